"""``swarmavg.Accumulator`` and ``swarmavg.Group``: moolib's accumulator for synchronous training
loops (see ``docs/guides/accumulator.md`` and ``docs/design/accumulator.md``).

They run a :class:`swarmavg.aio.accumulator.Accumulator` (and its
:class:`~swarmavg.aio.accumulator.Group`) on swarmavg's event-loop thread. As in moolib, the
network work goes on in the background and the caller's tensors change only in the caller's
thread: a result is written into ``.grad``, and a downloaded state into the parameters and
buffers, inside :meth:`Accumulator.update`; ``reduce_gradients`` reads and zeroes ``.grad``,
``zero_gradients`` zeroes it, ``set_state`` copies the model. The predicates
(``connected()``, ``wants_gradients()``, ...) are as of the last call::

    accumulator = swarmavg.Accumulator("bar", model.parameters(), model.buffers())
    accumulator.connect(ADDRESS)          # any member's (or a swarmavg dht node's) address
    while True:
        accumulator.update()
        if not accumulator.connected():
            time.sleep(0.25)
            continue
        ...                               # moolib's loop, unchanged
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Self

import anyio

from swarmavg.address import Address
from swarmavg.sync import TaskHandle, run_sync, start_soon
from swarmavg.sync._loop import shut_down_at_exit

if TYPE_CHECKING:
    import torch

    from swarmavg.aio.accumulator import Accumulator as AsyncAccumulator
    from swarmavg.aio.accumulator import Group as AsyncGroup
    from swarmavg.dht import DHT

__all__ = ["Accumulator", "Group"]

logger = logging.getLogger(__name__)

#: seconds between tries of connect(), doubling up to the last
_CONNECT_BACKOFF = (0.5, 30.0)


def _check_dht(dht: object) -> DHT:
    from swarmavg.dht import DHT

    if not isinstance(dht, DHT):
        hint = ""
        if type(dht).__module__ == "swarmavg.aio.dht_facade":
            hint = " (swarmavg.aio.DHT goes with swarmavg.aio.accumulator)"
        raise TypeError(f"dht must be a swarmavg.DHT, not {type(dht).__name__}{hint}")
    if not dht.is_alive():
        raise RuntimeError("the DHT is not running: start it first (swarmavg.DHT(...) starts)")
    return dht


class Group:
    """A named cohort in the DHT (moolib's ``Group``): this member's record under
    ``<name>.group`` and the view of the others'. The accumulator that takes it (``group=``)
    reads it by itself; :meth:`update` is there for moolib's loop (a read at most every
    ``refresh_period``).

    :param name: the cohort's name (every member's must be the same).
    :param dht: a running :class:`swarmavg.DHT`.
    :param member_ttl: seconds a member's record lives unless renewed (a member that dies
        leaves the view after this long at most, or at once when it does not answer).
    :param refresh_period: seconds between reads of the records.
    :raises TypeError: an argument of the wrong type.
    :raises ValueError: a bad argument (named).
    :raises RuntimeError: the DHT is not running.
    """

    def __init__(
        self,
        name: str,
        dht: DHT,
        *,
        member_ttl: float = 20.0,
        refresh_period: float = 1.0,
    ) -> None:
        from swarmavg.aio.accumulator import Group as AsyncGroup

        self.dht = _check_dht(dht)

        async def create() -> AsyncGroup:
            group = AsyncGroup(name, dht._dht, member_ttl=member_ttl, refresh_period=refresh_period)
            await group.__aenter__()
            return group

        self._group = run_sync(create)
        self._closed = False
        shut_down_at_exit(self)

    @property
    def name(self) -> str:
        return self._group.name

    def update(self) -> None:
        """Read the members' records if ``refresh_period`` passed since the last read."""
        self._check_open()
        run_sync(self._group.update)

    def members(self) -> list[str]:
        """The view's members (PeerID texts, sorted), this one included once it is in."""
        return [str(p) for p in self._group.members]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this group was shut down")

    def shutdown(self) -> None:
        """Leave the cohort (a tombstone in the DHT). Idempotent."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(RuntimeError):  # (the event loop is gone: exit)
                run_sync(self._group.aclose)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


class Accumulator:
    """moolib's ``Accumulator``: every member of a cohort calls :meth:`update` in its loop,
    contributes its gradients (:meth:`reduce_gradients`) or passes (:meth:`skip_gradients`)
    while :meth:`wants_gradients`, and steps with the result while :meth:`has_gradients`; the
    member with the greatest model version leads and hands its state to joiners.

    :param name: the cohort's name (the default group's).
    :param parameters: the model's parameters (floating-point tensors; e.g.
        ``model.parameters()``).
    :param buffers: the model's buffers (they travel with the state).
    :param group: a :class:`Group` on the same DHT (by default the accumulator makes its own,
        named ``name``).
    :param dht: a running :class:`swarmavg.DHT` (by default ``group``'s, or one the accumulator
        starts on loopback with ``dht_options``; join a swarm with :meth:`connect`).
    :param dht_options: keyword arguments for the accumulator's own DHT (e.g. ``host``,
        ``port``, ``announce_maddrs``, ``initial_peers``).
    :param options: those of :class:`swarmavg.aio.accumulator.Accumulator`:
        ``virtual_batch_size``, ``parallel_gradients``, ``weighting`` (``"contributions"``,
        moolib's: ``.grad`` is the mean over contributions; or ``"samples"``),
        ``model_version``, ``round_timeout``, ``state_timeout``, ``state_donors``,
        ``refresh_period``, ``buffer_sync_period`` (the leader's buffers copied into every
        member's, 12 s; ``None``: never), ``state_sync_period`` (moolib's regular update of
        the whole state, 600 s; ``None``: never).
    :raises TypeError: a parameter or buffer is not a tensor, or a parameter not a floating
        point one (named by index); ``dht`` or ``group`` of the wrong type.
    :raises ValueError: another bad argument (named).
    """

    def __init__(
        self,
        name: str,
        parameters: Iterable[torch.Tensor],
        buffers: Iterable[torch.Tensor] = (),
        group: Group | None = None,
        *,
        dht: DHT | None = None,
        dht_options: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        from swarmavg.aio.accumulator import Accumulator as AsyncAccumulator
        from swarmavg.dht import DHT

        if "_deferred" in options:
            raise TypeError("Accumulator() got an unexpected keyword argument '_deferred'")
        if group is not None and not isinstance(group, Group):
            raise TypeError(f"group must be a swarmavg.Group, not {type(group).__name__}")
        if group is not None:
            if dht is not None and dht is not group.dht:
                raise ValueError("dht must be the group's (or left out)")
            dht = group.dht
        self._own_dht: DHT | None = None
        if dht is None:
            self._own_dht = dht = DHT(**dict(dht_options or {}))
        elif dht_options is not None:
            raise ValueError("dht_options is for the accumulator's own DHT: pass dht or it")
        try:
            self.dht = _check_dht(dht)
            parameters, buffers = list(parameters), list(buffers)
            inner_group = group._group if group is not None else None
            given_dht = dht

            async def create() -> AsyncAccumulator:
                acc = AsyncAccumulator(
                    name,
                    parameters,
                    buffers,
                    inner_group,
                    dht=given_dht._dht,
                    _deferred=True,
                    **options,
                )
                await acc.__aenter__()
                return acc

            self._acc = run_sync(create)
        except BaseException:
            if self._own_dht is not None:
                self._own_dht.shutdown()
            raise
        self.group = group
        self._closed = False
        self._connecting: TaskHandle[None] | None = None
        self._new_state: object = None
        self._has_new_state = False
        shut_down_at_exit(self)
        self._snap: dict[str, Any] = run_sync(self._snapshot)

    # -- the network -----------------------------------------------------------------------

    def connect(self, address: str | Address) -> None:
        """Join the swarm through ``address`` (any member's, or a ``swarmavg dht`` node's; with
        its PeerID, as ``get_visible_maddrs()`` prints it). Non-blocking: it is tried in the
        background until it answers, with a backoff from 0.5 to 30 s; a second call replaces
        the first.

        :raises ValueError: ``address`` does not parse or names no PeerID.
        """
        self._check_open()
        parsed = Address.parse(address) if isinstance(address, str) else address
        if not isinstance(parsed, Address):
            raise TypeError(f"address must be a str, not {type(address).__name__}")
        if parsed.peer_id is None:
            raise ValueError(f"address {parsed} names no PeerID (/p/<peer-id>)")
        if self._connecting is not None:
            self._connecting.cancel()
        self._connecting = start_soon(self._connect, parsed)

    async def _connect(self, address: Address) -> None:
        from swarmavg.errors import SwarmError

        delay, longest = _CONNECT_BACKOFF
        while True:
            try:
                await self._acc.dht.dht_node.bootstrap([address])
            except (SwarmError, OSError, TimeoutError) as exc:
                logger.info("could not connect to %s (again in %.1f s): %s", address, delay, exc)
                await anyio.sleep(delay)
                delay = min(delay * 2, longest)
                continue
            logger.info("connected to the swarm through %s", address)
            self._acc.group.refresh_soon()
            return

    def update(self) -> None:
        """Bring the network's work in: write a result into ``.grad`` and a downloaded state
        into the parameters and buffers (in this thread), and refresh the predicates."""
        self._check_open()
        writes = run_sync(self._take_writes)
        for write in writes:
            write.write()
        self._snap = run_sync(self._writes_done, writes)

    async def _take_writes(self) -> list[Any]:
        return self._acc._take_writes()

    async def _writes_done(self, writes: list[Any]) -> dict[str, Any]:
        self._acc._writes_done(writes)
        if self._acc.has_new_state():
            self._new_state = self._acc.state()
            self._has_new_state = True
        return self._acc._snapshot()

    async def _snapshot(self) -> dict[str, Any]:
        return self._acc._snapshot()

    # -- predicates, as of the last call ------------------------------------------------------

    def connected(self) -> bool:
        """In the cohort, the leader elected, and holding its state (or leading)."""
        return bool(self._snap["connected"])

    def wants_state(self) -> bool:
        """A joiner waits for this member's state: answer with :meth:`set_state` (false while
        a result is unread: the state to serve is the model stepped with it)."""
        return bool(self._snap["wants_state"])

    def has_new_state(self) -> bool:
        """A state was loaded into the model (by :meth:`update`) since :meth:`state` was last
        called."""
        return self._has_new_state

    def state(self) -> object:
        """The user state that came with the last loaded state (clears :meth:`has_new_state`);
        ``None`` before any."""
        self._has_new_state = False
        return self._new_state

    def wants_gradients(self) -> bool:
        """The next :meth:`reduce_gradients` or :meth:`skip_gradients` is allowed."""
        return bool(self._snap["wants_gradients"])

    def has_gradients(self) -> bool:
        """A result is in ``.grad`` (until :meth:`zero_gradients`)."""
        return bool(self._snap["has_gradients"])

    def model_version(self) -> int:
        """Results the model was stepped with: +1 at each :meth:`zero_gradients` after a
        result (moolib's)."""
        return int(self._snap["model_version"])

    def get_leader(self) -> str | None:
        """The leader's name (its PeerID text), or ``None`` while electing."""
        leader: str | None = self._snap["leader"]
        return leader

    def is_leader(self) -> bool:
        return bool(self._snap["is_leader"])

    def get_gradient_stats(self) -> dict[str, int]:
        """The last result's ``num_gradients``, ``num_skipped`` and ``batch_size``, summed over
        the cohort (the same on every member)."""
        return dict(self._snap["stats"])

    # -- the user's calls -------------------------------------------------------------------

    def set_state(self, state: object) -> None:
        """The user state to hand to joiners, with a copy of the parameters and buffers as they
        are now (call it while :meth:`wants_state`). ``state`` holds dicts, lists, tuples, str,
        int, float, bool, None, bytes, tensors and numpy arrays (an optimizer's
        ``state_dict()`` fits); it is checked before anything is sent.

        :raises TypeError: an argument of the wrong type.

        :raises ValueError: ``state`` holds something that cannot travel (named by
            its path from ``state``, e.g. ``state['optimizer']['param_groups'][0]['fn']``).
        """
        from swarmavg.aio.accumulator import _copy_user_tensors, tensor_dtype
        from swarmavg.proto.accumulator_state import split_state

        self._check_open()
        skeleton, tensors = split_state(state, tensor_dtype)
        copies = self._acc._copy_model() + _copy_user_tensors(tensors)

        async def store() -> dict[str, Any]:
            self._acc._store_state(skeleton, copies)
            return self._acc._snapshot()

        self._snap = run_sync(store)

    def reduce_gradients(self, batch_size: int) -> None:
        """Contribute the parameters' ``.grad`` for ``batch_size`` samples (then zeroed); the
        cohort's result comes in a later :meth:`update` (:meth:`has_gradients`).

        :raises RuntimeError: :meth:`wants_gradients` is false (``.grad`` is left as it is).
        :raises TypeError: an argument of the wrong type.
        :raises ValueError: ``batch_size`` is not an int >= 1.
        """
        self._check_open()
        from swarmavg.proto.accumulator import _check_int

        batch_size = _check_int("batch_size", batch_size, 1)
        self._check_wants_gradients("reduce_gradients")
        grads = self._acc._read_grads()

        async def contribute() -> dict[str, Any]:
            self._acc._contribute_nowait(batch_size, grads)
            return self._acc._snapshot()

        self._snap = run_sync(contribute)
        self._acc._zero_grads()

    def skip_gradients(self) -> None:
        """Take part in the next count without a gradient.

        :raises RuntimeError: :meth:`wants_gradients` is false.
        """
        self._check_open()
        self._check_wants_gradients("skip_gradients")

        async def skip() -> dict[str, Any]:
            self._acc._contribute_nowait(0, [])
            return self._acc._snapshot()

        self._snap = run_sync(skip)

    def zero_gradients(self) -> None:
        """Zero ``.grad``; after a result (:meth:`has_gradients`), the model version goes up by
        one and the next result may come."""
        self._check_open()
        self._acc._zero_grads()

        async def zero() -> dict[str, Any]:
            self._acc._zero_result()
            return self._acc._snapshot()

        self._snap = run_sync(zero)

    def set_model_version(self, n: int) -> None:
        """Set the model version (a restored checkpoint): the greatest version leads at the next
        election and the others download its state.

        :raises TypeError: an argument of the wrong type.

        :raises ValueError: not an int in ``[0, 2**63)``.
        """
        self._call(self._acc.set_model_version, n)

    def set_virtual_batch_size(self, n: int) -> None:
        """The summed batch size a result needs at least (every member must use the same).

        :raises TypeError: an argument of the wrong type.

        :raises ValueError: not an int >= 1.
        """
        self._call(self._acc.set_virtual_batch_size, n)

    def set_parallel_gradients(self, n: int) -> None:
        """Use ``n`` slots: up to ``n`` contributions in flight, results up to ``n`` versions
        stale, applied in order.

        :raises TypeError: an argument of the wrong type.

        :raises ValueError: not an int >= 1.
        :raises RuntimeError: contributions are in flight (call it before the first one, or
            right after a result was read).
        """
        self._call(self._acc.set_parallel_gradients, n)

    def _call(self, fn: Any, value: int) -> None:
        self._check_open()

        async def run() -> dict[str, Any]:
            fn(value)
            return self._acc._snapshot()

        self._snap = run_sync(run)

    # -- lifecycle ---------------------------------------------------------------------------

    def _check_wants_gradients(self, what: str) -> None:
        """Misuse: the last :meth:`update` (or call) said :meth:`wants_gradients` is false. (As
        of then, as moolib's loop sees it: a cohort that changed since is no misuse, and the
        contribution waits for the next count.)"""
        if not self._snap["wants_gradients"]:
            raise RuntimeError(
                f"{what}() while wants_gradients() is false (as of the last update()): "
                + self._acc.core._why_not()
            )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this accumulator was shut down")

    def shutdown(self) -> None:
        """Leave the cohort (telling the members) and stop; the accumulator's own DHT too.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        with contextlib.suppress(RuntimeError):  # (the event loop is gone: exit)
            run_sync(self._acc.aclose)
        if self._own_dht is not None:
            self._own_dht.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
