"""One exception out of a task group's exception group, for the public API's edges.

anyio's task groups wrap whatever fails inside them in an :class:`ExceptionGroup`, also a lone
exception of the ``async with`` body. ``except swarmavg.SwarmError`` does not catch a group, so
the public API (starting and stopping a Node, a DHT, an averager) raises the one exception that
a group stands for instead (see :func:`sole_error`).
"""

from __future__ import annotations

import asyncio

__all__ = ["sole_error"]


def sole_error(
    group: BaseExceptionGroup[BaseException], preferred: BaseException | None = None
) -> BaseException:
    """The exception to raise in place of ``group``.

    ``preferred`` (the exception of the ``async with`` body, the caller's own) if it is in the
    group, nested or not (a group of the caller's own is kept whole); else an exception that
    must not be lost (``KeyboardInterrupt``, ``SystemExit``); else the first ``Exception``;
    else the first of them (a cancellation). Any others are named in notes on the one returned
    (``exc.__notes__``), so nothing that failed goes unmentioned.
    """
    leaves = _leaves(group, preferred)
    if preferred is not None and any(leaf is preferred for leaf in leaves):
        chosen = preferred
    else:
        chosen = next(
            (leaf for leaf in leaves if not isinstance(leaf, Exception | asyncio.CancelledError)),
            None,
        ) or next((leaf for leaf in leaves if isinstance(leaf, Exception)), leaves[0])
    for other in leaves:
        if other is not chosen:
            chosen.add_note(f"(at the same time: {type(other).__name__}: {other})")
    return chosen


def _leaves(exc: BaseException, keep: BaseException | None) -> list[BaseException]:
    if exc is keep or not isinstance(exc, BaseExceptionGroup):
        return [exc]
    return [leaf for sub in exc.exceptions for leaf in _leaves(sub, keep)]
