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

Every decision of a round (what is accepted from whom, when a member is given up on, when a
part is reduced) is made by its machine, :class:`~swarmavg.proto.butterfly.ButterflyRound`:
this module turns what happens on the network into its events and carries out its actions
(``aio/_round.py``), with relays in ``aio/_relay.py``.

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

import contextlib
import functools
import logging
import math
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc
import anyio.to_thread
import numpy.typing as npt

from swarmavg.abc._averaging import (
    AllReduceResult,
    AllReduceRunner,
    Group,
    GroupMember,
    MemberMode,
)
from swarmavg.aio._relay import _RELAY_TIMEOUT, RELAY_METHOD, Applied, Relays
from swarmavg.aio._round import (
    _NO_COMPRESSION,
    _apply,
    _check_open,
    _compress,
    _decode,
    _in_thread_if_big,
    _log_sent,
    _Outbound,
    _replies,
    _Round,
    _run_timers,
)
from swarmavg.aio._wire import WireSampler
from swarmavg.compression import (
    AdaptiveCompression,
    CompressionBase,
    ErrorFeedback,
    NoCompression,
    TensorInfo,
)
from swarmavg.errors import AllReduceFailed, ConnectError, SwarmError
from swarmavg.proto.allreduce import (
    MAX_WEIGHT,
    AccumulatorPool,
    FlatLayout,
    Part,
    _all_finite,
    check_tensor_infos,
    numpy_dtype,
    pacing_plan,
    part_codecs,
    plan_parts,
)
from swarmavg.proto.averaging_messages import (
    AvgBegin,
    AvgCompressedPart,
    AvgKeep,
    AvgLeave,
    AvgPart,
    AvgRelay,
)
from swarmavg.proto.butterfly import (
    AnswerCame,
    AnswerDecoded,
    Began,
    ButterflyRound,
    CallOpened,
    Fault,
    OutOfOrder,
    OwnPart,
    PartCame,
    PartDecoded,
    ReducerEnded,
    ReducerFailed,
    RoundConfig,
    SenderBroke,
    SenderEnded,
    SenderStage,
    TooLate,
    UnknownRound,
    check_leave,
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
_DEFAULT_CONFIG: Final = RoundConfig()


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
        self._relays = Relays(node, self._rounds)
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
            RELAY_METHOD, self._relays.serve, kind="server_stream", request_type=AvgRelay
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
        if not 0 <= weight <= MAX_WEIGHT:  # (also NaN and infinities)
            raise ValueError(f"weight must be a number from 0 to {MAX_WEIGHT:g}, not {weight!r}")
        if mode is not MemberMode.AUX:
            for (dtype, size), buffer in zip(layout.buffers, buffers, strict=True):
                if buffer.shape != (size,) or buffer.dtype != numpy_dtype(dtype):
                    raise ValueError(f"a buffer of {size} {dtype} expected, got {buffer.dtype}")
        if not isinstance(compression, CompressionBase | AdaptiveCompression):
            raise TypeError(f"compression must be a codec or a chooser, not {compression!r:.64}")
        check_tensor_infos(layout, tensor_infos)
        spans = group.span_sizes(layout.numel, config.min_vector_size, config.max_share)
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
        own_nonfinite = (
            config.check_values
            and mode is not MemberMode.AUX
            and weight > 0
            and not self._finite(buffers)
        )
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
        self._relays.forget(buffers)
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
        round_.pacing = pacing_plan(group, me, layout, plans, sends_values, upload_rate)
        result = AllReduceResult([], 0.0, own_nonfinite=own_nonfinite, started=started)
        machine.report.local_spans = result.local_spans  # (the relay amends them)
        round_.out = outbound = _Outbound(buffers, weight, averaging_alpha, result, {})
        round_.applied = applied = Applied(
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
        self._rounds[group.group_id] = round_
        waiting = self._waiting.pop(group.group_id, None)
        if waiting is not None:
            waiting.set()
        deadline = math.inf if timeout is None else anyio.current_time() + timeout
        wire = WireSampler(
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
                    await self._relays.fetch_missing(round_, budget)
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
            self._relays.remember(group.group_id, applied)
        report = machine.finish()
        result.bytes_received += round_.bytes_received
        result.bytes_sent += round_.bytes_sent
        result.received_log += round_.received_log
        result.sent_log += round_.sent_log
        result.seconds = anyio.current_time() - started
        result.reduced = spans[me]
        result.clipped = list(report.clipped)
        if report.clipped:
            logger.info(
                "all-reduce %s: clipped the contributions of members %s to our span",
                group.group_id.hex()[:8],
                result.clipped,
            )
        result.dropped += [(me, sender, first, why) for sender, first, why in report.excluded]
        result.nonfinite = sorted(set(result.nonfinite) | set(report.nonfinite))
        if report.failed is not None:
            raise AllReduceFailed(report.failed)
        result.contributors = list(report.contributors)
        result.total_weight = report.total_weight
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

    def keep_results(self, buffers: Sequence[npt.NDArray[Any]], max_bytes: int) -> None:
        """``buffers``, the caller's memory that a finished round ran on in place, are about
        to change: keep a copy of the results groupmates may still fetch (see
        :meth:`Relays.keep_results <swarmavg.aio._relay.Relays.keep_results>`)."""
        self._relays.keep_results(buffers, max_bytes)

    def _finish(self, group_id: bytes) -> None:
        """Remember the round as over here; calls waiting for it fail."""
        self._finished[group_id] = None
        while len(self._finished) > _FINISHED_MEMORY:
            self._finished.popitem(last=False)
        self._expected.discard(group_id)
        waiting = self._waiting.pop(group_id, None)
        if waiting is not None:
            waiting.set()

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
                        # (raises EndedEarly, unless we gave up on it meanwhile)
                        round_.feed(ReducerEnded(reducer))
                        return
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
                nbytes = (
                    message.values.nbytes
                    if isinstance(message, AvgPart)
                    else message.nbytes
                    if isinstance(message, AvgCompressedPart)
                    else 0
                )
                for decode in round_.feed(PartCame(sender, message)):
                    part = round_.parts[decode.index]
                    dtype = numpy_dtype(round_.layout.buffers[part.buffer][0])
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


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    """The exceptions in ``group`` and the groups nested in it."""
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found
