"""One peer process of ``tests/integrations/test_lightning.py``:
``python -m tests.integrations.lightning_peer CONFIG`` (CONFIG: a JSON object with ``index``,
``out``, ``epochs``, ``ns``; the initial peers come from ``SWARMAVG_INITIAL_PEERS``).

It runs ``Trainer.fit`` on the workload with ``SwarmStrategy`` (Adam at 2e-3, an
``ExponentialLR(0.9)`` from ``configure_optimizers``). At its first backward pass (the optimizer
wrapped) it prints ``{"event": "ready"}`` and waits for a ``go`` line on stdin; it stops at the
first batch that ends at swarm epoch ``epochs`` or later, and saves its parameters then
(``{out}/peer{index}.npy``) and, after ``fit``, what it saw at each batch
(``{out}/peer{index}.json``: ``num_peers``, ``epochs``, ``lrs``).
"""

from __future__ import annotations

import importlib
import itertools
import json
import sys
from pathlib import Path
from typing import Any


def main(config: dict[str, Any]) -> None:
    import numpy as np
    import torch

    from swarmavg.testing import workload

    torch.set_num_threads(1)  # (the peers share the machine's cores)
    ns = config["ns"]
    index, out, epochs = int(config["index"]), Path(config["out"]), int(config["epochs"])
    lightning = importlib.import_module(ns)
    integration = importlib.import_module(
        "swarmavg.integrations.lightning"
        if ns == "lightning.pytorch"
        else "swarmavg.integrations.pytorch_lightning"
    )
    corpus = workload.load_corpus()
    stream = workload.batches(corpus, 16, peer=index, num_peers=2, sharded=True)
    data = list(itertools.islice(stream, 200))
    seen: dict[str, list[Any]] = {"num_peers": [], "epochs": [], "lrs": []}

    class Model(lightning.LightningModule):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = workload.make_model(0)  # (every peer starts from the same parameters)
            self.waited = False

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(data, batch_size=None)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return workload.loss_fn(self.model, *batch)

        def configure_optimizers(self) -> Any:
            optimizer = workload.make_optimizer(self.parameters())
            return [optimizer], [torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)]

        def on_before_backward(self, loss: Any) -> None:
            if not self.waited:
                self.waited = True
                sys.stdout.write(json.dumps({"event": "ready"}) + "\n")
                sys.stdout.flush()
                if sys.stdin.readline().strip() != "go":
                    raise SystemExit(3)

        def on_train_batch_end(self, *args: Any) -> None:
            strategy = self.trainer.strategy
            seen["num_peers"].append(strategy.num_peers)
            seen["epochs"].append(strategy.local_epoch)
            seen["lrs"].append(self.trainer.optimizers[0].param_groups[0]["lr"])
            if strategy.local_epoch >= epochs and not self.trainer.should_stop:
                params = [p.detach().numpy().ravel() for p in self.model.parameters()]
                np.save(out / f"peer{index}.npy", np.concatenate(params))
                self.trainer.should_stop = True

    trainer = lightning.Trainer(
        strategy=integration.SwarmStrategy(
            target_batch_size=64,
            run_id="lightning_two_peers",
            matchmaking_time=2.0,
            averaging_timeout=20.0,
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
