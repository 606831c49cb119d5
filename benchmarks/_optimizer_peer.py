"""One training process of ``benchmarks/optimizer.py``: the workload of
``swarmavg/testing/workload.py`` trained with ``swarmavg.Optimizer``, ``hivemind.Optimizer``,
``swarmavg.DecentralizedSGD`` / ``DecentralizedAdam``, ``swarmavg.optim.DiLoCo``, or alone.

    python benchmarks/_optimizer_peer.py \
        --system swarmavg|hivemind|dsgd|dadam|diloco|local [options]

``--system swarmavg`` runs under the project's Python (``swarmavg.DHT`` + ``swarmavg.Optimizer``),
``--system hivemind`` under a Python with hivemind 1.1.12 (``hivemind.DHT`` +
``hivemind.Optimizer``), ``--system local`` under either (plain torch, no DHT), ``--system
lightning`` under the project's Python with Lightning (``Trainer.fit`` with
``swarmavg.integrations.lightning.SwarmStrategy``, the swarmavg system's arguments, the same
events: see :func:`_train_lightning`). Both swarm systems
get the same keyword arguments: ``dht``, ``run_id``, ``target_batch_size``,
``batch_size_per_step``, ``optimizer`` (a factory: Adam at ``--lr``), ``params``, ``scheduler``
(a factory: ``LambdaLR`` with a linear warmup over ``--warmup-epochs`` epochs, then constant),
``matchmaking_time``, ``averaging_timeout``, the ``delay_*`` flags that are given (the others keep
the library's default) and ``verbose``. ``--system local`` accumulates the gradients of its
batches of ``--batch-size`` until ``--target-batch-size`` samples, then steps Adam and the
scheduler: exactly one process training with batch T (the epoch is one optimizer step there);
``--local-optimizer sgd`` makes it SGD at ``--sgd-lr`` with ``--momentum`` instead of Adam.

The per-step systems (``dsgd``, ``dadam``, ``diloco``) take an optimizer step on every batch of
``--batch-size``; their epoch is only a reporting unit: ``--steps-per-epoch`` local steps
(default ``target_batch_size / (batch_size x num_peers)``, so that an epoch of all the peers
is T samples as for the collaborative optimizer). Their learning rate follows the same warmup
per local step (one local step of a peer stands for one optimizer step of a process alone
with batch ``peers x batch_size``):

- ``--system dsgd``: ``swarmavg.DecentralizedSGD`` (SGD at ``--sgd-lr``, ``--momentum``);
  ``--system dadam``: ``swarmavg.DecentralizedAdam`` (Adam at ``--lr``; the parameters and
  ``exp_avg_sq`` averaged). Both: ``target_group_size=--group-size`` (default the peers),
  ``averaging_steps_period=--averaging-steps-period``, ``timeout=--averaging-timeout``,
  ``averaging_expiration=--matchmaking-time``; the warmup is a ``LambdaLR`` on the wrapped
  torch optimizer stepped per local step (the library's epochs, ``total_steps_in_epoch``, are
  left at a size the run never reaches: no epoch change, no resync).
- ``--system diloco``: ``swarmavg.optim.DiLoCo`` as a hook on an inner Adam at ``--lr`` (the
  warmup as its ``scheduler``, driven by the global step), the outer optimizer SGD at
  ``--outer-lr`` (0.7), ``--outer-momentum`` (0.9), Nesterov, ``sync_every=--sync-every``,
  ``compression`` ``--compression none|fp16`` (``Float16Compression()``), ``matchmaking_time``
  and ``averaging_timeout`` from the flags, ``tracker_opts`` reading the others' records
  every 0.1 s to ``--tracker-refresh`` (1 s; with the tracker's defaults, 0.5-10 s, a peer
  that waited idle for the others read last before they were made, and took its first rounds
  alone). ``--start-delay`` (seconds after the go) lets this peer start later than the go.
- ``--step-compute-ms`` (all three): a sleep per step, standing for a bigger model's forward
  and backward (averaging rounds run meanwhile); ``--wait-for-round`` (dsgd/dadam): after a
  step that asked for a round, ``wait_for_round()`` until its result is written.
- ``--host`` (the swarm systems but lightning, hivemind's too): the address the DHT listens
  on (default 127.0.0.1; a network lab host's address in ``benchmarks/network_training.py``,
  whose ``speed`` mode runs both systems there); ``--probe``:
  every ``epoch`` event carries ``norm`` and ``probe``, a fingerprint of the parameters that
  tells how far two peers' parameters are apart (see :func:`parameter_probe`).
- ``--identity-seed`` (every swarmavg system): the PeerID derives from it and ``--peer``, so
  that the members of a group are in the same order (the same all-reduce plan) in every run;
  ``--ordered-reduction``: a diagnostic that makes the reducers of this process sum in member
  order (see :func:`_order_reductions`).

The workload module is loaded by file path (it imports torch and numpy only), so this script
needs nothing of swarmavg under hivemind's Python. Each peer draws its own stream of batches
(``workload.batches(seed=--data-seed, peer=--peer, num_peers=--num-peers)``); the model starts
from ``--model-seed`` on every peer. ``torch.set_num_threads(1)``.

Protocol: JSON lines on stdout (logs go to stderr), one object per line:

- ``{"event": "ready", "peer", "maddrs", "setup_s", "corpus"}`` once the DHT and the optimizer
  exist (``maddrs``: the DHT's visible addresses, for the others' ``--initial-peers``).
- With ``--wait-go``, the peer then reads one line from stdin, ``{"go": T}``, and starts training
  at ``time.monotonic() == T`` (one clock for every process on Linux); without it, at once.
- ``{"event": "epoch", "peer", "epoch", "t", "samples", "steps", "val_loss"?}`` each time the
  local epoch changes (``t``: seconds since the start; ``samples``, ``steps``: what this peer fed
  to ``step()`` while the previous epoch was current; ``val_loss``: with ``--eval-every k``,
  every k-th epoch, and the last one). Epoch 0 is reported at the start (its ``val_loss``, with
  ``--eval-every``, is that of the initial model).
- ``{"event": "done", "peer", "epoch", "t", "samples", "steps", "timed_out", "val_loss"?,
  "train_s"}`` when the local epoch reached ``--epochs`` (or ``--max-samples`` were fed, or
  ``--deadline`` seconds passed: ``timed_out``). ``val_loss``: with ``--final-eval``. The swarm
  systems of swarmavg add what this peer's averagers did until then: ``bytes_sent``,
  ``bytes_received`` (all-reduce payloads of completed rounds), ``rounds`` (all-reduce rounds
  completed), ``rounds_failed`` (averaging steps that failed), ``rounds_incomplete``,
  ``state_bytes`` (state downloaded and served), ``group_sizes`` (rounds begun, by group
  size); DiLoCo adds ``diloco_rounds`` (averaged, alone, failed, diverged), ``--wait-for-round``
  ``waited`` (the outcomes waited for: succeeded, failed, none).
- Then, with ``--wait-go``, the peer keeps its DHT and optimizer up (so that peers still
  finishing can average with it or load its state) until a line ``stop`` or EOF on stdin (at
  most ``--linger`` seconds), shuts down and prints ``{"event": "exit", "shutdown_s"}``. With
  ``--keep-stepping`` it goes on training meanwhile (those steps are not counted), as a peer of
  a longer run would: a peer that is done and stops stepping leaves a straggler alone in its
  last epoch (hivemind's then waits ``averaging_timeout`` for a group).
- ``{"event": "error", "error"}`` and exit status 3 when the system cannot run (e.g.
  ``swarmavg.Optimizer`` is missing); other failures raise (exit status 1).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import select
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

WORKLOAD_PATH = Path(__file__).resolve().parents[1] / "swarmavg" / "testing" / "workload.py"


def load_workload() -> ModuleType:
    """``swarmavg/testing/workload.py`` as a module of its own (no swarmavg import)."""
    spec = importlib.util.spec_from_file_location("_swarmavg_workload", WORKLOAD_PATH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def emit(**record: Any) -> None:
    print(json.dumps(record), flush=True)


#: dimensions of :func:`parameter_probe`'s projection
PROBE_DIMS = 16
_probe_matrix: torch.Tensor | None = None


def parameter_probe(model: torch.nn.Module) -> dict[str, Any]:
    """A fingerprint of the model's parameters, comparable between peers: ``norm`` (L2 of
    all parameters) and ``probe``, their projection on :data:`PROBE_DIMS` fixed random
    directions (Gaussian, seed 0, scaled by ``1/sqrt(PROBE_DIMS)``: the distance between two
    peers' probes estimates the distance between their parameters, within ~25% here)."""
    global _probe_matrix
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    if _probe_matrix is None or _probe_matrix.shape[0] != flat.numel():
        generator = torch.Generator().manual_seed(0)
        _probe_matrix = torch.randn(flat.numel(), PROBE_DIMS, generator=generator)
        _probe_matrix /= PROBE_DIMS**0.5
    probe = (flat.double() @ _probe_matrix.double()).tolist()
    return {"norm": float(flat.double().norm()), "probe": probe}


def warmup_lambda(warmup_epochs: int) -> Any:
    """The learning-rate factor per epoch: linear warmup over ``warmup_epochs``, then 1."""

    def factor(epoch: int) -> float:
        return min(1.0, (epoch + 1) / warmup_epochs) if warmup_epochs > 0 else 1.0

    return factor


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--system", choices=SYSTEMS, required=True)
    p.add_argument("--peer", type=int, default=0)
    p.add_argument("--num-peers", type=int, default=1)
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--run-id", default="bench")
    p.add_argument("--target-batch-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16, help="samples per step()")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--max-samples", type=int, default=0, help="stop after feeding this many")
    p.add_argument("--deadline", type=float, default=600.0, help="seconds of training at most")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--matchmaking-time", type=float, default=5.0)
    p.add_argument("--averaging-timeout", type=float, default=30.0)
    for flag in ("delay-optimizer-step", "delay-grad-averaging", "delay-state-averaging"):
        p.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--eval-every", type=int, default=0, help="epochs; 0: never during training")
    p.add_argument("--final-eval", action="store_true")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--model-seed", type=int, default=0)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--stdlib", default=None, help="the corpus root (default: this Python's)")
    p.add_argument("--wait-go", action="store_true")
    p.add_argument("--linger", type=float, default=60.0)
    p.add_argument(
        "--keep-stepping",
        action="store_true",
        help="after done, go on training (uncounted) until told to stop, as in a longer run",
    )
    p.add_argument("--startup-timeout", type=float, default=120.0)
    p.add_argument("--host", default="127.0.0.1", help="swarm systems: the DHT's address")
    p.add_argument(
        "--probe",
        action="store_true",
        help="epoch events carry a fingerprint of the parameters (see parameter_probe)",
    )
    p.add_argument("--local-optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--sgd-lr", type=float, default=0.1, help="SGD (dsgd, --local-optimizer sgd)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum")
    p.add_argument("--steps-per-epoch", type=int, default=0, help="per-step systems; 0: T/(b x n)")
    p.add_argument("--group-size", type=int, default=0, help="dsgd/dadam; 0: --num-peers")
    p.add_argument("--averaging-steps-period", type=int, default=4, help="dsgd/dadam")
    p.add_argument("--sync-every", type=int, default=10, help="diloco: H")
    p.add_argument("--compression", choices=("none", "fp16"), default="none", help="diloco's Δ")
    p.add_argument("--outer-lr", type=float, default=0.7, help="diloco")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="diloco (Nesterov)")
    p.add_argument("--start-delay", type=float, default=0.0, help="s after the go (--wait-go)")
    p.add_argument("--tracker-refresh", type=float, default=1.0, help="diloco: max_refresh_period")
    p.add_argument(
        "--identity-seed",
        type=int,
        default=-1,
        help="swarmavg peers: a PeerID derived from this seed and --peer (-1: a random one)",
    )
    p.add_argument(
        "--step-compute-ms",
        type=float,
        default=0.0,
        help="per-step systems: sleep this long per step (a bigger model's compute)",
    )
    p.add_argument(
        "--ordered-reduction",
        action="store_true",
        help="diagnostic: reducers sum the members' values in member order, not as they "
        "arrive (float32 sums then do not depend on timing)",
    )
    p.add_argument(
        "--wait-for-round",
        action="store_true",
        help="dsgd/dadam: after a step that asked for a round, wait until it is written",
    )
    args = p.parse_args(argv)
    if args.steps_per_epoch <= 0:
        per_epoch = args.target_batch_size // (args.batch_size * max(1, args.num_peers))
        args.steps_per_epoch = max(1, per_epoch)
    return args


# -- the systems ----------------------------------------------------------------------------------

#: the collaborative optimizers (an epoch is the swarm's T samples)
COLLABORATIVE = ("swarmavg", "hivemind")
#: the optimizers whose peers step on every batch
PER_STEP = ("dsgd", "dadam", "diloco")
SYSTEMS = (*COLLABORATIVE, *PER_STEP, "local", "lightning")


class _Local:
    """Training alone: accumulate ``batch_size`` batches until ``target`` samples, then step."""

    def __init__(self, model: torch.nn.Module, args: argparse.Namespace) -> None:
        self.opt: torch.optim.Optimizer
        if args.local_optimizer == "sgd":
            self.opt = torch.optim.SGD(model.parameters(), lr=args.sgd_lr, momentum=args.momentum)
        else:
            self.opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.opt, warmup_lambda(args.warmup_epochs)
        )
        self.target = args.target_batch_size
        self.accumulated = 0
        self.local_epoch = 0

    def backward(self, loss: torch.Tensor, batch: int) -> None:
        (loss * (batch / self.target)).backward()

    def step(self, batch: int) -> None:
        self.accumulated += batch
        if self.accumulated >= self.target:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.accumulated = 0
            self.local_epoch += 1

    def traffic(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        pass


def _averager_traffic(metrics: Any) -> dict[str, Any]:
    """What one ``swarmavg`` averager did (an ``AveragerMetrics`` snapshot); ``group_sizes``:
    the rounds that began, by the size of their group (``{"4": 40}``)."""
    cumulative = dict(metrics.group_size_histogram)
    group_sizes: dict[str, int] = {}
    below = 0
    for bound in sorted(cumulative):
        if cumulative[bound] > below:
            group_sizes[str(bound)] = cumulative[bound] - below
        below = cumulative[bound]
    return {
        "bytes_sent": int(metrics.bytes_sent),
        "bytes_received": int(metrics.bytes_received),
        "rounds": int(metrics.rounds_completed),
        "rounds_failed": int(metrics.steps_failed),
        "rounds_incomplete": int(metrics.rounds_incomplete),
        "state_bytes": int(metrics.state_bytes_served + metrics.state_bytes_downloaded),
        "group_sizes": group_sizes,
    }


def _order_reductions() -> None:
    """Diagnostic (``--ordered-reduction``): make every ``PartReducer`` of this process hold
    the values it receives until all its senders delivered, then sum them in member order.
    The library sums in arrival order: float32 addition is not associative, so the last bit
    of a mean depends on which member's part arrived first (timing), and a training run
    amplifies that. This costs a copy of every part received; it is not for production."""
    import numpy as np

    from swarmavg.proto import allreduce

    reducer = allreduce.PartReducer
    original = reducer.add
    original_nothing = reducer.add_nothing

    def flush(self: Any) -> bool:
        pending = self.__dict__.get("_bench_pending")
        clipped = False
        if pending and self.done:
            self.received.difference_update(pending)
            for member in sorted(pending):
                clipped |= original(self, member, *pending[member])
            pending.clear()
        return clipped

    def add_nothing(self: Any, sender: int) -> None:
        original_nothing(self, sender)
        flush(self)

    def add(
        self: Any, sender: int, values: Any, weight: float, max_norm: float | None = None
    ) -> bool:
        pending: dict[int, tuple[Any, float, float | None]] = self.__dict__.setdefault(
            "_bench_pending", {}
        )
        if sender not in self.expected or sender in self.received or sender in pending:
            return original(self, sender, values, weight, max_norm)  # (raises as it would)
        pending[sender] = (np.array(values, copy=True), weight, max_norm)
        self.received.add(sender)
        return flush(self)

    reducer.add = add  # type: ignore[method-assign]
    reducer.add_nothing = add_nothing  # type: ignore[method-assign]


def _swarmavg_dht(args: argparse.Namespace) -> Any:
    import swarmavg

    if args.ordered_reduction:
        _order_reductions()
    identity = None
    if args.identity_seed >= 0:  # (the same PeerIDs, so the same order of members, every run)
        from swarmavg.identity import Identity

        seed = hashlib.sha256(f"bench-identity:{args.identity_seed}:{args.peer}".encode())
        identity = Identity.from_private_bytes(seed.digest())
    return swarmavg.DHT(
        initial_peers=args.initial_peers,
        host=args.host,
        port=0,
        startup_timeout=args.startup_timeout,
        identity=identity,
    )


class _PerStep:
    """``DecentralizedSGD`` / ``DecentralizedAdam`` / ``DiLoCo``: an optimizer step on every
    batch; the reported epoch is ``--steps-per-epoch`` local steps."""

    def __init__(self, model: torch.nn.Module, args: argparse.Namespace) -> None:
        try:
            from swarmavg.compression import Float16Compression
            from swarmavg.optim import DecentralizedAdam, DecentralizedSGD, DiLoCo
        except ImportError as exc:
            raise SystemUnavailable(f"{args.system} is not available here: {exc}") from exc
        self.system = args.system
        self.steps = 0
        self.steps_per_epoch = args.steps_per_epoch
        self.step_compute_s = max(0.0, args.step_compute_ms) / 1000
        self.wait_for_round = args.wait_for_round and args.system != "diloco"
        self.period = args.averaging_steps_period
        self.round_timeout = args.averaging_timeout
        #: what the rounds waited for with --wait-for-round did: succeeded, failed, none
        self.waited = {"succeeded": 0, "failed": 0, "none": 0}
        warmup = warmup_lambda(args.warmup_epochs)
        self.dht = _swarmavg_dht(args)
        self.scheduler: Any = None
        try:
            if args.system == "diloco":
                self.inner = torch.optim.Adam(model.parameters(), lr=args.lr)
                outer_lr, momentum = args.outer_lr, args.outer_momentum
                compression = Float16Compression() if args.compression == "fp16" else None
                self.opt: Any = DiLoCo(
                    model.parameters(),
                    inner_optimizer=self.inner,
                    outer_optimizer=lambda params: torch.optim.SGD(
                        params, lr=outer_lr, momentum=momentum, nesterov=momentum > 0
                    ),
                    dht=self.dht,
                    run_id=args.run_id,
                    sync_every=args.sync_every,
                    scheduler=lambda inner: torch.optim.lr_scheduler.LambdaLR(inner, warmup),
                    batch_size=args.batch_size,
                    compression=compression,
                    matchmaking_time=args.matchmaking_time,
                    averaging_timeout=args.averaging_timeout,
                    # (reads the others' records often: a peer made before the others must
                    # see them before its first round, else it takes it alone)
                    tracker_opts={
                        "min_refresh_period": min(0.1, args.tracker_refresh),
                        "max_refresh_period": args.tracker_refresh,
                    },
                )
            else:
                common: dict[str, Any] = dict(
                    dht=self.dht,
                    prefix=args.run_id,
                    target_group_size=args.group_size or args.num_peers,
                    averaging_steps_period=args.averaging_steps_period,
                    timeout=args.averaging_timeout,
                    verbose=args.verbose,
                    total_steps_in_epoch=1 << 40,  # (never reached: no epoch change, no resync)
                    averaging_expiration=args.matchmaking_time,
                )
                if args.system == "dsgd":
                    self.opt = DecentralizedSGD(
                        model.parameters(), lr=args.sgd_lr, momentum=args.momentum, **common
                    )
                else:
                    self.opt = DecentralizedAdam(model.parameters(), lr=args.lr, **common)
                self.inner = self.opt.opt
                self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.inner, warmup)
        except BaseException:
            self.dht.shutdown()
            raise

    @property
    def local_epoch(self) -> int:
        return self.steps // self.steps_per_epoch

    def backward(self, loss: torch.Tensor, batch: int) -> None:
        loss.backward()

    def step(self, batch: int) -> None:
        if self.step_compute_s:  # (stands for the forward/backward of a bigger model)
            time.sleep(self.step_compute_s)
        if self.system == "diloco":
            self.inner.step()  # (DiLoCo's hook: every sync_every-th step runs a round)
            self.inner.zero_grad()
        else:
            self.opt.step()
            self.opt.zero_grad()
            self.scheduler.step()
            if self.wait_for_round and (self.steps + 1) % self.period == 0:
                # (this step asked for a round: its result is in the parameters before the
                # next step, as in synchronous training)
                try:
                    outcome = self.opt.wait_for_round(timeout=self.round_timeout + 10)
                except TimeoutError:
                    outcome = None
                key = "none" if outcome is None else "succeeded" if outcome.succeeded else "failed"
                self.waited[key] += 1
        self.steps += 1

    def maddrs(self) -> list[str]:
        return [str(a) for a in self.dht.get_visible_maddrs()]

    def traffic(self) -> dict[str, Any]:
        traffic: dict[str, Any] = _averager_traffic(self.opt.averager.metrics)
        if self.system == "diloco":  # (its rounds: averaged, alone, failed, diverged)
            schedule = self.opt.schedule
            traffic["diloco_rounds"] = {
                what: int(getattr(schedule, f"rounds_{what}"))
                for what in ("averaged", "alone", "failed", "diverged")
            }
        if self.wait_for_round:
            traffic["waited"] = dict(self.waited)
        return traffic

    def shutdown(self) -> None:
        try:
            self.opt.shutdown()
        finally:
            self.dht.shutdown()


class _Swarm:
    """``swarmavg.Optimizer`` or ``hivemind.Optimizer`` over a DHT of the same system."""

    def __init__(self, model: torch.nn.Module, args: argparse.Namespace) -> None:
        if args.system == "hivemind":
            import hivemind

            self.dht = hivemind.DHT(
                initial_peers=args.initial_peers or None,
                host_maddrs=[f"/ip4/{args.host}/tcp/0"],
                start=True,
                await_ready=False,
            )
            self.dht.wait_until_ready(args.startup_timeout)
            optimizer_class: Any = hivemind.Optimizer
        else:
            optimizer_class = _swarmavg_optimizer()
            self.dht = _swarmavg_dht(args)
        lr, warmup = args.lr, args.warmup_epochs
        delays = {
            name: getattr(args, name)
            for name in ("delay_optimizer_step", "delay_grad_averaging", "delay_state_averaging")
            if getattr(args, name) is not None
        }
        try:
            self.opt = optimizer_class(
                dht=self.dht,
                run_id=args.run_id,
                target_batch_size=args.target_batch_size,
                batch_size_per_step=args.batch_size,
                optimizer=lambda params: torch.optim.Adam(params, lr=lr),
                params=model.parameters(),
                scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda(warmup)),
                matchmaking_time=args.matchmaking_time,
                averaging_timeout=args.averaging_timeout,
                verbose=args.verbose,
                **delays,
            )
        except BaseException:
            self.dht.shutdown()
            raise

    @property
    def local_epoch(self) -> int:
        return int(self.opt.local_epoch)

    def backward(self, loss: torch.Tensor, batch: int) -> None:
        loss.backward()

    def step(self, batch: int) -> None:
        self.opt.step()
        self.opt.zero_grad()

    def maddrs(self) -> list[str]:
        return [str(a) for a in self.dht.get_visible_maddrs()]

    def traffic(self) -> dict[str, Any]:
        return _optimizer_traffic(self.opt)

    def shutdown(self) -> None:
        try:
            self.opt.shutdown()
        finally:
            self.dht.shutdown()


def _optimizer_traffic(opt: Any) -> dict[str, Any]:
    """What both averagers of a ``swarmavg.Optimizer`` did ({} for hivemind's: no metrics)."""
    metrics = getattr(opt, "metrics", None)
    if metrics is None:
        return {}
    parts = [m for m in (metrics.gradients, metrics.state) if m is not None]
    totals: dict[str, Any] = {}
    for part in parts:
        for key, value in _averager_traffic(part).items():
            if isinstance(value, dict):  # (group sizes: counts per size)
                merged = totals.setdefault(key, {})
                for size, count in value.items():
                    merged[size] = merged.get(size, 0) + count
            else:
                totals[key] = totals.get(key, 0) + value
    return totals


class SystemUnavailable(RuntimeError):
    pass


def _swarmavg_optimizer() -> Any:
    try:
        import swarmavg
    except ImportError as exc:
        raise SystemUnavailable(f"swarmavg cannot be imported here: {exc}") from exc
    for owner, name in ((swarmavg, "Optimizer"), (None, "swarmavg.optim")):
        try:
            module = owner if owner is not None else importlib.import_module(name)
            return module.Optimizer
        except (ImportError, AttributeError):
            continue
    raise SystemUnavailable(
        "swarmavg.Optimizer is not available in this checkout yet (swarmavg/optim/optimizer.py)"
    )


# -- the loop -------------------------------------------------------------------------------------


def _stdin_line(timeout: float) -> str | None:
    """One line of stdin within ``timeout`` seconds; ``""`` at EOF, ``None`` on timeout."""
    ready, _, _ = select.select([sys.stdin], [], [], max(0.0, timeout))
    if not ready:
        return None
    return sys.stdin.readline()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.verbose:  # (the optimizer's INFO lines, timed, into this peer's stderr log)
        logging.basicConfig(
            level=logging.INFO,
            format="%(asctime)s.%(msecs)03d %(threadName)s %(name)s: %(message)s",
            datefmt="%H:%M:%S",
        )
        # (to trace a failure: SWARMAVG_DEBUG_LOGGERS=swarmavg.aio.state,... at DEBUG)
        for name in filter(None, os.environ.get("SWARMAVG_DEBUG_LOGGERS", "").split(",")):
            logging.getLogger(name).setLevel(logging.DEBUG)
    torch.set_num_threads(1)
    began = time.perf_counter()
    workload = load_workload()
    corpus = workload.load_corpus(root=args.stdlib)
    model = workload.make_model(args.model_seed)
    if args.system == "lightning":
        return _train_lightning(args, workload, corpus, model, began)
    try:
        system: Any
        if args.system in COLLABORATIVE:
            system = _Swarm(model, args)
        elif args.system in PER_STEP:
            system = _PerStep(model, args)
        else:
            system = _Local(model, args)
    except SystemUnavailable as exc:
        emit(event="error", peer=args.peer, error=str(exc))
        return 3
    try:
        return _train(args, workload, corpus, model, system, began)
    finally:
        shutdown_began = time.perf_counter()
        system.shutdown()
        emit(event="exit", peer=args.peer, shutdown_s=time.perf_counter() - shutdown_began)


def _train(
    args: argparse.Namespace,
    workload: ModuleType,
    corpus: Any,
    model: torch.nn.Module,
    system: Any,
    began: float,
) -> int:
    maddrs = system.maddrs() if isinstance(system, _Swarm | _PerStep) else []
    emit(
        event="ready",
        peer=args.peer,
        maddrs=maddrs,
        setup_s=time.perf_counter() - began,
        corpus=corpus.fingerprint,
    )
    if args.wait_go:
        line = _stdin_line(args.startup_timeout + 600)
        if not line:
            raise SystemExit("no go from the driver")
        go = float(json.loads(line)["go"]) + args.start_delay
        time.sleep(max(0.0, go - time.monotonic()))
    start = time.monotonic()

    def evaluate() -> float:
        return float(workload.evaluate(model, corpus, num_batches=args.eval_batches))

    first: dict[str, Any] = {}
    if args.eval_every:
        first["val_loss"] = evaluate()
    if args.probe:
        first.update(parameter_probe(model))
    emit(
        event="epoch", peer=args.peer, epoch=system.local_epoch, t=0.0, samples=0, steps=0, **first
    )
    stream = workload.batches(
        corpus, args.batch_size, seed=args.data_seed, peer=args.peer, num_peers=args.num_peers
    )
    samples = steps = epoch_samples = epoch_steps = 0
    epoch = system.local_epoch
    timed_out = False
    while epoch < args.epochs and not (args.max_samples and samples >= args.max_samples):
        if time.monotonic() - start > args.deadline:
            timed_out = True
            break
        x, y = next(stream)
        loss = workload.loss_fn(model, x, y)
        system.backward(loss, args.batch_size)
        system.step(args.batch_size)
        samples += args.batch_size
        steps += 1
        epoch_samples += args.batch_size
        epoch_steps += 1
        now_epoch = system.local_epoch
        if now_epoch != epoch:
            epoch = now_epoch
            record: dict[str, Any] = {}
            if args.eval_every and (epoch % args.eval_every == 0 or epoch >= args.epochs):
                record["val_loss"] = evaluate()
            if args.probe:
                record.update(parameter_probe(model))
            emit(
                event="epoch",
                peer=args.peer,
                epoch=epoch,
                t=time.monotonic() - start,
                samples=epoch_samples,
                steps=epoch_steps,
                **record,
            )
            epoch_samples = epoch_steps = 0
    train_s = time.monotonic() - start
    final: dict[str, Any] = dict(system.traffic())
    if args.final_eval:
        final["val_loss"] = evaluate()
    emit(
        event="done",
        peer=args.peer,
        epoch=epoch,
        t=train_s,
        samples=samples,
        steps=steps,
        timed_out=timed_out,
        train_s=train_s,
        **final,
    )
    if args.wait_go:
        deadline = time.monotonic() + args.linger
        while (left := deadline - time.monotonic()) > 0:
            line = _stdin_line(0.0 if args.keep_stepping else left)
            if line is not None and (line == "" or line.strip() == "stop"):
                break
            if args.keep_stepping:  # as a peer of a run that goes on would (not counted)
                x, y = next(stream)
                system.backward(workload.loss_fn(model, x, y), args.batch_size)
                system.step(args.batch_size)
            elif line is None:
                break
    return 0 if not timed_out else 2


# -- Lightning ------------------------------------------------------------------------------------


def _train_lightning(
    args: argparse.Namespace,
    workload: ModuleType,
    corpus: Any,
    model: torch.nn.Module,
    began: float,
) -> int:
    """``--system lightning``: ``lightning.pytorch.Trainer.fit`` with ``SwarmStrategy`` (the
    ``swarmavg`` system's arguments: Adam at ``--lr`` and the warmup ``LambdaLR`` from
    ``configure_optimizers``, ``target_batch_size``, ``batch_size``, ``matchmaking_time``,
    ``averaging_timeout``, the ``delay_*`` flags given, a ``swarmavg.DHT`` on 127.0.0.1), the same
    protocol: ``ready`` once the optimizer is wrapped (at the first ``training_step``, before its
    forward pass), the clock starts at the go, the same events from the batch hooks."""
    try:
        import lightning.pytorch as pl

        import swarmavg
        from swarmavg.integrations.lightning import SwarmStrategy
    except ImportError as exc:
        emit(event="error", peer=args.peer, error=f"lightning is not available here: {exc}")
        return 3
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    stream = workload.batches(
        corpus, args.batch_size, seed=args.data_seed, peer=args.peer, num_peers=args.num_peers
    )
    lr, warmup = args.lr, args.warmup_epochs

    class Batches(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return stream

    state: dict[str, Any] = {
        "start": None,
        "epoch": 0,
        "samples": 0,
        "steps": 0,
        "epoch_samples": 0,
        "epoch_steps": 0,
        "done": False,
        "timed_out": False,
        "linger_until": None,
    }

    def evaluate() -> float:
        return float(workload.evaluate(model, corpus, num_batches=args.eval_batches))

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(Batches(), batch_size=None)

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lambda(warmup))
            return [optimizer], [scheduler]

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if state["start"] is None:
                self._begin()
            return workload.loss_fn(self.model, *batch)

        def _begin(self) -> None:
            strategy = self.trainer.strategy
            assert strategy.dht is not None
            emit(
                event="ready",
                peer=args.peer,
                maddrs=[str(a) for a in strategy.dht.get_visible_maddrs()],
                setup_s=time.perf_counter() - began,
                corpus=corpus.fingerprint,
            )
            if args.wait_go:
                line = _stdin_line(args.startup_timeout + 600)
                if not line:
                    raise SystemExit("no go from the driver")
                go = float(json.loads(line)["go"]) + args.start_delay
                time.sleep(max(0.0, go - time.monotonic()))
            state["start"] = time.monotonic()
            state["epoch"] = strategy.local_epoch
            first: dict[str, Any] = {"val_loss": evaluate()} if args.eval_every else {}
            emit(
                event="epoch",
                peer=args.peer,
                epoch=state["epoch"],
                t=0.0,
                samples=0,
                steps=0,
                **first,
            )

        def on_train_batch_end(self, *unused: Any) -> None:
            if state["done"]:
                self._linger()
                return
            state["samples"] += args.batch_size
            state["steps"] += 1
            state["epoch_samples"] += args.batch_size
            state["epoch_steps"] += 1
            epoch = self.trainer.strategy.local_epoch
            if epoch != state["epoch"]:
                state["epoch"] = epoch
                record: dict[str, Any] = {}
                if args.eval_every and (epoch % args.eval_every == 0 or epoch >= args.epochs):
                    record["val_loss"] = evaluate()
                emit(
                    event="epoch",
                    peer=args.peer,
                    epoch=epoch,
                    t=time.monotonic() - state["start"],
                    samples=state["epoch_samples"],
                    steps=state["epoch_steps"],
                    **record,
                )
                state["epoch_samples"] = state["epoch_steps"] = 0
            elapsed = time.monotonic() - state["start"]
            state["timed_out"] = elapsed > args.deadline
            if not (
                epoch >= args.epochs
                or (args.max_samples and state["samples"] >= args.max_samples)
                or state["timed_out"]
            ):
                return
            state["done"] = True
            optimizer = self.trainer.strategy.optimizer
            final: dict[str, Any] = _optimizer_traffic(optimizer)
            if args.final_eval:
                final["val_loss"] = evaluate()
            emit(
                event="done",
                peer=args.peer,
                epoch=epoch,
                t=elapsed,
                samples=state["samples"],
                steps=state["steps"],
                timed_out=state["timed_out"],
                train_s=elapsed,
                **final,
            )
            state["linger_until"] = time.monotonic() + args.linger
            if not args.wait_go:
                self.trainer.should_stop = True
            elif not args.keep_stepping:  # (wait here, not stepping, as the other systems)
                _stdin_line(args.linger)
                self.trainer.should_stop = True

        def _linger(self) -> None:
            line = _stdin_line(0.0)
            if (
                line is not None and (line == "" or line.strip() == "stop")
            ) or time.monotonic() > state["linger_until"]:
                self.trainer.should_stop = True

    delays = {
        name: getattr(args, name)
        for name in ("delay_optimizer_step", "delay_grad_averaging", "delay_state_averaging")
        if getattr(args, name) is not None
    }
    dht = swarmavg.DHT(
        initial_peers=args.initial_peers,
        host="127.0.0.1",
        port=0,
        startup_timeout=args.startup_timeout,
    )
    try:
        strategy = SwarmStrategy(
            target_batch_size=args.target_batch_size,
            run_id=args.run_id,
            matchmaking_time=args.matchmaking_time,
            averaging_timeout=args.averaging_timeout,
            verbose=args.verbose,
            batch_size=args.batch_size,
            dht=dht,
            **delays,
        )
        trainer = pl.Trainer(
            strategy=strategy,
            accelerator="cpu",
            max_epochs=1,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Module())  # (its teardown shuts the optimizer down)
    finally:
        stopping = time.perf_counter()
        dht.shutdown()
        emit(event="exit", peer=args.peer, shutdown_s=time.perf_counter() - stopping)
    return 0 if not state["timed_out"] else 2


if __name__ == "__main__":
    sys.exit(main())
