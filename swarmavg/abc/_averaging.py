"""The averaging protocols: a :class:`Matchmaker` finds a :class:`Group`, an
:class:`AllReduceRunner` averages over it. The averager takes one of each by composition, so
either can be swapped (and tested) alone; swarmavg's own are
:class:`swarmavg.aio.matchmaking.DHTMatchmaker` and
:class:`swarmavg.aio.allreduce.AllReduceService` (butterfly all-reduce).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from swarmavg.compression import (
    AdaptiveCompression,
    CompressionBase,
    ErrorFeedback,
    NoCompression,
    TensorInfo,
)
from swarmavg.proto.allreduce import MAX_SHARE, FlatLayout, load_balance
from swarmavg.proto.butterfly import RoundConfig

if TYPE_CHECKING:
    import numpy.typing as npt

    from swarmavg.address import Address
    from swarmavg.identity import PeerID

__all__ = [
    "AllReduceResult",
    "AllReduceRunner",
    "Group",
    "GroupInfo",
    "GroupMember",
    "Matchmaker",
    "MemberMode",
]


class MemberMode(enum.Enum):
    """How a member takes part: ``NODE`` sends and reduces; ``CLIENT`` (nobody can dial it)
    only sends; ``AUX`` only reduces (it has no values of its own)."""

    NODE = "node"
    CLIENT = "client"
    AUX = "aux"


@dataclass(frozen=True, slots=True)
class GroupMember:
    peer_id: PeerID
    #: where the others dial it (``None`` for a client-mode member)
    address: Address | None
    bandwidth: float | None = None
    mode: MemberMode = MemberMode.NODE


@dataclass(frozen=True, slots=True)
class Group:
    """A group ready to average: its id and members, in the same order for everyone."""

    group_id: bytes
    members: tuple[GroupMember, ...]

    def index_of(self, peer: PeerID) -> int:
        for index, member in enumerate(self.members):
            if member.peer_id == peer:
                return index
        raise ValueError(f"{peer} is not a member of this group")

    @property
    def senders(self) -> list[int]:
        return [i for i, m in enumerate(self.members) if m.mode is not MemberMode.AUX]

    def span_sizes(
        self, numel: int, min_vector_size: int = 0, max_share: float | None = MAX_SHARE
    ) -> list[int]:
        bandwidths = [
            0.0 if m.mode is MemberMode.CLIENT or m.address is None else m.bandwidth
            for m in self.members
        ]
        return load_balance(numel, bandwidths, min_vector_size, max_share)


@dataclass
class AllReduceResult:
    """What one member's all-reduce did."""

    #: members (indices) whose values went into the mean with a positive weight
    contributors: list[int]
    total_weight: float
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    #: elements this member reduced
    reduced: int = 0
    #: reducers whose span (from part ``part`` on) kept this member's local values, and why:
    #: ``(reducer, part, reason)`` (it failed or stalled)
    local_spans: list[tuple[int, int, str]] = field(default_factory=list)
    #: senders that a reducer left out of its parts from ``part`` on, and why:
    #: ``(reducer, sender, part, reason)``
    dropped: list[tuple[int, int, int, str]] = field(default_factory=list)
    #: senders whose contributions to this member's span were clipped (``clip_norm``)
    clipped: list[int] = field(default_factory=list)
    #: parts of a reducer's span that it did not answer here but another member relayed
    #: (it had applied them): ``(reducer, first part, stop, member that relayed)``
    relayed: list[tuple[int, int, int, int]] = field(default_factory=list)
    #: members whose values (sent to this member's span) or means (answered or relayed to
    #: it) held NaN or an infinity, or were too large to average, or whose weight was past
    #: ``MAX_WEIGHT``: they were refused
    nonfinite: list[int] = field(default_factory=list)
    #: this member's own values held NaN or an infinity: it took the mean without
    #: contributing (weight 0)
    own_nonfinite: bool = False
    #: when this member's all-reduce began (``anyio.current_time()``), and each part it sent
    #: or received since, as ``(time, bytes)`` once it was sent or had come: what the averager
    #: measures its throughput from (:mod:`swarmavg.proto.bandwidth`); a runner that does not
    #: record them leaves them empty
    started: float = 0.0
    sent_log: list[tuple[float, int]] = field(default_factory=list)
    received_log: list[tuple[float, int]] = field(default_factory=list)
    #: the same, counted where the bytes crossed the network (``(time, bytes)`` that reached,
    #: or arrived from, the group's members since the previous sample, on all connections to
    #: them; see :meth:`~swarmavg.abc.Connection.traffic`): empty where the transport
    #: does not tell. Unlike the logs above, they do not see a socket buffer filled or
    #: drained at once, so the averager measures from them where it has them.
    wire_sent_log: list[tuple[float, int]] = field(default_factory=list)
    wire_received_log: list[tuple[float, int]] = field(default_factory=list)

    @property
    def incomplete(self) -> bool:
        """Whether some of the vector was not averaged over every contributor."""
        return bool(self.local_spans or self.dropped)


@dataclass(frozen=True)
class GroupInfo:
    """A group that formed: its :class:`Group`, each member's gathered metadata (bytes, as
    the member packed it) and who led it."""

    group: Group
    gathered: dict[PeerID, bytes]
    leader: PeerID


class Matchmaker(ABC):
    """Finds groups of peers to average with."""

    @abstractmethod
    async def look_for_group(self, bits: str, *, gather: bytes, begin_at: float) -> GroupInfo:
        """A group for this peer under the group key ``bits``, beginning at the latest at
        ``begin_at`` (DHT time), every member's ``gather`` attached.

        :raises swarmavg.errors.MatchmakingFailed: no group formed in time.
        """

    def close(self) -> None:  # noqa: B027 (optional: most matchmakers serve nothing)
        """Stop taking part (serving other peers' requests). Idempotent."""


_NO_COMPRESSION = NoCompression()
_DEFAULT_CONFIG = RoundConfig()


class AllReduceRunner(ABC):
    """Averages flat buffers over a group.

    ``in_place``: whether the buffers may be the caller's own memory (the averager then
    passes a tensor's memory itself, without copying it in and out). A runner that says so
    writes into the buffers nothing but the round's results (a part of the vector is left as
    it was, or given its average, also when the round fails), takes the keyword argument
    ``results_valid`` (``None``, or a callable that tells whether the buffers still hold this
    round's results once :meth:`run` has returned: the caller's memory changes afterwards), and
    does not read or write the buffers after :meth:`run` returned unless it says yes. Runners
    that do not set it get copies, and a failed round leaves the caller's values as they were.
    """

    in_place: ClassVar[bool] = False
    #: whether :meth:`run` takes the keyword argument ``upload_rate`` (bytes/s, this member's
    #: measured throughput; passed only when known): the runner may pace its connections by it
    paces: ClassVar[bool] = False

    @abstractmethod
    async def run(
        self,
        group: Group,
        buffers: Sequence[npt.NDArray[Any]],
        layout: FlatLayout,
        *,
        config: RoundConfig = _DEFAULT_CONFIG,
        weight: float = 1.0,
        compression: CompressionBase | AdaptiveCompression = _NO_COMPRESSION,
        tensor_infos: Sequence[TensorInfo] | None = None,
        error_feedback: ErrorFeedback | None = None,
    ) -> AllReduceResult:
        """Average this member's ``buffers`` (one per ``layout`` buffer, updated in place) with
        the rest of ``group``, with this member's ``weight``, as ``config`` (a
        :class:`~swarmavg.proto.butterfly.RoundConfig`) says: elements per part, the round's
        ``timeout``, ``averaging_alpha``, ``min_vector_size``, and ``clip_norm`` (every
        contribution this member reduces is scaled down to an L2 norm of ``clip_norm`` over the
        whole vector, enforced part by part in proportion to the part's length). A sender silent
        for ``config.sender_timeout`` or a reducer silent for ``config.reducer_timeout`` is done
        without (the result says what stayed local).

        ``compression`` (a codec, or a chooser given one ``tensor_infos`` entry per tensor of
        ``layout``) compresses what travels; ``error_feedback`` (kept by the caller from round
        to round) carries what it lost to the next round. (The averager passes these three
        only when it compresses, so runners written without them keep working uncompressed.)

        :raises swarmavg.errors.AllReduceFailed: the average was not computed.
        """

    def expect(self, group: Group) -> None:  # noqa: B027 (optional)
        """This member will run ``group``'s round, maybe not at once (it waits for its
        trigger): hold the other members' requests for it until then."""

    async def leave(self, group: Group, reason: str) -> None:  # noqa: B027 (optional)
        """This member leaves ``group`` before (or while) running its round: tell the others,
        so that they stop waiting for it. Must not raise; bounded in time."""
