"""One peer process of ``test_diloco_processes.py`` (not a test module): a ``swarmavg.DHT``
over TCP on 127.0.0.1 and a ``swarmavg.optim.DiLoCo`` training the workload of
:mod:`swarmavg.testing.workload`. ``python _diloco_peer.py CONFIG`` (a JSON object: ``index``,
``initial_peers``, ``run_id``, ``sync_every``, ``epochs``, ``batch``, ``lr``, ``deadline``).

JSON lines on stdout, one object a line, nothing else: ``{"event": "listening", "maddrs":
[...]}`` (the DHT runs), ``{"event": "ready"}`` (the DiLoCo is made); after ``go`` on stdin,
``{"event": "start", "val_loss"}``, ``{"event": "epoch", "epoch"}`` at each new outer epoch,
``{"event": "done", "epoch", "digest", "val_loss", ...}`` at outer epoch ``epochs``
(``digest``: SHA-256 of θ_global and the outer optimizer's state). Then it stops training but
keeps serving its state until ``stop`` on stdin (or end of file), and answers ``{"event":
"exit"}``. ``{"event": "error", "error"}`` before it exits with status 1; past ``deadline``
seconds after ``go`` it gives up that way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from typing import Any


def _say(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _digest(diloco: Any) -> str:
    """SHA-256 of θ_global and the outer optimizer's state (its tensors, in parameter order)."""
    digest = hashlib.sha256()
    state = diloco.outer_optimizer.state
    tensors = [*diloco.backup]
    for param in diloco.params:
        for name in sorted(state.get(param, {})):
            value = state[param][name]
            if hasattr(value, "numpy"):
                tensors.append(value)
    for tensor in tensors:
        digest.update(repr(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(
        level=logging.INFO, format="%(relativeCreated)7.0f %(levelname)s %(name)s %(message)s"
    )
    config = json.loads(sys.argv[1])
    import torch

    import swarmavg
    from swarmavg.optim import DiLoCo
    from swarmavg.testing import workload

    torch.set_num_threads(1)
    corpus = workload.load_corpus()
    model = workload.make_model(seed=0)  # (the same initial weights on every peer)
    dht = swarmavg.DHT(
        initial_peers=config["initial_peers"], host="127.0.0.1", port=0, transport="tcp"
    )
    diloco = None
    try:
        _say(event="listening", maddrs=[str(a) for a in dht.get_visible_maddrs()])
        inner = workload.make_optimizer(model.parameters(), lr=float(config["lr"]))
        diloco = DiLoCo(
            model.parameters(),
            inner_optimizer=inner,
            dht=dht,
            run_id=config["run_id"],
            sync_every=int(config["sync_every"]),
            batch_size=int(config["batch"]),
            matchmaking_time=1.0,
            averaging_timeout=10.0,
            load_state_timeout=10.0,
            averager_opts={"request_timeout": 1.0},
            tracker_opts={
                "min_refresh_period": 0.1,
                "default_refresh_period": 0.2,
                "max_refresh_period": 0.5,
            },
        )
        val_loss = workload.evaluate(model, corpus, num_batches=2)
        _say(event="ready")
        if sys.stdin.readline().strip() != "go":
            return 0
        deadline = time.monotonic() + float(config["deadline"])
        _say(event="start", val_loss=val_loss)
        stream = workload.batches(corpus, int(config["batch"]), seed=100 + int(config["index"]))
        epoch = diloco.outer_epoch
        while diloco.outer_epoch < int(config["epochs"]):
            if time.monotonic() > deadline:
                _say(event="error", error=f"at outer epoch {diloco.outer_epoch} at the deadline")
                return 1
            x, y = next(stream)
            workload.loss_fn(model, x, y).backward()
            inner.step()  # (every sync_every-th one runs a round)
            inner.zero_grad()
            if diloco.outer_epoch != epoch:
                epoch = diloco.outer_epoch
                _say(event="epoch", epoch=epoch)
        schedule = diloco.schedule
        _say(
            event="done",
            epoch=diloco.outer_epoch,
            digest=_digest(diloco),
            val_loss=workload.evaluate(model, corpus, num_batches=2),
            averaged=schedule.rounds_averaged,
            alone=schedule.rounds_alone,
            failed=schedule.rounds_failed,
            state_loads=schedule.state_loads,
        )
        sys.stdin.readline()  # ("stop", or end of file: the test is gone)
        return 0
    except Exception as exc:
        _say(event="error", error=f"{type(exc).__name__}: {exc}"[:500])
        raise
    finally:
        if diloco is not None:
            diloco.shutdown()
        dht.shutdown()
        _say(event="exit")


if __name__ == "__main__":
    sys.exit(main())
