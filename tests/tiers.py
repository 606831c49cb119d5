"""The suite's tiers, and the time budget behind them (a pytest plugin; tests/conftest.py
registers it).

Every test is in one tier:

- **deterministic** (no marker): in-process, on virtual time or no time at all. Each call of
  one (its fixtures aside) takes at most :data:`TEST_LIMIT_S` seconds of CPU and waits at most
  as long beyond it, else it fails: make it cheaper, or mark it. ``@pytest.mark.slow``
  exempts a test that is deterministic but heavy (a 128-peer swarm), so that every exemption
  is written down.
- **realtime**: in-process, on the wall clock (real sockets, the sync facades' loop thread).
- **process**: starts interpreters (``subprocess``, ``multiprocessing``, or a child of the
  fork server, tests/forkserver.py).
- **lab**: the network lab (network namespaces, root).

A test gets its tier from a marker of its own (``pytestmark`` or a decorator), else from its
folder (:data:`FOLDER_TIERS`). A test not in ``process`` or ``lab`` that starts a Python
interpreter fails, so the tiers stay true and ``nox -s oldest``, which runs the in-process
tiers only (``-m "not process and not lab"``), leaves out exactly what it means to.

At the end of a run the plugin prints the seconds spent per tier; a run of the whole suite
(no paths, no ``-k``) fails if an in-process tier took longer than its :data:`BUDGET_S`.
Under a tracer (``coverage run``, a debugger), which makes every test several times slower,
the limit and the budget are reported but not enforced.
"""

from __future__ import annotations

import multiprocessing.process
import os
import re
import subprocess
import sys
import time
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import forkserver
import pytest

TIERS = ("deterministic", "realtime", "process", "lab")
#: the tier of a test without a tier marker of its own, by its folder under tests/
FOLDER_TIERS = {
    "netlab": "lab",
    "e2e": "realtime",  # (its tests that start interpreters are marked `process`)
    "sync": "realtime",
    "optim": "realtime",
    "transports": "realtime",
    "gpu": "realtime",
}
#: seconds (setup, call and teardown, summed over the tier's tests) that a run of the whole
#: suite may spend in each in-process tier on the CI machine (2 cores) before it fails
BUDGET_S = {"deterministic": 160.0, "realtime": 300.0}  # (~2x what they took, 2026-12-07)
#: seconds of CPU, and seconds of waiting beyond it, one deterministic test may take
TEST_LIMIT_S = 2.0

_INTERPRETER = re.compile(r"^(python[0-9.]*|swarmavg|pytest|nox)$")


def _is_interpreter(argv: Iterable[Any]) -> bool:
    for arg in list(argv)[:6]:  # (also behind `ip netns exec NAME`, `timeout N`, ...)
        text = os.fspath(arg) if isinstance(arg, str | os.PathLike) else ""
        if text == sys.executable or _INTERPRETER.match(Path(text).name):
            return True
    return False


@dataclass
class _Running:
    """The test that runs now."""

    nodeid: str
    tier: str
    #: wall-clock second its protocol began (setup)
    started: float = field(default_factory=time.perf_counter)
    #: wall-clock and process-CPU seconds its call began
    call: tuple[float, float] = (0.0, 0.0)
    #: the first interpreter it started (its command)
    spawned: str | None = None


@dataclass(eq=False)  # (pluggy keeps plugins in sets)
class TierGuard:
    """The plugin (one per pytest run)."""

    config: pytest.Config
    #: seconds of CPU (and of waiting beyond it) a deterministic test's call may take
    limit_s: float = TEST_LIMIT_S
    #: seconds per in-process tier a run of the whole suite may take
    budget_s: dict[str, float] = field(default_factory=lambda: dict(BUDGET_S))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIERS, 0.0))
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    problems: list[str] = field(default_factory=list)
    #: deterministic tests (not `slow`) whose call took over half the limit: (CPU s, node id)
    near: list[tuple[float, str]] = field(default_factory=list)
    #: a tracer (coverage, a debugger) runs every test several times slower: the limit and
    #: the budget are then reported, not enforced
    traced: bool = field(default_factory=lambda: sys.gettrace() is not None)
    _running: _Running | None = None
    _patches: pytest.MonkeyPatch = field(default_factory=pytest.MonkeyPatch)

    # -- tiers ---------------------------------------------------------------------------

    @staticmethod
    def tier_of(item: pytest.Item) -> str:
        own = [m.name for m in item.iter_markers() if m.name in TIERS[1:]]
        if len(set(own)) > 1:
            raise pytest.UsageError(f"{item.nodeid}: more than one tier marker: {own}")
        if own:
            return own[0]
        parts = Path(item.path).parts
        if "tests" in parts:
            below = parts[parts.index("tests") + 1 :]
            if len(below) > 1 and below[0] in FOLDER_TIERS:
                return FOLDER_TIERS[below[0]]
        return "deterministic"

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        # (before `-m` deselects: a folder's tier is a marker like any other)
        for item in items:
            tier = self.tier_of(item)
            item.stash[_TIER] = tier
            if tier != "deterministic" and item.get_closest_marker(tier) is None:
                item.add_marker(tier)

    # -- interpreters started --------------------------------------------------------------

    def pytest_sessionstart(self) -> None:
        popen_init = subprocess.Popen.__init__
        process_start = multiprocessing.process.BaseProcess.start

        def init(popen: Any, args: Any, *rest: Any, **kwargs: Any) -> None:
            argv = [args] if isinstance(args, str | bytes | os.PathLike) else args
            if kwargs.get("shell") and isinstance(args, str):
                argv = args.split()
            if _is_interpreter(argv):
                self._note_spawn(" ".join(map(str, list(argv)[:3]))[:100])
            popen_init(popen, args, *rest, **kwargs)

        def start(process: Any) -> None:
            self._note_spawn(f"multiprocessing {type(process).__name__}")
            process_start(process)

        self._patches.setattr(subprocess.Popen, "__init__", init)
        self._patches.setattr(multiprocessing.process.BaseProcess, "start", start)
        # a peer forked by the fork server is an interpreter started too
        hooks = [*forkserver.START_HOOKS, self._note_spawn]
        self._patches.setattr(forkserver, "START_HOOKS", hooks)

    def _note_spawn(self, what: str) -> None:
        if self._running is not None and self._running.spawned is None:
            self._running.spawned = what

    # -- time ------------------------------------------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, object, object]:
        self._running = running = _Running(item.nodeid, item.stash.get(_TIER, "deterministic"))
        try:
            return (yield)
        finally:
            self._running = None
            self.seconds[running.tier] += time.perf_counter() - running.started
            self.counts[running.tier] += 1

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        if self._running is not None:  # (the limit is on the test's own run: shared fixtures
            self._running.call = (time.perf_counter(), time.process_time())  # are set up once)
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        running = self._running
        if running is None or report.when != "call":
            return report
        wall = time.perf_counter() - running.call[0]
        cpu = time.process_time() - running.call[1]
        exempt = running.tier != "deterministic" or item.get_closest_marker("slow") is not None
        if not exempt and max(cpu, wall - cpu) > self.limit_s / 2:
            self.near.append((max(cpu, wall - cpu), item.nodeid))
        complaint = None
        if running.spawned is not None and running.tier not in ("process", "lab"):
            complaint = (
                f"it started an interpreter ({running.spawned}) but is in the {running.tier} "
                "tier: mark it `@pytest.mark.process` (tests/tiers.py)"
            )
        elif not exempt and not self.traced and (cpu > self.limit_s or wall - cpu > self.limit_s):
            complaint = (
                f"an unmarked (deterministic) test may take {self.limit_s:g} s of CPU and wait "
                f"{self.limit_s:g} s beyond it; this one took {cpu:.2f} s of CPU in "
                f"{wall:.2f} s: make it cheaper, move it to virtual time, or mark its tier "
                "(realtime, process, lab) or `slow` (tests/tiers.py)"
            )
        if complaint is not None and report.passed:
            report.outcome = "failed"
            report.longrepr = f"{item.nodeid}: {complaint}"
        return report

    # -- the budget --------------------------------------------------------------------------

    def _whole_suite(self) -> bool:
        option = self.config.option
        return not option.file_or_dir and not option.keyword

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self._patches.undo()
        if not self._whole_suite() or self.traced:
            return
        for tier, budget in self.budget_s.items():
            if self.seconds[tier] > budget:
                self.problems.append(
                    f"the {tier} tier took {self.seconds[tier]:.0f} s, over its budget of "
                    f"{budget:.0f} s (tests/tiers.py BUDGET_S)"
                )
        if self.problems and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        write = terminalreporter.write_line
        terminalreporter.section("time per tier (tests/tiers.py)")
        for tier in TIERS:
            budget = self.budget_s.get(tier)
            limit = f"  (budget {budget:.0f} s)" if budget is not None else ""
            write(f"{tier:14s} {self.counts[tier]:5d} tests {self.seconds[tier]:8.1f} s{limit}")
        total = sum(self.seconds.values())
        write(f"{'all':14s} {sum(self.counts.values()):5d} tests {total:8.1f} s")
        if self.near:
            write(f"deterministic tests nearest the {self.limit_s:g} s limit (CPU or waiting):")
            for seconds, nodeid in sorted(self.near, reverse=True)[:8]:
                write(f"  {seconds:5.2f} s  {nodeid}")
        for problem in self.problems:
            terminalreporter.write_line(f"BUDGET EXCEEDED: {problem}", red=True, bold=True)


_TIER = pytest.StashKey[str]()
