"""One peer process of ``test_accumulator_processes.py`` (not a test module): a cohort member
over TCP on 127.0.0.1 with one float32 parameter of ``--size`` elements whose gradient is always
``--value`` everywhere, so that every result's exact value is known from who contributed.

``--api sync`` runs ``swarmavg.Accumulator`` in moolib's loop (``update()`` polled); ``--api
async`` runs ``swarmavg.aio.accumulator.Accumulator`` (awaited ``reduce_gradients``). Both
train with SGD (lr ``LR``; ``--step-delay`` seconds of "compute" before each gradient) until
model version ``--rounds``, after waiting until ``--members``
are in the cohort.

JSON lines on stdout (one object a line, nothing else; each with ``t``, ``time.monotonic()``):

- ``{"event": "started", "address"}`` once the DHT runs (with ``--initial-peers -`` the peer
  imports everything, then reads the address to join as a line on stdin);
- ``{"event": "contributed", "version", "total"}`` after each ``reduce_gradients``;
- ``{"event": "refused", "error"}`` where the async peer's ``wants_gradients()`` turned false
  while it computed (its predicates are live);
- ``{"event": "result", "version", "min", "max", "stats", "mine"}`` for each result before it
  is stepped: ``version`` the model version it makes (after ``zero_gradients``), ``min`` and
  ``max`` of ``.grad``, ``mine`` this peer's contributions since its previous result;
- ``{"event": "done", "version", "digest"}`` at ``--rounds`` (the parameter's SHA-256): it then
  serves the cohort (sync: ``update()``) until ``exit`` comes on stdin, leaves and exits 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import select
import sys
import time
from typing import Any

LR = 0.01


def say(**message: Any) -> None:
    sys.stdout.write(json.dumps({**message, "t": round(time.monotonic(), 3)}) + "\n")
    sys.stdout.flush()


def digest(tensor: Any) -> str:
    return hashlib.sha256(tensor.detach().numpy().tobytes()).hexdigest()


def exit_requested(timeout: float) -> bool:
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    return bool(ready) and sys.stdin.readline().strip() in ("exit", "")


def run_sync(args: argparse.Namespace) -> int:
    import torch

    import swarmavg

    param = torch.nn.Parameter(torch.zeros(args.size))
    opt = torch.optim.SGD([param], lr=LR)
    dht = swarmavg.DHT()
    group = swarmavg.Group("cohort", dht)
    acc = swarmavg.Accumulator("acc", [param], group=group, round_timeout=args.round_timeout)
    if args.initial_peers:
        acc.connect(args.initial_peers)
    say(event="started", address=dht.get_visible_maddrs()[0])
    deadline = time.monotonic() + args.deadline
    # (the test's: every member in the accumulator's epoch, and connected, before anyone
    # trains; group.members() alone is not enough, see the test module's docstring)
    while len(acc._acc.core.members) < args.members or not acc.connected():
        assert time.monotonic() < deadline, "the cohort did not form"
        group.update()
        acc.update()
        if acc.wants_state():
            acc.set_state({"optimizer": opt.state_dict()})
        time.sleep(0.02)
    mine = total = 0
    while acc.model_version() < args.rounds:
        assert time.monotonic() < deadline, f"stuck at version {acc.model_version()}"
        group.update()
        acc.update()
        if not acc.connected():
            time.sleep(0.02)
            continue
        if acc.wants_state():
            acc.set_state({"optimizer": opt.state_dict()})
        if acc.has_new_state():
            opt.load_state_dict(acc.state()["optimizer"])  # type: ignore[index]
        if acc.wants_gradients():
            time.sleep(args.step_delay)
            param.grad = torch.full_like(param, args.value)
            acc.reduce_gradients(1)  # (as of the last update(): never refused if it said yes)
            mine += 1
            total += 1
            say(event="contributed", version=acc.model_version(), total=total)
        if acc.has_gradients():
            assert param.grad is not None
            grad = param.grad
            say(
                event="result",
                version=acc.model_version() + 1,
                min=float(grad.min()),
                max=float(grad.max()),
                stats=acc.get_gradient_stats(),
                mine=mine,
            )
            mine = 0
            opt.step()
            acc.zero_gradients()
        else:
            time.sleep(0.002)
    say(event="done", version=acc.model_version(), digest=digest(param))
    while not exit_requested(0.02):
        group.update()
        acc.update()
        if acc.wants_state():
            acc.set_state({"optimizer": opt.state_dict()})
    acc.shutdown()
    group.shutdown()
    dht.shutdown()
    return 0


def run_async(args: argparse.Namespace) -> int:
    import anyio
    import torch

    from swarmavg.aio import DHT
    from swarmavg.aio.accumulator import Accumulator, Group

    async def main() -> None:
        param = torch.nn.Parameter(torch.zeros(args.size))
        opt = torch.optim.SGD([param], lr=LR)
        peers = [args.initial_peers] if args.initial_peers else []
        async with (
            DHT(peers) as dht,
            Group("cohort", dht) as group,
            Accumulator(
                "acc", [param], (), group, dht=dht, round_timeout=args.round_timeout
            ) as acc,
            anyio.create_task_group() as tg,
        ):
            say(event="started", address=str(dht.get_visible_maddrs()[0]))

            async def serve_states() -> None:
                while True:
                    await acc.wait_state_request()
                    acc.set_state({"optimizer": opt.state_dict()})

            tg.start_soon(serve_states)
            mine = total = 0
            with anyio.fail_after(args.deadline):
                while len(acc.core.members) < args.members or not acc.connected():  # noqa: ASYNC110
                    await anyio.sleep(0.02)
                while acc.model_version() < args.rounds:
                    await acc.wait_state()
                    if acc.has_new_state():
                        opt.load_state_dict(acc.state()["optimizer"])  # type: ignore[index]
                    if acc.wants_gradients():
                        await anyio.sleep(args.step_delay)
                        param.grad = torch.full_like(param, args.value)
                        if not acc.wants_gradients():  # (it changed while we "computed")
                            say(event="refused", error="wants_gradients() turned false")
                            continue
                        mine += 1
                        total += 1
                        await acc.reduce_gradients(1)
                        say(event="contributed", version=acc.model_version(), total=total)
                    else:
                        with anyio.move_on_after(0.05):
                            await acc.wait_gradients()
                    if acc.has_gradients():
                        assert param.grad is not None
                        say(
                            event="result",
                            version=acc.model_version() + 1,
                            min=float(param.grad.min()),
                            max=float(param.grad.max()),
                            stats=acc.get_gradient_stats(),
                            mine=mine,
                        )
                        mine = 0
                        opt.step()
                        acc.zero_gradients()
            say(event="done", version=acc.model_version(), digest=digest(param))
            while not await anyio.to_thread.run_sync(exit_requested, 0.1):
                pass
            tg.cancel_scope.cancel()

    anyio.run(main)
    return 0


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(  # (stderr: the test's log file of this peer)
        level=logging.INFO,
        format="%(asctime)s.%(msecs)03d %(name)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    if os.environ.get("SWARMAVG_PEER_DEBUG"):  # (to trace a failure: the cohort's every step)
        logging.getLogger("swarmavg.aio.accumulator").setLevel(logging.DEBUG)
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=("sync", "async"), default="sync")
    parser.add_argument("--initial-peers", default="")
    parser.add_argument("--members", type=int, required=True)
    parser.add_argument("--value", type=float, required=True)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--round-timeout", type=float, default=10.0)
    parser.add_argument("--deadline", type=float, default=60.0)
    parser.add_argument("--step-delay", type=float, default=0.0, help="compute, per gradient")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    import swarmavg.accumulator
    import swarmavg.aio.accumulator  # noqa: F401 (imported before the address is known)

    if args.initial_peers == "-":  # (started at once with the others: the address comes later)
        args.initial_peers = sys.stdin.readline().strip()
    try:
        return run_sync(args) if args.api == "sync" else run_async(args)
    except BaseException as exc:
        say(event="error", error=f"{type(exc).__name__}: {exc}")
        raise


if __name__ == "__main__":
    sys.exit(main())
