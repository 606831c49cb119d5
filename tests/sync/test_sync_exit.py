"""A program that uses swarmavg exits cleanly: a child interpreter (this one's Python, so each
declared version runs it: ``nox -s tests`` on 3.11, ``nox -s pythons`` selects these tests
beside the in-process tiers on the others) runs a short program and must end with exit code 0,
an empty stderr, in time, and with no thread but the main one left when its last ``atexit``
hook runs.

Python 3.12 refuses to start a thread once the interpreter finalizes, from before the ``atexit``
hooks run; the loop thread stops in such a hook (docs/design/sync-runtime.md#interpreter-exit).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.process, pytest.mark.interpreter_exit, pytest.mark.timeout(60)]

#: seconds a program may take from its last line to its exit (the exit hooks wait at most 5 s
#: for the loop's tasks and 1 s for its worker threads)
EXIT_S = 15.0

#: registered before swarmavg is imported, so it runs after swarmavg's own exit hooks (atexit
#: runs the last registered first): what is left then stays behind
PRELUDE = """
import atexit, threading

def _left_behind():
    print("left at exit:", sorted(t.name for t in threading.enumerate()), flush=True)

atexit.register(_left_behind)
"""

PROGRAMS = {
    # the loop's default executor in use (asyncio joined it from a new thread as the loop
    # closed: Python 3.12 refused, at exit)
    "executor_used": """
        import asyncio
        import swarmavg.sync

        async def resolve():
            loop = asyncio.get_running_loop()
            await loop.getaddrinfo("localhost", 80)
            await loop.run_in_executor(None, sum, [1, 2])

        swarmavg.sync.run_sync(resolve)
    """,
    # the program: a DHT started and shut down
    "dht_shut_down": """
        import swarmavg
        d = swarmavg.DHT(host="127.0.0.1", start=True)
        d.shutdown()
    """,
    # the user forgot shutdown(): the facades' exit hook and the loop's do it
    "dht_forgotten": """
        import swarmavg
        d = swarmavg.DHT(host="127.0.0.1", start=True)
        d.get_visible_maddrs()
    """,
    # two peers: DHTs, averagers that average once, optimizers; half shut down, half not
    "several_facades": """
        import sys
        import torch
        import swarmavg

        first = swarmavg.DHT(host="127.0.0.1", start=True)
        dhts = [first, swarmavg.DHT(
            host="127.0.0.1", start=True, initial_peers=first.get_visible_maddrs()
        )]
        averagers = [
            swarmavg.DecentralizedAverager(
                [torch.full((4,), float(i))], dht, prefix="exit", target_group_size=2,
                min_matchmaking_time=1.0, start=True,
            )
            for i, dht in enumerate(dhts)
        ]
        optimizers = [
            swarmavg.Optimizer(
                dht=dht, run_id="exit", target_batch_size=8, batch_size_per_step=4,
                params=torch.nn.Linear(3, 1).parameters(),
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                matchmaking_time=1.0, averaging_timeout=5.0,
            )
            for dht in dhts
        ]
        handles = [averager.step(wait=False, timeout=20) for averager in averagers]
        print("group sizes", [handle.result().group_size for handle in handles], flush=True)
        optimizers[0].shutdown()
        averagers[0].shutdown()
        dhts[0].shutdown()
    """,
    # facades with threads of their own (an optimizer's, a metrics server's), none shut down:
    # at exit they are shut down newest first, before the loop stops
    "threads_forgotten": """
        import torch
        import swarmavg
        from swarmavg.optim import DecentralizedSGD

        dht = swarmavg.DHT(host="127.0.0.1", start=True)
        model = torch.nn.Linear(3, 1)
        opt = DecentralizedSGD(model.parameters(), 0.1, dht=dht, prefix="sgd", target_group_size=2)
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        averager = swarmavg.DecentralizedAverager(
            [torch.zeros(2)], dht, prefix="metrics", target_group_size=2, start=True,
            metrics_port=0,
        )
    """,
}

EXPECTED_OUT = {"several_facades": ["group sizes [2, 2]"]}


def _start(tmp_path: Path, body: str, *args: str) -> subprocess.Popen[str]:
    script = tmp_path / "program.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _finish(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the program did not exit within {timeout} s\nstdout:\n{out}\nstderr:\n{err}")


def _assert_clean(proc: subprocess.Popen[str], out: str, err: str) -> list[str]:
    assert err == ""
    assert proc.returncode == 0, out
    lines = out.splitlines()
    assert lines[-1] == "left at exit: ['MainThread']", out
    return lines[:-1]


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_program_exits_cleanly(tmp_path: Path, name: str) -> None:
    proc = _start(tmp_path, PROGRAMS[name])
    out, err = _finish(proc, timeout=45)
    assert _assert_clean(proc, out, err) == EXPECTED_OUT.get(name, [])


CTRL_C = """
    import sys
    import time
    import torch
    import swarmavg

    dht = swarmavg.DHT(host="127.0.0.1", start=True)
    averager = swarmavg.DecentralizedAverager(
        [torch.zeros(4)], dht, prefix="alone", target_group_size=2, start=True
    )
    handle = averager.step(wait=False, timeout=60)  # nobody else: it waits in matchmaking

    def block():
        if sys.argv[1] == "sleep":
            time.sleep(60)
        else:
            handle.result()

    if sys.argv[1] == "uncaught":
        print("ready", flush=True)
        block()
    try:
        print("ready", flush=True)
        block()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
"""


def _interrupt(tmp_path: Path, blocked_in: str) -> tuple[subprocess.Popen[str], str, str]:
    proc = _start(tmp_path, CTRL_C, blocked_in)
    assert proc.stdout is not None
    ready = proc.stdout.readline()
    if ready.strip() != "ready":
        out, err = _finish(proc, timeout=EXIT_S)
        pytest.fail(f"the program ended before it was ready:\n{ready}{out}\nstderr:\n{err}")
    proc.send_signal(signal.SIGINT)
    return proc, *_finish(proc, timeout=EXIT_S)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("blocked_in", ["step", "sleep"])  # (in a handle's wait, in user code)
def test_ctrl_c_then_exit_is_clean(tmp_path: Path, blocked_in: str) -> None:
    proc, out, err = _interrupt(tmp_path, blocked_in)
    assert _assert_clean(proc, out, err) == ["interrupted"]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_an_uncaught_ctrl_c_shows_only_its_own_traceback(tmp_path: Path) -> None:
    """Python prints the KeyboardInterrupt's traceback and ends by SIGINT; swarmavg adds
    nothing to it and leaves no thread."""
    proc, out, err = _interrupt(tmp_path, "uncaught")
    assert proc.returncode == -signal.SIGINT, err
    assert err.count("Traceback") == 1, err
    assert err.rstrip().splitlines()[-1] == "KeyboardInterrupt", err
    assert out.splitlines() == ["left at exit: ['MainThread']"]
