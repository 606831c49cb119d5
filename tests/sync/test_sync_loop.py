"""The loop thread: run_sync, lazy start, shutdown, thread safety, misuse from the loop thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import gc
import logging
import threading

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
from anyio.from_thread import BlockingPortal

import swarmavg.sync
from swarmavg.sync import (
    THREAD_NAME,
    TaskHandle,
    _loop,
    get_portal,
    in_loop_thread,
    run_sync,
    shutdown_loop,
    start_soon,
)

pytestmark = pytest.mark.timeout(10)

WAIT = 5.0


def loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


async def _thread_info() -> tuple[int, str, bool]:
    await anyio.lowlevel.checkpoint()
    thread = threading.current_thread()
    return threading.get_ident(), thread.name, in_loop_thread()


async def _echo(value: int) -> int:
    await anyio.lowlevel.checkpoint()
    return value


class Parked:
    """Parks forever; records that it started and that it saw cancellation."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.cancelled = threading.Event()

    async def __call__(self) -> None:
        self.entered.set()
        try:
            await anyio.sleep_forever()
        finally:
            self.cancelled.set()


def test_public_api() -> None:
    assert sorted(swarmavg.sync.__all__) == [
        "THREAD_NAME",
        "TaskHandle",
        "call",
        "get_portal",
        "in_loop_thread",
        "run_sync",
        "shutdown_loop",
        "start_soon",
    ]
    for name in swarmavg.sync.__all__:
        assert getattr(swarmavg.sync, name) is not None


def test_lazy_start_one_named_thread() -> None:
    assert loop_threads() == []
    ident, name, on_loop = run_sync(_thread_info)
    assert (name, on_loop) == (THREAD_NAME, True)
    assert ident != threading.get_ident()
    assert not in_loop_thread()
    assert [t.ident for t in loop_threads()] == [ident]
    assert run_sync(_thread_info)[0] == ident  # the same thread serves every call
    assert isinstance(get_portal(), BlockingPortal)
    assert len(loop_threads()) == 1


def test_portal_runs_on_the_same_loop() -> None:
    ident = run_sync(_thread_info)[0]
    assert get_portal().call(_thread_info)[0] == ident


def test_run_sync_passes_arguments_and_context() -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    var.set("caller")

    async def read() -> str:
        return var.get()

    assert run_sync(_echo, 11) == 11
    assert run_sync(read) == "caller"  # runs in a copy of the caller's context


def test_run_sync_timeout_cancels_the_task() -> None:
    parked = Parked()
    with pytest.raises(TimeoutError, match="cancelled"):
        run_sync(parked, timeout=0.05)
    assert parked.cancelled.wait(WAIT)


def test_run_sync_on_the_loop_thread_raises() -> None:
    async def nested() -> int:
        return run_sync(_echo, 1)

    with pytest.raises(RuntimeError, match="deadlock"):
        run_sync(nested)


def test_start_soon_on_the_loop_thread_works() -> None:
    async def spawn() -> TaskHandle[int]:
        return start_soon(_echo, 4)

    assert run_sync(spawn).result(WAIT) == 4


def test_shutdown_on_the_loop_thread_raises() -> None:
    async def stop() -> None:
        shutdown_loop()

    with pytest.raises(RuntimeError, match="loop thread"):
        run_sync(stop)


def test_shutdown_cancels_outstanding_tasks_and_is_idempotent() -> None:
    parked = [Parked() for _ in range(3)]
    handles = [start_soon(p) for p in parked]
    for p in parked:
        assert p.entered.wait(WAIT)
    portal_parked = Parked()
    portal_future = get_portal().start_task_soon(portal_parked)
    assert portal_parked.entered.wait(WAIT)

    shutdown_loop()

    assert all(h.cancelled() for h in handles)
    assert all(p.cancelled.is_set() for p in parked)  # cleanup finished before shutdown returned
    assert portal_future.cancelled()
    assert portal_parked.cancelled.is_set()
    assert loop_threads() == []
    shutdown_loop()  # idempotent
    shutdown_loop(timeout=0)


def test_tasks_cannot_start_work_while_their_loop_shuts_down() -> None:
    outcome: list[str] = []
    entered = threading.Event()

    async def cleanup_spawns() -> None:
        entered.set()
        try:
            await anyio.sleep_forever()
        finally:
            try:
                start_soon(_echo, 1)
            except RuntimeError as exc:
                outcome.append(str(exc))

    start_soon(cleanup_spawns)
    assert entered.wait(WAIT)
    shutdown_loop()
    assert outcome == ["the swarmavg event loop is shutting down"]
    assert loop_threads() == []


def test_shutdown_without_a_loop_is_a_no_op() -> None:
    shutdown_loop()
    assert loop_threads() == []


def test_shutdown_leaves_no_worker_threads() -> None:
    before = set(threading.enumerate())

    async def use_worker_thread() -> int:
        return await anyio.to_thread.run_sync(threading.get_ident)

    assert run_sync(use_worker_thread) != threading.get_ident()
    shutdown_loop()
    assert set(threading.enumerate()) <= before


def test_stopping_the_loop_starts_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """At interpreter exit, where the loop stops, Python 3.12 refuses to start a thread; here
    every version refuses. The loop's default executor (``loop.getaddrinfo``) and anyio's
    worker threads were in use, and their threads are joined, not left behind."""
    before = set(threading.enumerate())

    async def use_worker_threads() -> None:
        loop = asyncio.get_running_loop()
        assert await loop.getaddrinfo("127.0.0.1", 0)
        await loop.run_in_executor(None, threading.get_ident)
        await anyio.to_thread.run_sync(threading.get_ident)

    run_sync(use_worker_threads)
    started: list[str] = []

    def refuse(thread: threading.Thread) -> None:
        started.append(thread.name)
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    shutdown_loop(timeout=WAIT)  # (a crashed loop logs at CRITICAL, which fails the test)
    monkeypatch.undo()
    assert started == []
    assert set(threading.enumerate()) <= before


def test_facades_left_running_are_shut_down_at_exit_newest_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What the exit hook does before it stops the loop: ``shutdown()`` of every facade that
    registered, newest first; one that raises is logged and the next goes on; a facade that
    became garbage is not kept alive for it."""
    closed: list[str] = []

    class Facade:
        def __init__(self, name: str, fails: bool = False) -> None:
            self.name, self.fails = name, fails

        def shutdown(self) -> None:
            closed.append(self.name)
            if self.fails:
                raise ValueError("cannot")

    facades = [Facade("dht"), Facade("averager", fails=True), Facade("optimizer")]
    for facade in facades:
        _loop.shut_down_at_exit(facade)
    gone = Facade("gone")
    _loop.shut_down_at_exit(gone)
    del gone
    gc.collect()
    with caplog.at_level(logging.DEBUG, logger="swarmavg.sync"):
        _loop._shut_facades_down()
    assert closed == ["optimizer", "averager", "dht"]
    assert "shutting <" in caplog.text
    assert "ValueError: cannot" in caplog.text
    _loop._shut_facades_down()  # (each once)
    assert closed == ["optimizer", "averager", "dht"]


def test_a_fresh_loop_starts_after_shutdown() -> None:
    run_sync(_echo, 1)
    (first,) = loop_threads()
    old_portal = get_portal()
    shutdown_loop()
    assert not first.is_alive()
    assert run_sync(_echo, 3) == 3
    (second,) = loop_threads()
    assert second is not first
    assert get_portal() is not old_portal


def test_handle_pending_at_shutdown_ends_cancelled_and_wait_returns() -> None:
    parked = Parked()
    handle = start_soon(parked)
    assert parked.entered.wait(WAIT)
    waiter = concurrent.futures.ThreadPoolExecutor(1)
    try:
        blocked = waiter.submit(handle.exception)
        shutdown_loop()
        with pytest.raises(concurrent.futures.CancelledError):
            blocked.result(WAIT)
    finally:
        waiter.shutdown()


def test_concurrent_callers() -> None:
    def worker(base: int) -> list[int]:
        return [run_sync(_echo, base + i) for i in range(50)]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(worker, range(0, 1600, 100)))
    assert results == [list(range(base, base + 50)) for base in range(0, 1600, 100)]
    assert len(loop_threads()) == 1


def test_concurrent_first_use_starts_one_loop() -> None:
    barrier = threading.Barrier(8)

    def first_call() -> int:
        barrier.wait(WAIT)
        return run_sync(_thread_info)[0]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        idents = set(pool.map(lambda _: first_call(), range(8)))
    assert len(idents) == 1
    assert len(loop_threads()) == 1


def test_submissions_racing_shutdown_all_settle() -> None:
    """Every handle that start_soon returned ends (value or cancelled), whatever the timing."""
    stop = threading.Event()
    settled: list[TaskHandle[None]] = []
    stuck: list[TaskHandle[None]] = []
    lock = threading.Lock()

    def submit() -> None:
        while not stop.is_set():
            try:
                handle = start_soon(anyio.sleep, 0)
            except RuntimeError:  # refused: the loop was shutting down at that instant
                continue
            done, _ = concurrent.futures.wait([handle], timeout=WAIT)
            with lock:
                (settled if done else stuck).append(handle)

    threads = [threading.Thread(target=submit) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(10):
            run_sync(anyio.sleep, 0)
            shutdown_loop()
    finally:
        stop.set()
        for thread in threads:
            thread.join(WAIT)
    assert stuck == []
    assert settled
