"""``AllReduceService.run``'s keywords from a test's options: the ``RoundConfig`` fields among
them (``part_size``, ``timeout``, ...) go into one ``config=RoundConfig(...)``, the rest
(``weight``, ``compression``, ...) stay as they are."""

from __future__ import annotations

import dataclasses
from typing import Any

from swarmavg.abc import RoundConfig

_FIELDS = frozenset(f.name for f in dataclasses.fields(RoundConfig))


def run_options(options: dict[str, Any]) -> dict[str, Any]:
    config = {k: v for k, v in options.items() if k in _FIELDS}
    rest = {k: v for k, v in options.items() if k not in _FIELDS}
    return {"config": RoundConfig(**config), **rest}
