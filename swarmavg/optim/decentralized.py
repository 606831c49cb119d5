"""``swarmavg.DecentralizedOptimizer``, ``DecentralizedSGD``, ``DecentralizedAdam``: Moshpit SGD
(hivemind's decentralized optimizers, with the epochs of its PR #252).

Theory of operation
-------------------
Each peer steps its own optimizer on its own batches; every ``averaging_steps_period`` steps a
background thread averages the parameters (and the named optimizer statistics, e.g. Adam's
``exp_avg_sq``) with a small group of peers (:class:`~swarmavg.optim.TrainingAverager`).

The handshake (hivemind's shipped version): the training thread holds :attr:`lock_parameters`
at all times except inside :meth:`DecentralizedOptimizer.step`, so averaged values are written
into the model only while the caller is inside ``step()``, never between a forward and its
backward. ``step()`` takes the optimizer step, releases the lock, asks for a round (requests
coalesce: at most one is pending; when the background thread is idle, ``step()`` waits until
the round copied the parameters just stepped), waits until a finished round's result is
written (by the delta rule: local steps taken during the round are kept), and takes the lock
back. :meth:`DecentralizedOptimizer.wait_for_round` does the same wait for the round requested
last (the training thread releases the lock until it ended and was written), so that a caller
can wait for averaging to settle without sleeping.

Epochs (spec R-B6, :mod:`swarmavg.proto.decentralized`): each peer publishes ``{epoch, step,
time}`` under ``f"{prefix}.progress"`` with its owner subkey after each step, and reads
everyone's in the background. An epoch ends when the peers at the highest epoch took
``total_steps_in_epoch`` steps in it; a peer behind adopts the epoch, or, more than
``max_allowed_epoch_difference`` behind, downloads the state instead of stepping. The
scheduler gives ``lr(epoch)``.

Threads: the averaging thread and the progress thread, both owned by the optimizer and joined
by :meth:`DecentralizedOptimizer.shutdown`. Exceptions there are logged, never raised.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from swarmavg._time import get_dht_time
from swarmavg.errors import RemoteProtocolError
from swarmavg.optim.training_averager import RoundOutcome, TrainingAverager
from swarmavg.proto.decentralized import (
    EpochAccounting,
    EpochRecord,
    EpochView,
    epoch_key,
    next_round_time,
)
from swarmavg.proto.dht_validation import owner_marker
from swarmavg.sync._loop import shut_down_at_exit

if TYPE_CHECKING:
    from swarmavg.dht import DHT

__all__ = ["DecentralizedAdam", "DecentralizedOptimizer", "DecentralizedSGD"]

logger = logging.getLogger(__name__)

#: Scheduler steps beyond which the scheduler jumps to the epoch instead.
_MAX_SCHEDULER_STEPS = 10_000
#: Seconds a background DHT operation may take before it is given up.
_DHT_TIMEOUT = 10.0
#: Seconds shutdown waits for each background thread.
_JOIN_TIMEOUT = 30.0

LRScheduler = torch.optim.lr_scheduler.LRScheduler


class DecentralizedOptimizer(torch.optim.Optimizer):
    """Trains a shared model by stepping locally and averaging with peers (Moshpit SGD).

    :param opt: a pre-built ``torch.optim.Optimizer`` over the model's parameters.
    :param dht: a running :class:`swarmavg.DHT`.
    :param prefix: the run's name: matchmaking and progress keys start with it.
    :param target_group_size: the largest group a round averages in.
    :param average_parameters: average the parameters.
    :param average_gradients: average the gradients.
    :param average_opt_statistics: optimizer statistics to average (e.g. ``("exp_avg_sq",)``).
    :param averaging_steps_period: ask for a round every this many steps (an int > 0).
    :param averaging_time_period: if > 0, start each round at the next multiple of this many
        seconds of DHT time, so that peers start together.
    :param timeout: seconds for a round (matchmaking and all-reduce); ``None``: the averager's
        own bounds.
    :param verbose: log each round's start and end at INFO.
    :param max_allowed_epoch_difference: a peer more epochs behind than this downloads the
        state instead of stepping (an int ≥ 0).
    :param total_steps_in_epoch: optimizer steps, over the peers at the highest epoch, that
        end an epoch (an int > 0).
    :param scheduler_cls: a factory ``opt -> LR scheduler``; the scheduler follows the epoch:
        during epoch ``e`` the learning rate is ``lr(e)``.
    :param report_progress_expiration: seconds a progress record lives in the DHT.
    :param averager_kwargs: for :class:`~swarmavg.optim.TrainingAverager` and
        :class:`swarmavg.DecentralizedAverager` (``compression``, ``client_mode``,
        ``request_timeout``, ``min_group_size``, ``extra_tensors``...).
    :raises TypeError: an argument has the wrong type (the message names it).
    :raises ValueError: an argument is out of range (named).
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        dht: DHT,
        *,
        prefix: str,
        target_group_size: int,
        average_parameters: bool,
        average_gradients: bool,
        average_opt_statistics: Sequence[str] = (),
        averaging_steps_period: int = 1,
        averaging_time_period: float = 0,
        timeout: float | None = None,
        verbose: bool = False,
        max_allowed_epoch_difference: int = 1,
        total_steps_in_epoch: int = 1000,
        scheduler_cls: Callable[[torch.optim.Optimizer], LRScheduler] | None = None,
        report_progress_expiration: float = 30,
        **averager_kwargs: Any,
    ) -> None:
        from swarmavg.dht import DHT

        given: object = opt
        if not isinstance(given, torch.optim.Optimizer):
            raise TypeError(f"opt must be a torch.optim.Optimizer, not {type(given).__name__}")
        given = dht
        if not isinstance(given, DHT):
            raise TypeError(f"dht must be a swarmavg.DHT, not {type(given).__name__}")
        if not isinstance(prefix, str) or not prefix:
            raise TypeError(f"prefix must be a non-empty str, not {prefix!r:.40}")
        if type(averaging_steps_period) is not int or averaging_steps_period < 1:
            raise ValueError(
                f"averaging_steps_period must be an int > 0, not {averaging_steps_period!r:.40}"
            )
        if (
            isinstance(averaging_time_period, bool)
            or not isinstance(averaging_time_period, int | float)
            or not math.isfinite(averaging_time_period)
            or averaging_time_period < 0
        ):
            raise ValueError(
                f"averaging_time_period must be a number >= 0, not {averaging_time_period!r:.40}"
            )
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
        ):
            raise ValueError(f"timeout must be None or a number > 0, not {timeout!r:.40}")
        if not isinstance(verbose, bool):
            raise TypeError(f"verbose must be a bool, not {verbose!r:.40}")
        if scheduler_cls is not None and not callable(scheduler_cls):
            raise TypeError("scheduler_cls must be None or a factory callable(opt)")
        if (
            isinstance(report_progress_expiration, bool)
            or not isinstance(report_progress_expiration, int | float)
            or not report_progress_expiration > 0
        ):
            raise ValueError(
                "report_progress_expiration must be a number > 0, not "
                f"{report_progress_expiration!r:.40}"
            )
        self._epochs = EpochAccounting(
            total_steps_in_epoch, max_allowed_epoch_difference, float(report_progress_expiration)
        )

        self._initializing = True
        self._closed = False
        self.opt = opt
        self.dht = dht
        self.prefix = prefix
        self.averaging_steps_period = averaging_steps_period
        self.averaging_step_period = averaging_steps_period  # (hivemind's name)
        self.averaging_time_period = float(averaging_time_period)
        self.timeout = timeout
        self.verbose = verbose
        self.report_progress_expiration = float(report_progress_expiration)
        self.report_progress_key = epoch_key(prefix)
        client_mode = averager_kwargs.get("client_mode")
        self._client_mode = dht.client_mode if client_mode is None else bool(client_mode)
        self.averager = TrainingAverager(
            opt,
            average_parameters=average_parameters,
            average_gradients=average_gradients,
            average_opt_statistics=average_opt_statistics,
            dht=dht,
            start=True,
            prefix=prefix,
            target_group_size=target_group_size,
            **averager_kwargs,
        )
        try:
            self.scheduler: LRScheduler | None = None
            if scheduler_cls is not None:
                made = scheduler_cls(opt)
                if not isinstance(made, LRScheduler):
                    raise TypeError(
                        f"scheduler_cls returned a {type(made).__name__}, not an LR scheduler"
                    )
                self.scheduler = made
            torch.optim.Optimizer.__init__(self, opt.param_groups, dict(opt.defaults))
            self._initializing = False

            self.lock_parameters = threading.Lock()
            self.lock_parameters.acquire()  # (held by the training thread outside step())
            self.lock_scheduler_params = threading.Lock()  # (the epochs and the scheduler)
            self.update_event = threading.Event()
            self.stop_event = threading.Event()
            self._progress_event = threading.Event()
            self._publish_lock = threading.Lock()
            self._last_expiration = -math.inf
            self._round_state = threading.Condition()
            self._round_busy = False
            self._rounds_started = 0
            self._rounds_requested = 0  # (requests counted; the last round served up to _served)
            self._served = 0
            self._served_outcome: RoundOutcome | None = None
            self._returned = 0  # (rounds whose outcome wait_for_round returned, up to)
            self._steps_taken = 0
            self._subkey = owner_marker(dht.peer_id)

            self._read_progress()  # (a peer that joins is at the right epoch at once)
            if not self._epochs.is_synchronized():
                logger.info(
                    "%s: the run is at epoch %d: downloading the state",
                    prefix,
                    self._epochs.view().max_epoch,
                )
                self.load_states_from_peers()
            else:
                self._epochs.adopt()
            self._update_scheduler()
            self.averager.state_epoch = self._epochs.local_epoch

            self._averaging_thread = threading.Thread(
                target=self._average_in_background,
                name=f"{type(self).__name__}.averaging",
                daemon=True,
            )
            self._progress_thread = threading.Thread(
                target=self._report_in_background,
                name=f"{type(self).__name__}.progress",
                daemon=True,
            )
            self._averaging_thread.start()
            self._progress_thread.start()
            shut_down_at_exit(self)
        except BaseException:
            self.averager.shutdown()
            raise

    # -- torch.optim.Optimizer -------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups (the same list)."""
        return self.opt.param_groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        if not getattr(self, "_initializing", False):
            raise AttributeError("param_groups are the wrapped optimizer's: change them there")

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state (the same mapping)."""
        return self.opt.state

    @state.setter
    def state(self, value: Any) -> None:
        if not getattr(self, "_initializing", False):
            raise AttributeError("state is the wrapped optimizer's: change it there")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported after construction (the averager's tensors are fixed).

        :raises ValueError: always, after construction.
        """
        if getattr(self, "_initializing", False):
            return  # (torch.optim.Optimizer.__init__: the groups are the wrapped optimizer's)
        raise ValueError(
            f"{type(self).__name__} cannot add param groups after it was created: "
            "give the optimizer all of them first"
        )

    def state_dict(self) -> dict[str, Any]:
        return self.opt.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with self.averager.lock_optimizer:
            self.opt.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(prefix={self.prefix!r}, epoch={self.local_epoch}, "
            f"opt={type(self.opt).__name__})"
        )

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(f"{type(self).__name__} cannot be pickled (it holds live network state)")

    # -- progress --------------------------------------------------------------------------------

    @property
    def local_epoch(self) -> int:
        return self._epochs.local_epoch

    @property
    def local_step(self) -> int:
        """Optimizer steps this peer took in its current epoch."""
        return self._epochs.local_step

    @property
    def decentralized_state(self) -> EpochView:
        """The run as last read: ``max_epoch``, ``total_steps`` (at it), ``num_peers``."""
        with self.lock_scheduler_params:
            return self._epochs.view(get_dht_time())

    @property
    def is_synchronized(self) -> bool:
        """Whether this peer is at most ``max_allowed_epoch_difference`` epochs behind."""
        with self.lock_scheduler_params:
            return self._epochs.is_synchronized(get_dht_time())

    @property
    def last_round(self) -> RoundOutcome | None:
        """What the last averaging round did (``None``: none yet)."""
        return self.averager.last_round

    @property
    def rounds_failed(self) -> int:
        return self.averager.rounds_failed

    @property
    def rounds_succeeded(self) -> int:
        return self.averager.rounds_succeeded

    def refresh_progress(self) -> EpochView:
        """Publish this peer's progress and read everyone's now (``step()`` does it in the
        background after each step); the run as read. Does not change the epoch."""
        self._publish_progress()
        self._read_progress()
        return self.decentralized_state

    def _publish_progress(self) -> None:
        with self._publish_lock:
            now = get_dht_time()
            with self.lock_scheduler_params:
                record = self._epochs.record(now)
            expiration = max(now + self.report_progress_expiration, self._last_expiration + 1e-3)
            self._last_expiration = expiration
            try:
                self.dht.store(
                    self.report_progress_key, record.to_wire(), expiration, subkey=self._subkey
                )
            except Exception as exc:
                logger.debug("publishing our progress failed: %r", exc)

    def _read_progress(self) -> None:
        try:
            found = self.dht.get(self.report_progress_key, latest=True)
        except Exception as exc:
            logger.debug("reading the progress of %r failed: %r", self.prefix, exc)
            return
        records: dict[Any, EpochRecord] = {}
        entries = found.value if found is not None else None
        if isinstance(entries, dict):
            for subkey, item in entries.items():
                if subkey == self._subkey or item.value is None:
                    continue  # (ours is counted from our counters; None: a peer that left)
                if not (isinstance(subkey, bytes) and subkey.startswith(b"[owner:")):
                    continue  # (only owner subkeys: nobody else could have written them)
                try:
                    records[subkey] = EpochRecord.from_wire(item.value)
                except RemoteProtocolError as exc:
                    logger.debug("ignored a progress record under %r: %s", subkey, exc)
        with self.lock_scheduler_params:
            self._epochs.apply_fetch(records, get_dht_time())

    def _report_in_background(self) -> None:
        while not self.stop_event.is_set():
            self._progress_event.wait()
            self._progress_event.clear()
            if self.stop_event.is_set():
                break
            try:
                self._publish_progress()
                self._read_progress()
            except Exception:
                logger.exception("the progress thread of %r failed once", self.prefix)

    def _update_scheduler(self) -> None:
        """Step the scheduler until it counts the epoch: during epoch ``e``, ``lr(e)``."""
        scheduler, epoch = self.scheduler, self._epochs.local_epoch
        if scheduler is None:
            return
        self.opt._opt_called = True  # type: ignore[attr-defined]  # (it follows the epoch)
        if epoch - scheduler._step_count > _MAX_SCHEDULER_STEPS:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                scheduler.step(epoch)
            scheduler._step_count = epoch + 1
            return
        while scheduler._step_count <= epoch:
            scheduler.step()

    # -- stepping --------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step (see the module's docstring): epoch bookkeeping, the wrapped
        optimizer's step, a round requested every ``averaging_steps_period`` steps, finished
        rounds written into the parameters.

        A peer more than ``max_allowed_epoch_difference`` epochs behind downloads the state
        instead, and returns ``None`` without a step.

        :returns: what the wrapped optimizer's step returned (the loss of ``closure``).
        :raises RuntimeError: the optimizer was shut down.
        :raises Exception: what the wrapped optimizer's step raised.
        """
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} was shut down")
        with self.lock_scheduler_params:
            action = self._epochs.before_step(get_dht_time())
            epoch = self._epochs.local_epoch
            view = self._epochs.view()
        if action == "resync":
            logger.warning(
                "%s: this peer is at epoch %d, the run at %d: downloading the state",
                self.prefix,
                epoch,
                view.max_epoch,
            )
            self.load_states_from_peers()
            return None
        self._update_scheduler()
        self.averager.state_epoch = epoch
        with self.averager.lock_optimizer:
            loss = self.opt.step() if closure is None else self.opt.step(closure)
        with self.lock_scheduler_params:
            self._epochs.stepped()
        self._steps_taken += 1
        self._progress_event.set()
        self.lock_parameters.release()
        try:
            if self._steps_taken % self.averaging_steps_period == 0:
                self._request_round()
            self.averager.pending_updates_done.wait()
            if not self._client_mode:
                self.averager.state_sharing_priority = get_dht_time()
        finally:
            self.lock_parameters.acquire()
        return loss

    def _request_round(self) -> None:
        """Ask the averaging thread for a round; if it was idle (and rounds are not aligned to
        a period), wait until it copied the parameters just stepped."""
        with self._round_state:
            wait = not self._round_busy and self.averaging_time_period == 0
            target = self._rounds_started + 1
            self._rounds_requested += 1
            self.update_event.set()
            if wait:
                while self._rounds_started < target and not self.stop_event.is_set():
                    self._round_state.wait(1.0)

    def _average_in_background(self) -> None:
        while not self.stop_event.is_set():
            self.update_event.wait()
            with self._round_state:  # (a request counted after this sets the event again)
                self.update_event.clear()
                serving = self._rounds_requested
            if self.stop_event.is_set():
                break
            if self.averaging_time_period:
                now = get_dht_time()
                delay = next_round_time(now, self.averaging_time_period) - now
                if self.stop_event.wait(delay):
                    break
            with self._round_state:
                self._round_busy = True
                self.averager.pending_updates_done.clear()
                self._rounds_started += 1
                self._round_state.notify_all()
            outcome = RoundOutcome(False, 0, 0.0, "the round raised an exception")
            try:
                if self.verbose:
                    logger.info("%s: starting a new averaging round", self.prefix)
                _, outcome = self.averager._step(
                    self.lock_parameters, None, self.timeout, None, True, None
                )
                if self.verbose and outcome.succeeded:
                    logger.info(
                        "%s: finished an averaging round with %d peers in %.2f s",
                        self.prefix,
                        outcome.group_size,
                        outcome.seconds,
                    )
            except Exception as exc:
                outcome = RoundOutcome(False, 0, 0.0, repr(exc))
                if not self._closed:
                    logger.exception("%s: the averaging thread failed once", self.prefix)
            finally:
                self.averager.pending_updates_done.set()
                with self._round_state:
                    self._round_busy = False
                    self._served = serving
                    self._served_outcome = outcome
                    self._round_state.notify_all()

    def wait_for_round(
        self, timeout: float | None = None, *, request: bool = False
    ) -> RoundOutcome | None:
        """Wait until the averaging round requested last (running, or asked for and not begun)
        has ended and its result is written into the parameters; return what it did.

        Call it from the training thread, outside :meth:`step`, as you call ``step()``: it
        releases :attr:`lock_parameters` while it waits (the round writes its result
        meanwhile) and takes it back before it returns or raises. Use it at the end of
        training, before an evaluation or a checkpoint, or in tests: after it, nothing changes
        the parameters until the next ``step()``.

        :param timeout: the most seconds to wait (``None``: until the round ends; a round is
            bounded by ``timeout`` of the constructor or the averager's own bounds).
        :param request: first ask for a round of the parameters as they are now (as
            ``step()`` does every ``averaging_steps_period`` steps; it coalesces with one
            asked for and not begun, and a round running ends first), then wait for it.
        :returns: the round's :class:`~swarmavg.optim.RoundOutcome` (a failed round too:
            ``succeeded`` is ``False``; also when it ended before this call, e.g. while
            ``step()`` waited for it), or ``None`` at once when no round was requested since
            the last outcome returned (never with ``request``).
        :raises TimeoutError: the round did not end within ``timeout`` (it goes on; a later
            call waits for it again).
        :raises RuntimeError: the optimizer is or was shut down meanwhile.
        :raises ValueError: ``timeout`` is not ``None`` or a number >= 0.
        :raises TypeError: ``request`` is not a bool.
        """
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not timeout >= 0  # (also NaN)
        ):
            raise ValueError(f"timeout must be None or a number >= 0, not {timeout!r:.40}")
        if not isinstance(request, bool):
            raise TypeError(f"request must be a bool, not {request!r:.40}")
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} was shut down")
        if not request:
            with self._round_state:
                if self._served >= self._rounds_requested:
                    # (ended already: even before this call, e.g. while step() waited for it)
                    if self._returned >= self._served:
                        return None
                    self._returned = self._served
                    return self._served_outcome
        deadline = None if timeout is None else time.monotonic() + timeout
        self.lock_parameters.release()
        try:
            if request:
                self._request_round()
            with self._round_state:
                target = self._rounds_requested
                while self._served < target:
                    if self._closed or self.stop_event.is_set():
                        raise RuntimeError(
                            f"this {type(self).__name__} was shut down while a round was awaited"
                        )
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"the averaging round did not end within {timeout} s")
                    self._round_state.wait(remaining)
                self._returned = self._served
                return self._served_outcome
        finally:
            self.lock_parameters.acquire()

    # -- state -----------------------------------------------------------------------------------

    def load_states_from_peers(self, timeout: float | None = None) -> bool:
        """Download a peer's state (parameters, optimizer state, its epoch) and move to the
        run's epoch with zero steps; the scheduler follows. Call it from the training thread
        (which holds :attr:`lock_parameters`). Without a donor, the epoch is adopted all the
        same (the next rounds pull the parameters together), with a WARNING.

        :param timeout: seconds for the download.
        :returns: whether a state was loaded.
        """
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
        ):
            raise ValueError(f"timeout must be None or a number > 0, not {timeout!r:.40}")
        self.opt.zero_grad(set_to_none=True)
        metadata = self.averager._load_state(timeout)
        epoch = metadata.get("epoch") if metadata is not None else None
        if metadata is None:
            logger.warning(
                "%s: no peer served its state: adopting the run's epoch with our parameters",
                self.prefix,
            )
        if self.scheduler is not None and type(epoch) is int and metadata is not None:
            # the loaded param groups hold the donor's lr(epoch): the scheduler is at its epoch
            self.scheduler.last_epoch = epoch
            self.scheduler._step_count = epoch + 1
            self.scheduler._last_lr = [group["lr"] for group in self.opt.param_groups]
        with self.lock_scheduler_params:
            self._epochs.resynced(epoch if isinstance(epoch, int) else None)
            self.averager.state_epoch = self._epochs.local_epoch
        self._update_scheduler()
        self._progress_event.set()
        return metadata is not None

    load_state_from_peers = load_states_from_peers

    # -- lifecycle -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the background threads and the averager; tell the run this peer left (its
        progress record is replaced by a tombstone). Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self.stop_event.set()
        self.update_event.set()
        self._progress_event.set()
        with self._round_state:
            self._round_state.notify_all()
        self.averager.shutdown()
        for thread in (self._averaging_thread, self._progress_thread):
            thread.join(_JOIN_TIMEOUT)
        if self.dht.is_alive():
            try:
                expiration = max(
                    get_dht_time() + self.report_progress_expiration, self._last_expiration + 1e-3
                )
                self.dht.store(self.report_progress_key, None, expiration, subkey=self._subkey)
            except Exception as exc:
                logger.debug("storing our progress tombstone failed: %r", exc)

    def __del__(self) -> None:
        stop = getattr(self, "stop_event", None)
        if stop is not None:
            stop.set()
            self.update_event.set()
            self._progress_event.set()


class DecentralizedSGD(DecentralizedOptimizer):
    """Decentralized SGD (Lian et al. 2017) over Moshpit All-Reduce (arXiv 2103.03239): local
    ``torch.optim.SGD`` steps, parameters averaged with peers.

    :param params: the parameters (or param groups) to train.
    :param lr: the learning rate; ``momentum``, ``dampening``, ``weight_decay``, ``nesterov``:
        as ``torch.optim.SGD``.
    :param kwargs: for :class:`DecentralizedOptimizer` (``averaging_steps_period``,
        ``total_steps_in_epoch``, ``scheduler_cls``, ... and the averager's options).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        *,
        dht: DHT,
        prefix: str,
        target_group_size: int,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        **kwargs: Any,
    ) -> None:
        opt = torch.optim.SGD(
            params,
            lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        super().__init__(
            opt,
            dht,
            prefix=prefix,
            target_group_size=target_group_size,
            average_parameters=True,
            average_gradients=False,
            **kwargs,
        )


class DecentralizedAdam(DecentralizedOptimizer):
    """Decentralized Adam/AMSGrad: local ``torch.optim.Adam`` steps, parameters and the second
    moments (``exp_avg_sq``, or ``max_exp_avg_sq`` with ``amsgrad``) averaged with peers;
    ``exp_avg`` stays local (as hivemind).

    :param params: the parameters (or param groups) to train.
    :param lr: the learning rate; ``betas``, ``eps``, ``weight_decay``, ``amsgrad``: as
        ``torch.optim.Adam``.
    :param averaging_steps_period: average every this many steps (required, as hivemind).
    :param kwargs: for :class:`DecentralizedOptimizer`.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        *,
        dht: DHT,
        prefix: str,
        target_group_size: int,
        averaging_steps_period: int,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        **kwargs: Any,
    ) -> None:
        opt = torch.optim.Adam(
            params, lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad
        )
        statistics = ("max_exp_avg_sq",) if amsgrad else ("exp_avg_sq",)
        super().__init__(
            opt,
            dht,
            prefix=prefix,
            target_group_size=target_group_size,
            average_parameters=True,
            average_gradients=False,
            average_opt_statistics=statistics,
            averaging_steps_period=averaging_steps_period,
            **kwargs,
        )
