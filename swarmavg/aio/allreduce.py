"""The butterfly all-reduce over a group's RPC connections.

Every member of a :class:`Group` runs :meth:`AllReduceService.run` with the same group: the
arithmetic (:mod:`swarmavg.proto.allreduce`) gives each member the same plan of spans and parts.
A member with a span *reduces* it: the senders (every member but auxiliary ones) each open one
bidirectional call to it (``avg.allreduce``), stream their values of its parts, and read back
each part's weighted mean as soon as every sender delivered that part, so that sending,
reducing and receiving overlap. A member's own span is reduced locally. Results are written into
the member's flat buffers in place (``local += alpha · (mean - local)``).

One :class:`AllReduceService` serves a node: it routes incoming calls to the round (group id)
they belong to; a call that arrives before its round started waits for it (bounded).

Compression (``compression=``, a codec or a per-tensor chooser with ``tensor_infos=``): every
part has one codec, the one chosen for the tensor that holds most of the part's elements (the
first such tensor on a tie; a part is a slice of a flat per-dtype buffer and may span several
tensors). A sender compresses its values of a part, the reducer compresses the part's mean once
and sends that to every sender, and applies to its own buffer what that decodes to, so that
every member ends with the same values. The codec name travels with each part
(:class:`AvgCompressedPart`; :class:`NoCompression` parts stay plain :class:`AvgPart`), and
receivers decode whatever codec was sent, after checking the declared shape and dtype against
the part (a sender whose part fails the checks is left out). Big parts are (de)compressed in a
worker thread. With ``error_feedback=`` (a :class:`~swarmavg.compression.ErrorFeedback`, kept
from round to round by the caller), what compression lost is added to the values sent next
time (both a sender's values and a reducer's means; keyed by the part's place in its buffer).

Faults: a sender that fails, sends bad values or stalls (``sender_timeout``) is left out of the
parts it had not delivered, and the other senders are told (:class:`AvgDropped`); a reducer that
fails or stalls (``reducer_timeout``) leaves the rest of its span at local values; a member that
leaves (its step was cancelled) tells the others (``avg.leave``), who go on without it at once;
so does a member whose connection to us is lost, or that we cannot connect to while it is not
connected to us (it died after its group formed: it will not send either).
The result says what stayed local and who was left out (``incomplete``).

Relay: a reducer that dies (or stalls, or leaves out a sender) while answering may have
answered some members more parts than others. So that survivors do not end disagreeing, a
member left with part of a reducer's span unanswered asks the other members (``avg.relay``)
how much of that span they applied, and fetches the rest from the one that applied most; with
``averaging_alpha=1`` a member's buffer there holds exactly the mean it was answered. A member
answers for a round in progress once it is done with that span, and for a finished round as
long as its buffers hold the round's results (until its next round; at most ``_RELAY_KEEP``
seconds; buffers that are the caller's tensors, averaged in place, until the caller says they
changed: ``results_valid``). Members with another ``averaging_alpha`` neither relay nor are
relayed to the wrong values: they answer that they have nothing. Asking a member that stalls
costs no more than the ask's budget (a transport must let a send that has not started be
cancelled).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import logging
import math
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc
import anyio.to_thread
import numpy as np
import numpy.typing as npt

from swarmavg.abc._averaging import (
    AllReduceResult,
    AllReduceRunner,
    Group,
    GroupMember,
    MemberMode,
)
from swarmavg.compression import (
    AdaptiveCompression,
    CompressedTensor,
    CompressionBase,
    ErrorFeedback,
    NoCompression,
    TensorInfo,
    decompress,
)
from swarmavg.errors import AllReduceFailed, ConnectError, SwarmError
from swarmavg.proto.allreduce import (
    AccumulatorPool,
    FlatLayout,
    Part,
    _all_finite,
    plan_parts,
)
from swarmavg.proto.averaging_messages import (
    AvgBegin,
    AvgCompressedPart,
    AvgDropped,
    AvgHave,
    AvgKeep,
    AvgLeave,
    AvgPart,
    AvgRelay,
    AvgWeights,
)
from swarmavg.proto.butterfly import (
    Action,
    AnswerCame,
    AnswerDecoded,
    Apply,
    Began,
    ButterflyRound,
    CallOpened,
    Decode,
    Dropped,
    EndCall,
    Event,
    Excluded,
    Fault,
    GaveUp,
    Malformed,
    MemberLeft,
    NonFiniteData,
    OutOfOrder,
    OwnPart,
    PartCame,
    PartDecoded,
    Reason,
    Reduced,
    ReducerEnded,
    ReducerFailed,
    RelayReader,
    RoundConfig,
    SenderBroke,
    SenderEnded,
    SenderStage,
    Tick,
    TooLate,
    UnknownRound,
    check_leave,
    check_relay_request,
)
from swarmavg.proto.codec import Message

if TYPE_CHECKING:
    from swarmavg.abc import Connection
    from swarmavg.aio.node import Node
    from swarmavg.aio.rpc import CallContext
    from swarmavg.identity import PeerID

__all__ = [
    "AllReduceFailed",
    "AllReduceResult",
    "AllReduceService",
    "Group",
    "GroupMember",
    "MemberMode",
]

logger = logging.getLogger(__name__)

METHOD: Final = "avg.allreduce"
LEAVE_METHOD: Final = "avg.leave"
RELAY_METHOD: Final = "avg.relay"
#: How long a member asks its groupmates for the parts a reducer did not answer (seconds;
#: also bounded by the reducer timeout and what is left of the round's timeout).
_RELAY_TIMEOUT: Final = 10.0
#: How long a finished round's results can be relayed (seconds), and how many rounds.
_RELAY_KEEP: Final = 120.0
_RELAY_ROUNDS: Final = 8
#: How often a round samples what crossed the network to its members (seconds; see
#: ``_WireSampler``).
_WIRE_SAMPLE: Final = 0.05
#: Pacing (see ``_pacing_plan``): each connection's cap is this times its share of our upload
#: rate. None above: the rate is a peak measurement, already a little above what the link
#: sustains, and caps 10% higher let the connections drift apart again (docs/design/averaging.md).
_PACING_MARGIN: Final = 1.0
#: ... only in rounds where we send at least this much (bytes) to at least two members...
_PACING_MIN_BYTES: Final = 16 << 20
#: ... and to at most this many: with more connections to share an upload, the flows came out
#: even enough by themselves, and caps cost more at the round's end than they saved (on the
#: network lab, 8% at 6 peers and 9% at 8; docs/design/averaging.md).
_PACING_MAX_PEERS: Final = 3
#: How long a call for a round that has not started here yet waits for it (seconds).
_JOIN_WAIT: Final = 10.0
#: ... for a round this node expects to run (its member waits for its trigger); the caller's
#: own timeout ends the wait sooner.
_EXPECT_WAIT: Final = 600.0
#: How long a leaving member spends telling the others (seconds).
_LEAVE_TIMEOUT: Final = 2.0
#: Leave notices kept for rounds that have not started here (bounded: they come from the network).
_LEFT_MEMORY: Final = 256
#: Rounds a node waits for at once (calls for more unknown rounds are refused).
_MAX_PENDING_ROUNDS: Final = 64
#: Finished rounds remembered, so that late calls for them fail at once.
_FINISHED_MEMORY: Final = 256
#: A member whose last connection to us was lost this recently (seconds), and to which no
#: connection is open, counts as gone when a round with it starts here (it died between the
#: group's forming and our round's start; short, so that a connection closed for idleness
#: before a group formed is no false alarm).
_LOST_RECENTLY: Final = 2.0
_LOST_MEMORY: Final = 1024
#: Parts bigger than this (bytes) are compressed and decompressed in a worker thread.
_THREAD_THRESHOLD: Final = 1 << 20
_NO_COMPRESSION: Final = NoCompression()
_DEFAULT_CONFIG: Final = RoundConfig()


@dataclass(frozen=True)
class _Outbound:
    """What this member sends its reducers in a round, and where their answers go."""

    buffers: Sequence[npt.NDArray[Any]]
    weight: float
    alpha: float
    result: AllReduceResult
    #: every member's weight, as the reducers tell it
    weights: dict[int, float]


@dataclass
class _Applied:
    """What a member applied of each reducer's span in a round (its own span included), for
    groupmates that missed some of it (``avg.relay``): valid while its buffers hold them."""

    group: Group
    plans: list[list[Part]]
    buffers: Sequence[npt.NDArray[Any]]
    #: whether these buffers hold the means (``averaging_alpha=1``, not auxiliary)
    relayable: bool
    #: parts of each reducer's span applied here (from part 0 on)
    got: dict[int, int] = field(default_factory=dict)
    #: ... of those, the parts answered with AvgKeep (the local values stayed)
    kept: dict[int, set[int]] = field(default_factory=dict)
    #: set once this member is done with each reducer's span
    settled: dict[int, anyio.Event] = field(default_factory=dict)
    #: the senders each reducer left out: ``(reducer, sender, part, reason)``
    dropped: list[tuple[int, int, int, str]] = field(default_factory=list)
    until: float = math.inf
    #: once the round is over: whether ``buffers`` still hold its results (``None``: they do,
    #: until ``until`` or the next round on them)
    valid: Callable[[], bool] | None = None
    #: the memory the round ran on, when ``buffers`` became a copy of it (see
    #: :meth:`AllReduceService.keep_results`)
    origin: Sequence[npt.NDArray[Any]] = ()

    def __post_init__(self) -> None:
        for reducer in range(len(self.plans)):
            self.settled[reducer] = anyio.Event()
            self.kept[reducer] = set()

    def applied(self, reducer: int, keep: bool) -> None:
        """One more part of ``reducer``'s span applied here."""
        count = self.got.get(reducer, 0)
        if keep:
            self.kept[reducer].add(count)
        self.got[reducer] = count + 1

    def close(self) -> None:
        for event in self.settled.values():
            event.set()

    def holds_results(self, in_progress: bool) -> bool:
        """Whether the buffers still hold what this round applied (a round in progress
        holds the caller's memory; a finished one may have given it back)."""
        if self.until < anyio.current_time():
            return False
        return in_progress or self.valid is None or self.valid()


class _WireSampler:
    """Samples, every ``_WIRE_SAMPLE`` seconds of a round, what crossed the network on the
    connections to the group's members (:meth:`~swarmavg.abc.Connection.traffic`) into the
    result's ``wire_sent_log`` / ``wire_received_log``: bytes that reached the members and
    bytes that arrived from them, per sample. Every open connection to a member counts (two
    members that dialed each other at once hold two, and each sends on its own pooled one: what
    this node receives comes over the other); one opened during the round counts from 0; one
    whose transport does not tell makes the logs say nothing (they are cleared)."""

    def __init__(self, node: Node, peers: Sequence[PeerID], result: AllReduceResult) -> None:
        self.node = node
        self.peers = list(peers)
        self.result = result
        #: per connection: its last (sent, received)
        self.last: dict[Connection, tuple[int, int]] = {}
        self.blind = False
        for peer in self.peers:
            for conn in node.connections_to(peer):
                traffic = conn.traffic()
                if traffic is None:
                    self.blind = True
                else:
                    self.last[conn] = traffic

    def tells(self) -> bool:
        """Whether the connections count their traffic (as far as is known: none open yet
        that does not)."""
        return not self.blind

    async def run(self) -> None:
        while not self.blind:
            await anyio.sleep(_WIRE_SAMPLE)
            self.sample()

    def sample(self) -> None:
        if self.blind:
            return
        sent = received = 0
        seen: dict[Connection, tuple[int, int]] = {}
        for peer in self.peers:
            for conn in self.node.connections_to(peer):
                traffic = conn.traffic()
                if traffic is None:
                    self.blind = True
                    self.result.wire_sent_log.clear()
                    self.result.wire_received_log.clear()
                    return
                then_sent, then_received = self.last.get(conn, (0, 0))
                sent += max(traffic[0] - then_sent, 0)
                received += max(traffic[1] - then_received, 0)
                seen[conn] = traffic
        self.last = seen
        now = anyio.current_time()
        if sent:
            self.result.wire_sent_log.append((now, sent))
        if received:
            self.result.wire_received_log.append((now, received))


@dataclass
class _Round:
    """A round in progress on this node: its machine (:class:`ButterflyRound`, which decides)
    and what the driver keeps to carry out its actions."""

    machine: ButterflyRound
    ready: list[anyio.Event] = field(default_factory=list)
    results: list[npt.NDArray[Any] | None] = field(default_factory=list)
    bytes_received: int = 0
    #: the reduced parts' answers to the senders, counted as each part is reduced
    bytes_sent: int = 0
    #: ``(time, bytes)`` of each sender's part that came, and of each answer once sent (what
    #: the averager measures its throughput from; see ``AllReduceResult.sent_log``)
    received_log: list[tuple[float, int]] = field(default_factory=list)
    sent_log: list[tuple[float, int]] = field(default_factory=list)
    #: our calls to the other reducers, cancelled if we give up on one: reducer -> scope
    exchanges: dict[int, anyio.CancelScope] = field(default_factory=dict)
    #: the wait of each sender's call for its next message (cancelled to end the call), and
    #: why calls were ended
    waits: dict[int, anyio.CancelScope] = field(default_factory=dict)
    ended: dict[int, Reason] = field(default_factory=dict)
    #: why the round was aborted (this member left it), if it was
    left: str | None = None
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    #: the codec of each of our parts (the means we answer are compressed with it)
    codecs: list[CompressionBase] = field(default_factory=list)
    feedback: ErrorFeedback | None = None
    #: each part's answer once ready (``None``: the plain mean in ``results``, or keep)
    answers: list[AvgCompressedPart | None] = field(default_factory=list)
    #: where big means are compressed (while the round's tasks run)
    tasks: anyio.abc.TaskGroup | None = None
    applied: _Applied | None = None
    #: what this member sends and where answers go (set once the round runs)
    out: _Outbound | None = None
    #: the pacing cap (bytes/s) of our connection to each member (see ``_pacing_plan``), and
    #: the connections this round capped
    pacing: dict[PeerID, float] = field(default_factory=dict)
    paced: set[Connection] = field(default_factory=set)
    #: each part reduced and answerable (``ready`` is also set for every part when the round
    #: ends here, so that the calls still waiting for answers end too)
    final: list[bool] = field(default_factory=list)
    #: set when an event moved the machine's deadline (the timer task looks again)
    changed: anyio.Event = field(default_factory=anyio.Event)
    #: whether the timer task runs (it ends once this is false and ``changed`` set)
    timing: bool = True
    closed: bool = False

    def __post_init__(self) -> None:
        for _ in self.parts:
            self.ready.append(anyio.Event())
            self.results.append(None)
            self.answers.append(None)
            self.final.append(False)
        if not self.codecs:
            self.codecs = [_NO_COMPRESSION] * len(self.parts)

    @property
    def group(self) -> Group:
        return self.machine.group

    @property
    def me(self) -> int:
        return self.machine.me

    @property
    def parts(self) -> list[Part]:
        return self.machine.parts

    @property
    def layout(self) -> FlatLayout:
        return self.machine.layout

    def feed(self, event: Event) -> list[Decode]:
        """Give the machine ``event`` and carry out what it says; the parts or answers to
        decode are left to the caller (who awaits them).

        :raises RoundProtocolError: the event's sender broke the protocol (its actions were
            carried out first).
        """
        try:
            self.machine.receive(event, anyio.current_time())
        finally:
            decodes = self.act(self.machine.actions())
            self.changed.set()
        return decodes

    def act(self, actions: Sequence[Action]) -> list[Decode]:
        decodes = []
        for action in actions:
            match action:
                case Decode():
                    decodes.append(action)
                case Reduced():
                    self._settle(action.index, action.mean)
                case Apply():
                    self._apply_answer(action)
                case Excluded():
                    self._excluded(action)
                case EndCall():
                    self._end_call(action.sender, action.reason)
                case GaveUp():
                    scope = self.exchanges.get(action.reducer)
                    if scope is not None:
                        scope.cancel()
                case Dropped():
                    if self.out is not None:
                        self.out.result.dropped.append(
                            (action.reducer, action.sender, action.first, action.reason)
                        )
        return decodes

    def _excluded(self, action: Excluded) -> None:
        logger.debug(
            "all-reduce %s: member %d (%s) left out of parts %d.. of our span: %s",
            self.group.group_id.hex()[:8],
            action.sender,
            self.group.members[action.sender].peer_id.short(),
            action.first,
            action.reason,
        )
        self._end_call(action.sender, action.reason)

    def _end_call(self, sender: int, reason: Reason) -> None:
        self.ended.setdefault(sender, reason)
        scope = self.waits.get(sender)
        if scope is not None:
            scope.cancel()

    def _apply_answer(self, action: Apply) -> None:
        out = self.out
        assert out is not None
        part = self.machine.plans[action.reducer][action.index]
        local = out.buffers[part.buffer][part.start : part.stop]
        if action.mean is not None:
            if action.nbytes:
                out.result.bytes_received += action.nbytes
                out.result.received_log.append((anyio.current_time(), action.nbytes))
            _apply(local, action.mean, out.alpha)
        assert self.applied is not None
        self.applied.applied(action.reducer, keep=action.mean is None)

    def _settle(self, index: int, mean: npt.NDArray[Any] | None) -> None:
        part = self.parts[index]
        dtype = _numpy_dtype(self.layout.buffers[part.buffer][0])
        codec = self.codecs[index]
        if mean is None or isinstance(codec, NoCompression):
            self.results[index] = None if mean is None else mean.astype(dtype, copy=False)
            self.final[index] = True
            self._count_answers(index)
            self.ready[index].set()
            return
        mean = mean.astype(dtype, copy=False)
        if self.tasks is not None and mean.nbytes > _THREAD_THRESHOLD:
            self.tasks.start_soon(self._settle_compressed, index, mean, codec)
        else:
            self._answer_with(index, mean, *self._compress_mean(index, mean, codec))

    def _compress_mean(
        self, index: int, mean: npt.NDArray[Any], codec: CompressionBase
    ) -> tuple[CompressedTensor | None, npt.NDArray[Any] | None]:
        """The mean compressed and what that decodes to (``None, None``: it cannot be
        compressed, e.g. float64 magnitudes beyond float32's; it is sent as it is)."""
        part = self.parts[index]
        key = ("mean", part.buffer, part.start, part.stop)
        tensor = _compress(codec, mean, self.feedback, key)
        if tensor is None:
            return None, None
        return tensor, decompress(tensor)

    async def _settle_compressed(
        self, index: int, mean: npt.NDArray[Any], codec: CompressionBase
    ) -> None:
        tensor, decoded = await anyio.to_thread.run_sync(self._compress_mean, index, mean, codec)
        self._answer_with(index, mean, tensor, decoded)

    def _answer_with(
        self,
        index: int,
        mean: npt.NDArray[Any],
        tensor: CompressedTensor | None,
        decoded: npt.NDArray[Any] | None,
    ) -> None:
        if tensor is None or decoded is None:
            self.results[index] = mean
        else:  # we apply what the senders will decode: every member ends with the same values
            self.answers[index] = AvgCompressedPart.of(index, tensor)
            self.results[index] = decoded
        self.final[index] = True
        self._count_answers(index)
        self.ready[index].set()

    def _count_answers(self, index: int) -> None:
        """Count the bytes of part ``index``'s answer once per sender that gets it (every
        other sender that called, unless it was left out of this part)."""
        compressed = self.answers[index]
        mean = self.results[index]
        size = compressed.nbytes if compressed is not None else 0 if mean is None else mean.nbytes
        excluded = self.machine.excluded
        recipients = sum(
            1
            for sender in self.machine.weights
            if sender != self.me and not (sender in excluded and excluded[sender][0] <= index)
        )
        self.bytes_sent += size * recipients

    def leave(self, member: int, fault: Fault, detail: str) -> None:
        """``member`` left: leave it out of what it had not delivered, stop waiting for its
        span (our values stay local there)."""
        self.feed(MemberLeft(member, fault, detail))

    def abort(self, reason: str) -> None:
        if self.left is None:
            self.left = reason
            self.scope.cancel()

    def close(self) -> None:
        """The round is over here: wake the calls still waiting for answers (they end)."""
        self.closed = True
        for event in self.ready:
            event.set()
        for scope in self.waits.values():
            scope.cancel()


def _pacing_plan(
    group: Group,
    me: int,
    layout: FlatLayout,
    plans: Sequence[Sequence[Part]],
    sends_values: bool,
    upload_rate: float | None,
) -> dict[PeerID, float]:
    """The pacing cap (bytes/s) of our connection to each member this round sends to: our
    ``upload_rate`` split in proportion to what we send each (our values of its span, and
    the means of our span it receives), times ``_PACING_MARGIN``; empty (no pacing) without
    a rate, with fewer than two or more than ``_PACING_MAX_PEERS`` members to send to, or
    under ``_PACING_MIN_BYTES`` in all.

    Why: the connections of one upload share one queue (at the access link, usually
    first-in first-out), and TCP's congestion control does not share it evenly: on the
    network lab one of a host's three connections ran at about twice the rate of the others
    for whole rounds, and the means of the last parts waited for the slowest one. Capped at
    their share, they all finish together."""
    if upload_rate is None or not (upload_rate > 0 and math.isfinite(upload_rate)):
        return {}
    itemsizes = [_numpy_dtype(dtype).itemsize for dtype, _ in layout.buffers]

    def nbytes(parts: Sequence[Part]) -> int:
        return sum(part.size * itemsizes[part.buffer] for part in parts)

    means = nbytes(plans[me])
    senders = set(group.senders)
    carried: dict[PeerID, int] = {}
    for index, member in enumerate(group.members):
        if index == me:
            continue
        amount = (nbytes(plans[index]) if sends_values else 0) + (means if index in senders else 0)
        if amount > 0:
            carried[member.peer_id] = amount
    total = sum(carried.values())
    if not 2 <= len(carried) <= _PACING_MAX_PEERS or total < _PACING_MIN_BYTES:
        return {}
    return {peer: _PACING_MARGIN * upload_rate * amount / total for peer, amount in carried.items()}


def _numpy_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(np.float32 if name == "bfloat16" else name)


def _compress(
    codec: CompressionBase,
    values: npt.NDArray[Any],
    feedback: ErrorFeedback | None,
    key: Hashable,
) -> CompressedTensor | None:
    """``values`` compressed (plus the residual under ``key``), or ``None`` where ``codec``
    cannot compress them (float64 magnitudes beyond float32's: sent as they are)."""
    try:
        if feedback is None:
            return codec.compress(values)
        return feedback.compress(codec, values, key)
    except ValueError:
        return None


async def _in_thread_if_big(nbytes: int, fn: Callable[[], Any]) -> Any:
    """``fn()``, in a worker thread if ``nbytes`` is big (numpy releases the GIL)."""
    if nbytes > _THREAD_THRESHOLD:
        return await anyio.to_thread.run_sync(fn)
    return fn()


async def _decode(message: AvgCompressedPart, dtype: np.dtype[Any]) -> npt.NDArray[Any] | None:
    """The values of a compressed part whose declared shape and dtype the round checked
    (``None``: they do not decode)."""
    size = message.shape[0] if message.shape else 0
    try:
        decoded: npt.NDArray[Any] = await _in_thread_if_big(
            size * dtype.itemsize, lambda: decompress(message.tensor())
        )
    except ValueError as exc:
        logger.debug("part %d does not decode: %s", message.index, exc)
        return None
    return decoded


def part_codecs(
    layout: FlatLayout,
    parts: Sequence[Part],
    compression: CompressionBase | AdaptiveCompression,
    tensor_infos: Sequence[TensorInfo] | None = None,
) -> list[CompressionBase]:
    """The codec of each part: ``compression`` itself, or what an adaptive ``compression``
    chooses for the tensor that holds most of the part's elements (the first one on a tie),
    described by its ``tensor_infos`` entry (default: role ``unspecified``, its size)."""
    if isinstance(compression, CompressionBase):
        return [compression] * len(parts)
    infos = _tensor_infos(layout, tensor_infos)
    offsets: dict[int, list[int]] = {}
    tensors: dict[int, list[int]] = {}
    for t, (buffer, offset) in enumerate(layout.places):
        offsets.setdefault(buffer, []).append(offset)
        tensors.setdefault(buffer, []).append(t)
    chosen: dict[int, CompressionBase] = {}
    codecs = []
    for part in parts:
        starts, ids = offsets[part.buffer], tensors[part.buffer]
        i = max(bisect.bisect_right(starts, part.start) - 1, 0)
        best, most = ids[i], -1
        while i < len(starts) and starts[i] < part.stop:
            t = ids[i]
            overlap = min(part.stop, starts[i] + layout.specs[t].numel) - max(part.start, starts[i])
            if overlap > most:
                best, most = t, overlap
            i += 1
        if best not in chosen:
            chosen[best] = compression.choose(infos[best])
        codecs.append(chosen[best])
    return codecs


def _tensor_infos(
    layout: FlatLayout, tensor_infos: Sequence[TensorInfo] | None
) -> Sequence[TensorInfo]:
    if tensor_infos is None:
        return [TensorInfo(size=spec.numel) for spec in layout.specs]
    if len(tensor_infos) != len(layout.specs) or not all(
        isinstance(info, TensorInfo) for info in tensor_infos
    ):
        raise ValueError(f"tensor_infos must hold one TensorInfo per tensor ({len(layout.specs)})")
    return tensor_infos


_services: weakref.WeakKeyDictionary[Node, AllReduceService] = weakref.WeakKeyDictionary()


class AllReduceService(AllReduceRunner):
    """Runs all-reduce rounds for the members on one node and serves ``avg.allreduce``."""

    #: the buffers may be the caller's tensors (see :class:`~swarmavg.abc.AllReduceRunner`)
    in_place = True
    #: ``run`` takes ``upload_rate`` and paces its connections by it (see ``_pacing_plan``)
    paces = True

    def __init__(self, node: Node, *, join_wait: float = _JOIN_WAIT) -> None:
        self.node = node
        self.join_wait = join_wait
        self._rounds: dict[bytes, _Round] = {}
        self._waiting: dict[bytes, anyio.Event] = {}
        self._expected: set[bytes] = set()
        self._finished: OrderedDict[bytes, None] = OrderedDict()
        #: leave notices for rounds not started here: group id -> (who, its index, why)
        self._left: OrderedDict[bytes, tuple[PeerID, int, str]] = OrderedDict()
        #: finished rounds whose results can still be relayed (see the module docstring)
        self._recent: OrderedDict[bytes, _Applied] = OrderedDict()
        #: the rounds' accumulators, recycled (a fresh one is page-faulted in every round)
        self._accumulators = AccumulatorPool()
        #: rounds whose other members we told that we are out
        self._told: OrderedDict[bytes, None] = OrderedDict()
        #: peers whose last connection to us ended, and when (``anyio.current_time()``)
        self._lost: OrderedDict[PeerID, float] = OrderedDict()
        #: connections paced by running rounds: the caps each round asked for (their sum holds)
        self._paced: dict[Connection, dict[bytes, float]] = {}
        node.watch_peers(self._peer_lost)
        node.rpc.register(METHOD, self._serve, kind="bidi", request_type=Message)
        node.rpc.register(LEAVE_METHOD, self._serve_leave, request_type=AvgLeave)
        node.rpc.register(
            RELAY_METHOD, self._serve_relay, kind="server_stream", request_type=AvgRelay
        )

    @staticmethod
    def _finite(buffers: Sequence[npt.NDArray[Any]]) -> bool:
        """Whether our own values are all finite (else we send none: weight 0)."""
        return all(_all_finite(buffer) for buffer in buffers)

    def _peer_lost(self, peer: PeerID) -> None:
        """Our last connection to ``peer`` ended (its process died, or it closed its node): in
        every round here it is a member of, it is gone (the others go on without it at once
        instead of waiting out the sender and reducer timeouts)."""
        self._lost[peer] = anyio.current_time()
        self._lost.move_to_end(peer)
        while len(self._lost) > _LOST_MEMORY:
            self._lost.popitem(last=False)
        for round_ in list(self._rounds.values()):
            for index, member in enumerate(round_.group.members):
                if member.peer_id == peer and index != round_.me:
                    round_.leave(index, Fault.LOST, "its connection was lost")

    @classmethod
    def for_node(cls, node: Node) -> AllReduceService:
        """The node's service (made on first use: one per node, whatever uses it)."""
        service = _services.get(node)
        if service is None:
            service = _services[node] = cls(node)
        return service

    # -- running a round -------------------------------------------------------------------------

    async def run(
        self,
        group: Group,
        buffers: Sequence[npt.NDArray[Any]],
        layout: FlatLayout,
        **options: Any,
    ) -> AllReduceResult:
        """Average ``buffers`` with the rest of ``group`` (see :meth:`_run` for the options).
        If the round fails here as a whole, the other members are told at once (in the
        background), as when this member leaves: they go on without it instead of waiting
        for it to send or answer.

        :raises AllReduceFailed: the round took more than ``timeout``, a member left it, or no
            part of the vector was averaged.
        """
        try:
            return await self._run(group, buffers, layout, **options)
        except AllReduceFailed as exc:
            self._tell_left(group, f"its round failed: {exc}")
            raise

    async def _run(
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
        results_valid: Callable[[], bool] | None = None,
        upload_rate: float | None = None,
    ) -> AllReduceResult:
        """Average ``buffers`` (this member's flat buffers, one per ``layout`` buffer, updated in
        place) with the rest of ``group``, as ``config`` says (part size, timeouts, alpha,
        clipping: :class:`~swarmavg.proto.butterfly.RoundConfig`).

        ``upload_rate`` (bytes/s; the averager passes its measured bandwidth): the connections
        this round sends on are paced to share it in proportion to what each carries (see
        :func:`_pacing_plan`) while the round runs.

        ``results_valid``: the buffers are the caller's memory, which changes after this
        returns; groupmates are relayed results from them only while it says ``True`` (see
        the module docstring).

        With ``config.clip_norm``, each contribution to a part of our span (ours included) is
        scaled down to an L2 norm of ``clip_norm · sqrt(part size / vector size)`` if longer: a
        contribution's norm over the whole vector is then at most ``clip_norm`` (its parts are
        clipped independently, so a long one loses more where it is longest).

        Parts are compressed with ``compression`` (a codec, or a chooser given each tensor's
        ``tensor_infos`` entry: see :func:`part_codecs`); ``error_feedback`` keeps what
        compression lost for the next round (see the module docstring).

        A sender that fails, sends bad values, or stalls for ``sender_timeout`` seconds (or has
        not begun by then) is left out of the parts of our span it had not delivered; a reducer
        that fails or stalls for ``reducer_timeout`` leaves the rest of its span at our local
        values. Either makes the result :attr:`~AllReduceResult.incomplete` (saying what).

        :raises AllReduceFailed: the round took more than ``config.timeout``, a member left it,
            or no part of the vector was averaged.
        """
        if not isinstance(config, RoundConfig):
            raise TypeError(f"config must be a RoundConfig, not {config!r:.64}")
        timeout, averaging_alpha = config.timeout, config.averaging_alpha
        me = group.index_of(self.node.peer_id)
        mode = group.members[me].mode
        if group.group_id in self._rounds or group.group_id in self._finished:
            raise ValueError("this group's round already ran here")
        if not (weight >= 0 and math.isfinite(weight)):
            raise ValueError(f"weight must be a finite number >= 0, not {weight!r}")
        if mode is not MemberMode.AUX:
            for (dtype, size), buffer in zip(layout.buffers, buffers, strict=True):
                if buffer.shape != (size,) or buffer.dtype != _numpy_dtype(dtype):
                    raise ValueError(f"a buffer of {size} {dtype} expected, got {buffer.dtype}")
        if not isinstance(compression, CompressionBase | AdaptiveCompression):
            raise TypeError(f"compression must be a codec or a chooser, not {compression!r:.64}")
        _tensor_infos(layout, tensor_infos)
        spans = group.span_sizes(layout.numel, config.min_vector_size)
        plans = plan_parts(layout, spans, config.part_size)
        codecs = [part_codecs(layout, parts, compression, tensor_infos) for parts in plans]
        if error_feedback is not None:
            error_feedback.retain(
                {
                    ("send", p.buffer, p.start, p.stop)
                    for r, ps in enumerate(plans)
                    if r != me
                    for p in ps
                }
                | {("mean", p.buffer, p.start, p.stop) for p in plans[me]}
            )
        own_nonfinite = mode is not MemberMode.AUX and weight > 0 and not self._finite(buffers)
        if own_nonfinite:
            logger.warning(
                "all-reduce %s: our own values hold NaN or an infinity: we take the group's"
                " mean without contributing",
                group.group_id.hex()[:8],
            )
            weight = 0.0
        self._expected.discard(group.group_id)
        left = self._left.pop(group.group_id, None)
        started = anyio.current_time()
        self._forget_results(buffers)
        sends_values = mode is not MemberMode.AUX and weight > 0
        machine = ButterflyRound(
            group,
            me,
            plans,
            layout,
            config,
            sending=mode is not MemberMode.AUX,
            now=started,
            pool=self._accumulators,
        )
        round_ = _Round(machine, codecs=codecs[me], feedback=error_feedback)
        round_.pacing = _pacing_plan(group, me, layout, plans, sends_values, upload_rate)
        result = AllReduceResult([], 0.0, own_nonfinite=own_nonfinite, started=started)
        machine.report.local_spans = result.local_spans  # (the relay amends them)
        round_.out = outbound = _Outbound(buffers, weight, averaging_alpha, result, {})
        round_.applied = applied = _Applied(
            group,
            plans,
            buffers,
            relayable=averaging_alpha == 1.0 and mode is not MemberMode.AUX,
            dropped=result.dropped,
            valid=results_valid,
        )
        if mode is not MemberMode.AUX:
            machine.own_weight(float(weight))
        if left is not None:
            peer, sender, reason = left
            if 0 <= sender < len(group.members) and group.members[sender].peer_id == peer:
                round_.leave(sender, Fault.LEFT, f"it left the group: {reason}")
        for index, member in enumerate(group.members):
            lost = self._lost.get(member.peer_id)
            if (
                index != me
                and lost is not None
                and started - lost < _LOST_RECENTLY
                and self.node.connection_to(member.peer_id) is None
            ):
                round_.leave(index, Fault.LOST, "its connection was lost")
        senders = group.senders
        self._rounds[group.group_id] = round_
        waiting = self._waiting.pop(group.group_id, None)
        if waiting is not None:
            waiting.set()
        deadline = math.inf if timeout is None else anyio.current_time() + timeout
        wire = _WireSampler(
            self.node, [m.peer_id for i, m in enumerate(group.members) if i != me], result
        )
        try:
            for peer in round_.pacing:
                self._pace(round_, peer)
            with anyio.fail_after(timeout), round_.scope:
                # (the timers end by themselves, uncancelled: a cancelled task's frame, which
                # holds the round and its accumulators, lingers in its exception's traceback)
                async with anyio.create_task_group() as timers:
                    timers.start_soon(_run_timers, round_)
                    try:
                        async with anyio.create_task_group() as sampling:
                            if wire.tells():
                                sampling.start_soon(wire.run)
                            await self._run_tasks(group, round_, plans, codecs, outbound)
                            sampling.cancel_scope.cancel()
                    finally:
                        round_.timing = False
                        round_.changed.set()
                wire.sample()
            applied.close()
            if result.local_spans and round_.left is None:
                budget = min(config.reducer_timeout or _RELAY_TIMEOUT, _RELAY_TIMEOUT)
                round_.scope = anyio.CancelScope()  # (a member that leaves cancels this too)
                with (
                    round_.scope,
                    anyio.move_on_after(min(budget, deadline - anyio.current_time())),
                ):
                    await self._relay(round_, result, buffers, averaging_alpha, budget)
        except TimeoutError:
            raise AllReduceFailed(f"the all-reduce did not finish within {timeout} s") from None
        except AllReduceFailed:
            if round_.left is None:
                raise
        finally:
            self._unpace(round_)
            del self._rounds[group.group_id]
            round_.close()
            applied.close()
            self._finish(group.group_id)
        if round_.left is not None:
            raise AllReduceFailed(round_.left)
        if applied.relayable:
            applied.until = anyio.current_time() + _RELAY_KEEP
            self._recent[group.group_id] = applied
            while len(self._recent) > _RELAY_ROUNDS:
                self._recent.popitem(last=False)
        report = machine.report
        result.bytes_received += round_.bytes_received
        result.bytes_sent += round_.bytes_sent
        result.received_log += round_.received_log
        result.sent_log += round_.sent_log
        result.seconds = anyio.current_time() - started
        result.reduced = spans[me]
        result.clipped = sorted(report.clipped)
        if report.clipped:
            logger.info(
                "all-reduce %s: clipped the contributions of members %s to our span",
                group.group_id.hex()[:8],
                result.clipped,
            )
        for sender, (first, reason) in machine.excluded.items():
            result.dropped.append((me, sender, first, reason))
        result.nonfinite = sorted(set(result.nonfinite) | report.nonfinite)
        others = [i for i, parts in enumerate(plans) if parts and i != me]
        failed = {reducer for reducer, first, _ in result.local_spans if first == 0}
        if mode is not MemberMode.AUX and not round_.parts and others and set(others) <= failed:
            raise AllReduceFailed(
                "nothing was averaged: "
                + "; ".join(f"member {r}: {why}" for r, _, why in result.local_spans)
            )
        # every member agrees on who contributed: each reducer tells every sender all weights
        if round_.parts:
            weights = dict(machine.weights)
        else:
            weights = dict(machine.told)
            if mode is not MemberMode.AUX:
                weights.setdefault(me, float(weight))
        result.contributors = [i for i in senders if weights.get(i, 0.0) > 0]
        result.total_weight = sum(weights.get(i, 0.0) for i in senders)
        return result

    def _pace(self, round_: _Round, peer: PeerID) -> None:
        """Cap our pooled connection to ``peer`` at what ``round_``'s plan gives it (added to
        the caps of other rounds that pace it), once per connection and round."""
        rate = round_.pacing.get(peer)
        conn = self.node.connection_to(peer)
        if rate is None or conn is None or conn in round_.paced:
            return
        rates = self._paced.setdefault(conn, {})
        rates[round_.group.group_id] = rate
        if conn.set_pacing_rate(sum(rates.values())):
            round_.paced.add(conn)
        else:  # (the transport cannot pace, or the connection is gone)
            rates.pop(round_.group.group_id)
            if not rates:
                del self._paced[conn]

    def _unpace(self, round_: _Round) -> None:
        """Take ``round_``'s caps off its connections (another round's stay)."""
        for conn in round_.paced:
            rates = self._paced.get(conn, {})
            rates.pop(round_.group.group_id, None)
            if not rates:
                self._paced.pop(conn, None)
            conn.set_pacing_rate(sum(rates.values()) if rates else None)
        round_.paced.clear()

    def _finish(self, group_id: bytes) -> None:
        """Remember the round as over here; calls waiting for it fail."""
        self._finished[group_id] = None
        while len(self._finished) > _FINISHED_MEMORY:
            self._finished.popitem(last=False)
        self._expected.discard(group_id)
        waiting = self._waiting.pop(group_id, None)
        if waiting is not None:
            waiting.set()

    def keep_results(self, buffers: Sequence[npt.NDArray[Any]], max_bytes: int) -> None:
        """``buffers``, the caller's memory that a finished round ran on in place, are about
        to change: a round of three or more members whose results they still hold keeps a copy
        of them (if at most ``max_bytes``), so that a groupmate that a reducer stopped answering
        can still fetch what it missed (``avg.relay``) until our next round. Callable from any
        thread (the caller's training thread enters ``get_tensors``)."""
        for applied in list(self._recent.values()):
            valid = applied.valid
            if (
                valid is None
                or len(applied.group.members) < 3
                or not any(np.may_share_memory(a, b) for a in applied.buffers for b in buffers)
                or sum(b.nbytes for b in applied.buffers) > max_bytes
                or not valid()
            ):
                continue
            origin = applied.buffers
            applied.buffers = [np.array(b, copy=True) for b in origin]
            applied.origin = origin
            applied.valid = None

    def _forget_results(self, buffers: Sequence[npt.NDArray[Any]]) -> None:
        """``buffers`` are about to be reused (or rounds are old): stop relaying the results
        that earlier rounds left in them (or in a copy of them: :meth:`keep_results`)."""
        now = anyio.current_time()
        for group_id, applied in list(self._recent.items()):
            if applied.until < now or any(
                np.may_share_memory(a, b)
                for a in (*applied.buffers, *applied.origin)
                for b in buffers
            ):
                applied.until = -math.inf
                del self._recent[group_id]

    async def _relay(
        self,
        round_: _Round,
        result: AllReduceResult,
        buffers: Sequence[npt.NDArray[Any]],
        alpha: float,
        budget: float,
    ) -> None:
        """For each reducer whose span we were left with unanswered parts of, fetch them from
        the groupmate that applied most of that span (see the module docstring)."""
        async with anyio.create_task_group() as tg:
            for reducer, first, reason in list(result.local_spans):
                tg.start_soon(
                    self._relay_span, round_, result, buffers, alpha, budget, reducer, first, reason
                )

    async def _relay_span(
        self,
        round_: _Round,
        result: AllReduceResult,
        buffers: Sequence[npt.NDArray[Any]],
        alpha: float,
        budget: float,
        reducer: int,
        first: int,
        reason: str,
    ) -> None:
        applied = round_.applied
        assert applied is not None
        group = round_.group
        parts = applied.plans[reducer]
        if first >= len(parts) or applied.got.get(reducer, 0) != first:
            return
        counts: dict[int, int] = {}

        async def ask(member: int, address: Any, scope: anyio.CancelScope) -> None:
            request = AvgRelay(group.group_id, reducer, first, False)
            try:
                async with self.node.rpc.server_stream(
                    address, RELAY_METHOD, request, response_type=Message
                ) as answers:
                    have = await anext(answers, None)
            except (SwarmError, OSError, TimeoutError, ValueError) as exc:
                logger.debug("relay: member %d did not answer: %s", member, exc)
                return
            if isinstance(have, AvgHave) and first < have.count <= len(parts):
                counts[member] = have.count
                if have.count == len(parts):
                    scope.cancel()  # (it has all of it)

        with anyio.move_on_after(budget / 2) as scope:
            async with anyio.create_task_group() as tg:
                for member, info in enumerate(group.members):
                    if (
                        member != round_.me
                        and info.address is not None
                        and info.mode is not MemberMode.AUX
                        and member not in round_.machine.gone
                    ):
                        tg.start_soon(ask, member, info.address, scope)
        got = first
        source = -1
        for member in sorted(counts, key=lambda m: -counts[m]):
            if counts[member] <= got:
                break
            address = group.members[member].address
            assert address is not None
            try:
                got = await self._fetch_relayed(
                    round_, result, buffers, alpha, reducer, got, member, address
                )
                source = member
            except (SwarmError, OSError, TimeoutError, ValueError) as exc:
                logger.debug("relay: member %d failed: %s", member, exc)
                if isinstance(exc, NonFiniteData):
                    result.nonfinite.append(member)
                got = applied.got.get(reducer, 0)
            if got >= counts[member]:
                break
        if got > first:
            result.local_spans.remove((reducer, first, reason))
            if got < len(parts):
                result.local_spans.append((reducer, got, reason))
            result.relayed.append((reducer, first, got, source))
            logger.debug(
                "all-reduce %s: member %d relayed parts %d..%d of member %d's span",
                group.group_id.hex()[:8],
                source,
                first,
                got - 1,
                reducer,
            )

    async def _fetch_relayed(
        self,
        round_: _Round,
        result: AllReduceResult,
        buffers: Sequence[npt.NDArray[Any]],
        alpha: float,
        reducer: int,
        first: int,
        member: int,
        address: Any,
    ) -> int:
        """Apply the parts of ``reducer``'s span from ``first`` on that ``member`` applied;
        the first part not applied here."""
        applied = round_.applied
        assert applied is not None
        parts = applied.plans[reducer]
        dtypes = [dtype for dtype, _ in round_.layout.buffers]
        reader = RelayReader(member, reducer, first, parts, dtypes, len(round_.group.members))
        request = AvgRelay(round_.group.group_id, reducer, first, True)
        async with self.node.rpc.server_stream(
            address, RELAY_METHOD, request, response_type=Message
        ) as answers:
            reader.have(await anext(answers, None))
            async for answer in answers:
                match reader.receive(answer):
                    case Dropped() as notice:
                        entry = (reducer, notice.sender, notice.first, notice.reason)
                        if all(d[:2] != entry[:2] for d in result.dropped):
                            result.dropped.append(entry)
                    case Apply() as relayed:
                        part = parts[relayed.index]
                        local = buffers[part.buffer][part.start : part.stop]
                        result.bytes_received += relayed.nbytes
                        _apply(local, relayed.mean, alpha)
                        applied.applied(reducer, keep=relayed.mean is None)
        return reader.next

    def expect(self, group: Group) -> None:
        """Hold the other members' calls for ``group``'s round (up to ``_EXPECT_WAIT``) until
        :meth:`run` starts it here: this member waits for its trigger first."""
        if group.group_id not in self._rounds and group.group_id not in self._finished:
            self._expected.add(group.group_id)

    async def leave(self, group: Group, reason: str) -> None:
        """Leave ``group``'s round (before or while it runs here): stop it here at once, and
        tell every other member that can be dialed (``avg.leave``) in the background, within
        ``_LEAVE_TIMEOUT`` seconds (a leaving step must not wait for it: its caller's deadline
        holds). Never raises."""
        round_ = self._rounds.get(group.group_id)
        if round_ is not None:
            round_.abort(f"this member left: {reason}")
        else:
            self._finish(group.group_id)
        self._tell_left(group, reason)

    def _tell_left(self, group: Group, reason: str) -> None:
        """Tell the other members of ``group`` (in the background, once per round) that this
        member is out of its round."""
        if group.group_id in self._told:
            return
        self._told[group.group_id] = None
        while len(self._told) > _FINISHED_MEMORY:
            self._told.popitem(last=False)
        me = group.index_of(self.node.peer_id)
        notice = AvgLeave(group.group_id, me, reason[:200])

        async def tell(member: GroupMember) -> None:
            assert member.address is not None
            try:
                await self.node.rpc.call(
                    member.address, LEAVE_METHOD, notice, timeout=_LEAVE_TIMEOUT
                )
            except (SwarmError, OSError, RuntimeError, anyio.ClosedResourceError) as exc:
                # (RuntimeError, ClosedResourceError: our node is closing meanwhile)
                logger.debug("could not tell %s we left: %s", member.peer_id.short(), exc)

        async def tell_all() -> None:
            with anyio.move_on_after(_LEAVE_TIMEOUT):
                async with anyio.create_task_group() as tg:
                    for index, member in enumerate(group.members):
                        if index != me and member.address is not None:
                            tg.start_soon(tell, member)

        with contextlib.suppress(RuntimeError):  # (the node is closing: so are its connections)
            self.node.spawn(tell_all, name="avg.leave")

    async def _serve_relay(self, ask: AvgRelay, ctx: CallContext) -> AsyncIterator[Message]:
        """A groupmate asks what we applied of a reducer's span (and for those parts)."""
        if not 0 < len(ask.group_id) <= 64 or ask.reducer < 0 or ask.first < 0:
            raise Malformed("a malformed relay request")
        round_ = self._rounds.get(ask.group_id)
        applied = round_.applied if round_ is not None else self._recent.get(ask.group_id)
        if applied is None or not applied.holds_results(round_ is not None):
            yield AvgHave(0)
            return
        members = applied.group.members
        check_relay_request(ask, applied.group, ctx.peer_id)
        settled = applied.settled[ask.reducer]
        with anyio.move_on_after(_RELAY_TIMEOUT):
            await settled.wait()  # (what a round in progress will have applied)
        count = applied.got.get(ask.reducer, 0) if applied.relayable and settled.is_set() else 0
        yield AvgHave(count)
        if not ask.fetch or ask.first >= count:
            return
        me = applied.group.index_of(self.node.peer_id)
        if ask.reducer == me and round_ is not None:
            notices: list[tuple[int, int, int, str]] = [
                (me, s, part, why) for s, (part, why) in round_.machine.excluded.items()
            ]
        else:
            notices = [d for d in applied.dropped if d[0] == ask.reducer]
        for _, sender, first, why in notices[: len(members)]:
            yield AvgDropped(sender, first, why[:200])
        parts = applied.plans[ask.reducer]
        for index in range(ask.first, count):
            if index in applied.kept[ask.reducer]:
                yield AvgKeep(index)
                continue
            part = parts[index]
            values = applied.buffers[part.buffer][part.start : part.stop].copy()
            # (the buffers were reused, or given back and changed, meanwhile)
            in_progress = round_ is not None and self._rounds.get(ask.group_id) is round_
            if not applied.holds_results(in_progress):
                raise AllReduceFailed("those results are gone")
            yield AvgPart(index, values)

    async def _serve_leave(self, notice: AvgLeave, ctx: CallContext) -> Message:
        """A member tells us it left a round: the round goes on without it here (now, or when
        it starts)."""
        round_ = self._rounds.get(notice.group_id)
        check_leave(notice, None if round_ is None else round_.group, ctx.peer_id)
        reason = notice.reason[:200]
        if round_ is not None:
            round_.leave(notice.sender, Fault.LEFT, f"it left the group: {reason}")
        elif notice.group_id not in self._finished:
            self._left[notice.group_id] = (ctx.peer_id, notice.sender, reason)
            while len(self._left) > _LEFT_MEMORY:
                self._left.popitem(last=False)
        return AvgKeep(-1)

    async def _run_tasks(
        self,
        group: Group,
        round_: _Round,
        plans: list[list[Part]],
        codecs: list[list[CompressionBase]],
        out: _Outbound,
    ) -> None:
        me = round_.me
        sending = group.members[me].mode is not MemberMode.AUX
        try:
            async with anyio.create_task_group() as tg:
                round_.tasks = tg
                if sending:
                    for reducer, parts in enumerate(plans):
                        if reducer != me and parts:
                            tg.start_soon(
                                self._send_to, round_, reducer, parts, codecs[reducer], out
                            )
                tg.start_soon(self._reduce_own, round_, out.buffers, out.weight, out.alpha, sending)
        except* (SwarmError, OSError, ValueError) as failures:
            reasons = "; ".join(f"{type(e).__name__}: {e}" for e in _leaves(failures))
            raise AllReduceFailed(f"the all-reduce failed: {reasons}") from None
        finally:
            round_.tasks = None

    async def _reduce_own(
        self,
        round_: _Round,
        buffers: Sequence[npt.NDArray[Any]],
        weight: float,
        alpha: float,
        sending: bool,
    ) -> None:
        """Contribute to our own span (unless auxiliary), wait until every part of it is
        reduced, and apply the results."""
        if sending:
            for index, part in enumerate(round_.parts):
                values = buffers[part.buffer][part.start : part.stop] if weight > 0 else None
                round_.feed(OwnPart(index, values))
        for index, part in enumerate(round_.parts):
            await round_.ready[index].wait()
            if sending:
                local = buffers[part.buffer][part.start : part.stop]
                _apply(local, round_.results[index], alpha)
                assert round_.applied is not None
                round_.applied.applied(round_.me, keep=round_.results[index] is None)
        assert round_.applied is not None
        round_.applied.settled[round_.me].set()

    async def _send_to(
        self,
        round_: _Round,
        reducer: int,
        parts: list[Part],
        codecs: list[CompressionBase],
        out: _Outbound,
    ) -> None:
        """Send our values of ``reducer``'s parts and apply the means it answers with; if it
        fails or stalls, the rest of its span keeps our local values (and the result says so)."""
        try:
            await self._send_and_apply(round_, reducer, parts, codecs, out)
        finally:
            assert round_.applied is not None
            round_.applied.settled[reducer].set()

    async def _send_and_apply(
        self,
        round_: _Round,
        reducer: int,
        parts: list[Part],
        codecs: list[CompressionBase],
        out: _Outbound,
    ) -> None:
        group = round_.group
        machine = round_.machine
        failures: list[BaseException] = []
        if machine.link_reason(reducer) is None:
            with anyio.CancelScope() as scope:  # (cancelled when we give up on it)
                round_.exchanges[reducer] = scope
                try:
                    await self._exchange(round_, reducer, parts, codecs, out)
                except* (SwarmError, OSError, ValueError) as caught:
                    failures.extend(_leaves(caught))
        if failures and machine.link_reason(reducer) is None:
            exc = failures[0]
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if (
                isinstance(exc, ConnectError)
                and machine.answered(reducer) == 0
                and self.node.connection_to(group.members[reducer].peer_id) is None
            ):
                # Not there, and not connected to us: it will not send its values either (a
                # peer that died after its group formed, before anyone of it called us). Waiting
                # out sender_timeout for it failed whole steps when that outlasted them.
                round_.leave(reducer, Fault.LOST, f"it cannot be reached: {reason}")
            else:
                round_.feed(ReducerFailed(reducer, Fault.BROKE_OFF, reason))
        why = machine.link_reason(reducer)
        if why is not None:
            logger.debug(
                "all-reduce %s: member %d (%s) failed; its span from part %d on keeps local"
                " values: %s",
                group.group_id.hex()[:8],
                reducer,
                group.members[reducer].peer_id.short(),
                machine.answered(reducer),
                why,
            )

    async def _exchange(
        self,
        round_: _Round,
        reducer: int,
        parts: list[Part],
        codecs: list[CompressionBase],
        out: _Outbound,
    ) -> None:
        result = out.result
        group = round_.group
        member = group.members[reducer]
        assert member.address is not None  # client-mode members have no span
        me = group.index_of(self.node.peer_id)
        machine = round_.machine
        async with self.node.rpc.open(
            member.address, METHOD, kind="bidi", response_type=Message
        ) as call:
            self._pace(round_, member.peer_id)  # (its connection may be new)
            round_.feed(CallOpened(reducer))

            async def send() -> None:
                await call.send(AvgBegin(group.group_id, me, float(out.weight)))
                if out.weight > 0:
                    for part, codec in zip(parts, codecs, strict=True):
                        values = out.buffers[part.buffer][part.start : part.stop]
                        tensor = None
                        if not isinstance(codec, NoCompression):
                            key = ("send", part.buffer, part.start, part.stop)
                            tensor = await _in_thread_if_big(
                                values.nbytes,
                                functools.partial(_compress, codec, values, round_.feedback, key),
                            )
                        if tensor is None:
                            await call.send(AvgPart(part.index, values))
                            result.bytes_sent += values.nbytes
                            result.sent_log.append((anyio.current_time(), values.nbytes))
                        else:
                            await call.send(AvgCompressedPart.of(part.index, tensor))
                            result.bytes_sent += tensor.nbytes
                            result.sent_log.append((anyio.current_time(), tensor.nbytes))
                await call.done_sending()

            async with anyio.create_task_group() as tg:
                tg.start_soon(send)
                while machine.answered(reducer) < len(parts):
                    try:
                        answer = await call.receive()
                    except StopAsyncIteration:
                        round_.feed(ReducerEnded(reducer))  # (raises EndedEarly)
                        raise
                    came = anyio.current_time()
                    for decode in round_.feed(AnswerCame(reducer, answer)):
                        local = out.buffers[parts[decode.index].buffer]
                        mean = await _decode(decode.message, local.dtype)  # (None: garbage)
                        result.bytes_received += decode.message.nbytes
                        result.received_log.append((came, decode.message.nbytes))
                        round_.feed(AnswerDecoded(reducer, decode.index, mean))

    # -- serving a round -------------------------------------------------------------------------

    async def _round_for(self, group_id: bytes) -> _Round:
        round_ = self._rounds.get(group_id)
        if round_ is not None:
            return round_
        if group_id in self._finished:
            raise TooLate("that round is over here")
        event = self._waiting.get(group_id)
        if event is None:
            if len(self._waiting) >= _MAX_PENDING_ROUNDS and group_id not in self._expected:
                raise UnknownRound("too many rounds not started here")
            event = self._waiting[group_id] = anyio.Event()
        with anyio.move_on_after(self.join_wait):
            await event.wait()
        if not event.is_set() and group_id in self._expected:  # its member waits for a trigger
            with anyio.move_on_after(_EXPECT_WAIT - self.join_wait):
                await event.wait()
        round_ = self._rounds.get(group_id)
        if round_ is None:
            if self._waiting.get(group_id) is event:
                del self._waiting[group_id]
            raise UnknownRound("no such round here")
        return round_

    async def _serve(
        self, requests: AsyncIterator[Message], ctx: CallContext
    ) -> AsyncIterator[Message]:
        """One sender's call: take its parts of our span, answer each part's mean."""
        begin = await anext(requests, None)
        if not isinstance(begin, AvgBegin):
            raise OutOfOrder("an all-reduce call starts with AvgBegin")
        round_ = await self._round_for(begin.group_id)
        machine = round_.machine
        sender = begin.sender
        round_.feed(Began(sender, ctx.peer_id, begin.weight))  # (raises what it refuses)
        self._pace(round_, ctx.peer_id)  # (a connection the sender opened mid-round)
        count = len(round_.parts)
        answered = 0
        told: set[int] = set()  # dropped senders this caller was told about
        try:
            while machine.sender_stage(sender) in (SenderStage.SENDING, SenderStage.DELIVERED):
                if sender in round_.ended or round_.closed:
                    break
                with anyio.CancelScope() as wait:
                    round_.waits[sender] = wait
                    message = await anext(requests, None)
                round_.waits.pop(sender, None)
                if wait.cancelled_caught:
                    break
                if message is None:
                    round_.feed(SenderEnded(sender))  # (raises EndedEarly before the last part)
                    break
                came = anyio.current_time()
                nbytes = message.nbytes if isinstance(message, AvgCompressedPart) else 0
                if isinstance(message, AvgPart):
                    nbytes = message.values.nbytes
                for decode in round_.feed(PartCame(sender, message)):
                    part = round_.parts[decode.index]
                    dtype = _numpy_dtype(round_.layout.buffers[part.buffer][0])
                    values = await _decode(decode.message, dtype)
                    round_.feed(PartDecoded(sender, decode.index, values))
                round_.bytes_received += nbytes
                round_.received_log.append((came, nbytes))
                while answered < count and round_.ready[answered].is_set():
                    _check_open(round_, answered)
                    for reply in _replies(round_, answered, told, sender):
                        yield reply
                        _log_sent(round_, reply)
                    answered += 1
        except BaseException:  # (the caller went away: the handler is cancelled, ...)
            with contextlib.suppress(Exception):
                round_.feed(SenderBroke(sender))
            raise
        excluded = machine.excluded.get(sender)
        if excluded is not None:  # (ends the call: it gets no answers)
            raise AllReduceFailed(f"member {sender} was left out of the round: {excluded[1]}")
        while answered < count:
            await round_.ready[answered].wait()
            _check_open(round_, answered)
            for reply in _replies(round_, answered, told, sender):
                yield reply
                _log_sent(round_, reply)
            answered += 1


async def _run_timers(round_: _Round) -> None:
    """Send the round's machine :class:`Tick` whenever its deadline comes (looking again
    after every event, which may move it)."""
    while round_.timing:
        round_.changed = anyio.Event()
        deadline = round_.machine.deadline()
        if deadline is None:
            await round_.changed.wait()
            continue
        with anyio.move_on_after(max(deadline - anyio.current_time(), 0.0)):
            await round_.changed.wait()
        if round_.timing and anyio.current_time() >= deadline:
            round_.feed(Tick())


def _log_sent(round_: _Round, reply: Message) -> None:
    """Note an answer's bytes once sent (the RPC layer resumes us after sending it)."""
    if isinstance(reply, AvgPart):
        round_.sent_log.append((anyio.current_time(), reply.values.nbytes))
    elif isinstance(reply, AvgCompressedPart):
        round_.sent_log.append((anyio.current_time(), reply.nbytes))


def _check_open(round_: _Round, index: int) -> None:
    """Part ``index`` was reduced, unless the round ended here before (then the call ends:
    the caller keeps its values there, or fetches them from a groupmate that has them)."""
    if not round_.final[index]:
        raise AllReduceFailed(f"the round ended here before part {index} was reduced")


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    """The exceptions in ``group`` and the groups nested in it."""
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found


def _replies(round_: _Round, index: int, told: set[int], caller: int) -> list[Message]:
    """What to send ``caller`` once part ``index`` is reduced: news of senders left out, every
    sender's weight (before the first part), then the part's answer."""
    replies: list[Message] = list(_drops(round_, index, told, caller))
    if index == 0:
        replies.append(_weights(round_))
    replies.append(_answer(round_, index))
    return replies


def _drops(round_: _Round, index: int, told: set[int], caller: int) -> list[AvgDropped]:
    """Notices of the senders left out of part ``index`` (or earlier) that ``caller`` was not
    told about yet."""
    notices = []
    for sender, (first, reason) in round_.machine.excluded.items():
        if first <= index and sender not in told and sender != caller:
            told.add(sender)
            notices.append(AvgDropped(sender, first, reason[:200]))
    return notices


def _weights(round_: _Round) -> AvgWeights:
    """Every sender's weight (all have begun once a part is reduced)."""
    members = round_.group.members
    weights = round_.machine.weights
    return AvgWeights([weights.get(i, 0.0) for i in range(len(members))])


def _answer(round_: _Round, index: int) -> Message:
    compressed = round_.answers[index]
    if compressed is not None:
        return compressed
    mean = round_.results[index]
    return AvgKeep(index) if mean is None else AvgPart(index, mean)


def _apply(local: npt.NDArray[Any], mean: npt.NDArray[Any] | None, alpha: float) -> None:
    """Move ``local`` towards ``mean`` by ``alpha`` (1: replace), in place."""
    if mean is None:
        return
    if alpha == 1.0:
        local[...] = mean
    else:
        local += (mean.astype(local.dtype, copy=False) - local) * alpha
