"""``swarmavg.optim.ProgressTracker``: hivemind's ``ProgressTracker`` for synchronous code.

The class is the sync facade of :mod:`swarmavg.progress` (beside the other facades, so that
``swarmavg.optim`` imports nothing of ``swarmavg.aio``); this module keeps hivemind's path,
``hivemind.optim.progress_tracker``, and the names it had.
"""

from __future__ import annotations

from swarmavg.progress import GlobalTrainingProgress, LocalTrainingProgress, ProgressTracker

__all__ = ["GlobalTrainingProgress", "LocalTrainingProgress", "ProgressTracker"]
