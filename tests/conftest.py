from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import forkserver
import pytest
from hypothesis import HealthCheck, settings
from tiers import TierGuard

from swarmavg.testing import VirtualClockLoop

pytest_plugins = ["pytester"]  # (tests/test_tiers.py runs pytest on cases of its own)

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.register_profile("thorough", max_examples=5000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config: pytest.Config) -> None:
    # the tiers (tests/tiers.py): markers from folders, a check that only `process` and `lab`
    # tests start interpreters, and the time budget printed and checked at the end
    config.pluginmanager.register(TierGuard(config), "swarmavg-tiers")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if forkserver.STARTS:  # (a real start's reason says why a fork would not do)
        starts = ", ".join(f"{count} {how}" for how, count in sorted(forkserver.STARTS.items()))
        terminalreporter.write_line(f"peer processes (tests/forkserver.py): {starts}")


def pytest_unconfigure(config: pytest.Config) -> None:
    # the peers' fork server (tests/forkserver.py), if a test started it, and its children
    forkserver.shutdown()


def _virtual_clock_loop() -> VirtualClockLoop:
    # (its clock also stands still while anyio.to_thread work runs, as under run_on_virtual_time)
    return VirtualClockLoop(watch_default_thread_limiter=True)


@pytest.fixture
def anyio_backend(request: pytest.FixtureRequest) -> str | tuple[str, dict[str, Any]]:
    """anyio tests run on virtual time (:class:`swarmavg.testing.VirtualClockLoop`): timeouts
    and sleeps cost no wall time, and a test sees the exact second a timeout fires
    (``anyio.current_time()``). Tests of the other tiers (real sockets, threads that wait on
    the wall clock, processes, the lab; tests/tiers.py) get asyncio's own loop."""
    if TierGuard.tier_of(request.node) != "deterministic":
        return "asyncio"
    return ("asyncio", {"loop_factory": _virtual_clock_loop})


def _load_benchmark(filename: str) -> ModuleType:
    """Import ``benchmarks/<filename>`` (not a package) as a module of its own."""
    path = Path(__file__).parents[1] / "benchmarks" / filename
    name = f"_benchmark_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def load_benchmark() -> Callable[[str], ModuleType]:
    """``load_benchmark("averaging_scale.py")``: a script of ``benchmarks/`` as a module."""
    return _load_benchmark


class _ErrorRecords(logging.Handler):
    """Keeps every record of level ERROR or above that reaches the root logger."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _describe(record: logging.LogRecord) -> str:
    text = f"{record.levelname} {record.name}: {record.getMessage()}"
    if record.exc_info and record.exc_info[1] is not None:
        exc = record.exc_info[1]
        text += f" [{type(exc).__module__}.{type(exc).__qualname__}: {exc}]"
    return text


@pytest.fixture(autouse=True)
def _fail_on_error_logs(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test (at teardown) that logged anything at ERROR or above, from any logger
    (swarmavg's, the transports', asyncio's "Task exception was never retrieved", ...): in
    swarmavg an ERROR log means a bug, so a test that makes one has found it. A test whose
    behaviour under test is an ERROR log says so with ``@pytest.mark.allow_error_log``."""
    handler = _ErrorRecords()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
    if handler.records and request.node.get_closest_marker("allow_error_log") is None:
        listed = "\n".join(f"  {_describe(r)}" for r in handler.records)
        pytest.fail(
            f"{len(handler.records)} unexpected ERROR log record(s) during the test "
            f"(mark it allow_error_log if that is the behaviour under test):\n{listed}",
            pytrace=False,
        )


@pytest.fixture
def fresh_loop() -> Iterator[None]:
    """The test starts without swarmavg's event-loop thread and leaves no thread behind (the
    loop's, an averager's background threads, ...). Directories of sync tests make it autouse."""
    import threading

    import swarmavg.sync

    swarmavg.sync.shutdown_loop(timeout=10)
    before = set(threading.enumerate())
    yield
    swarmavg.sync.shutdown_loop(timeout=10)
    leftover = [t for t in set(threading.enumerate()) - before if t.is_alive()]
    for thread in leftover:  # (one told to stop may still be on its way out: anyio's workers
        thread.join(timeout=2)  # end when their loop closes, a moment after anyio.run returns)
    leftover = [t for t in leftover if t.is_alive()]
    assert leftover == [], f"threads left behind: {leftover}"


@pytest.fixture
def usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[[list[str]], str]:
    """``usage_error(argv)``: ``swarmavg *argv`` run in this process, in ``tmp_path`` (a usage
    error exits before anything starts: no interpreter to wait for) must exit with code 2; its
    standard error."""
    from swarmavg.cli import main

    monkeypatch.chdir(tmp_path)

    def run(argv: list[str]) -> str:
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        return capsys.readouterr().err

    return run
