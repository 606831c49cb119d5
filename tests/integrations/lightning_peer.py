"""One peer process of ``tests/integrations/test_lightning.py``:
``python -m tests.integrations.lightning_peer CONFIG`` (CONFIG: a JSON object with ``index``,
``out``, ``epochs``, ``ns``, ``num_peers``, ``run_id``; the initial peers come from
``SWARMAVG_INITIAL_PEERS``).

It runs ``Trainer.fit`` on the workload with ``SwarmStrategy(sync_metrics=True)`` (Adam at
2e-3, an ``ExponentialLR(0.9)`` from ``configure_optimizers``), logging its ``index`` as the
metric ``peer_index`` with ``sync_dist=True`` at every batch. At its first ``training_step``
(the optimizer wrapped) it prints ``{"event": "ready", "epoch"}`` and waits for a ``go`` line on
stdin; it prints ``{"event": "epoch", "epoch"}`` whenever its swarm epoch changes, and stops at
the first batch that ends at swarm epoch ``epochs`` or later (a line ``{"stop_at": N}`` on
stdin changes ``epochs`` to N), saving its parameters then (``{out}/peer{index}.npy``) and,
after ``fit``, what it saw at each batch (``{out}/peer{index}.json``: ``num_peers``,
``epochs``, ``lrs``, ``metric``; and ``stop_epoch`` and ``state_loads``, the downloads of the
swarm's state, when it stopped).
"""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import select
import sys
from pathlib import Path
from typing import Any


def emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def main(config: dict[str, Any]) -> None:
    import numpy as np
    import torch

    from swarmavg.testing import workload

    torch.set_num_threads(1)  # (the peers share the machine's cores)
    logging.basicConfig(  # (what the test shows of this peer when it fails)
        level=logging.INFO, format="%(asctime)s.%(msecs)03d %(name)s: %(message)s", datefmt="%X"
    )
    ns = config["ns"]
    index, out, epochs = int(config["index"]), Path(config["out"]), int(config["epochs"])
    lightning = importlib.import_module(ns)
    integration = importlib.import_module(
        "swarmavg.integrations.lightning"
        if ns == "lightning.pytorch"
        else "swarmavg.integrations.pytorch_lightning"
    )
    corpus = workload.load_corpus()
    stream = workload.batches(
        corpus, 16, peer=index, num_peers=int(config["num_peers"]), sharded=True
    )
    data = list(itertools.islice(stream, 2000))  # (more than any test trains on)
    seen: dict[str, Any] = {"num_peers": [], "epochs": [], "lrs": [], "metric": []}
    stop_at = [epochs]

    class Model(lightning.LightningModule):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = workload.make_model(0)  # (every peer starts from the same parameters)
            self.epoch: int | None = None

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(data, batch_size=None)

        def configure_optimizers(self) -> Any:
            optimizer = workload.make_optimizer(self.parameters())
            return [optimizer], [torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)]

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if self.epoch is None:
                self.epoch = self.trainer.strategy.local_epoch
                emit(event="ready", epoch=self.epoch)
                if sys.stdin.readline().strip() != "go":
                    raise SystemExit(3)
            self.log("peer_index", float(index), sync_dist=True)
            return workload.loss_fn(self.model, *batch)

        def on_train_batch_end(self, *args: Any) -> None:
            strategy = self.trainer.strategy
            before = strategy.local_epoch
            lr = self.trainer.optimizers[0].param_groups[0]["lr"]
            epoch = strategy.local_epoch
            seen["num_peers"].append(strategy.num_peers)
            if epoch == before:  # (a round's catch-up on another thread may move both between)
                seen["epochs"].append(epoch)
                seen["lrs"].append(lr)
            seen["metric"].append(float(self.trainer.callback_metrics["peer_index"]))
            if epoch != self.epoch:
                self.epoch = epoch
                emit(event="epoch", epoch=epoch)
            if select.select([sys.stdin], [], [], 0)[0]:
                line = sys.stdin.readline()
                if line.startswith("{"):
                    stop_at[0] = int(json.loads(line)["stop_at"])
            if epoch >= stop_at[0] and not self.trainer.should_stop:
                params = [p.detach().numpy().ravel() for p in self.model.parameters()]
                np.save(out / f"peer{index}.npy", np.concatenate(params))
                seen["state_loads"] = strategy.optimizer.metrics.state_loads
                seen["stop_epoch"] = epoch
                self.trainer.should_stop = True

    trainer = lightning.Trainer(
        strategy=integration.SwarmStrategy(
            target_batch_size=64,
            run_id=config["run_id"],
            matchmaking_time=2.0,
            averaging_timeout=20.0,
            sync_metrics=True,
        ),
        accelerator="cpu",
        max_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model())
    (out / f"peer{index}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
