"""Helpers shared by ``benchmarks/averaging.py`` and its reference sides (standard library only,
so that ``_averaging_hivemind.py`` can import it under hivemind's Python too).

- :func:`machine_busy_seconds`: machine-wide busy CPU seconds so far, from ``/proc/stat``
  (user + nice + system + irq + softirq + steal, all CPUs).
- :func:`tree_cpu_seconds`: user + system CPU seconds of the live descendants of a process (all
  their threads), from ``/proc/<pid>/stat``; a process that exits between two readings drops out
  of the second, so take both readings while the processes of interest run.
- :func:`stats`: median, min, max and mean of a list of samples.
- :func:`hivemind_sockets`, :func:`remove_stale_sockets`: hivemind's p2pd control sockets in
  /tmp, and removing those left behind (no live socket bound to them).
"""

from __future__ import annotations

import contextlib
import os
import statistics
from pathlib import Path
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_busy_seconds() -> float | None:
    """Busy CPU seconds of the whole machine since boot (``None`` where there is no /proc)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6]
    if len(fields) > 7:
        busy += fields[7]
    return busy / _TICK


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system seconds) of ``pid``, or ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
    rest = text[text.rindex(")") + 2 :].split()
    try:
        return int(rest[1]), (int(rest[11]) + int(rest[12])) / _TICK
    except (IndexError, ValueError):
        return None


def tree_cpu_seconds(root: int, include_root: bool = False) -> float | None:
    """CPU seconds used so far by the live descendants of ``root`` (and ``root`` itself if
    ``include_root``); ``None`` where there is no /proc."""
    if not os.path.isdir("/proc"):
        return None
    info: dict[int, tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            got = _stat(int(name))
            if got is not None:
                info[int(name)] = got
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in info.items():
        children.setdefault(ppid, []).append(pid)
    total = info[root][1] if include_root and root in info else 0.0
    todo = list(children.get(root, []))
    seen: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += info[pid][1]
        todo.extend(children.get(pid, []))
    return total


def stats(samples: list[float]) -> dict[str, Any]:
    """Median, min, max and mean of ``samples`` (``{"n": 0}`` for none)."""
    xs = sorted(float(x) for x in samples)
    if not xs:
        return {"n": 0}
    return {
        "n": len(xs),
        "median": statistics.median(xs),
        "min": xs[0],
        "max": xs[-1],
        "mean": statistics.fmean(xs),
    }


def hivemind_sockets() -> set[Path]:
    """hivemind's p2pd control sockets (``/tmp/hivemind-p2p*.sock``)."""
    return set(Path("/tmp").glob("hivemind-p2p*.sock"))


def remove_stale_sockets(before: set[Path]) -> None:
    """Removes the hivemind sockets made since ``before`` that no live socket is bound to:
    hivemind leaves its p2p clients' sockets behind even when it shuts down cleanly."""
    try:
        bound = {line.split()[-1] for line in Path("/proc/net/unix").read_text().splitlines()[1:]}
    except (OSError, IndexError):
        return  # cannot tell which are in use: leave them
    for path in hivemind_sockets() - before:
        if str(path) not in bound:
            with contextlib.suppress(OSError):
                path.unlink()
