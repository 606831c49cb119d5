"""Relays (``avg.relay``): a member left with part of a reducer's span unanswered (the reducer
died or stalled while answering) fetches the rest from the groupmate that applied most of it,
so that survivors do not end disagreeing (see :mod:`swarmavg.aio.allreduce`). :class:`Relays`
keeps this node's recent results and serves them, and asks for what a round here missed.
Private to :mod:`swarmavg.aio.allreduce`."""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import anyio
import numpy as np
import numpy.typing as npt

from swarmavg.abc import Group, MemberMode
from swarmavg.aio._round import _apply
from swarmavg.errors import AllReduceFailed, SwarmError
from swarmavg.proto.allreduce import Part
from swarmavg.proto.averaging_messages import AvgDropped, AvgHave, AvgKeep, AvgPart, AvgRelay
from swarmavg.proto.butterfly import (
    Apply,
    Dropped,
    Fault,
    NonFiniteData,
    RelayReader,
    check_relay_request,
)
from swarmavg.proto.codec import Message

if TYPE_CHECKING:
    from swarmavg.aio._round import _Round
    from swarmavg.aio.node import Node
    from swarmavg.aio.rpc import CallContext

__all__ = ["RELAY_METHOD", "Applied", "Relays"]

logger = logging.getLogger("swarmavg.aio.allreduce")

RELAY_METHOD: Final = "avg.relay"
#: How long a member asks its groupmates for the parts a reducer did not answer (seconds;
#: also bounded by the reducer timeout and what is left of the round's timeout).
_RELAY_TIMEOUT: Final = 10.0
#: How long a finished round's results can be relayed (seconds), and how many rounds.
_RELAY_KEEP: Final = 120.0


_RELAY_ROUNDS: Final = 8


@dataclass
class Applied:
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


class Relays:
    """The results of this node's recent rounds, for groupmates that missed some (served as
    ``avg.relay``), and the asking side, for a round here that missed some.

    :param rounds: the rounds running on this node (the service's, by group id).
    """

    def __init__(self, node: Node, rounds: Mapping[bytes, _Round]) -> None:
        self.node = node
        self.rounds = rounds
        #: finished rounds whose results can still be relayed
        self.recent: OrderedDict[bytes, Applied] = OrderedDict()

    def remember(self, group_id: bytes, applied: Applied) -> None:
        """A finished round's results, relayable for ``_RELAY_KEEP`` seconds (the last
        ``_RELAY_ROUNDS`` rounds)."""
        applied.until = anyio.current_time() + _RELAY_KEEP
        self.recent[group_id] = applied
        while len(self.recent) > _RELAY_ROUNDS:
            self.recent.popitem(last=False)

    def keep_results(self, buffers: Sequence[npt.NDArray[Any]], max_bytes: int) -> None:
        """``buffers``, the caller's memory that a finished round ran on in place, are about
        to change: a round of three or more members whose results they still hold keeps a copy
        of them (if at most ``max_bytes``), so that a groupmate that a reducer stopped answering
        can still fetch what it missed (``avg.relay``) until our next round. Callable from any
        thread (the caller's training thread enters ``get_tensors``)."""
        for applied in list(self.recent.values()):
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

    def forget(self, buffers: Sequence[npt.NDArray[Any]]) -> None:
        """``buffers`` are about to be reused (or rounds are old): stop relaying the results
        that earlier rounds left in them (or in a copy of them: :meth:`keep_results`)."""
        now = anyio.current_time()
        for group_id, applied in list(self.recent.items()):
            if applied.until < now or any(
                np.may_share_memory(a, b)
                for a in (*applied.buffers, *applied.origin)
                for b in buffers
            ):
                applied.until = -math.inf
                del self.recent[group_id]

    async def fetch_missing(self, round_: _Round, budget: float) -> None:
        """For each reducer whose span ``round_`` was left with unanswered parts of, fetch them
        from the groupmate that applied most of that span (see the module docstring), within
        ``budget`` seconds."""
        assert round_.out is not None
        async with anyio.create_task_group() as tg:
            for reducer, first, reason in list(round_.out.result.local_spans):
                tg.start_soon(self._relay_span, round_, budget, reducer, first, reason)

    async def _relay_span(
        self, round_: _Round, budget: float, reducer: int, first: int, reason: str
    ) -> None:
        assert round_.out is not None
        result = round_.out.result
        applied = round_.applied
        assert applied is not None
        group = round_.group
        parts = applied.plans[reducer]
        if first >= len(parts) or applied.got.get(reducer, 0) != first:
            return
        counts: dict[int, int] = {}
        # (a reducer that broke the protocol is not asked to relay its own span: it lied once)
        breached = getattr(reason, "fault", None) in (Fault.BAD_DATA, Fault.NON_FINITE)

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
                        and not (member == reducer and breached)
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
                got = await self._fetch_relayed(round_, reducer, got, member, address)
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
        self, round_: _Round, reducer: int, first: int, member: int, address: Any
    ) -> int:
        """Apply the parts of ``reducer``'s span from ``first`` on that ``member`` applied;
        the first part not applied here."""
        out = round_.out
        assert out is not None
        result, buffers, alpha = out.result, out.buffers, out.alpha
        applied = round_.applied
        assert applied is not None
        parts = applied.plans[reducer]
        dtypes = [dtype for dtype, _ in round_.layout.buffers]
        reader = RelayReader(
            member,
            reducer,
            first,
            parts,
            dtypes,
            len(round_.group.members),
            me=round_.me,
            own_weight=round_.machine.weights.get(round_.me, 0.0),
        )
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

    async def serve(self, ask: AvgRelay, ctx: CallContext) -> AsyncIterator[Message]:
        """A groupmate asks what we applied of a reducer's span (and for those parts)."""
        check_relay_request(ask, None, ctx.peer_id)
        round_ = self.rounds.get(ask.group_id)
        applied = round_.applied if round_ is not None else self.recent.get(ask.group_id)
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
            in_progress = round_ is not None and self.rounds.get(ask.group_id) is round_
            if not applied.holds_results(in_progress):
                raise AllReduceFailed("those results are gone")
            yield AvgPart(index, values)
