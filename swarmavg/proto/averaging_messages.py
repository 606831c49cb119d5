"""The averaging layer's wire messages (all-reduce).

A sender opens one bidirectional call (``avg.allreduce``) to each reducer of its group: it sends
:class:`AvgBegin` (which round, which member it is, its weight), then its values of the
reducer's span as :class:`AvgPart` messages, in the order of the reducer's parts; the reducer
answers first with every sender's weight (:class:`AvgWeights`, known once all have begun), then
each part, once every sender delivered it, with the weighted mean (:class:`AvgPart`) or
:class:`AvgKeep` (the part's total weight is 0: everyone keeps their own values).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from numpy.typing import NDArray  # runtime import: the codec resolves the annotations

from swarmavg.proto.codec import Message, message

__all__ = ["AvgBegin", "AvgKeep", "AvgPart", "AvgWeights"]


@message("avg.begin")
@dataclass(frozen=True, slots=True)
class AvgBegin(Message):
    """The first message of a sender's call: the round (``group_id``), the sender's index in
    the group, and its weight (>= 0; 0 sends no parts)."""

    group_id: bytes
    sender: int
    weight: float


@message("avg.part")
@dataclass(frozen=True, slots=True, eq=False)
class AvgPart(Message):
    """Part ``index`` of the reducer's span: a sender's values, or the reducer's result."""

    index: int
    values: NDArray[Any]


@message("avg.keep")
@dataclass(frozen=True, slots=True)
class AvgKeep(Message):
    """Part ``index`` had a total weight of 0: keep the local values."""

    index: int


@message("avg.weights")
@dataclass(frozen=True, slots=True)
class AvgWeights(Message):
    """The weight of each member (by index; 0 for members that send nothing), as the reducer
    saw them: every member learns who contributed."""

    weights: list[float]
