"""A peer process of the end-to-end tests that speaks JSON lines: its events on stdout (one
object per line, read by a thread into a queue), commands on stdin, stderr in a log file; a
child of the tests' fork server (tests/forkserver.py)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import forkserver


class JsonLinesPeer:
    """``argv`` run as peer ``index``, its stderr in ``log_dir/peer{index}.log``.

    An ``error`` event, or the end of its output, fails :meth:`wait_for` with the log's tail.
    """

    def __init__(self, index: int, log_dir: Path, argv: Sequence[str]) -> None:
        self.index = index
        self.log_path = log_dir / f"peer{index}.log"
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        with self.log_path.open("w") as log:
            self.proc = forkserver.popen(
                list(argv),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))
        self.events.put({"event": "eof"})

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float) -> Any:
        """The first event (others dropped) for which ``predicate`` holds, within ``timeout``
        seconds."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"peer {self.index}: no such event within {timeout} s"
            try:
                event = self.events.get(timeout=remaining)
            except queue.Empty:
                continue
            if event["event"] in ("error", "eof"):
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise AssertionError(f"peer {self.index}: {event}\n{tail}")
            if predicate(event):
                return event

    def send(self, line: str) -> None:
        """One line on the peer's stdin."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        """Kill the process if it still runs, reap it, close its pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
