"""The tests' fork server (tests/forkserver.py): a child behaves as ``python script.py`` would
(argv, ``__main__``, ``sys.path``, environment, working folder, files, exit codes, signals,
seeds, thread counts, no inherited descriptors); a start a fork would get wrong is a real
one; the server's end, or its death, leaves no child running and no handle waiting."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import forkserver
import psutil
import pytest

pytestmark = [
    pytest.mark.process,
    pytest.mark.timeout(120),
    pytest.mark.skipif(forkserver._unavailable() is not None, reason="no fork server here"),
]

REPORT = """
import json, os, random, signal, sys, threading
import numpy, torch
print(json.dumps({
    "argv": sys.argv, "orig_argv": sys.orig_argv, "name": __name__, "file": __file__,
    "path0": sys.path[0], "cwd": os.getcwd(), "x": os.environ.get("X"),
    "pythonpath": os.environ.get("PYTHONPATH"), "fds": sorted(os.listdir("/proc/self/fd")),
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "seeds": [random.random(), float(numpy.random.rand()), float(torch.rand(1))],
    "torch_threads": torch.get_num_threads(), "threads": threading.active_count(),
    "pid": os.getpid(), "sid": os.getsid(0), "stdout_file": os.readlink("/proc/self/fd/1"),
}))
"""


def _script(tmp_path: Path, body: str, name: str = "script.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _report(args: list[str], **kwargs: Any) -> dict[str, Any]:
    done = forkserver.run(args, capture_output=True, text=True, timeout=60, **kwargs)
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def _forked(args: list[str], **kwargs: Any) -> forkserver.ForkedProcess:
    proc = forkserver.popen(args, **kwargs)
    assert isinstance(proc, forkserver.ForkedProcess), forkserver.STARTS
    return proc


def test_a_script_sees_what_python_script_py_would(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    script = _script(tmp_path / "sub", REPORT)
    env = {**os.environ, "X": "42", "OMP_NUM_THREADS": "1"}
    report = _report([sys.executable, str(script), "a", "b c"], cwd=tmp_path, env=env)
    assert report["argv"] == [str(script), "a", "b c"]
    assert report["orig_argv"] == [sys.executable, str(script), "a", "b c"]
    assert report["name"] == "__main__"
    assert report["file"] == str(script)
    assert report["path0"] == str(script.parent)
    assert report["cwd"] == str(tmp_path)
    assert report["x"] == "42"
    assert report["fds"] in (["0", "1", "2"], ["0", "1", "2", "3"])  # (3: listdir's own)
    assert report["sigint"] is True
    assert report["torch_threads"] == 1
    assert report["threads"] == 1
    assert report["sid"] != report["pid"]
    # a relative script is found from the child's working folder
    relative = _report([sys.executable, os.path.relpath(script, tmp_path)], cwd=tmp_path)
    assert relative["file"] == str(script)
    assert relative["argv"] == [os.path.relpath(script, tmp_path)]


def test_a_module_runs_as_with_dash_m(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    _script(package, REPORT, "report.py")
    report = _report([sys.executable, "-m", "pkg.report", "x"], cwd=tmp_path)
    assert report["argv"] == [str(package / "report.py"), "x"]
    assert report["name"] == "__main__"
    assert report["path0"] == str(tmp_path)


def test_each_child_gets_fresh_seeds(tmp_path: Path) -> None:
    script = _script(tmp_path, REPORT)
    first, second = (_report([sys.executable, str(script)]) for _ in range(2))
    assert all(a != b for a, b in zip(first["seeds"], second["seeds"], strict=True))


def test_exit_codes_and_tracebacks(tmp_path: Path) -> None:
    codes = {
        "import sys; sys.exit(3)": 3,
        "raise SystemExit('bye')": 1,
        "raise ValueError('boom')": 1,
        "pass": 0,
    }
    for body, code in codes.items():
        done = forkserver.run(
            [sys.executable, str(_script(tmp_path, body))], capture_output=True, text=True
        )
        assert done.returncode == code, (body, done.stderr)
    error = forkserver.run(
        [sys.executable, str(_script(tmp_path, "raise ValueError('boom')"))],
        capture_output=True,
        text=True,
    )
    assert error.stderr.startswith("Traceback (most recent call last):")
    assert error.stderr.rstrip().endswith("ValueError: boom")


def test_sigkill_and_sigint_reach_the_child(tmp_path: Path) -> None:
    waiting = _script(
        tmp_path,
        """
        import sys, time
        try:
            print("ready", flush=True)
            time.sleep(60)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(130)
        """,
    )
    for sig, code in ((signal.SIGKILL, -9), (signal.SIGINT, 130), (signal.SIGTERM, -15)):
        proc = _forked([sys.executable, str(waiting)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        assert proc.poll() is None
        proc.send_signal(sig)
        assert proc.wait(30) == code
        assert proc.returncode == code
        proc.send_signal(signal.SIGKILL)  # (gone: nothing happens)
        proc.stdout.close()
    # an unhandled KeyboardInterrupt ends the interpreter by SIGINT, as a fresh one does
    bare = _script(tmp_path, "import time; print('ready', flush=True); time.sleep(60)")
    proc = _forked([sys.executable, str(bare)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGINT
    assert err.rstrip().endswith(b"KeyboardInterrupt")


def test_wait_times_out_and_pipes_carry_lines(tmp_path: Path) -> None:
    echo = _script(
        tmp_path,
        """
        import sys
        for line in sys.stdin:
            print(line.strip().upper(), flush=True)
        """,
    )
    with _forked(
        [sys.executable, str(echo)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdin is not None
        assert proc.stdout is not None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.2)
        proc.stdin.write("hello\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "HELLO\n"
        out, _ = proc.communicate("bye\n", timeout=30)
        assert out == "BYE\n"
    assert proc.returncode == 0


def test_output_to_a_file_and_a_new_session(tmp_path: Path) -> None:
    script = _script(tmp_path, REPORT + "print('to stderr', file=sys.stderr)\n")
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        proc = _forked(
            [sys.executable, str(script)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert os.getsid(proc.pid) == proc.pid  # (at once, as after Popen: killpg reaches it)
    assert proc.wait(60) == 0
    first, second = log.read_text().splitlines()
    report = json.loads(first)
    assert report["sid"] == report["pid"] == proc.pid
    assert report["stdout_file"] == str(log)
    assert second == "to stderr"


def test_starts_a_fork_would_get_wrong_are_real(tmp_path: Path) -> None:
    script = _script(tmp_path, "pass")
    real = {
        "PYTHONHASHSEED": {**os.environ, "PYTHONHASHSEED": "7"},
        "a shadowed module": {**os.environ, "PYTHONPATH": str(tmp_path)},
    }
    (tmp_path / "numpy.py").write_text("")
    for why, env in real.items():
        proc = forkserver.popen([sys.executable, str(script)], env=env)
        assert isinstance(proc, subprocess.Popen), why
        assert proc.wait(60) == 0
    options = forkserver.popen([sys.executable, "-I", str(script)])
    assert isinstance(options, subprocess.Popen)
    assert options.wait(60) == 0


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_until(check: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_servers_end_leaves_no_process_behind(tmp_path: Path) -> None:
    sleeper = _script(tmp_path, "import time; time.sleep(120)")
    server = forkserver.ForkServer()
    try:
        procs = [
            server.popen([sys.executable, str(sleeper)], start_new_session=session)
            for session in (False, True)
        ]
    finally:
        server.close()
    assert server.proc.returncode == 0
    for proc in procs:
        assert isinstance(proc, forkserver.ForkedProcess)
        assert proc.wait(10) == -signal.SIGKILL
        assert _gone(proc.pid)
    assert not os.path.exists(server.log_path)


def test_a_dead_server_fails_the_handles_without_a_hang(tmp_path: Path) -> None:
    sleeper = _script(tmp_path, "import time; time.sleep(120)")
    server = forkserver.ForkServer()
    try:
        proc = server.popen([sys.executable, str(sleeper)])
        assert isinstance(proc, forkserver.ForkedProcess)
        server.proc.kill()
        server.proc.wait(10)
        with pytest.raises(forkserver.ForkServerError, match="died"):
            proc.wait(10)
        with pytest.raises(forkserver.ForkServerError, match="died"):
            proc.poll()
        proc.kill()  # (through its pidfd: the orphan still gets it)
        assert _wait_until(lambda: _gone(proc.pid))
        assert not server.alive()
        with pytest.raises(forkserver.ForkServerError):
            server.popen([sys.executable, str(sleeper)])
    finally:
        server.close()
