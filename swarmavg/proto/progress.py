"""Training progress across a collaborative run (sans-IO): records, the samples/s EMA, accounting.

Theory of operation
-------------------
Peers that train together count progress in *epochs*: an epoch ends once the swarm as a whole
has accumulated ``target_batch_size`` samples (hivemind's ``ProgressTracker``). Each peer
publishes a :class:`LocalTrainingProgress` record in the DHT (its epoch, the samples it has
accumulated towards the next epoch, its samples/s, when it said so); each peer periodically
reads every peer's record and folds them, with its own, into a :class:`GlobalTrainingProgress`
(:func:`aggregate_progress`):

* the global epoch is the highest epoch of this peer and of every *non-client* peer (a client,
  behind NAT, counts in ``num_peers`` and ``num_clients`` but never raises the epoch);
* the samples towards the next epoch are the sums over peers **at** the global epoch, and the
  estimate of where they are now extrapolates each one's count with its samples/s since its
  report, by at most its latest step (a peer publishes after each step: one whose record
  grows old is not training);
* the ETA of the epoch's end divides what is missing by the samples/s of **all** peers (a peer
  one epoch behind will soon catch up and contribute);
* the next read is due after a fraction of the ETA, so that peers joining or leaving (the
  expected drift) do not make us miss the end, clipped to ``[min_refresh_period,
  max_refresh_period]`` (``min_refresh_period`` while a peer at the epoch has no speed yet);
  with no record at all, our own numbers and ``default_refresh_period``.

:class:`ProgressAccounting` is the state of one peer: its local record, the global progress it
last computed, its samples/s EMA, and the rules that change them: ``report_local_progress``
(adds our new samples to the global count at once when we are at the global epoch),
``update_epoch`` (only while paused), ``apply_fetch`` (a read of the DHT, discarded if a pause
began since it started), ``record_to_publish`` (what to store, if anything: a peer that has
not accumulated samples since the epoch before the global one, e.g. an auxiliary peer, does
not publish), ``ready_to_update_epoch``. Nothing here reads a clock or touches the network:
every method that needs the time takes ``now`` (DHT time, seconds, see
:func:`swarmavg.get_dht_time`), so the tests drive it on a fake clock.

Records come from other peers: :meth:`LocalTrainingProgress.from_wire` accepts exactly the
types and ranges below and raises :class:`~swarmavg.errors.RemoteProtocolError` on anything
else; the caller ignores such a record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from swarmavg.errors import RemoteProtocolError

__all__ = [
    "MAX_HYPERPARAMETERS_LENGTH",
    "GlobalTrainingProgress",
    "LocalTrainingProgress",
    "PerformanceEMA",
    "ProgressAccounting",
    "ProgressSettings",
    "aggregate_progress",
    "hyperparameters_digest",
    "progress_key",
]

#: The longest ``hyperparameters`` digest a record may carry (characters).
MAX_HYPERPARAMETERS_LENGTH: Final = 128
#: The most fields a record may have (unknown fields are ignored, up to this many).
_MAX_FIELDS: Final = 32
#: A peer ID on the wire is at most this long (ours: 38 bytes).
_MAX_PEER_ID_LENGTH: Final = 64
#: Added to a sum of samples/s so that an ETA is never a division by zero (hivemind's eps).
EPS: Final = 1e-20
#: A record at most this many of its peer's steps old is recent (see ``num_active_peers``) ...
ACTIVE_STEPS: Final = 10
#: ... or at most this many seconds old, whichever is longer.
ACTIVE_SECONDS: Final = 5.0
#: A record's samples/s at most this means "not measured yet" (a peer's first step).
_UNKNOWN_SPEED: Final = 1e-9
#: One interval of :meth:`PerformanceEMA.update` counts as at most this many times what the
#: estimate predicts for its task.
MAX_INTERVAL_RATIO: Final = 4.0


def progress_key(prefix: str) -> str:
    """The DHT key of a run's progress records (hivemind's name): ``f"{prefix}_progress"``."""
    return f"{prefix}_progress"


def hyperparameters_digest(hyperparameters: Mapping[str, Any]) -> str:
    """A short stable digest (16 hex characters) of a run's hyperparameters, for
    :attr:`LocalTrainingProgress.hyperparameters`: peers that publish different digests train
    with different settings and will diverge (hivemind #443).

    The mapping is written as JSON with sorted keys; values JSON cannot hold (a class, a
    scheduler's lambda) are written as their ``repr``, so pass values whose ``repr`` is stable
    across processes (a class's qualified name rather than the class, say).

    :raises TypeError: ``hyperparameters`` is not a mapping with string keys.
    """
    if not isinstance(hyperparameters, Mapping):
        raise TypeError(f"hyperparameters must be a mapping, not {type(hyperparameters).__name__}")
    if not all(isinstance(key, str) for key in hyperparameters):
        raise TypeError("hyperparameters must have string keys")
    text = json.dumps(dict(hyperparameters), sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# -- records ---------------------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_float(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class LocalTrainingProgress:
    """One peer's progress, as it publishes it in the DHT (hivemind's record, plus a digest).

    :ivar peer_id: the peer's binary PeerID (``PeerID.to_bytes()``).
    :ivar epoch: the peer's local epoch (≥ 0).
    :ivar samples_accumulated: samples it accumulated towards the end of ``epoch`` (≥ 0).
    :ivar samples_per_second: its training speed, the EMA of :class:`PerformanceEMA` (≥ 0).
    :ivar time: when it reported this (DHT time, seconds).
    :ivar client_mode: whether it is a client (a client's epoch never raises the global one).
    :ivar hyperparameters: a digest of its optimizer's hyperparameters
        (:func:`hyperparameters_digest`), or ``None``.
    :ivar step_samples: the samples of its latest step (≥ 0; 0: unknown). A peer publishes
        after each step, so the others extrapolate its count by at most one step: one that
        stopped reporting (evaluating, checkpointing, stalled) is not counted as training.
    """

    peer_id: bytes
    epoch: int
    samples_accumulated: int
    samples_per_second: float
    time: float
    client_mode: bool
    hyperparameters: str | None = None
    step_samples: int = 0

    def __post_init__(self) -> None:
        problem = _record_problem(dataclasses.asdict(self))
        if problem is not None:
            raise ValueError(f"invalid training progress record: {problem}")

    def to_wire(self) -> dict[str, Any]:
        """The record as the DHT value (a msgpack map; hivemind's field names)."""
        wire: dict[str, Any] = {
            "peer_id": self.peer_id,
            "epoch": self.epoch,
            "samples_accumulated": self.samples_accumulated,
            "samples_per_second": float(self.samples_per_second),
            "time": float(self.time),
            "client_mode": self.client_mode,
        }
        if self.hyperparameters is not None:
            wire["hyperparameters"] = self.hyperparameters
        if self.step_samples:
            wire["step_samples"] = self.step_samples
        return wire

    @classmethod
    def from_wire(cls, value: Any) -> LocalTrainingProgress:
        """Parse a record another peer published (strictly: ints are ints, not bools; floats
        are finite floats; unknown fields are ignored).

        :raises RemoteProtocolError: ``value`` is not a valid record.
        """
        if not isinstance(value, dict):
            raise RemoteProtocolError(
                f"a progress record must be a map, not {type(value).__name__}"
            )
        if len(value) > _MAX_FIELDS:
            raise RemoteProtocolError(f"a progress record with {len(value)} fields")
        fields: dict[str, Any] = {
            name: value.get(name)
            for name in (
                "peer_id",
                "epoch",
                "samples_accumulated",
                "samples_per_second",
                "time",
                "client_mode",
                "hyperparameters",
                "step_samples",
            )
        }
        if fields["step_samples"] is None:
            fields["step_samples"] = 0
        for name, field in fields.items():
            if field is None and name != "hyperparameters":
                raise RemoteProtocolError(f"a progress record without {name}")
        problem = _record_problem(fields)
        if problem is not None:
            raise RemoteProtocolError(f"invalid progress record: {problem}")
        return cls(**fields)


def _record_problem(fields: Mapping[str, Any]) -> str | None:
    """What is wrong with a record's fields, or ``None``."""
    peer_id = fields["peer_id"]
    if not isinstance(peer_id, bytes) or not 0 < len(peer_id) <= _MAX_PEER_ID_LENGTH:
        return f"peer_id must be 1..{_MAX_PEER_ID_LENGTH} bytes"
    for name in ("epoch", "samples_accumulated", "step_samples"):
        if not _is_int(fields[name]) or fields[name] < 0:
            return f"{name} must be an int ≥ 0, not {fields[name]!r:.40}"
    speed = fields["samples_per_second"]
    if not _is_finite_float(speed) or speed < 0:
        return f"samples_per_second must be a finite float ≥ 0, not {speed!r:.40}"
    if not _is_finite_float(fields["time"]):
        return f"time must be a finite float, not {fields['time']!r:.40}"
    if not isinstance(fields["client_mode"], bool):
        return f"client_mode must be a bool, not {fields['client_mode']!r:.40}"
    digest = fields["hyperparameters"]
    if digest is not None and (
        not isinstance(digest, str) or not 0 < len(digest) <= MAX_HYPERPARAMETERS_LENGTH
    ):
        return (
            f"hyperparameters must be None or a str of 1..{MAX_HYPERPARAMETERS_LENGTH} characters"
        )
    return None


@dataclass(frozen=True, slots=True)
class GlobalTrainingProgress:
    """The swarm's progress as one peer estimates it (immutable: a new one replaces it).

    :ivar epoch: the global epoch (the highest of ours and of non-client peers').
    :ivar samples_accumulated: samples reported towards the end of ``epoch`` by peers at it.
    :ivar target_batch_size: samples per epoch.
    :ivar num_peers: peers with a live record (us included if we published one).
    :ivar num_clients: how many of them are clients.
    :ivar eta_next_epoch: when the epoch is expected to end (DHT time; ``inf``: unknown).
    :ivar next_fetch_time: when the tracker reads the records again (DHT time).
    :ivar num_active_peers: peers whose record is recent: at most :data:`ACTIVE_STEPS` of its
        steps old, or :data:`ACTIVE_SECONDS` (a peer publishes after each step; one whose
        record is older is dead, stalled or between runs, and will not look for the next
        group). What a training loop expects to average with.
    """

    epoch: int
    samples_accumulated: int
    target_batch_size: int
    num_peers: int
    num_clients: int
    eta_next_epoch: float
    next_fetch_time: float
    num_active_peers: int = 0


# -- the samples/s EMA -----------------------------------------------------------------------------


class PerformanceEMA:
    """A running estimate of speed (samples per second): a bias-corrected exponential moving
    average of seconds per sample (hivemind's ``PerformanceEMA``), on a clock the caller reads.

    The time of an update is the interval since the previous update (or :meth:`reset_timer`,
    or construction). While paused (:meth:`pause`, :meth:`resume`; pauses nest) that time does
    not count: an update without an explicit ``interval`` changes nothing, and resuming resets
    the timer. After the first update, an interval counts as at most :data:`MAX_INTERVAL_RATIO`
    times what the estimate predicts for its task (hivemind counts it whole): a pause in
    training such as an evaluation would otherwise read as a slowdown for dozens of updates.

    :param alpha: smoothing factor in (0, 1]: the weight of the newest interval.
    :param eps: the speed before any update, and the floor of seconds per sample.
    :param now: the clock's reading at construction (seconds).
    :raises ValueError: ``alpha`` or ``eps`` out of range.
    """

    __slots__ = ("_pauses", "alpha", "ema_seconds_per_sample", "eps", "num_updates",
                 "samples_per_second", "timestamp")  # fmt: skip

    def __init__(self, alpha: float = 0.1, eps: float = EPS, *, now: float = 0.0) -> None:
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha <= 1:
            raise ValueError(f"performance_ema_alpha must be in (0, 1], not {alpha!r:.40}")
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < 1:
            raise ValueError(f"eps must be in (0, 1), not {eps!r:.40}")
        self.alpha = float(alpha)
        self.eps = float(eps)
        self.num_updates = 0
        self.ema_seconds_per_sample = 0.0
        #: The current estimate (``eps`` before the first update).
        self.samples_per_second = self.eps
        #: When the interval of the next update began.
        self.timestamp = float(now)
        self._pauses = 0

    @property
    def paused(self) -> bool:
        return self._pauses > 0

    def update(self, task_size: float, now: float, interval: float | None = None) -> float:
        """Count ``task_size`` items processed since the last update (``interval`` seconds, or
        ``now - timestamp``); return the new samples/s.

        :raises ValueError: ``task_size`` is not positive, or ``interval`` negative.
        """
        if not task_size > 0:
            raise ValueError(f"task_size must be positive, not {task_size!r:.40}")
        if interval is None:
            if self.paused:
                return self.samples_per_second  # (paused time does not count)
            interval = max(0.0, now - self.timestamp)  # (a clock that stepped back: 0)
            self.timestamp = now
        elif not interval >= 0:
            raise ValueError(f"interval must be ≥ 0, not {interval!r:.40}")
        if self.num_updates > 0:
            # A pause in training (an evaluation, a checkpoint) is not a slowdown: one interval
            # counts as at most MAX_INTERVAL_RATIO times the time the estimate predicts; a real
            # slowdown still shows, over a few updates.
            predicted = task_size / self.samples_per_second
            interval = min(interval, MAX_INTERVAL_RATIO * predicted)
        self.ema_seconds_per_sample = (
            self.alpha * interval / task_size + (1 - self.alpha) * self.ema_seconds_per_sample
        )
        self.num_updates += 1
        adjusted = self.ema_seconds_per_sample / (1 - (1 - self.alpha) ** self.num_updates)
        self.samples_per_second = 1 / max(adjusted, self.eps)
        return self.samples_per_second

    def reset_timer(self, now: float) -> None:
        """Start the next interval at ``now`` (the time until now is not counted)."""
        self.timestamp = now

    def pause(self) -> None:
        """Stop counting time (until the matching :meth:`resume`)."""
        self._pauses += 1

    def resume(self, now: float) -> None:
        """Undo one :meth:`pause`; the timer restarts at ``now``.

        :raises RuntimeError: not paused.
        """
        if self._pauses == 0:
            raise RuntimeError("resume() without pause()")
        self._pauses -= 1
        self.reset_timer(now)

    def __repr__(self) -> str:
        return f"PerformanceEMA(ema={self.samples_per_second:.5f}, num_updates={self.num_updates})"


# -- accounting ------------------------------------------------------------------------------------


def _check_number(name: str, value: object, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(
            f"{name} must be a finite number {'> 0' if positive else '≥ 0'}, not {value!r}"
        )
    return float(value)


@dataclass(frozen=True, slots=True)
class ProgressSettings:
    """What the accounting needs to know of the run (hivemind's tracker arguments).

    :param target_batch_size: samples per epoch, over the whole swarm (an int > 0).
    :param min_refresh_period: read the records at most this often (seconds).
    :param max_refresh_period: read them at least this often (seconds).
    :param default_refresh_period: how often to read while no record is found (seconds).
    :param expected_drift_peers: assume this many peers may join before the epoch ends.
    :param expected_drift_rate: assume this fraction of the swarm may join before it ends.
    :raises TypeError: an argument has the wrong type (named).
    :raises ValueError: an argument is out of range (named).
    """

    target_batch_size: int
    min_refresh_period: float = 0.5
    max_refresh_period: float = 10.0
    default_refresh_period: float = 3.0
    expected_drift_peers: float = 3.0
    expected_drift_rate: float = 0.2

    def __post_init__(self) -> None:
        if not _is_int(self.target_batch_size):
            raise TypeError(
                f"target_batch_size must be an int, not {type(self.target_batch_size).__name__}"
            )
        if self.target_batch_size <= 0:
            raise ValueError(f"target_batch_size must be > 0, not {self.target_batch_size}")
        _check_number("min_refresh_period", self.min_refresh_period)
        _check_number("max_refresh_period", self.max_refresh_period, positive=True)
        _check_number("default_refresh_period", self.default_refresh_period, positive=True)
        _check_number("expected_drift_peers", self.expected_drift_peers)
        _check_number("expected_drift_rate", self.expected_drift_rate)
        if self.min_refresh_period > self.max_refresh_period:
            raise ValueError(
                f"min_refresh_period ({self.min_refresh_period}) must not exceed "
                f"max_refresh_period ({self.max_refresh_period})"
            )


def _since_report(record: LocalTrainingProgress, now: float) -> float:
    """The samples a peer accumulated since its ``record``, as estimated at ``now``: its speed
    times the time since, at most its latest step (it reports each step: at most one is in
    progress)."""
    since = max(0.0, now - record.time) * record.samples_per_second
    return min(since, record.step_samples) if record.step_samples else since


def _recent(record: LocalTrainingProgress, now: float) -> bool:
    """Whether ``record`` is recent enough that its peer is still training (see
    :attr:`GlobalTrainingProgress.num_active_peers`)."""
    speed = record.samples_per_second
    step = record.step_samples / speed if record.step_samples and speed > _UNKNOWN_SPEED else 0.0
    return now - record.time <= max(ACTIVE_SECONDS, ACTIVE_STEPS * step)


def aggregate_progress(
    records: Iterable[LocalTrainingProgress],
    local: LocalTrainingProgress,
    settings: ProgressSettings,
    now: float,
) -> GlobalTrainingProgress:
    """Fold the peers' ``records`` (as read from the DHT) and our ``local`` record into the
    global progress at ``now`` (DHT time). See the module docstring for the rules.

    A record of ours among ``records`` (same ``peer_id``) is replaced by ``local``, which is at
    least as fresh; otherwise ``local`` is counted as a peer only if it has samples (a peer that
    does not publish, e.g. an auxiliary one, is not a peer of the swarm's count; one that just
    began to publish is). With no record at all, the
    progress is ours alone: our epoch and samples, the ETA from our speed, ``num_peers == 0``.
    """
    peers: dict[bytes, LocalTrainingProgress] = {}
    for record in records:
        if record.peer_id == local.peer_id:
            record = local
        known = peers.get(record.peer_id)
        if known is None or record.time > known.time:
            peers[record.peer_id] = record
    if peers and local.samples_accumulated > 0:
        # we train and publish now, though our record was not read yet (we just joined): a
        # peer that counted only the others would believe itself alone with one other peer
        peers.setdefault(local.peer_id, local)

    if not peers:
        remaining = max(0, settings.target_batch_size - local.samples_accumulated)
        return GlobalTrainingProgress(
            epoch=local.epoch,
            samples_accumulated=local.samples_accumulated,
            target_batch_size=settings.target_batch_size,
            num_peers=0,
            num_clients=0,
            eta_next_epoch=now + remaining / max(local.samples_per_second, EPS),
            next_fetch_time=now + settings.default_refresh_period,
        )

    num_peers = len(peers)
    num_clients = sum(peer.client_mode for peer in peers.values())
    epoch = max([local.epoch, *(p.epoch for p in peers.values() if not p.client_mode)])
    samples = 0
    estimated = 0.0
    total_speed = EPS
    for peer in peers.values():
        total_speed += peer.samples_per_second
        if peer.epoch == epoch:  # (peers behind catch up soon: their speed counts, not samples)
            samples += peer.samples_accumulated
            estimated += peer.samples_accumulated + _since_report(peer, now)
    eta = max(0.0, settings.target_batch_size - estimated) / total_speed
    expected_max_peers = max(
        num_peers + settings.expected_drift_peers, num_peers * (1 + settings.expected_drift_rate)
    )
    refresh = min(
        max(eta * num_peers / expected_max_peers, settings.min_refresh_period),
        settings.max_refresh_period,
    )
    if any(p.epoch == epoch and p.samples_per_second <= _UNKNOWN_SPEED for p in peers.values()):
        refresh = settings.min_refresh_period  # (a peer just began: the ETA is no estimate yet)
    return GlobalTrainingProgress(
        epoch=epoch,
        samples_accumulated=samples,
        target_batch_size=settings.target_batch_size,
        num_peers=num_peers,
        num_clients=num_clients,
        num_active_peers=sum(_recent(peer, now) for peer in peers.values()),
        eta_next_epoch=now + eta,
        next_fetch_time=now + refresh,
    )


class ProgressAccounting:
    """One peer's view of the run's progress (not thread-safe: its owner locks).

    :param settings: the run's :class:`ProgressSettings`.
    :param peer_id: our binary PeerID.
    :param client_mode: whether we are a client.
    :param now: the time (DHT time) at construction: the EMA's timer starts there.
    :param performance_ema_alpha: the EMA's smoothing factor.
    :param hyperparameters: our hyperparameters digest for our records, or ``None``.
    :raises TypeError: an argument is invalid (named).
    :raises ValueError: an argument is invalid (named).
    """

    def __init__(
        self,
        settings: ProgressSettings,
        peer_id: bytes,
        *,
        client_mode: bool,
        now: float,
        performance_ema_alpha: float = 0.1,
        hyperparameters: str | None = None,
    ) -> None:
        if not isinstance(client_mode, bool):
            raise TypeError(f"client_mode must be a bool or None, not {client_mode!r:.40}")
        if hyperparameters is not None and (
            not isinstance(hyperparameters, str)
            or not 0 < len(hyperparameters) <= MAX_HYPERPARAMETERS_LENGTH
        ):
            raise ValueError(
                f"hyperparameters must be None or a str of 1..{MAX_HYPERPARAMETERS_LENGTH} "
                f"characters, not {hyperparameters!r:.40}"
            )
        self.settings = settings
        self.peer_id = peer_id
        self.client_mode = client_mode
        self.hyperparameters = hyperparameters
        self.performance_ema = PerformanceEMA(performance_ema_alpha, now=now)
        #: Our samples in our last report that added some (our step's size).
        self._step_samples = 0
        #: Our latest record.
        self.local_progress = self._local(0, 0, now)
        #: The global progress as last computed (or adjusted by our reports).
        self.global_progress = aggregate_progress((), self.local_progress, settings, now)
        #: How many pauses are held (:meth:`pause`).
        self._pauses = 0
        #: Counts pauses begun: a fetch that started before the latest one is stale.
        self.generation = 0
        self._last_report_epoch = -math.inf
        #: When the global progress was last read (DHT time), and our epoch and samples then.
        self._fetched_at: float | None = None
        self._epoch_at_fetch = 0
        self._samples_at_fetch = 0.0
        self._speed_at_fetch = 0.0
        #: Whether our first report with samples has set the EMA's timer (the time before it,
        #: from construction on, is set-up, not training).
        self._timer_started = False

    def _local(self, epoch: int, samples: int, now: float) -> LocalTrainingProgress:
        return LocalTrainingProgress(
            peer_id=self.peer_id,
            epoch=epoch,
            samples_accumulated=samples,
            samples_per_second=float(self.performance_ema.samples_per_second),
            time=float(now),
            client_mode=self.client_mode,
            hyperparameters=self.hyperparameters,
            step_samples=self._step_samples,
        )

    # -- the training loop's side ------------------------------------------------------------------

    def report_local_progress(
        self,
        local_epoch: int,
        samples_accumulated: int,
        now: float,
        update_global_samples: bool = True,
    ) -> LocalTrainingProgress:
        """We are at ``local_epoch`` with ``samples_accumulated`` samples towards its end.

        If ``update_global_samples`` and we are at the global epoch (and were at this epoch
        before), the difference to our previous report is added to the global count at once
        (it may be negative: a count reset after an fp16 overflow). The difference updates the
        samples/s EMA if positive, else restarts its timer. Returns the new local record.

        :raises TypeError: ``local_epoch`` or ``samples_accumulated`` is not an int.
        :raises ValueError: ``local_epoch`` or ``samples_accumulated`` is below 0.
        """
        for name, value in (
            ("local_epoch", local_epoch),
            ("samples_accumulated", samples_accumulated),
        ):
            if not _is_int(value):
                raise TypeError(f"{name} must be an int, not {type(value).__name__}")
            if value < 0:
                raise ValueError(f"{name} must be ≥ 0, not {value}")
        old = self.local_progress
        extra = samples_accumulated - old.samples_accumulated
        if update_global_samples and local_epoch == old.epoch == self.global_progress.epoch:
            self.global_progress = dataclasses.replace(
                self.global_progress,
                samples_accumulated=self.global_progress.samples_accumulated + extra,
            )
        if extra > 0 and self._timer_started:
            self.performance_ema.update(extra, now)
            self._step_samples = extra
        else:
            self.performance_ema.reset_timer(now)
            if extra > 0:
                # we begin to train: the records read before are likely stale, read them soon
                self._timer_started = True
                self._step_samples = extra
                self.global_progress = dataclasses.replace(
                    self.global_progress,
                    next_fetch_time=min(
                        self.global_progress.next_fetch_time,
                        now + self.settings.min_refresh_period,
                    ),
                )
        self.local_progress = self._local(local_epoch, samples_accumulated, now)
        return self.local_progress

    @property
    def paused(self) -> bool:
        return self._pauses > 0

    def pause(self) -> None:
        """Hold the global progress: fetches that end while paused, or that began before the
        pause, are discarded; the EMA does not count the time. Pauses nest."""
        self._pauses += 1
        self.generation += 1
        self.performance_ema.pause()

    def resume(self, now: float) -> None:
        """Undo one :meth:`pause`.

        :raises RuntimeError: not paused.
        """
        if self._pauses == 0:
            raise RuntimeError("resume() without pause()")
        self._pauses -= 1
        self.performance_ema.resume(now)

    def update_epoch(self, new_epoch: int | None, now: float) -> int:
        """Move to ``new_epoch`` (default: our epoch + 1) with no samples; if it is beyond the
        global epoch, the global epoch becomes it, with no samples and an unknown ETA. Returns
        the new epoch.

        :raises RuntimeError: not paused (:meth:`pause`).
        :raises TypeError: ``new_epoch`` is not None or an int ≥ 0.
        :raises ValueError: ``new_epoch`` is not None or an int ≥ 0.
        """
        if not self.paused:
            raise RuntimeError("update_epoch() must be called inside pause_updates()")
        if new_epoch is None:
            new_epoch = self.local_progress.epoch + 1
        if not _is_int(new_epoch):
            raise TypeError(f"new_epoch must be an int or None, not {type(new_epoch).__name__}")
        if new_epoch < 0:
            raise ValueError(f"new_epoch must be ≥ 0, not {new_epoch}")
        if new_epoch > self.global_progress.epoch:
            self.global_progress = dataclasses.replace(
                self.global_progress,
                epoch=new_epoch,
                samples_accumulated=0,
                eta_next_epoch=math.inf,
            )
        # Look at the swarm at once: until then the new epoch has no ETA, and peers that train
        # faster than the refresh period would overshoot the target by up to a whole period.
        self.global_progress = dataclasses.replace(
            self.global_progress, next_fetch_time=min(self.global_progress.next_fetch_time, now)
        )
        self.report_local_progress(new_epoch, 0, now)
        return new_epoch

    def _training_seconds_left(self, nearest_step: bool) -> float | None:
        """Seconds of our own training until the swarm's estimated end (less half our step if
        ``nearest_step``); ``None`` if we do not train (no speed yet) or have not read the
        records."""
        if self._fetched_at is None or self._speed_at_fetch <= _UNKNOWN_SPEED:
            return None
        eta_seconds = self.global_progress.eta_next_epoch - self._fetched_at
        local = self.local_progress
        since_fetch = local.samples_accumulated - (
            self._samples_at_fetch if local.epoch == self._epoch_at_fetch else 0
        )
        half_step = self._step_samples / 2 if nearest_step else 0
        # (at the speed the ETA was computed with: a peer alone then ends at exactly the target)
        return eta_seconds - (since_fetch + half_step) / self._speed_at_fetch

    def ready_to_update_epoch(self, now: float, *, nearest_step: bool = False) -> bool:
        """Whether we may end our epoch now: the swarm is ahead of us, or has the target's
        samples, or its estimated end has come.

        The estimate (the ETA of the last read of the records) lets an epoch end before the
        reports reach the target, as hivemind's does. A peer that trains measures it in its own
        training, not in wall-clock time: the swarm is assumed to have progressed, since the
        read, as much as our samples since then at our speed then say (the others' share by their
        speeds). So a pause that the whole swarm takes (an evaluation, a checkpoint) does not
        end an epoch early. A peer that does not train (an auxiliary one) compares ``now`` with
        the ETA.

        With ``nearest_step``, the estimated end counts as come at our step nearest to it
        rather than the first one after it: a peer whose decision ends only its own share of
        the epoch (:class:`swarmavg.Optimizer`'s, which waits in the averaging round for the
        others) then does not overshoot the target by up to a step. Where the first peer to
        move on ends the epoch for everyone (peers that follow the global epoch), keep the
        default: the peer with the longest step would otherwise end it for all, early.
        """
        progress = self.global_progress
        if (
            progress.epoch > self.local_progress.epoch
            or progress.samples_accumulated >= self.settings.target_batch_size
        ):
            return True
        left = self._training_seconds_left(nearest_step)
        if left is None:
            return now >= progress.eta_next_epoch
        return left <= 0

    def estimated_next_update_time(self, now: float, *, nearest_step: bool = False) -> float:
        """When we expect to end our epoch (DHT time): ``now`` if ready, else the ETA (for a
        peer that trains: now plus its training time left, see
        :meth:`ready_to_update_epoch`)."""
        if self.ready_to_update_epoch(now, nearest_step=nearest_step):
            return now
        left = self._training_seconds_left(nearest_step)
        if left is None:
            return self.global_progress.eta_next_epoch
        return now + left

    # -- the background side -----------------------------------------------------------------------

    def record_to_publish(self) -> LocalTrainingProgress | None:
        """Our record to store now, or ``None``: we publish only while we have accumulated
        samples at most one epoch before the global one (a peer that never accumulates, such
        as an auxiliary peer, never publishes)."""
        local = self.local_progress
        if local.samples_accumulated > 0:
            self._last_report_epoch = self.global_progress.epoch
        if self._last_report_epoch >= self.global_progress.epoch - 1:
            return local
        return None

    def apply_fetch(
        self, records: Iterable[LocalTrainingProgress], now: float, generation: int
    ) -> GlobalTrainingProgress | None:
        """Replace the global progress by the one ``records`` (read at ``now``) give, unless we
        are paused or a pause began since the read started (``generation`` is
        :attr:`generation` at its start): then return ``None`` and change nothing."""
        if self.paused or generation != self.generation:
            return None
        self.global_progress = aggregate_progress(records, self.local_progress, self.settings, now)
        self._fetched_at = now
        self._speed_at_fetch = self.local_progress.samples_per_second
        self._epoch_at_fetch = self.local_progress.epoch
        # (the estimate counts the part of our step in progress: so do our samples then)
        self._samples_at_fetch = self.local_progress.samples_accumulated + _since_report(
            self.local_progress, now
        )
        return self.global_progress
