"""One peer of ``benchmarks/network.py``'s hivemind reference, started inside a network-lab
host under a Python that has hivemind 1.1.12 (``/tmp/hm-venv/bin/python``), not the project's.

It starts a hivemind ``DHT`` on the host's address (``/ip4/<host>/tcp/0``; hivemind's p2pd
daemon is its child, so it lives in the host's namespace too) and one
``DecentralizedAverager`` over ``full(--size, --value)`` float32 with ``target_group_size =
min_group_size = --group``, hivemind's defaults otherwise (libp2p connections are encrypted,
hivemind's only mode). Driven by JSON lines on stdin, answering JSON lines on stdout (hivemind
logs to stderr):

- first line ``{"event": "started", "maddrs": [...]}`` once the DHT is up (``--initial``: a
  JSON list of multiaddrs to join); ``{"event": "ready"}`` follows once the averager runs;
- ``{"op": "step", "timeout": s}``: ``step(wait=False)``, polled every 2 ms; answers
  ``{"event": "result", "allreduce_s": ..., "matchmaking_s": ...}`` (from the first poll that
  saw ``RUNNING_ALLREDUCE`` or later to the first that saw it done) or ``{"event": "result",
  "error": ...}``; the tensor is put back to ``--value`` afterwards, so every round averages
  the same values;
- ``{"op": "check", "expected": x}``: ``{"event": "check", "max_abs_error": ...}`` of the last
  round's tensor against ``x``;
- ``{"op": "exit"}`` or stdin closed: shuts down.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

POLL = 0.002


def _say(**message: Any) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--initial", default="[]")
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--value", type=float, required=True)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--allreduce-timeout", type=float, default=300.0)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from hivemind import DHT, DecentralizedAverager
    from hivemind.averaging.control import AveragingStage

    torch.set_num_threads(1)
    initial = json.loads(args.initial)
    dht = DHT(
        initial_peers=initial or None,
        host_maddrs=[f"/ip4/{args.host}/tcp/0"],
        start=True,
    )
    averager = None
    last = None
    try:
        _say(event="started", maddrs=[str(a) for a in dht.get_visible_maddrs()])
        averager = DecentralizedAverager(
            [torch.full((args.size,), args.value, dtype=torch.float32)],
            dht,
            prefix=args.prefix,
            target_group_size=args.group,
            min_group_size=args.group,
            allreduce_timeout=args.allreduce_timeout,
            start=True,
        )
        _say(event="ready")
        for line in sys.stdin:
            request = json.loads(line)
            if request["op"] == "exit":
                break
            if request["op"] == "check":
                error = None if last is None else float((last - request["expected"]).abs().max())
                _say(event="check", max_abs_error=error)
                continue
            timeout = float(request["timeout"])
            start = time.monotonic()
            control = averager.step(wait=False, timeout=timeout)
            group = None
            deadline = start + timeout + args.allreduce_timeout + 5
            while not control.done() and time.monotonic() < deadline:
                stage = control.stage
                if group is None and stage in (
                    AveragingStage.RUNNING_ALLREDUCE,
                    AveragingStage.FINISHED,
                ):
                    group = time.monotonic()
                time.sleep(POLL)
            end = time.monotonic()
            if not control.done():
                control.cancel()
                _say(event="result", error="not done in time, cancelled")
                continue
            try:
                got = control.result(timeout=5)
            except Exception as exc:
                _say(event="result", error=f"{type(exc).__name__}: {exc}"[:300])
                continue
            if got is None:
                _say(event="result", error="step returned None (no group)")
                continue
            group = end if group is None else group
            _say(
                event="result",
                allreduce_s=end - group,
                matchmaking_s=group - start,
                group=len(got),
            )
            with averager.get_tensors() as tensors:
                last = tensors[0].clone()
                tensors[0].fill_(args.value)
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
