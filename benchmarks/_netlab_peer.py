"""One peer of the network lab's averaging runs (``benchmarks/network_faults.py`` and
``tests/netlab/``), not a test module: started inside a lab host, it holds a ``swarmavg.DHT``
on that host's address and one ``swarmavg.DecentralizedAverager`` at a time over one float32
tensor, driven by JSON lines on stdin and answering JSON lines on stdout (one object a line,
nothing else on stdout; ``t`` fields are ``time.monotonic()``, one clock for every process of
the machine, namespaces included).

Arguments: ``--host`` (the lab host's address), ``--transports`` (``tcp``, plaintext, and/or
``quic``, comma-separated: one DHT each, so that one process serves rounds over either),
``--peers`` (initial peers, a JSON object ``{transport: [multiaddr, ...]}``). First line:
``{"event": "started", "peer_ids": {transport: id}, "maddrs": {transport: [...]}}``.

Requests (``{"op": ...}``):

- ``averager`` (``transport``, ``prefix``, ``size``, ``value``, ``group_size``,
  ``min_group_size``, ``options``): the averager, on that transport's DHT (a previous one is
  shut down first) over ``full(size, value)``; answers ``{"event": "ready"}``.
- ``step`` (``timeout``, ``out``: a ``.npy`` path or ``null``): ``step(wait=False)``; answers
  ``{"event": "allreduce", "t"}`` once its stage is ``RUNNING_ALLREDUCE`` (or it is over),
  then ``{"event": "result", "t", ...}`` with what the ``StepResult`` says (or ``error``) and
  the averager's ``measured_bandwidth``, the tensor saved to ``out`` first.
- ``dht``: answers ``{"event": "dht", "peers": {transport: routing table size}}``.
- ``exit``: shuts down and exits (also when stdin closes, or after ``IDLE`` s of silence).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
from typing import Any

IDLE = 300.0
POLL = 0.005


def _say(**message: Any) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--transports", default="tcp")
    parser.add_argument("--peers", default="{}")
    args = parser.parse_args()
    if os.environ.get("SWARMAVG_DEBUG_LOG"):  # (to trace a failure: DEBUG lines on stderr)
        import logging

        logging.basicConfig(
            level=logging.DEBUG, format="%(relativeCreated)7.0f %(name)s %(message)s"
        )
    import numpy as np
    import torch

    import swarmavg

    torch.set_num_threads(1)
    initial = json.loads(args.peers)
    dhts: dict[str, Any] = {}
    averager: Any = None
    try:
        for spec in args.transports.split(","):  # "tcp", "quic", "quic/<congestion control>"
            transport, _, congestion = spec.partition("/")
            if transport not in ("tcp", "quic") or (congestion and transport != "quic"):
                raise SystemExit(f"--transports: unknown transport {spec!r}")
            options: dict[str, Any] = {"encryption": False} if transport == "tcp" else {}
            if congestion:
                options["congestion_control"] = congestion
            dhts[spec] = swarmavg.DHT(
                initial_peers=initial.get(spec, []),
                transport=transport,
                host=args.host,
                port=0,
                transport_options=options,
            )
        _say(
            event="started",
            peer_ids={t: str(dht.peer_id) for t, dht in dhts.items()},
            maddrs={t: [str(a) for a in dht.get_visible_maddrs()] for t, dht in dhts.items()},
        )
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
            if op == "averager":
                if averager is not None:
                    averager.shutdown()
                tensor = torch.full((request["size"],), float(request["value"]))
                averager = swarmavg.DecentralizedAverager(
                    [tensor],
                    dhts[request["transport"]],
                    prefix=request["prefix"],
                    target_group_size=request["group_size"],
                    min_group_size=request.get("min_group_size", request["group_size"]),
                    **request.get("options", {}),
                )
                _say(event="ready")
            elif op == "step":
                timeout = request["timeout"]
                handle = averager.step(timeout=timeout, wait=False)
                deadline = time.monotonic() + timeout + 30
                while (
                    handle.stage != swarmavg.AveragingStage.RUNNING_ALLREDUCE
                    and not handle.done()
                    and time.monotonic() < deadline
                ):
                    time.sleep(POLL)
                _say(event="allreduce", t=time.monotonic())
                try:
                    result = handle.result(timeout=max(0.0, deadline - time.monotonic()))
                except Exception as exc:
                    _say(event="result", t=time.monotonic(), error=f"{type(exc).__name__}: {exc}")
                    continue
                done = time.monotonic()
                if request.get("out"):
                    with averager.get_tensors() as tensors:
                        np.save(request["out"], tensors[0].numpy())
                _say(
                    event="result",
                    t=done,
                    incomplete=result.incomplete,
                    group_id=result.group_id.hex(),
                    group=[str(p) for p in result],
                    contributors=[str(p) for p in result.contributors],
                    local_spans=[[str(p), why] for p, why in result.local_spans],
                    dropped=[[str(r), str(s), why] for r, s, why in result.dropped],
                    relayed=[[str(r), str(b)] for r, b in result.relayed],
                    allreduce_s=result.allreduce_seconds,
                    matchmaking_s=result.matchmaking_seconds,
                    measured_bandwidth=averager.measured_bandwidth,
                )
            elif op == "dht":
                _say(
                    event="dht",
                    peers={t: dht.run_coroutine(_table_size) for t, dht in dhts.items()},
                )
            else:
                _say(event="error", error=f"unknown op {op!r}")
    finally:
        if averager is not None:
            averager.shutdown()
        for dht in dhts.values():
            dht.shutdown()


async def _table_size(dht: Any, node: Any) -> int:
    return int(node.routing_table_size)


if __name__ == "__main__":
    sys.exit(main())
