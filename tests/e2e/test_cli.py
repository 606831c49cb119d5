from __future__ import annotations

import re
import subprocess
import sys


def test_demo_runs_and_reports() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "swarmavg.cli", "demo", "--megabytes", "16"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "alice -> bob: 'got 11 bytes'" in out.stdout
    assert re.search(r"bulk: 16 MiB in [0-9.]+ s = [0-9.]+ GiB/s", out.stdout), out.stdout
    assert out.stderr == ""


def test_demo_rejects_bad_arguments() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "swarmavg.cli", "demo", "--megabytes", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--megabytes" in out.stderr
