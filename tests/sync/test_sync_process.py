"""Process lifecycle in real processes: Ctrl+C, interpreter exit, fork."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from swarmavg.sync import THREAD_NAME, TaskHandle, run_sync, shutdown_loop, start_soon

pytestmark = [pytest.mark.process, pytest.mark.timeout(20)]

WAIT = 10.0


def _spawn_script(tmp_path: Path, body: str, *args: str) -> subprocess.Popen[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _wait_for_line(proc: subprocess.Popen[str], expected: str) -> None:
    """Read stdout until ``expected`` (bounded by the test timeout)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == expected:
            return
    _, err = proc.communicate(timeout=WAIT)
    pytest.fail(f"the script ended before printing {expected!r}; stderr:\n{err}")


BLOCKED_ON_CTRL_C = """
    import sys
    import anyio
    import swarmavg.sync as sync

    async def forever():
        print("ready", flush=True)
        try:
            await anyio.sleep_forever()
        finally:
            print("task cancelled", flush=True)

    if sys.argv[1] == "run_sync":
        sync.run_sync(forever)
    else:
        sync.start_soon(forever).result()
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("how", ["run_sync", "handle.result"])
def test_ctrl_c_wakes_the_blocked_main_thread_and_the_process_exits(
    tmp_path: Path, how: str
) -> None:
    proc = _spawn_script(tmp_path, BLOCKED_ON_CTRL_C, how)
    try:
        _wait_for_line(proc, "ready")
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=WAIT)
    finally:
        proc.kill()
        proc.wait()
    assert time.monotonic() - sent < 5
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in err
    # run_sync cancels at once; a handle's task is cancelled by the exit hook. Either way the
    # coroutine's cleanup ran before the process ended.
    assert "task cancelled" in out


EXIT_WITH_PENDING_TASK = """
    import atexit
    import threading
    import anyio
    import swarmavg.sync as sync

    async def forever():
        try:
            await anyio.sleep_forever()
        finally:
            print("task cancelled", flush=True)

    async def hello():
        return "facade hook ran"

    # Registered before the loop started, so it runs after the loop's own exit hook.
    def too_late():
        try:
            sync.run_sync(hello)
        except RuntimeError as exc:
            print("refused:", exc, flush=True)

    atexit.register(too_late)
    sync.start_soon(forever)
    # A hook registered after the loop started runs before the loop's own hook: a facade's
    # cleanup at exit can still use the loop.
    atexit.register(lambda: print(sync.run_sync(hello), flush=True))
    print("exiting", [t.name for t in threading.enumerate()], flush=True)
"""


def test_interpreter_exit_cancels_tasks_and_stops_the_loop(tmp_path: Path) -> None:
    proc = _spawn_script(tmp_path, EXIT_WITH_PENDING_TASK)
    try:
        out, err = proc.communicate(timeout=WAIT)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err
    assert THREAD_NAME in out
    lines = out.splitlines()
    assert lines[-3:-1] == ["facade hook ran", "task cancelled"]
    assert lines[-1].startswith("refused: ")
    assert "interpreter exit" in lines[-1]
    assert err == ""


def _child(conn: multiprocessing.connection.Connection, pending: TaskHandle[None]) -> None:
    report: dict[str, Any] = {}
    try:
        report["pid"], report["thread"] = run_sync(_whoami)
        for action in ("result", "cancel"):
            try:
                getattr(pending, action)(1) if action == "result" else pending.cancel()
            except RuntimeError as exc:
                report[action] = str(exc)
            else:
                report[action] = "no error"
        shutdown_loop(timeout=WAIT)
        report["threads"] = [t.name for t in threading.enumerate()]
    except BaseException as exc:
        report["error"] = repr(exc)
    conn.send(report)
    conn.close()


async def _whoami() -> tuple[int, int]:
    await anyio.lowlevel.checkpoint()
    return os.getpid(), threading.get_ident()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
# Python ≥ 3.12 warns about forking a process that has threads; that is the point of this test.
@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_forked_child_gets_a_fresh_loop_and_parent_handles_fail_clearly() -> None:
    parent_pid, parent_loop = run_sync(_whoami)
    parked = threading.Event()

    async def park() -> None:
        parked.set()
        await anyio.sleep_forever()

    pending = start_soon(park)
    assert parked.wait(WAIT)

    ctx = multiprocessing.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(sender, pending))
    child.start()
    sender.close()
    try:
        assert receiver.poll(WAIT), "the child hung"
        report = receiver.recv()
        child.join(WAIT)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0
    assert "error" not in report, report["error"]
    assert report["pid"] == child.pid != parent_pid
    assert "forked" in report["result"]
    assert "forked" in report["cancel"]
    assert THREAD_NAME not in report["threads"]

    # the parent's loop and handle are untouched
    assert run_sync(_whoami) == (parent_pid, parent_loop)
    assert not pending.done()
    assert pending.cancel()
