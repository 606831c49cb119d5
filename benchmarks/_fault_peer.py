"""One peer of ``benchmarks/averaging.py --faults``: a training loop that averages one tensor.

Runs under our Python (``--system swarmavg``) or under a Python with hivemind 1.1.12
(``--system hivemind``): it imports nothing else of ``benchmarks/``. The driver
(``_averaging_faults.py``) starts it as a process group of its own (``start_new_session``), so
that a SIGKILL to the group kills the whole peer: for hivemind that is this process, its DHT
and averager processes and their p2pd daemon.

Protocol: JSON lines. The driver writes requests ``{"seq", "op", ...}`` to stdin; this process
writes to its original stdout (file descriptor 1 is pointed at stderr, so that nothing the
libraries print can mix in) ``{"seq", "ok": true, "result"}`` or ``{"seq", "ok": false,
"error"}`` answers and ``{"event", ...}`` events, one per line. First event: ``ready`` (torch
and the system imported). Requests, run one at a time on the main thread:

- ``start(transport, initial_peers)``: a DHT on 127.0.0.1, port 0 (``tcp`` or ``quic``); its
  visible multiaddrs.
- ``averager(prefix, group_size, size, index, step_timeout, options)``: an averager over one
  float32 tensor of ``size`` elements (``torch.randn`` seeded by ``index``), with
  ``target_group_size = group_size`` and the system's defaults otherwise (``options`` override
  them; hivemind's ``allreduce_timeout`` is the step timeout unless given).
- ``train(go_at, step_timeout, compute, max_steps, until, fault)``: the training loop, from
  ``go_at`` (``time.monotonic()``, one clock for every process on Linux): ``step(wait=False,
  timeout=step_timeout)``, its stage polled every 2 ms until it is done (what a blocking
  ``step(timeout=...)`` does, observed), then ``compute`` seconds of "compute" from the end
  of the step (the tensor's digest and a copy are taken under ``get_tensors()``, then
  ``0.001·(index+1)`` is added to it, then the rest is slept), again, until ``halt``,
  ``max_steps`` steps or the monotonic time ``until``. Each step sends a ``step`` event: its
  number, start and end, when it was seen looking for a group and running its all-reduce, the
  result (group size, contributors, group id, incomplete, matchmaking and all-reduce seconds
  where the system says) or the error, and the tensor's BLAKE2b digest after it. Answers the
  number of steps once it ends.
- ``teardown()``: shuts the averager and the DHT down (bounded); their seconds.
- ``exit``: as ``teardown``, then the process exits.

Requests handled at once by the reader thread, also while the loop runs: ``halt`` (the loop
stops: a step in progress is cancelled and waited for) and ``diff(step, path, save)`` (the
tensor as it was after that step, of the last :data:`RING` steps: saved to ``path`` with
``numpy.save``, or its largest absolute difference from the one saved there).

``fault`` (the victim only): ``{"signal": "SIGINT" | "SIGKILL", "step": k, "stage": "idle" |
"looking" | "allreduce" | "allreduce-mid", "skip": warm-up steps}``. The loop signals at that
point of step ``k`` (``idle``: halfway through the compute pause before it; ``looking``: once
the step has looked for a group for a quarter of the median matchmaking time of this peer's
earlier steps after the warm-up; ``allreduce``: as soon as it is seen running its all-reduce;
``allreduce-mid``: half this peer's median all-reduce time later), after writing a ``fault``
event (when, and the stage the step was in). When that moment finds the step past the stage
asked for (or the stage never came), the fault moves to the next step (a ``rearmed`` event),
at most :data:`MAX_REARM` times. From the loop itself, so that the moment does not depend on
the driver's scheduling.

``SIGKILL`` goes to the whole process group: the peer dies at once. ``SIGINT`` goes to this
process, the training script's (a Ctrl+C that reached only it): ``KeyboardInterrupt`` where
the loop is; a step in progress is cancelled (ours: what the blocking ``step()`` does on an
exception; hivemind's does nothing), then the averager and the DHT are shut down, a ``left``
event says how long that took, and the process exits, as a Ctrl+C'd training script would.
hivemind's averager sets SIGINT to ``SIG_IGN`` in the training process when it starts and
leaves it so (a Ctrl+C would do nothing there; in a terminal it would reach only its p2pd
daemon, which dies of it): ``averager`` puts Python's handler back, as a script that wants to
leave on Ctrl+C must, and says what it found.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import queue
import signal
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

HOST = "127.0.0.1"
POLL = 0.002  # s between looks at a step's stage
RING = 12  # steps whose tensors are kept for ``diff``
#: times the victim moves its fault to its next step because the stage asked for had passed
#: (or never came) in this one; then it signals anyway
MAX_REARM = 5
#: the stage a fault's moment must find the step in
_WANTED = {
    "looking": "LOOKING_FOR_GROUP",
    "allreduce": "RUNNING_ALLREDUCE",
    "allreduce-mid": "RUNNING_ALLREDUCE",
}
SHUTDOWN_TIMEOUT = 30.0  # an averager or DHT shutdown, s


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


class _Out:
    """Lines to the driver from any thread (a lock keeps them whole)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        with self._lock:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]


class _System:
    """What differs between swarmavg and hivemind."""

    name = ""

    def start_dht(self, transport: str, initial_peers: list[str]) -> Any:
        raise NotImplementedError

    def maddrs(self, dht: Any) -> list[str]:
        return [str(a) for a in dht.get_visible_maddrs()]

    def averager(
        self, tensor: Any, dht: Any, prefix: str, n: int, timeout: float, options: dict[str, Any]
    ) -> Any:
        raise NotImplementedError

    def result(self, result: Any) -> dict[str, Any]:
        raise NotImplementedError

    def on_interrupt(self, handle: Any) -> None:
        """What the system's blocking ``step()`` does when ``KeyboardInterrupt`` hits it."""

    def shutdown_dht(self, dht: Any) -> None:
        dht.shutdown()


class _Ours(_System):
    name = "swarmavg"

    def __init__(self) -> None:
        import swarmavg

        self.lib = swarmavg
        self.version = getattr(swarmavg, "__version__", "?")

    def start_dht(self, transport: str, initial_peers: list[str]) -> Any:
        return self.lib.DHT(initial_peers=initial_peers, transport=transport, host=HOST, port=0)

    def averager(
        self, tensor: Any, dht: Any, prefix: str, n: int, timeout: float, options: dict[str, Any]
    ) -> Any:
        return self.lib.DecentralizedAverager(
            [tensor], dht, prefix=prefix, target_group_size=n, **options
        )

    def result(self, result: Any) -> dict[str, Any]:
        return {
            "group_size": int(result.group_size),
            "contributors": len(result.contributors),
            "group_id": bytes(result.group_id).hex(),
            "incomplete": bool(result.incomplete),
            "matchmaking_s": float(result.matchmaking_seconds),
            "allreduce_s": float(result.allreduce_seconds),
        }

    def on_interrupt(self, handle: Any) -> None:
        handle.cancel()  # DecentralizedAverager.step(wait=True) cancels on any exception

    def shutdown_dht(self, dht: Any) -> None:
        dht.shutdown(timeout=SHUTDOWN_TIMEOUT)


class _Hivemind(_System):
    name = "hivemind"

    def __init__(self) -> None:
        import hivemind

        self.lib = hivemind
        self.version = hivemind.__version__

    def start_dht(self, transport: str, initial_peers: list[str]) -> Any:
        maddr = "/ip4/127.0.0.1/tcp/0" if transport == "tcp" else "/ip4/127.0.0.1/udp/0/quic-v1"
        return self.lib.DHT(initial_peers=initial_peers or None, host_maddrs=[maddr], start=True)

    def averager(
        self, tensor: Any, dht: Any, prefix: str, n: int, timeout: float, options: dict[str, Any]
    ) -> Any:
        options = {"allreduce_timeout": timeout, **options}
        return self.lib.DecentralizedAverager(
            [tensor], dht, prefix=prefix, target_group_size=n, start=True, **options
        )

    def result(self, result: Any) -> dict[str, Any]:
        if result is None:  # (1.1.12 raises instead; older versions returned None)
            raise RuntimeError("step returned None")
        return {"group_size": len(result)}


class _Peer:
    def __init__(self, system: _System, index: int, out: _Out) -> None:
        self.system = system
        self.index = index
        self.out = out
        self.dht: Any = None
        self.averager: Any = None
        self.halt = threading.Event()
        self.ring: dict[int, Any] = {}
        self.ring_lock = threading.Lock()
        self.records: list[dict[str, Any]] = []

    # -- requests --------------------------------------------------------------------------------

    def start(self, transport: str, initial_peers: list[str]) -> list[str]:
        self.dht = self.system.start_dht(transport, initial_peers)
        return self.system.maddrs(self.dht)

    def averager_(
        self,
        prefix: str,
        group_size: int,
        size: int,
        index: int,
        step_timeout: float,
        options: dict[str, Any],
    ) -> dict[str, str]:
        import torch

        generator = torch.Generator().manual_seed(index)
        tensor = torch.randn(size, generator=generator, dtype=torch.float32)
        self.averager = self.system.averager(
            tensor, self.dht, prefix, group_size, step_timeout, options
        )
        # hivemind's averager sets SIGINT to SIG_IGN in this (the training) process when it
        # starts (run_in_background) and leaves it so: a Ctrl+C would do nothing here. A script
        # that wants to leave on Ctrl+C puts Python's handler back, as this one does.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        with self.ring_lock:
            self.ring.clear()
        self.records = []
        if previous is signal.default_int_handler:
            was = "default_int_handler"
        else:
            was = getattr(previous, "name", repr(previous))
        return {"sigint_was": was}

    def teardown(self) -> dict[str, float]:
        took: dict[str, float] = {}
        averager, self.averager = self.averager, None
        dht, self.dht = self.dht, None
        try:
            if averager is not None:
                begin = time.monotonic()
                averager.shutdown()
                took["averager_s"] = time.monotonic() - begin
        finally:
            if dht is not None:
                begin = time.monotonic()
                self.system.shutdown_dht(dht)
                took["dht_s"] = time.monotonic() - begin
        return took

    def diff(self, step: int, path: str, save: bool) -> float | None:
        import numpy as np

        with self.ring_lock:
            tensor = self.ring.get(step)
        if tensor is None:
            return None
        if save:
            with open(path, "wb") as f:
                np.save(f, tensor, allow_pickle=False)
            return 0.0
        other = np.load(path, allow_pickle=False)
        return float(np.abs(other - tensor).max())

    # -- the loop --------------------------------------------------------------------------------

    def train(
        self,
        go_at: float,
        step_timeout: float,
        compute: float,
        max_steps: int,
        until: float,
        fault: dict[str, Any] | None,
    ) -> int:
        self.halt.clear()
        time.sleep(max(0.0, go_at - time.monotonic()))
        k = 0
        while not self.halt.is_set() and k < max_steps and time.monotonic() < until:
            record = self._step(k, step_timeout, fault)
            self.records.append(record)
            self._after_step(k, record)
            self.out.send({"event": "step", **record})
            pause_until = record["end"] + compute
            with self.averager.get_tensors() as tensors:  # the "gradient step"
                tensors[0].add_(0.001 * (self.index + 1))
            if fault is not None and fault["stage"] == "idle" and fault["step"] == k + 1:
                fire_at = record["end"] + compute / 2
                self._sleep_until(fire_at)
                self._fire(fault, k + 1, "IDLE", record["end"], None)
            self._sleep_until(pause_until)
            k += 1
        return k

    def _sleep_until(self, moment: float) -> None:
        while not self.halt.is_set():
            left = moment - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.05))

    def _step(self, k: int, step_timeout: float, fault: dict[str, Any] | None) -> dict[str, Any]:
        start = time.monotonic()
        record: dict[str, Any] = {"k": k, "start": start, "looking_at": None, "allreduce_at": None}
        handle = self.averager.step(wait=False, timeout=step_timeout)
        armed = fault is not None and fault["step"] == k and fault["stage"] != "idle"
        fire_at = None
        try:
            while not handle.done():
                now = time.monotonic()
                stage = handle.stage.name
                if record["looking_at"] is None and stage == "LOOKING_FOR_GROUP":
                    record["looking_at"] = now
                if record["allreduce_at"] is None and stage == "RUNNING_ALLREDUCE":
                    record["allreduce_at"] = now
                if armed and fault is not None:
                    if fault["stage"] == "looking" and stage == "RUNNING_ALLREDUCE":
                        fire_at = now  # it was never seen looking
                    fire_at = self._fire_at(fault, record, fire_at)
                    if fire_at is not None and now >= fire_at:
                        armed = False
                        wanted = _WANTED[fault["stage"]]
                        if stage == wanted or fault.get("rearmed", 0) >= MAX_REARM:
                            self._fire(fault, k, stage, start, record["allreduce_at"])
                        else:
                            self._rearm(fault, k, stage)
                if self.halt.is_set() and not record.get("halted"):
                    handle.cancel()
                    record["halted"] = True
                time.sleep(POLL)
            if armed and fault is not None:  # its moment did not come in this step
                if fault.get("rearmed", 0) >= MAX_REARM:
                    self._fire(fault, k, handle.stage.name, start, record["allreduce_at"])
                else:
                    self._rearm(fault, k, handle.stage.name)
            record.update(self.system.result(handle.result()))
        except KeyboardInterrupt:
            self.system.on_interrupt(handle)
            raise
        except Exception as exc:
            record["error"] = _error(exc)
        record["end"] = time.monotonic()
        return record

    def _fire_at(
        self, fault: dict[str, Any], record: dict[str, Any], fire_at: float | None
    ) -> float | None:
        if fire_at is not None:
            return fire_at
        earlier = self.records[fault.get("skip", 0) :]
        if fault["stage"] == "looking" and record["looking_at"] is not None:
            spans = [
                r["allreduce_at"] - r["looking_at"]
                for r in earlier
                if r["allreduce_at"] is not None and r["looking_at"] is not None
            ]
            delay = statistics.median(spans) / 4 if spans else 0.0
            return float(record["looking_at"] + max(delay, 0.002))
        if fault["stage"] == "allreduce" and record["allreduce_at"] is not None:
            return float(record["allreduce_at"])
        if fault["stage"] == "allreduce-mid" and record["allreduce_at"] is not None:
            spans = [r["end"] - r["allreduce_at"] for r in earlier if r["allreduce_at"] is not None]
            delay = statistics.median(spans) / 2 if spans else 0.0
            return float(record["allreduce_at"] + delay)
        return None

    def _rearm(self, fault: dict[str, Any], k: int, stage: str) -> None:
        """The stage asked for had passed (or never came) when its moment came: the next step."""
        fault["rearmed"] = fault.get("rearmed", 0) + 1
        fault["step"] = k + 1
        self.out.send({"event": "rearmed", "step": k, "stage": stage})

    def _fire(
        self, fault: dict[str, Any], k: int, stage: str, start: float, allreduce_at: float | None
    ) -> None:
        now = time.monotonic()
        self.out.send(
            {
                "event": "fault",
                "t": now,
                "wall": time.time(),
                "step": k,
                "stage": stage,
                "since_start_s": now - start,
                "since_allreduce_s": None if allreduce_at is None else now - allreduce_at,
            }
        )
        if fault["signal"] == "SIGKILL":
            os.killpg(os.getpgid(0), signal.SIGKILL)  # the whole peer at once
        else:
            os.kill(os.getpid(), signal.SIGINT)  # KeyboardInterrupt here, at once
        time.sleep(1.0)

    def _after_step(self, k: int, record: dict[str, Any]) -> None:
        with self.averager.get_tensors() as tensors:
            array = tensors[0].detach().numpy()
            record["digest"] = hashlib.blake2b(array, digest_size=16).hexdigest()
            copy = array.copy()
        with self.ring_lock:
            self.ring[k] = copy
            for old in [s for s in self.ring if s <= k - RING]:
                del self.ring[old]

    # -- leaving (Ctrl+C) ------------------------------------------------------------------------

    def leave(self) -> None:
        """What a Ctrl+C'd training script does on its way out: shut down, then exit."""
        begin = time.monotonic()
        message: dict[str, Any] = {"event": "left", "interrupted_at": begin}
        try:
            message.update(self.teardown())
        except BaseException as exc:
            message["error"] = _error(exc)
        message["shutdown_s"] = time.monotonic() - begin
        self.out.send(message)


def _lines(fd: int) -> Iterator[bytes]:
    """Lines read from ``fd`` with ``os.read``: not through ``sys.stdin``, whose lock a thread
    blocked in it would hold across a fork (hivemind forks its DHT and averager processes, and
    multiprocessing closes ``sys.stdin`` in the child: it deadlocked there)."""
    pending = b""
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        pending += chunk
        *lines, pending = pending.split(b"\n")
        yield from lines


def _reader(peer: _Peer, fd: int, inbox: queue.SimpleQueue[dict[str, Any] | None]) -> None:
    """Reads requests; ``halt`` and ``diff`` are handled here (also while the loop runs)."""
    for line in _lines(fd):
        try:
            request = json.loads(line)
        except ValueError:
            continue
        if request.get("op") == "halt":
            peer.halt.set()
        elif request.get("op") == "diff":
            try:
                got = peer.diff(request["step"], request["path"], request["save"])
                peer.out.send({"seq": request["seq"], "ok": True, "result": got})
            except Exception as exc:
                peer.out.send({"seq": request["seq"], "ok": False, "error": _error(exc)})
        else:
            inbox.put(request)
    peer.halt.set()
    inbox.put(None)  # the driver is gone


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", choices=("swarmavg", "hivemind"), required=True)
    parser.add_argument("--index", type=int, required=True, help="the pool slot (for logs)")
    parser.add_argument("--idle", type=float, default=1800.0, help="exit after this long idle")
    args = parser.parse_args()
    out = _Out(os.dup(1))
    os.dup2(2, 1)
    requests = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import logging

    import torch

    torch.set_num_threads(1)
    if args.system == "swarmavg":
        logging.basicConfig(
            level=logging.INFO, format="%(created).3f %(levelname)s %(name)s: %(message)s"
        )
        for name in os.environ.get("SWARMAVG_FAULT_DEBUG", "").split(","):
            if name:  # (e.g. swarmavg.aio.matchmaking: a fault that went wrong, traced)
                logging.getLogger(name).setLevel(logging.DEBUG)
    system: _System = _Ours() if args.system == "swarmavg" else _Hivemind()
    peer = _Peer(system, args.index, out)
    inbox: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
    threading.Thread(target=_reader, args=(peer, requests, inbox), daemon=True).start()
    ops = {
        "start": peer.start,
        "averager": peer.averager_,
        "train": peer.train,
        "teardown": peer.teardown,
    }
    out.send({"event": "ready", "pid": os.getpid(), "version": system.version})
    status = 0
    try:
        while True:
            try:
                request = inbox.get(timeout=args.idle)
            except queue.Empty:
                break
            if request is None or request.get("op") == "exit":
                with contextlib.suppress(Exception):
                    peer.teardown()
                if request is not None:
                    out.send({"seq": request.get("seq"), "ok": True, "result": None})
                break
            seq = request.pop("seq", None)
            op = request.pop("op", None)
            try:
                got = ops[str(op)](**request)
                out.send({"seq": seq, "ok": True, "result": got})
            except Exception as exc:
                out.send({"seq": seq, "ok": False, "error": _error(exc)})
    except KeyboardInterrupt:
        peer.leave()
        status = 130
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # the averager and DHT are shut down; skip the interpreter's teardown


if __name__ == "__main__":
    sys.exit(main())
