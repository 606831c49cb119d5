"""The process-wide event-loop thread that every synchronous facade talks to.

Theory of operation
-------------------
One thread, named ``swarmavg-loop``, runs ``anyio.run(..., backend="asyncio")``. Its root task
owns an anyio ``BlockingPortal`` (handed out by :func:`get_portal` for code that wants anyio's
own thread bridge, e.g. ``wrap_async_context_manager``) and ``_LoopState.live``, the registry of
every task that :func:`start_soon` / :func:`run_sync` started. The root task does not return
before the registry is empty: every task has an owner that waits for it.

Submissions skip the portal and anyio's task group. ``BlockingPortal.start_task_soon`` makes a
blocking round trip to the loop just to spawn the task, and ``TaskGroup.start_soon`` costs more
loop-thread time per call than the whole reference round trip. :func:`start_soon` instead posts
one ``loop.call_soon_threadsafe`` callback that creates a plain asyncio task and returns at once.
That keeps a no-op round trip close to a bare ``asyncio.run_coroutine_threadsafe`` (see
``benchmarks/_sync_handle.py``). Cancellation stays anyio's: each task runs its coroutine in its
own ``CancelScope``, which ``TaskHandle.cancel`` cancels; shutdown cancels every live handle the
same way and waits for the tasks to finish.

Shutdown is ordered by ``_LoopState.lock``: a submission posts its callback while holding the
lock and only if the loop still accepts work; :meth:`_LoopState.request_stop` flips ``accepting``
and posts the stop callback under the same lock. The loop runs callbacks in FIFO order, so every
accepted task is in ``live`` before the loop starts draining it, and every handle ends settled
(cancelled, at worst). No accepted handle is left pending by a stopped loop.

Process lifecycle:

* The thread starts lazily on first use. It is a daemon thread only as a last resort: an
  ``atexit`` hook (registered on first start, so hooks that the program registers later run
  before it and can still use the loop) first shuts down the facades that the program left running
  (:func:`shut_down_at_exit`, newest first, as nested ``with`` blocks would), then cancels the
  outstanding tasks and joins the thread, waiting at most ``_EXIT_TIMEOUT`` seconds for their
  cleanup. After that hook, using the loop raises ``RuntimeError`` rather than starting a new
  thread in a dying interpreter.
* Stopping the loop starts no thread, because that hook runs while the interpreter finalizes,
  when Python 3.12 refuses new threads (``can't create new thread at interpreter shutdown``; 3.11
  and 3.13 allow them in ``atexit`` hooks). ``asyncio.Runner`` ends by joining the loop's default
  executor (``run_in_executor(None, ...)``, which ``loop.getaddrinfo`` uses) from a new thread;
  the loop here (:class:`_LoopThreadEventLoop`) shuts that executor down without one, and the
  loop thread joins its workers briefly, as it does anyio's.
* Nothing is installed at import time: no signal handlers. Ctrl+C raises ``KeyboardInterrupt``
  in the main thread as usual; waits are sliced so it is delivered promptly, ``run_sync``
  cancels its task, and the ``atexit`` hook stops the loop.
* ``os.register_at_fork`` (also on first start) drops the parent's loop state in a forked child:
  the child has no loop thread, so it lazily starts its own on first use. Handles created in the
  parent raise ``RuntimeError`` in the child instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar, TypeVarTuple, Unpack

import anyio
from anyio.from_thread import BlockingPortal

from swarmavg.sync import _handle
from swarmavg.sync._handle import TaskHandle

__all__ = ["get_portal", "in_loop_thread", "run_sync", "shutdown_loop", "start_soon"]

T = TypeVar("T")
PosArgsT = TypeVarTuple("PosArgsT")

_logger = logging.getLogger("swarmavg.sync")

#: The loop thread's name (``threading.enumerate()`` shows it).
THREAD_NAME = "swarmavg-loop"

#: How long the interpreter-exit hook waits for cancelled tasks to finish their cleanup.
_EXIT_TIMEOUT = 5.0

#: How long a stopping loop thread waits for its idle worker threads (anyio's, the default
#: executor's) to exit.
_WORKER_JOIN_TIMEOUT = 1.0


if sys.platform == "win32":  # (asyncio's default loop class on each platform)
    _EventLoop = asyncio.ProactorEventLoop
else:
    _EventLoop = asyncio.SelectorEventLoop


class _LoopThreadEventLoop(_EventLoop):
    """asyncio's loop, whose default executor is shut down without starting a thread.

    ``asyncio.Runner`` (under ``anyio.run``) ends with ``loop.shutdown_default_executor()``,
    which joins the executor from a new thread, and the loop thread stops in an ``atexit``
    hook, where Python 3.12 refuses to start one. Here the default executor is made with the
    loop, so its worker threads are known: :meth:`shutdown_default_executor` only tells them to
    exit (no task is left to wait for the executor by then), and the loop thread joins them,
    within ``_WORKER_JOIN_TIMEOUT``, after the loop closed.
    """

    def __init__(self) -> None:
        super().__init__()
        #: the default executor's worker threads, each added as it starts
        self.executor_threads: list[threading.Thread] = []
        self._executor = concurrent.futures.ThreadPoolExecutor(
            thread_name_prefix=f"{THREAD_NAME}-executor", initializer=self._worker_started
        )
        self.set_default_executor(self._executor)

    def _worker_started(self) -> None:  # a worker thread of the executor
        self.executor_threads.append(threading.current_thread())

    async def shutdown_default_executor(self, timeout: float | None = None) -> None:
        # (a call still running in a worker finishes there; cancel_futures drops those not
        # started. An executor that replaced ours, set_default_executor(), is shut down by
        # loop.close(), also without a thread.)
        self._executor.shutdown(wait=False, cancel_futures=True)


class _LoopState:
    """One running loop thread. Created on that thread; afterwards ``accepting`` is guarded by
    ``lock`` and ``live`` belongs to the loop thread."""

    def __init__(self, portal: BlockingPortal, stop: anyio.Event) -> None:
        self.loop = asyncio.get_running_loop()
        self.thread = threading.current_thread()
        self.thread_id = threading.get_ident()
        self.portal = portal
        self.lock = threading.Lock()
        self.accepting = True
        self.live: dict[TaskHandle[Any], asyncio.Task[None]] = {}
        self._stop = stop

    def submit(
        self,
        handle: TaskHandle[Any],
        async_fn: Callable[..., Awaitable[Any]],
        args: tuple[Any, ...],
    ) -> None:
        """Post the task; the handle settles even if the loop stops right after."""
        with self.lock:
            if not self.accepting:
                raise RuntimeError("the swarmavg event loop was shut down")
            self.loop.call_soon_threadsafe(self._spawn, handle, async_fn, args)

    def _spawn(
        self,
        handle: TaskHandle[Any],
        async_fn: Callable[..., Awaitable[Any]],
        args: tuple[Any, ...],
    ) -> None:  # loop thread
        self.live[handle] = self.loop.create_task(
            handle._drive(async_fn, args, self.live), name=handle._name
        )

    def request_stop(self) -> None:
        """Stop accepting work and ask the loop to cancel everything and exit. Idempotent."""
        with self.lock:
            if not self.accepting:
                return
            self.accepting = False
            with contextlib.suppress(RuntimeError):  # the loop already closed (it crashed)
                self.loop.call_soon_threadsafe(self._stop.set)

    async def drain(self) -> None:  # loop thread, after request_stop
        """Cancel every live task and wait until all of them have finished."""
        while self.live:
            for handle in list(self.live):
                handle.cancel()
            await asyncio.wait(list(self.live.values()))

    def mark_dead(self) -> None:
        with self.lock:
            self.accepting = False


class _Facade(Protocol):
    def shutdown(self) -> None: ...


_lock = threading.Lock()  # guards the globals below; replaced in a forked child
#: facades to shut down at exit, by the order they started in (held weakly)
_facades: weakref.WeakValueDictionary[int, _Facade] = weakref.WeakValueDictionary()
_facade_order = itertools.count()
_state: _LoopState | None = None
_retiring: list[_LoopState] = []  # stopped or stopping, not yet joined
_orphans: list[_LoopState] = []  # inherited through fork; kept so nothing is finalized in a child
_exiting = False
_hooks_installed = False
_thread_local = threading.local()


async def _serve(started: concurrent.futures.Future[_LoopState]) -> None:
    _thread_local.is_loop_thread = True
    stop = anyio.Event()
    async with BlockingPortal() as portal:
        state = _LoopState(portal, stop)
        started.set_result(state)
        await stop.wait()
        await portal.stop(cancel_remaining=True)
        await state.drain()


def _run_loop_thread(started: concurrent.futures.Future[_LoopState]) -> None:
    try:
        anyio.run(
            _serve,
            started,
            backend="asyncio",
            backend_options={"loop_factory": _LoopThreadEventLoop},
        )
    except BaseException as exc:
        if not started.done():
            started.set_exception(exc)
        else:
            _logger.critical("the swarmavg event loop crashed", exc_info=exc)
    finally:
        if started.done() and started.exception() is None:
            state = started.result()
            state.mark_dead()
            _join_worker_threads(state.loop)


def _join_worker_threads(loop: asyncio.AbstractEventLoop) -> None:
    """Wait briefly for the worker threads of ``loop`` to exit: anyio's (``anyio.to_thread``)
    and those of its default executor (``loop.run_in_executor(None, ...)``).

    Both were told to stop as the loop closed (anyio's when the root task ended), and neither is
    joined by its owner. Idle ones exit at once; one still running a function whose task
    abandoned it is left to finish alone (anyio's are daemons, like this thread; the executor's
    are joined by ``concurrent.futures`` at interpreter exit).
    """
    deadline = time.monotonic() + _WORKER_JOIN_TIMEOUT
    # anyio's WorkerThread keeps its loop in ``.loop``; without it we join nothing of anyio's.
    threads = [t for t in threading.enumerate() if getattr(t, "loop", None) is loop]
    if isinstance(loop, _LoopThreadEventLoop):
        threads += loop.executor_threads
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


def _install_process_hooks() -> None:  # under _lock
    global _hooks_installed
    if not _hooks_installed:
        atexit.register(_shutdown_at_exit)
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _hooks_installed = True


def _current_state() -> _LoopState:
    """The running loop, started on first use (or after a shutdown)."""
    global _state
    state = _state
    if state is not None and state.accepting:
        return state
    with _lock:
        state = _state
        if state is not None and state.accepting:
            return state
        if _exiting:
            raise RuntimeError(
                "the swarmavg event loop was shut down at interpreter exit and cannot restart"
            )
        if in_loop_thread():  # a task cleaning up while its own loop shuts down
            raise RuntimeError("the swarmavg event loop is shutting down")
        if state is not None:  # the loop thread died; keep it for shutdown_loop() to join
            _retiring.append(state)
            _state = None
        _install_process_hooks()
        started: concurrent.futures.Future[_LoopState] = concurrent.futures.Future()
        thread = threading.Thread(
            target=_run_loop_thread, args=(started,), name=THREAD_NAME, daemon=True
        )
        thread.start()
        try:
            state = started.result()
        except BaseException:  # e.g. Ctrl+C while waiting: stop the loop once it is up
            started.add_done_callback(_stop_if_started)
            raise
        _state = state
        return state


def shut_down_at_exit(facade: _Facade) -> None:
    """Call ``facade.shutdown()`` at interpreter exit, before the event loop stops, unless the
    program calls it first (``shutdown()`` must be idempotent). Facades are shut down newest
    first, as nested ``with`` blocks would close them: an optimizer before the averagers it
    made, an averager before its DHT. Held weakly: a facade that is garbage is not kept alive.
    What a ``shutdown()`` raises is logged (DEBUG) and the next one goes on.
    """
    with _lock:
        _install_process_hooks()
        _facades[next(_facade_order)] = facade


def _shut_facades_down() -> None:
    with _lock:
        facades = [_facades.get(key) for key in sorted(_facades, reverse=True)]
        _facades.clear()
    for facade in facades:
        if facade is None:
            continue
        try:
            facade.shutdown()
        except Exception:
            _logger.debug("shutting %r down at exit failed", facade, exc_info=True)


def _stop_if_started(started: concurrent.futures.Future[_LoopState]) -> None:
    if started.exception() is None:
        started.result().request_stop()


def in_loop_thread() -> bool:
    """Whether the caller runs on the swarmavg event-loop thread (where blocking calls deadlock)."""
    return getattr(_thread_local, "is_loop_thread", False)


def get_portal() -> BlockingPortal:
    """The anyio ``BlockingPortal`` of the process-wide event loop, started on first use.

    Tasks started through the portal are cancelled by :func:`shutdown_loop` like every other task.
    Prefer :func:`start_soon`/:func:`run_sync` for plain calls: they are faster and return a
    :class:`TaskHandle`.

    :raises RuntimeError: called after the interpreter-exit hook stopped the loop.
    """
    return _current_state().portal


def start_soon(
    async_fn: Callable[[Unpack[PosArgsT]], Awaitable[T]], *args: *PosArgsT
) -> TaskHandle[T]:
    """Run ``async_fn(*args)`` as a task on the event-loop thread and return its handle at once.

    Callable from any thread, the loop thread included. The coroutine is created on the loop
    thread (never if the handle is cancelled first) and runs in a copy of the caller's
    ``contextvars`` context.

    :raises RuntimeError: the loop is shutting down (concurrently, or this is one of its tasks
        cleaning up), or was stopped at interpreter exit.
    """
    return _start_handle(TaskHandle, async_fn, *args)


H = TypeVar("H", bound=TaskHandle[Any])


def _start_handle(
    make_handle: Callable[[asyncio.AbstractEventLoop, int, str], H],
    async_fn: Callable[..., Awaitable[Any]],
    *args: Any,
) -> H:
    """:func:`start_soon` with a handle made by ``make_handle(loop, loop_thread_id, name)`` (a
    :class:`TaskHandle` subclass with more to it, such as the averager's step handle)."""
    state = _current_state()
    name = getattr(async_fn, "__qualname__", None) or repr(async_fn)
    handle = make_handle(state.loop, state.thread_id, name)
    state.submit(handle, async_fn, args)
    return handle


def run_sync(
    async_fn: Callable[[Unpack[PosArgsT]], Awaitable[T]],
    *args: *PosArgsT,
    timeout: float | None = None,
) -> T:
    """Run ``async_fn(*args)`` on the event-loop thread and block until it finishes.

    The caller owns the task: if the wait ends early (``timeout`` or an exception such as
    ``KeyboardInterrupt`` while waiting), the task is cancelled before the exception propagates.
    The wait is sliced, so Ctrl+C interrupts it promptly.

    :param timeout: seconds to wait; ``None`` waits as long as it takes.
    :returns: what the coroutine returned.
    :raises TimeoutError: it did not finish within ``timeout`` (the task was cancelled).
    :raises RuntimeError: called on the loop thread itself (it would deadlock: ``await``
        there), or the loop is shutting down.
    :raises BaseException: whatever the coroutine raised, including
        :class:`concurrent.futures.CancelledError` if someone else cancelled it.
    """
    if in_loop_thread():
        raise RuntimeError(
            "run_sync() was called on the swarmavg event-loop thread, where it would deadlock; "
            "await the coroutine instead"
        )
    handle = start_soon(async_fn, *args)
    try:
        finished = handle._wait(timeout)
    except BaseException:
        handle.cancel()
        raise
    if not finished:
        handle.cancel()
        raise TimeoutError(f"{handle._name} did not finish within {timeout} s and was cancelled")
    return handle.result(0)


def shutdown_loop(timeout: float | None = None) -> None:
    """Stop the event-loop thread: cancel every outstanding task and join the thread.

    Handles of cancelled tasks end cancelled. Idempotent; the next :func:`start_soon`,
    :func:`run_sync` or :func:`get_portal` starts a fresh loop. Called automatically at
    interpreter exit.

    :param timeout: seconds to wait for the thread; ``None`` waits as long as cleanup takes.
    :raises TimeoutError: the thread is still running after ``timeout`` (a task ignores its
        cancellation); a later call waits for it again.
    :raises RuntimeError: called on the loop thread itself.
    """
    global _state
    if in_loop_thread():
        raise RuntimeError("shutdown_loop() cannot be called on the swarmavg event-loop thread")
    with _lock:
        if _state is not None:
            _retiring.append(_state)
            _state = None
        retiring = list(_retiring)
    deadline = None if timeout is None else time.monotonic() + timeout
    for state in retiring:
        state.request_stop()
    for state in retiring:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        state.thread.join(remaining)
        if state.thread.is_alive():
            raise TimeoutError(f"the swarmavg event loop did not stop within {timeout} s")
        with _lock, contextlib.suppress(ValueError):
            _retiring.remove(state)


def _shutdown_at_exit() -> None:
    global _exiting
    _shut_facades_down()
    with _lock:
        _exiting = True
    try:
        shutdown_loop(timeout=_EXIT_TIMEOUT)
    except TimeoutError:
        _logger.warning(
            "the swarmavg event loop did not stop within %s s at exit; abandoning it", _EXIT_TIMEOUT
        )


def _after_fork_in_child() -> None:
    # Only the forking thread exists in the child: the loop thread and anyone holding _lock are
    # gone. Forget the parent's loop without touching it (its objects belong to the parent).
    global _lock, _state, _retiring
    _handle._bump_fork_generation()
    if _state is not None:
        _orphans.append(_state)
    _orphans.extend(_retiring)
    _state = None
    _retiring = []
    _facades.clear()  # (the parent's: the child shuts down only what it starts)
    _lock = threading.Lock()
    _thread_local.is_loop_thread = False  # in case the loop thread itself forked
