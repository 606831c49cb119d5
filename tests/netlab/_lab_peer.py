"""One peer of ``test_netlab_averaging.py`` (not a test module), run inside a lab host: a
``swarmavg.DHT`` over TCP on ``--host`` and a ``swarmavg.DecentralizedAverager`` over one
float32 tensor ``arange(size) * value``. Prints ``{"maddrs": [...]}``, waits for a line on
stdin, runs one step, and prints ``{"group", "contributors", "incomplete", "max_error"}`` where
``max_error`` is the largest distance from the expected mean ``arange(size) * mean``; exits."""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--value", type=float, required=True)
    parser.add_argument("--mean", type=float, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--peers", default="[]")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    import torch

    import swarmavg

    torch.set_num_threads(1)
    dht = swarmavg.DHT(
        initial_peers=json.loads(args.peers),
        transport="tcp",
        host=args.host,
        port=0,
        transport_options={"encryption": False},
    )
    tensor = torch.arange(args.size, dtype=torch.float32) * args.value
    averager = swarmavg.DecentralizedAverager(
        [tensor], dht, prefix="lab", target_group_size=args.group, min_group_size=args.group
    )
    try:
        print(json.dumps({"maddrs": [str(a) for a in dht.get_visible_maddrs()]}), flush=True)
        if not sys.stdin.readline():
            return 1
        result = averager.step(timeout=args.timeout)
        expected = torch.arange(args.size, dtype=torch.float32) * args.mean
        with averager.get_tensors() as tensors:
            error = float((tensors[0] - expected).abs().max())
        print(
            json.dumps(
                {
                    "group": len(result),
                    "contributors": len(result.contributors),
                    "incomplete": result.incomplete,
                    "max_error": error,
                    "allreduce_s": result.allreduce_seconds,
                }
            ),
            flush=True,
        )
    finally:
        averager.shutdown()
        dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
