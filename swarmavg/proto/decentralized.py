"""Epochs of the decentralized optimizers (sans-IO): progress records, their aggregation, when
to end an epoch, when a peer is out of sync, when the next round starts.

Theory of operation
-------------------
:class:`swarmavg.DecentralizedOptimizer` (Moshpit SGD) counts its progress in *epochs* of
optimizer **steps** (not samples, unlike :mod:`swarmavg.proto.progress`): an epoch ends once the
peers at the highest epoch together took ``total_steps_in_epoch`` steps in it. Each peer
publishes an :class:`EpochRecord` ``{"epoch", "step", "time"}`` (its epoch, its steps in that
epoch, the DHT time it said so) under the DHT key :func:`epoch_key` with its owner subkey (so
nobody else can write it), after each step; each peer reads everyone's and keeps the latest
(:meth:`EpochAccounting.apply_fetch`).

:meth:`EpochAccounting.view` folds them with this peer's own counters (always the current
ones, never its stale published record) into an :class:`EpochView`: ``max_epoch`` the highest
epoch of anyone, ``total_steps`` the sum of the steps of the peers **at** ``max_epoch``.

Before each optimizer step, :meth:`EpochAccounting.before_step` decides:

1. this peer is more than ``max_allowed_epoch_difference`` epochs behind: ``"resync"`` (the
   caller downloads the state and calls :meth:`EpochAccounting.resynced`; no step is taken);
2. it is behind, within the allowance: it adopts ``max_epoch`` with zero steps;
3. the epoch's steps are complete: ``local_epoch += 1`` and zero steps. The aggregation is
   recomputed from the records each time, so the records of the epoch just ended stop
   counting at once (hivemind's seed cached the total and incremented the epoch again at each
   step until its next fetch: the runaway epoch).

Nothing here reads a clock or touches the network: what needs the time takes ``now`` (DHT
time, see :func:`swarmavg.get_dht_time`), so the tests drive it on a fake clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from swarmavg.errors import RemoteProtocolError

__all__ = [
    "EpochAccounting",
    "EpochRecord",
    "EpochView",
    "epoch_key",
    "next_round_time",
]

#: The largest epoch or step count a record may carry.
MAX_COUNT: Final = 2**62
#: The most fields a record may have (unknown fields are ignored, up to this many).
_MAX_FIELDS: Final = 16


def epoch_key(prefix: str) -> str:
    """The DHT key of a run's epoch records (hivemind's seed name): ``f"{prefix}.progress"``."""
    return f"{prefix}.progress"


def _count(value: object) -> bool:
    return type(value) is int and 0 <= value <= MAX_COUNT


@dataclass(frozen=True, slots=True)
class EpochRecord:
    """One peer's progress as it publishes it: its epoch, its optimizer steps in that epoch, and
    the DHT time it said so."""

    epoch: int
    step: int
    time: float

    def __post_init__(self) -> None:
        if not _count(self.epoch):
            raise ValueError(f"epoch must be an int in [0, 2**62], not {self.epoch!r:.40}")
        if not _count(self.step):
            raise ValueError(f"step must be an int in [0, 2**62], not {self.step!r:.40}")
        if not (isinstance(self.time, float) and math.isfinite(self.time)):
            raise ValueError(f"time must be a finite float, not {self.time!r:.40}")

    def to_wire(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "time": self.time}

    @classmethod
    def from_wire(cls, value: Any) -> EpochRecord:
        """Parse a record read from the DHT.

        :raises RemoteProtocolError: not a mapping with an int ``epoch`` and ``step`` in
            ``[0, 2**62]`` and a finite float ``time`` (at most 16 fields).
        """
        if not isinstance(value, dict) or len(value) > _MAX_FIELDS:
            raise RemoteProtocolError("an epoch record must be a small mapping")
        epoch, step, time = value.get("epoch"), value.get("step"), value.get("time")
        if not (_count(epoch) and _count(step)):
            raise RemoteProtocolError("an epoch record needs int epoch and step in [0, 2**62]")
        if type(time) is int:
            time = float(time)
        if not (isinstance(time, float) and math.isfinite(time)):
            raise RemoteProtocolError("an epoch record needs a finite time")
        assert isinstance(epoch, int)
        assert isinstance(step, int)
        return cls(epoch, step, time)


@dataclass(frozen=True, slots=True)
class EpochView:
    """The run's progress as this peer sees it: the highest epoch, the steps taken in it by the
    peers at it (this one included), and how many peers published (this one included)."""

    max_epoch: int
    total_steps: int
    num_peers: int


class EpochAccounting:
    """One peer's epoch counters and its latest read of the others' records.

    :param total_steps_in_epoch: steps over the peers at the highest epoch that end it (> 0).
    :param max_allowed_epoch_difference: a peer more epochs behind than this resyncs (≥ 0).
    :param expiration: records older than this many seconds (by their ``time``) are ignored
        (the DHT drops them too; this also bounds a clock that runs ahead).
    :raises ValueError: an argument is out of range (named).
    """

    def __init__(
        self,
        total_steps_in_epoch: int,
        max_allowed_epoch_difference: int,
        expiration: float = math.inf,
    ) -> None:
        if type(total_steps_in_epoch) is not int or total_steps_in_epoch < 1:
            raise ValueError(
                f"total_steps_in_epoch must be an int > 0, not {total_steps_in_epoch!r:.40}"
            )
        if type(max_allowed_epoch_difference) is not int or max_allowed_epoch_difference < 0:
            raise ValueError(
                "max_allowed_epoch_difference must be an int >= 0, not "
                f"{max_allowed_epoch_difference!r:.40}"
            )
        if not (isinstance(expiration, int | float) and expiration > 0):
            raise ValueError(f"expiration must be a number > 0, not {expiration!r:.40}")
        self.total_steps_in_epoch = total_steps_in_epoch
        self.max_allowed_epoch_difference = max_allowed_epoch_difference
        self.expiration = float(expiration)
        self.local_epoch = 0
        self.local_step = 0
        self._others: dict[Any, EpochRecord] = {}
        self._read_at = -math.inf

    # -- reads -------------------------------------------------------------------------------

    def apply_fetch(self, records: Mapping[Any, EpochRecord], now: float) -> None:
        """Replace the others' records with a fresh read (``records`` keyed by peer; the caller
        leaves its own out). Records older than ``expiration`` are dropped."""
        self._others = {
            peer: record for peer, record in records.items() if now - record.time <= self.expiration
        }
        self._read_at = now

    def view(self, now: float | None = None) -> EpochView:
        """The highest epoch and the steps taken in it, from the last read and this peer's
        current counters (``now``: drop records that expired since the read)."""
        others = [
            r for r in self._others.values() if now is None or now - r.time <= self.expiration
        ]
        max_epoch = max([self.local_epoch, *(r.epoch for r in others)])
        total = sum(r.step for r in others if r.epoch == max_epoch)
        if self.local_epoch == max_epoch:
            total += self.local_step
        return EpochView(max_epoch, total, 1 + len(others))

    def is_synchronized(self, now: float | None = None) -> bool:
        """Whether this peer is at most ``max_allowed_epoch_difference`` epochs behind."""
        return self.local_epoch + self.max_allowed_epoch_difference >= self.view(now).max_epoch

    def record(self, now: float) -> EpochRecord:
        """What to publish now."""
        return EpochRecord(self.local_epoch, self.local_step, float(now))

    # -- transitions -------------------------------------------------------------------------

    def before_step(self, now: float | None = None) -> Literal["resync", "step"]:
        """Decide what the coming step does (see the module's docstring): ``"resync"`` (take
        no step; download the state, then :meth:`resynced`) or ``"step"`` (the epoch was
        adopted or ended as needed; take the step, then :meth:`stepped`)."""
        view = self.view(now)
        if self.local_epoch + self.max_allowed_epoch_difference < view.max_epoch:
            return "resync"
        if self.local_epoch < view.max_epoch:
            self.local_epoch, self.local_step = view.max_epoch, 0
            view = self.view(now)
        if view.total_steps >= self.total_steps_in_epoch:
            self.local_epoch, self.local_step = self.local_epoch + 1, 0
        return "step"

    def stepped(self) -> None:
        """This peer took one optimizer step."""
        self.local_step += 1

    def resynced(self, epoch: int | None = None) -> None:
        """This peer downloaded the state (of a peer at ``epoch``, if known): it moves to the
        highest epoch it knows with zero steps."""
        known = self.view().max_epoch
        given = epoch if epoch is not None and _count(epoch) else 0
        self.local_epoch = max(self.local_epoch, known, given)
        self.local_step = 0

    def adopt(self) -> bool:
        """Move to ``max_epoch`` (zero steps) if behind within the allowance; whether it did.
        (A peer that just joined uses it, so that its epoch and learning rate are right at
        once.)"""
        view = self.view()
        if (
            self.local_epoch
            < view.max_epoch
            <= (self.local_epoch + self.max_allowed_epoch_difference)
        ):
            self.local_epoch, self.local_step = view.max_epoch, 0
            return True
        return False


def next_round_time(now: float, period: float) -> float:
    """The next multiple of ``period`` seconds at or after ``now`` (DHT time): peers that wait
    until then start their rounds together. ``period`` 0: ``now``.

    :raises ValueError: ``period`` is negative or not finite.
    """
    if not (isinstance(period, int | float) and math.isfinite(period) and period >= 0):
        raise ValueError(f"period must be a finite number >= 0, not {period!r:.40}")
    if period == 0:
        return now
    return math.ceil(now / period) * period
