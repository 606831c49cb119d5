"""TaskHandle: outcome propagation, cancellation, callbacks, timeouts, awaiting from any loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

from swarmavg.sync import TaskHandle, _handle, in_loop_thread, run_sync, start_soon

pytestmark = pytest.mark.timeout(10)

WAIT = 5.0  # generous bound for "this happens promptly"; tests never sleep for it


class Boom(Exception):
    pass


class Gate:
    """A coroutine that parks until released from any thread, recording how it ended."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.cancelled = threading.Event()
        self.released = threading.Event()
        self._event: anyio.Event | None = None

    async def __call__(self, value: int = 0) -> int:
        self._event = anyio.Event()
        self.entered.set()
        try:
            await self._event.wait()
        except anyio.get_cancelled_exc_class():
            self.cancelled.set()
            raise
        return value

    def release(self) -> None:
        assert self.entered.wait(WAIT)
        run_sync(self._set)

    async def _set(self) -> None:
        assert self._event is not None
        self._event.set()


async def _add(a: int, b: int) -> int:
    await anyio.lowlevel.checkpoint()
    return a + b


async def _raise(exc: BaseException) -> None:
    await anyio.lowlevel.checkpoint()
    raise exc


def test_result_propagates() -> None:
    handle = start_soon(_add, 2, 3)
    assert isinstance(handle, TaskHandle)
    assert isinstance(handle, concurrent.futures.Future)
    assert handle.result(WAIT) == 5
    assert handle.done()
    assert not handle.cancelled()
    assert handle.exception() is None
    assert handle.cancel() is False  # already done


def test_exception_propagates_unchanged() -> None:
    exc = Boom("nope")
    handle = start_soon(_raise, exc)
    with pytest.raises(Boom) as info:
        handle.result(WAIT)
    assert info.value is exc
    assert handle.exception() is exc
    assert handle.cancel() is False


def test_base_exception_is_delivered_not_raised_on_the_loop() -> None:
    class Fatal(BaseException):
        pass

    with pytest.raises(Fatal):
        start_soon(_raise, Fatal()).result(WAIT)
    assert run_sync(_add, 1, 1) == 2  # the loop survived


def test_timeout_raised_by_the_coroutine_is_not_a_wait_timeout() -> None:
    handle = start_soon(_raise, TimeoutError("from the coroutine"))
    with pytest.raises(TimeoutError, match="from the coroutine"):
        handle.result(WAIT)


def test_result_timeout_raises_and_leaves_the_task_running() -> None:
    gate = Gate()
    handle = start_soon(gate, 7)
    assert gate.entered.wait(WAIT)
    with pytest.raises(TimeoutError):
        handle.result(timeout=0.01)
    with pytest.raises(TimeoutError):
        handle.exception(timeout=0)
    assert not handle.done()
    gate.release()
    assert handle.result(WAIT) == 7
    assert not gate.cancelled.is_set()


def test_cancel_cancels_the_running_coroutine() -> None:
    gate = Gate()
    handle = start_soon(gate)
    assert gate.entered.wait(WAIT)
    assert handle.cancel() is True
    assert handle.cancelled()
    assert handle.done()
    with pytest.raises(concurrent.futures.CancelledError):
        handle.result()
    with pytest.raises(concurrent.futures.CancelledError):
        handle.exception()
    assert gate.cancelled.wait(WAIT)  # the coroutine saw an anyio cancellation
    assert handle.cancel() is True  # idempotent
    # concurrent.futures.wait() sees the handle once the task has acknowledged the cancellation
    done, _ = concurrent.futures.wait([handle], timeout=WAIT)
    assert done == {handle}


def test_cancel_before_start_never_creates_the_coroutine() -> None:
    entered = threading.Event()
    unblock = threading.Event()
    calls: list[str] = []

    async def hog() -> None:
        entered.set()
        unblock.wait(WAIT)  # deliberately blocks the loop thread

    def never_called() -> Awaitable[None]:
        calls.append("called")
        return anyio.lowlevel.checkpoint()

    hogging = start_soon(hog)
    assert entered.wait(WAIT)
    handle = start_soon(never_called)  # queued behind the blocked loop
    assert handle.cancel() is True
    unblock.set()
    hogging.result(WAIT)
    done, _ = concurrent.futures.wait([handle], timeout=WAIT)
    assert done == {handle}
    assert calls == []


def test_stray_cancelled_error_cancels_only_its_handle() -> None:
    async def stray() -> None:
        raise asyncio.CancelledError

    handle = start_soon(stray)
    done, _ = concurrent.futures.wait([handle], timeout=WAIT)
    assert done == {handle}
    assert handle.cancelled()
    assert run_sync(_add, 1, 2) == 3


def test_done_callbacks_receive_the_handle_before_and_after_completion() -> None:
    gate = Gate()
    handle = start_soon(gate, 3)
    seen: list[tuple[Any, bool]] = []
    called = threading.Event()

    def early(fut: concurrent.futures.Future[int]) -> None:
        seen.append((fut, in_loop_thread()))
        called.set()

    handle.add_done_callback(early)
    assert seen == []
    gate.release()
    assert called.wait(WAIT)
    assert seen == [(handle, True)]  # completed on the loop thread

    late: list[Any] = []
    handle.add_done_callback(late.append)  # already done: runs at once, in this thread
    assert late == [handle]


def test_done_callback_runs_on_cancel() -> None:
    gate = Gate()
    handle = start_soon(gate)
    states: list[bool] = []
    handle.add_done_callback(lambda fut: states.append(fut.cancelled()))
    assert gate.entered.wait(WAIT)
    handle.cancel()
    assert states == [True]


def test_result_on_the_loop_thread_raises_instead_of_deadlocking() -> None:
    gate = Gate()
    handle = start_soon(gate)

    async def block_on_it() -> None:
        handle.result()

    with pytest.raises(RuntimeError, match="deadlock"):
        run_sync(block_on_it)
    handle.cancel()


def test_await_from_another_asyncio_loop_does_not_block_it() -> None:
    gate = Gate()
    handle = start_soon(gate, 42)
    ticking = threading.Event()
    outcome: list[object] = []

    async def main() -> int:
        waiter = asyncio.ensure_future(_await(handle))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        ticking.set()  # reached only if awaiting the handle left this loop running
        return await waiter

    thread = threading.Thread(target=lambda: outcome.append(asyncio.run(main())))
    thread.start()
    assert ticking.wait(WAIT)
    assert not handle.done()
    gate.release()
    thread.join(WAIT)
    assert outcome == [42]


async def _await(handle: TaskHandle[int]) -> int:
    return await handle


def test_await_from_the_loop_thread() -> None:
    async def parent() -> tuple[int, int]:
        child = start_soon(_add, 20, 1)
        first = await child
        return first, await child  # awaiting a done handle works too

    assert run_sync(parent) == (21, 21)


def test_await_propagates_exceptions_and_cancellation_as_errors() -> None:
    exc = Boom("x")
    failing = start_soon(_raise, exc)
    gate = Gate()
    cancelled = start_soon(gate)
    assert gate.entered.wait(WAIT)
    cancelled.cancel()

    async def main() -> None:
        with pytest.raises(Boom):
            await failing
        # an Exception, not the awaiting task's own cancellation
        with pytest.raises(concurrent.futures.CancelledError):
            await cancelled

    asyncio.run(main())


def test_cancelling_the_awaiter_does_not_cancel_the_operation() -> None:
    gate = Gate()
    handle = start_soon(gate, 5)
    assert gate.entered.wait(WAIT)

    async def main() -> None:
        waiter = asyncio.ensure_future(_await(handle))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(main())
    assert not handle.done()
    assert handle._done_callbacks == []  # type: ignore[attr-defined]  # no stale wake-up left
    gate.release()
    assert handle.result(WAIT) == 5
    assert not gate.cancelled.is_set()


def test_await_outside_asyncio_waits_in_a_worker_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path for trio (through anyio), exercised on asyncio by hiding the asyncio loop."""
    asked = threading.Event()

    def no_asyncio_loop() -> None:
        asked.set()

    monkeypatch.setattr(_handle, "_running_asyncio_loop", no_asyncio_loop)
    gate = Gate()
    handle = start_soon(gate, 8)
    outcome: list[int] = []

    def release_once_awaited() -> None:
        assert asked.wait(WAIT)
        gate.release()

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_collect, handle, outcome)
            await anyio.to_thread.run_sync(release_once_awaited)

    anyio.run(main)
    assert outcome == [8]


async def _collect(handle: TaskHandle[int], outcome: list[int]) -> None:
    outcome.append(await handle)


@pytest.mark.parametrize("how", ["result", "await"])
def test_many_waiters_on_one_handle(how: str) -> None:
    gate = Gate()
    handle = start_soon(gate, 9)
    results: list[int] = []
    lock = threading.Lock()

    def wait() -> None:
        value = handle.result(WAIT) if how == "result" else asyncio.run(_await(handle))
        with lock:
            results.append(value)

    threads = [threading.Thread(target=wait) for _ in range(8)]
    for thread in threads:
        thread.start()
    gate.release()
    for thread in threads:
        thread.join(WAIT)
    assert results == [9] * 8


def test_works_with_concurrent_futures_helpers() -> None:
    handles = [start_soon(_add, i, i) for i in range(10)]
    values = sorted(h.result() for h in concurrent.futures.as_completed(handles, timeout=WAIT))
    assert values == [2 * i for i in range(10)]


def test_repr_names_the_function() -> None:
    handle = start_soon(_add, 1, 1)
    handle.result(WAIT)
    assert "_add" in repr(handle)
    assert "finished" in repr(handle)
