"""``swarmavg.DHT``: the DHT for synchronous code, with hivemind's names and semantics.

The DHT runs on swarmavg's event-loop thread (see :mod:`swarmavg.sync`), in this process:
calls cost a hop between threads, not a round trip to another process. Every method can block
for its result or, with ``return_future=True``, return a :class:`~swarmavg.sync.TaskHandle`
(a :class:`concurrent.futures.Future` that can also be awaited and cancelled).

::

    with swarmavg.DHT(initial_peers=[...], host="0.0.0.0") as dht:
        print(dht.get_visible_maddrs())          # give these to other peers
        dht.store("key", {"any": "msgpack", "or": ("a", "tuple")}, swarmavg.get_dht_time() + 60)
        value, expiration = dht.get("key")
        dht.store("votes", "yes", swarmavg.get_dht_time() + 60, subkey="alice")
        votes, latest_expiration = dht.get("votes", latest=True)  # {"alice": ("yes", exp.)}
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, Self, TypeVar, overload

from swarmavg.address import Address
from swarmavg.aio.dht import DHTNode, GetResult
from swarmavg.aio.dht_facade import DHT as AsyncDHT
from swarmavg.identity import Identity, PeerID
from swarmavg.proto.dht_validation import RecordValidator
from swarmavg.sync import TaskHandle, call, in_loop_thread, run_sync, start_soon
from swarmavg.sync._loop import shut_down_at_exit

__all__ = ["DHT"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class DHT:
    """A DHT peer, for synchronous code (hivemind's ``hivemind.DHT``).

    Takes the arguments of :class:`swarmavg.aio.DHT` (``initial_peers``, ``client_mode``,
    ``transport``, ``host``, ``port``, ``identity``, ``host_maddrs``, ``identity_path``,
    ``announce_maddrs``, ``transport_options``, ``record_validators`` and the DHT options),
    and:

    :param start: start at once (otherwise call :meth:`run_in_background`).
    :param await_ready: with ``start``, block until the DHT has bootstrapped (and raise its
        error, e.g. :class:`~swarmavg.ConnectError` if no initial peer answered).
    :param startup_timeout: seconds :meth:`run_in_background` waits for readiness.

    Use it as a context manager, or call :meth:`shutdown` when done (interpreter exit also
    stops it).
    """

    def __init__(
        self,
        initial_peers: Sequence[str | Address] = (),
        *,
        start: bool = True,
        await_ready: bool = True,
        startup_timeout: float | None = 60.0,
        client_mode: bool = False,
        transport: str = "tcp",
        host: str = "127.0.0.1",
        port: int = 0,
        identity: Identity | str | os.PathLike[str] | None = None,
        host_maddrs: Sequence[str | Address] | None = None,
        identity_path: str | os.PathLike[str] | None = None,
        announce_maddrs: Sequence[str | Address] | None = None,
        record_validators: Sequence[RecordValidator] = (),
        **options: Any,
    ) -> None:
        for name, flag in (("start", start), ("await_ready", await_ready)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, not {flag!r:.64}")
        if startup_timeout is not None and (
            isinstance(startup_timeout, bool)
            or not isinstance(startup_timeout, int | float)
            or not startup_timeout > 0
        ):
            raise ValueError(
                f"startup_timeout must be a positive number of seconds or None, "
                f"not {startup_timeout!r:.64}"
            )
        self._startup_timeout = startup_timeout
        self._lock = threading.Lock()
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._serving: TaskHandle[None] | None = None
        self._shut_down = False

        async def create() -> AsyncDHT:
            return AsyncDHT(
                initial_peers,
                client_mode=client_mode,
                transport=transport,
                host=host,
                port=port,
                identity=identity,
                host_maddrs=host_maddrs,
                identity_path=identity_path,
                announce_maddrs=announce_maddrs,
                record_validators=record_validators,
                **options,
            )

        self._dht = run_sync(create)
        if start:
            self.run_in_background(await_ready=await_ready)

    # -- lifecycle -------------------------------------------------------------------------------

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """Start the DHT on the event-loop thread; with ``await_ready``, block until it is ready
        (``timeout``: seconds, default ``startup_timeout``) and raise what failed."""
        with self._lock:
            if self._shut_down:
                raise RuntimeError("this DHT was shut down")
            if self._serving is None:
                self._serving = start_soon(self._serve)
                shut_down_at_exit(self)
        if await_ready:
            self.wait_until_ready(timeout)

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Block until the DHT has bootstrapped; raise what made it fail.

        :raises TimeoutError: not ready within ``timeout`` (default ``startup_timeout``)
            seconds; the DHT is shut down.
        """
        timeout = self._startup_timeout if timeout is None else timeout
        try:
            self._ready.result(timeout)
        except concurrent.futures.TimeoutError:
            self.shutdown()
            raise TimeoutError(f"the DHT was not ready within {timeout} s") from None

    async def _serve(self) -> None:
        try:
            async with self._dht:
                self._ready.set_result(None)
                await self._dht.wait_closed()
        except BaseException as exc:
            if not self._ready.done():
                self._ready.set_exception(exc)
            raise

    def is_alive(self) -> bool:
        """Whether the DHT is running (started and not shut down)."""
        return (
            self._ready.done()
            and self._ready.exception() is None
            and self._serving is not None
            and not self._serving.done()
        )

    @property
    def ready(self) -> concurrent.futures.Future[None]:
        """A future that completes when the DHT is ready (hivemind's ``dht.ready``)."""
        return self._ready

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the DHT and close its node, its connections and listeners. Idempotent.

        Called on the event-loop thread (in a :meth:`run_coroutine` function), it starts the
        shutdown and returns without waiting for it."""
        with self._lock:
            first, self._shut_down = not self._shut_down, True
            serving = self._serving
        if in_loop_thread():  # from a coroutine of ours (run_coroutine): close, don't wait
            if first:
                start_soon(self._dht.aclose)
            return
        if first:
            try:
                run_sync(self._dht.aclose, timeout=timeout)
            except RuntimeError:
                return  # the event loop is gone (interpreter exit): nothing left to close
        if serving is not None:  # a later call waits for the end too
            try:
                serving.result(timeout)
            except concurrent.futures.CancelledError:
                pass
            except Exception:
                logger.debug("the DHT ended with an error", exc_info=True)

    def __enter__(self) -> Self:
        if self._serving is None:
            self.run_in_background(await_ready=True)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- properties ------------------------------------------------------------------------------

    @property
    def peer_id(self) -> PeerID:
        return self._dht.peer_id

    @property
    def client_mode(self) -> bool:
        return self._dht.client_mode

    def get_visible_maddrs(self, latest: bool = False) -> list[str]:
        """The addresses (multiaddrs) other peers can pass as ``initial_peers`` to reach us;
        never a wildcard such as 0.0.0.0."""
        self._check_running()
        return self._dht.get_visible_maddrs(latest=latest)

    def _check_running(self) -> None:
        if self._shut_down:
            raise RuntimeError("this DHT was shut down")
        if not self._ready.done():
            raise RuntimeError("this DHT is not started: pass start=True or run_in_background()")
        self._ready.result()

    # -- operations ------------------------------------------------------------------------------

    @overload
    def store(
        self,
        key: Any,
        value: Any,
        expiration_time: float,
        subkey: Any = None,
        return_future: Literal[False] = False,
    ) -> bool: ...

    @overload
    def store(
        self,
        key: Any,
        value: Any,
        expiration_time: float,
        subkey: Any = None,
        *,
        return_future: Literal[True],
    ) -> TaskHandle[bool]: ...

    def store(
        self,
        key: Any,
        value: Any,
        expiration_time: float,
        subkey: Any = None,
        return_future: bool = False,
    ) -> bool | TaskHandle[bool]:
        """Store ``value`` under ``key`` (and ``subkey``) until ``expiration_time`` (DHT time);
        whether at least one peer accepted it. See :meth:`swarmavg.aio.DHT.store`."""
        self._check_running()
        return call(self._dht.store, key, value, expiration_time, subkey, wait=not return_future)

    @overload
    def get(
        self, key: Any, latest: bool = False, return_future: Literal[False] = False
    ) -> GetResult: ...

    @overload
    def get(
        self, key: Any, latest: bool = False, *, return_future: Literal[True]
    ) -> TaskHandle[GetResult]: ...

    def get(
        self, key: Any, latest: bool = False, return_future: bool = False
    ) -> GetResult | TaskHandle[GetResult]:
        """The value under ``key`` as ``ValueWithExpiration(value, expiration_time)``, or
        ``None`` if nothing live is stored under it; for a dictionary key (stored with
        subkeys), ``value`` is ``{subkey: ValueWithExpiration(value, expiration_time)}`` and
        ``expiration_time`` the latest of theirs, as in hivemind: ``value, expiration =
        dht.get(key)`` works for both. See :meth:`swarmavg.aio.DHT.get`."""
        self._check_running()
        return call(self._dht.get, key, latest, wait=not return_future)

    @overload
    def run_coroutine(
        self,
        fn: Callable[[DHT, DHTNode], Awaitable[T]],
        return_future: Literal[False] = False,
    ) -> T: ...

    @overload
    def run_coroutine(
        self, fn: Callable[[DHT, DHTNode], Awaitable[T]], return_future: Literal[True]
    ) -> TaskHandle[T]: ...

    def run_coroutine(
        self, fn: Callable[[DHT, DHTNode], Awaitable[T]], return_future: bool = False
    ) -> T | TaskHandle[T]:
        """Run ``await fn(dht, node)`` on the event-loop thread (``dht`` is this object,
        ``node`` the :class:`~swarmavg.aio.dht.DHTNode`) and return its result."""
        self._check_running()

        async def run() -> T:
            return await fn(self, self._dht.dht_node)

        return call(run, wait=not return_future)

    def __repr__(self) -> str:
        return f"<swarmavg.DHT {self.peer_id}>"
