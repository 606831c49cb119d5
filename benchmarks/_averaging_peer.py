"""One swarmavg peer process of ``benchmarks/averaging.py``.

The driver starts it (``multiprocessing``, "spawn") with one end of a pipe and sends it requests
``(seq, op, args)``; it answers each with ``(seq, "ok" | "error", payload)`` (``seq`` 0, sent
first, says that torch and swarmavg are imported). The operations, methods of :class:`_Peer`:

- ``start(initial_peers, encryption)``: a ``swarmavg.DHT`` over TCP on 127.0.0.1, port 0, with
  ``transport_options={"encryption": encryption}``; its visible multiaddrs.
- ``averager(prefix, group_size, size, value, options)``: a ``swarmavg.DecentralizedAverager``
  over one float32 tensor of ``size`` elements, all ``value``, with ``target_group_size`` and
  ``min_group_size`` = ``group_size``. ``options["compression"]``, if there, is a codec's name
  (its class name in :mod:`swarmavg.compression` or its wire name, e.g. ``"Float16Compression"``
  or ``"float16"``): the codec is made here, with its default parameters (:func:`make_codec`).
- ``step(go_at, timeout)``: sleeps until ``go_at`` (``time.monotonic()``, which on Linux is
  CLOCK_MONOTONIC, one clock for all processes) and then calls ``averager.step(timeout=...)``;
  returns when it was called and returned (monotonic), this process's CPU seconds over the
  call (``time.process_time()``: all its threads; ``cpu_sys``: the kernel's part) and what
  the ``StepResult`` says, or the error.
- ``load_state(timeout)`` (the ``--state`` rows): times ``load_state_from_peers(timeout=...)``:
  seconds, bytes of the tensors received (0 for ``None``), or the error.
- ``error(expected)``: the largest ``|tensor - expected|`` (is the average right?).
- ``randomize(seed)`` (the ``--codecs`` rows): sets the tensor to ``random_tensor(size, seed)``
  (``torch.randn`` from a generator seeded with ``seed``).
- ``mean_error(seeds)`` (the ``--codecs`` rows): the error of the tensor against the exact mean
  of ``random_tensor(size, s)`` over ``seeds`` (what every peer's tensor must be after a round
  from those tensors with equal weights and ``averaging_alpha=1``): :func:`error_stats`.
- ``stop()``: shuts the averager and the DHT down.

The process ignores SIGINT (the driver shuts it down on Ctrl+C) and exits on ``"exit"`` (at once,
without the interpreter's teardown, once the averager and DHT are shut down), when the driver's
end of the pipe closes, or after ``idle`` seconds without a request.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

HOST = "127.0.0.1"
#: the codecs of :mod:`swarmavg.compression` that ``--codecs`` compares, by class name
CODEC_CLASSES = (
    "NoCompression",
    "Float16Compression",
    "ScaledFloat16Compression",
    "Uniform8BitQuantization",
    "Quantile8BitQuantization",
    "BlockwiseQuantization",
)


def make_codec(name: str) -> Any:
    """A codec of :mod:`swarmavg.compression` with its default parameters, by class name (one
    of :data:`CODEC_CLASSES`) or wire name (``"float16"``); ``ValueError`` for anything else."""
    from swarmavg import compression

    for class_name in CODEC_CLASSES:
        cls = getattr(compression, class_name)
        if name in (class_name, cls.name):
            return cls()
    raise ValueError(f"unknown codec {name!r}; known: {', '.join(CODEC_CLASSES)}")


def random_tensor(size: int, seed: int, out: Any = None) -> Any:
    """``size`` float32 values from ``torch.randn`` seeded with ``seed`` (the same everywhere),
    written into ``out`` if given."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, generator=generator, dtype=torch.float32, out=out)


def error_stats(
    result: Any, seeds: list[int], scratch: Any = None, acc: Any = None
) -> dict[str, float]:
    """How far the float32 tensor ``result`` is from the exact mean (float64) of
    ``random_tensor(result.numel(), s)`` over ``seeds``: ``rms`` (root mean square of the
    difference), ``rel_rms`` (that over the RMS of the mean) and ``max_abs``. ``scratch`` (a
    float32 tensor) and ``acc`` (a float64 numpy array) of ``result.numel()`` elements are
    reused if given (numpy: its mixed float32 + float64 sums are ~10x faster than torch's)."""
    import numpy as np
    import torch

    size = result.numel()
    if scratch is None:
        scratch = torch.empty(size, dtype=torch.float32)
    if acc is None:
        acc = np.empty(size, dtype=np.float64)
    for k, seed in enumerate(seeds):
        values = random_tensor(size, seed, out=scratch).numpy()
        if k:
            np.add(acc, values, out=acc)
        else:
            np.copyto(acc, values)
    acc /= len(seeds)
    scale = float(np.linalg.norm(acc)) / math.sqrt(size)
    np.subtract(acc, result.detach().reshape(-1).numpy(), out=acc)  # now minus the error
    rms = float(np.linalg.norm(acc)) / math.sqrt(size)
    return {
        "rms": rms,
        "rel_rms": rms / scale if scale > 0 else float("inf"),
        "max_abs": max(float(acc.max()), -float(acc.min())),
    }


class _Peer:
    def __init__(self) -> None:
        self.dht: Any = None
        self.averager: Any = None
        self._scratch: tuple[Any, Any] | None = None  # error_stats's buffers

    def start(self, initial_peers: list[str], encryption: bool) -> tuple[float, list[str]]:
        import swarmavg

        begin = time.perf_counter()
        self.dht = swarmavg.DHT(
            initial_peers=initial_peers,
            transport="tcp",
            host=HOST,
            port=0,
            transport_options={"encryption": encryption},
        )
        elapsed = time.perf_counter() - begin
        return elapsed, [str(a) for a in self.dht.get_visible_maddrs()]

    def averager_(
        self, prefix: str, group_size: int, size: int, value: float, options: dict[str, Any]
    ) -> None:
        import torch

        import swarmavg

        tensor = torch.full((size,), float(value), dtype=torch.float32)
        if isinstance(options.get("compression"), str):
            options = {**options, "compression": make_codec(options["compression"])}
        self.averager = swarmavg.DecentralizedAverager(
            [tensor],
            self.dht,
            prefix=prefix,
            target_group_size=group_size,
            min_group_size=group_size,
            **options,
        )

    def step(self, go_at: float, timeout: float) -> dict[str, Any]:
        wait = go_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        cpu = time.process_time()
        kernel = os.times().system
        start = time.monotonic()
        try:
            result = self.averager.step(timeout=timeout)
        except Exception as exc:
            end = time.monotonic()
            return {
                "start": start,
                "end": end,
                "cpu": time.process_time() - cpu,
                "cpu_sys": os.times().system - kernel,
                "error": f"{type(exc).__name__}: {exc}"[:300],
            }
        end = time.monotonic()
        return {
            "start": start,
            "end": end,
            "cpu": time.process_time() - cpu,
            "cpu_sys": os.times().system - kernel,
            "matchmaking_s": float(result.matchmaking_seconds),
            "allreduce_s": float(result.allreduce_seconds),
            "group_size": int(result.group_size),
            "contributors": len(result.contributors),
            "bytes_sent": int(result.bytes_sent),
            "bytes_received": int(result.bytes_received),
            # (what it announces for the split; None before a round measured it)
            "bandwidth": getattr(self.averager, "measured_bandwidth", None),
        }

    def load_state(self, timeout: float) -> dict[str, Any]:
        start = time.monotonic()
        try:
            got = self.averager.load_state_from_peers(timeout=timeout)
        except Exception as exc:
            return {"seconds": time.monotonic() - start, "error": f"{type(exc).__name__}: {exc}"}
        seconds = time.monotonic() - start
        if got is None:
            return {"seconds": seconds, "bytes": 0}
        _, tensors = got
        return {"seconds": seconds, "bytes": sum(t.numel() * t.element_size() for t in tensors)}

    def error(self, expected: float) -> float:
        with self.averager.get_tensors() as tensors:
            return float((tensors[0] - expected).abs().max())

    def randomize(self, seed: int) -> None:
        with self.averager.get_tensors() as tensors:
            random_tensor(tensors[0].numel(), seed, out=tensors[0])

    def mean_error(self, seeds: list[int]) -> dict[str, float]:
        import numpy as np
        import torch

        with self.averager.get_tensors() as tensors:
            size = tensors[0].numel()
            if self._scratch is None or self._scratch[0].numel() != size:
                self._scratch = None  # free the old ones first
                self._scratch = (
                    torch.empty(size, dtype=torch.float32),
                    np.empty(size, dtype=np.float64),
                )
            return error_stats(tensors[0], seeds, *self._scratch)

    def stop(self) -> None:
        self._scratch = None
        averager, self.averager = self.averager, None
        dht, self.dht = self.dht, None
        try:
            if averager is not None:
                averager.shutdown()
        finally:
            if dht is not None:
                dht.shutdown()


def peer_main(conn: Connection, idle: float, tree: str | None = None) -> None:
    """The process: answers the driver's requests until told to exit (see the module doc).
    ``tree``: the root of another checkout whose swarmavg (and transports) this process
    imports instead of the one installed (``averaging.py --baseline``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if tree is not None:
        root = os.path.abspath(tree)
        sys.path[:0] = [root] + [os.path.join(root, "transports", t) for t in ("tcp", "quic")]
    import torch

    import swarmavg  # (imported before the hello: the process is warm from then)

    if tree is not None and not os.path.abspath(swarmavg.__file__).startswith(root + os.sep):
        raise RuntimeError(f"swarmavg came from {swarmavg.__file__}, not from {tree}")

    torch.set_num_threads(1)
    peer = _Peer()
    clean = False
    ops: dict[str, Callable[..., Any]] = {
        "start": peer.start,
        "averager": peer.averager_,
        "step": peer.step,
        "load_state": peer.load_state,
        "error": peer.error,
        "randomize": peer.randomize,
        "mean_error": peer.mean_error,
        "stop": peer.stop,
    }
    try:
        conn.send((0, "ok", os.getpid()))
        while conn.poll(idle):
            seq, op, args = conn.recv()
            if op == "exit":
                peer.stop()
                conn.send((seq, "ok", None))
                clean = True
                break
            try:
                conn.send((seq, "ok", ops[op](*args)))
            except Exception as exc:
                conn.send((seq, "error", f"{type(exc).__name__}: {exc}"[:500]))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the driver is gone
    finally:
        try:
            peer.stop()
        finally:
            conn.close()
    if clean:
        # The averager and the DHT are shut down through the library's API: skip the interpreter's
        # teardown (torch's alone is ~0.6 CPU s a process, and a loaded 2-CPU machine exiting
        # eight of them at once took longer than the driver waits).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
