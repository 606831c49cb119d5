"""float16 AMP on one GPU: ``swarmavg.Optimizer`` with ``swarmavg.optim.GradScaler``, beside the
same peers training alone (``torch.optim.Adam`` with ``torch.amp.GradScaler``, no averaging).

    python benchmarks/amp_gpu.py [--peers 2] [--epochs 10] [--batch-size 32]
                                 [--target-batch-size 512] [--d-model 256] [--layers 4]
                                 [--matchmaking-time 1] [--reuse-grad-buffers]
                                 [--delay-optimizer-step] [--out results.jsonl]

The workload of ``swarmavg/testing/workload.py`` (a byte-level transformer LM on the standard
library's source; ``--d-model``/``--layers`` make it large enough to keep a GPU busy), every
peer a thread of this process on the one GPU, each with its own ``swarmavg.DHT`` on loopback
(peer 0 first, the others join it), its own CUDA copy of the model (same seed) and its own
stream of batches; the forward pass under ``torch.autocast("cuda", dtype=torch.float16)``.

Two runs, one after the other:

- **swarm**: each peer trains with ``swarmavg.Optimizer`` (Adam factory, ``target_batch_size``
  T over all peers, ``batch_size_per_step`` B) through ``GradScaler("cuda")`` until its local
  epoch reaches ``--epochs`` (E);
- **alone**: each peer trains the same model with ``torch.optim.Adam`` through
  ``torch.amp.GradScaler("cuda")``, accumulating T / peers samples per optimizer step, for the
  samples a swarm peer fed on average: the same compute without the DHT, the averaging and the
  epoch bookkeeping.

Printed (and appended to ``--out`` as one JSON line): samples/s of both (all peers' samples over
the wall-clock), the overhead ``1 - swarm / alone``, the final scale of peer 0's scaler, whether
the peers ended apart (the largest parameter difference; 0 when every epoch averaged the
gradients of all of them) and peer 0's validation loss before and after.
Without CUDA the script says so and exits with status 1 (there is nothing to measure);
``--device cpu`` runs the same code on the CPU (float16 autocast there) as a check of the
script itself: its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from functools import partial
from typing import Any

import torch


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--target-batch-size", type=int, default=512)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--matchmaking-time", type=float, default=1.0)
    parser.add_argument("--averaging-timeout", type=float, default=30.0)
    parser.add_argument("--reuse-grad-buffers", action="store_true")
    parser.add_argument(
        "--delay-optimizer-step",
        action="store_true",
        help="delay_optimizer_step and delay_grad_averaging (delayed parameter updates)",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: a smoke run of this script (use tiny sizes; the figures mean nothing)",
    )
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds per run at most")
    parser.add_argument("--out", default=None, help="append the result as a JSON line here")
    args = parser.parse_args(argv)
    if args.peers < 1 or args.epochs < 1 or args.batch_size < 1:
        parser.error("--peers, --epochs and --batch-size must be positive")
    if args.target_batch_size < args.peers * args.batch_size:
        parser.error("--target-batch-size must be at least --peers x --batch-size")
    return args


def _run_threads(targets: list[Callable[[], None]], timeout: float) -> None:
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"a peer did not finish within {timeout:.0f} s")
    if errors:
        raise errors[0]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "benchmarks/amp_gpu.py: needs a CUDA GPU (torch.cuda.is_available() is False with "
            f"torch {torch.__version__}); nothing to measure",
            file=sys.stderr,
        )
        return 1

    import swarmavg
    from swarmavg.optim import GradScaler
    from swarmavg.testing import workload

    device = torch.device(args.device)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    corpus = workload.load_corpus()
    make_model = partial(
        workload.make_model, seed=0, d_model=args.d_model, layers=args.layers, heads=args.heads
    )

    def to_device(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)

    def stream(peer: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        batches = workload.batches(corpus, args.batch_size, seed=0, peer=peer, num_peers=args.peers)
        return map(to_device, batches)

    @torch.no_grad()
    def validation_loss(model: torch.nn.Module) -> float:
        batches = workload.batches(corpus, 64, seed=0, split="validation")
        total = 0.0
        model.eval()
        for _, batch in zip(range(4), batches, strict=False):
            x, y = to_device(batch)
            with torch.autocast(device.type, dtype=torch.float16):
                total += float(workload.loss_fn(model, x, y))
        model.train()
        return total / 4

    initial_loss = validation_loss(make_model().to(device))

    # -- swarm ------------------------------------------------------------------------------------
    samples = [0] * args.peers
    finals: list[torch.Tensor] = [torch.empty(0)] * args.peers
    extra: dict[str, Any] = {}
    ready = threading.Barrier(args.peers)
    start = [0.0]

    def swarm_peer(peer: int, dht: swarmavg.DHT) -> None:
        model = make_model().to(device)
        scaler = GradScaler(device.type)
        delay = args.delay_optimizer_step
        with swarmavg.Optimizer(
            dht=dht,
            run_id="amp_gpu",
            target_batch_size=args.target_batch_size,
            batch_size_per_step=args.batch_size,
            params=model.parameters(),
            optimizer=partial(workload.make_optimizer, lr=args.lr),
            matchmaking_time=args.matchmaking_time,
            averaging_timeout=args.averaging_timeout,
            reuse_grad_buffers=args.reuse_grad_buffers,
            delay_optimizer_step=delay,
            delay_grad_averaging=delay,
        ) as opt:
            if ready.wait(60) == 0:
                start[0] = time.perf_counter()
            ready.wait(60)
            for x, y in stream(peer):
                if opt.local_epoch >= args.epochs:
                    break
                with torch.autocast(device.type, dtype=torch.float16):
                    loss = workload.loss_fn(model, x, y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                if not args.reuse_grad_buffers:
                    opt.zero_grad()
                samples[peer] += len(x)
            synchronize()
            # until every peer is done (it stays for a straggler's last round meanwhile)
            if ready.wait(args.deadline) == 0:
                extra["swarm_s"] = time.perf_counter() - start[0]
            if peer == 0:
                extra["final_scale"] = scaler.get_scale()
            finals[peer] = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
            if peer == 0:
                extra["swarm_loss"] = validation_loss(model)

    with ExitStack() as stack:
        first = stack.enter_context(swarmavg.DHT())
        dhts = [first] + [
            stack.enter_context(swarmavg.DHT(first.get_visible_maddrs()))
            for _ in range(args.peers - 1)
        ]
        _run_threads([partial(swarm_peer, i, dht) for i, dht in enumerate(dhts)], args.deadline)
    swarm_samples = sum(samples)
    swarm_rate = swarm_samples / extra["swarm_s"]

    # -- alone ------------------------------------------------------------------------------------
    per_peer = max(1, swarm_samples // args.peers)
    accumulate = max(1, args.target_batch_size // args.peers // args.batch_size)
    alone_start = [0.0]
    alone_s: list[float] = [0.0]

    def alone_peer(peer: int) -> None:
        model = make_model().to(device)
        opt = workload.make_optimizer(model.parameters(), lr=args.lr)
        scaler = torch.amp.GradScaler(device.type)
        fed = 0
        if ready.wait(60) == 0:
            alone_start[0] = time.perf_counter()
        ready.wait(60)
        for step, (x, y) in enumerate(stream(peer)):
            if fed >= per_peer:
                break
            with torch.autocast(device.type, dtype=torch.float16):
                loss = workload.loss_fn(model, x, y) / accumulate
            scaler.scale(loss).backward()
            fed += len(x)
            if (step + 1) % accumulate == 0:
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        synchronize()
        if ready.wait(args.deadline) == 0:
            alone_s[0] = time.perf_counter() - alone_start[0]

    _run_threads([partial(alone_peer, i) for i in range(args.peers)], args.deadline)
    alone_rate = per_peer * args.peers / alone_s[0]

    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "peers": args.peers,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "target_batch_size": args.target_batch_size,
        "d_model": args.d_model,
        "layers": args.layers,
        "reuse_grad_buffers": args.reuse_grad_buffers,
        "delay_optimizer_step": args.delay_optimizer_step,
        "swarm_samples_per_s": round(swarm_rate, 1),
        "alone_samples_per_s": round(alone_rate, 1),
        "overhead": round(1 - swarm_rate / alone_rate, 3),
        "final_scale": extra["final_scale"],
        "max_param_difference": max(
            [float((finals[0] - f).abs().max()) for f in finals[1:]], default=0.0
        ),
        "val_loss_before": round(initial_loss, 4),
        "val_loss_after": round(extra["swarm_loss"], 4),
    }
    print(
        f"{result['device']}: {args.peers} peers, float16 AMP: swarm {swarm_rate:.0f} samples/s, "
        f"alone {alone_rate:.0f} samples/s, overhead {result['overhead']:.1%}; "
        f"validation loss {initial_loss:.3f} -> {extra['swarm_loss']:.3f}; "
        f"largest parameter difference between peers: {result['max_param_difference']:.2g}"
    )
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a", encoding="utf-8") as out:
            out.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
