"""One peer process of ``test_averager_kill.py`` (not a test module): a ``swarmavg.DHT`` over TCP
on 127.0.0.1 and a ``swarmavg.DecentralizedAverager`` over one float32 tensor, driven by JSON
lines on stdin, answering JSON lines on stdout (one object a line, nothing else on stdout).

Requests (``{"op": ...}``):

- ``start`` (``initial_peers``, ``size``, ``value``, ``prefix``, ``group_size``, ``options``,
  ``transport``: ``"tcp"`` (plaintext, the default) or ``"quic"``): the DHT and the averager
  (tensor all ``value``); answers ``{"event": "started", "peer_id", "maddrs"}``.
- ``step`` (``timeout``, ``out``): ``step(wait=False)``; answers ``{"event": "stepping", "t"}``
  once the step's stage is ``RUNNING_ALLREDUCE`` (or it is done), then, when the step is over,
  saves the tensor to ``out`` (``.npy``) and answers ``{"event": "result", "t", ...}`` with
  what the ``StepResult`` says (or ``"error"``). ``t`` is ``time.monotonic()`` (one clock for
  every process on Linux).
- ``poison`` (``every``): NaN in every ``every``-th element of its tensor (a diverged peer);
  answers ``{"event": "poisoned"}``.
- ``exit``: shuts down and exits.

The process exits by itself when stdin closes, and after ``IDLE`` seconds without a request.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from typing import Any

IDLE = 120.0
POLL = 0.005


def _say(**message: Any) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if os.environ.get("SWARMAVG_DEBUG_LOG"):  # (to trace a failure: DEBUG lines on stderr)
        import logging

        logging.basicConfig(
            level=logging.DEBUG, format="%(relativeCreated)7.0f %(name)s %(message)s"
        )
    import numpy as np
    import torch

    import swarmavg

    torch.set_num_threads(1)
    dht: Any = None
    averager: Any = None
    tensor: Any = None
    try:
        while True:
            ready, _, _ = select.select([sys.stdin], [], [], IDLE)
            if not ready:
                return 2
            line = sys.stdin.readline()
            if not line:
                return 0
            request = json.loads(line)
            op = request["op"]
            if op == "exit":
                return 0
            if op == "start":
                transport = request.get("transport", "tcp")
                dht = swarmavg.DHT(
                    initial_peers=request["initial_peers"],
                    transport=transport,
                    host="127.0.0.1",
                    port=0,
                    transport_options={"encryption": False} if transport == "tcp" else {},
                )
                tensor = torch.full((request["size"],), float(request["value"]))
                averager = swarmavg.DecentralizedAverager(
                    [tensor],
                    dht,
                    prefix=request["prefix"],
                    target_group_size=request["group_size"],
                    **{"min_group_size": request["group_size"], **request["options"]},
                )
                _say(
                    event="started",
                    peer_id=str(dht.peer_id),
                    maddrs=[str(a) for a in dht.get_visible_maddrs()],
                )
            elif op == "poison":  # (its training diverged: NaN in its tensor)
                with averager.get_tensors() as tensors:
                    tensors[0][:: request.get("every", 7)] = float("nan")
                _say(event="poisoned")
            elif op == "step":
                handle = averager.step(timeout=request["timeout"], wait=False)
                deadline = time.monotonic() + request["timeout"] + 30
                while (
                    handle.stage != swarmavg.AveragingStage.RUNNING_ALLREDUCE
                    and not handle.done()
                    and time.monotonic() < deadline
                ):
                    time.sleep(POLL)
                _say(event="stepping", t=time.monotonic())
                try:
                    result = handle.result(timeout=max(0.0, deadline - time.monotonic()))
                except Exception as exc:
                    _say(
                        event="result",
                        t=time.monotonic(),
                        error=f"{type(exc).__name__}: {exc}",
                        error_type=type(exc).__name__,
                    )
                    continue
                done = time.monotonic()
                with averager.get_tensors() as tensors:
                    np.save(request["out"], tensors[0].numpy())
                _say(
                    event="result",
                    t=done,
                    incomplete=result.incomplete,
                    group=[str(p) for p in result],
                    contributors=[str(p) for p in result.contributors],
                    local_spans=[[str(p), why] for p, why in result.local_spans],
                    dropped=[[str(r), str(s), why] for r, s, why in result.dropped],
                    allreduce_s=result.allreduce_seconds,
                )
            else:
                _say(event="error", error=f"unknown op {op!r}")
    finally:
        if averager is not None:
            averager.shutdown()
        if dht is not None:
            dht.shutdown()


if __name__ == "__main__":
    sys.exit(main())
