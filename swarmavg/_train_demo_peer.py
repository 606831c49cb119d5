"""One process of ``swarmavg demo`` (a child process): ``python -m swarmavg._train_demo_peer
CONFIG``.

It trains the workload of :mod:`swarmavg.testing.workload` (a byte-level transformer on
Python's standard library), either as a peer of the swarm (``"role": "peer"``: a
``swarmavg.DHT`` on loopback and the optimizer named by ``"optimizer"``, one of
:data:`OPTIMIZERS`) or alone (``"role": "alone"``: Adam stepped once per ``target`` samples,
the gradients of its batches accumulated in between: one process with the swarm's global
batch). CONFIG is a JSON object (its keys: see ``_peer_config`` in :mod:`swarmavg._train_demo`).

It talks to the demo process in JSON lines, one object per line, and nothing else:

* commands on stdin: ``{"cmd": "join", "initial_peers": [...]}`` (every peer but the first,
  before it starts its DHT), ``{"cmd": "go"}`` (start training) and ``{"cmd": "stop"}``; end of
  file (the demo is gone) stops it too;
* events on stdout: ``{"event": "loaded"}`` (torch imported, model made),
  ``{"event": "listening", "maddrs": [...]}`` (the first peer, once its DHT runs),
  ``{"event": "ready"}``; once training: ``{"event": "progress", ...}`` every
  ``report_interval`` seconds (epoch, samples/s, training loss, last group size, peers the
  swarm counts), ``{"event": "epoch", ...}`` at each new epoch (the epoch's wall time split
  into compute, averaging and evaluation seconds; ``val_loss`` every ``eval_every`` epochs and
  at the last), ``{"event": "done", ...}`` at epoch ``epochs``; then, until ``stop``, a peer
  goes on stepping (uncounted, as a peer of a longer run would), so that the peers still in
  their last epoch find groups; ``{"event": "error", "error": "..."}`` before it exits with
  status 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from swarmavg._demo_peer import _Commands, child_main

if TYPE_CHECKING:
    import torch

    from swarmavg.dht import DHT

__all__ = ["OPTIMIZERS", "DemoOptimizer", "main"]


@dataclass(frozen=True)
class DemoOptimizer:
    """An optimizer the demo can train with.

    :ivar description: one line for ``--help`` and the demo's first line.
    :ivar make: ``make(dht, model, config)``: the optimizer, over ``model``'s parameters, with
        ``local_epoch`` (the epoch it is at) and ``shutdown()``; ``last_epoch_info`` (a dict
        with ``seconds``: the epoch's end, and ``grad_group``: the gradient round's group size
        or ``None``) and ``tracker.global_progress.num_peers`` where it has them.
    """

    description: str
    make: Callable[[DHT, torch.nn.Module, dict[str, Any]], Any]


def _make_hivemind(dht: DHT, model: torch.nn.Module, config: dict[str, Any]) -> Any:
    import torch

    import swarmavg

    lr = float(config["lr"])
    return swarmavg.Optimizer(
        dht=dht,
        run_id=config["run_id"],
        target_batch_size=config["target"],
        batch_size_per_step=config["batch"],
        optimizer=lambda params: torch.optim.Adam(params, lr=lr),
        params=model.parameters(),
        matchmaking_time=config["matchmaking_time"],
        averaging_timeout=config["averaging_timeout"],
    )


#: The optimizers ``--optimizer`` chooses from, by name (add one here to offer it).
OPTIMIZERS: dict[str, DemoOptimizer] = {
    "hivemind": DemoOptimizer(
        "swarmavg.Optimizer: hivemind.Optimizer's algorithm (the peers fill one global batch "
        "together, average its gradients and all take the same Adam step)",
        _make_hivemind,
    ),
}


def _emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


class _Alone:
    """Training alone with the swarm's global batch: gradients of ``batch``-sample steps are
    accumulated (scaled) until ``target`` samples, then one Adam step: an epoch."""

    def __init__(self, model: torch.nn.Module, config: dict[str, Any]) -> None:
        import torch

        self.opt = torch.optim.Adam(model.parameters(), lr=float(config["lr"]))
        self.target: int = config["target"]
        self.accumulated = 0
        self.local_epoch = 0
        self.last_epoch_info: dict[str, Any] = {}

    def scale(self, batch: int) -> float:
        return batch / self.target

    def step(self, batch: int) -> None:
        self.accumulated += batch
        if self.accumulated >= self.target:
            started = time.perf_counter()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.accumulated = 0
            self.local_epoch += 1
            self.last_epoch_info = {"seconds": time.perf_counter() - started, "grad_group": 1}

    def shutdown(self) -> None:
        pass


class _Swarm:
    """A peer of the swarm: its DHT and the chosen optimizer."""

    def __init__(self, dht: DHT, model: torch.nn.Module, config: dict[str, Any]) -> None:
        self.dht = dht
        self.opt = OPTIMIZERS[config["optimizer"]].make(dht, model, config)

    @property
    def local_epoch(self) -> int:
        return int(self.opt.local_epoch)

    @property
    def last_epoch_info(self) -> dict[str, Any]:
        info: dict[str, Any] = getattr(self.opt, "last_epoch_info", {})
        return info

    def swarm_peers(self) -> int | None:
        tracker = getattr(self.opt, "tracker", None)
        return None if tracker is None else int(tracker.global_progress.num_peers)

    def scale(self, batch: int) -> float:
        return 1.0

    def step(self, batch: int) -> None:
        self.opt.step()
        self.opt.zero_grad()

    def shutdown(self) -> None:
        self.opt.shutdown()


def _wait_for(commands: _Commands, name: str, timeout: float) -> dict[str, Any] | None:
    """The command ``name``; ``None`` if told to stop (or the demo is gone) first.

    :raises ValueError: another command came.
    :raises TimeoutError: none within ``timeout`` seconds.
    """
    command = commands.next(timeout)
    if command is None or command.get("cmd") == "stop":
        return None
    if command.get("cmd") != name:
        raise ValueError(f"expected a {name} command, got {command!r}")
    return command


def _run(config: dict[str, Any], commands: _Commands) -> None:
    import torch

    torch.set_num_threads(1)  # the processes share this machine's cores
    if config["role"] == "alone":
        # the swarm comes first; this process takes the cores the peers leave
        with contextlib.suppress(OSError):
            os.nice(10)

    import swarmavg
    from swarmavg.testing import workload

    index: int = config["index"]
    command_timeout: float = config["command_timeout"]
    corpus = workload.load_corpus()
    model = workload.make_model(config["model_seed"])
    _emit(event="loaded")

    dht = None
    if config["role"] == "peer":
        dht_options: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": 0,
            "transport": config["transport"],
            "startup_timeout": config["startup_timeout"],
        }
        if index == 0:
            dht = swarmavg.DHT(**dht_options)
            _emit(event="listening", maddrs=[str(a) for a in dht.get_visible_maddrs()])
        else:
            join = _wait_for(commands, "join", command_timeout)
            if join is None:
                return
            dht = swarmavg.DHT(initial_peers=join["initial_peers"], **dht_options)
    try:
        system: Any = _Alone(model, config) if dht is None else _Swarm(dht, model, config)
        try:
            _emit(event="ready")
            if _wait_for(commands, "go", command_timeout) is not None:
                _train(config, commands, workload, corpus, model, system)
        finally:
            system.shutdown()
    finally:
        if dht is not None:
            dht.shutdown()
    _emit(event="stopped")


def _train(
    config: dict[str, Any],
    commands: _Commands,
    workload: Any,
    corpus: Any,
    model: torch.nn.Module,
    system: Any,
) -> None:
    """Train until epoch ``epochs``, reporting; then step on (uncounted) until told to stop."""
    batch: int = config["batch"]
    epochs: int = config["epochs"]
    eval_every: int = config["eval_every"]
    interval: float = config["report_interval"]
    stream = workload.batches(
        corpus, batch, seed=config["data_seed"], peer=config["index"], num_peers=config["streams"]
    )

    def evaluate() -> tuple[float, float]:
        began = time.perf_counter()
        loss = float(workload.evaluate(model, corpus, num_batches=config["eval_batches"]))
        return loss, time.perf_counter() - began

    start = time.monotonic()
    val_loss, _ = evaluate()
    epoch = system.local_epoch
    _emit(event="epoch", epoch=epoch, t=0.0, val_loss=val_loss, seconds=0.0, averaging=0.0)
    epoch_started = time.monotonic()
    samples = 0
    window: list[tuple[float, int]] = [(time.monotonic(), 0)]  # (time, samples) for samples/s
    loss_ema: float | None = None
    group: int | None = None
    last_report = 0.0
    while True:
        x, y = next(stream)
        loss = workload.loss_fn(model, x, y)
        (loss * system.scale(batch)).backward()
        system.step(batch)
        samples += batch
        value = float(loss)
        loss_ema = value if loss_ema is None else 0.9 * loss_ema + 0.1 * value
        now = time.monotonic()
        if system.local_epoch != epoch and epoch < epochs:
            epoch = system.local_epoch
            info = system.last_epoch_info
            group = info.get("grad_group") or 1
            record: dict[str, Any] = {}
            evaluated = 0.0
            if epoch >= epochs or epoch % eval_every == 0:
                record["val_loss"], evaluated = evaluate()
            _emit(
                event="epoch",
                epoch=epoch,
                t=now - start,
                seconds=now - epoch_started,
                averaging=float(info.get("seconds") or 0.0),
                group=group,
                eval_seconds=evaluated,
                **record,
            )
            epoch_started = time.monotonic()
            if epoch >= epochs:
                _emit(event="done", epoch=epoch, t=now - start, samples=samples, loss=loss_ema)
        if now - last_report >= interval:
            window = [w for w in window if now - w[0] <= 3.0] + [(now, samples)]
            elapsed = window[-1][0] - window[0][0]
            rate = (window[-1][1] - window[0][1]) / elapsed if elapsed > 0 else 0.0
            _emit(
                event="progress",
                epoch=min(epoch, epochs),
                samples=samples,
                samples_per_s=rate,
                loss=loss_ema,
                group=group,
                swarm_peers=system.swarm_peers() if isinstance(system, _Swarm) else None,
            )
            last_report = now
        if epoch >= epochs:
            # done: step on (a peer of a longer run would) until told to stop; alone: stop
            with contextlib.suppress(queue.Empty):
                command = commands.next(0)
                if command is None or command.get("cmd") == "stop":
                    return
            if isinstance(system, _Alone):
                _wait_for(commands, "stop", config["command_timeout"])
                return


def main(argv: Sequence[str] | None = None) -> int:
    return child_main(_run, argv)


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # everything is closed: skip the interpreter's teardown (torch's alone takes a second or more)
    os._exit(status)
