"""Synchronous access to swarmavg: one process-wide event-loop thread and handles to its tasks.

Every synchronous facade call becomes a task on a single thread (``swarmavg-loop``) running an
anyio event loop on the asyncio backend. The thread starts on first use and stops at interpreter
exit or on :func:`shutdown_loop`.

* :func:`run_sync` — run a coroutine function there and block for its result.
* :func:`start_soon` — run it there and get a :class:`TaskHandle` (a
  :class:`concurrent.futures.Future` that also cancels the task and can be awaited from any
  asyncio loop).
* :func:`call` — either of the two, chosen by a ``wait`` flag; facades type it with ``@overload``
  on ``Literal`` (see :mod:`swarmavg.sync._facade`).
* :func:`get_portal` — the loop's anyio ``BlockingPortal``, for everything else.
"""

from swarmavg.sync._facade import call
from swarmavg.sync._handle import TaskHandle
from swarmavg.sync._loop import (
    THREAD_NAME,
    get_portal,
    in_loop_thread,
    run_sync,
    shutdown_loop,
    start_soon,
)

__all__ = [
    "THREAD_NAME",
    "TaskHandle",
    "call",
    "get_portal",
    "in_loop_thread",
    "run_sync",
    "shutdown_loop",
    "start_soon",
]
