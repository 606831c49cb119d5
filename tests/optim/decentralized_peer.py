"""One peer process of ``tests/optim/test_decentralized_processes.py``:
``python -m tests.optim.decentralized_peer CONFIG`` (CONFIG: a JSON object, see :func:`_run`).

It trains the workload of :mod:`swarmavg.testing.workload` with a ``DecentralizedAdam``
(``"optimizer": "sgd"``: a ``DecentralizedSGD``) over TCP on 127.0.0.1, driven by the test in
JSON lines (the helpers of ``swarmavg demo``'s children: :func:`swarmavg._demo_peer.child_main`):

* commands on stdin: ``join`` (``initial_peers``: every peer but the first, before its DHT
  starts), ``go`` (train), ``killed`` (a peer was killed: count the rounds from now on),
  ``settle`` (one more round, awaited), ``finish``; end of file stops it;
* events on stdout: ``listening`` (the first peer: ``maddrs``), ``ready``, ``progress`` after
  every step (``step``, ``rounds_succeeded``), ``marked`` (after ``killed``), ``trained``
  (``rounds_after_kill``), ``settled`` (the round's ``succeeded`` and ``group_size``; the
  parameters are saved to ``{out}/peer{index}.npy``), ``done`` (``val_start``, ``val_end``).

A peer trains until it was told ``killed``, then ``steps_after_kill`` more steps and until a
round begun after that succeeded (at most ``max_steps`` in all), says ``trained``, and trains
on (averaging with the survivors still short of their round) until the next command; the
first peer to be killed trains until it is.
"""

from __future__ import annotations

import json
import os
import queue
import sys
from pathlib import Path
from typing import Any

from swarmavg._demo_peer import _Commands, child_main


def _emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _expect(commands: _Commands, name: str) -> dict[str, Any] | None:
    command = commands.next(120)
    if command is None or command.get("cmd") != name:
        return None
    return command


def _run(config: dict[str, Any], commands: _Commands) -> None:
    import numpy as np
    import torch

    import swarmavg
    from swarmavg.optim.decentralized import DecentralizedAdam, DecentralizedSGD
    from swarmavg.testing import workload

    torch.set_num_threads(1)  # (the peers share the machine's cores)
    index: int = config["index"]
    corpus = workload.load_corpus()
    model = workload.make_model(0)  # (every peer starts from the same parameters)
    # torch imports its optimizers' machinery at the first one made (~2 s): now, while the
    # first peer starts, rather than after
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    initial_peers: list[str] = []
    if index > 0:
        join = _expect(commands, "join")
        if join is None:
            return
        initial_peers = join["initial_peers"]
    dht = swarmavg.DHT(initial_peers=initial_peers, host="127.0.0.1", port=0)
    try:
        if index == 0:
            _emit(event="listening", maddrs=[str(a) for a in dht.get_visible_maddrs()])
        # Adam at 3e-3, or SGD at 0.1 with momentum 0.9 (as benchmarks/optimizer.py's dsgd)
        make = DecentralizedAdam if config.get("optimizer", "adam") == "adam" else DecentralizedSGD
        extra: dict[str, Any] = {} if make is DecentralizedAdam else {"momentum": 0.9}
        opt = make(
            model.parameters(),
            lr=3e-3 if make is DecentralizedAdam else 0.1,
            dht=dht,
            prefix="killrun",
            target_group_size=4,
            averaging_steps_period=4,
            timeout=10.0,
            # short bounds: a round of 3 (the group is not full) begins after 1 s; a member
            # that was killed is done without after allreduce_timeout / 4
            averaging_expiration=1.0,
            allreduce_timeout=4.0,
            request_timeout=1.0,
            **extra,
        )
        try:
            _emit(event="ready")
            if _expect(commands, "go") is not None:
                _train(config, commands, opt, model, corpus, workload, np)
        finally:
            opt.shutdown()
    finally:
        dht.shutdown()


def _train(
    config: dict[str, Any],
    commands: _Commands,
    opt: Any,
    model: Any,
    corpus: Any,
    workload: Any,
    np: Any,
) -> None:
    index: int = config["index"]

    def evaluate() -> float:
        return float(workload.evaluate(model, corpus, num_batches=2))

    val_start = evaluate()
    stream = workload.batches(corpus, 16, seed=1, peer=index, num_peers=4)
    base: int | None = None  # rounds succeeded before the kill was known
    after_kill = 0
    trained = False
    command: dict[str, Any] | None = {}
    for step in range(1, config["max_steps"] + 1):
        x, y = next(stream)
        workload.loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        _emit(event="progress", step=step, rounds_succeeded=opt.rounds_succeeded)
        try:
            command = commands.next(0)
        except queue.Empty:
            command = {}
        if command is None:
            return
        if trained:
            # (trained on, averaging with the survivors still short of their round, until the
            # test moves on: a survivor that stopped would leave the last one alone)
            if command:
                break
            continue
        if command.get("cmd") == "killed":
            opt.wait_for_round(timeout=60)  # (a round begun before the kill ends first)
            base = opt.rounds_succeeded
            _emit(event="marked", base=base)
        if base is not None:
            after_kill += 1
            if after_kill >= config["steps_after_kill"] and opt.rounds_succeeded > base:
                trained = True
                _emit_trained(opt, base)
    if not trained:  # (max_steps: the test reads how many rounds succeeded)
        _emit_trained(opt, base)
    opt.zero_grad()
    opt.wait_for_round(timeout=60)
    if not command:
        command = commands.next(120)
    while command is not None and command.get("cmd") == "settle":
        outcome = opt.wait_for_round(timeout=60, request=True)
        flat = torch_flat(model)
        np.save(Path(config["out"]) / f"peer{index}.npy", flat, allow_pickle=False)
        _emit(
            event="settled",
            succeeded=outcome is not None and outcome.succeeded,
            group_size=0 if outcome is None else outcome.group_size,
        )
        command = commands.next(120)
    if command is not None and command.get("cmd") == "finish":
        _emit(event="done", val_start=val_start, val_end=evaluate())


def _emit_trained(opt: Any, base: int | None) -> None:
    """``trained``: how many rounds succeeded since the kill was known, once the round under
    way ended."""
    opt.wait_for_round(timeout=60)
    _emit(event="trained", rounds_after_kill=None if base is None else opt.rounds_succeeded - base)


def torch_flat(model: Any) -> Any:
    """The model's parameters as one float32 numpy vector."""
    import torch

    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


if __name__ == "__main__":
    status = child_main(_run)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # (skip torch's slow interpreter teardown: everything is closed)
