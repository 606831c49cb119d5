"""The child processes of ``swarmavg demo`` and ``swarmavg demo averaging``.

Each child is ``python -m MODULE CONFIG_JSON``: it reads JSON-line commands on its stdin and
writes JSON-line events on its stdout, which a thread per child reads; its stderr goes to a
log file in the demo's working directory. Children run in their own session, so Ctrl+C in a
terminal reaches the demo only, which stops them itself (:func:`interrupts_held` keeps a
Ctrl+C from landing while children are being spawned or killed, so none is left behind).
Stopping and closing are bounded: :data:`STOP_TIMEOUT` for the children to stop when asked,
then :data:`KILL_TIMEOUT` after each signal.
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["KILL_TIMEOUT", "LOG_TAIL", "STOP_TIMEOUT", "ChildProcesses", "interrupts_held"]

#: Seconds the children get to stop when asked, all together.
STOP_TIMEOUT = 30.0
#: Seconds a child gets to end after SIGTERM, and again after SIGKILL.
KILL_TIMEOUT = 5.0
#: Lines of a child's stderr shown when it fails.
LOG_TAIL = 20


class ChildProcesses(abc.ABC):
    """Children running ``python -m module``; a subclass says what to do with their lines
    (:meth:`_deliver`, called from the reader threads).

    :param workdir: where the children's stderr logs go (``{log_prefix}-{index}.log``).
    :param module: the module each child runs.
    :param log_prefix: the logs' name prefix.
    """

    def __init__(self, workdir: Path, module: str, log_prefix: str) -> None:
        self.workdir = workdir
        self.module = module
        self.log_prefix = log_prefix
        self.processes: list[subprocess.Popen[str]] = []
        self.logs: list[Path] = []
        self._log_files: list[IO[bytes]] = []
        self._threads: list[threading.Thread] = []

    def spawn(self, config: dict[str, Any]) -> int:
        """Start one more child with ``config``; its index."""
        index = len(self.processes)
        log = self.workdir / f"{self.log_prefix}-{index}.log"
        log_file = open(log, "wb")  # noqa: SIM115 (closed in close())
        self.logs.append(log)
        self._log_files.append(log_file)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        process = subprocess.Popen(  # noqa: S603 (this interpreter, our own module)
            [sys.executable, "-m", self.module, json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
            env=env,
            # Ctrl+C in a terminal reaches the demo process only; it stops the children itself
            start_new_session=True,
        )
        self.processes.append(process)
        self._spawned(index)
        thread = threading.Thread(target=self._read, args=(index, process), daemon=True)
        thread.start()
        self._threads.append(thread)
        return index

    def _spawned(self, index: int) -> None:
        """A child was just started (before its reader thread): a subclass's bookkeeping."""
        return  # (an optional hook)

    @abc.abstractmethod
    def _deliver(self, index: int, line: str | None) -> None:
        """A line the child ``index`` wrote, or ``None`` when its stdout ended (reader
        thread)."""

    def _read(self, index: int, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        try:
            for line in process.stdout:
                self._deliver(index, line)
        except (OSError, ValueError):  # closed under us
            pass
        finally:
            self._deliver(index, None)

    def kill(self, index: int) -> None:
        """SIGKILL child ``index`` (if it is still there)."""
        with contextlib.suppress(OSError):
            self.processes[index].send_signal(signal.SIGKILL)

    def log_tail(self, index: int) -> list[str]:
        """The last :data:`LOG_TAIL` lines of child ``index``'s stderr."""
        self._log_files[index].flush()
        return self.logs[index].read_text(errors="replace").splitlines()[-LOG_TAIL:]

    def stop(self) -> list[tuple[int, int]]:
        """Ask every child to stop (a ``stop`` command, then the end of its stdin) and wait
        for them, :data:`STOP_TIMEOUT` seconds in all; those that ended badly, as
        ``(index, exit status)`` (one killed on purpose included). Those that do not stop in
        time are killed."""
        for process in self.processes:
            if process.stdin is not None:
                with contextlib.suppress(OSError, ValueError):  # gone: its status says how
                    process.stdin.write(json.dumps({"cmd": "stop"}) + "\n")
                    process.stdin.close()
        deadline = time.monotonic() + STOP_TIMEOUT
        failed = []
        for index, process in enumerate(self.processes):
            try:
                code = process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                code = process.wait(KILL_TIMEOUT)
            if code != 0:
                failed.append((index, code))
        return failed

    def close(self) -> None:
        """Terminate the children still running, wait for them, close the pipes and logs.
        Bounded: it gives up on a child that survives SIGKILL for :data:`KILL_TIMEOUT`."""
        running = [p for p in self.processes if p.poll() is None]
        for process in running:
            with contextlib.suppress(OSError):
                process.terminate()
        deadline = time.monotonic() + KILL_TIMEOUT
        for process in running:
            try:
                process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(KILL_TIMEOUT)
        for thread in self._threads:  # the pipes are at their end now that they are gone
            thread.join(1.0)
        for process in self.processes:
            for stream in (process.stdin, process.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        for log_file in self._log_files:
            log_file.close()


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold Ctrl+C back while children are spawned or killed, so that none is left behind;
    raise it (``KeyboardInterrupt``) once that is done."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt
