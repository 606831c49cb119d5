"""The moolib-style accumulator's rounds, sans-IO: epochs, leader election, count and gradient
phases, results in order, and the misuse checks (see ``docs/design/accumulator.md``).

Theory of operation
-------------------
A cohort's members agree on a *view* (the members) through the DHT; the *epoch* is a digest of
it. Every message carries the sender's epoch, and an exchange completes only once every member
of the view sent its message for this epoch, so whatever completes ran among members that held
the same view. :class:`AccumulatorCore` is one member's state:

* :meth:`~AccumulatorCore.new_epoch` adopts a view: rounds in flight and results not yet
  applied are dropped, the data of every slot is merged into slot 0 (contributions are kept),
  and a :class:`Hello` (our model version) goes to every other member;
* once it holds every member's hello, the leader is the greatest ``(model_version, name)``
  (on equal versions a member that holds the cohort's model ranks first, so that a fresh
  joiner never takes over);
  a member at another version, or a fresh one that is not the leader, wants a state
  (:class:`RequestState`) and is not connected until :meth:`~AccumulatorCore.state_loaded`;
* contribution ``k`` of the epoch (:meth:`~AccumulatorCore.contribute` or
  :meth:`~AccumulatorCore.skip`) goes to slot ``k mod P`` and sends :class:`Count` ``k`` (the
  slot's totals) to every other member; with every member's count ``k``, each member sums the
  same numbers: below the virtual batch size the slot opens again, otherwise count ``k``
  decides a gradient phase (:class:`StartReduce`; the sums are its stats), or, if there was no
  gradient at all, a zero result at once;
* results are applied (:class:`ApplyResult`) in the order of the counts that decided them,
  each only once the previous one was read (:meth:`~AccumulatorCore.zero_gradients`, which
  increments the model version: a version counts the results the model was stepped with, so a
  state served at version ``v`` is a model after ``v`` steps).

The core holds no tensors: the caller keeps one buffer per slot and does what the actions say
(add ``.grad`` into slot ``s``, all-reduce a scaled copy, write the mean into ``.grad``, merge or
drop slots). Nothing here reads a clock: the methods that start an exchange take ``now`` and
:meth:`~AccumulatorCore.stalled` says whom an exchange waited on for too long.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from swarmavg.errors import RemoteProtocolError
from swarmavg.proto.codec import Message
from swarmavg.proto.codec import message as _message

__all__ = [
    "EPOCH_SIZE",
    "WEIGHTINGS",
    "AccAck",
    "AccLeave",
    "AccumulatorCore",
    "Action",
    "ApplyResult",
    "CoreMessage",
    "Count",
    "DropSlots",
    "GradientStats",
    "Hello",
    "MergeSlots",
    "Refresh",
    "RequestState",
    "Send",
    "SlotTotals",
    "StartReduce",
    "epoch_digest",
    "round_group_id",
]

Weighting = Literal["contributions", "samples"]
WEIGHTINGS: Final[tuple[str, ...]] = ("contributions", "samples")
#: Messages kept per peer for an epoch this member has not adopted yet.
_MAX_EARLY_MESSAGES: Final = 64
#: Peers whose messages of an epoch this member has not adopted are kept (a cohort's size).
_MAX_EARLY_PEERS: Final = 256
#: Kept messages of an epoch this member has not adopted last this many ``round_timeout``.
_EARLY_KEEP: Final = 2
_MAX_INT64: Final = (1 << 63) - 1
#: Bytes of an epoch (a SHA-256).
EPOCH_SIZE: Final = 32


def epoch_digest(members: Sequence[str], incarnations: Sequence[str] | None = None) -> bytes:
    """The epoch of a view: SHA-256 over its sorted, distinct member names, each with its
    incarnation (e.g. when its record says it joined) if given, in the same order as
    ``members``."""
    if incarnations is None:
        incarnations = [""] * len(members)
    if len(incarnations) != len(members):
        raise ValueError("incarnations must have one entry per member")
    pairs = sorted(set(zip(members, incarnations, strict=True)))
    digest = hashlib.sha256(b"swarmavg.acc.epoch")
    for pair in pairs:
        for part in pair:
            raw = part.encode()
            digest.update(len(raw).to_bytes(4, "big") + raw)
    return digest.digest()


def round_group_id(name: str, epoch: bytes, index: int) -> bytes:
    """The all-reduce group id of count ``index``'s gradient phase in ``epoch`` of cohort
    ``name``: every member derives the same one."""
    raw = name.encode()
    digest = hashlib.sha256(b"swarmavg.acc.round")
    digest.update(len(raw).to_bytes(4, "big") + raw + epoch + index.to_bytes(8, "big"))
    return digest.digest()


def _check_epoch(epoch: bytes) -> None:
    # (the core refuses any but EPOCH_SIZE; empty is "none" in an AccAck)
    if len(epoch) > EPOCH_SIZE:
        raise ValueError(f"an epoch is at most {EPOCH_SIZE} bytes, not {len(epoch)}")


@_message("acc.totals")
@dataclass(frozen=True, slots=True)
class SlotTotals(Message):
    """What a slot accumulated: samples of gradient contributions, gradients, skips."""

    batch_size: int = 0
    num_gradients: int = 0
    num_skipped: int = 0

    def __add__(self, other: SlotTotals) -> SlotTotals:
        return SlotTotals(
            self.batch_size + other.batch_size,
            self.num_gradients + other.num_gradients,
            self.num_skipped + other.num_skipped,
        )

    @property
    def empty(self) -> bool:
        return self == SlotTotals()


@dataclass(frozen=True, slots=True)
class GradientStats:
    """The stats of the last applied result (moolib's ``get_gradient_stats()``)."""

    num_gradients: int = 0
    num_skipped: int = 0
    batch_size: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "num_gradients": self.num_gradients,
            "num_skipped": self.num_skipped,
            "batch_size": self.batch_size,
        }


# --- messages between members (the shell encodes them) ---------------------------------------


# (registered with the codec: they travel as ``acc.msg`` requests, answered by an AccAck; the
# core checks the values of what it receives: RemoteProtocolError)


@_message("acc.hello")
@dataclass(frozen=True, slots=True)
class Hello(Message):
    """Sent to every member on adopting ``epoch``: our model version and the *lineage* of our
    model (empty: none yet, a fresh member), for the election."""

    epoch: bytes
    version: int
    lineage: bytes = b""

    def __post_init__(self) -> None:
        _check_epoch(self.epoch)

    @property
    def has_model(self) -> bool:
        return bool(self.lineage)


@_message("acc.count")
@dataclass(frozen=True, slots=True)
class Count(Message):
    """Contribution ``index`` of the epoch: the totals of its slot, and our virtual batch size
    (which must be every member's)."""

    epoch: bytes
    index: int
    totals: SlotTotals
    virtual_batch_size: int

    def __post_init__(self) -> None:
        _check_epoch(self.epoch)


@_message("acc.leave")
@dataclass(frozen=True, slots=True)
class AccLeave(Message):
    """The sender leaves the cohort (it also stores a tombstone): re-read the records now."""

    epoch: bytes

    def __post_init__(self) -> None:
        _check_epoch(self.epoch)


@_message("acc.ack")
@dataclass(frozen=True, slots=True)
class AccAck(Message):
    """The answer to every ``acc.msg``: the receiver's epoch (empty: none yet). One that is
    not the sender's says the views differ: the sender re-reads the records."""

    epoch: bytes

    def __post_init__(self) -> None:
        _check_epoch(self.epoch)


CoreMessage = Hello | Count


# --- actions for the caller -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``message`` to each of ``to``."""

    to: tuple[str, ...]
    message: CoreMessage


@dataclass(frozen=True, slots=True)
class Refresh:
    """A member spoke of another epoch: read the cohort's records now."""

    peer: str


@dataclass(frozen=True, slots=True)
class RequestState:
    """Download the state (version ``version``) from ``donors``, best first."""

    donors: tuple[str, ...]
    version: int


@dataclass(frozen=True, slots=True)
class MergeSlots:
    """Add the buffers of ``slots`` into slot 0's and empty them (an epoch change)."""

    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DropSlots:
    """Empty every slot's buffer: a downloaded state replaces what they were computed on."""


@dataclass(frozen=True, slots=True)
class StartReduce:
    """Run the gradient phase of count ``index``: all-reduce a copy of slot ``slot``'s buffer
    times ``scale`` with ``weight`` over ``members`` (``group_id``), then report
    :meth:`AccumulatorCore.reduce_done`."""

    epoch: bytes
    index: int
    slot: int
    group_id: bytes
    members: tuple[str, ...]
    weight: float
    scale: float
    stats: GradientStats


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """Write count ``index``'s result into ``.grad`` (zeros when ``zero``), then empty slot
    ``slot``; ``model_version`` becomes ``version`` when the user reads it
    (:meth:`AccumulatorCore.zero_gradients`: the model then holds the step it made)."""

    index: int
    slot: int
    stats: GradientStats
    zero: bool
    version: int


Action = Send | Refresh | RequestState | MergeSlots | DropSlots | StartReduce | ApplyResult


# --- the state machine -----------------------------------------------------------------------


@dataclass
class _Slot:
    totals: SlotTotals = field(default_factory=SlotTotals)
    #: "open" (takes a contribution), "counting", "reducing" (a decided gradient phase, until
    #: its result is applied)
    phase: Literal["open", "counting", "reducing"] = "open"


@dataclass
class _Exchange:
    started: float
    got: dict[str, CoreMessage] = field(default_factory=dict)


@dataclass
class _Pending:
    """A decided gradient phase, waiting for its all-reduce and its turn."""

    slot: int
    stats: GradientStats
    done: bool = False
    zero: bool = False


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not minimum <= value <= _MAX_INT64:
        raise ValueError(f"{name} must be an int >= {minimum}, not {value}")
    return value


class AccumulatorCore:
    """One member's rounds (see the module docstring). ``me`` is this member's name (its
    PeerID text); names order the leader election. ``cohort`` (the group's name) goes into the
    all-reduce group ids.

    :raises TypeError: an argument of the wrong type.

    :raises ValueError: a bad argument (named).
    """

    def __init__(
        self,
        me: str,
        *,
        cohort: str = "",
        virtual_batch_size: int = 1,
        parallel_gradients: int = 1,
        weighting: Weighting = "contributions",
        model_version: int = 0,
        round_timeout: float = 60.0,
    ) -> None:
        if not isinstance(me, str) or not me:
            raise ValueError("me must be a non-empty str")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, not {weighting!r}")
        if not isinstance(round_timeout, int | float) or not round_timeout > 0:
            raise ValueError(f"round_timeout must be a positive number, not {round_timeout!r}")
        if not isinstance(cohort, str):
            raise TypeError(f"cohort must be a str, not {type(cohort).__name__}")
        self.me = me
        self.cohort = cohort
        self.weighting: Weighting = weighting
        self.round_timeout = float(round_timeout)
        self._virtual_batch_size = _check_int("virtual_batch_size", virtual_batch_size, 1)
        self._version = _check_int("model_version", model_version, 0)
        self._slots = [
            _Slot() for _ in range(_check_int("parallel_gradients", parallel_gradients, 1))
        ]
        #: which model we hold: empty for none (fresh); made by a member that leads without
        #: one, inherited with a state. Two members hold the same model iff they have the same
        #: lineage and version (members that start alone each lead their own model).
        self._lineage = b""
        self._leader_lineage = b""
        self._epoch: bytes | None = None
        self._members: tuple[str, ...] = ()
        self._leader: str | None = None
        self._hellos: _Exchange | None = None
        self._waiting_for_state = False
        self._counts: dict[int, _Exchange] = {}
        #: per peer, messages of the one epoch it last spoke of that this member has not
        #: adopted, and when the first of them came
        self._early: dict[str, tuple[float, list[CoreMessage]]] = {}
        #: members of this epoch that last spoke of another one (a message, or an answer to
        #: ours: see :meth:`heard_elsewhere`), and when
        self._elsewhere: dict[str, float] = {}
        self._next_index = 0
        self._pending: dict[int, _Pending] = {}
        self._has_gradients = False
        self._stats = GradientStats()
        self._state_requests = False
        #: (epoch, count index) of the result in .grad, until zero_gradients reads it
        self._unread = (b"", 0)

    # --- settings and accessors --------------------------------------------------------------

    @property
    def model_version(self) -> int:
        return self._version

    def set_model_version(self, version: int) -> None:
        """Set the model version (a restored checkpoint: the model is another one, so its
        lineage is new); it takes effect in the next election.

        :raises TypeError: an argument of the wrong type.

        :raises ValueError: not an int in ``[0, 2**63)``.
        """
        self._version = _check_int("version", version, 0)
        self._lineage = b""

    @property
    def virtual_batch_size(self) -> int:
        return self._virtual_batch_size

    def set_virtual_batch_size(self, size: int) -> None:
        """The lower bound on a result's summed batch size; every member must use the same.

        :raises TypeError: an argument of the wrong type.

        :raises ValueError: not an int >= 1.
        """
        self._virtual_batch_size = _check_int("size", size, 1)

    @property
    def parallel_gradients(self) -> int:
        return len(self._slots)

    def set_parallel_gradients(self, n: int) -> None:
        """Use ``n`` slots. Only while no slot holds data or a round (as moolib resets them).

        :raises TypeError: an argument of the wrong type.

        :raises ValueError: not an int >= 1.
        :raises RuntimeError: a slot holds contributions or a round is in flight.
        """
        n = _check_int("n", n, 1)
        if self._counts or self._pending or any(not s.totals.empty for s in self._slots):
            raise RuntimeError(
                "set_parallel_gradients() while contributions are in flight: call it before "
                "the first reduce_gradients() or right after a result was applied"
            )
        self._slots = [_Slot() for _ in range(n)]

    @property
    def epoch(self) -> bytes | None:
        return self._epoch

    @property
    def members(self) -> tuple[str, ...]:
        return self._members

    @property
    def leader(self) -> str | None:
        """The elected leader of this epoch, or ``None`` while electing."""
        return self._leader

    def is_leader(self) -> bool:
        return self._leader == self.me

    def connected(self) -> bool:
        """In an epoch, the leader elected, and holding the leader's model (or leading)."""
        return self._leader is not None and not self._waiting_for_state

    def wants_gradients(self) -> bool:
        """Whether the next :meth:`contribute` or :meth:`skip` is allowed."""
        return (
            self.connected()
            and not self._has_gradients
            and self._slots[self._next_index % len(self._slots)].phase == "open"
        )

    def has_gradients(self) -> bool:
        return self._has_gradients

    @property
    def next_index(self) -> int:
        """The index of this epoch's next contribution (its count's)."""
        return self._next_index

    def counted(self, index: int) -> bool:
        """Whether count ``index`` of this epoch completed (every member's count held)."""
        return index < self._next_index and index not in self._counts

    def pending(self, index: int) -> bool:
        """Whether count ``index`` decided a result that is not applied yet."""
        return index in self._pending

    def stats(self) -> GradientStats:
        return self._stats

    def wants_state(self) -> bool:
        """Whether this member is a donor and a member of the epoch waits for a state."""
        return self._state_requests

    def state_set(self) -> None:
        """The user answered :meth:`wants_state` (the caller shares the state)."""
        self._state_requests = False

    # --- epochs and election -------------------------------------------------------------------

    def new_epoch(
        self, members: Sequence[str], now: float, *, epoch: bytes | None = None
    ) -> list[Action]:
        """Adopt the view ``members`` (which holds ``me``) as ``epoch`` (by default
        :func:`epoch_digest` of ``members``; the group passes a digest that also covers each
        member's incarnation, so that a member that restarted makes a new epoch). Drops rounds
        in flight and unapplied results, keeps contributions (merged into slot 0), starts the
        election. Adopting the current epoch again does nothing.

        :raises ValueError: ``me`` is not a member.
        """
        view = tuple(sorted(set(members)))
        if self.me not in view:
            raise ValueError(f"{self.me} is not in the view {view}")
        if epoch is None:
            epoch = epoch_digest(view)
        if epoch == self._epoch:
            return []
        actions: list[Action] = []
        carry = [i for i, s in enumerate(self._slots) if not s.totals.empty]
        merged = SlotTotals()
        for i in carry:
            merged = merged + self._slots[i].totals
        if any(i != 0 for i in carry):
            actions.append(MergeSlots(tuple(i for i in carry if i != 0)))
        self._slots = [_Slot() for _ in self._slots]
        self._slots[0].totals = merged
        self._epoch, self._members = epoch, view
        self._leader = None
        self._waiting_for_state = False
        self._state_requests = False
        self._counts.clear()
        self._pending.clear()
        self._elsewhere.clear()
        self._next_index = 0
        hello = Hello(epoch, *self.state_id())
        self._hellos = _Exchange(now, {self.me: hello})
        others = self._others()
        if others:
            actions.append(Send(others, hello))
        actions += self._replay_early(now)
        actions += self._maybe_elect()
        return actions

    def _others(self) -> tuple[str, ...]:
        return tuple(m for m in self._members if m != self.me)

    def _maybe_elect(self) -> list[Action]:
        hellos = self._hellos
        if hellos is None or len(hellos.got) < len(self._members):
            return []
        self._hellos = None
        lineages = {peer: msg.lineage for peer, msg in hellos.got.items() if isinstance(msg, Hello)}
        ranked = sorted(
            (
                (msg.version, msg.has_model, peer)
                for peer, msg in hellos.got.items()
                if isinstance(msg, Hello)
            ),
            reverse=True,
        )
        leader_version, _, self._leader = ranked[0]
        if self._leader == self.me:
            if not self._lineage:
                self._lineage = _new_lineage(self.me, self._epoch or b"")
            self._leader_lineage = self._lineage
            return []
        # (a fresh leader makes its lineage now, as every member can derive)
        self._leader_lineage = lineages[self._leader] or _new_lineage(
            self._leader, self._epoch or b""
        )
        version, lineage = self.state_id()
        if leader_version == version and lineage and lineage == self._leader_lineage:
            return []  # (the same model: e.g. we trained together, or loaded its state)
        self._waiting_for_state = True
        donors = tuple(
            peer
            for version, _, peer in ranked
            if version == leader_version
            and (
                peer == self._leader
                or (lineages[peer] and lineages[peer] == lineages[self._leader])
            )
        )
        return [RequestState(donors, leader_version)]

    @property
    def lineage(self) -> bytes:
        """Which model this member holds (empty: none yet); travels with its state."""
        return self._lineage

    def state_id(self) -> tuple[int, bytes]:
        """The ``(model_version, lineage)`` this member's hello announces and its state must
        have when it is served: the model's once the result in ``.grad`` is read (a result
        applied before an epoch change is stepped with by the user, while members whose
        all-reduce of it failed did not get it: they must download, not train on one version
        behind)."""
        if self._has_gradients:
            return self._version + 1, _next_lineage(self._lineage, *self._unread)
        return self._version, self._lineage

    def state_requested(self) -> None:
        """A member of this epoch asked this donor for the state: :meth:`wants_state`."""
        if self.connected():
            self._state_requests = True

    def state_loaded(self, version: int, lineage: bytes | None = None) -> list[Action]:
        """A state of version ``version`` and ``lineage`` (by default the elected leader's) was
        copied in: connected; the slots are dropped."""
        self._version = _check_int("version", version, 0)
        self._lineage = lineage if lineage else self._leader_lineage
        self._waiting_for_state = False
        self._slots = [_Slot() for _ in self._slots]
        self._drop_unread()
        return [DropSlots()]

    def _drop_unread(self) -> None:
        # (a result of the model that a state replaced: stepping the state with it would apply
        # it twice, or apply one the donor never did)
        self._has_gradients = False
        self._unread = (b"", 0)

    def model_replaced(self, version: int, lineage: bytes) -> None:
        """The model was replaced by a state of ``version`` and ``lineage`` outside an election
        of this epoch (a download that ended after the epoch changed): the next epoch's hello
        says so."""
        self._version = _check_int("version", version, 0)
        self._lineage = lineage
        self._drop_unread()

    # --- messages -----------------------------------------------------------------------------

    def receive(self, peer: str, message: CoreMessage, now: float) -> list[Action]:
        """A message from ``peer``. One of another epoch is kept (bounded) until this member
        adopts that epoch, and asks for a :class:`Refresh`.

        :raises RemoteProtocolError: a message no honest member sends (a duplicate, an index
            out of range, another virtual batch size, a non-member).
        """
        if len(message.epoch) != EPOCH_SIZE:
            raise RemoteProtocolError(f"{peer} sent an epoch of {len(message.epoch)} bytes")
        if message.epoch != self._epoch:
            kept = self._early.get(peer)
            if kept is None and len(self._early) >= _MAX_EARLY_PEERS:
                self._forget_early(now)
                if len(self._early) >= _MAX_EARLY_PEERS:
                    raise RemoteProtocolError(f"too many peers speak of epochs; {peer} refused")
            if kept is None or kept[1][0].epoch != message.epoch:
                kept = self._early[peer] = (now, [])
            if len(kept[1]) >= _MAX_EARLY_MESSAGES:
                raise RemoteProtocolError(f"{peer} sent too many messages of an unknown epoch")
            kept[1].append(message)
            self.heard_elsewhere(peer, now)
            return [Refresh(peer)]
        if peer not in self._members or peer == self.me:
            raise RemoteProtocolError(f"{peer} is not a member of this epoch")
        if isinstance(message, Hello):
            return self._on_hello(peer, message)
        return self._on_count(peer, message, now)

    def _replay_early(self, now: float) -> list[Action]:
        """Receive the kept messages of the epoch just adopted. Those of another epoch stay
        kept: this member may pass through other views before it adopts theirs (the sender
        does not send them again, so dropping them here would leave both waiting for each
        other until one suspects the other)."""
        actions: list[Action] = []
        self._forget_early(now)
        for peer in [p for p, (_, kept) in self._early.items() if kept[0].epoch == self._epoch]:
            _, messages = self._early.pop(peer)
            if peer not in self._members or peer == self.me:
                continue
            for message in messages:
                try:
                    actions += self.receive(peer, message, now)
                except RemoteProtocolError:
                    break
        return actions

    def _forget_early(self, now: float) -> None:
        """Drop kept messages that came ``_EARLY_KEEP * round_timeout`` ago or more: their
        sender has given up on this member by then (and a peer that left must not hold a
        place for good).

        Not after one ``round_timeout``: the sender waits that long from its own message and
        then a little more before it suspects this member, while this member may itself have
        spent a ``round_timeout`` in a view that still holds a dead peer (it suspects one only
        once its messages failed for that long) before it adopts the sender's. Forgetting at
        one ``round_timeout`` dropped the hellos of the sender's epoch just before this member
        adopted it; the sender, holding this member's hello, went on, and each side waited
        for the other until it suspected it: the cohort split in two."""
        keep = _EARLY_KEEP * self.round_timeout
        for peer, (since, _) in list(self._early.items()):
            if now - since >= keep:
                del self._early[peer]

    def _on_hello(self, peer: str, hello: Hello) -> list[Action]:
        if self._hellos is None or peer in self._hellos.got:
            raise RemoteProtocolError(f"{peer} said hello twice in one epoch")
        _check_wire_int(peer, "version", hello.version)
        if not isinstance(hello.lineage, bytes) or len(hello.lineage) > EPOCH_SIZE:
            raise RemoteProtocolError(f"{peer} sent a bad lineage: {hello.lineage!r:.80}")
        self._hellos.got[peer] = hello
        return self._maybe_elect()

    def _on_count(self, peer: str, count: Count, now: float) -> list[Action]:
        index = count.index
        _check_wire_int(peer, "index", index)
        for name in ("batch_size", "num_gradients", "num_skipped"):
            _check_wire_int(peer, name, getattr(count.totals, name))
        if count.virtual_batch_size != self._virtual_batch_size:
            raise RemoteProtocolError(
                f"{peer} uses virtual_batch_size={count.virtual_batch_size}, "
                f"this member {self._virtual_batch_size}: every member must use the same"
            )
        # a member's count k needs ours of k - P: it is at most P - 1 ahead of our next one
        if index >= self._next_index + len(self._slots):
            raise RemoteProtocolError(f"{peer} sent count {index}, too far ahead")
        exchange = self._counts.get(index)
        if exchange is None:
            if index < self._next_index:
                raise RemoteProtocolError(f"{peer} sent count {index} after it completed")
            exchange = self._counts[index] = _Exchange(now)
        if peer in exchange.got:
            raise RemoteProtocolError(f"{peer} sent count {index} twice")
        exchange.got[peer] = count
        return self._maybe_decide(index)

    # --- contributions ------------------------------------------------------------------------

    def contribute(self, batch_size: int, now: float) -> tuple[int, list[Action]]:
        """A gradient of ``batch_size`` samples: returns the slot the caller adds ``.grad``
        into (times ``batch_size`` with ``weighting="samples"``), and what to do.

        :raises TypeError: an argument of the wrong type.

        :raises ValueError: ``batch_size`` not an int >= 1.
        :raises RuntimeError: :meth:`wants_gradients` is false.
        """
        batch_size = _check_int("batch_size", batch_size, 1)
        return self._contribute(SlotTotals(batch_size, 1, 0), "reduce_gradients", now)

    def skip(self, now: float) -> tuple[int, list[Action]]:
        """Take part in the next count without a gradient.

        :raises RuntimeError: :meth:`wants_gradients` is false.
        """
        return self._contribute(SlotTotals(0, 0, 1), "skip_gradients", now)

    def _contribute(self, add: SlotTotals, what: str, now: float) -> tuple[int, list[Action]]:
        if not self.wants_gradients():
            raise RuntimeError(f"{what}() while wants_gradients() is false: {self._why_not()}")
        assert self._epoch is not None
        index = self._next_index
        self._next_index += 1
        slot_index = index % len(self._slots)
        slot = self._slots[slot_index]
        slot.totals = slot.totals + add
        slot.phase = "counting"
        count = Count(self._epoch, index, slot.totals, self._virtual_batch_size)
        exchange = self._counts.setdefault(index, _Exchange(now))
        exchange.started = now  # (a stall counts from our own count)
        exchange.got[self.me] = count
        actions: list[Action] = []
        if self._others():
            actions.append(Send(self._others(), count))
        actions += self._maybe_decide(index)
        return slot_index, actions

    def _why_not(self) -> str:
        if self._epoch is None:
            return "not in a cohort yet"
        if self._leader is None:
            return "electing a leader"
        if self._waiting_for_state:
            return "waiting for the leader's state"
        if self._has_gradients:
            return "a result is in .grad: call zero_gradients() first"
        return "every slot is busy (counting or reducing)"

    def _maybe_decide(self, index: int) -> list[Action]:
        exchange = self._counts.get(index)
        if exchange is None or len(exchange.got) < len(self._members):
            return []
        del self._counts[index]
        slot_index = index % len(self._slots)
        slot = self._slots[slot_index]
        total = SlotTotals()
        for message in exchange.got.values():
            assert isinstance(message, Count)
            total = total + message.totals
        if total.batch_size < self._virtual_batch_size:
            slot.phase = "open"
            return []
        slot.phase = "reducing"
        stats = GradientStats(total.num_gradients, total.num_skipped, total.batch_size)
        pending = self._pending[index] = _Pending(slot_index, stats)
        if total.num_gradients == 0:
            pending.done = pending.zero = True
            return self._apply_ready()
        assert self._epoch is not None
        mine = slot.totals
        weight = float(mine.num_gradients if self.weighting == "contributions" else mine.batch_size)
        return [
            StartReduce(
                self._epoch,
                index,
                slot_index,
                round_group_id(self.cohort, self._epoch, index),
                self._members,
                weight,
                1.0 / weight if weight > 0 else 0.0,
                stats,
            )
        ]

    # --- gradient phases and results ------------------------------------------------------------

    def reduce_done(self, epoch: bytes, index: int, ok: bool) -> list[Action]:
        """The all-reduce of count ``index`` of ``epoch`` ended: ``ok`` if it was complete. A
        failed one leaves the slot's data in place; the caller then suspects the members it
        names, and the next epoch retries with every contribution kept. Reports of another
        epoch are ignored."""
        if epoch != self._epoch:
            return []
        pending = self._pending.get(index)
        if pending is None or pending.done:
            return []
        if not ok:
            return []
        pending.done = True
        return self._apply_ready()

    def _apply_ready(self) -> list[Action]:
        if self._has_gradients or not self._pending:
            return []
        index = min(self._pending)
        pending = self._pending[index]
        if not pending.done:
            return []
        del self._pending[index]
        slot = self._slots[pending.slot]
        slot.totals = SlotTotals()
        slot.phase = "open"
        self._stats = pending.stats
        self._has_gradients = True
        self._unread = (self._epoch or b"", index)
        return [ApplyResult(index, pending.slot, pending.stats, pending.zero, self._version + 1)]

    def zero_gradients(self) -> list[Action]:
        """The user read the result (stepped the model with it): ``model_version`` goes up by
        one (as moolib's), and the next result in order may be applied. Without an unread
        result, nothing changes."""
        if not self._has_gradients:
            return []
        self._has_gradients = False
        self._version += 1
        # the model now holds this result: those that stepped with it (the members of its
        # epoch) share the new lineage, and a member that stepped with another result of the
        # same version (a cohort split in two for a while) does not
        self._lineage = _next_lineage(self._lineage, *self._unread)
        return self._apply_ready()

    # --- faults ---------------------------------------------------------------------------------

    def heard_elsewhere(self, peer: str, now: float) -> None:
        """``peer``, a member of this epoch, answered one of our messages with another epoch
        (or sent one of another epoch): it is alive and has not adopted ours yet, and it keeps
        what we sent until it does (see :meth:`stalled`)."""
        if peer in self._members and peer != self.me:
            self._elsewhere[peer] = now

    def stalled(self, now: float) -> tuple[str, ...]:
        """Members that an exchange of this epoch has waited on for ``round_timeout`` (the
        caller suspects them: they are left out of the view until they speak again). A count
        waits only once this member sent its own.

        A member that spoke of another epoch since the exchange began is waited on for twice
        ``round_timeout``: it is alive and on its way to ours (it may itself spend a
        ``round_timeout`` in a view that still holds a dead peer before it adopts ours, as
        this member did before it); suspected at one ``round_timeout``, it could be suspected
        just before its hello came, and the cohort split for a while."""
        silent: set[str] = set()
        exchanges = list(self._counts.values())
        if self._hellos is not None:
            exchanges.append(self._hellos)
        for exchange in exchanges:
            waited = now - exchange.started
            if self.me not in exchange.got or waited < self.round_timeout:
                continue
            for member in self._members:
                if member in exchange.got:
                    continue
                elsewhere = self._elsewhere.get(member)
                if (
                    waited < _EARLY_KEEP * self.round_timeout
                    and elsewhere is not None
                    and elsewhere >= exchange.started
                ):
                    continue
                silent.add(member)
        return tuple(sorted(silent))


def _new_lineage(me: str, epoch: bytes) -> bytes:
    digest = hashlib.sha256(b"swarmavg.acc.lineage")
    raw = me.encode()
    digest.update(len(raw).to_bytes(4, "big") + raw + epoch)
    return digest.digest()[:16]


def _next_lineage(lineage: bytes, epoch: bytes, index: int) -> bytes:
    """The lineage of a model of ``lineage`` stepped with count ``index``'s result of
    ``epoch``."""
    digest = hashlib.sha256(b"swarmavg.acc.step")
    digest.update(len(lineage).to_bytes(4, "big") + lineage + epoch + index.to_bytes(8, "big"))
    return digest.digest()[:16]


def _check_wire_int(peer: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_INT64:
        raise RemoteProtocolError(f"{peer} sent a bad {name}: {value!r}")
