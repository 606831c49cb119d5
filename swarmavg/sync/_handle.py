"""``TaskHandle``: a :class:`concurrent.futures.Future` bound to one task on the swarmavg loop.

Theory of operation
-------------------
A handle is created by the submitting thread and completed by the loop thread (see ``_loop``).
Its state lives in the ``Future`` base class, which is thread-safe; what this module adds is the
link to the task:

* The task (:meth:`TaskHandle._drive`) runs the coroutine inside its own anyio ``CancelScope``.
  Only the loop thread touches ``_scope``. The loop cancels every live handle the same way when it
  shuts down.
* :meth:`TaskHandle.cancel` first moves the future to CANCELLED (so ``cancel()`` keeps the
  ``concurrent.futures`` contract: ``True`` means the handle is now cancelled), then asks the loop
  thread to cancel the scope. If the task has not started yet, it sees the cancelled future when
  it starts and never creates the coroutine. Both orders run on the loop thread, so there is no
  window in which a cancellation is lost.
* The future stays PENDING while the task runs (never RUNNING), because ``Future.cancel()``
  refuses to cancel a RUNNING future. ``set_running_or_notify_cancel()`` is called exactly once,
  when the task ends; it atomically decides between "deliver the outcome" and "the handle was
  cancelled first, drop it".

Waiting (``result``, ``exception``, ``await``) never cancels the task: a handle is a view of an
operation that the loop owns, and many parties may wait on it. Only :meth:`TaskHandle.cancel`,
the loop's shutdown, and ``run_sync`` (whose caller owns the task it created) cancel.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Generic, TypeVar

import anyio
import anyio.to_thread

__all__ = ["TaskHandle"]

T = TypeVar("T")

_logger = logging.getLogger("swarmavg.sync")

#: Longest single blocking wait. Waiting in slices lets the main thread run signal handlers
#: (KeyboardInterrupt) on every platform, including where a lock wait is not interruptible.
_WAIT_SLICE = 0.1

#: Bumped in a forked child (see ``_loop._after_fork_in_child``). A handle remembers the value
#: it was created under; a different value means the task it stands for lives in another process.
_fork_generation = 0


def _bump_fork_generation() -> None:
    global _fork_generation
    _fork_generation += 1


def _running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _resolve_waiter(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class TaskHandle(concurrent.futures.Future[T], Generic[T]):
    """The outcome of a coroutine running on the swarmavg event-loop thread (our ``MPFuture``).

    Returned by :func:`swarmavg.sync.start_soon` and by facade methods called with
    ``wait=False``. It *is* a :class:`concurrent.futures.Future`, so it works with
    :func:`concurrent.futures.wait` and :func:`~concurrent.futures.as_completed`. Do not call
    ``set_result``/``set_exception``/``set_running_or_notify_cancel`` on it: the loop does.

    Promises:

    * :meth:`result` and :meth:`exception` block in short slices, so Ctrl+C reaches a main
      thread waiting on them. Waiting never cancels the task (use :meth:`cancel`).
    * :meth:`cancel` cancels the task on the loop: the coroutine sees the anyio cancellation at
      its next checkpoint. The handle is cancelled at once; the coroutine's cleanup finishes
      later, and whatever it returns or raises after that is dropped (an exception is logged to
      the ``swarmavg.sync`` logger).
    * ``await handle`` works from any asyncio loop in any thread (the loop thread included)
      without blocking that loop; from other anyio backends (trio) it waits in a worker thread.
      Cancelling the awaiting task stops the *wait* only, not the operation. Awaiting a cancelled
      handle raises :class:`concurrent.futures.CancelledError` (an ``Exception``, not the
      awaiting task's own cancellation).
    * Done callbacks receive the handle. They run in the thread that completes it: usually the
      loop thread (keep them short and non-blocking), the thread that calls :meth:`cancel`, or
      the caller of :meth:`add_done_callback` if the handle is already done.
    * Used in a process forked after it was created, a handle that is not done raises
      ``RuntimeError`` instead of waiting for a task that does not exist in that process.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, loop_thread_id: int, name: str) -> None:
        """Internal: handles are made by ``start_soon``; constructing one yourself is an error
        in spirit, since nothing would ever complete it."""
        super().__init__()
        self._loop = loop
        self._loop_thread_id = loop_thread_id
        self._name = name
        self._generation = _fork_generation
        self._scope: anyio.CancelScope | None = None  # loop thread only

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._name} {super().__repr__()[1:-1]}>"

    # -- waiting --------------------------------------------------------------------------------

    def result(self, timeout: float | None = None) -> T:
        """Wait for the task and return its value, or raise what it raised.

        :param timeout: seconds to wait; ``None`` waits as long as it takes. Expiry does not
            cancel the task.
        :raises TimeoutError: the task did not finish within ``timeout``.
        :raises concurrent.futures.CancelledError: the handle was cancelled.
        :raises RuntimeError: called on the loop thread before the handle is done (it would
            deadlock: ``await`` the handle there), or the handle belongs to the parent of this
            forked process.
        :raises BaseException: whatever the coroutine raised.
        """
        self._wait_or_raise(timeout)
        return super().result(0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the task and return the exception it raised, or ``None`` if it returned.

        Raises like :meth:`result`, except that the task's own exception is returned.
        """
        self._wait_or_raise(timeout)
        return super().exception(0)

    def _wait_or_raise(self, timeout: float | None) -> None:
        if self.done():
            return
        self._check_waitable()
        if not self._wait(timeout):
            raise TimeoutError(f"{self._name} did not finish within {timeout} s")

    def _check_waitable(self) -> None:
        if self._generation != _fork_generation:
            raise RuntimeError(
                f"{self!r} was created in a parent process before this process was forked; its "
                "task runs on the parent's event loop and cannot be waited for or cancelled here"
            )
        if threading.get_ident() == self._loop_thread_id:
            raise RuntimeError(
                f"blocking on {self!r} in the swarmavg event-loop thread would deadlock; "
                "use `await handle` there"
            )

    def _wait(self, timeout: float | None) -> bool:
        """Block until done or ``timeout`` elapses; return ``done()``. Waits in slices."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if deadline is None:
                wait = _WAIT_SLICE
            else:
                wait = min(deadline - time.monotonic(), _WAIT_SLICE)
                if wait <= 0:
                    return self.done()
            try:
                # Future.exception raises TimeoutError only while not done, so this is
                # unambiguous (unlike result(), where the task may raise TimeoutError itself).
                super().exception(wait)
            except TimeoutError:
                continue
            except concurrent.futures.CancelledError:
                return True
            return True

    def __await__(self) -> Generator[Any, None, T]:
        if not self.done():
            if self._generation != _fork_generation:
                self._check_waitable()
            yield from self._wait_async().__await__()
        return super().result(0)

    async def _wait_async(self) -> None:
        loop = _running_asyncio_loop()
        if loop is None:
            # Not asyncio (trio through anyio): park a worker thread on the blocking wait. If the
            # awaiting task is cancelled, the thread is abandoned and ends with the handle.
            await anyio.to_thread.run_sync(self._wait, None, abandon_on_cancel=True)
            return

        waiter: asyncio.Future[None] = loop.create_future()

        def wake(_: concurrent.futures.Future[T]) -> None:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_resolve_waiter, waiter)

        self.add_done_callback(wake)
        try:
            await waiter
        finally:
            if not waiter.done() or waiter.cancelled():
                # The awaiting task was cancelled; leave the handle alone (waiting is only
                # waiting), but do not keep a callback for a waiter nobody listens to. Only
                # while the handle is pending: once it is done, another thread may be iterating
                # over the callbacks, and removing one would make it skip the next.
                with self._condition:
                    if not self.done():
                        self._done_callbacks.remove(wake)  # type: ignore[attr-defined]

    # -- cancellation ---------------------------------------------------------------------------

    def cancel(self) -> bool:
        """Cancel the task on the loop.

        :returns: ``True`` if the handle is cancelled (now or before), ``False`` if it already
            finished with a result or exception. The coroutine sees the cancellation at its next
            checkpoint, shortly after this returns (a task that has not started never runs).
        :raises RuntimeError: the handle is not done and belongs to the parent of this forked
            process.
        """
        if self._generation != _fork_generation and not self.done():
            self._check_waitable()
        if not super().cancel():
            return False
        if threading.get_ident() == self._loop_thread_id:
            self._cancel_scope()
        else:
            with contextlib.suppress(RuntimeError):  # loop closed: the task has ended anyway
                self._loop.call_soon_threadsafe(self._cancel_scope)
        return True

    def _cancel_scope(self) -> None:  # loop thread
        if self._scope is not None:
            self._scope.cancel()

    # -- the task (loop thread) -----------------------------------------------------------------

    async def _drive(
        self,
        async_fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        live: dict[TaskHandle[Any], asyncio.Task[None]],
    ) -> None:
        """Run ``async_fn(*args)`` and settle the handle with its outcome; the task's body.

        ``live`` is the loop's registry of running tasks (it keeps them referenced, and shutdown
        waits for it to drain); the handle leaves it when this returns. A cancellation that
        escapes the handle's own scope (a ``CancelledError`` from the coroutine, or a native
        ``Task.cancel()``) settles the handle as cancelled and propagates.
        """
        try:
            if self.cancelled():  # cancelled before it started: never create the coroutine
                self.set_running_or_notify_cancel()
                return
            finished = False
            retval: Any = None
            try:
                with anyio.CancelScope() as self._scope:
                    retval = await async_fn(*args)
                    finished = True
            except (anyio.get_cancelled_exc_class(), GeneratorExit):
                self._settle_cancelled()
                raise
            except BaseException as exc:
                if self.set_running_or_notify_cancel():
                    self.set_exception(exc)
                else:
                    _logger.warning(
                        "%s raised after its handle was cancelled", self._name, exc_info=exc
                    )
            else:
                if not finished:  # our scope caught the cancellation that cancel() requested
                    self._settle_cancelled()
                elif self.set_running_or_notify_cancel():
                    self.set_result(retval)
        finally:
            self._scope = None
            live.pop(self, None)

    def _settle_cancelled(self) -> None:
        concurrent.futures.Future.cancel(self)  # no-op if already cancelled; never RUNNING here
        self.set_running_or_notify_cancel()
