"""One member's butterfly round, sans-IO: what it accepts from its groupmates, when it gives up
on one, and what it does with what came.

Theory of operation
-------------------
In a round (see :mod:`swarmavg.proto.allreduce` for the arithmetic), every member plays two
roles at once:

* **reducer** of its own span: each *sender* (every member but auxiliary ones) opens one call
  to it, begins it (its weight), streams its values of the span's parts in order and ends the
  stream; each part's weighted mean is ready once every sender delivered that part or was left
  out of it;
* **sender** to every other reducer: it reads back, on its call, notices of senders that
  reducer left out, every member's weight, then the mean of each part in order (or *keep*:
  nobody weighed in), which it writes into its own tensors.

:class:`ButterflyRound` holds one member's state of one round. Its only input is
:meth:`ButterflyRound.receive` (an *event*: a call began, a part or an answer came, a stream
ended or broke, a member left, a timer fired); its outputs are *actions* the driver
(:mod:`swarmavg.aio.allreduce`) pulls with :meth:`ButterflyRound.actions` and carries out
(decode a compressed part, answer and apply a reduced mean, write an answered mean, end a
sender's call, stop waiting for a reducer), and :meth:`ButterflyRound.deadline`, when the driver
must send :class:`Tick`. Once the round is over here, :meth:`ButterflyRound.finish` gives its
:class:`RoundReport`. Nothing here reads a clock or does I/O: every event comes with ``now``
(the driver's clock, ``anyio.current_time()``), so the tests run it on numbers.

Everything a groupmate sends enters through :meth:`ButterflyRound.receive`; a message that
breaks the protocol raises a :class:`RoundProtocolError` subclass naming the rule, *after* the
round left that member out of what it had not delivered (the caller ends its stream).

Each sender of our span moves through these stages (``receive`` is the only place that moves
it; :data:`SENDER_TRANSITIONS` is the table it follows)::

    stage      event                                   next        actions
    ---------  --------------------------------------  ----------  ------------------------------
    EXPECTED   Began (weight 0)                         DELIVERED   Reduced (parts now complete)
    EXPECTED   Began (weight > 0)                       SENDING
    EXPECTED   Tick past start + sender_timeout         EXCLUDED    Excluded (NOT_BEGUN), Reduced
    SENDING    PartCame (plain, the next part)          SENDING     Reduced (when complete)
                                                        /DELIVERED
    SENDING    PartCame (compressed, the next part)     DECODING    Decode
    DECODING   PartDecoded                              SENDING     Reduced (when complete)
                                                        /DELIVERED
    SENDING    Tick past its last part + sender_timeout EXCLUDED    Excluded (SILENT), EndCall
    SENDING    SenderEnded / SenderBroke                EXCLUDED    Excluded (ENDED_EARLY /
                                                                    BROKE_OFF)
    DELIVERED  SenderEnded                              ENDED
    DELIVERED  Tick past its last part + sender_timeout ENDED       EndCall (it never ended)
    DELIVERED  SenderBroke                              ENDED       (it delivered everything)
    any        MemberLeft                               EXCLUDED    Excluded (LEFT or LOST)
    any        bad data (RoundProtocolError raised)     EXCLUDED    Excluded (BAD_DATA, NON_FINITE)

Each reducer this member sends to (a *link*) moves through::

    stage      event                                   next        actions
    ---------  --------------------------------------  ----------  ------------------------------
    CALLING    CallOpened                              WEIGHING
    WEIGHING   AnswerCame AvgDropped (a few)            WEIGHING    Dropped
    WEIGHING   AnswerCame AvgWeights                    ANSWERING   (weights kept)
    ANSWERING  AnswerCame AvgPart / AvgKeep (the next)  ANSWERING   Apply
                                                        /ANSWERED
    ANSWERING  AnswerCame AvgCompressedPart (the next)  DECODING    Decode
    DECODING   AnswerDecoded                            ANSWERING   Apply
                                                        /ANSWERED
    WEIGHING,  Tick past its last answer +              GAVE_UP     GaveUp (SILENT)
    ANSWERING  reducer_timeout
    any open   ReducerEnded / ReducerFailed             GAVE_UP     GaveUp (ENDED_EARLY, BROKE_OFF)
    any open   MemberLeft                               GAVE_UP     GaveUp (LEFT, LOST)
    any open   bad data (RoundProtocolError raised)     GAVE_UP     GaveUp (BAD_DATA, NON_FINITE)

Timers (all relative to the event that armed them, so a fault fires at an exact time):
``sender_timeout`` after the round's start for a sender that has not begun, after its last
part for one that has; ``reducer_timeout`` after the call was opened or its last answer.
``timeout`` bounds the whole round (the driver's: it fails the round rather than a member).

Faults are typed (:class:`Fault`); the reasons kept in the round's result are :class:`Reason`
strings that carry their fault, so that a program (``swarmavg status``) can count them by kind.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import numpy as np
import numpy.typing as npt

from swarmavg.errors import RemoteProtocolError
from swarmavg.proto.allreduce import (
    MAX_SHARE,
    MAX_WEIGHT,
    AccumulatorPool,
    FlatLayout,
    NonFiniteValues,
    OverflowingValues,
    Part,
    PartReducer,
    _all_finite,
    _check_max_share,
    numpy_dtype,
)
from swarmavg.proto.averaging_messages import (
    AvgCompressedPart,
    AvgDropped,
    AvgHave,
    AvgKeep,
    AvgLeave,
    AvgPart,
    AvgRelay,
    AvgWeights,
)
from swarmavg.proto.text import printable

if TYPE_CHECKING:
    from swarmavg.abc._averaging import Group
    from swarmavg.identity import PeerID
    from swarmavg.proto.codec import Message

__all__ = [
    "LINK_TRANSITIONS",
    "SENDER_TRANSITIONS",
    "Action",
    "AnswerCame",
    "AnswerDecoded",
    "Apply",
    "BadWeights",
    "Began",
    "ButterflyRound",
    "CallOpened",
    "Decode",
    "Dropped",
    "EndCall",
    "EndedEarly",
    "Event",
    "Excluded",
    "FalseKeep",
    "Fault",
    "GaveUp",
    "LinkStage",
    "Malformed",
    "MemberLeft",
    "NonFiniteData",
    "NotAMember",
    "OutOfOrder",
    "OwnPart",
    "PartCame",
    "PartDecoded",
    "PartMismatch",
    "Reason",
    "Reduced",
    "ReducerEnded",
    "ReducerFailed",
    "RelayReader",
    "RoundConfig",
    "RoundProtocolError",
    "RoundReport",
    "SenderBroke",
    "SenderEnded",
    "SenderStage",
    "Tick",
    "TooLate",
    "TooManyNotices",
    "Undecodable",
    "UnknownRound",
    "check_leave",
    "check_relay_request",
]

#: Reason strings kept in a round's result are cut to this many characters.
_REASON_CHARS: Final = 200


# -- the configuration ----------------------------------------------------------------------------


def _seconds(name: str, value: object, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds or None, not {value!r:.40}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number of seconds > 0, not {value!r}")


@dataclass(frozen=True, slots=True)
class RoundConfig:
    """How a member runs its rounds: one object from the averager's keywords to the socket.

    :param part_size: elements per part (a reducer answers a part once every sender sent it).
    :param timeout: the whole round fails past this many seconds (``None``: no bound).
    :param sender_timeout: a sender that has not begun this long after the round started here,
        or sent nothing this long after its last part, is left out of the parts it had not
        delivered (``None``: waited for as long as the round lasts).
    :param reducer_timeout: a reducer that answered nothing this long after our call opened or
        after its last answer keeps the rest of its span at our local values.
    :param averaging_alpha: how far a member moves towards the mean (1: all the way).
    :param min_vector_size: a member whose share of the vector would be smaller reduces none.
    :param max_share: a member reduces at most this many even shares of the vector, whatever
        bandwidth it announces (see :func:`~swarmavg.proto.allreduce.load_balance`; ``None``:
        no cap). Every member of a swarm must use the same (their splits must agree).
    :param clip_norm: each contribution to a part of our span is scaled down to an L2 norm of
        ``clip_norm · sqrt(part size / vector size)`` if longer (``None``: no clipping).
    :param check_values: check our own values for NaN and infinities before the round (a member
        whose values are not finite takes the group's mean without contributing to it). A
        caller that checked them just before passes ``False`` (the averager does: one pass
        over the vector less); the parts of our own span are then checked as they are added,
        and every groupmate checks what it receives anyway.
    """

    part_size: int = 1 << 16
    timeout: float | None = None
    sender_timeout: float | None = None
    reducer_timeout: float | None = None
    averaging_alpha: float = 1.0
    min_vector_size: int = 0
    max_share: float | None = MAX_SHARE
    clip_norm: float | None = None
    check_values: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.part_size, bool) or not isinstance(self.part_size, int):
            raise TypeError(f"part_size must be an int, not {self.part_size!r:.40}")
        if self.part_size < 1:
            raise ValueError(f"part_size must be >= 1, not {self.part_size}")
        _seconds("timeout", self.timeout)
        _seconds("sender_timeout", self.sender_timeout)
        _seconds("reducer_timeout", self.reducer_timeout)
        alpha = self.averaging_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float):
            raise TypeError(f"averaging_alpha must be a number, not {alpha!r:.40}")
        if not 0 < alpha <= 1:
            raise ValueError(f"averaging_alpha must be in (0, 1], not {alpha!r}")
        if isinstance(self.min_vector_size, bool) or not isinstance(self.min_vector_size, int):
            raise TypeError(f"min_vector_size must be an int, not {self.min_vector_size!r:.40}")
        if self.min_vector_size < 0:
            raise ValueError(f"min_vector_size must be >= 0, not {self.min_vector_size}")
        _check_max_share(self.max_share)
        norm = self.clip_norm
        if norm is not None:
            if isinstance(norm, bool) or not isinstance(norm, int | float):
                raise TypeError(f"clip_norm must be a number or None, not {norm!r:.40}")
            if not (norm >= 0 and math.isfinite(norm)):
                raise ValueError(f"clip_norm must be a finite number >= 0, not {norm!r}")
        if not isinstance(self.check_values, bool):
            raise TypeError(f"check_values must be a bool, not {self.check_values!r:.40}")


# -- faults, reasons, errors ----------------------------------------------------------------------


class Fault(enum.Enum):
    """Why a member was left out of (part of) a round."""

    #: a sender did not begin within ``sender_timeout`` of the round's start
    NOT_BEGUN = "not_begun"
    #: a sender (``sender_timeout``) or reducer (``reducer_timeout``) went quiet
    SILENT = "silent"
    #: it sent something the protocol does not allow (a :class:`RoundProtocolError`)
    BAD_DATA = "bad_data"
    #: its values or means held NaN or an infinity
    NON_FINITE = "non_finite"
    #: its stream ended before everything it owed came
    ENDED_EARLY = "ended_early"
    #: its call or our call to it failed (a transport error)
    BROKE_OFF = "broke_off"
    #: it told us it left the round
    LEFT = "left"
    #: our last connection to it was lost, or it cannot be reached
    LOST = "lost"
    #: our own values were not finite (we left ourselves out)
    OURS = "ours"


class Reason(str):
    """Why a member was left out: the text for people (what ``str`` gives), :attr:`fault` for
    programs."""

    fault: Fault

    def __new__(cls, fault: Fault, detail: str) -> Reason:
        reason = super().__new__(cls, detail[:_REASON_CHARS])
        reason.fault = fault
        return reason

    def __reduce__(self) -> tuple[Any, ...]:  # (copy and deepcopy keep the fault)
        return (Reason, (self.fault, str(self)))


class RoundProtocolError(RemoteProtocolError):
    """A groupmate broke the round's protocol; it is left out of what it had not delivered."""

    fault: Fault = Fault.BAD_DATA


class NotAMember(RoundProtocolError):
    """A call claims a place in the group that is not the caller's, or that sends nothing."""


class TooLate(RoundProtocolError):
    """A call came for a sender that already began, or that was already left out."""


class OutOfOrder(RoundProtocolError):
    """A message came that is not the one the protocol expects next."""


class PartMismatch(RoundProtocolError):
    """A part (or a mean) is not the part's size or dtype."""


class UnknownRound(RoundProtocolError):
    """A call for a round that did not start here in time (or one too many waiting)."""


class Malformed(RoundProtocolError):
    """A request's fields are out of range (no group id, a negative index)."""


class Undecodable(RoundProtocolError):
    """A compressed part (or mean) does not decode."""


class BadWeights(RoundProtocolError):
    """A weight (a sender's, or one a reducer told) is not a number from 0 to
    :data:`~swarmavg.proto.allreduce.MAX_WEIGHT`."""


class TooManyNotices(RoundProtocolError):
    """A reducer told of more left-out senders than the group has."""


class FalseKeep(RoundProtocolError):
    """A reducer answered "keep your values" (``AvgKeep``) for a part that had weight: ours,
    or that of a member it did not say it left out."""


class EndedEarly(RoundProtocolError):
    """A stream ended before everything it owed came."""

    fault = Fault.ENDED_EARLY


class NonFiniteData(RoundProtocolError):
    """Values or a mean held NaN or an infinity."""

    fault = Fault.NON_FINITE


# -- events ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Began:
    """A call to our span began (its first message, ``AvgBegin``), from ``peer``."""

    sender: int
    peer: PeerID
    weight: float


@dataclass(frozen=True, slots=True)
class PartCame:
    """A message on a sender's call after its begin (a part, if it keeps the protocol)."""

    sender: int
    message: Message


@dataclass(frozen=True, slots=True)
class PartDecoded:
    """What :class:`Decode` of a sender's compressed part gave (``None``: it did not decode)."""

    sender: int
    index: int
    values: npt.NDArray[Any] | None


@dataclass(frozen=True, slots=True)
class OwnPart:
    """Our own values of part ``index`` of our span (``None``: we send nothing, weight 0)."""

    index: int
    values: npt.NDArray[Any] | None


@dataclass(frozen=True, slots=True)
class SenderEnded:
    """A sender ended its stream."""

    sender: int


@dataclass(frozen=True, slots=True)
class SenderBroke:
    """A sender's call broke off (its connection, or the caller went away)."""

    sender: int


@dataclass(frozen=True, slots=True)
class CallOpened:
    """Our call to ``reducer`` is open (its answer timer starts)."""

    reducer: int


@dataclass(frozen=True, slots=True)
class AnswerCame:
    """A message on our call to ``reducer``."""

    reducer: int
    message: Message


@dataclass(frozen=True, slots=True)
class AnswerDecoded:
    """What :class:`Decode` of a reducer's compressed answer gave (``None``: it did not
    decode)."""

    reducer: int
    index: int
    values: npt.NDArray[Any] | None


@dataclass(frozen=True, slots=True)
class ReducerEnded:
    """``reducer``'s answer stream ended."""

    reducer: int


@dataclass(frozen=True, slots=True)
class ReducerFailed:
    """Our call to ``reducer`` failed (``fault``: BROKE_OFF, or LOST if it cannot be reached)."""

    reducer: int
    fault: Fault
    detail: str


@dataclass(frozen=True, slots=True)
class MemberLeft:
    """``member`` is out of the round (it told us, or our connection to it was lost)."""

    member: int
    fault: Fault
    detail: str


@dataclass(frozen=True, slots=True)
class Tick:
    """The time :meth:`ButterflyRound.deadline` named came."""


Event: TypeAlias = (
    Began
    | PartCame
    | PartDecoded
    | OwnPart
    | SenderEnded
    | SenderBroke
    | CallOpened
    | AnswerCame
    | AnswerDecoded
    | ReducerEnded
    | ReducerFailed
    | MemberLeft
    | Tick
)


# -- actions --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Decode:
    """Decode ``message`` (its shape and dtype were checked) and send back
    :class:`PartDecoded` (``answer`` false) or :class:`AnswerDecoded`."""

    member: int
    index: int
    message: AvgCompressedPart
    answer: bool


@dataclass(frozen=True, slots=True)
class Reduced:
    """Part ``index`` of our span is reduced: ``mean`` (accumulation dtype), or ``None`` (no
    weight: every member keeps its values). Answer it, and apply it to our values."""

    index: int
    mean: npt.NDArray[Any] | None


@dataclass(frozen=True, slots=True)
class Apply:
    """Write ``reducer``'s mean of its part ``index`` into our values (``None``: keep them)."""

    reducer: int
    index: int
    mean: npt.NDArray[Any] | None
    nbytes: int


@dataclass(frozen=True, slots=True)
class Excluded:
    """``sender`` is left out of our parts ``first`` and later."""

    sender: int
    first: int
    reason: Reason


@dataclass(frozen=True, slots=True)
class EndCall:
    """End ``sender``'s call now (it is over for the round: left out, or it never ended it)."""

    sender: int
    reason: Reason


@dataclass(frozen=True, slots=True)
class GaveUp:
    """``reducer``'s span from part ``first`` on keeps our local values; end our call to it."""

    reducer: int
    first: int
    reason: Reason


@dataclass(frozen=True, slots=True)
class Dropped:
    """``reducer`` told us it left ``sender`` out of its parts ``first`` and later."""

    reducer: int
    sender: int
    first: int
    reason: str


Action: TypeAlias = Decode | Reduced | Apply | Excluded | EndCall | GaveUp | Dropped


# -- the stages and their tables ------------------------------------------------------------------


class SenderStage(enum.Enum):
    """Where a sender of our span is."""

    EXPECTED = "expected"
    SENDING = "sending"
    DECODING = "decoding"
    DELIVERED = "delivered"
    ENDED = "ended"
    EXCLUDED = "excluded"


class LinkStage(enum.Enum):
    """Where our call to a reducer is."""

    CALLING = "calling"
    WEIGHING = "weighing"
    ANSWERING = "answering"
    DECODING = "decoding"
    ANSWERED = "answered"
    GAVE_UP = "gave_up"


_S = SenderStage
_L = LinkStage

#: ``(stage, event) -> the stages it may lead to`` for a sender of our span (what the machine
#: checks each move against; an event not listed for a stage is a protocol breach when it comes
#: from the sender, and ignored when it is ours, e.g. a late timer).
SENDER_TRANSITIONS: Final[dict[tuple[SenderStage, str], frozenset[SenderStage]]] = {
    (_S.EXPECTED, "begin"): frozenset({_S.SENDING, _S.DELIVERED}),
    (_S.EXPECTED, "timer"): frozenset({_S.EXCLUDED}),
    (_S.SENDING, "part"): frozenset({_S.SENDING, _S.DELIVERED}),
    (_S.SENDING, "compressed"): frozenset({_S.DECODING}),
    (_S.DECODING, "decoded"): frozenset({_S.SENDING, _S.DELIVERED}),
    (_S.SENDING, "timer"): frozenset({_S.EXCLUDED}),
    (_S.SENDING, "end"): frozenset({_S.EXCLUDED}),
    (_S.SENDING, "broke"): frozenset({_S.EXCLUDED}),
    (_S.DECODING, "end"): frozenset({_S.EXCLUDED}),
    (_S.DECODING, "broke"): frozenset({_S.EXCLUDED}),
    (_S.DELIVERED, "end"): frozenset({_S.ENDED}),
    (_S.DELIVERED, "timer"): frozenset({_S.ENDED}),
    (_S.DELIVERED, "broke"): frozenset({_S.ENDED}),
    **{(stage, "left"): frozenset({_S.EXCLUDED, stage}) for stage in SenderStage},
    **{(stage, "bad"): frozenset({_S.EXCLUDED, stage}) for stage in SenderStage},
}

#: The same for our call to each reducer.
LINK_TRANSITIONS: Final[dict[tuple[LinkStage, str], frozenset[LinkStage]]] = {
    (_L.CALLING, "open"): frozenset({_L.WEIGHING}),
    (_L.WEIGHING, "dropped"): frozenset({_L.WEIGHING}),
    (_L.ANSWERING, "dropped"): frozenset({_L.ANSWERING}),
    (_L.WEIGHING, "weights"): frozenset({_L.ANSWERING, _L.ANSWERED}),
    (_L.ANSWERING, "answer"): frozenset({_L.ANSWERING, _L.ANSWERED}),
    (_L.ANSWERING, "compressed"): frozenset({_L.DECODING}),
    (_L.DECODING, "decoded"): frozenset({_L.ANSWERING, _L.ANSWERED}),
    (_L.WEIGHING, "timer"): frozenset({_L.GAVE_UP}),
    (_L.ANSWERING, "timer"): frozenset({_L.GAVE_UP}),
    (_L.DECODING, "timer"): frozenset({_L.GAVE_UP}),
    **{(stage, "end"): frozenset({_L.GAVE_UP, stage}) for stage in LinkStage},
    **{(stage, "failed"): frozenset({_L.GAVE_UP, stage}) for stage in LinkStage},
    **{(stage, "left"): frozenset({_L.GAVE_UP, stage}) for stage in LinkStage},
    **{(stage, "bad"): frozenset({_L.GAVE_UP, stage}) for stage in LinkStage},
}

_OPEN_LINKS: Final = frozenset({_L.CALLING, _L.WEIGHING, _L.ANSWERING, _L.DECODING})
_DONE_SENDERS: Final = frozenset({_S.DELIVERED, _S.ENDED, _S.EXCLUDED})


@dataclass
class _Sender:
    stage: SenderStage = SenderStage.EXPECTED
    weight: float = 0.0
    #: parts that came (the next one's index)
    received: int = 0
    #: when its last message came (or the round began)
    last: float = 0.0


@dataclass
class _Link:
    stage: LinkStage = LinkStage.CALLING
    #: parts answered (the next one's index)
    answered: int = 0
    notices: int = 0
    last: float = 0.0
    reason: Reason | None = None
    #: every member's weight as this reducer told it
    weights: tuple[float, ...] = ()
    #: the senders it said it left out: sender -> the first part without it
    dropped: dict[int, int] = field(default_factory=dict)


@dataclass
class _Report:
    """What the round did here, for the result."""

    #: ``(reducer, first part, reason)`` of the spans that kept our local values
    local_spans: list[tuple[int, int, str]] = field(default_factory=list)
    clipped: set[int] = field(default_factory=set)
    nonfinite: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class RoundReport:
    """What a round did here, once it is over (:meth:`ButterflyRound.finish`)."""

    #: the members whose values went into the mean with a positive weight (every member
    #: agrees: each reducer tells every sender all weights)
    contributors: tuple[int, ...]
    total_weight: float
    #: the senders left out of our span: ``(sender, first part, why)``
    excluded: tuple[tuple[int, int, Reason], ...]
    #: the senders whose contributions to our span were clipped (``clip_norm``)
    clipped: tuple[int, ...]
    #: the members whose values or means would have poisoned ours: NaN or an infinity, values
    #: too large to average, a weight past ``MAX_WEIGHT``
    nonfinite: tuple[int, ...]
    #: why nothing was averaged here (every other span kept our values from its first part,
    #: and we reduce none), or ``None``
    failed: str | None


class ButterflyRound:
    """One member's state of one round (see the module docstring).

    :param group: the group (every member holds the same).
    :param me: our index in it.
    :param plans: every member's parts (:func:`~swarmavg.proto.allreduce.plan_parts`).
    :param layout: the flat buffers' layout.
    :param config: timeouts and clipping.
    :param sending: whether we send values (not an auxiliary member).
    :param now: when the round began here.
    :param pool: where our span's accumulators come from (``None``: fresh arrays).
    """

    def __init__(
        self,
        group: Group,
        me: int,
        plans: Sequence[Sequence[Part]],
        layout: FlatLayout,
        config: RoundConfig,
        *,
        sending: bool,
        now: float,
        pool: AccumulatorPool | None = None,
    ) -> None:
        self.group = group
        self.me = me
        self.plans = plans
        self.parts = list(plans[me])
        self.layout = layout
        self.config = config
        self.sending = sending
        self.started = now
        self.report = _Report()
        self._actions: list[Action] = []
        senders = group.senders
        self._senders: dict[int, _Sender] = {
            s: _Sender(last=now) for s in senders if s != me and self.parts
        }
        self._links: dict[int, _Link] = {
            r: _Link(last=now) for r, parts in enumerate(plans) if r != me and parts and sending
        }
        #: the weights of our span's senders (ours included) as they began
        self.weights: dict[int, float] = {}
        #: every member's weight as the reducers we send to told us
        self.told: dict[int, float] = {}
        #: senders left out of our parts: sender -> (first part, why)
        self.excluded: dict[int, tuple[int, Reason]] = {}
        #: members that left: index -> why
        self.gone: dict[int, Reason] = {}
        self.reducers = self._make_reducers(senders, pool)
        self.reduced = [False] * len(self.parts)
        total = max(layout.numel, 1)
        norm = config.clip_norm
        self._max_norms = [
            None if norm is None else norm * math.sqrt(p.size / total) for p in self.parts
        ]

    def _make_reducers(
        self, senders: Sequence[int], pool: AccumulatorPool | None
    ) -> list[PartReducer]:
        # one accumulator per buffer for the whole span (its parts are contiguous in it)
        blocks: dict[int, tuple[int, npt.NDArray[np.floating]]] = {}
        for part in self.parts:
            if part.buffer not in blocks:
                stop = max(p.stop for p in self.parts if p.buffer == part.buffer)
                dtype = self.layout.buffers[part.buffer][0]
                accumulate = np.float64 if dtype == "float64" else np.float32
                size = stop - part.start
                acc: npt.NDArray[np.floating] = (
                    np.empty(size, accumulate) if pool is None else pool.take(size, accumulate)
                )
                blocks[part.buffer] = (part.start, acc)
        reducers = []
        for part in self.parts:
            dtype = self.layout.buffers[part.buffer][0]
            start, block = blocks[part.buffer]
            out = block[part.start - start : part.stop - start]
            reducers.append(PartReducer(part.size, dtype, senders, out=out))
        return reducers

    # -- the driver's side ------------------------------------------------------------------------

    def actions(self) -> list[Action]:
        """The actions since the last call, in order (the driver carries them out)."""
        actions, self._actions = self._actions, []
        return actions

    def deadline(self) -> float | None:
        """When the next timer fires (send :class:`Tick` then), or ``None``."""
        config = self.config
        times: list[float] = []
        if config.sender_timeout is not None:
            for sender in self._senders.values():
                if sender.stage is _S.EXPECTED:
                    times.append(self.started + config.sender_timeout)
                elif sender.stage in (_S.SENDING, _S.DECODING, _S.DELIVERED):
                    times.append(sender.last + config.sender_timeout)
        if config.reducer_timeout is not None:
            for link in self._links.values():
                if link.stage in (_L.WEIGHING, _L.ANSWERING, _L.DECODING):
                    times.append(link.last + config.reducer_timeout)
        return min(times, default=None)

    def sender_stage(self, sender: int) -> SenderStage:
        return self._senders[sender].stage

    def link_stage(self, reducer: int) -> LinkStage:
        return self._links[reducer].stage

    def answered(self, reducer: int) -> int:
        """The parts of ``reducer``'s span answered here so far."""
        link = self._links.get(reducer)
        return 0 if link is None else link.answered

    def link_reason(self, reducer: int) -> Reason | None:
        link = self._links.get(reducer)
        return None if link is None else link.reason

    @property
    def own_reduced(self) -> bool:
        return all(self.reduced)

    def receive(self, event: Event, now: float) -> None:
        """Take ``event`` (see the module docstring); pull what to do with :meth:`actions`.

        :raises RoundProtocolError: the groupmate it came from broke the protocol (it was left
            out of what it had not delivered, or its span keeps our values, first).
        """
        match event:
            case Began():
                self._begin(event, now)
            case PartCame():
                self._part_came(event.sender, event.message, now)
            case PartDecoded():
                self._part_decoded(event.sender, event.index, event.values, now)
            case OwnPart():
                self._own_part(event.index, event.values)
            case SenderEnded():
                self._sender_ended(event.sender)
            case SenderBroke():
                self._sender_broke(event.sender)
            case CallOpened():
                self._open(event.reducer, now)
            case AnswerCame():
                self._answer_came(event.reducer, event.message, now)
            case AnswerDecoded():
                self._answer_decoded(event.reducer, event.index, event.values, now)
            case ReducerEnded():
                self._reducer_ended(event.reducer)
            case ReducerFailed():
                self._give_up(event.reducer, Reason(event.fault, event.detail), "failed")
            case MemberLeft():
                self._member_left(event.member, Reason(event.fault, event.detail))
            case Tick():
                self._timers(now)

    def finish(self) -> RoundReport:
        """The round's report, once the driver is done with it (after any relay, which may
        have filled parts of :attr:`report`'s ``local_spans``)."""
        me = self.me
        others = [i for i, parts in enumerate(self.plans) if parts and i != me]
        spans = self.report.local_spans
        lost = {reducer for reducer, first, _ in spans if first == 0}
        failed = None
        if self.sending and not self.parts and others and set(others) <= lost:
            failed = "nothing was averaged: " + "; ".join(
                f"member {r}: {why}" for r, _, why in spans
            )
        if self.parts:
            weights = dict(self.weights)
        else:
            weights = dict(self.told)
            if self.sending:
                weights.setdefault(me, self.weights.get(me, 0.0))
        senders = self.group.senders
        return RoundReport(
            contributors=tuple(i for i in senders if weights.get(i, 0.0) > 0),
            total_weight=sum(weights.get(i, 0.0) for i in senders),
            excluded=tuple((s, first, why) for s, (first, why) in self.excluded.items()),
            clipped=tuple(sorted(self.report.clipped)),
            nonfinite=tuple(sorted(self.report.nonfinite)),
            failed=failed,
        )

    # -- moves ------------------------------------------------------------------------------------

    def _move_sender(self, sender: int, move: str, to: SenderStage) -> None:
        state = self._senders[sender]
        allowed = SENDER_TRANSITIONS.get((state.stage, move))
        if allowed is None or to not in allowed:  # (a bug here, not the peer's doing)
            raise RuntimeError(f"no move {move} from {state.stage} to {to}")
        state.stage = to

    def _move_link(self, reducer: int, move: str, to: LinkStage) -> None:
        link = self._links[reducer]
        allowed = LINK_TRANSITIONS.get((link.stage, move))
        if allowed is None or to not in allowed:  # (a bug here, not the peer's doing)
            raise RuntimeError(f"no move {move} from {link.stage} to {to}")
        link.stage = to

    # -- our span: its senders --------------------------------------------------------------------

    def _begin(self, event: Began, now: float) -> None:
        members = self.group.members
        sender = event.sender
        if not (0 <= sender < len(members)) or sender == self.me:
            raise NotAMember(f"no sender {sender} in this group")
        if members[sender].peer_id != event.peer:
            # a member that claims another's place broke the protocol: it is left out at
            # once, not waited for until sender_timeout (Trust I's F14); the member it named
            # is unharmed
            caller = next((i for i, m in enumerate(members) if m.peer_id == event.peer), None)
            if caller is not None and caller in self._senders and caller not in self.excluded:
                self._exclude(
                    caller, 0, Reason(Fault.BAD_DATA, f"it claimed to be member {sender}")
                )
            raise NotAMember("the caller is not the member it claims to be")
        if sender not in self._senders:
            raise NotAMember(f"member {sender} sends nothing to this member")
        state = self._senders[sender]
        if sender in self.excluded:
            raise TooLate(f"member {sender} was left out of this round: too late")
        if state.stage is not _S.EXPECTED:
            raise TooLate(f"member {sender} already called")
        weight = event.weight
        if not (isinstance(weight, float | int) and 0 <= weight <= MAX_WEIGHT):
            why = f"bad weight {weight!r:.40} (a number from 0 to {MAX_WEIGHT:g})"
            self.report.nonfinite.add(sender)  # (it would poison the mean as NaN does)
            self._exclude(sender, 0, Reason(Fault.BAD_DATA, why))
            raise BadWeights(why)
        state.weight = float(weight)
        state.last = now
        self.weights[sender] = float(weight)
        if weight == 0:
            self._move_sender(sender, "begin", _S.DELIVERED)
            for index, reducer in enumerate(self.reducers):
                reducer.add_nothing(sender)
                self._settle(index)
        else:
            self._move_sender(sender, "begin", _S.SENDING)

    def _expect_part(self, sender: int, message: Message) -> tuple[_Sender, Part]:
        state = self._senders.get(sender)
        if state is None or state.stage not in (_S.SENDING, _S.DECODING):
            raise OutOfOrder(f"member {sender} sent a part it does not owe")
        if state.stage is _S.DECODING:
            raise OutOfOrder(f"member {sender} sent a part before the last one was decoded")
        count = len(self.parts)
        if not isinstance(message, AvgPart | AvgCompressedPart):
            raise OutOfOrder(
                f"expected part {state.received} of {count}, not a {type(message).__name__}"
            )
        if message.index != state.received:
            raise OutOfOrder(f"expected part {state.received} of {count}, not {message.index}")
        return state, self.parts[state.received]

    def _part_came(self, sender: int, message: Message, now: float) -> None:
        try:
            state, part = self._expect_part(sender, message)
            dtype = numpy_dtype(self.layout.buffers[part.buffer][0])
            if isinstance(message, AvgCompressedPart):
                _check_declared(message, part.size, dtype)
                state.last = now
                self._move_sender(sender, "compressed", _S.DECODING)
                self._actions.append(Decode(sender, part.index, message, answer=False))
                return
            assert isinstance(message, AvgPart)
            values = message.values
            if values.dtype != dtype or values.shape != (part.size,):
                raise PartMismatch(
                    f"part {part.index} has shape {values.shape[:2]} and dtype {values.dtype},"
                    f" not ({part.size},) {dtype}"
                )
            state.last = now
            self._contribute(sender, state, values)
        except RoundProtocolError as exc:
            self._bad_sender(sender, exc)
            raise

    def _part_decoded(
        self, sender: int, index: int, values: npt.NDArray[Any] | None, now: float
    ) -> None:
        state = self._senders.get(sender)
        if state is None or state.stage is not _S.DECODING or index != state.received:
            return  # (it was left out meanwhile)
        part = self.parts[index]
        try:
            if values is None:
                raise Undecodable(f"part {index} does not decode")
            if values.shape != (part.size,):
                raise PartMismatch(
                    f"part {index} decoded to {values.shape[:2]}, not ({part.size},)"
                )
            self._move_sender(sender, "decoded", _S.SENDING)
            state.last = now
            self._contribute(sender, state, values)
        except RoundProtocolError as exc:
            self._bad_sender(sender, exc)
            raise

    def _contribute(self, sender: int, state: _Sender, values: npt.NDArray[Any]) -> None:
        index = state.received
        try:
            clipped = self.reducers[index].add(sender, values, state.weight, self._max_norms[index])
        except NonFiniteValues as exc:  # (or OverflowingValues: its text says which)
            raise NonFiniteData(str(exc)) from None
        if clipped:
            self.report.clipped.add(sender)
        state.received += 1
        if state.received == len(self.parts):
            self._move_sender(sender, "part", _S.DELIVERED)
        else:
            self._move_sender(sender, "part", _S.SENDING)
        self._settle(index)

    def _own_part(self, index: int, values: npt.NDArray[Any] | None) -> None:
        me = self.me
        if me in self.excluded or me not in self.reducers[index].expected:
            return
        if values is None:
            self.reducers[index].add_nothing(me)
        else:
            try:
                clipped = self.reducers[index].add(
                    me, values, self.weights.get(me, 0.0), self._max_norms[index]
                )
            except OverflowingValues as exc:  # (left out, as anyone)
                self._exclude(me, index, Reason(Fault.OURS, f"our own values: {exc}"))
                return
            except NonFiniteValues:  # (changed since the check: left out, as anyone)
                self._exclude(me, index, Reason(Fault.OURS, "our own values are not finite"))
                return
            if clipped:
                self.report.clipped.add(me)
        self._settle(index)

    def own_weight(self, weight: float) -> None:
        """Our own weight (before our own parts)."""
        self.weights[self.me] = weight

    def _sender_ended(self, sender: int) -> None:
        state = self._senders.get(sender)
        if state is None:
            return
        if state.stage is _S.DELIVERED:
            self._move_sender(sender, "end", _S.ENDED)
        elif state.stage in (_S.SENDING, _S.DECODING):
            count = len(self.parts)
            reason = Reason(Fault.ENDED_EARLY, f"{state.received} parts of {count} came")
            self._exclude(sender, state.received, reason, "end")
            raise EndedEarly(str(reason))

    def _sender_broke(self, sender: int) -> None:
        state = self._senders.get(sender)
        if state is None:
            return
        if state.stage is _S.DELIVERED:
            self._move_sender(sender, "broke", _S.ENDED)
        elif state.stage in (_S.SENDING, _S.DECODING):
            reason = Reason(Fault.BROKE_OFF, "its call broke off")
            self._exclude(sender, state.received, reason, "broke")

    def _bad_sender(self, sender: int, exc: RoundProtocolError) -> None:
        if isinstance(exc, NonFiniteData | BadWeights):
            self.report.nonfinite.add(sender)
        state = self._senders.get(sender)
        first = 0 if state is None else state.received
        if state is not None and state.stage not in (_S.EXCLUDED, _S.ENDED):
            self._exclude(sender, first, Reason(exc.fault, str(exc)))

    def _exclude(self, sender: int, first: int, reason: Reason, move: str = "bad") -> None:
        """Leave ``sender`` out of our parts ``first`` and later: they are reduced without it."""
        if sender in self.excluded:
            return
        state = self._senders.get(sender)
        if state is not None:
            if state.stage in (_S.DELIVERED, _S.ENDED, _S.EXCLUDED):
                return  # it delivered everything: nobody to leave out
            self._move_sender(sender, move, _S.EXCLUDED)
        elif sender != self.me:
            return
        if all(sender in reducer.received for reducer in self.reducers[first:]):
            return
        self.excluded[sender] = (first, reason)
        self._actions.append(Excluded(sender, first, reason))
        for index in range(first, len(self.parts)):
            if sender not in self.reducers[index].received:
                self.reducers[index].add_nothing(sender)
                self._settle(index)

    def _settle(self, index: int) -> None:
        reducer = self.reducers[index]
        if reducer.done and not self.reduced[index]:
            self.reduced[index] = True
            self._actions.append(Reduced(index, reducer.result()))

    # -- the reducers we send to ------------------------------------------------------------------

    def _open(self, reducer: int, now: float) -> None:
        link = self._links.get(reducer)
        if link is not None and link.stage is _L.CALLING:
            link.last = now
            self._move_link(reducer, "open", _L.WEIGHING)

    def _answer_came(self, reducer: int, message: Message, now: float) -> None:
        link = self._links.get(reducer)
        if link is None or link.stage not in (_L.WEIGHING, _L.ANSWERING):
            if link is not None and link.stage is _L.DECODING:
                self._bad_link(reducer, OutOfOrder(f"member {reducer} answered before decoding"))
            return  # (we gave up on it meanwhile)
        try:
            link.last = now
            if isinstance(message, AvgDropped):
                self._notice(reducer, link, message)
            elif link.stage is _L.WEIGHING:
                self._weights(reducer, link, message)
            else:
                self._answer(reducer, link, message)
        except RoundProtocolError as exc:
            self._bad_link(reducer, exc)
            raise

    def _notice(self, reducer: int, link: _Link, notice: AvgDropped) -> None:
        members = len(self.group.members)
        link.notices += 1
        if link.notices > members:
            raise TooManyNotices(f"member {reducer} told of more left-out senders than members")
        self._move_link(reducer, "dropped", link.stage)
        if 0 <= notice.sender < members:
            first = link.dropped.get(notice.sender, notice.part)
            link.dropped[notice.sender] = min(first, max(notice.part, 0))
            reason = printable(notice.reason, _REASON_CHARS)  # (a peer's words: into our logs)
            self._actions.append(Dropped(reducer, notice.sender, notice.part, reason))

    def _weights(self, reducer: int, link: _Link, message: Message) -> None:
        members = len(self.group.members)
        if not isinstance(message, AvgWeights):
            raise OutOfOrder(f"member {reducer} did not say the weights first")
        told = message.weights
        if len(told) != members or not all(
            isinstance(w, float | int) and 0 <= w <= MAX_WEIGHT for w in told
        ):
            raise BadWeights(
                f"member {reducer} said weights that are not one number from 0 to"
                f" {MAX_WEIGHT:g} per member"
            )
        link.weights = tuple(float(w) for w in told)
        for index, weight in enumerate(told):
            if weight > 0 or index not in self.told:
                self.told[index] = float(weight)
        parts = self.plans[reducer]
        self._move_link(reducer, "weights", _L.ANSWERING if parts else _L.ANSWERED)

    def _answer(self, reducer: int, link: _Link, message: Message) -> None:
        parts = self.plans[reducer]
        if (
            not isinstance(message, AvgPart | AvgKeep | AvgCompressedPart)
            or message.index != link.answered
        ):
            raise OutOfOrder(f"member {reducer} answered out of order")
        part = parts[link.answered]
        dtype = numpy_dtype(self.layout.buffers[part.buffer][0])
        if isinstance(message, AvgCompressedPart):
            _check_declared(message, part.size, dtype)
            self._move_link(reducer, "compressed", _L.DECODING)
            self._actions.append(Decode(reducer, part.index, message, answer=True))
            return
        if isinstance(message, AvgKeep):
            self._check_keep(reducer, link, link.answered)
            self._applied(reducer, link, None, 0, "answer")
            return
        values = message.values
        if values.shape != (part.size,) or values.dtype != dtype:
            raise PartMismatch(f"member {reducer} answered a wrong shape or dtype")
        if not _all_finite(values):
            raise NonFiniteData(f"member {reducer} answered non-finite values")
        self._applied(reducer, link, values, values.nbytes, "answer")

    def _check_keep(self, reducer: int, link: _Link, index: int) -> None:
        """An honest reducer keeps (no mean) only a part whose senders all had weight 0, or
        were left out: we were not (it would have ended our call instead), so our own weight
        and the weights it told of the others it kept in must all be 0."""
        weight = max(
            [self.weights.get(self.me, 0.0)]
            + [
                w
                for sender, w in enumerate(link.weights)
                if sender != self.me and link.dropped.get(sender, index + 1) > index
            ]
        )
        if weight > 0:
            raise FalseKeep(
                f"member {reducer} answered 'keep' for part {index}, which had weight {weight:g}"
            )

    def _answer_decoded(
        self, reducer: int, index: int, values: npt.NDArray[Any] | None, now: float
    ) -> None:
        link = self._links.get(reducer)
        if link is None or link.stage is not _L.DECODING or index != link.answered:
            return
        part = self.plans[reducer][index]
        try:
            link.last = now
            if values is None:
                raise Undecodable(
                    f"member {reducer} answered garbage: part {index} does not decode"
                )
            if values.shape != (part.size,):
                raise PartMismatch(f"member {reducer} answered a wrong shape")
            if not _all_finite(values):
                raise NonFiniteData(f"member {reducer} answered non-finite values")
        except RoundProtocolError as exc:
            self._bad_link(reducer, exc)
            raise
        self._applied(reducer, link, values, 0, "decoded")

    def _applied(
        self,
        reducer: int,
        link: _Link,
        values: npt.NDArray[Any] | None,
        nbytes: int,
        move: str,
    ) -> None:
        index = link.answered
        link.answered += 1
        done = link.answered == len(self.plans[reducer])
        self._move_link(reducer, move, _L.ANSWERED if done else _L.ANSWERING)
        self._actions.append(Apply(reducer, index, values, nbytes))

    def _reducer_ended(self, reducer: int) -> None:
        link = self._links.get(reducer)
        if link is None or link.stage not in _OPEN_LINKS:
            return
        count = len(self.plans[reducer])
        reason = Reason(
            Fault.ENDED_EARLY,
            f"member {reducer} ended its answers after {link.answered} of {count}",
        )
        self._give_up(reducer, reason, "end")
        raise EndedEarly(str(reason))

    def _bad_link(self, reducer: int, exc: RoundProtocolError) -> None:
        if isinstance(exc, NonFiniteData | BadWeights):
            self.report.nonfinite.add(reducer)
        self._give_up(reducer, Reason(exc.fault, str(exc)), "bad")

    def _give_up(self, reducer: int, reason: Reason, move: str) -> None:
        link = self._links.get(reducer)
        if link is None or link.stage not in _OPEN_LINKS:
            return
        self._move_link(reducer, move, _L.GAVE_UP)
        link.reason = reason
        self.report.local_spans.append((reducer, link.answered, reason))
        self._actions.append(GaveUp(reducer, link.answered, reason))

    # -- both -------------------------------------------------------------------------------------

    def _member_left(self, member: int, reason: Reason) -> None:
        if member == self.me or not 0 <= member < len(self.group.members):
            return
        self.gone.setdefault(member, reason)
        state = self._senders.get(member)
        if state is not None and state.stage not in _DONE_SENDERS:
            self._exclude(member, state.received, reason, "left")
        link = self._links.get(member)
        if link is not None and link.answered < len(self.plans[member]):
            self._give_up(member, reason, "left")

    def _timers(self, now: float) -> None:
        config = self.config
        if config.sender_timeout is not None:
            timeout = config.sender_timeout
            for sender, state in list(self._senders.items()):
                if state.stage is _S.EXPECTED and now >= self.started + timeout:
                    reason = Reason(Fault.NOT_BEGUN, f"it did not begin within {timeout} s")
                    self._exclude(sender, 0, reason, "timer")
                elif state.stage in (_S.SENDING, _S.DECODING) and now >= state.last + timeout:
                    reason = Reason(Fault.SILENT, f"it sent nothing for {timeout} s")
                    self._exclude(sender, state.received, reason, "timer")
                    self._actions.append(EndCall(sender, reason))
                elif state.stage is _S.DELIVERED and now >= state.last + timeout:
                    self._move_sender(sender, "timer", _S.ENDED)
                    reason = Reason(Fault.SILENT, f"it did not end its call within {timeout} s")
                    self._actions.append(EndCall(sender, reason))
        if config.reducer_timeout is not None:
            timeout = config.reducer_timeout
            for reducer, link in list(self._links.items()):
                if link.stage in (_L.WEIGHING, _L.ANSWERING, _L.DECODING) and (
                    now >= link.last + timeout
                ):
                    reason = Reason(Fault.SILENT, f"it answered nothing for {timeout} s")
                    self._give_up(reducer, reason, "timer")


def _check_declared(message: AvgCompressedPart, size: int, dtype: np.dtype[Any]) -> None:
    """A compressed part's declared shape and dtype are the part's (checked before anything
    is decoded)."""
    if list(message.shape) != [size]:
        raise PartMismatch(
            f"part {message.index} is declared as shape {list(message.shape)[:4]}, not [{size}]"
        )
    if message.dtype != dtype.name:
        raise PartMismatch(f"part {message.index} is declared {message.dtype[:16]}, not {dtype}")


# -- relays and leave notices ---------------------------------------------------------------------


def check_relay_request(ask: AvgRelay, group: Group | None, peer: PeerID) -> None:
    """A relay request (``avg.relay``) for ``group``'s round, from ``peer`` (``None``: the
    round is not known yet; only its form is checked).

    :raises Malformed: no group id, or a negative index.
    :raises NotAMember: ``peer`` is not a member, or there is no such reducer.
    """
    if not 0 < len(ask.group_id) <= 64 or ask.reducer < 0 or ask.first < 0:
        raise Malformed("a malformed relay request")
    if group is None:
        return
    if not any(m.peer_id == peer for m in group.members):
        raise NotAMember("the caller is not a member of that round")
    if ask.reducer >= len(group.members):
        raise NotAMember(f"no member {ask.reducer} in that round")


def check_leave(notice: AvgLeave, group: Group | None, peer: PeerID) -> None:
    """A leave notice (``avg.leave``) from ``peer``, for ``group``'s round (``None``: not
    started here; only its form is checked then).

    :raises Malformed: no group id, or a negative index.
    :raises NotAMember: ``peer`` is not the member it names.
    """
    if not 0 < len(notice.group_id) <= 64 or notice.sender < 0:
        raise Malformed("a malformed leave notice")
    if group is not None:
        members = group.members
        if notice.sender >= len(members) or members[notice.sender].peer_id != peer:
            raise NotAMember("the caller is not the member it claims to be")


class RelayReader:
    """What a groupmate (``source``) relays us of ``reducer``'s span (``avg.relay`` with
    ``fetch``): first how many parts it applied (``AvgHave``: :meth:`have`), then
    (:meth:`receive`) at most one left-out notice per member and the parts from ``first`` on,
    in order, each checked as an answered mean is.

    :param plan: ``reducer``'s parts; ``dtypes``: each flat buffer's dtype name.
    :param me: our index in the group, and ``own_weight`` the weight we sent ``reducer``: a
        relayed "keep" (``AvgKeep``) is believed only for a part that had none of ours (see
        :class:`FalseKeep`), or one the reducer left us out of (as the relayed notices say).
    """

    def __init__(
        self,
        source: int,
        reducer: int,
        first: int,
        plan: Sequence[Part],
        dtypes: Sequence[str],
        members: int,
        *,
        me: int = -1,
        own_weight: float = 0.0,
    ) -> None:
        self.source = source
        self.reducer = reducer
        self.plan = plan
        self.dtypes = dtypes
        self.members = members
        self.me = me
        self.own_weight = own_weight
        #: the first part the reducer left us out of, as the relay said (none: past the end)
        self._without_me = len(plan)
        #: the next part expected, and where the relayed parts stop
        self.next = first
        self.stop = first
        self._notices = 0

    def have(self, message: Message | None) -> int:
        """The relay's first message: where its parts stop.

        :raises OutOfOrder: it is not an ``AvgHave``.
        """
        if not isinstance(message, AvgHave):
            raise OutOfOrder(f"member {self.source} did not say what it has")
        self.stop = min(max(message.count, 0), len(self.plan))
        return self.stop

    def receive(self, message: Message) -> Apply | Dropped:
        """What to do with the relay's next message.

        :raises RoundProtocolError: it broke the protocol (nothing more is taken from it).
        """
        source = self.source
        if isinstance(message, AvgDropped):
            self._notices += 1
            if self._notices > self.members or not 0 <= message.sender < self.members:
                raise TooManyNotices(f"member {source} relayed bad notices")
            if message.sender == self.me:
                self._without_me = min(self._without_me, max(message.part, 0))
            reason = printable(message.reason, _REASON_CHARS)
            return Dropped(self.reducer, message.sender, message.part, reason)
        index = self.next
        if (
            index >= self.stop
            or not isinstance(message, AvgPart | AvgKeep)
            or message.index != index
        ):
            raise OutOfOrder(f"member {source} relayed out of order")
        self.next += 1
        if isinstance(message, AvgKeep):
            if self.own_weight > 0 and index < self._without_me:
                raise FalseKeep(
                    f"member {source} relayed 'keep' for part {index} of member"
                    f" {self.reducer}'s span, which had our weight {self.own_weight:g}"
                )
            return Apply(self.reducer, index, None, 0)
        part = self.plan[index]
        values = message.values
        if values.shape != (part.size,) or values.dtype != numpy_dtype(self.dtypes[part.buffer]):
            raise PartMismatch(f"member {source} relayed a wrong shape or dtype")
        if not _all_finite(values):
            raise NonFiniteData(f"member {source} relayed non-finite values")
        return Apply(self.reducer, index, values, values.nbytes)
