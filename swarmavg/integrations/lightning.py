"""Lightning's ``Trainer`` with a swarm of peers: ``SwarmStrategy`` (``pip install
swarmavg[lightning]``).

::

    from lightning.pytorch import Trainer
    from swarmavg.integrations.lightning import SwarmStrategy

    trainer = Trainer(strategy=SwarmStrategy(target_batch_size=4096), max_epochs=10)
    trainer.fit(model)

The class here subclasses ``lightning.pytorch``'s ``Strategy`` (``pytorch_lightning``'s when
only that namespace is installed): a ``Trainer`` accepts only its own namespace's strategies,
so with ``pytorch_lightning.Trainer`` use :mod:`swarmavg.integrations.pytorch_lightning`.
Importing this module registers ``Trainer(strategy="swarm")`` in that namespace (the target
batch size then comes from ``SWARMAVG_TARGET_BATCH_SIZE``). ``HivemindStrategy`` is the same
class, for scripts that used lightning-Hivemind's. See ``docs/guides/lightning.md``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from swarmavg.integrations._lightning import (
    INITIAL_PEERS_ENV,
    REGISTERED_NAME,
    SWARMAVG_INITIAL_PEERS_ENV,
    TARGET_BATCH_SIZE_ENV,
    strategy_class,
)

__all__ = [
    "INITIAL_PEERS_ENV",
    "NAMESPACE",
    "REGISTERED_NAME",
    "SWARMAVG_INITIAL_PEERS_ENV",
    "TARGET_BATCH_SIZE_ENV",
    "HivemindStrategy",
    "SwarmStrategy",
]


def _namespace() -> str:
    try:
        if importlib.util.find_spec("lightning.pytorch") is not None:
            return "lightning.pytorch"
    except ModuleNotFoundError:  # (no `lightning` package at all)
        pass
    if importlib.util.find_spec("pytorch_lightning") is not None:
        return "pytorch_lightning"
    raise ModuleNotFoundError(
        "swarmavg.integrations.lightning needs Lightning: pip install swarmavg[lightning] "
        "(or lightning / pytorch-lightning >= 2.0)",
        name="lightning",
    )


#: the Lightning namespace whose ``Strategy`` :data:`SwarmStrategy` subclasses
NAMESPACE = _namespace()

SwarmStrategy: Any = strategy_class(NAMESPACE)
#: lightning-Hivemind's name, for migration: the same class
HivemindStrategy: Any = SwarmStrategy
