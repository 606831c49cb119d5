"""Collaborative training: hivemind-style optimizers over :class:`swarmavg.DecentralizedAverager`.

* :class:`Optimizer` — hivemind's ``hivemind.Optimizer``: peers accumulate one large global batch
  together, average gradients when it is full, step in lockstep (epochs), average parameters and
  optimizer statistics, and a peer that falls behind downloads the state.
* :class:`ProgressTracker` — the run's global progress (epoch, samples, peers, ETA), from
  owner-signed records in the DHT.
* :class:`GradientAverager` — accumulates gradients and averages them, weighted by samples.
* :class:`TrainingStateAverager` — averages parameters, optimizer statistics and extra tensors,
  runs (delayed) optimizer steps, shares and loads the training state.
* :class:`DiLoCo` — DiLoCo's outer optimization: ``sync_every`` steps of a local inner
  optimizer, then an outer (Nesterov) step on the averaged pseudo-gradient.
* :class:`GradScaler` — ``torch.amp.GradScaler`` for float16 AMP with :class:`Optimizer`.
* :class:`DecentralizedOptimizer`, :class:`DecentralizedSGD`, :class:`DecentralizedAdam` —
  Moshpit SGD: local steps, parameters (and statistics) averaged with small groups.
* :class:`TrainingAverager` — averages an optimizer's parameters, gradients and statistics.

This package imports torch; ``import swarmavg`` does not (``swarmavg.Optimizer`` is resolved on
first use). Names are imported lazily, on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarmavg.optim.decentralized import (
        DecentralizedAdam,
        DecentralizedOptimizer,
        DecentralizedSGD,
    )
    from swarmavg.optim.diloco import DiLoCo
    from swarmavg.optim.grad_averager import GradientAverager
    from swarmavg.optim.grad_scaler import GradScaler
    from swarmavg.optim.optimizer import Optimizer
    from swarmavg.optim.progress_tracker import ProgressTracker
    from swarmavg.optim.state_averager import TrainingStateAverager
    from swarmavg.optim.training_averager import TrainingAverager

__all__ = [
    "DecentralizedAdam",
    "DecentralizedOptimizer",
    "DecentralizedSGD",
    "DiLoCo",
    "GradScaler",
    "GradientAverager",
    "Optimizer",
    "ProgressTracker",
    "TrainingAverager",
    "TrainingStateAverager",
]

_WHERE = {
    "DecentralizedAdam": "swarmavg.optim.decentralized",
    "DecentralizedOptimizer": "swarmavg.optim.decentralized",
    "DecentralizedSGD": "swarmavg.optim.decentralized",
    "DiLoCo": "swarmavg.optim.diloco",
    "GradScaler": "swarmavg.optim.grad_scaler",
    "GradientAverager": "swarmavg.optim.grad_averager",
    "Optimizer": "swarmavg.optim.optimizer",
    "ProgressTracker": "swarmavg.optim.progress_tracker",
    "TrainingAverager": "swarmavg.optim.training_averager",
    "TrainingStateAverager": "swarmavg.optim.state_averager",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'swarmavg.optim' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
