"""A round in progress on one node, on the driver's side: what carries out the actions of the
round's machine (:class:`~swarmavg.proto.butterfly.ButterflyRound`): each part's answer (and
its compression), the means written into our buffers, calls ended, the timer task; and the
helpers the calls share. Private to :mod:`swarmavg.aio.allreduce`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc
import anyio.to_thread
import numpy as np
import numpy.typing as npt

from swarmavg.compression import (
    CompressedTensor,
    CompressionBase,
    ErrorFeedback,
    NoCompression,
    decompress,
)
from swarmavg.errors import AllReduceFailed
from swarmavg.proto.allreduce import FlatLayout, Part, numpy_dtype
from swarmavg.proto.averaging_messages import (
    AvgCompressedPart,
    AvgDropped,
    AvgKeep,
    AvgPart,
    AvgWeights,
)
from swarmavg.proto.butterfly import (
    Action,
    Apply,
    ButterflyRound,
    Decode,
    Dropped,
    EndCall,
    Event,
    Excluded,
    Fault,
    GaveUp,
    MemberLeft,
    Reason,
    Reduced,
    Tick,
)

if TYPE_CHECKING:
    from swarmavg.abc import AllReduceResult, Connection, Group
    from swarmavg.aio._relay import Applied
    from swarmavg.identity import PeerID
    from swarmavg.proto.codec import Message

logger = logging.getLogger("swarmavg.aio.allreduce")

#: Parts bigger than this (bytes) are compressed and decompressed in a worker thread.
_THREAD_THRESHOLD: Final = 1 << 20


_NO_COMPRESSION: Final = NoCompression()


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
    applied: Applied | None = None
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
        dtype = numpy_dtype(self.layout.buffers[part.buffer][0])
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
