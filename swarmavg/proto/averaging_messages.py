"""The averaging layer's wire messages: matchmaking (join a leader) and all-reduce.

A sender opens one bidirectional call (``avg.allreduce``) to each reducer of its group: it sends
:class:`AvgBegin` (which round, which member it is, its weight), then its values of the
reducer's span as :class:`AvgPart` messages, in the order of the reducer's parts; the reducer
answers first with every sender's weight (:class:`AvgWeights`, known once all have begun), then
each part, once every sender delivered it, with the weighted mean (:class:`AvgPart`) or
:class:`AvgKeep` (the part's total weight is 0: everyone keeps their own values). A part whose
codec compresses travels as :class:`AvgCompressedPart` instead of :class:`AvgPart`, either way.
A member whose step is cancelled tells the others with :class:`AvgLeave`.

A member left with part of a reducer's span unanswered (the reducer died or stalled while
answering, or left it out) asks the other members for the means they applied there
(``avg.relay``, a server stream): :class:`AvgRelay` asks, :class:`AvgHave` says how many of the
span's parts the member applied, then (if asked to fetch) the reducer's :class:`AvgDropped`
notices and the parts from ``first`` on as :class:`AvgPart` or :class:`AvgKeep`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray  # runtime import: the codec resolves the annotations

from swarmavg.compression import CompressedTensor
from swarmavg.identity import PeerID
from swarmavg.proto.codec import Message, message

__all__ = [
    "AvgBegin",
    "AvgCompressedPart",
    "AvgDropped",
    "AvgHave",
    "AvgKeep",
    "AvgLeave",
    "AvgPart",
    "AvgRelay",
    "AvgWeights",
    "JoinReply",
    "JoinRequest",
    "MemberInfo",
    "Presence",
]


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


@message("avg.cpart")
@dataclass(frozen=True, slots=True, eq=False)
class AvgCompressedPart(Message):
    """Part ``index`` of the reducer's span, compressed (a sender's values or the reducer's
    result): the fields of :meth:`swarmavg.compression.CompressedTensor.to_parts`, the three
    payloads as arrays (sent zero-copy, after the header). The codec is whatever the sender
    chose; the receiver checks the declared shape and dtype against the part before anything
    else, then :meth:`tensor` validates the rest."""

    index: int
    codec: str
    shape: list[int]
    dtype: str
    data: NDArray[Any]
    scales: NDArray[Any]
    codebook: NDArray[Any]
    block_size: int

    @classmethod
    def of(cls, index: int, tensor: CompressedTensor) -> AvgCompressedPart:
        """The message for part ``index`` compressed as ``tensor``."""
        return cls(
            index,
            tensor.codec,
            list(tensor.shape),
            tensor.dtype,
            tensor.data,
            tensor.scales,
            tensor.codebook,
            tensor.block_size,
        )

    @property
    def nbytes(self) -> int:
        """The payload size in bytes."""
        return int(self.data.nbytes + self.scales.nbytes + self.codebook.nbytes)

    def tensor(self) -> CompressedTensor:
        """The compressed tensor, rebuilt with
        :meth:`~swarmavg.compression.CompressedTensor.from_parts` (every field and byte length
        checked against the declared shape, then the values); :class:`ValueError` if anything
        is off."""
        return CompressedTensor.from_parts(
            {
                "codec": self.codec,
                "shape": self.shape,
                "dtype": self.dtype,
                "data": _raw(self.data),
                "scales": _raw(self.scales),
                "codebook": _raw(self.codebook),
                "block_size": self.block_size,
            }
        )


def _raw(array: NDArray[Any]) -> memoryview:
    """The bytes of ``array`` (as received: little-endian), without a copy where possible."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


@message("avg.keep")
@dataclass(frozen=True, slots=True)
class AvgKeep(Message):
    """Part ``index`` had a total weight of 0: keep the local values."""

    index: int


@message("avg.dropped")
@dataclass(frozen=True, slots=True)
class AvgDropped(Message):
    """The reducer dropped member ``sender`` from its parts ``part`` and later (it failed,
    stalled or sent bad values): those parts' means leave it out. Sent to every other sender
    before the answer of part ``part``."""

    sender: int
    part: int
    reason: str


@message("avg.weights")
@dataclass(frozen=True, slots=True)
class AvgWeights(Message):
    """The weight of each member (by index; 0 for members that send nothing), as the reducer
    saw them: every member learns who contributed."""

    weights: list[float]


@message("avg.leave")
@dataclass(frozen=True, slots=True)
class AvgLeave(Message):
    """A member (``sender``, its index) leaves round ``group_id`` before it finished (its step
    was cancelled): the others fail the round at once instead of waiting for it. Sent as a
    unary call (``avg.leave``) to every member that can be dialed; answered with
    :class:`AvgKeep` (index -1) as a plain acknowledgement."""

    group_id: bytes
    sender: int
    reason: str


@message("avg.relay")
@dataclass(frozen=True, slots=True)
class AvgRelay(Message):
    """Ask a member of round ``group_id`` how many parts of member ``reducer``'s span it
    applied (the means ``reducer`` answered, or its own span's means if it is ``reducer``),
    and, with ``fetch``, for those parts from ``first`` on."""

    group_id: bytes
    reducer: int
    first: int
    fetch: bool


@message("avg.have")
@dataclass(frozen=True, slots=True)
class AvgHave(Message):
    """The answer to :class:`AvgRelay`: the member applied parts ``0 .. count - 1`` of the
    span and can still send them (0: it cannot)."""

    count: int


@message("avg.member")
@dataclass(frozen=True, slots=True)
class MemberInfo(Message):
    """A member of a group as its leader announces it: where to dial it (empty for a client-mode
    member), its bandwidth (< 0: unknown), its mode (``"node"``, ``"client"``, ``"aux"``) and
    the metadata it gathers to the group."""

    peer_id: PeerID
    addresses: list[str]
    bandwidth: float
    mode: str
    gather: bytes


@message("avg.join")
@dataclass(frozen=True, slots=True)
class JoinRequest(Message):
    """Take me into your group: the key and tensor schema I average, when my own declaration
    expires (``inf`` for a client-mode peer, which never leads), and who I am."""

    group_key: str
    schema: bytes
    expiration: float
    member: MemberInfo


@message("avg.join_reply")
@dataclass(frozen=True, slots=True)
class JoinReply(Message):
    """A leader's answers on a join call: ``"accepted"`` (wait), then ``"begin"`` with the group
    (its id and members, in order), or ``"disband"``; or at once ``"rejected"`` with a reason."""

    code: str
    reason: str
    group_id: bytes
    members: list[MemberInfo]


@message("avg.presence")
@dataclass(frozen=True, slots=True)
class Presence(Message):
    """Asked (``avg.presence``): does this node average under ``prefix``? Answered with the
    same message, ``present`` saying so (a leader pings a peer it expected back this way)."""

    prefix: str
    present: bool = False
