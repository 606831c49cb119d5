"""Integrations of swarmavg with training frameworks, each an optional extra.

* :mod:`swarmavg.integrations.lightning`: ``SwarmStrategy`` for Lightning's ``Trainer``
  (``pip install swarmavg[lightning]``), under ``lightning.pytorch`` (or ``pytorch_lightning``
  when only that is installed);
* :mod:`swarmavg.integrations.pytorch_lightning`: the same strategy for the
  ``pytorch_lightning`` namespace.

Nothing here is imported by ``import swarmavg``; each module imports its framework.
"""
