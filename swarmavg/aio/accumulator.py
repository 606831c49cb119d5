"""The moolib-style accumulator's anyio shell: :class:`Group` (the cohort in the DHT) and
:class:`Accumulator` (a task drives :class:`~swarmavg.proto.accumulator.AccumulatorCore`).

See ``docs/design/accumulator.md``. The core decides; this module moves bytes and tensors:

* :class:`Group` publishes this member's signed record under ``<name>.group`` (subkey
  ``owner_marker(peer)``: only its owner can write it), renews it, reads the others' and makes
  the *view* (alive records minus suspects) and its epoch (:func:`epoch_digest` over each
  member's name and when it joined);
* :class:`Accumulator` sends the core's messages as ``acc.msg`` unary calls (answered with
  :class:`~swarmavg.proto.accumulator.AccAck`: the receiver's epoch), keeps one flat CPU
  buffer per slot, runs each gradient phase with
  :meth:`~swarmavg.aio.allreduce.AllReduceService.run` over an ``abc.Group`` built from the
  view (group id :func:`round_group_id`), counts a round only if the all-reduce was complete,
  and moves states with :class:`~swarmavg.aio.state.StateSharer` (prefix ``<name>.acc``;
  parameters, buffers, then the user's tensors; the user's skeleton and the version in the
  metadata) from the donors the election named.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, Self

import anyio
import numpy as np
import numpy.typing as npt

from swarmavg._time import get_dht_time
from swarmavg.abc import Group as AvgGroup
from swarmavg.abc import GroupMember
from swarmavg.address import Address
from swarmavg.errors import RemoteError, RemoteProtocolError, SwarmError, TransportError
from swarmavg.identity import PeerID
from swarmavg.proto.accumulator import (
    EPOCH_SIZE,
    AccAck,
    AccLeave,
    AccumulatorCore,
    Action,
    ApplyResult,
    Count,
    DropSlots,
    Hello,
    MergeSlots,
    Refresh,
    RequestState,
    Send,
    StartReduce,
    epoch_digest,
)
from swarmavg.proto.accumulator_state import join_state, split_state
from swarmavg.proto.allreduce import FlatLayout, TensorSpec
from swarmavg.proto.butterfly import RoundConfig
from swarmavg.proto.codec import Message
from swarmavg.proto.dht_validation import owner_marker, owner_of
from swarmavg.proto.state_messages import StateDownloadFailed

if TYPE_CHECKING:
    import torch

    from swarmavg.aio.dht_facade import DHT
    from swarmavg.aio.node import BackgroundTask, Node
    from swarmavg.aio.rpc import CallContext

__all__ = ["METHOD", "Accumulator", "Group", "tensor_dtype"]

logger = logging.getLogger(__name__)

METHOD: Final = "acc.msg"
#: an ``acc.msg`` is tried again after a failure for ``round_timeout``, each try waiting at
#: most this fraction of it for the answer
_SEND_TRIES: Final = 4
#: seconds between tries of an ``acc.msg``: the first, doubling up to the second
_RESEND_DELAY: Final = (0.25, 2.0)
_MAX_ADDRESS_LENGTH: Final = 512
_MAX_MEMBERS: Final = 256
#: gradient phases in a row that a member is named in as failing (its part or its values
#: missing) before it is left out of the view although it still answers messages
_MAX_ROUND_FAILURES: Final = 3


def tensor_dtype(obj: object) -> str | None:
    """For :func:`~swarmavg.proto.accumulator_state.split_state`: ``None`` if ``obj`` is not a
    torch tensor, else its dtype's name (or why it cannot travel)."""
    import torch

    if not isinstance(obj, torch.Tensor):
        return None
    if obj.layout != torch.strided:
        return f"a {obj.layout} tensor"
    return str(obj.dtype).removeprefix("torch.")


class Group:
    """A named cohort in the DHT: this member's record under ``<name>.group`` and the view of
    the others'. An async context manager (entering publishes and renews the record, leaving
    stores a tombstone); :meth:`update` reads the records.

    :raises ValueError: a bad argument (named).
    """

    def __init__(
        self, name: str, dht: DHT, *, member_ttl: float = 20.0, refresh_period: float = 1.0
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, not {name!r}")
        for what, value in (("member_ttl", member_ttl), ("refresh_period", refresh_period)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{what} must be a positive number, not {value!r}")
        self.name = name
        self.dht = dht
        self.key = f"{name}.group"
        self.member_ttl = float(member_ttl)
        self.refresh_period = float(refresh_period)
        #: the view: members (sorted by PeerID text), their addresses, the epoch
        self.members: tuple[PeerID, ...] = ()
        self.addresses: dict[PeerID, Address] = {}
        self.epoch: bytes | None = None
        #: a local counter of epochs (for logs)
        self.epoch_count = 0
        self._since = 0.0
        self._suspects: dict[PeerID, float] = {}  # peer -> its record's expiration then
        self._excluded: dict[PeerID, float] = {}  # peer -> until (anyio time)
        #: the newest record read of each member: (address, since, expiration). A read that
        #: misses a record (a partial answer while a link fails) does not drop its member:
        #: only the record's expiration, its owner's tombstone or a suspicion does
        self._records: dict[PeerID, tuple[Address | None, float, float]] = {}
        self._last_read = -math.inf
        self._renewer: BackgroundTask | None = None
        self._closed = False
        #: epochs this member held (a view that comes back makes a new incarnation instead)
        self._past: set[bytes] = set()
        self._updating = anyio.Lock()
        #: called (on the loop) whenever the view's epoch changes, whoever read it
        self.on_change: list[Callable[[], None]] = []

    @property
    def me(self) -> PeerID:
        return self.dht.peer_id

    async def __aenter__(self) -> Self:
        """Publish this member's record and renew it (a background task of the node: entering
        and leaving may happen in different tasks, as the sync facade does)."""
        if self._renewer is not None:
            raise RuntimeError("a group can be entered once")
        self._since = get_dht_time()
        await self._publish()
        self._renewer = self.dht.node.spawn(self._renew_loop, name=f"renew {self.key}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop renewing and store a tombstone (best effort). Idempotent."""
        renewer, self._renewer = self._renewer, None
        if renewer is None or self._closed:
            return
        self._closed = True
        renewer.cancel()
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.refresh_period * 5):
            try:
                await self.dht.store(
                    self.key, None, get_dht_time() + self.member_ttl, owner_marker(self.me)
                )
            except (SwarmError, OSError) as exc:
                logger.debug("could not store the tombstone of %s: %s", self.key, exc)

    async def _publish(self) -> bool:
        addresses = self.dht.visible_addresses()
        record = {
            "peer": self.me.to_bytes(),
            "address": str(addresses[0]) if addresses else "",
            "since": self._since,
        }
        try:
            stored = await self.dht.store(
                self.key, record, get_dht_time() + self.member_ttl, owner_marker(self.me)
            )
        except (SwarmError, OSError) as exc:
            logger.debug("could not publish %s: %s", self.key, exc)
            return False
        if not stored:
            logger.debug("could not publish %s: no node took it", self.key)
        return stored

    async def _renew_loop(self) -> None:
        while True:
            await anyio.sleep(self.member_ttl / 3)
            await self._publish()

    async def rejoin(self) -> None:
        """Publish a new incarnation of this member (a new ``since``): every member makes a
        new epoch at its next read although the members are the same. This is how a round
        that failed among members that all still answer is retried (with the contributions
        kept, as on any epoch change)."""
        self._since = max(get_dht_time(), self._since + 1e-3)
        await self._publish()
        self.refresh_soon()

    def suspect(self, peer: PeerID) -> None:
        """Leave ``peer`` out of the view until its record is renewed (it stopped answering)."""
        if peer != self.me:
            record = self._records.get(peer)
            self._suspects[peer] = record[2] if record is not None else math.inf
            self._last_read = -math.inf

    def exclude(self, peer: PeerID, seconds: float) -> None:
        """Leave ``peer`` out of the view for ``seconds`` whether it answers or not (it keeps
        failing the rounds it is in)."""
        if peer != self.me:
            self._excluded[peer] = anyio.current_time() + seconds
            self._last_read = -math.inf

    def unsuspect(self, peer: PeerID) -> bool:
        """``peer`` answered or spoke: take it back into the view at the next read (a link
        that failed for a while must not keep the cohort split until its record is renewed).
        Whether it was suspected."""
        if self._suspects.pop(peer, None) is None:
            return False
        self._last_read = -math.inf
        return True

    def refresh_soon(self) -> None:
        """Make the next :meth:`update` read the records whatever ``refresh_period`` says."""
        self._last_read = -math.inf

    async def update(self) -> bool:
        """Read the records (at most every ``refresh_period`` unless :meth:`refresh_soon`);
        whether the epoch changed. A view this member held before and left (a suspect taken
        back) is never adopted again: the others may still hold that epoch's exchanges, so this
        member publishes a new incarnation (:meth:`rejoin`) and the epoch is a new one."""
        async with self._updating:
            now = anyio.current_time()
            if now - self._last_read < self.refresh_period:
                return False
            self._last_read = now
            return await self._update()

    async def _update(self) -> bool:
        for _ in range(2):
            members = await self._read()
            if members is None:
                return False
            now = anyio.current_time()
            for peer, until in list(self._excluded.items()):
                if until <= now:
                    del self._excluded[peer]
            view = {
                p: v
                for p, v in members.items()
                if p not in self._suspects and p not in self._excluded
            }
            if self.me in view:
                view[self.me] = (view[self.me][0], self._since)  # (ours, as we know it)
            epoch = self._epoch_of(view)
            if epoch is None or epoch not in self._past or epoch == self.epoch:
                break
            logger.debug(
                "cohort %s: the view %s was held before: rejoining", self.name, epoch.hex()[:8]
            )
            await self.rejoin()
        if self.me not in view or epoch is None:
            changed = self.epoch is not None
            self.members, self.addresses, self.epoch = (), {}, None
            if changed:
                self._changed()
            return changed
        if epoch == self.epoch:
            return False
        order = sorted(view, key=str)
        self.members = tuple(order)
        self.addresses = {p: a for p, (a, _) in view.items() if a is not None}
        self.epoch = epoch
        self._past.add(epoch)
        self.epoch_count += 1
        logger.info(
            "cohort %s: epoch %d (%s) with %d members",
            self.name,
            self.epoch_count,
            epoch.hex()[:8],
            len(order),
        )
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "cohort %s: epoch %s is %s",
                self.name,
                epoch.hex()[:8],
                ", ".join(f"{p.short()}@{view[p][1]!r}" for p in order),
            )
        self._changed()
        return True

    def _changed(self) -> None:
        for callback in self.on_change:
            callback()

    @staticmethod
    def _epoch_of(view: dict[PeerID, tuple[Address | None, float]]) -> bytes | None:
        order = sorted(view, key=str)
        return epoch_digest([str(p) for p in order], [repr(view[p][1]) for p in order])

    async def _read(self) -> dict[PeerID, tuple[Address | None, float]] | None:
        """The members whose records are alive (suspects too), as this read and the earlier
        ones saw them; ``None`` if the read failed."""
        try:
            with anyio.fail_after(max(self.refresh_period * 5, 5.0)):
                found = await self.dht.get(self.key, latest=True)
        except (SwarmError, OSError, TimeoutError) as exc:
            logger.debug("reading %s failed: %s", self.key, exc)
            return None
        entries = found.value if found is not None else None
        if isinstance(entries, dict):
            for subkey, item in list(entries.items())[:_MAX_MEMBERS]:
                expiration = getattr(item, "expiration_time", None)
                if not isinstance(expiration, int | float):
                    continue
                value = getattr(item, "value", None)
                parsed = _parse_record(subkey, value)
                if parsed is not None:
                    peer, address, since = parsed
                    known = self._records.get(peer)
                    if known is None or expiration >= known[2]:
                        self._records[peer] = (address, since, float(expiration))
                elif value is None and (owner := _tombstone_owner(subkey)) is not None:
                    known = self._records.get(owner)
                    if known is not None and expiration > known[2]:
                        del self._records[owner]  # (it left after that record)
        now = get_dht_time()
        for peer in [p for p, (_, _, expiration) in self._records.items() if expiration <= now]:
            del self._records[peer]
        members = {p: (address, since) for p, (address, since, _) in self._records.items()}
        for peer, until in list(self._suspects.items()):
            if peer not in self._records or self._records[peer][2] > until:
                del self._suspects[peer]  # renewed since (or gone anyway)
        return members


def _tombstone_owner(subkey: object) -> PeerID | None:
    """The member whose tombstone this subkey holds (the DHT checked its signature)."""
    return owner_of(subkey)


def _parse_record(subkey: object, value: object) -> tuple[PeerID, Address | None, float] | None:
    if not isinstance(value, dict):
        return None  # (a tombstone, or garbage)
    raw, address, since = value.get("peer"), value.get("address"), value.get("since")
    if (
        not isinstance(raw, bytes)
        or not isinstance(address, str)
        or len(address) > _MAX_ADDRESS_LENGTH
        or isinstance(since, bool)
        or not isinstance(since, int | float)
        or not math.isfinite(since)
    ):
        return None
    try:
        peer = PeerID(raw)
    except ValueError:
        return None
    if subkey != owner_marker(peer):
        return None  # (the DHT checked the owner's signature on this subkey)
    parsed: Address | None = None
    if address:
        try:
            parsed = Address.parse(address).with_peer_id(peer)
        except ValueError:
            return None
    return peer, parsed, float(since)


# -- the accumulator ---------------------------------------------------------------------------


@dataclass(eq=False)
class _Write:
    """Tensor writes for the user's thread (a result into ``.grad``, a state into the
    parameters), then what the task does once they are done. Without a deferring facade both
    run at once, in the task."""

    kind: Literal["result", "state", "sync"]
    write: Callable[[], None]
    then: Callable[[], None] | None = None
    #: checked (in the task) right before the write: a write it refuses is dropped
    valid: Callable[[], bool] | None = None


class Accumulator:
    """moolib's ``Accumulator`` for async code (see the module docstring and the design page).

    ``async with Accumulator(name, parameters, buffers, dht=dht) as acc:`` then
    ``await acc.wait_state()``; in the loop ``await acc.reduce_gradients(n)`` or
    ``await acc.skip_gradients()``, read ``.grad`` while :meth:`has_gradients`, then
    :meth:`zero_gradients`; answer :meth:`wants_state` with :meth:`set_state`.

    :param group: a :class:`Group` of ``dht`` that the caller entered (by default the
        accumulator makes its own, named ``name``).
    :param virtual_batch_size: the summed batch size a result needs at least (every member
        must use the same).
    :param parallel_gradients: slots (results may be up to this many versions stale).
    :param weighting: ``"contributions"`` (``.grad`` is the mean over contributions, as
        moolib) or ``"samples"`` (the sample-weighted mean).
    :param model_version: the version to start at (a restored checkpoint: see
        :meth:`set_model_version`).
    :param round_timeout: seconds an exchange or an all-reduce waits for a member, and
        messages to a member keep failing, before it is suspected (left out of the view).
    :param state_timeout: seconds a donor waits for :meth:`set_state`, and a joiner for a
        download, before asking again.
    :param state_donors: donors a joiner downloads from at once.
    :param refresh_period: seconds between reads of the cohort's records.
    :param buffer_sync_period: seconds between copies of the leader's buffers into every
        other member's (moolib's 12 s; ``None``: never): buffers such as batch-norm statistics
        are each member's own between them.
    :param state_sync_period: seconds between moolib's *regular updates*: every other member
        copies the leader's whole state (parameters, buffers, user state: the leader's
        :meth:`wants_state` turns true), taken only where it is at the leader's version and
        lineage and holds no unread result (600 s; ``None``: never).
    :raises TypeError: a parameter or buffer is not a tensor (named by index).
    :raises ValueError: another bad argument (named).
    """

    def __init__(
        self,
        name: str,
        parameters: Iterable[torch.Tensor],
        buffers: Iterable[torch.Tensor] = (),
        group: Group | None = None,
        *,
        dht: DHT,
        virtual_batch_size: int = 1,
        parallel_gradients: int = 1,
        weighting: str = "contributions",
        model_version: int = 0,
        round_timeout: float = 60.0,
        state_timeout: float = 60.0,
        state_donors: int = 2,
        refresh_period: float = 1.0,
        buffer_sync_period: float | None = 12.0,
        state_sync_period: float | None = 600.0,
        _deferred: bool = False,
    ) -> None:
        import torch

        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, not {name!r:.64}")
        self.parameters = list(parameters)
        self.buffers = list(buffers)
        for what, tensors in (("parameters", self.parameters), ("buffers", self.buffers)):
            for i, t in enumerate(tensors):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{what}[{i}] is a {type(t).__name__}, not a torch.Tensor")
        for i, p in enumerate(self.parameters):
            if not p.dtype.is_floating_point:
                raise TypeError(f"parameters[{i}] has dtype {p.dtype}, not a floating point one")
        if group is not None and group.dht is not dht:
            raise ValueError("group must use the accumulator's dht")
        if isinstance(state_donors, bool) or not isinstance(state_donors, int) or state_donors < 1:
            raise ValueError(f"state_donors must be an int >= 1, not {state_donors!r}")
        for what, value in (
            ("state_timeout", state_timeout),
            ("buffer_sync_period", buffer_sync_period),
            ("state_sync_period", state_sync_period),
        ):
            if value is None and what != "state_timeout":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{what} must be a positive number, not {value!r}")
        self.name = name
        self.dht = dht
        self.group = group if group is not None else Group(name, dht, refresh_period=refresh_period)
        self._owns_group = group is None
        self.core = AccumulatorCore(
            str(dht.peer_id),
            cohort=name,
            virtual_batch_size=virtual_batch_size,
            parallel_gradients=parallel_gradients,
            weighting=weighting,  # type: ignore[arg-type]
            model_version=model_version,
            round_timeout=round_timeout,
        )
        self.state_timeout = float(state_timeout)
        self.state_donors = state_donors
        self.buffer_sync_period = None if buffer_sync_period is None else float(buffer_sync_period)
        self.state_sync_period = None if state_sync_period is None else float(state_sync_period)
        #: regular updates (buffers, states) taken from the leader so far
        self.syncs = {"buffers": 0, "state": 0}
        self.layout = FlatLayout(
            tuple(
                TensorSpec(tuple(p.shape), str(p.dtype).removeprefix("torch."))
                for p in self.parameters
            )
        )
        self._slots = [self._empty_slot() for _ in range(self.core.parallel_gradients)]
        self._results: dict[tuple[bytes, int], list[npt.NDArray[Any]]] = {}
        #: (version, lineage), skeleton, tensors (parameters, buffers, the user's): copies made
        #: by set_state
        self._user_state: tuple[tuple[int, bytes], bytes, list[torch.Tensor]] | None = None
        self._new_state: object = None
        self._has_new_state = False
        self._state_set = anyio.Event()
        self._changed = anyio.Event()  # wakes waiters and the driver
        self._wake = anyio.Event()
        self._runner: BackgroundTask | None = None
        self._ended = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None
        self._sharer: Any = None
        self._buffer_sharer: Any = None
        self._regular_sharer: Any = None
        #: set_state() calls so far
        self._state_sets = 0
        #: state requests waiting for set_state (StateSharer's provider calls)
        self._providers = 0
        self._state_wanted = False  # (until the next set_state)
        self._downloading = False
        self._state_request: RequestState | None = None
        self._closed = False
        #: writes for the facade's update() (None: done at once, in the task)
        self._outbox: list[_Write] | None = [] if _deferred else None
        #: failed gradient phases in a row (each one makes a new epoch: see _reduce)
        self.failed_rounds = 0
        #: members named in the last failed gradient phases, and in how many in a row
        self._round_failures: dict[PeerID, int] = {}
        #: the sync facade's contribution (batch size, gradients; batch size 0: a skip) that
        #: its last snapshot allowed but the cohort did not take when it came (it changed in
        #: between): given to the next count the cohort allows, dropped if the model is replaced
        self._queued: tuple[int, list[npt.NDArray[Any] | None]] | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Start: serve ``acc.msg`` and the state, join the cohort, and drive the rounds (in a
        background task of the node, so that entering and leaving may happen in different
        tasks, as the sync facade does).

        :raises ValueError: another accumulator of this name runs on the node.
        :raises RuntimeError: entered twice.
        """
        from swarmavg.aio.allreduce import AllReduceService
        from swarmavg.aio.state import StateSharer

        if self._runner is not None or self._closed:
            raise RuntimeError("an accumulator can be entered once")
        registry = _registry(self.dht)
        if registry.setdefault(self.name, self) is not self:
            raise ValueError(f"another accumulator of {self.name!r} runs on this node")
        try:
            self.allreduce = AllReduceService.for_node(self.dht.node)

            def share(suffix: str, provider: Any, priority: float = 0.0) -> Any:
                sharer = StateSharer(
                    self.dht,
                    f"{self.name}.{suffix}",
                    provider,
                    enabled=True,
                    priority=priority,
                    declare_period=3600.0,
                )
                sharer.start()
                return sharer

            # (the joiners' state; the leader's buffers; the regular updates' fresh state)
            self._sharer = share("acc", self._provide_state, float(self.core.model_version))
            self._buffer_sharer = share("buf", self._provide_buffers)
            self._regular_sharer = share("reg", self._provide_fresh_state)
            if self._owns_group:
                await self.group.__aenter__()
            self.group.on_change.append(self._on_group_change)
            started = anyio.Event()
            self._runner = self.dht.node.spawn(self._run, started, name=f"accumulator {self.name}")
            await started.wait()
        except BaseException:
            await self._stop()
            raise
        return self

    async def _run(self, started: anyio.Event) -> None:
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._drive)
                tg.start_soon(self._sync_loop)
                started.set()
                await anyio.sleep_forever()
        finally:
            self._ended.set()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop: tell the members, withdraw, end every task. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._signal()
        epoch = self.core.epoch
        with anyio.CancelScope(shield=True):
            if epoch is not None:
                with anyio.move_on_after(2.0):
                    async with anyio.create_task_group() as tg:
                        for peer in self.group.members:
                            if peer != self.dht.peer_id:
                                tg.start_soon(self._send_one, peer, AccLeave(epoch))
            await self._stop()

    def _on_group_change(self) -> None:
        self._wake.set()  # (the driver adopts the view's new epoch now, not at its next turn)

    async def _stop(self) -> None:
        self._closed = True
        if self._on_group_change in self.group.on_change:
            self.group.on_change.remove(self._on_group_change)
        if self._runner is not None:
            self._runner.cancel()
            with anyio.move_on_after(5.0):
                await self._ended.wait()
        for sharer in (self._sharer, self._buffer_sharer, self._regular_sharer):
            if sharer is not None:
                sharer.stop()
        registry = _registry(self.dht)
        if registry.get(self.name) is self:
            del registry[self.name]
        if self._owns_group:
            await self.group.aclose()

    # -- predicates (moolib's) -----------------------------------------------------------------

    def connected(self) -> bool:
        """In the cohort, the leader elected, and holding its model (or leading)."""
        return self.core.connected()

    def wants_state(self) -> bool:
        """A joiner waits for a state from this member: answer with :meth:`set_state`."""
        return self._wants_state()

    def _wants_state(self) -> bool:
        # (a request waits for set_state: it outlives an epoch change, which resets the core's)
        # (and not while a result is unread: the state to serve is the model stepped with it)
        return (
            self.core.connected()
            and not self.core.has_gradients()
            and (self.core.wants_state() or self._state_wanted)
        )

    def has_new_state(self) -> bool:
        """A state was loaded since :meth:`state` was last called."""
        return self._has_new_state

    def state(self) -> object:
        """The user state last received (clears :meth:`has_new_state`)."""
        self._has_new_state = False
        return self._new_state

    def wants_gradients(self) -> bool:
        """The next :meth:`reduce_gradients` or :meth:`skip_gradients` is allowed."""
        return self.core.wants_gradients()

    def has_gradients(self) -> bool:
        """A result is in ``.grad`` (until :meth:`zero_gradients`)."""
        return self.core.has_gradients()

    def model_version(self) -> int:
        """Results this model was stepped with (+1 at each :meth:`zero_gradients` after a
        result)."""
        return self.core.model_version

    def set_model_version(self, version: int) -> None:
        """Set the model version (a restored checkpoint): the greatest version leads at the
        next election, and the others download its state.

        :raises TypeError: an argument of the wrong type.

        :raises ValueError: not an int in ``[0, 2**63)``.
        """
        self.core.set_model_version(version)

    def set_virtual_batch_size(self, size: int) -> None:
        """The summed batch size a result needs at least (every member must use the same).

        :raises TypeError: an argument of the wrong type.

        :raises ValueError: not an int >= 1.
        """
        self.core.set_virtual_batch_size(size)

    def set_parallel_gradients(self, n: int) -> None:
        """Use ``n`` slots (before the first contribution, or right after a result).

        :raises TypeError: an argument of the wrong type.

        :raises ValueError: not an int >= 1.
        :raises RuntimeError: contributions are in flight.
        """
        self.core.set_parallel_gradients(n)
        self._slots = [self._empty_slot() for _ in range(n)]

    def get_leader(self) -> str | None:
        """The leader's name (its PeerID text), or ``None`` while electing."""
        return self.core.leader

    def is_leader(self) -> bool:
        return self.core.is_leader()

    def get_gradient_stats(self) -> dict[str, int]:
        """The last result's ``num_gradients``, ``num_skipped`` and ``batch_size`` (summed over
        the cohort: the same on every member)."""
        return self.core.stats().as_dict()

    # -- the user's calls ----------------------------------------------------------------------

    def set_state(self, state: object) -> None:
        """The user state to hand to joiners, with a copy of the parameters and buffers as
        they are now, at the current model version (checked now: nothing is sent otherwise).

        :raises TypeError: an argument of the wrong type.

        :raises ValueError: ``state`` holds something that cannot travel (named
            by its path from ``state``).
        """
        skeleton, tensors = split_state(state, tensor_dtype)
        self._store_state(skeleton, self._copy_model() + _copy_user_tensors(tensors))

    async def wait_state(self) -> None:
        """Return once this member is connected (holding the leader's state if it joined).

        :raises RuntimeError: the accumulator is closed.
        """
        while not self.core.connected():
            await self._wait_change()

    async def wait_state_request(self) -> None:
        """Return once :meth:`wants_state` is true (a joiner waits for this member's state):
        a task that serves states loops on this and :meth:`set_state`.

        :raises RuntimeError: the accumulator is closed.
        """
        while not self._wants_state():
            await self._wait_change()

    async def reduce_gradients(self, batch_size: int, *, wait: bool = True) -> None:
        """Contribute ``.grad`` (then zeroed) for ``batch_size`` samples; return once its count
        is done: with the result in ``.grad`` if the count decided a result (the virtual batch
        is full), else at once after the count (the slot takes the next contribution). Returns
        early, the contribution kept for the next count, if the cohort changes meanwhile.
        With ``wait=False``, return as soon as ``.grad`` was read (with
        ``set_parallel_gradients(n)``, to contribute to the next slot meanwhile; see
        :meth:`wait_gradients`).

        :raises RuntimeError: :meth:`wants_gradients` is false (nothing was read or zeroed).
        :raises TypeError: an argument of the wrong type.
        :raises ValueError: ``batch_size`` is not an int >= 1.
        """
        actions = self._contribute(batch_size, self._read_grads())
        self._zero_grads()
        if wait:
            await self._await_count(actions)
        else:
            self._handle(actions)

    async def skip_gradients(self, *, wait: bool = True) -> None:
        """Take part in the next count without a gradient (see :meth:`reduce_gradients`).

        :raises RuntimeError: :meth:`wants_gradients` is false.
        """
        _slot, actions = self.core.skip(anyio.current_time())
        if wait:
            await self._await_count(actions)
        else:
            self._handle(actions)

    async def wait_gradients(self) -> None:
        """Return once :meth:`has_gradients` is true (a result is in ``.grad``).

        :raises RuntimeError: the accumulator is closed.
        """
        while not self.core.has_gradients():
            await self._wait_change()

    def zero_gradients(self) -> None:
        """Zero ``.grad``; if a result was in it, the model version goes up by one and the next
        result in order may be applied."""
        self._zero_grads()
        self._zero_result()

    # -- the sync facade's entry points (on the loop, its tensor work in the user's thread) -----

    def _read_grads(self) -> list[npt.NDArray[Any] | None]:
        """The parameters' ``.grad``, flat (``None`` where there is none): views of CPU
        gradients, to be added into a slot before they are zeroed (a queued contribution copies
        them)."""
        import torch

        with torch.no_grad():
            return [
                None if p.grad is None else p.grad.detach().reshape(-1).cpu().numpy()
                for p in self.parameters
            ]

    def _zero_grads(self) -> None:
        for p in self.parameters:
            if p.grad is not None:
                p.grad.zero_()

    def _copy_model(self) -> list[torch.Tensor]:
        import torch

        with torch.no_grad():
            return [t.detach().to("cpu", copy=True) for t in self.parameters + self.buffers]

    def _contribute(self, batch_size: int, grads: list[npt.NDArray[Any] | None]) -> list[Action]:
        """Add ``grads`` to the next slot (:meth:`reduce_gradients` without the waiting)."""
        slot, actions = self.core.contribute(batch_size, anyio.current_time())
        scale = batch_size if self.core.weighting == "samples" else 1
        for view, grad in zip(self._views(self._slots[slot]), grads, strict=True):
            if grad is None:
                continue
            if scale == 1:
                view += grad  # (no temporary: a full pass fewer)
            else:
                view += grad * scale
        return actions

    def _contribute_nowait(self, batch_size: int, grads: list[npt.NDArray[Any] | None]) -> None:
        """The facade's contribution (``batch_size`` 0: a skip), allowed by its snapshot: at
        once if the cohort takes it now, else queued for the next count it allows."""
        if self._queued is not None or not self.core.wants_gradients():
            if self._queued is not None:
                raise RuntimeError("a contribution is queued already")  # (snapshot said no)
            self._queued = (batch_size, [None if g is None else g.copy() for g in grads])
            logger.info(
                "cohort %s: the cohort changed since wants_gradients(); the %s waits for the "
                "next count",
                self.name,
                "skip" if batch_size == 0 else "contribution",
            )
            return
        if batch_size == 0:
            _slot, actions = self.core.skip(anyio.current_time())
            self._handle(actions)
        else:
            self._handle(self._contribute(batch_size, grads))

    def _flush_queued(self) -> None:
        """Give the queued contribution to the count the cohort now allows."""
        if self._queued is not None and self.core.wants_gradients():
            batch_size, grads = self._queued
            self._queued = None
            self._contribute_nowait(batch_size, grads)

    def _zero_result(self) -> None:
        had = self.core.has_gradients()
        self._handle(self.core.zero_gradients())
        if had:
            self._sharer.priority = float(self.core.model_version)

    def _store_state(self, skeleton: bytes, tensors: list[torch.Tensor]) -> None:
        self._user_state = ((self.core.model_version, self.core.lineage), skeleton, tensors)
        self._state_sets += 1
        self.core.state_set()
        self._state_wanted = False
        self._state_set.set()
        self._state_set = anyio.Event()

    def _take_writes(self) -> list[_Write]:
        """The writes queued for the user's thread (the facade's ``update()``)."""
        assert self._outbox is not None
        writes, self._outbox[:] = list(self._outbox), []
        return [w for w in writes if w.valid is None or w.valid()]

    def _writes_done(self, writes: list[_Write]) -> None:
        for write in writes:
            if write.then is not None:
                write.then()

    def _snapshot(self) -> dict[str, Any]:
        """The predicates as the user's thread may see them: no result before its write."""
        unwritten = self._outbox is not None and any(w.kind == "result" for w in self._outbox)
        return {
            "connected": self.core.connected(),
            "wants_state": self._wants_state(),
            "wants_gradients": (
                self.core.wants_gradients() and not unwritten and self._queued is None
            ),
            "has_gradients": self.core.has_gradients() and not unwritten,
            "model_version": self.core.model_version,
            "leader": self.core.leader,
            "is_leader": self.core.is_leader(),
            "stats": self.core.stats().as_dict(),
        }

    def _write(self, write: _Write) -> None:
        if self._outbox is None:
            if write.valid is not None and not write.valid():
                return
            write.write()
            if write.then is not None:
                write.then()
        else:
            self._outbox.append(write)

    # -- internals -------------------------------------------------------------------------------

    def _empty_slot(self) -> list[npt.NDArray[Any]]:
        return [np.zeros(size, dtype=np.dtype(dtype)) for dtype, size in self.layout.buffers]

    def _views(self, flat: list[npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
        views = []
        for spec, (buffer, offset) in zip(self.layout.specs, self.layout.places, strict=True):
            numel = math.prod(spec.shape)
            views.append(flat[buffer][offset : offset + numel])
        return views

    def _signal(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _wait_change(self) -> None:
        if self._closed:
            raise RuntimeError("the accumulator is closed")
        await self._changed.wait()

    async def _await_count(self, actions: list[Action]) -> None:
        epoch, index = self.core.epoch, self.core.next_index - 1
        version = self.core.model_version
        self._handle(actions)
        while (
            self.core.epoch == epoch
            and not self.core.counted(index)
            and self.core.model_version == version
        ):
            await self._wait_change()
        while self.core.epoch == epoch and self.core.pending(index):
            await self._wait_change()

    async def _drive(self) -> None:
        while True:
            await self.group.update()
            # (compared, not the return value: another caller of the group's update() may have
            # seen the change first, e.g. the sync facade's Group.update())
            if self.group.epoch is not None and self.group.epoch != self.core.epoch:
                names = [str(p) for p in self.group.members]
                now = anyio.current_time()
                self._state_request = None
                self._handle(self.core.new_epoch(names, now, epoch=self.group.epoch))
                self._signal()
            for name in self.core.stalled(anyio.current_time()):
                logger.info("cohort %s: %s stopped answering", self.name, name[:16])
                self.group.suspect(PeerID.from_string(name))
            self._wake = anyio.Event()
            with anyio.move_on_after(self.group.refresh_period):
                await self._wake.wait()

    def _handle(self, actions: list[Action]) -> None:
        assert self._tg is not None
        for action in actions:
            if isinstance(action, Send):
                for name in action.to:
                    self._tg.start_soon(self._send_one, PeerID.from_string(name), action.message)
            elif isinstance(action, Refresh):
                logger.debug("cohort %s: %s is in another epoch", self.name, action.peer[:16])
                self.group.refresh_soon()
                self._wake.set()
            elif isinstance(action, RequestState):
                self._tg.start_soon(self._download, action)
            elif isinstance(action, MergeSlots):
                for slot in action.slots:
                    for into, buf in zip(self._slots[0], self._slots[slot], strict=True):
                        into += buf
                        buf.fill(0)
            elif isinstance(action, DropSlots):
                self._slots = [self._empty_slot() for _ in self._slots]
            elif isinstance(action, StartReduce):
                self._tg.start_soon(self._reduce, action)
            elif isinstance(action, ApplyResult):
                self._apply(action)
        self._flush_queued()
        self._signal()

    def _obsolete(self, message: Message) -> bool:
        """Whether sending ``message`` is moot now: closed, or an exchange of a past epoch."""
        if isinstance(message, AccLeave):
            return False
        return self._closed or getattr(message, "epoch", None) != self.core.epoch

    async def _send_one(self, peer: PeerID, message: Message) -> None:
        """Send ``message`` and read the answer. A transport failure (a call cut mid-way
        included: only an answer is a refusal) or a timeout is tried again (with a backoff)
        until the member has not answered for ``round_timeout``: only then is it suspected (a
        message lost to a link that failed for a moment would otherwise split the cohort). An
        ``AccLeave`` is sent once."""
        address = self.group.addresses.get(peer)
        if address is None:
            return
        if self._closed and not isinstance(message, AccLeave):
            return
        once = isinstance(message, AccLeave)
        tries = 1 if once else _SEND_TRIES
        deadline = anyio.current_time() + self.core.round_timeout
        delay = _RESEND_DELAY[0]
        ack: AccAck | None = None
        while ack is None:
            left = deadline - anyio.current_time()
            try:
                with anyio.fail_after(max(min(self.core.round_timeout / tries, left), 0.0)):
                    ack = await self.dht.node.rpc.call(
                        address, METHOD, message, response_type=AccAck
                    )
            except (SwarmError, OSError, TimeoutError) as exc:
                if not _lost(exc):  # (it refused the message: our views differ)
                    logger.info(
                        "cohort %s: %s refused %s: %s",
                        self.name,
                        peer.short(),
                        type(message).__name__,
                        exc,
                    )
                    self._heard_from(peer)
                    self.group.refresh_soon()
                    self._wake.set()
                    return
                left = deadline - anyio.current_time()
                if not once and left > 0 and not self._obsolete(message):
                    logger.debug(
                        "cohort %s: sending %s to %s failed (again in %.2f s): %s",
                        self.name,
                        type(message).__name__,
                        peer.short(),
                        delay,
                        exc,
                    )
                    await anyio.sleep(min(delay, left))
                    delay = min(delay * 2, _RESEND_DELAY[1])
                    if not self._obsolete(message):
                        continue
                    return
                # it left or died (or its link is down): out of the view until it is heard
                # from again or its record is renewed, rather than waited for in every
                # exchange
                logger.info(
                    "cohort %s: could not send %s to %s: %s",
                    self.name,
                    type(message).__name__,
                    peer.short(),
                    exc,
                )
                if not once and not self._obsolete(message):
                    self.group.suspect(peer)
                    self._wake.set()
                return
            except (RuntimeError, anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
                # (our own node is closed: shutting down, or the process' node was taken away)
                logger.debug(
                    "could not send %s: our node is closed: %s", type(message).__name__, exc
                )
                return
        self._heard_from(peer)
        if ack.epoch != getattr(message, "epoch", None):
            if getattr(message, "epoch", None) == self.core.epoch:
                # (alive, and it keeps our message until it adopts our epoch: waited on longer)
                self.core.heard_elsewhere(str(peer), anyio.current_time())
            self.group.refresh_soon()
            self._wake.set()

    def _heard_from(self, peer: PeerID) -> None:
        """``peer`` answered or spoke: if this member suspected it, the views merge again."""
        if self.group.unsuspect(peer):
            logger.info("cohort %s: %s answers again", self.name, peer.short())
            self._wake.set()

    async def _serve(self, message: Message, ctx: CallContext) -> AccAck:
        if not isinstance(message, AccLeave):
            self._heard_from(ctx.peer_id)
        if isinstance(message, AccLeave):
            self.group.refresh_soon()
            self._wake.set()
        elif isinstance(message, Hello | Count):
            try:
                self._handle(self.core.receive(str(ctx.peer_id), message, anyio.current_time()))
            except RemoteProtocolError as exc:
                logger.info(
                    "cohort %s: refused a message of %s: %s", self.name, ctx.peer_id.short(), exc
                )
                raise
        else:
            raise RemoteProtocolError(f"acc.msg does not take {type(message).__name__}")
        return AccAck(self.core.epoch or b"")

    async def _reduce(self, action: StartReduce) -> None:
        from swarmavg.aio.allreduce import AllReduceFailed

        members = []
        for name in action.members:
            peer = PeerID.from_string(name)
            members.append(GroupMember(peer, self.group.addresses.get(peer)))
        group = AvgGroup(action.group_id, tuple(members))
        copies = [buf * action.scale for buf in self._slots[action.slot]]
        ok = False
        culprits: set[PeerID] = set()
        try:
            # (a member that stalls half the round is named in the result: see _blame)
            stall = self.core.round_timeout / 2
            result = await self.allreduce.run(
                group,
                copies,
                self.layout,
                config=RoundConfig(
                    part_size=_part_size(self.layout.numel, len(members)),
                    timeout=self.core.round_timeout,
                    sender_timeout=stall,
                    reducer_timeout=stall,
                ),
                weight=action.weight,
            )
            expected = (
                action.stats.num_gradients
                if self.core.weighting == "contributions"
                else action.stats.batch_size
            )
            ok = not result.incomplete and not result.nonfinite and result.total_weight == expected
            if not ok:
                named = {r for r, _, _ in result.local_spans} | {s for _, s, _, _ in result.dropped}
                culprits = {members[i].peer_id for i in named | set(result.nonfinite)}
                culprits.discard(self.dht.peer_id)
                logger.info(
                    "cohort %s: count %d's all-reduce was incomplete (missing: %s)",
                    self.name,
                    action.index,
                    ", ".join(sorted(p.short() for p in culprits)) or "none named",
                )
        except AllReduceFailed as exc:
            logger.info("cohort %s: count %d's all-reduce failed: %s", self.name, action.index, exc)
        if ok:
            self.failed_rounds = 0
            self._round_failures.clear()
            self._results[(action.epoch, action.index)] = copies
        else:
            # (also when the epoch moved on meanwhile: a member that fails at once starts the
            # next epoch before the others' phase names it)
            self._blame(culprits)
        if not ok and action.epoch == self.core.epoch:
            # Every member may still answer (the all-reduce failed on a lost connection, a
            # timeout): nothing else would end this epoch, and the slot would stay stuck. A new
            # incarnation makes a new epoch everywhere, which retries the round with every
            # contribution kept; members that did apply the result lead it, and those behind
            # download their state.
            self.failed_rounds += 1
            assert self._tg is not None
            self._tg.start_soon(self._retry, self.failed_rounds)
        self._handle(self.core.reduce_done(action.epoch, action.index, ok))

    def _blame(self, culprits: set[PeerID]) -> None:
        """Count the failed gradient phases in a row that name each member; one named in
        ``_MAX_ROUND_FAILURES`` of them is left out of the view for ``10 * round_timeout``
        although it answers messages (else every retry would fail the same way, forever)."""
        failures = {p: self._round_failures.get(p, 0) + 1 for p in culprits}
        self._round_failures = failures
        for peer, count in list(failures.items()):
            if count >= _MAX_ROUND_FAILURES:
                seconds = 10 * self.core.round_timeout
                logger.warning(
                    "cohort %s: %s failed %d gradient phases in a row: left out for %.0f s",
                    self.name,
                    peer.short(),
                    count,
                    seconds,
                )
                self.group.exclude(peer, seconds)
                del self._round_failures[peer]

    async def _retry(self, failed: int) -> None:
        """Retry a failed gradient phase in a new epoch: at once the first time, then after
        0.5, 1, 2, ... s (up to ``round_timeout``) while phases keep failing."""
        if failed > 1:
            await anyio.sleep(min(0.5 * 2 ** (failed - 2), self.core.round_timeout))
        await self.group.rejoin()
        self._wake.set()

    def _apply(self, action: ApplyResult) -> None:
        import torch

        epoch = self.core.epoch
        assert epoch is not None
        result = None if action.zero else self._results.pop((epoch, action.index))
        for buf in self._slots[action.slot]:
            buf.fill(0)
        views = self._views(result) if result is not None else None

        def write() -> None:
            with torch.no_grad():
                for i, p in enumerate(self.parameters):
                    if views is None:
                        if p.grad is not None:
                            p.grad.zero_()
                        continue
                    value = torch.from_numpy(views[i].reshape(p.shape)).to(p.device)
                    if p.grad is None:
                        p.grad = value.clone()
                    else:
                        p.grad.copy_(value)

        self._write(_Write("result", write))

    # -- state ---------------------------------------------------------------------------------

    async def _provide_state(self, *, fresh: bool = False) -> tuple[Any, list[torch.Tensor]]:
        """What a donor serves: the state the user set at the current version (waiting up to
        ``state_timeout`` for :meth:`set_state`, which :meth:`wants_state` asks for); with
        ``fresh``, one set after this request came (a regular update: buffers and the user
        state change without a new version)."""
        asked = self._state_sets
        # (a state set while a result is unread waits for the next one: the election counted
        # that result in, core.state_id())
        while (
            self._user_state is None
            or self._user_state[0] != self.core.state_id()
            or (fresh and self._state_sets == asked)
        ):
            self.core.state_requested()
            self._providers += 1
            self._state_wanted = True
            self._signal()
            try:
                with anyio.fail_after(self.state_timeout):
                    await self._state_set.wait()
            finally:
                self._providers -= 1
                if not self._providers:
                    self._state_wanted = False
        (version, lineage), skeleton, tensors = self._user_state
        metadata = {
            "version": version,
            "lineage": lineage,
            "skeleton": skeleton,
            "parameters": len(self.parameters),
            "buffers": len(self.buffers),
        }
        return metadata, list(tensors)

    async def _download(self, request: RequestState) -> None:
        """Download the state from the donors of the latest request until connected (a new
        epoch's request replaces the one this loop started with)."""
        from swarmavg.aio.state import DEFAULT_MAX_STATE_SIZE, Donor, load_state_from

        self._state_request = request
        if self._downloading:
            return
        self._downloading = True
        try:
            while not self._closed and self._state_request is not None:
                request, epoch = self._state_request, self.core.epoch
                donors: list[Donor] = []
                for name in request.donors[: self.state_donors]:
                    peer = PeerID.from_string(name)
                    address = self.group.addresses.get(peer)
                    if address is not None:
                        donors.append((peer, address, 0.0))
                state = None
                with anyio.move_on_after(self.state_timeout):
                    state = await load_state_from(
                        self.dht.node,
                        f"{self.name}.acc",
                        donors,
                        chunk_timeout=self.state_timeout,
                        header_timeout=self.state_timeout,
                        max_bytes=DEFAULT_MAX_STATE_SIZE,
                        max_donors=self.state_donors,
                    )
                if (
                    state is not None
                    and self.core.epoch == epoch
                    and self._state_request is request
                ):
                    metadata, tensors = state[0], list(state[1])
                    try:
                        self._load(metadata, tensors, epoch, request.version)
                        self._state_request = None
                        return
                    except StateDownloadFailed as exc:
                        logger.warning("cohort %s: refused a state: %s", self.name, exc)
                if self._state_request is request:
                    await anyio.sleep(1.0)
        finally:
            self._downloading = False

    def _load(
        self, metadata: object, tensors: list[torch.Tensor], epoch: bytes | None, expected: int
    ) -> None:

        version, lineage, own, user = self._check_state(metadata, tensors)
        if version != expected:
            raise StateDownloadFailed(
                f"the donor served version {version}, the election chose {expected}"
            )

        def then() -> None:
            self._new_state = user
            self._has_new_state = True
            if self._queued is not None:
                self._queued = None  # (computed on the model this state replaced)
                logger.info("cohort %s: a queued contribution was dropped (new state)", self.name)
            if self.core.epoch == epoch:
                self._handle(self.core.state_loaded(version, lineage))
            else:
                # the model is now that one, but the new epoch elected with what we held
                # before: a new incarnation makes an epoch whose election knows it
                self.core.model_replaced(version, lineage)
                assert self._tg is not None
                self._tg.start_soon(self.group.rejoin)
            self._sharer.priority = float(version)
            logger.info("cohort %s: loaded the state of version %d", self.name, version)

        self._write(_Write("state", _copier(own, tensors), then))

    def _check_state(
        self, metadata: object, tensors: list[torch.Tensor]
    ) -> tuple[int, bytes, list[torch.Tensor], object]:
        """A downloaded state's version, lineage, this model's tensors it replaces, and the
        user state.

        :raises StateDownloadFailed: its metadata or layout is not this model's.
        """
        if not isinstance(metadata, dict):
            raise StateDownloadFailed("the metadata is not a map")
        version, skeleton = metadata.get("version"), metadata.get("skeleton")
        lineage = metadata.get("lineage")
        n_params, n_buffers = metadata.get("parameters"), metadata.get("buffers")
        if (
            isinstance(version, bool)
            or not isinstance(version, int)
            or not 0 <= version < 1 << 63
            or not isinstance(skeleton, bytes)
            or not isinstance(lineage, bytes)
            or len(lineage) > EPOCH_SIZE
            or n_params != len(self.parameters)
            or n_buffers != len(self.buffers)
            or len(tensors) < n_params + n_buffers
        ):
            raise StateDownloadFailed("the state's layout is not this model's")
        own = self.parameters + self.buffers
        _check_layout(own, tensors)
        user = join_state(skeleton, tensors[len(own) :], to_array=lambda t: t.numpy())
        return version, lineage, own, user

    # -- regular updates from the leader (moolib's) ----------------------------------------------

    async def _provide_fresh_state(self) -> tuple[Any, list[torch.Tensor]]:
        """What the leader serves under ``<name>.reg`` (regular updates): a state the user
        set after the request came."""
        if not self.core.is_leader():
            raise ValueError("this member does not lead the cohort")
        return await self._provide_state(fresh=True)

    async def _provide_buffers(self) -> tuple[Any, list[torch.Tensor]]:
        """What the leader serves under ``<name>.buf``: copies of its buffers as they are."""
        if not self.core.is_leader():
            raise ValueError("this member does not lead the cohort")
        return {"buffers": len(self.buffers)}, self._copy_model()[len(self.parameters) :]

    async def _sync_loop(self) -> None:
        """Every member but the leader copies the leader's buffers every
        ``buffer_sync_period`` seconds and its whole state every ``state_sync_period`` seconds
        (moolib's regular updates, pulled rather than pushed: a member takes them when it is
        ready for them)."""
        periods = {"buffers": self.buffer_sync_period if self.buffers else None}
        periods["state"] = self.state_sync_period
        due = {kind: anyio.current_time() + p for kind, p in periods.items() if p is not None}
        while due:
            kind = min(due, key=due.__getitem__)
            await anyio.sleep(max(due[kind] - anyio.current_time(), 0.0))
            period = periods[kind]
            assert period is not None
            due[kind] = anyio.current_time() + period
            leader, epoch = self.core.leader, self.core.epoch
            if not self.core.connected() or leader is None or leader == self.core.me:
                continue
            peer = PeerID.from_string(leader)
            address = self.group.addresses.get(peer)
            if address is None:
                continue
            try:
                state = await self._fetch(kind, peer, address)
                if state is None:
                    logger.info("cohort %s: no %s from the leader this time", self.name, kind)
                elif kind == "buffers":
                    self._take_buffers(state[0], list(state[1]), epoch)
                else:
                    self._take_regular(state[0], list(state[1]), epoch)
            except StateDownloadFailed as exc:
                logger.warning("cohort %s: refused the leader's %s: %s", self.name, kind, exc)

    async def _fetch(self, kind: str, peer: PeerID, address: Address) -> Any:
        from swarmavg.aio.state import DEFAULT_MAX_STATE_SIZE, load_state_from

        prefix = f"{self.name}.{'buf' if kind == 'buffers' else 'reg'}"
        with anyio.move_on_after(self.state_timeout):
            return await load_state_from(
                self.dht.node,
                prefix,
                [(peer, address, 0.0)],
                chunk_timeout=self.state_timeout,
                header_timeout=self.state_timeout,
                max_bytes=DEFAULT_MAX_STATE_SIZE,
                max_donors=1,
            )
        return None

    def _take_buffers(
        self, metadata: object, tensors: list[torch.Tensor], epoch: bytes | None
    ) -> None:

        if not isinstance(metadata, dict) or metadata.get("buffers") != len(self.buffers):
            raise StateDownloadFailed("the leader's buffers are not this model's")
        _check_layout(self.buffers, tensors)
        buffers = self.buffers

        def valid() -> bool:
            return self.core.epoch == epoch and self.core.connected() and not self.core.is_leader()

        def then() -> None:
            self.syncs["buffers"] += 1

        self._write(_Write("sync", _copier(buffers, tensors), then, valid))

    def _take_regular(
        self, metadata: object, tensors: list[torch.Tensor], epoch: bytes | None
    ) -> None:

        version, lineage, own, user = self._check_state(metadata, tensors)

        def valid() -> bool:
            # (a member whose model is another one, or that the user is about to step with an
            # unread result, keeps its own: it is overwritten only by the same model)
            core = self.core
            return (
                core.epoch == epoch
                and core.connected()
                and not core.has_gradients()
                and (core.model_version, core.lineage) == (version, lineage)
            )

        def then() -> None:
            self._new_state = user
            self._has_new_state = True
            self.syncs["state"] += 1
            logger.info(
                "cohort %s: took the leader's regular update (version %d)", self.name, version
            )

        self._write(_Write("sync", _copier(own, tensors), then, valid))


def _lost(exc: BaseException) -> bool:
    """Whether a call failed on the way (the peer unreachable, the connection reset or cut
    mid-call, no answer in time) rather than by the peer's refusal: only an answer says that
    the peer is alive."""
    if isinstance(exc, RemoteError):
        return exc.code == "interrupted"
    return isinstance(exc, TransportError | OSError | TimeoutError)


def _part_size(numel: int, group_size: int) -> int:
    """Elements per all-reduce part: about a quarter of a member's span, a power of two
    between 256 Ki and 4 Mi (as the averager's automatic size: the same for every member)."""
    quarter_span = max(1, numel // (4 * group_size))
    return min(max(1 << (quarter_span - 1).bit_length(), 1 << 18), 1 << 22)


def _copier(own: list[torch.Tensor], tensors: list[torch.Tensor]) -> Callable[[], None]:
    """A write that copies ``tensors`` into ``own`` (pairwise; extra ``tensors`` are the user
    state's)."""

    def write() -> None:
        import torch

        with torch.no_grad():
            for mine, theirs in zip(own, tensors, strict=False):
                mine.copy_(theirs)

    return write


def _check_layout(own: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    for mine, theirs in zip(own, tensors, strict=False):
        if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
            raise StateDownloadFailed("a tensor's shape or dtype is not this model's")


def _copy_user_tensors(tensors: list[Any]) -> list[torch.Tensor]:
    """CPU copies of the user state's tensors and arrays (for :meth:`Accumulator.set_state`)."""
    return [
        _array_tensor(t) if isinstance(t, np.ndarray) else t.detach().to("cpu", copy=True)
        for t in tensors
    ]


def _array_tensor(array: npt.NDArray[Any]) -> Any:
    import torch

    return torch.from_numpy(np.array(array, copy=True))


_registries: weakref.WeakKeyDictionary[Node, dict[str, Accumulator]] = weakref.WeakKeyDictionary()


def _registry(dht: DHT) -> dict[str, Accumulator]:
    """The node's accumulators by cohort name; registers ``acc.msg`` on first use (a message
    goes to the accumulator whose epoch it names, else to the only one)."""
    node = dht.node
    registry = _registries.get(node)
    if registry is None:
        found: dict[str, Accumulator] = {}
        registry = _registries[node] = found

        async def serve(message: Message, ctx: CallContext) -> AccAck:
            epoch = getattr(message, "epoch", None)
            target = next((a for a in found.values() if a.core.epoch == epoch), None)
            if target is None and len(found) == 1:
                target = next(iter(found.values()))
            if target is None:
                return AccAck(b"")
            return await target._serve(message, ctx)

        node.rpc.register(METHOD, serve, request_type=Message)
    return registry
