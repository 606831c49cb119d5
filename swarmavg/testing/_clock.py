"""An asyncio event loop on virtual time, for simulations and tests of many peers in one process.

Its clock stands still while callbacks run (but for a microsecond a cycle of the loop, so that
code that polls the clock in a busy loop gets to its deadline) and jumps to the next timer when
every task waits, like ``trio.testing.MockClock(autojump_threshold=0)``: a thousand peers that
share one core then see the timeouts they would see on a thousand machines, however long the
process takes to run them all, and a ``sleep(60)`` costs nothing. DHT time
(:func:`swarmavg.get_dht_time`) follows it on such a loop, from the wall-clock time at which the
loop was made.

Work that the loop hands to a worker thread (``anyio.to_thread.run_sync`` with the default
limiter, on a loop made with ``watch_default_thread_limiter=True`` as :func:`run_on_virtual_time`
and the tests' ``anyio_backend`` make it; ``loop.run_in_executor``, and the join of the default
executor as the loop closes) is computation too, so
it takes no virtual time either: while such a thread runs and nothing else is ready, the clock
stands still and the loop waits (in real time) for the thread's result, up to
5 real seconds per move of the clock (a thread that waits for the clock
itself would otherwise hold it forever). Without this, a loop that only jumps from timer to
timer runs through minutes of timeouts while a thread hashes a few kilobytes (the thread gets
the GIL only between the loop's cycles). Anything else that waits outside the loop (a real
socket) does not hold the clock back. Meant for code on the in-process
:class:`~swarmavg.testing.MemoryTransport`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import selectors
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import anyio
import anyio.to_thread

__all__ = ["VirtualClockLoop", "run_on_virtual_time"]

T = TypeVar("T")

#: Virtual seconds a cycle of the loop costs when something is ready to run.
_BUSY_CYCLE = 1e-6
#: Loop cycles that only retry delivering a cancellation before the clock moves on regardless.
_CANCELLATION_SPINS = 100
#: Real seconds the clock waits for busy worker threads before it moves on regardless.
_THREAD_HOLD = 5.0


class _JumpingSelector(selectors.BaseSelector):
    """A selector that never waits: with nothing ready, it moves its loop's clock on to when
    the loop would have woken up (the next timer) instead."""

    def __init__(self, real: selectors.BaseSelector, loop: VirtualClockLoop) -> None:
        self._real = real
        self._loop = loop
        self._spins = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = self._real.select(0)
        if events:
            self._spins = 0
            return events
        if timeout == 0:
            # Something is ready to run: a cycle of the loop costs a little time, so that code
            # that polls the clock in a busy loop (until a deadline) gets there.
            self._loop._advance(_BUSY_CYCLE)
            # If it is only anyio re-delivering a cancellation
            # (it retries every cycle until the cancelled task leaves the scope) and that has
            # gone on for a while, the task waits for a timer (a shielded clean-up with a
            # timeout): the clock must move on for it, as it would on real time.
            if self._loop._only_retrying_cancellation():
                self._spins += 1
                if self._spins >= _CANCELLATION_SPINS:
                    self._spins = 0
                    hold = self._loop._thread_hold()
                    if hold > 0:  # (the task may wait for a worker thread: as below)
                        return self._real.select(min(hold, 0.01))
                    self._loop._advance_to_next_timer()
            else:
                self._spins = 0
            return events
        self._spins = 0
        if timeout is None:  # no timer at all: only I/O (another thread) can wake us
            return self._real.select(None)
        hold = self._loop._thread_hold()
        if hold > 0:
            # a worker thread computes for the loop: wait for its result (it wakes the real
            # selector) rather than jump; the loop comes back here if it has not reported
            return self._real.select(hold)
        self._loop._advance(timeout)
        return []

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def close(self) -> None:
        self._real.close()

    def get_key(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.get_key(fileobj)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._real.get_map()


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An asyncio event loop whose clock (``loop.time()``, ``anyio.current_time()``, every
    timeout and sleep) moves only when all its tasks wait, straight to the next timer.

    :param start: the clock's first reading (seconds).
    :param watch_default_thread_limiter: also hold the clock while anyio's default thread
        limiter of this loop has tokens borrowed (``anyio.to_thread.run_sync`` work), as
        :meth:`watch_thread_limiter` would with it; for a loop that something else runs (anyio's
        pytest plugin: ``anyio_backend = ("asyncio", {"loop_factory": ...})``), where no code
        of ours gets to run on it first.
    """

    def __init__(self, start: float = 0.0, *, watch_default_thread_limiter: bool = False) -> None:
        super().__init__()
        #: the default thread limiter is still to be watched (at the loop's first run)
        self._watch_default_pending = watch_default_thread_limiter
        self._now = float(start)
        #: DHT time at ``loop.time() == 0``
        self.epoch = time.time() - self._now
        real: selectors.BaseSelector = self._selector  # type: ignore[has-type]
        self._selector = _JumpingSelector(real, self)
        self._thread_limiters: list[anyio.CapacityLimiter] = []
        self._executor_jobs = 0
        #: real time since which the clock has waited for worker threads (None: it is not)
        self._held_since: float | None = None

    def watch_thread_limiter(self, limiter: anyio.CapacityLimiter) -> None:
        """Hold the clock while ``limiter`` has tokens borrowed (worker threads run work of
        this loop under it): :func:`run_on_virtual_time` passes anyio's default thread
        limiter."""
        if limiter not in self._thread_limiters:
            self._thread_limiters.append(limiter)

    def run_forever(self) -> None:
        if self._watch_default_pending:
            self._watch_default_pending = False
            # anyio's default limiter is a run variable of the loop, to look up from a task on
            # it: this one is ready before any timer fires, so the clock cannot move (jump
            # over a worker thread's work) before it has run
            self.create_task(self._watch_default_limiter())
        super().run_forever()

    async def _watch_default_limiter(self) -> None:
        self.watch_thread_limiter(anyio.to_thread.current_default_thread_limiter())

    def run_in_executor(  # type: ignore[override]
        self, executor: concurrent.futures.Executor | None, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        """As asyncio's; the clock stands still while the job runs (see the module)."""
        future = super().run_in_executor(executor, func, *args)
        self._executor_jobs += 1
        future.add_done_callback(self._executor_job_done)
        return future

    def _executor_job_done(self, _: object) -> None:
        self._executor_jobs -= 1

    async def shutdown_default_executor(self, timeout: float | None = None) -> None:
        """As asyncio's (``asyncio.Runner`` calls it as the loop closes); the clock stands still
        while a thread joins the default executor. Python 3.13 bounds that join with a timeout
        on the loop's clock (300 s from ``asyncio.Runner``), which would otherwise jump past it
        at once and warn that the executor did not finish joining."""
        self._executor_jobs += 1
        try:
            if sys.version_info >= (3, 12):  # (the timeout came with 3.12)
                await super().shutdown_default_executor(timeout)
            else:
                await super().shutdown_default_executor()
        finally:
            self._executor_jobs -= 1

    def _thread_hold(self) -> float:
        """Real seconds the clock may still wait for busy worker threads (0: move on)."""
        busy = self._executor_jobs > 0 or any(
            limiter.borrowed_tokens for limiter in self._thread_limiters
        )
        if not busy:
            self._held_since = None
            return 0.0
        now = time.monotonic()
        if self._held_since is None:
            self._held_since = now
        return max(self._held_since + _THREAD_HOLD - now, 0.0)

    def time(self) -> float:
        return self._now

    def dht_time(self) -> float:
        """DHT time on this loop: the wall clock when it was made, plus virtual time since."""
        return self.epoch + self._now

    def _advance(self, seconds: float) -> None:
        self._now += seconds
        if seconds > _BUSY_CYCLE:
            self._held_since = None  # (the next wait for a thread holds the clock anew)

    def _advance_to_next_timer(self) -> None:
        scheduled = self._scheduled  # type: ignore[attr-defined]
        if scheduled:
            self._now = max(self._now, scheduled[0].when())
            self._held_since = None

    def _only_retrying_cancellation(self) -> bool:
        """Whether every callback ready to run is anyio's retry of a cancellation."""
        ready = self._ready  # type: ignore[attr-defined]
        return bool(ready) and all(
            getattr(handle._callback, "__name__", "") == "_deliver_cancellation" for handle in ready
        )


def run_on_virtual_time(fn: Callable[..., Awaitable[T]], *args: Any, start: float = 0.0) -> T:
    """``anyio.run(fn, *args)`` on a :class:`VirtualClockLoop` (whose clock also waits for
    ``anyio.to_thread`` work under the default limiter)."""
    return anyio.run(
        fn,
        *args,
        backend="asyncio",
        backend_options={
            "loop_factory": lambda: VirtualClockLoop(start, watch_default_thread_limiter=True)
        },
    )
