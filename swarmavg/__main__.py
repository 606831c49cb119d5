"""``python -m swarmavg``: the ``swarmavg`` command (see :mod:`swarmavg.cli`)."""

import sys

from swarmavg.cli import main

if __name__ == "__main__":  # (not on an import: tools that import every module import this)
    sys.exit(main())
