"""The Node: one identity, its transports and listeners, and a pool of connections.

A Node is the composition root of a peer. The RPC layer, the DHT and averagers attach to a Node;
they open streams to other peers through it and register handlers for the streams peers open.

Theory of operation
-------------------
``async with Node(...)`` starts the transports needed for ``listen`` addresses, binds the
listeners and starts one task per listener in the node's task group. Every connection, accepted or
dialed, gets tasks that accept the streams the peer opens and run the stream handler on each
(the task that accepted a stream serves it, after starting another acceptor if none is left, so
concurrent streams each get a task; see :meth:`Node._serve_connection`), and the connection
enters the pool keyed by the peer's PeerID so later dials to that peer reuse it. Leaving the
``async with`` block (or :meth:`aclose`) cancels those tasks and closes every transport, which
closes every listener, connection and stream.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Coroutine, Mapping, Sequence
from contextlib import AsyncExitStack
from functools import partial
from typing import Any, Self

import anyio
import anyio.abc

from swarmavg._groups import sole_error
from swarmavg.abc import Connection, Stream, Transport
from swarmavg.address import Address
from swarmavg.aio.rpc import _REQUEST_FAILURES, RPC
from swarmavg.errors import ConnectError, SwarmError
from swarmavg.identity import Identity, PeerID
from swarmavg.transport import resolve_transport

__all__ = ["BackgroundTask", "Node", "StreamHandler"]

logger = logging.getLogger(__name__)

#: Called with every stream a peer opens to us; runs in its own task and owns the stream.
StreamHandler = Callable[[Stream], Coroutine[Any, Any, None]]


class BackgroundTask:
    """A task started with :meth:`Node.spawn`: :meth:`cancel` stops it (idempotent)."""

    __slots__ = ("_cancelled", "_scope")

    def __init__(self) -> None:
        self._cancelled = False
        self._scope: anyio.CancelScope | None = None  # (made by the task itself)

    def cancel(self) -> None:
        self._cancelled = True
        if self._scope is not None:
            self._scope.cancel()

    @property
    def cancel_called(self) -> bool:
        """Whether :meth:`cancel` was called (as ``anyio.CancelScope.cancel_called``)."""
        return self._cancelled


def _name_of(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


class Node:
    """A peer: an identity, the transports it listens and dials with, and its connections.

    :param identity: an :class:`Identity`, or the path of a key file (created if missing), or
        ``None`` for a fresh random identity.
    :param listen: addresses to listen on, e.g. ``["tcp://0.0.0.0:0"]``; port 0 picks a port.
    :param transports: per-transport options, e.g. ``{"memory": {"network": net}}``, or ready
        :class:`Transport` instances bound to this node's identity. Transports for other schemes
        are created on first use with default options.
    :param stream_handler: called with each stream a peer opens, instead of the RPC layer
        (see :meth:`set_stream_handler`).
    :param max_concurrent_calls_per_peer: RPC calls one peer may run on this node at once.

    Remote procedure calls go through :attr:`rpc` (``node.rpc.register(...)``,
    ``await node.rpc.call(...)``).
    """

    def __init__(
        self,
        *,
        identity: Identity | str | os.PathLike[str] | None = None,
        listen: Sequence[str | Address] = (),
        transports: Mapping[str, Mapping[str, Any] | Transport] | Sequence[Transport] = (),
        stream_handler: StreamHandler | None = None,
        max_concurrent_calls_per_peer: int = 64,
    ) -> None:
        if identity is None:
            identity = Identity.generate()
        elif isinstance(identity, str | os.PathLike):
            identity = Identity.load_or_create(identity)
        elif not isinstance(identity, Identity):
            raise TypeError(f"identity must be an Identity or a key file path, not {identity!r}")
        self.identity = identity
        if isinstance(listen, str):
            raise TypeError("listen must be a list of addresses, not a single string")
        self._listen = [Address.parse(a) for a in listen]
        self._transport_options: dict[str, Mapping[str, Any]] = {}
        self._transports: dict[str, Transport] = {}
        items = (
            transports.items()
            if isinstance(transports, Mapping)
            else [(None, t) for t in transports]
        )
        for name, spec in items:
            if isinstance(spec, Transport):
                if spec.identity.peer_id != identity.peer_id:
                    raise ValueError(f"transport {spec.name!r} is bound to another identity")
                for scheme in spec.schemes:
                    self._transports[scheme] = spec
            elif isinstance(name, str) and isinstance(spec, Mapping):
                self._transport_options[name] = spec
            else:
                raise TypeError(f"transports[{name!r}] must be an options mapping or a Transport")
        self._handler = stream_handler
        #: The RPC layer: serves every incoming stream unless a stream handler replaces it.
        self.rpc = RPC(self, max_concurrent_calls_per_peer=max_concurrent_calls_per_peer)
        self._addresses: list[Address] = []
        self._pool: dict[PeerID, Connection] = {}
        self._dial_locks: dict[PeerID, anyio.Lock] = {}
        self._running: dict[int, anyio.Event] = {}  # id(transport) -> set once it has started
        self._stack: AsyncExitStack | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._scopes: set[anyio.CancelScope] = set()  # of our background tasks
        self._closed = False
        #: connections open per peer (the pooled one among them), and who wants to hear when a
        #: peer's last one ends
        self._connections: dict[PeerID, list[Connection]] = {}
        self._watchers: list[Callable[[PeerID], object]] = []

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Start the transports of the ``listen`` addresses and listen on them.

        :raises AddressInUse: a listen address's port is taken.
        :raises TransportNotFound: no transport is installed for a listen address's scheme.
        :raises TransportError: another reason a listen address cannot be listened on.
        """
        if self._stack is not None or self._closed:
            raise RuntimeError("a Node can be started once")
        try:
            async with AsyncExitStack() as stack:
                self._tg = await stack.enter_async_context(anyio.create_task_group())
                stack.push_async_callback(self._close_transports)
                for address in self._listen:
                    transport = await self._transport_for(address.scheme)
                    listener = await transport.listen(address)
                    self._addresses.append(listener.address)
                    self._tg.start_soon(
                        self._guarded,
                        self._accept_loop,
                        listener,
                        name=f"listen {listener.address}",
                    )
                    logger.info("node %s listening on %s", self.peer_id.short(), listener.address)
                self._stack = stack.pop_all()
        except BaseExceptionGroup as group:
            # (the task group wraps what failed: give the caller the exception itself)
            error = sole_error(group)
        else:
            return self
        self._closed = True
        raise error

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        try:
            return await self._exit(*exc_info)
        except BaseExceptionGroup as group:
            # The task group wraps what the ``async with`` body raised: give the caller their
            # own exception back (a ConnectError, not a group), or the one that failed.
            error = sole_error(group, exc_info[1])
        raise error

    async def _exit(self, *exc_info: Any) -> bool | None:
        try:
            await self.aclose()
        except BaseException as exc:
            # the task group must be exited whatever happened (or its cancel scope stays
            # open in this task and breaks the caller's scopes)
            stack, self._stack = self._stack, None
            if stack is not None:
                await stack.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        stack, self._stack = self._stack, None
        if stack is None:
            return None
        return await stack.__aexit__(*exc_info)

    async def aclose(self) -> None:
        """Stop serving and close every transport, listener and connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # Cancel our tasks, not the task group's own scope: that one also covers the body of
        # `async with node:` in the task that entered it, which must go on after an aclose().
        for scope in list(self._scopes):
            scope.cancel()
        with anyio.CancelScope(shield=True):
            await self._close_transports()

    async def _close_transports(self) -> None:
        for transport in {id(t): t for t in self._transports.values()}.values():
            try:
                await transport.aclose()
            except Exception:
                logger.exception("closing the %s transport failed", transport.name)
        self._pool.clear()

    # -- properties ----------------------------------------------------------------------------

    @property
    def peer_id(self) -> PeerID:
        return self.identity.peer_id

    @property
    def is_running(self) -> bool:
        """Whether the node has started (``async with``) and not closed."""
        return self._tg is not None and not self._closed

    @property
    def addresses(self) -> list[Address]:
        """The addresses other peers can dial to reach this node (with our PeerID)."""
        return list(self._addresses)

    def set_stream_handler(self, handler: StreamHandler | None) -> None:
        """Set the coroutine function that serves streams peers open to this node.

        Each stream runs ``handler(stream)`` in its own task; the stream is closed when the
        handler returns and aborted if it raises. ``None`` gives the streams back to :attr:`rpc`.
        """
        self._handler = handler

    def watch_peers(self, lost: Callable[[PeerID], object]) -> Callable[[], None]:
        """Call ``lost(peer)`` (on the event loop, from the node's own task) whenever the last
        open connection to ``peer`` ends, closed or broken, while the node runs: the transport
        knows at once when a peer's process died (its socket was reset) or it closed its
        node. Returns the function that stops the calls. ``lost`` must not block or raise."""
        self._watchers.append(lost)

        def unwatch() -> None:
            with contextlib.suppress(ValueError):
                self._watchers.remove(lost)

        return unwatch

    def _lost(self, peer: PeerID) -> None:
        for watcher in list(self._watchers):
            try:
                watcher(peer)
            except Exception:
                logger.exception("a peer watcher failed")

    def spawn(
        self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any, name: str | None = None
    ) -> BackgroundTask:
        """Run ``fn(*args)`` as a background task of the node, until it returns, the returned
        handle is cancelled, or the node closes (a task that begins after that is cancelled at
        its first checkpoint). For the layers built on the node (the DHT's upkeep).

        An exception it raises is logged, not raised: it ends only that task. A
        :class:`~swarmavg.SwarmError` (or a timeout) is an event of the network, logged as a
        WARNING line (the task stopped); any other exception is a bug, logged at ERROR with
        its traceback. This may be called from an event-loop callback (a transport's reader).

        :raises RuntimeError: the node is not running.
        """
        if self._tg is None or self._closed:
            raise RuntimeError("the node is not running: use `async with Node(...) as node`")
        task = BackgroundTask()

        async def run() -> None:
            with anyio.CancelScope() as scope:
                if self._closed or task._cancelled:
                    scope.cancel()  # (before it began: it ends at its first checkpoint)
                task._scope = scope
                self._scopes.add(scope)
                try:
                    await fn(*args)
                except (SwarmError, TimeoutError) as exc:
                    logger.warning("background task %s stopped: %s", name or _name_of(fn), exc)
                except Exception:
                    logger.exception("background task %s failed", name or _name_of(fn))
                finally:
                    self._scopes.discard(scope)

        # (start_soon, and nothing that needs to know the async library: a loop callback has
        # no task, and anyio < 4.16 cannot tell the library there)
        self._tg.start_soon(run, name=name)
        return task

    # -- dialing ---------------------------------------------------------------------------------

    async def _transport_for(self, scheme: str) -> Transport:
        """The running transport for ``scheme``, created and started on first use.

        :raises TransportNotFound: no transport is installed for ``scheme``.
        """
        while True:
            transport = self._transports.get(scheme)
            if transport is None:
                if self._closed or self._tg is None:
                    raise anyio.ClosedResourceError("node is closed")
                cls = resolve_transport(scheme)
                transport = cls(self.identity, **self._transport_options.get(cls.name, {}))
                for s in cls.schemes:
                    self._transports.setdefault(s, transport)
            key = id(transport)
            started = self._running.get(key)
            if started is None:
                started = self._running[key] = anyio.Event()
                assert self._tg is not None
                try:
                    await self._tg.start(
                        self._guarded_start, self._run_transport, transport, name=transport.name
                    )
                except BaseException:
                    del self._running[key]  # (a task waiting for it tries again, and raises)
                    raise
                finally:
                    started.set()
                return transport
            await started.wait()  # another task is starting it right now
            if self._running.get(key) is started:
                return transport

    async def _run_transport(
        self, transport: Transport, *, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        """Hold ``transport`` open (its background tasks live here) until the node closes."""
        async with transport:
            task_status.started()
            await anyio.sleep_forever()

    async def connect(
        self,
        address: str | Address,
        *,
        allow_unknown_peer: bool = False,
        timeout: float | None = None,
    ) -> Connection:
        """A connection to the peer at ``address``, reusing an open one to the same peer.

        :raises ValueError: if ``address`` is malformed or names no PeerID (unless
            ``allow_unknown_peer``).
        :raises ConnectError: if the peer cannot be reached in ``timeout`` seconds or another
            key answers (:class:`~swarmavg.errors.PeerIdentityMismatch`).
        """
        if self._tg is None or self._closed:
            raise RuntimeError("the node is not running: use `async with Node(...) as node`")
        address = Address.parse(address)
        peer = address.peer_id
        if peer == self.peer_id:
            raise ValueError("a node cannot connect to itself")
        if peer is not None:
            existing = self._pool.get(peer)
            if existing is not None and not existing.is_closed:
                return existing
        transport = await self._transport_for(address.scheme)
        lock = self._dial_locks.setdefault(peer, anyio.Lock()) if peer else anyio.Lock()
        async with lock:
            if peer is not None:
                existing = self._pool.get(peer)
                if existing is not None and not existing.is_closed:
                    return existing
            try:
                with anyio.fail_after(timeout):
                    conn = await transport.connect(address, allow_unknown_peer=allow_unknown_peer)
            except TimeoutError:
                raise ConnectError(f"connecting to {address} timed out after {timeout} s") from None
            self._adopt(conn)
            return conn

    def connection_to(self, peer_id: PeerID) -> Connection | None:
        """The open pooled connection to ``peer_id``, if there is one."""
        conn = self._pool.get(peer_id)
        return conn if conn is not None and not conn.is_closed else None

    def connections_to(self, peer_id: PeerID) -> list[Connection]:
        """Every open connection to ``peer_id``: the pooled one, and any other (two peers that
        dial each other at the same moment end up with two connections; each side sends on its
        pooled one, so what it receives may come over the other)."""
        return [conn for conn in self._connections.get(peer_id, ()) if not conn.is_closed]

    async def open_stream(self, address: str | Address, *, timeout: float | None = None) -> Stream:
        """Open a stream to the peer at ``address`` (connecting first if needed)."""
        conn = await self.connect(address, timeout=timeout)
        return await conn.open_stream()

    # -- serving -------------------------------------------------------------------------------

    def _adopt(self, conn: Connection) -> None:
        assert self._tg is not None
        conn.serve_inline(partial(self._serve_inline, conn.peer_id))
        previous = self._pool.get(conn.peer_id)
        if previous is None or previous.is_closed:
            self._pool[conn.peer_id] = conn
        self._connections.setdefault(conn.peer_id, []).append(conn)
        self._tg.start_soon(
            self._guarded, self._serve_connection, conn, name=f"conn {conn.peer_id.short()}"
        )

    async def _guarded(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Run a background task of ours in a cancel scope that :meth:`aclose` cancels."""
        with anyio.CancelScope() as scope:
            if self._closed:
                scope.cancel()
            self._scopes.add(scope)
            try:
                await fn(*args)
            finally:
                self._scopes.discard(scope)

    async def _guarded_start(
        self,
        fn: Callable[..., Coroutine[Any, Any, Any]],
        *args: Any,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """:meth:`_guarded` for a task started with ``TaskGroup.start``."""
        with anyio.CancelScope() as scope:
            if self._closed:
                scope.cancel()
            self._scopes.add(scope)
            try:
                await fn(*args, task_status=task_status)
            finally:
                self._scopes.discard(scope)

    async def _accept_loop(self, listener: Any) -> None:
        while True:
            try:
                conn = await listener.accept()
            except anyio.ClosedResourceError:
                return
            logger.debug("accepted a connection from %s", conn.peer_id)
            self._adopt(conn)

    async def _serve_connection(self, conn: Connection) -> None:
        """Serve the streams the peer opens, until the connection ends.

        Tasks wait in ``accept_stream``; the task that gets a stream serves it itself (a
        call's critical path is an event-loop step shorter than handing it to a new task),
        after starting a new waiter if it was the last one, so concurrent streams still each
        get a task. When it is done, it waits for the next stream unless two others already
        wait: calls one after another then start no task at all (starting one, on the
        critical path, cost more than the second waiter's wake-up, which comes after the
        answer is sent).
        """
        waiting = 0
        ended = anyio.Event()

        async def acceptor(tg: anyio.abc.TaskGroup) -> None:
            nonlocal waiting
            while not ended.is_set():
                waiting += 1
                try:
                    stream = await conn.accept_stream()
                except SwarmError:
                    ended.set()
                    return
                finally:
                    waiting -= 1
                if not waiting:
                    tg.start_soon(acceptor, tg)
                await self._serve_stream(stream, conn.peer_id)
                if waiting >= 2:
                    return

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(acceptor, tg)
                await ended.wait()
                tg.cancel_scope.cancel()  # the waiting acceptor; streams being served end too
        finally:
            peer = conn.peer_id
            if self._pool.get(peer) is conn:
                del self._pool[peer]
            left = [other for other in self._connections.get(peer, ()) if other is not conn]
            if left:
                self._connections[peer] = left
            else:
                self._connections.pop(peer, None)
                if not self._closed:
                    self._lost(peer)
            with anyio.CancelScope(shield=True):
                await conn.aclose()

    def _serve_inline(self, peer_id: PeerID, stream: Stream, opening: memoryview) -> bool:
        """The connections' inline handler: calls of the RPC layer's inline methods."""
        if self._handler is not None:
            return False
        return self.rpc.serve_inline(stream, peer_id, opening)

    async def _serve_stream(self, stream: Stream, peer_id: PeerID) -> None:
        handler = self._handler
        try:
            if handler is None:
                await self.rpc.serve_stream(stream, peer_id)
            else:
                await handler(stream)
        except Exception as exc:
            if isinstance(exc, _REQUEST_FAILURES):  # (the peer's doing: see RPC)
                logger.debug("the stream handler failed for %s: %r; resetting", peer_id, exc)
            else:
                logger.exception("the stream handler failed; resetting the stream")
            with anyio.CancelScope(shield=True):
                await stream.abort()
        else:
            await stream.aclose()

    def __repr__(self) -> str:
        where = ", ".join(map(str, self._addresses)) or "not listening"
        return f"<Node {self.peer_id} {where}>"
