"""One peer of ``swarmavg demo`` (a child process): ``python -m swarmavg._demo_peer CONFIG``.

CONFIG is a JSON object (its keys: see ``_run_swarm`` in :mod:`swarmavg._demo`). The peer talks
to the demo process that started it in JSON lines, one object per line, and nothing else:

* it reads commands on stdin: ``{"cmd": "join", "initial_peers": [...]}`` (every peer but the
  first, before it starts its DHT), ``{"cmd": "step", "round": r}``, ``{"cmd": "skip",
  "round": r}`` (stop looking for a group in round r: nobody is left to join) and
  ``{"cmd": "stop"}``; end of file (the demo is gone) stops it too;
* it writes events on stdout: ``{"event": "loaded"}`` (torch is imported and the tensors made),
  ``{"event": "listening", "maddrs": [...]}`` (the first peer, once its DHT runs),
  ``{"event": "ready", ...}``, ``{"event": "round", ...}`` after each step, and
  ``{"event": "error", "error": "..."}`` before it exits with status 1.

Its tensors are random (numpy's generator seeded with ``[seed, index]``, so the demo knows every
peer's values without receiving them); after each step it reports how far they are from the
exact mean of all peers' initial tensors, which the demo computed and left in ``mean_path``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from swarmavg import DecentralizedAverager
    from swarmavg.aio.averager import StepResult

__all__ = ["initial_values", "main", "split_sizes"]

#: The averager's key prefix in the demo's DHT.
PREFIX = "demo"


def split_sizes(size: int) -> list[int]:
    """How the demo splits ``size`` elements into a few tensors (none empty)."""
    parts = [size // 2, size // 3, size - size // 2 - size // 3]
    return [part for part in parts if part > 0]


def initial_values(seed: int, index: int, size: int) -> npt.NDArray[np.float32]:
    """Peer ``index``'s initial tensors, flattened and concatenated."""
    return np.random.default_rng([seed, index]).standard_normal(size, dtype=np.float32)


class _Commands:
    """Lines of stdin, read by a daemon thread so that every wait for one has a timeout."""

    def __init__(self, stream: IO[str]) -> None:
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._ended = False
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        try:
            for line in stream:
                if line.strip():
                    self._queue.put(json.loads(line))
        finally:
            self._queue.put(None)

    def next(self, timeout: float) -> dict[str, Any] | None:
        """The next command; ``None`` at end of file (the demo closed our stdin or died), and
        from then on.

        :raises TimeoutError: none within ``timeout`` seconds (``queue.Empty`` for 0).
        """
        if self._ended:
            return None
        try:
            command = self._queue.get(timeout=timeout) if timeout else self._queue.get_nowait()
        except queue.Empty:
            if not timeout:
                raise
            raise TimeoutError(f"no command from the demo process within {timeout:.0f} s") from None
        self._ended = command is None
        return command


def _step(
    averager: DecentralizedAverager, commands: _Commands, number: int, timeout: float
) -> StepResult | None:
    """Step; ``None`` if the demo tells us that no peer is left to make a group with (or is
    gone). Commands for other rounds (a late ``skip``) are dropped.

    :raises MatchmakingFailed: no group in ``timeout`` seconds.
    """
    handle = averager.step(timeout=timeout, wait=False)
    while True:
        with contextlib.suppress(TimeoutError):
            return handle.result(timeout=0.05)
        with contextlib.suppress(queue.Empty):
            command = commands.next(0)
            told = command is None or (command.get("cmd") == "skip" and command["round"] == number)
            if told and handle.cancel():  # (if it finished meanwhile, take its result)
                return None


def _emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _run(config: dict[str, Any], commands: _Commands) -> None:
    import torch

    torch.set_num_threads(1)  # the peers share this machine's cores

    import swarmavg
    from swarmavg.errors import MatchmakingFailed

    index: int = config["index"]
    size: int = config["size"]
    command_timeout: float = config["command_timeout"]
    flat = initial_values(config["seed"], index, size)
    tensors = [torch.from_numpy(part) for part in np.split(flat, np.cumsum(split_sizes(size))[:-1])]
    mean = np.load(config["mean_path"], mmap_mode="r")
    mean_norm = float(np.linalg.norm(mean)) or 1.0
    _emit(event="loaded")

    transport_options = {} if config["transport"] != "tcp" else {"encryption": config["encryption"]}
    dht_options: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "transport": config["transport"],
        "transport_options": transport_options,
        "startup_timeout": config["startup_timeout"],
    }
    if index == 0:
        dht = swarmavg.DHT(**dht_options)
        _emit(event="listening", maddrs=dht.get_visible_maddrs())
    else:
        join = commands.next(command_timeout)
        if join is None:
            return
        if join.get("cmd") != "join":
            raise ValueError(f"expected a join command, got {join!r}")
        dht = swarmavg.DHT(initial_peers=join["initial_peers"], **dht_options)
    try:
        averager = swarmavg.DecentralizedAverager(
            tensors,
            dht,
            prefix=PREFIX,
            target_group_size=config["group_size"],
            min_group_size=2,
            initial_group_bits=config["bits"],
            averaging_expiration=config["averaging_expiration"],
            allreduce_timeout=config["allreduce_timeout"],
        )
        try:

            def distance() -> float:
                with averager.get_tensors() as own:
                    values = torch.cat([t.reshape(-1) for t in own]).numpy()
                return float(np.linalg.norm(values.astype(np.float64) - mean)) / mean_norm

            _emit(event="ready", distance=distance(), bits=averager.get_group_bits())
            while True:
                command = commands.next(command_timeout)
                if command is None or command.get("cmd") == "stop":
                    break
                if command.get("cmd") == "skip":  # too late: that round is over for us
                    continue
                if command.get("cmd") != "step":
                    raise ValueError(f"unknown command {command!r}")
                started = time.perf_counter()
                number = command["round"]
                report: dict[str, Any] = {"round": number, "bits": averager.get_group_bits()}
                try:
                    result = _step(averager, commands, number, config["step_timeout"])
                    if result is None:
                        raise MatchmakingFailed("no peer left to make a group with")
                except MatchmakingFailed as exc:  # no group this round: sit it out (Moshpit)
                    report.update(group=None, group_size=1, allreduce_seconds=0.0, bytes=0)
                    report.update(matchmaking_seconds=time.perf_counter() - started, note=str(exc))
                else:
                    report.update(
                        group=result.group_id.hex(),
                        group_size=result.group_size,
                        matchmaking_seconds=result.matchmaking_seconds,
                        allreduce_seconds=result.allreduce_seconds,
                        bytes=result.bytes_sent + result.bytes_received,
                    )
                report["next_bits"] = averager.get_group_bits()
                _emit(event="round", distance=distance(), **report)
        finally:
            averager.shutdown()
    finally:
        dht.shutdown()
    _emit(event="stopped")


def main(argv: Sequence[str] | None = None) -> int:
    return child_main(_run, argv)


def child_main(
    run: Callable[[dict[str, Any], _Commands], None], argv: Sequence[str] | None = None
) -> int:
    """A demo child's entry: ``run(config, commands)`` with the JSON config of ``argv``; any
    failure is printed to stderr and reported to the demo as an ``error`` event (status 1)."""
    args = sys.argv[1:] if argv is None else list(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    commands = _Commands(sys.stdin)
    try:
        (text,) = args
        run(json.loads(text), commands)
    except BaseException as exc:  # report anything, KeyboardInterrupt included, to the demo
        traceback.print_exc()
        with contextlib.suppress(OSError):  # the demo may be gone
            _emit(event="error", error=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # everything is closed: skip the interpreter's teardown (torch's alone takes a second or more)
    os._exit(status)
