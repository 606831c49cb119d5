"""``call``: the one place where a facade method's ``wait`` flag turns into a value or a handle.

The facade pattern
------------------
A synchronous facade method that can either block or return a handle declares two overloads on
``Literal`` and forwards to :func:`call`; its return type then follows the flag, so users never
see ``T | TaskHandle[T]`` when they pass a literal::

    from typing import Literal, overload

    from swarmavg.sync import TaskHandle, call

    class DecentralizedAverager:
        @overload
        def step(self, *, timeout: float | None = None, wait: Literal[True] = True) -> StepResult:
            ...

        @overload
        def step(
            self, *, timeout: float | None = None, wait: Literal[False]
        ) -> TaskHandle[StepResult]: ...

        @overload  # for callers that pass a plain bool
        def step(
            self, *, timeout: float | None = None, wait: bool
        ) -> StepResult | TaskHandle[StepResult]: ...

        def step(
            self, *, timeout: float | None = None, wait: bool = True
        ) -> StepResult | TaskHandle[StepResult]:
            \"\"\"...\"\"\"
            return call(self._averager.step, timeout, wait=wait)

The operation's own ``timeout`` goes to the async method (it bounds the operation in both modes);
``call`` itself has none. ``tests/sync/test_sync_facade.py`` holds a runnable example that
``mypy --strict`` checks.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar, TypeVarTuple, Unpack, overload

from swarmavg.sync._handle import TaskHandle
from swarmavg.sync._loop import run_sync, start_soon

__all__ = ["call"]

T = TypeVar("T")
PosArgsT = TypeVarTuple("PosArgsT")


@overload
def call(
    async_fn: Callable[[Unpack[PosArgsT]], Awaitable[T]],
    *args: *PosArgsT,
    wait: Literal[True] = True,
) -> T: ...


@overload
def call(
    async_fn: Callable[[Unpack[PosArgsT]], Awaitable[T]],
    *args: *PosArgsT,
    wait: Literal[False],
) -> TaskHandle[T]: ...


@overload
def call(
    async_fn: Callable[[Unpack[PosArgsT]], Awaitable[T]],
    *args: *PosArgsT,
    wait: bool,
) -> T | TaskHandle[T]: ...


def call(
    async_fn: Callable[[Unpack[PosArgsT]], Awaitable[T]],
    *args: *PosArgsT,
    wait: bool = True,
) -> T | TaskHandle[T]:
    """Run ``async_fn(*args)`` on the event-loop thread; block for it or return its handle.

    ``wait=True`` is :func:`run_sync` (the result, or the exception; ``KeyboardInterrupt`` while
    waiting cancels the task). ``wait=False`` is :func:`start_soon` (a :class:`TaskHandle`).

    :raises RuntimeError: ``wait=True`` on the loop thread (it would deadlock), or the loop is
        shutting down.
    """
    if wait:
        return run_sync(async_fn, *args)
    return start_soon(async_fn, *args)
