"""A peer's throughput, measured from the all-reduce rounds it takes part in (sans-IO).

Theory of operation
-------------------
The load balancer (:func:`swarmavg.proto.allreduce.load_balance`) splits the vector among a
group's members in proportion to their ``bandwidth``. A peer that was given none measures its
own: each all-reduce round it takes part in records, for every part it sends or receives, when
(the event loop's clock) and how many bytes; :class:`BandwidthEstimator` turns a round's records
into one rate and keeps an estimate over recent rounds, which the averager announces in
matchmaking from then on.

*A round's rate.* Dividing a round's bytes by its duration would not tell peers apart: every
member of a group waits for the slowest one, so a fast peer's round lasts as long as a slow
one's and it moves the same bytes under an even split. What a fast peer shows is *how fast its
data can flow while it flows*: the rate of its fastest stretch of ``window`` bytes
(:func:`peak_rate`), per direction, where ``window`` is ``window_fraction`` of the bytes the
round moved in that direction (at least ``min_window_bytes``), so that one burst (a socket
buffer read at once after a pause) cannot make it. The round's rate is the lower of the two
directions' (the all-reduce loads both about equally, so the slower one bounds the peer); a
direction that moved less than ``min_bytes`` is left out, and a round where both did says
nothing: small rounds are dominated by round trips, not by the link.

*The estimate* is the median of the last ``rounds`` rounds' rates (a median: a round disturbed
by CPU contention or a burst moves it little). :meth:`BandwidthEstimator.add_round` says when it
is worth a log line: the first estimate, and one that differs from the last one reported by at
least ``report_factor``.

Units: bytes per second, as the averager's ``bandwidth`` argument. Nothing here reads a clock:
the times are given (seconds on any monotonic clock).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable

__all__ = ["DEFAULT_MIN_BYTES", "BandwidthEstimator", "peak_rate"]

#: a direction of a round that moved less than this (bytes) says nothing about the link
DEFAULT_MIN_BYTES = 4 << 20


def peak_rate(
    start: float, events: Iterable[tuple[float, int]], window_bytes: float
) -> float | None:
    """The highest rate (bytes/s) at which ``window_bytes`` or more moved, over ``events``.

    ``events`` are ``(time, nbytes)``: ``nbytes`` finished moving at ``time``; ``start`` is
    when the transfers began (nothing moved before). For each event, the stretch that ends
    there is the shortest one, back to ``start`` or to an earlier event, that holds at least
    ``window_bytes`` (the bytes of the events after its first point, up to its end); its rate
    is those bytes over its duration. Events at the same time count as one; a stretch of
    duration 0 (bytes that came at ``start``) has no rate.

    :returns: the highest such rate, or ``None`` when no stretch holds ``window_bytes`` in a
        positive time (too few bytes, or every byte at one instant).
    :raises ValueError: ``window_bytes`` is not a positive finite number, or an event has a
        negative or non-integer byte count or a time that is not finite.
    """
    if not (window_bytes > 0 and math.isfinite(window_bytes)):
        raise ValueError(f"window_bytes must be a finite number > 0, not {window_bytes!r}")
    points: list[tuple[float, int]] = []
    for time, nbytes in events:
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"an event's byte count must be an int >= 0, not {nbytes!r}")
        if not math.isfinite(time):
            raise ValueError(f"an event's time must be finite, not {time!r}")
        if nbytes:
            points.append((max(time, start), nbytes))
    points.sort(key=lambda point: point[0])
    merged: list[tuple[float, int]] = []  # (bytes that came at one instant count together)
    for time, nbytes in points:
        if merged and merged[-1][0] == time:
            merged[-1] = (time, merged[-1][1] + nbytes)
        else:
            merged.append((time, nbytes))
    points = merged
    times = [start] + [time for time, _ in points]
    moved = [0]  # moved[i]: the bytes of the first i events
    for _, nbytes in points:
        moved.append(moved[-1] + nbytes)
    best: float | None = None
    first = 0  # the stretch ending at event ``end`` begins at point ``first``
    for end in range(1, len(times)):
        while first + 1 < end and moved[end] - moved[first + 1] >= window_bytes:
            first += 1
        amount = moved[end] - moved[first]
        duration = times[end] - times[first]
        if amount >= window_bytes and duration > 0:
            rate = amount / duration
            if best is None or rate > best:
                best = rate
    return best


class BandwidthEstimator:
    """This peer's throughput (bytes/s), from the rounds it took part in (see the module
    docstring).

    :param min_bytes: a direction of a round that moved fewer bytes is left out.
    :param window_fraction: a round's rate in one direction is its fastest stretch of this
        fraction of the bytes it moved that way...
    :param min_window_bytes: ...and of at least this many bytes.
    :param rounds: the estimate is the median of the last this many rounds' rates.
    :param report_factor: :meth:`add_round` says ``True`` when the estimate is first set or
        differs from the last one it said ``True`` for by at least this factor.
    :raises ValueError: an argument is out of range (the message names it).
    """

    def __init__(
        self,
        *,
        min_bytes: int = DEFAULT_MIN_BYTES,
        window_fraction: float = 0.125,
        min_window_bytes: int = 1 << 20,
        rounds: int = 5,
        report_factor: float = 2.0,
    ) -> None:
        if not (isinstance(min_bytes, int) and min_bytes >= 1):
            raise ValueError(f"min_bytes must be an int >= 1, not {min_bytes!r}")
        if not (0 < window_fraction <= 1):
            raise ValueError(f"window_fraction must be in (0, 1], not {window_fraction!r}")
        if not (isinstance(min_window_bytes, int) and min_window_bytes >= 1):
            raise ValueError(f"min_window_bytes must be an int >= 1, not {min_window_bytes!r}")
        if not (isinstance(rounds, int) and rounds >= 1):
            raise ValueError(f"rounds must be an int >= 1, not {rounds!r}")
        if not (report_factor > 1 and math.isfinite(report_factor)):
            raise ValueError(f"report_factor must be a finite number > 1, not {report_factor!r}")
        self.min_bytes = min_bytes
        self.window_fraction = window_fraction
        self.min_window_bytes = min_window_bytes
        self.report_factor = report_factor
        self._rates: deque[float] = deque(maxlen=rounds)
        self._reported: float | None = None

    @property
    def estimate(self) -> float | None:
        """The median of the recent rounds' rates (bytes/s); ``None`` before the first round
        that said something."""
        return statistics.median(self._rates) if self._rates else None

    def round_rate(
        self,
        start: float,
        sent: Iterable[tuple[float, int]],
        received: Iterable[tuple[float, int]],
    ) -> float | None:
        """One round's rate (bytes/s): the lower of the two directions' peak rates (each
        over stretches of ``window_fraction`` of its bytes, at least ``min_window_bytes``),
        leaving out a direction that moved fewer than ``min_bytes``; ``None`` if neither says
        anything. ``start``, ``sent`` and ``received`` are as :func:`peak_rate`'s ``start``
        and ``events``.

        :raises ValueError: an event is malformed (see :func:`peak_rate`).
        """
        rates = []
        for events in (list(sent), list(received)):
            total = sum(nbytes for _, nbytes in events)
            if total < self.min_bytes:
                continue
            window = max(total * self.window_fraction, self.min_window_bytes)
            rate = peak_rate(start, events, window)
            if rate is not None:
                rates.append(rate)
        return min(rates) if rates else None

    def add_round(
        self,
        start: float,
        sent: Iterable[tuple[float, int]],
        received: Iterable[tuple[float, int]],
    ) -> bool:
        """Take one round into the estimate (see :meth:`round_rate`; a round that says
        nothing changes nothing).

        :returns: whether the estimate is worth reporting: it was just set for the first time,
            or it differs from the last one reported by at least ``report_factor``.
        :raises ValueError: an event is malformed (see :func:`peak_rate`).
        """
        rate = self.round_rate(start, sent, received)
        if rate is None:
            return False
        self._rates.append(rate)
        estimate = self.estimate
        assert estimate is not None
        reported = self._reported
        if reported is None or not (
            reported / self.report_factor < estimate < reported * self.report_factor
        ):
            self._reported = estimate
            return True
        return False
