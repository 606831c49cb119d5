"""``swarmavg.aio.progress.ProgressTracker``: a run's training progress, from records in the DHT.

Theory of operation
-------------------
The accounting is :class:`swarmavg.proto.progress.ProgressAccounting` (sans-IO); this module
gives it a clock, a lock and two background tasks on the DHT's node:

* the *reporter* stores our :class:`~swarmavg.proto.progress.LocalTrainingProgress` under the
  key ``f"{prefix}_progress"``, subkey ``owner_marker(our peer id)`` (so the DHT signs it and
  every peer refuses a record for that subkey that we did not sign), when the training loop
  reports progress and at least every ``metadata_expiration / 2`` seconds, each record living
  ``metadata_expiration`` seconds; only while the accounting says so (a peer that has not
  accumulated samples since the epoch before the global one does not publish);
* the *fetcher* reads every record at the global progress's ``next_fetch_time`` and folds them
  into the global progress, unless the training loop holds :meth:`ProgressTracker.pause_updates`
  (a read that ends while paused, or that began before a pause, is discarded and made again
  after it).

Records that do not parse, or whose ``peer_id`` is not the owner of their subkey, are ignored
(logged at DEBUG). A peer whose record carries another hyperparameters digest than ours gets one
WARNING, the first time we see it. :meth:`ProgressTracker.aclose` stops both tasks and stores a
tombstone (``None``) under our subkey, so the others stop counting us at once.

The methods the training loop calls (:meth:`~ProgressTracker.report_local_progress`,
:meth:`~ProgressTracker.pause_updates`, :meth:`~ProgressTracker.update_epoch` and the properties)
are synchronous and thread-safe: the synchronous :class:`swarmavg.optim.ProgressTracker` calls
them from the training thread while the tasks run on the event-loop thread. Everything is
logged at DEBUG (or ``status_loglevel``) but for the hyperparameters warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Final, Self

import anyio
import anyio.from_thread
import anyio.lowlevel

from swarmavg._time import get_dht_time
from swarmavg.aio.dht import GetResult
from swarmavg.aio.dht_facade import DHT
from swarmavg.aio.node import BackgroundTask
from swarmavg.errors import RemoteProtocolError, SwarmError
from swarmavg.identity import PeerID
from swarmavg.proto.dht_validation import owner_marker
from swarmavg.proto.progress import (
    GlobalTrainingProgress,
    LocalTrainingProgress,
    PerformanceEMA,
    ProgressAccounting,
    ProgressSettings,
    progress_key,
)

__all__ = ["ProgressTracker"]

logger = logging.getLogger(__name__)

#: How long :meth:`ProgressTracker.aclose` waits for its tasks, then for the tombstone (s).
_CLOSE_TIMEOUT: Final = 5.0
#: Peers remembered as warned about their hyperparameters (beyond: no more warnings).
_MAX_WARNED: Final = 4096
#: Our successive records expire at least this much apart (the DHT keeps the first of two
#: values with the same expiration).
_EXPIRATION_STEP: Final = 1e-3


class _Wakeup:
    """A flag that any thread may raise and one task of the loop waits for. Made on the loop."""

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._thread = threading.get_ident()
        self._loop: asyncio.AbstractEventLoop | None
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # (trio)
            self._loop = None
        self._token = anyio.lowlevel.current_token()

    def set(self) -> None:
        """Raise the flag (from any thread; a no-op once the loop is gone)."""
        if threading.get_ident() == self._thread:
            self._event.set()
            return
        with contextlib.suppress(RuntimeError):  # the loop is gone
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._set_here)
            else:
                anyio.from_thread.run_sync(self._set_here, token=self._token)

    def _set_here(self) -> None:
        self._event.set()  # (the current event, whichever it is by now)

    async def wait(self, timeout: float) -> bool:
        """Wait until the flag is raised or ``timeout`` seconds passed; whether it was raised
        (it is lowered again)."""
        with anyio.move_on_after(max(0.0, timeout)):
            await self._event.wait()
        if self._event.is_set():
            self._event = anyio.Event()
            return True
        return False


def _check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number of seconds > 0, not {value!r}")
    return float(value)


class ProgressTracker:
    """Tracks a run's training progress with the other peers under ``prefix`` (async).

    ``async with ProgressTracker(dht, "run", target_batch_size=4096) as tracker:`` reads the
    records once, then publishes and fetches in the background until the block ends.

    :param dht: a :class:`swarmavg.aio.DHT` (entered before the tracker, left after it).
    :param prefix: the run's name: the records live under ``f"{prefix}_progress"``.
    :param target_batch_size: samples per epoch, over the whole swarm.
    :param client_mode: whether we are a client (our epoch never raises the global one);
        ``None``: the DHT's ``client_mode``.
    :param min_refresh_period: fetch at most this often (seconds).
    :param max_refresh_period: fetch at least this often (seconds).
    :param default_refresh_period: fetch this often while no peer publishes (seconds).
    :param expected_drift_peers: assume this many peers may join before the epoch ends.
    :param expected_drift_rate: assume this fraction of the swarm may join before it ends.
    :param performance_ema_alpha: smoothing of our samples/s estimate.
    :param metadata_expiration: our records live this long (seconds); we publish at least
        every half of it.
    :param hyperparameters: a digest of our hyperparameters
        (:func:`swarmavg.proto.progress.hyperparameters_digest`) to publish, or ``None``; a
        peer that publishes another one gets a WARNING (once).
    :param status_loglevel: the level of the status lines (each fetch's summary).
    :param end_at_nearest_step: the estimated end of an epoch counts as come at our step
        nearest to it, not the first one after it
        (:meth:`swarmavg.proto.progress.ProgressAccounting.ready_to_update_epoch`): for a
        peer whose decision ends only its own share of the epoch, as
        :class:`swarmavg.Optimizer`'s does.
    :param clock: DHT time (default :func:`swarmavg.get_dht_time`).
    :raises TypeError: an argument has the wrong type (named).
    :raises ValueError: an argument is out of range (named).
    """

    def __init__(
        self,
        dht: DHT,
        prefix: str,
        target_batch_size: int,
        *,
        client_mode: bool | None = None,
        min_refresh_period: float = 0.5,
        max_refresh_period: float = 10.0,
        default_refresh_period: float = 3.0,
        expected_drift_peers: float = 3.0,
        expected_drift_rate: float = 0.2,
        performance_ema_alpha: float = 0.1,
        metadata_expiration: float = 60.0,
        hyperparameters: str | None = None,
        status_loglevel: int = logging.DEBUG,
        end_at_nearest_step: bool = False,
        clock: Callable[[], float] = get_dht_time,
    ) -> None:
        if not isinstance(dht, DHT):
            raise TypeError(f"dht must be a swarmavg.aio.DHT, not {type(dht).__name__}")
        if not isinstance(prefix, str) or not prefix:
            raise TypeError(f"prefix must be a non-empty str, not {prefix!r:.64}")
        if client_mode is None:
            client_mode = dht.client_mode
        if isinstance(status_loglevel, bool) or not isinstance(status_loglevel, int):
            raise TypeError(
                f"status_loglevel must be a logging level (int), not {status_loglevel!r}"
            )
        if not isinstance(end_at_nearest_step, bool):
            raise TypeError(f"end_at_nearest_step must be a bool, not {end_at_nearest_step!r:.40}")
        self.end_at_nearest_step = end_at_nearest_step
        self.metadata_expiration = _check_seconds("metadata_expiration", metadata_expiration)
        settings = ProgressSettings(
            target_batch_size,
            min_refresh_period=min_refresh_period,
            max_refresh_period=max_refresh_period,
            default_refresh_period=default_refresh_period,
            expected_drift_peers=expected_drift_peers,
            expected_drift_rate=expected_drift_rate,
        )
        self.dht = dht
        self.prefix = prefix
        #: The DHT key of the records (hivemind's attribute name).
        self.training_progress_key = progress_key(prefix)
        self.status_loglevel = status_loglevel
        self._clock = clock
        self._lock = threading.Lock()
        self._state = ProgressAccounting(
            settings,
            dht.peer_id.to_bytes(),
            client_mode=client_mode,
            now=clock(),
            performance_ema_alpha=performance_ema_alpha,
            hyperparameters=hyperparameters,
        )
        #: Set by each fetch that updated the global progress; cleared by :meth:`update_epoch`
        #: (a ``threading.Event``, so that any thread can read or wait on it).
        self.fetched_global_progress_this_epoch = threading.Event()
        self._subkey = owner_marker(dht.peer_id)
        self._report_wakeup: _Wakeup | None = None
        self._fetch_wakeup: _Wakeup | None = None
        self._tasks: list[BackgroundTask] = []
        self._ended: list[anyio.Event] = []
        self._started = False
        self._closed = False
        self._published = False
        self._last_expiration = -math.inf
        self._warned: set[bytes] = set()

    # -- what the training loop reads ------------------------------------------------------------

    @property
    def target_batch_size(self) -> int:
        return self._state.settings.target_batch_size

    @property
    def client_mode(self) -> bool:
        return self._state.client_mode

    @property
    def hyperparameters(self) -> str | None:
        """Our hyperparameters digest (published in our records), or ``None``."""
        return self._state.hyperparameters

    @property
    def local_progress(self) -> LocalTrainingProgress:
        """Our latest record (immutable)."""
        return self._state.local_progress

    @property
    def global_progress(self) -> GlobalTrainingProgress:
        """The swarm's progress as last computed (immutable; replaced as it changes)."""
        return self._state.global_progress

    @property
    def global_epoch(self) -> int:
        return self._state.global_progress.epoch

    @property
    def performance_ema(self) -> PerformanceEMA:
        """Our samples/s estimate (``performance_ema.samples_per_second``)."""
        return self._state.performance_ema

    @property
    def ready_to_update_epoch(self) -> bool:
        """Whether we may end our epoch now: the global epoch is ahead of ours, or the swarm
        reported ``target_batch_size`` samples, or the estimated end of the epoch has come
        (measured in our training, see
        :meth:`swarmavg.proto.progress.ProgressAccounting.ready_to_update_epoch`)."""
        with self._lock:
            return self._state.ready_to_update_epoch(
                self._clock(), nearest_step=self.end_at_nearest_step
            )

    @property
    def estimated_next_update_time(self) -> float:
        """When we expect to end our epoch (absolute DHT time; now if ready)."""
        with self._lock:
            return self._state.estimated_next_update_time(
                self._clock(), nearest_step=self.end_at_nearest_step
            )

    # -- what the training loop calls ------------------------------------------------------------

    def report_local_progress(
        self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True
    ) -> None:
        """We are at ``local_epoch`` with ``samples_accumulated`` samples towards its end:
        update our record (and samples/s), add the difference to the global count when we are
        at the global epoch (and ``update_global_samples``), and publish it soon. Thread-safe.

        :raises TypeError: an argument is not an int ≥ 0.
        :raises ValueError: an argument is not an int ≥ 0.
        """
        with self._lock:
            due = self._state.global_progress.next_fetch_time
            self._state.report_local_progress(
                local_epoch, samples_accumulated, self._clock(), update_global_samples
            )
            sooner = self._state.global_progress.next_fetch_time < due
        if self._report_wakeup is not None:
            self._report_wakeup.set()
        if sooner and self._fetch_wakeup is not None:
            self._fetch_wakeup.set()

    @contextlib.contextmanager
    def pause_updates(self) -> Iterator[None]:
        """A block in which no fetch changes the global progress (one in flight is discarded
        and made again after it) and the samples/s estimate does not count the time: wrap the
        end of an epoch (averaging, :meth:`update_epoch`) in it. Never blocks; nests;
        thread-safe."""
        with self._lock:
            self._state.pause()
        try:
            yield
        finally:
            with self._lock:
                self._state.resume(self._clock())
            if self._fetch_wakeup is not None:
                self._fetch_wakeup.set()

    def update_epoch(self, new_epoch: int | None = None) -> int:
        """Move to ``new_epoch`` (default: our epoch + 1) with no samples; if the global epoch
        is behind it, it becomes it (no samples, ETA unknown). Clears
        :attr:`fetched_global_progress_this_epoch`, publishes soon, returns the new epoch.

        :raises RuntimeError: not inside :meth:`pause_updates`.
        :raises TypeError: ``new_epoch`` is not None or an int ≥ 0.
        :raises ValueError: ``new_epoch`` is not None or an int ≥ 0.
        """
        with self._lock:
            epoch = self._state.update_epoch(new_epoch, self._clock())
            self.fetched_global_progress_this_epoch.clear()
        if self._report_wakeup is not None:
            self._report_wakeup.set()
        return epoch

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Read the records once, then start publishing and fetching in the background.

        :raises RuntimeError: the DHT is not running, or the tracker was started before.
        """
        if self._started or self._closed:
            raise RuntimeError("a ProgressTracker can be started once")
        if not self.dht.node.is_running:
            raise RuntimeError(
                "the tracker's DHT is not running: enter it first and leave it after the tracker"
            )
        self._started = True
        self._report_wakeup = _Wakeup()
        self._fetch_wakeup = _Wakeup()
        await self.fetch()
        self._spawn(self._report_forever, f"progress: publish {self.training_progress_key}")
        self._spawn(self._fetch_forever, f"progress: fetch {self.training_progress_key}")
        return self

    def _spawn(self, fn: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        ended = anyio.Event()

        async def run() -> None:
            try:
                await fn()
            finally:
                ended.set()

        self._ended.append(ended)
        self._tasks.append(self.dht.node.spawn(run, name=name))

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def is_running(self) -> bool:
        """Whether the background tasks run (started, not closed, the DHT's node alive)."""
        return (
            self._started
            and not self._closed
            and self.dht.node.is_running
            and not all(ended.is_set() for ended in self._ended)
        )

    async def aclose(self) -> None:
        """Stop publishing and fetching, and, if we published, store a tombstone (``None``)
        under our subkey: the others stop counting us at their next fetch. Idempotent; waits
        at most a few seconds; nothing of the tracker runs afterwards."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(_CLOSE_TIMEOUT):
                for ended in self._ended:
                    await ended.wait()
            logger.log(self.status_loglevel, "no longer tracking %s", self.training_progress_key)
            if self._published and self.dht.node.is_running:
                with anyio.move_on_after(_CLOSE_TIMEOUT):
                    await self._store(None, self._clock())

    # -- fetching --------------------------------------------------------------------------------

    async def fetch(self) -> GlobalTrainingProgress | None:
        """Read every peer's record now and update the global progress; the new progress, or
        ``None`` if the read failed or a pause began meanwhile (then nothing changed)."""
        with self._lock:
            generation = self._state.generation
        records = await self._read()
        if records is None:
            return None
        return self._apply(records, generation)

    async def _read(self) -> list[LocalTrainingProgress] | None:
        """The valid records under our key; ``None`` if the read failed."""
        try:
            with anyio.fail_after(self.metadata_expiration):
                found = await self.dht.get(self.training_progress_key, latest=True)
        except (SwarmError, TimeoutError) as exc:
            logger.debug("reading %s failed: %s", self.training_progress_key, exc)
            return None
        return self._parse(found)

    def _parse(self, found: GetResult) -> list[LocalTrainingProgress]:
        if found is None:
            return []
        entries = found.value
        if not isinstance(entries, dict):
            logger.debug("%s holds a plain value, not records: ignored", self.training_progress_key)
            return []
        records = []
        for subkey, item in entries.items():
            value = item.value
            if value is None:
                continue  # a tombstone: that peer left
            try:
                record = LocalTrainingProgress.from_wire(value)
                owner = PeerID(record.peer_id)
            except (RemoteProtocolError, ValueError) as exc:
                logger.debug("ignored a progress record under %r: %s", subkey, exc)
                continue
            if subkey != owner_marker(owner):
                logger.debug("ignored a progress record of %s under another's subkey", owner)
                continue
            self._check_hyperparameters(owner, record)
            records.append(record)
        return records

    def _check_hyperparameters(self, owner: PeerID, record: LocalTrainingProgress) -> None:
        ours, theirs = self.hyperparameters, record.hyperparameters
        if ours is None or theirs is None or theirs == ours or owner == self.dht.peer_id:
            return
        if record.peer_id in self._warned or len(self._warned) >= _MAX_WARNED:
            return
        self._warned.add(record.peer_id)
        logger.warning(
            "peer %s trains %r with other hyperparameters (digest %s, ours %s): its updates "
            "will not match ours; give every peer the same optimizer, learning rate schedule "
            "and target_batch_size",
            owner,
            self.prefix,
            theirs,
            ours,
        )

    def _apply(
        self, records: list[LocalTrainingProgress], generation: int
    ) -> GlobalTrainingProgress | None:
        now = self._clock()
        with self._lock:
            progress = self._state.apply_fetch(records, now, generation)
            if progress is not None:
                self.fetched_global_progress_this_epoch.set()
        if progress is None:
            logger.debug(
                "a fetch of %s ended during a pause: discarded", self.training_progress_key
            )
        else:
            logger.log(
                self.status_loglevel,
                "%s accumulated %d samples for epoch #%d from %d peers; ETA %.2f s (refresh in "
                "%.2f s)",
                self.prefix,
                progress.samples_accumulated,
                progress.epoch,
                progress.num_peers,
                progress.eta_next_epoch - now,
                progress.next_fetch_time - now,
            )
        return progress

    async def _fetch_forever(self) -> None:
        wakeup = self._fetch_wakeup
        assert wakeup is not None
        while True:
            with self._lock:
                paused = self._state.paused
                due = self._state.global_progress.next_fetch_time
            if paused:
                await wakeup.wait(math.inf)  # (until the pause ends)
                continue
            now = self._clock()
            if due > now:
                await wakeup.wait(due - now)
                continue  # (due, or woken: look again)
            with self._lock:
                generation = self._state.generation
            records = await self._read()
            if records is None:
                await wakeup.wait(self._state.settings.default_refresh_period)
                continue
            self._apply(records, generation)

    # -- publishing ------------------------------------------------------------------------------

    async def _report_forever(self) -> None:
        wakeup = self._report_wakeup
        assert wakeup is not None
        last_report = -math.inf
        while True:
            await wakeup.wait(last_report + self.metadata_expiration / 2 - self._clock())
            with self._lock:
                record = self._state.record_to_publish()
            last_report = self._clock()
            if record is not None:
                await self._store(record.to_wire(), last_report)

    async def _store(self, value: dict[str, Any] | None, now: float) -> bool:
        """Store ``value`` (a record, or ``None``: a tombstone) under our subkey."""
        expiration = max(now + self.metadata_expiration, self._last_expiration + _EXPIRATION_STEP)
        self._last_expiration = expiration
        if value is not None:
            self._published = True
        try:
            with anyio.fail_after(self.metadata_expiration):
                return await self.dht.store(
                    self.training_progress_key, value, expiration, subkey=self._subkey
                )
        except (SwarmError, TimeoutError) as exc:
            logger.debug("publishing our progress failed: %s", exc)
            return False

    def __repr__(self) -> str:
        progress = self.global_progress
        return (
            f"<ProgressTracker {self.prefix!r} epoch {progress.epoch}: "
            f"{progress.samples_accumulated}/{progress.target_batch_size} samples, "
            f"{progress.num_peers} peers>"
        )
