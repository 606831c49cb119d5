"""``swarmavg.optim.ProgressTracker``: hivemind's ``ProgressTracker`` for synchronous code.

It runs a :class:`swarmavg.aio.progress.ProgressTracker` on swarmavg's event-loop thread,
attached to a :class:`swarmavg.DHT` of this process: its records are published and fetched
there, in the background, while the training thread reports progress and reads the global
progress without waiting for the network::

    tracker = ProgressTracker(dht, prefix="my_run", target_batch_size=4096)
    local_epoch, local_samples = 0, 0
    while True:
        local_samples += train_one_batch()
        tracker.report_local_progress(local_epoch, local_samples)
        if tracker.ready_to_update_epoch:
            with tracker.pause_updates():
                average_gradients_and_step()
                local_epoch = tracker.update_epoch(local_epoch + 1)
                local_samples = 0

See :mod:`swarmavg.proto.progress` for the accounting (records, ETA, refresh periods) and
:mod:`swarmavg.aio.progress` for the background tasks. This module is a sync facade like
:mod:`swarmavg.averager` and :mod:`swarmavg.dht`, so it lives beside them; the public name is
``swarmavg.optim.ProgressTracker`` (:mod:`swarmavg.optim.progress_tracker` re-exports it), and
``swarmavg.optim`` itself reaches the async layer only through such facades.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Self

from swarmavg.aio.progress import ProgressTracker as AsyncProgressTracker
from swarmavg.proto.progress import GlobalTrainingProgress, LocalTrainingProgress, PerformanceEMA
from swarmavg.sync import in_loop_thread, run_sync, start_soon
from swarmavg.sync._loop import shut_down_at_exit

if TYPE_CHECKING:
    from swarmavg.dht import DHT

__all__ = ["GlobalTrainingProgress", "LocalTrainingProgress", "ProgressTracker"]

logger = logging.getLogger(__name__)


class ProgressTracker:
    """Keeps track of the swarm's training progress, in epochs (hivemind's ``ProgressTracker``).

    An epoch ends once the peers under ``prefix`` together accumulated ``target_batch_size``
    samples. Each peer publishes its progress (epoch, samples towards the next epoch,
    samples/s) in the DHT, signed with the DHT's identity, and reads everyone's to estimate
    the global progress and when the epoch will end.

    :param dht: a running :class:`swarmavg.DHT`.
    :param prefix: the run's name; the records live under the DHT key ``f"{prefix}_progress"``.
    :param target_batch_size: samples per epoch, over the whole swarm (an int > 0).
    :param client_mode: whether this peer is a client (counted, but its epoch never raises the
        global one); ``None``: the DHT's ``client_mode``.
    :param min_refresh_period: fetch the others' progress at most this often (seconds).
    :param max_refresh_period: fetch it at least this often (seconds).
    :param default_refresh_period: fetch this often while no peer publishes (seconds).
    :param expected_drift_peers: assume this many peers may join before the epoch ends.
    :param expected_drift_rate: assume this fraction of the swarm may join before it ends (the
        two drift parameters make us fetch more often as the end nears).
    :param performance_ema_alpha: smoothing of this peer's samples/s estimate.
    :param metadata_expiration: our record lives this long in the DHT (seconds); we publish it
        on each report and at least every half of this.
    :param status_loglevel: the level of the status lines (each fetch's summary).
    :param private_key: accepted for hivemind's sake; must be ``None``. hivemind signs records
        with an RSA key of its own; swarmavg signs them with the DHT's identity (its Ed25519
        key): our subkey names our PeerID, and every peer refuses a record under it that we
        did not sign.
    :param daemon: accepted for hivemind's sake, without effect: the tracker has no thread of
        its own (its tasks run on swarmavg's event-loop thread, which stops at interpreter
        exit).
    :param start: start at once; otherwise call :meth:`start`.
    :param hyperparameters: a digest of this peer's hyperparameters
        (:func:`swarmavg.proto.progress.hyperparameters_digest` of the optimizer's class,
        learning-rate schedule and ``target_batch_size``), published with our progress; a
        peer that publishes another digest is named in one WARNING. ``None``: no check.
    :param end_at_nearest_step: the estimated end of an epoch counts as come at this peer's
        step nearest to it rather than the first one after it; right where a peer's decision
        ends only its own share of the epoch (:class:`swarmavg.Optimizer` sets it), wrong
        where the first peer to move on ends the epoch for all (the default).
    :raises TypeError: an argument has the wrong type (named), or ``private_key`` is given.
    :raises ValueError: an argument is out of range (named).
    :raises RuntimeError: ``start`` and the DHT is not running.
    """

    def __init__(
        self,
        dht: DHT,
        prefix: str,
        target_batch_size: int,
        *,
        client_mode: bool | None = None,
        min_refresh_period: float = 0.5,
        max_refresh_period: float = 10,
        default_refresh_period: float = 3,
        expected_drift_peers: float = 3,
        expected_drift_rate: float = 0.2,
        performance_ema_alpha: float = 0.1,
        metadata_expiration: float = 60.0,
        status_loglevel: int = logging.DEBUG,
        private_key: Any = None,
        daemon: bool = True,
        start: bool = True,
        hyperparameters: str | None = None,
        end_at_nearest_step: bool = False,
    ) -> None:
        from swarmavg.dht import DHT

        given: object = dht
        if not isinstance(given, DHT):
            raise TypeError(f"dht must be a swarmavg.DHT, not {type(given).__name__}")
        if private_key is not None:
            raise TypeError(
                "private_key must be None: swarmavg signs progress records with the DHT's "
                "identity (pass identity=... to swarmavg.DHT for a key of your own)"
            )
        for name, flag in (("daemon", daemon), ("start", start)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, not {flag!r:.64}")
        if client_mode is not None and not isinstance(client_mode, bool):
            raise TypeError(f"client_mode must be a bool or None, not {client_mode!r:.64}")
        self.dht = dht
        self.daemon = daemon

        async def create() -> AsyncProgressTracker:
            return AsyncProgressTracker(
                dht._dht,
                prefix,
                target_batch_size,
                client_mode=client_mode,
                min_refresh_period=min_refresh_period,
                max_refresh_period=max_refresh_period,
                default_refresh_period=default_refresh_period,
                expected_drift_peers=expected_drift_peers,
                expected_drift_rate=expected_drift_rate,
                performance_ema_alpha=performance_ema_alpha,
                metadata_expiration=metadata_expiration,
                hyperparameters=hyperparameters,
                status_loglevel=status_loglevel,
                end_at_nearest_step=end_at_nearest_step,
            )

        self._tracker = run_sync(create)
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        shut_down_at_exit(self)
        if start:
            self.start()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Read the others' progress once, then publish and fetch in the background.
        Idempotent while running.

        :raises RuntimeError: the tracker was shut down, or the DHT is not running.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("this ProgressTracker was shut down")
            if self._started:
                return
            if not self.dht.is_alive():
                raise RuntimeError(
                    "the tracker's DHT is not running: start it first and shut it down after "
                    "the tracker"
                )
            run_sync(self._tracker.__aenter__)
            self._started = True

    def is_alive(self) -> bool:
        """Whether the tracker publishes and fetches (started, not shut down)."""
        return self._started and not self._closed and self._tracker.is_running

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop publishing and fetching and, if we published, store a tombstone so that the
        others stop counting us. Idempotent.

        :param timeout: seconds to wait for that (``None``: the tracker's own bound, a few
            seconds); past it, the tracker is stopped without the tombstone.
        """
        with self._lock:
            first, self._closed = not self._closed, True
        if not first or not self._started:
            return
        if in_loop_thread():  # (from a coroutine on the loop thread: start it, don't wait)
            start_soon(self._tracker.aclose)
            return
        try:
            run_sync(self._tracker.aclose, timeout=timeout)
        except TimeoutError:
            logger.debug("the progress tracker did not shut down within %s s", timeout)
        except RuntimeError:
            pass  # the event loop is gone (interpreter exit): nothing runs any more

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- progress --------------------------------------------------------------------------------

    @property
    def prefix(self) -> str:
        return self._tracker.prefix

    @property
    def training_progress_key(self) -> str:
        """The DHT key of the records: ``f"{prefix}_progress"``."""
        return self._tracker.training_progress_key

    @property
    def target_batch_size(self) -> int:
        return self._tracker.target_batch_size

    @property
    def client_mode(self) -> bool:
        return self._tracker.client_mode

    @property
    def hyperparameters(self) -> str | None:
        return self._tracker.hyperparameters

    @property
    def metadata_expiration(self) -> float:
        return self._tracker.metadata_expiration

    @property
    def local_progress(self) -> LocalTrainingProgress:
        """Our latest record (immutable)."""
        return self._tracker.local_progress

    @property
    def global_progress(self) -> GlobalTrainingProgress:
        """The swarm's progress as last fetched or adjusted by our reports (immutable, and
        replaced as it changes: read it once per decision)."""
        return self._tracker.global_progress

    @property
    def global_epoch(self) -> int:
        return self._tracker.global_epoch

    @property
    def performance_ema(self) -> PerformanceEMA:
        """Our samples/s estimate (``performance_ema.samples_per_second``)."""
        return self._tracker.performance_ema

    @property
    def fetched_global_progress_this_epoch(self) -> threading.Event:
        """Set by each fetch of the global progress; cleared by :meth:`update_epoch`."""
        return self._tracker.fetched_global_progress_this_epoch

    @property
    def ready_to_update_epoch(self) -> bool:
        """Whether this peer may end its epoch now: the global epoch is ahead of ours, or the
        swarm reported ``target_batch_size`` samples, or the estimated end of the epoch has
        come (an epoch may end on that estimate, before the reports reach the target)."""
        return self._tracker.ready_to_update_epoch

    @property
    def estimated_next_update_time(self) -> float:
        """When this peer expects to end its epoch (absolute DHT time; now if ready)."""
        return self._tracker.estimated_next_update_time

    def report_local_progress(
        self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True
    ) -> None:
        """This peer is at ``local_epoch`` with ``samples_accumulated`` samples towards its end
        (the total so far this epoch, not the increment). Updates the samples/s estimate; when
        we are at the global epoch (and ``update_global_samples``), adds the difference to the
        global count at once; publishes the record in the background.

        :raises TypeError: an argument is not an int ≥ 0.
        :raises ValueError: an argument is not an int ≥ 0.
        """
        self._tracker.report_local_progress(local_epoch, samples_accumulated, update_global_samples)

    @contextlib.contextmanager
    def pause_updates(self) -> Iterator[None]:
        """A block in which no background fetch changes the global progress and the samples/s
        estimate does not count the time; :meth:`update_epoch` must run inside one. Unlike
        hivemind's, it never waits for a fetch in flight (that fetch is discarded)."""
        with self._tracker.pause_updates():
            yield

    def update_epoch(self, new_epoch: int | None = None) -> int:
        """Move this peer to ``new_epoch`` (default: its epoch + 1) with no samples, and the
        global epoch with it if it was behind; returns the new epoch.

        :raises RuntimeError: not inside :meth:`pause_updates`.
        :raises TypeError: ``new_epoch`` is not None or an int ≥ 0.
        :raises ValueError: ``new_epoch`` is not None or an int ≥ 0.
        """
        return self._tracker.update_epoch(new_epoch)

    def __repr__(self) -> str:
        return repr(self._tracker).replace("<ProgressTracker", "<swarmavg.optim.ProgressTracker")
