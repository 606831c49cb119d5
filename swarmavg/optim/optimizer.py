"""``swarmavg.Optimizer``: collaborative training with hivemind 1.x's ``hivemind.Optimizer`` API.

Peers of one run (``run_id``) accumulate one large global batch together (``target_batch_size``
samples, counted over all peers by the :class:`~swarmavg.optim.ProgressTracker`). When it is
full, they average their gradients, weighted by the samples each contributed, and every peer
takes the same optimizer step: an *epoch*. Parameters and chosen optimizer statistics are
averaged too (every ``average_state_every`` epochs), so peers that drifted (lossy compression,
missed rounds) are pulled back together, and a peer that falls behind downloads the state of a
peer that is up to date. With ``use_local_updates=True`` each peer steps on its own gradients
instead and the state is averaged at each epoch boundary.

How one ``step()`` of the training loop works, and how it differs from hivemind's, is in
``docs/guides/training.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Self

import torch

from swarmavg._step import AveragingStage
from swarmavg.compression import AdaptiveCompression, CompressionBase, NoCompression
from swarmavg.errors import LoadStateFailed, MatchmakingFailed
from swarmavg.metrics import OptimizerCounter, OptimizerMetrics
from swarmavg.optim.grad_averager import GradientAverager
from swarmavg.optim.grad_scaler import GradScaler
from swarmavg.optim.progress_tracker import ProgressTracker
from swarmavg.optim.state_averager import TrainingStateAverager, _SecondsEMA
from swarmavg.sync._loop import shut_down_at_exit

if TYPE_CHECKING:
    from swarmavg._prometheus import MetricsServer
    from swarmavg.averager import StepHandle
    from swarmavg.dht import DHT

__all__ = ["Optimizer"]

logger = logging.getLogger(__name__)

#: A factory of the inner optimizer: ``callable(params) -> torch.optim.Optimizer``.
OptimizerFactory = Callable[..., torch.optim.Optimizer]

#: How long a peer that failed to download the state waits before it tries again on its own
#: (``step()`` retries; an explicit :meth:`Optimizer.load_state_from_peers` raises at once).
_RESYNC_BACKOFF = (1.0, 60.0)
#: Downloads of the state in a row (no epoch between) after which a peer still behind the
#: swarm trains on from there instead.
_MAX_RESYNCS_IN_A_ROW = 3


def _is_optimizer_like(obj: object) -> bool:
    return all(hasattr(obj, name) for name in ("param_groups", "step", "zero_grad"))


def _check_positive(name: str, value: object, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, not {value!r:.64}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be positive and finite, not {value!r}")
    return float(value)


def _check_flag(name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool{' or None' if optional else ''}, not {value!r:.64}")


class Optimizer(torch.optim.Optimizer):
    """Train one model with many peers (hivemind's ``hivemind.Optimizer``; same parameters).

    Use it as the model's optimizer and call :meth:`step` after each backward pass::

        dht = swarmavg.DHT(initial_peers=[...])
        opt = swarmavg.Optimizer(
            dht=dht, run_id="my_run", target_batch_size=4096, batch_size_per_step=32,
            optimizer=lambda params: torch.optim.Adam(params, lr=1e-3), params=model.parameters(),
        )
        for x, y in data:
            loss_fn(model(x), y).backward()
            opt.step()          # accumulates; at the end of an epoch averages and steps
            opt.zero_grad()

    :param dht: a running :class:`swarmavg.DHT`.
    :param run_id: the run's name; every DHT key of the run starts with it
        (``{run_id}_progress``, ``{run_id}_grad_averager``, ``{run_id}_state_averager``).
    :param target_batch_size: samples per epoch, over all peers.
    :param batch_size_per_step: samples per :meth:`step` (or pass ``step(batch_size=...)``).
    :param optimizer: a torch optimizer over the model's parameters, or a factory
        ``callable(params) -> optimizer`` (needed for ``offload_optimizer`` and the delays).
    :param params: the parameters (or param groups) for a factory ``optimizer``.
    :param scheduler: an LR scheduler, or a factory ``callable(optimizer)`` (needed with a factory
        optimizer); stepped by epoch: during epoch ``e`` the learning rate is ``lr(e)``.
    :param matchmaking_time: seconds peers spend forming a group for a round (a group begins
        sooner once every peer that looks for it joined).
    :param averaging_timeout: seconds for a whole averaging round; a round that fails costs at
        most this, and the peer goes on with its local values.
    :param allreduce_timeout: seconds for one all-reduce (default ``averaging_timeout``).
    :param next_chunk_timeout: a transfer moves on when nothing came for this long (default
        ``matchmaking_time``).
    :param load_state_timeout: seconds for downloading the state, all attempts together.
    :param reuse_grad_buffers: accumulate gradients in ``param.grad`` (saves memory; never
        call :meth:`zero_grad` then).
    :param offload_optimizer: run the optimizer on float32 CPU copies of the parameters
        (default: when ``params`` is given and not ``use_local_updates``).
    :param delay_optimizer_step: run the optimizer step in the background, applied at a later
        :meth:`step` (default ``delay_grad_averaging``).
    :param delay_grad_averaging: average gradients in the background too (one step stale).
    :param delay_state_averaging: average the state in the background (default True).
    :param average_state_every: average the state every this many epochs.
    :param use_local_updates: step on local gradients at every :meth:`step`; average only the
        state, at each epoch's end.
    :param client_mode: take no incoming connections (default: the DHT's mode).
    :param auxiliary: help average but contribute no samples (no model training here).
    :param grad_compression: codec for gradients (with error feedback: what a lossy codec
        dropped is added to the next round's gradients).
    :param state_averaging_compression: codec for parameters and statistics.
    :param load_state_compression: codec for state downloads.
    :param average_opt_statistics: names of ``optimizer.state[p]`` entries to average
        (e.g. ``("exp_avg_sq",)``).
    :param extra_tensors: more tensors to average and share (e.g. BatchNorm statistics).
    :param averager_opts: keyword arguments for both averagers
        (:class:`swarmavg.DecentralizedAverager`'s, e.g. ``request_timeout``).
    :param tracker_opts: keyword arguments for the :class:`~swarmavg.optim.ProgressTracker`.
    :param performance_ema_alpha: smoothing of the samples-per-second estimate.
    :param shutdown_timeout: seconds :meth:`shutdown` gives the averagers.
    :param verbose: log every event at INFO (default: one INFO line per epoch, the rest DEBUG).
    :param grad_averager_factory: a :class:`~swarmavg.optim.GradientAverager` subclass (or a
        factory with its signature).
    :param metrics_port: serve :attr:`metrics` (this optimizer's and both averagers') over
        HTTP on this TCP port in Prometheus' text format, until :meth:`shutdown` (``None``,
        the default: off; 0: a free port). Needs ``pip install swarmavg[prometheus]``; see
        ``docs/guides/metrics.md``.
    :param metrics_host: the address the metrics server listens on (default loopback only).
    :raises ValueError: a combination of options that cannot work (the message says which).
    :raises TypeError: an argument of the wrong type (the message names it).
    :raises ImportError: ``metrics_port`` is given and prometheus-client is not installed.
    """

    def __init__(
        self,
        *,
        dht: DHT,
        run_id: str,
        target_batch_size: int,
        batch_size_per_step: int | None = None,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | None = None,
        scheduler: Any = None,
        matchmaking_time: float = 15.0,
        averaging_timeout: float = 60.0,
        allreduce_timeout: float | None = None,
        next_chunk_timeout: float | None = None,
        load_state_timeout: float = 600.0,
        reuse_grad_buffers: bool = False,
        offload_optimizer: bool | None = None,
        delay_optimizer_step: bool | None = None,
        delay_grad_averaging: bool = False,
        delay_state_averaging: bool = True,
        average_state_every: int = 1,
        use_local_updates: bool = False,
        client_mode: bool | None = None,
        auxiliary: bool = False,
        grad_compression: CompressionBase | AdaptiveCompression = NoCompression(),  # noqa: B008
        grad_averager_factory: Callable[..., GradientAverager] | None = None,
        state_averaging_compression: CompressionBase | AdaptiveCompression = NoCompression(),  # noqa: B008
        load_state_compression: CompressionBase | AdaptiveCompression = NoCompression(),  # noqa: B008
        average_opt_statistics: Sequence[str] = (),
        extra_tensors: Sequence[torch.Tensor] = (),
        averager_opts: dict[str, Any] | None = None,
        tracker_opts: dict[str, Any] | None = None,
        performance_ema_alpha: float = 0.1,
        shutdown_timeout: float = 5.0,
        verbose: bool = False,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
    ) -> None:
        from swarmavg._prometheus import check_metrics_options
        from swarmavg.dht import DHT as SyncDHT

        self._parent_pid = os.getpid()
        self._closed = False
        self._initializing = True
        self._metrics_server: MetricsServer | None = None
        if not isinstance(dht, SyncDHT):
            raise TypeError(f"dht must be a swarmavg.DHT, not {type(dht).__name__}")
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"run_id must be a non-empty str, not {run_id!r:.64}")
        if (
            isinstance(target_batch_size, bool)
            or not isinstance(target_batch_size, int)
            or target_batch_size < 1
        ):
            raise ValueError(f"target_batch_size must be a positive int, not {target_batch_size!r}")
        if batch_size_per_step is not None and (
            isinstance(batch_size_per_step, bool)
            or not isinstance(batch_size_per_step, int)
            or batch_size_per_step < 1
        ):
            raise ValueError(
                f"batch_size_per_step must be a positive int or None, not {batch_size_per_step!r}"
            )
        if (
            isinstance(average_state_every, bool)
            or not isinstance(average_state_every, int)
            or average_state_every < 1
        ):
            raise ValueError(
                f"average_state_every must be a positive int, not {average_state_every!r}"
            )
        matchmaking_time = _check_positive("matchmaking_time", matchmaking_time)  # type: ignore[assignment]
        averaging_timeout = _check_positive("averaging_timeout", averaging_timeout)  # type: ignore[assignment]
        _check_positive("allreduce_timeout", allreduce_timeout, optional=True)
        _check_positive("next_chunk_timeout", next_chunk_timeout, optional=True)
        load_state_timeout = _check_positive("load_state_timeout", load_state_timeout)  # type: ignore[assignment]
        shutdown_timeout = _check_positive("shutdown_timeout", shutdown_timeout)  # type: ignore[assignment]
        for name, flag in (
            ("reuse_grad_buffers", reuse_grad_buffers),
            ("delay_grad_averaging", delay_grad_averaging),
            ("delay_state_averaging", delay_state_averaging),
            ("use_local_updates", use_local_updates),
            ("auxiliary", auxiliary),
            ("verbose", verbose),
        ):
            _check_flag(name, flag)
        for name, maybe in (
            ("offload_optimizer", offload_optimizer),
            ("delay_optimizer_step", delay_optimizer_step),
            ("client_mode", client_mode),
        ):
            _check_flag(name, maybe, optional=True)
        check_metrics_options(metrics_port, metrics_host)

        # R-A1: resolve the defaults (client_mode the right way round, as upstream meant it).
        client_mode = bool(dht.client_mode if client_mode is None else client_mode)
        if delay_optimizer_step is None:
            delay_optimizer_step = delay_grad_averaging
        if offload_optimizer is None:
            offload_optimizer = params is not None and not use_local_updates
        allreduce_timeout = averaging_timeout if allreduce_timeout is None else allreduce_timeout
        next_chunk_timeout = matchmaking_time if next_chunk_timeout is None else next_chunk_timeout
        if delay_grad_averaging and not delay_optimizer_step:
            raise ValueError("delay_grad_averaging=True needs delay_optimizer_step=True")
        if client_mode and auxiliary:
            raise ValueError("auxiliary=True: a client-mode peer cannot be an auxiliary peer")
        if auxiliary and batch_size_per_step is not None:
            raise ValueError("auxiliary=True: an auxiliary peer takes no batch_size_per_step")
        if callable(optimizer) and not _is_optimizer_like(optimizer) and params is not None:
            if scheduler is not None and (
                not callable(scheduler)
                or isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)
            ):
                raise ValueError(
                    "with an optimizer factory, scheduler must be a factory too: "
                    "callable(optimizer) -> scheduler"
                )
        elif _is_optimizer_like(optimizer):
            if params is not None:
                raise ValueError(
                    "params is for an optimizer factory; this optimizer already has its parameters"
                )
            if offload_optimizer or delay_optimizer_step or delay_grad_averaging:
                raise ValueError(
                    "offload_optimizer and the delayed steps need an optimizer factory: "
                    "swarmavg.Optimizer(..., params=model.parameters(), "
                    "optimizer=lambda params: torch.optim.Adam(params, ...))"
                )
        else:
            raise ValueError(
                "optimizer must be a torch optimizer (swarmavg.Optimizer(..., optimizer=opt)) or a "
                "factory with params (swarmavg.Optimizer(..., params=model.parameters(), "
                "optimizer=lambda params: torch.optim.Adam(params, ...)))"
            )
        if use_local_updates:
            if reuse_grad_buffers:
                raise ValueError(
                    "use_local_updates=True accumulates no gradients: reuse_grad_buffers"
                )
            if delay_grad_averaging:
                raise ValueError(
                    "use_local_updates=True averages no gradients: delay_grad_averaging"
                )
            if grad_averager_factory is not None:
                raise ValueError(
                    "use_local_updates=True averages no gradients: grad_averager_factory"
                )

        self.dht, self.run_id = dht, run_id
        self.client_mode, self.auxiliary = client_mode, auxiliary
        self.batch_size_per_step, self.target_batch_size = batch_size_per_step, target_batch_size
        self.delay_state_averaging, self.average_state_every = (
            delay_state_averaging,
            average_state_every,
        )
        self.matchmaking_time, self.offload_optimizer = matchmaking_time, offload_optimizer
        self.delay_grad_averaging, self.delay_optimizer_step = (
            delay_grad_averaging,
            delay_optimizer_step,
        )
        self.averaging_timeout, self.allreduce_timeout = averaging_timeout, allreduce_timeout
        self.load_state_timeout, self.shutdown_timeout = load_state_timeout, shutdown_timeout
        self.next_chunk_timeout = next_chunk_timeout
        self.status_loglevel = logging.INFO if verbose else logging.DEBUG
        self.scheduled_grads: StepHandle | None = None
        self.scheduled_state: StepHandle | None = None
        self._averager_opts = dict(averager_opts or {})

        self.tracker: ProgressTracker | None = None
        self.state_averager: TrainingStateAverager | None = None
        self.grad_averager: GradientAverager | None = None
        try:
            self.state_averager = self._make_state_averager(
                optimizer=optimizer,
                params=params,
                scheduler=scheduler,
                delta_rule_averaging=use_local_updates and delay_state_averaging,
                compression=state_averaging_compression,
                state_compression=load_state_compression,
                average_opt_statistics=average_opt_statistics,
                performance_ema_alpha=performance_ema_alpha,
                extra_tensors=extra_tensors,
            )
            if not use_local_updates:
                self.grad_averager = self._make_gradient_averager(
                    grad_averager_factory or GradientAverager,
                    reuse_grad_buffers=reuse_grad_buffers,
                    compression=grad_compression,
                )
            self.tracker = self._make_progress_tracker(
                target_batch_size,
                performance_ema_alpha=performance_ema_alpha,
                **(tracker_opts or {}),
            )
        except BaseException:
            self._close_parts()
            raise

        self._should_check_synchronization_on_update = True
        self._schema_hash = self._compute_schema_hash()
        # time from the start of an epoch's transition to its state averaging round
        self.delay_before_state_averaging = _SecondsEMA(performance_ema_alpha)
        self._resync_failures = 0
        self._resync_not_before = 0.0
        #: Downloads since our last epoch that ended in a round: each is checked against the
        #: next read of the swarm's progress (the donor may have moved on meanwhile).
        self._resyncs_in_a_row = 0
        # torch's GradScaler.step() then passes itself to step(), which rejects it (R-A3): it
        # cannot know how this optimizer accumulates; swarmavg.optim.GradScaler can
        self._step_supports_amp_scaling = True
        #: what the last epoch's rounds did (see :meth:`_log_epoch`)
        self.last_epoch_info: dict[str, Any] = {}
        #: ``callable() -> value``: called when a gradient round of this peer begins looking
        #: for a group; the value (msgpack-serializable, a few hundred bytes at most) is
        #: shared with that round's group (its ``gather``). ``None``: nothing is shared.
        #: Exceptions it raises are logged and nothing is shared then.
        self.grad_gather: Callable[[], Any] | None = None
        #: what each member of the last gradient round that completed shared through
        #: :attr:`grad_gather` (this peer included): PeerID -> value as it arrived (untrusted:
        #: check it before use). Empty before the first such round.
        self.last_grad_gathered: dict[Any, Any] = {}
        self._epoch_started = time.perf_counter()
        self._counter = OptimizerCounter(run_id)

        inner = self.state_averager.optimizer
        super().__init__(self.state_averager.main_parameters, dict(inner.defaults))
        if metrics_port is not None:
            from swarmavg._prometheus import MetricsServer

            try:
                self._metrics_server = MetricsServer(
                    lambda: self.metrics, port=metrics_port, host=metrics_host
                )
            except BaseException:
                self._close_parts()
                raise
        self._initializing = False
        shut_down_at_exit(self)

    # -- construction ------------------------------------------------------------------------

    def _make_state_averager(self, **kwargs: Any) -> TrainingStateAverager:
        return TrainingStateAverager(
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **self._averager_kwargs(),
            **kwargs,
        )

    def _averager_kwargs(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "averaging_expiration": self.matchmaking_time,
            "allreduce_timeout": self.allreduce_timeout,
            "next_chunk_timeout": self.next_chunk_timeout,
        }
        options.update(self._averager_opts)
        return options

    def _make_gradient_averager(
        self, factory: Callable[..., GradientAverager], **kwargs: Any
    ) -> GradientAverager:
        assert self.state_averager is not None
        grad_averager = factory(
            self.state_averager.main_parameters,
            dht=self.dht,
            prefix=f"{self.run_id}_grad_averager",
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            error_feedback=not isinstance(kwargs.get("compression"), NoCompression),
            **self._averager_kwargs(),
            **kwargs,
        )
        if self.offload_optimizer:
            # The optimizer's own .grad tensors are the averaged buffers: no copy per epoch.
            with grad_averager.get_tensors() as averaged:
                optimized = self._optimized_parameters()
                if len(averaged) != len(optimized):
                    raise RuntimeError("the gradient averager has another number of tensors")
                for param, grad in zip(optimized, averaged, strict=True):
                    param.grad = grad
        return grad_averager

    def _make_progress_tracker(self, target_batch_size: int, **kwargs: Any) -> ProgressTracker:
        kwargs.setdefault("hyperparameters", self._hyperparameter_digest(target_batch_size))
        # our decision ends only our share of the epoch (we wait for the others in the round)
        kwargs.setdefault("end_at_nearest_step", True)
        return ProgressTracker(
            self.dht,
            self.run_id,
            target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **kwargs,
        )

    def _hyperparameter_digest(self, target_batch_size: int) -> str:
        """A digest of what peers of one run must agree on: the inner optimizer's class and
        hyperparameters, the schedule and the target (peers that differ diverge, #443)."""
        assert self.state_averager is not None
        inner = self.state_averager.optimizer
        groups = [
            sorted((k, repr(v)) for k, v in group.items() if k != "params" and k != "initial_lr")
            for group in inner.param_groups
        ]
        scheduler = self.state_averager.scheduler
        text = repr(
            (type(inner).__qualname__, groups, type(scheduler).__qualname__, target_batch_size)
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def _optimized_parameters(self) -> list[torch.Tensor]:
        assert self.state_averager is not None
        return [p for group in self.state_averager.optimizer.param_groups for p in group["params"]]

    def _compute_schema_hash(self) -> int:
        params = self._optimized_parameters()
        shapes = tuple(tuple(p.shape) for p in params)
        grad_ids = tuple(id(p.grad) for p in params) if self.offload_optimizer else None
        return hash((grad_ids, shapes))

    # -- what torch.optim.Optimizer's machinery sets during __init__ ----------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups, with ``"params"`` the model's (main) parameters."""
        if self.state_averager is None:
            return []
        groups = [dict(group) for group in self.state_averager.optimizer.param_groups]
        main = self.state_averager.main_parameters
        start = 0
        for group in groups:
            count = len(group["params"])
            group["params"] = list(main[start : start + count])
            start += count
        return groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        if not self._initializing:
            raise AttributeError("param_groups of swarmavg.Optimizer cannot be replaced")

    @property  # type: ignore[override]
    def state(self) -> dict[Any, Any]:
        """The inner optimizer's state, plus ``local_epoch``."""
        if self.state_averager is None:
            return {}
        state: dict[Any, Any] = dict(self.state_averager.optimizer.state)
        state["local_epoch"] = self.local_epoch
        return state

    @state.setter
    def state(self, value: Any) -> None:
        if not self._initializing:
            raise AttributeError("state of swarmavg.Optimizer cannot be replaced")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._initializing:
            return  # torch.optim.Optimizer.__init__: the groups are the inner optimizer's
        raise ValueError(
            "swarmavg.Optimizer takes all parameter groups at construction; "
            "add_param_group afterwards is not supported"
        )

    # -- properties ----------------------------------------------------------------------------

    @property
    def opt(self) -> torch.optim.Optimizer:
        """The inner (possibly offloaded) torch optimizer."""
        assert self.state_averager is not None
        return self.state_averager.optimizer

    @property
    def local_epoch(self) -> int:
        """This peer's epoch; kept in step with the swarm (a peer that falls behind downloads
        the state). An epoch is ``target_batch_size`` samples over all peers."""
        assert self.state_averager is not None
        return int(self.state_averager.local_epoch)

    @property
    def local_progress(self) -> Any:
        assert self.tracker is not None
        return self.tracker.local_progress

    @property
    def metrics(self) -> OptimizerMetrics:
        """What this optimizer did since it was made: epochs, how each stepped, state
        downloads, and its averagers' :class:`~swarmavg.metrics.AveragerMetrics`
        (:class:`swarmavg.metrics.OptimizerMetrics`, see ``docs/guides/metrics.md``). A consistent
        snapshot, readable from any thread (and after :meth:`shutdown`)."""
        assert self.state_averager is not None
        return self._counter.snapshot(
            local_epoch=self.local_epoch,
            gradients=None if self.grad_averager is None else self.grad_averager.metrics,
            state=self.state_averager.metrics,
        )

    @property
    def use_local_updates(self) -> bool:
        return self.grad_averager is None

    @property
    def use_gradient_averaging(self) -> bool:
        return self.grad_averager is not None

    def is_alive(self) -> bool:
        return not self._closed

    def is_synchronized_with_peers(self) -> bool:
        """Whether this peer's epoch is at most one behind the swarm's."""
        assert self.tracker is not None
        return self.local_epoch >= self.tracker.global_epoch - 1

    # -- the training step ---------------------------------------------------------------------

    def step(  # type: ignore[override]
        self,
        closure: Callable[[], torch.Tensor] | None = None,
        batch_size: int | None = None,
        grad_scaler: Any = None,
    ) -> torch.Tensor | None:
        """Count this step's samples and gradients; at the end of an epoch, average with the
        swarm and take the optimizer step.

        :param closure: re-evaluates the model and returns the loss (run under
            ``torch.enable_grad()``).
        :param batch_size: samples of this step (default ``batch_size_per_step``).
        :param grad_scaler: a :class:`swarmavg.optim.GradScaler` for float16 AMP (or call
            ``grad_scaler.step(opt, ...)``, the same): the gradients are unscaled and checked;
            a batch with inf/NaN gradients is skipped (with ``reuse_grad_buffers``, the whole
            accumulation is reset); see ``docs/guides/training.md``.
        :returns: the closure's loss, or ``None``.
        :raises ValueError: no batch size, an auxiliary peer given a batch, closure or scaler,
            a ``grad_scaler`` that is not a :class:`swarmavg.optim.GradScaler`, or a closure
            with a scaler.
        :raises RuntimeError: the optimizer was shut down, or ``step`` with the same scaler
            twice before ``grad_scaler.update()``.
        """
        if self._closed:
            raise RuntimeError("this swarmavg.Optimizer was shut down")
        assert self.state_averager is not None
        assert self.tracker is not None
        if grad_scaler is not None and not isinstance(grad_scaler, GradScaler):
            raise ValueError(
                f"grad_scaler must be a swarmavg.optim.GradScaler, not "
                f"{type(grad_scaler).__module__}.{type(grad_scaler).__qualname__} (torch's "
                "cannot see the gradients this optimizer accumulates across steps)"
            )
        if self.auxiliary:
            if closure is not None or batch_size is not None or grad_scaler is not None:
                raise ValueError(
                    "an auxiliary peer trains nothing: step() takes no closure, batch_size or "
                    "grad_scaler there"
                )
        elif batch_size is None and self.batch_size_per_step is None:
            raise ValueError(
                "step() needs the batch size: pass step(batch_size=...) or "
                "batch_size_per_step=... to swarmavg.Optimizer"
            )
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        ):
            raise ValueError(f"batch_size must be a positive int, not {batch_size!r}")
        batch = batch_size if batch_size is not None else (self.batch_size_per_step or 0)
        if grad_scaler is not None:
            if closure is not None:
                raise ValueError(
                    "closure: not with a grad_scaler (as torch's GradScaler): compute the loss, "
                    "scale it and call backward() before step()"
                )
            if grad_scaler.is_enabled():
                grad_scaler._begin_optimizer_step(self)
            else:
                grad_scaler = None

        # apply a delayed optimizer step or averaging round that finished meanwhile
        self.state_averager.step(apply_delayed_updates=True)

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        if not self.auxiliary and self._should_load_state_from_peers():
            logger.log(self.status_loglevel, "%s: out of sync with the swarm", self.run_id)
            if self._resync():
                if grad_scaler is not None:
                    grad_scaler._skip_local_step(self)
                return loss  # these gradients came from parameters that are out of date

        if self.grad_averager is not None:
            if not self.auxiliary and not self._check_and_accumulate_gradients(batch, grad_scaler):
                return loss
            self._maybe_schedule_gradient_averaging()
            self._maybe_schedule_state_averaging()
        elif not self.auxiliary:
            if grad_scaler is not None and not grad_scaler._check_local_gradients(
                self, unscale=True
            ):
                logger.log(
                    self.status_loglevel,
                    "%s: non-finite gradients under AMP: no local step on this batch",
                    self.run_id,
                )
                return loss
            samples = self.tracker.local_progress.samples_accumulated + batch
            self.tracker.report_local_progress(self.local_epoch, samples)
            self._maybe_schedule_state_averaging()
            self.state_averager.step(
                increment_epoch=False,
                optimizer_step=True,
                delay_optimizer_step=self.delay_optimizer_step,
            )

        if self.tracker.ready_to_update_epoch:
            self._update_global_epoch(grad_scaler)
        return loss

    def _check_and_accumulate_gradients(
        self, batch_size: int, grad_scaler: GradScaler | None
    ) -> bool:
        """Accumulate this batch's gradients and report the samples; with a scaler, first
        unscale (own accumulators) or only check (``reuse_grad_buffers``) them: non-finite
        gradients skip the batch, or with ``reuse_grad_buffers`` reset the accumulation (the
        sum of scaled gradients in ``.grad`` is lost) and report 0 samples. Whether the batch
        was accumulated."""
        assert self.grad_averager is not None
        assert self.tracker is not None
        reuse = self.grad_averager.reuse_grad_buffers
        if grad_scaler is not None and not grad_scaler._check_local_gradients(
            self, unscale=not reuse
        ):
            if reuse:
                logger.log(
                    self.status_loglevel,
                    "%s: non-finite gradients under AMP: the accumulated gradients are reset",
                    self.run_id,
                )
                self.grad_averager.reset_accumulated_grads_()
                self.tracker.report_local_progress(self.local_epoch, 0)
            else:
                logger.log(
                    self.status_loglevel,
                    "%s: non-finite gradients under AMP: this batch is skipped",
                    self.run_id,
                )
            return False
        self.grad_averager.accumulate_grads_(batch_size)
        self.tracker.report_local_progress(
            self.local_epoch, self.grad_averager.local_samples_accumulated
        )
        return True

    def _update_global_epoch(self, grad_scaler: Any) -> None:
        """The end of an epoch: average gradients and take the optimizer step, average the
        state, move to the next epoch (R-A5)."""
        assert self.state_averager is not None
        assert self.tracker is not None
        if self._schema_hash != self._compute_schema_hash():
            raise RuntimeError(
                "the parameters or their gradient buffers changed since swarmavg.Optimizer was made"
            )
        started = time.perf_counter()
        info: dict[str, Any] = {
            "epoch": self.local_epoch,
            "peers": self.tracker.global_progress.num_peers,
            "samples": self.tracker.global_progress.samples_accumulated,
            "local_samples": self.tracker.local_progress.samples_accumulated,
            "grad_group": None,
            "grad_seconds": None,
            "grad_error": None,
        }
        with self.tracker.pause_updates():
            wait_for_trigger = None
            if self.grad_averager is not None:
                if self.delay_optimizer_step:
                    # The previous optimizer step reads the buffers this round averages into:
                    # wait for it, but not for its state round. (That round waits for its
                    # groupmates' gradient rounds; had one of them formed with this peer's
                    # pre-scheduled next round, waiting for it here would be a cycle, broken
                    # only by the all-reduce's timeouts.)
                    self.state_averager.wait_for_delayed_optimizer_steps()
                previous = self.scheduled_grads
                if (
                    self.delay_grad_averaging
                    and (previous is None or previous.triggered or previous.done())
                    and self.tracker.global_progress.num_peers > 1
                ):
                    # Not pre-scheduled (see _maybe_schedule_gradient_averaging): the group is
                    # found now, in the background, within averaging_timeout as a pre-scheduled
                    # round's would be. (If this fails, _begin_averaging_gradients tries a step
                    # of its own and says why that failed.)
                    with contextlib.suppress(Exception):
                        self.scheduled_grads = self.grad_averager.schedule_step(
                            timeout=self.averaging_timeout, gather=self._grad_gather()
                        )
                alone = self.tracker.global_progress.num_peers <= 1
                began = self._begin_averaging_gradients(grad_scaler)
                if not began:
                    # no round (alone, or it could not start): step on the local gradients
                    self._counter.stepped_locally("alone" if alone else "not_started")
                    self._load_local_gradients_into_optimizer(info)
                elif self.delay_grad_averaging:
                    handle = self.scheduled_grads
                    info["delayed"] = True

                    def wait_for_trigger() -> None:
                        self._average_gradients_and_load_into_optimizer(handle, info)

                else:
                    self._average_gradients_and_load_into_optimizer(self.scheduled_grads, info)

            next_epoch = max(self.local_epoch + 1, self.tracker.global_epoch)
            swarm_not_empty = self.tracker.global_progress.num_peers > 1
            optimizer_step = not self.auxiliary and not self.use_local_updates
            # The previous state round may still run (it is delayed by default). Where the
            # rounds average the optimizer's tensors in place (reuse_tensors, e.g. offloaded),
            # this epoch's round is queued behind it: the background thread runs them in order,
            # and every peer keeps averaging every epoch, instead of this epoch blocking on the
            # previous round (or skipping its own while its groupmates wait for it).
            queue_round = (
                self.state_averager.reuse_tensors and self.state_averager.averaging_pending
            )
            average_state = (
                swarm_not_empty
                and next_epoch % self.average_state_every == 0
                and (queue_round or not self.state_averager.averaging_in_progress)
            )
            if average_state and info.get("grad_no_group"):
                # The gradient round found nobody within averaging_timeout: a state round now
                # would most likely wait as long for nobody, and two peers that each wait in a
                # different kind of round (one in its gradient round while the other is in its
                # state round, as after a groupmate's death) would then miss each other epoch
                # after epoch. Going on to the next epoch puts both in its gradient round.
                average_state = False
                logger.log(
                    self.status_loglevel,
                    "%s epoch %d: no state round this epoch (the gradient round found no group)",
                    self.run_id,
                    info["epoch"],
                )
            if average_state and self.scheduled_state is not None:
                if self.scheduled_state.triggered or self.scheduled_state.done():
                    self.scheduled_state = None
                self.delay_before_state_averaging.update(
                    task_size=1, interval=time.perf_counter() - started
                )
            if average_state:
                self._expect_peers(self.state_averager)
            self.state_averager.step(
                wait_for_delayed_updates=False if average_state and queue_round else None,
                increment_epoch=True,
                wait_for_trigger=wait_for_trigger,
                optimizer_step=optimizer_step,
                delay_optimizer_step=self.delay_optimizer_step and optimizer_step,
                grad_scaler=None,  # the averaged gradients are unscaled
                averaging_round=average_state,
                delay_averaging=self.delay_state_averaging and not self.auxiliary,
                averaging_control=self.scheduled_state if average_state else None,
                averaging_opts={"timeout": self.averaging_timeout} if average_state else None,
            )
            if (
                not average_state
                and self.scheduled_state is not None
                and not self.scheduled_state.done()
            ):
                self.scheduled_state.cancel()
            self.scheduled_state = None

            self.tracker.update_epoch(self.state_averager.local_epoch)
            self._should_check_synchronization_on_update = True
            self._resyncs_in_a_row = 0
            if not self.client_mode:
                self.state_averager.state_sharing_priority = self.local_epoch
            if self.grad_averager is not None and not self.auxiliary:
                self.grad_averager.reset_accumulated_grads_()
                if not self.client_mode:
                    self.grad_averager.state_sharing_priority = self.local_epoch
        self._counter.epoch_ended()
        self._log_epoch(info, time.perf_counter() - started)

    def _log_epoch(self, info: dict[str, Any], seconds: float) -> None:
        """The one INFO line of an epoch."""
        if self.grad_averager is None:
            how = "local updates"
        elif info["grad_group"] is not None:
            how = f"averaged with {info['grad_group'] - 1} peers in {info['grad_seconds']:.2f} s"
        elif info["grad_error"] is not None:
            how = f"local gradients ({info['grad_error']})"
        elif self.delay_grad_averaging and info.get("delayed"):
            how = "gradients averaging in the background"
        else:
            how = "local gradients (no other peer)"
        info["seconds"] = seconds
        self.last_epoch_info = info
        logger.info(
            "%s epoch %d: %d peers, %d samples, %s",
            self.run_id,
            info["epoch"],
            info["peers"],
            info["samples"],
            how,
        )

    def _begin_averaging_gradients(self, grad_scaler: GradScaler | None) -> bool:
        """Start the gradient round (R-A5); whether it started. With a scaler and
        ``reuse_grad_buffers``, the accumulated ``.grad`` is unscaled first (own accumulators
        hold unscaled gradients already)."""
        assert self.grad_averager is not None
        assert self.tracker is not None
        if grad_scaler is not None and self.grad_averager.reuse_grad_buffers:
            grad_scaler._unscale_accumulated(self)
        began = False
        if self.scheduled_grads is not None and (
            self.scheduled_grads.triggered or self.scheduled_grads.done()
        ):
            logger.log(
                self.status_loglevel,
                "%s: not using the pre-scheduled gradient round %r, it was used already",
                self.run_id,
                self.scheduled_grads,
            )
            self.scheduled_grads = None
        # (not elif, as hivemind's: a used handle left from the last epoch, when no round was
        # scheduled ahead this time, must not make this peer step alone)
        if self.tracker.global_progress.num_peers > 1:
            try:
                self._expect_peers(self.grad_averager)
                options = (
                    {} if self.scheduled_grads is not None else {"gather": self._grad_gather()}
                )
                self.scheduled_grads = self.grad_averager.step(
                    control=self.scheduled_grads, reset_accumulators=True, wait=False, **options
                )
                began = True
            except Exception as exc:
                logger.warning(
                    "%s: could not start averaging gradients (%s); stepping on local gradients",
                    self.run_id,
                    exc,
                )
        if not began and self.scheduled_grads is not None and not self.scheduled_grads.done():
            if self.tracker.global_progress.num_peers > 1:
                self._tag_along_with_zero_weight(self.scheduled_grads)
            else:
                self.scheduled_grads.cancel()
            self.scheduled_grads = None
        return began

    def _average_gradients_and_load_into_optimizer(
        self, handle: StepHandle | None, info: dict[str, Any]
    ) -> None:
        """Wait for the gradient round; on success give its result to the optimizer, else the
        local gradients."""
        assert self.grad_averager is not None
        averaged = False
        try:
            if handle is not None:
                result = handle.result(self.averaging_timeout)
                if self.grad_gather is not None:
                    self.last_grad_gathered = dict(result.gathered)
                info["grad_group"] = result.group_size
                info["grad_seconds"] = result.matchmaking_seconds + result.allreduce_seconds
                self._load_averaged_gradients_into_optimizer()
                averaged = True
                self._counter.gradients_averaged()
        except Exception as exc:
            info["grad_error"] = f"{type(exc).__name__}: {exc}"[:200]
            # (no group: matchmaking gave up, or the wait ended while it still looked)
            info["grad_no_group"] = isinstance(exc, MatchmakingFailed) or (
                handle is not None
                and handle.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)
            )
            # (a delayed round that shutdown() cancelled is no news)
            logger.log(
                self.status_loglevel if self._closed else logging.WARNING,
                "%s epoch %d: averaging gradients failed (%s); stepping on local gradients",
                self.run_id,
                info["epoch"],
                info["grad_error"],
            )
        if not averaged:
            self._counter.stepped_locally("failed" if handle is not None else "not_started")
            self._load_local_gradients_into_optimizer(info)

    def _load_local_gradients_into_optimizer(self, info: dict[str, Any]) -> None:
        """Step on this peer's own gradients: put them in the averaged buffers and from there
        into the optimizer (always both: a stale ``.grad`` is never stepped on, A.4)."""
        assert self.grad_averager is not None
        self.grad_averager.load_accumulators_into_averager_()
        self._load_averaged_gradients_into_optimizer()

    def _load_averaged_gradients_into_optimizer(self) -> None:
        assert self.grad_averager is not None
        if not self.offload_optimizer:
            optimized = self._optimized_parameters()
            with torch.no_grad(), self.grad_averager.get_tensors() as averaged:
                if len(averaged) != len(optimized):
                    raise RuntimeError("the gradient averager has another number of tensors")
                for param, grad in zip(optimized, averaged, strict=True):
                    if param.grad is None:
                        param.grad = grad.to(param.device, copy=True)
                    else:
                        param.grad.copy_(grad, non_blocking=True)
        self.grad_averager.notify_used_averaged_gradients()

    def _grad_gather(self) -> Any:
        """What this peer shares with a gradient round's group (:attr:`grad_gather`)."""
        if self.grad_gather is None:
            return None
        import msgpack

        try:
            value = self.grad_gather()
            msgpack.packb(value, use_bin_type=True)
        except Exception as exc:
            logger.warning("%s: grad_gather failed (%s); sharing nothing", self.run_id, exc)
            return None
        return value

    def _expect_peers(self, averager: Any) -> None:
        """Tell ``averager``'s matchmaking how many peers the progress records show: a group
        is not assembled early among the first few to look (the others look soon: a swarm
        that split so would average in two halves, round after round)."""
        assert self.tracker is not None
        # (peers whose record went stale, e.g. killed ones, are not waited for: their record
        # outlives them by up to metadata_expiration)
        averager.expected_group_size = max(1, self.tracker.global_progress.num_active_peers)

    def _maybe_schedule_gradient_averaging(self) -> None:
        """Find the gradient round's group while the last batches are computed (R-A6).

        Not with ``delay_grad_averaging``: there the round runs in the background anyway, so
        its matchmaking is hidden without pre-scheduling; and a pre-scheduled round waits for
        this peer's trigger, which comes only after the previous delayed step, itself behind
        the previous state round in the background thread. A groupmate still in its previous
        gradient round (groups split: a peer lagged, or loaded the state) that met this
        pre-scheduled round would wait for that trigger, while this peer's state round waits
        for that groupmate: a cycle that only the all-reduce's timeouts broke (7.5-15 s an
        epoch). Begun at the epoch's end instead, the round needs no trigger."""
        assert self.grad_averager is not None
        assert self.tracker is not None
        if self.delay_grad_averaging:
            return
        from swarmavg._time import get_dht_time

        eta = self.tracker.estimated_next_update_time - get_dht_time()
        if eta <= self.matchmaking_time:
            handle = self.scheduled_grads
            if handle is None or handle.triggered or handle.done():
                logger.log(
                    self.status_loglevel,
                    "%s: finding a group for the gradient round (ETA %.2f s)",
                    self.run_id,
                    max(eta, 0.0),
                )
                self._expect_peers(self.grad_averager)
                self.scheduled_grads = self.grad_averager.schedule_step(
                    scheduled_time=get_dht_time() + max(eta, self.matchmaking_time),
                    timeout=self.averaging_timeout,
                    gather=self._grad_gather(),
                )

    def _maybe_schedule_state_averaging(self) -> None:
        """Find the state round's group ahead of time (R-A6)."""
        assert self.state_averager is not None
        assert self.tracker is not None
        from swarmavg._time import get_dht_time

        next_epoch = max(self.local_epoch + 1, self.tracker.global_epoch)
        if next_epoch % self.average_state_every != 0:
            return
        if self.state_averager.averaging_in_progress:
            return
        if self.delay_before_state_averaging.num_updates == 0:
            return
        estimated = self.tracker.estimated_next_update_time
        estimated += self.delay_before_state_averaging.ema_seconds_per_sample
        estimated += self.state_averager.delay_before_averaging.ema_seconds_per_sample
        eta = estimated - get_dht_time()
        if eta <= self.matchmaking_time:
            handle = self.scheduled_state
            if handle is None or handle.triggered or handle.done():
                self._expect_peers(self.state_averager)
                self.scheduled_state = self.state_averager.schedule_step(
                    scheduled_time=get_dht_time() + max(eta, self.matchmaking_time),
                    gather=next_epoch,
                    timeout=self.averaging_timeout,
                )

    def _tag_along_with_zero_weight(self, handle: StepHandle, timeout: float | None = None) -> None:
        """Stay in a round this peer joined, contributing nothing (R-A6 [keep]: a peer never
        deserts a group it joined), for ``timeout`` seconds at most (``averaging_timeout``)."""
        if not handle.triggered:
            handle.weight = 0.0
            handle.allow_allreduce()
        if not handle.done():
            try:
                handle.result(self.averaging_timeout if timeout is None else timeout)
            except Exception as exc:
                logger.log(self.status_loglevel, "%s: tag-along round failed: %s", self.run_id, exc)
                handle.cancel()

    # -- synchronization -----------------------------------------------------------------------

    def _should_load_state_from_peers(self) -> bool:
        """Whether this peer must download the state (R-A9): once per epoch, at the first
        fetch of the swarm's progress after it, strictly (same epoch as the swarm); otherwise
        when it is more than one epoch behind."""
        assert self.tracker is not None
        if (
            self._should_check_synchronization_on_update
            and self.tracker.fetched_global_progress_this_epoch.is_set()
        ):
            self._should_check_synchronization_on_update = False
            if self._resyncs_in_a_row >= _MAX_RESYNCS_IN_A_ROW:
                return False  # (epochs shorter than a download: train on, a step behind)
            return self.local_epoch != self.tracker.global_epoch
        return self.local_epoch < self.tracker.global_epoch - 1

    def _resync(self) -> bool:
        """Called by :meth:`step`: download the state unless a recent attempt failed (then
        wait, with a doubling backoff). Whether the state was loaded."""
        now = time.monotonic()
        if now < self._resync_not_before:
            return False
        try:
            self.load_state_from_peers()
        except LoadStateFailed as exc:
            self._resync_failures += 1
            wait = min(_RESYNC_BACKOFF[0] * 2 ** (self._resync_failures - 1), _RESYNC_BACKOFF[1])
            self._resync_not_before = time.monotonic() + wait
            logger.warning("%s: %s; training on, next try in %.0f s", self.run_id, exc, wait)
            return False
        self._resync_failures = 0
        return True

    def load_state_from_peers(self, **kwargs: Any) -> None:
        """Download the newest state of the run from a peer that is up to date: parameters,
        optimizer state, epoch and learning rate, written in place.

        Tries donors (best first) until one succeeds or ``load_state_timeout`` seconds passed.

        :raises LoadStateFailed: no donor, or none succeeded in time (the message says what
            happened); this peer's state is unchanged then.
        """
        if self._closed:
            raise RuntimeError("this swarmavg.Optimizer was shut down")
        assert self.state_averager is not None
        assert self.tracker is not None
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self._tag_along_with_zero_weight(self.scheduled_grads)
            self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)

        with self.tracker.pause_updates():
            deadline = time.monotonic() + self.load_state_timeout
            attempts = 0
            errors: list[str] = []
            loaded = False
            got_some = False  # (a state behind the swarm's epoch: better than none)
            while not loaded:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or attempts >= 3:
                    break
                attempts += 1
                try:
                    # (one epoch past the swarm's as its records say: its epoch may have
                    # ended while we looked)
                    supported = self.tracker.global_epoch + 1
                    loaded = bool(
                        self.state_averager.load_state_from_peers(
                            timeout=remaining, max_epoch=supported, **kwargs
                        )
                    )
                    if not loaded:
                        errors.append("no peer served a usable state")
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                if loaded and self.local_epoch < self.tracker.global_epoch and attempts < 3:
                    # the donor's epoch ended while it served us: its next state is the one
                    logger.log(
                        self.status_loglevel,
                        "%s: downloaded the state of epoch %d, the swarm is at %d: again",
                        self.run_id,
                        self.local_epoch,
                        self.tracker.global_epoch,
                    )
                    loaded, got_some = False, True
                    continue
                if not loaded and time.monotonic() < deadline:
                    time.sleep(min(0.5 * attempts, max(0.0, deadline - time.monotonic())))
            loaded = loaded or got_some
            self._counter.state_loaded(ok=loaded)
            if not loaded:
                raise LoadStateFailed(
                    f"could not download the state of run {self.run_id!r} "
                    f"({attempts} attempt(s) in {self.load_state_timeout:.0f} s at most: "
                    f"{'; '.join(errors[-3:]) or 'timed out'})"
                )
            if self.tracker.global_epoch - 1 <= self.local_epoch < self.tracker.global_epoch:
                logger.log(
                    self.status_loglevel,
                    "%s: catching up with epoch %d",
                    self.run_id,
                    self.tracker.global_epoch,
                )
                self.state_averager.local_epoch = self.tracker.global_epoch
                with self.state_averager.lock_optimizer:  # (lr(epoch) during the epoch)
                    self.state_averager._update_scheduler()
            self.tracker.report_local_progress(self.local_epoch, 0)
            # The donor may have ended its epoch while we downloaded: the next read of the
            # swarm's progress tells, and then we download again (at most a few times in a row)
            # rather than train a step behind the others.
            self._resyncs_in_a_row += 1
            self._should_check_synchronization_on_update = True
            self.tracker.fetched_global_progress_this_epoch.clear()
            if not self.client_mode:
                self.state_averager.state_sharing_priority = self.local_epoch
            if self.grad_averager is not None:
                self.grad_averager.reset_accumulated_grads_()
                if not self.client_mode:
                    self.grad_averager.state_sharing_priority = self.local_epoch
        logger.info("%s: loaded the swarm's state at epoch %d", self.run_id, self.local_epoch)

    # -- gradients and state dicts -------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients.

        :raises ValueError: with ``reuse_grad_buffers=True`` (the optimizer clears them itself).
        """
        if self.grad_averager is not None and self.grad_averager.reuse_grad_buffers:
            raise ValueError(
                "with reuse_grad_buffers=True the gradients are the accumulators: never call "
                "zero_grad() (the optimizer clears them at each epoch)"
            )
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_()
                    param.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict, plus ``state["local_epoch"]``."""
        state_dict = self.opt.state_dict()
        state_dict["state"]["local_epoch"] = self.local_epoch
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (the epoch too: the progress tracker and the
        state this peer shares move to it, so a peer resumed from a checkpoint is not out of
        sync with its own, stale, record; one behind the swarm still downloads the state)."""
        assert self.state_averager is not None
        assert self.tracker is not None
        state_dict = dict(state_dict)
        state = dict(state_dict.get("state", {}))
        epoch = state.pop("local_epoch", None)
        state_dict["state"] = state
        self.opt.load_state_dict(state_dict)
        if epoch is not None:
            self.state_averager.local_epoch = int(epoch)
            with self.tracker.pause_updates():
                self.tracker.update_epoch(self.local_epoch)
            if not self.client_mode:
                self.state_averager.state_sharing_priority = self.local_epoch
                if self.grad_averager is not None:
                    self.grad_averager.state_sharing_priority = self.local_epoch

    def __repr__(self) -> str:
        epoch = self.local_epoch if self.state_averager is not None else None
        return f"{type(self).__name__}(run_id={self.run_id!r}, epoch={epoch})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("swarmavg.Optimizer cannot be pickled (it holds live network state)")

    # -- lifecycle -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leave the run: tell the swarm, finish or leave pending rounds, stop the averagers.
        Takes about ``shutdown_timeout`` seconds at most (a round this peer already began is
        finished with weight 0 if it ends by then, as hivemind's; one still looking for a
        group is left at once, and the groupmates are told). Idempotent."""
        if self._closed:
            return
        self._closed = True
        logger.log(self.status_loglevel, "%s: leaving the run", self.run_id)
        try:
            if self.tracker is not None:
                self.tracker.shutdown(self.shutdown_timeout)
            for handle in (self.scheduled_grads, self.scheduled_state):
                if handle is None or handle.done():
                    continue
                if handle.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP):
                    handle.cancel()
                else:
                    self._tag_along_with_zero_weight(handle, self.shutdown_timeout)
            if self.state_averager is not None:
                # a delayed optimizer step or round still running: give it shutdown_timeout
                self.state_averager._wait_for_pending(self.shutdown_timeout)
        finally:
            self._close_parts()

    def _close_parts(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.close()
        for part in (self.tracker, self.grad_averager, self.state_averager):
            if part is not None:
                with contextlib.suppress(Exception):
                    part.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if getattr(self, "_parent_pid", None) == os.getpid() and not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.shutdown()
