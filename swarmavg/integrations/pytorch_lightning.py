"""``SwarmStrategy`` for the ``pytorch_lightning`` namespace (``pytorch_lightning.Trainer``);
the same strategy as :mod:`swarmavg.integrations.lightning`'s, subclassing
``pytorch_lightning.strategies.Strategy``. Importing this module registers
``pytorch_lightning.Trainer(strategy="swarm")``. See ``docs/guides/lightning.md``.
"""

from __future__ import annotations

from typing import Any

from swarmavg.integrations._lightning import strategy_class

__all__ = ["HivemindStrategy", "SwarmStrategy"]

SwarmStrategy: Any = strategy_class("pytorch_lightning")
#: lightning-Hivemind's name, for migration: the same class
HivemindStrategy: Any = SwarmStrategy
