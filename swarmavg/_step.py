"""What an averaging step reports: :class:`StepResult` (its outcome) and :class:`AveragingStage`
(where it is), public as ``swarmavg.StepResult`` and ``swarmavg.AveragingStage``.

They are plain values, so they live here, outside ``aio/``, and this module imports neither
anyio nor torch: the async averager (``swarmavg.aio.averager``, which re-exports them), the sync
facade (``swarmavg.averager``) and the optimizers of ``swarmavg.optim``, which see only the
facades, all take them from here.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from swarmavg.proto.allreduce import MAX_WEIGHT

if TYPE_CHECKING:
    from swarmavg.identity import PeerID

__all__ = ["AveragingStage", "StepResult"]


@dataclass
class StepResult(Mapping["PeerID", Any]):
    """The outcome of one averaging step: a mapping PeerID -> the metadata each member gathered
    (as hivemind's ``step`` returns), plus what the round did."""

    gathered: dict[PeerID, Any]
    group_id: bytes
    #: the members whose tensors went into the mean (with a positive weight)
    contributors: list[PeerID] = field(default_factory=list)
    total_weight: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    matchmaking_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    #: members whose span kept our local values (from some part on), and why: they failed,
    #: stalled or left
    local_spans: list[tuple[PeerID, str]] = field(default_factory=list)
    #: senders left out of (part of) a member's span, and why: ``(reducer, sender, why)``
    dropped: list[tuple[PeerID, PeerID, str]] = field(default_factory=list)
    #: members whose answers stopped partway (they died or stalled) and the groupmate that
    #: relayed us the rest of their span: ``(reducer, relayed by)``
    relayed: list[tuple[PeerID, PeerID]] = field(default_factory=list)

    @property
    def incomplete(self) -> bool:
        """Whether some of the tensors were not averaged over every member (see
        :attr:`local_spans` and :attr:`dropped`)."""
        return bool(self.local_spans or self.dropped)

    def __getitem__(self, peer: PeerID) -> Any:
        return self.gathered[peer]

    def __iter__(self) -> Iterator[PeerID]:
        return iter(self.gathered)

    def __len__(self) -> int:
        return len(self.gathered)

    @property
    def group_size(self) -> int:
        return len(self.gathered)


class AveragingStage(enum.Enum):
    """Where a step is (:attr:`swarmavg.StepHandle.stage`,
    :attr:`swarmavg.aio.averager.StepControl.stage`)."""

    IDLE = "idle"
    LOOKING_FOR_GROUP = "looking_for_group"
    AWAITING_TRIGGER = "awaiting_trigger"
    RUNNING_ALLREDUCE = "running_allreduce"
    FINISHED = "finished"


def _check_weight(weight: object) -> float:
    """A step's weight as a float.

    :raises TypeError: ``weight`` is not an int or float (a bool is not a number here).
    :raises ValueError: ``weight`` is negative, NaN, or above
        :data:`~swarmavg.proto.allreduce.MAX_WEIGHT` (1e9).
    """
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise TypeError(f"weight must be a number, not {weight!r}")
    if not 0 <= weight <= MAX_WEIGHT:  # (also NaN and infinities)
        raise ValueError(f"weight must be a number from 0 to {MAX_WEIGHT:g}, not {weight!r}")
    return float(weight)
