"""``TrainingStateAverager``: a peer's training state (parameters, optimizer statistics, extra
tensors, epoch), kept weakly in sync with its peers (hivemind's ``TrainingStateAverager``).

Theory of operation
-------------------
The *local tensors* are the tensors the optimizer works on: its parameters (the model's own, or
fp32 CPU copies with ``offload_optimizer``), then, for each name in ``average_opt_statistics``,
that statistic of every parameter (``optimizer.state[p][name]``), then ``extra_tensors``. The
*averaged tensors* are what the :class:`swarmavg.DecentralizedAverager` underneath averages: the
local tensors themselves (``reuse_tensors``), or fp32 CPU copies of them (views of one flat
buffer, so that a round averages them in place).

:meth:`TrainingStateAverager.step` does, in this order: wait for background work
(``wait_for_delayed_updates``), forget finished work, apply finished work
(``apply_delayed_updates``: averaging results into the local tensors, offloaded parameters into
the model), ``local_epoch += 1`` (``increment_epoch``), then submits one *job* to a background
thread (two with the delta rule) and waits for the parts that are not delayed. A job
(:meth:`_do`) finds or reuses a group (``averaging_control``), runs ``wait_for_trigger``, then
under ``lock_optimizer`` the optimizer step, ``zero_grad`` and the scheduler, then under
``lock_averaging`` copies the local tensors into the averaged ones and averages them. Each job
carries its own events, so a caller waits for its own job, never for an event another job set.

Locks, always taken in this order: ``lock_optimizer`` (the optimizer, the scheduler and the
local tensors), then the averaged tensors' lock (:meth:`get_tensors`). ``lock_averaging`` is
held by a job from the copy into the averaged tensors to the end of its round
(:attr:`averaging_in_progress`).

The state served to peers that :meth:`load_state_from_peers` (:meth:`get_current_state`) is
msgpack metadata ``{"epoch", "group_bits", "optimizer_metadata"}`` and tensors: the optimizer's
parameters, the extra tensors, then the tensors of ``optimizer.state_dict()``; the state dict's
other values travel in ``optimizer_metadata`` (a tagged tree, see :func:`_encode_tree`). No
pickle. A receiver checks everything against its own optimizer before it changes anything.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import torch

from swarmavg.averager import DecentralizedAverager, StepHandle
from swarmavg.compression import TensorInfo

if TYPE_CHECKING:
    from swarmavg._step import StepResult
    from swarmavg.dht import DHT

__all__ = ["TrainingStateAverager"]

#: Scheduler steps beyond which the scheduler jumps to the epoch (:meth:`_update_scheduler`).
_MAX_SCHEDULER_STEPS = 10_000
logger = logging.getLogger(__name__)

Parameters: TypeAlias = Iterable[torch.Tensor]
ParamGroups: TypeAlias = Iterable[dict[str, Any]]
LRScheduler: TypeAlias = torch.optim.lr_scheduler.LRScheduler
OptimizerFactory: TypeAlias = Callable[[Any], torch.optim.Optimizer]
SchedulerFactory: TypeAlias = Callable[[torch.optim.Optimizer], LRScheduler]

#: ``target_group_size=None`` (hivemind: everyone who shows up): groups of up to this many; a
#: group begins at its scheduled time, or as soon as every peer looking under the key joined.
EVERYONE = 256
#: Keys of ``averaging_opts`` (the averaging round's options; its weight is always the default).
_AVERAGING_OPTS = frozenset({"timeout", "allow_retries", "scheduled_time"})
#: Tags of the optimizer-metadata tree (:func:`_encode_tree`).
_TENSOR, _LIST, _TUPLE, _DICT = "T", "L", "U", "D"
#: The deepest metadata tree a receiver accepts (a torch state dict is 4 deep).
_MAX_DEPTH = 16
_SCALARS = (type(None), bool, int, float, str, bytes)


class _Refused(Exception):
    """A downloaded state that this averager cannot use (the message says why)."""


@dataclass(eq=False)
class _Job:
    """One submission to the background thread and what became of it."""

    optimizer_step: bool
    zero_grad: bool
    averaging_round: bool
    #: set when the optimizer part (step, zero_grad, scheduler) is over, or the job failed
    stepped: threading.Event = field(default_factory=threading.Event)
    #: set when the averaging part is over, or the job failed
    averaged: threading.Event = field(default_factory=threading.Event)
    future: concurrent.futures.Future[StepResult | None] | None = None
    #: the round (made by the job, or pre-scheduled) while the job runs
    control: StepHandle | None = None
    #: the round's result (``None``: it failed or did not run)
    result: StepResult | None = None
    #: the averaged tensors before the round (delta rule)
    old_tensors: list[torch.Tensor] | None = None
    step_applied: bool = False
    average_applied: bool = False
    reported: bool = False

    @property
    def updates_parameters(self) -> bool:
        return self.optimizer_step or self.zero_grad

    @property
    def applied(self) -> bool:
        return (not self.updates_parameters or self.step_applied) and (
            not self.averaging_round or self.average_applied
        )


class _SecondsEMA:
    """An exponential moving average of seconds per task (hivemind's ``PerformanceEMA``, as far
    as the optimizer reads it: ``ema_seconds_per_sample``, ``samples_per_second``,
    ``num_updates``)."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.ema_seconds_per_sample = 0.0
        self.samples_per_second = 0.0
        self.num_updates = 0

    def update(self, task_size: float, interval: float) -> float:
        """Count ``task_size`` tasks done in ``interval`` seconds; return the tasks/s."""
        self.ema_seconds_per_sample = (
            self.alpha * interval / task_size + (1 - self.alpha) * self.ema_seconds_per_sample
        )
        self.num_updates += 1
        adjusted = self.ema_seconds_per_sample / (1 - (1 - self.alpha) ** self.num_updates)
        self.samples_per_second = 1 / max(adjusted, 1e-20)
        return self.samples_per_second


class TrainingStateAverager(DecentralizedAverager):
    """Holds a peer's training state and averages it with peers; shares it with peers that fall
    behind (hivemind's ``TrainingStateAverager``, same arguments and defaults).

    Call :meth:`step` (e.g. once per batch) with what to do: ``optimizer_step``, ``zero_grad``,
    ``averaging_round``, ``increment_epoch``, each possibly in the background. A peer that fell
    behind calls :meth:`load_state_from_peers`. Do not call the optimizer yourself while
    background steps run: go through :meth:`step`.

    :param dht: a running :class:`swarmavg.DHT`.
    :param optimizer: a ``torch.optim.Optimizer``, or a factory ``callable(param_groups)`` that
        makes one (required with ``offload_optimizer``).
    :param params: the parameters, or param groups (dicts with ``"params"``); default: the
        optimizer's (required with a factory).
    :param scheduler: an LR scheduler, or a factory ``callable(optimizer)`` (required to be a
        factory when the optimizer is one). It follows :attr:`local_epoch`: during epoch ``e``
        the learning rate is ``lr(e)``.
    :param initialize_optimizer: create the optimizer's state now (default: when it has no
        state tensors). Unlike hivemind, this changes neither the parameters nor any ``step``
        counter: see :func:`_initialize_optimizer_state`.
    :param offload_optimizer: the optimizer works on fp32 CPU copies of the parameters (the
        model keeps only parameters and gradients); the copies are written into the model
        after each step.
    :param custom_gradients: with ``offload_optimizer``, the offloaded ``.grad`` are filled by
        someone else (:class:`swarmavg.Optimizer`), not copied from the model's.
    :param reuse_tensors: average the local tensors in place, without copies (default:
        ``offload_optimizer and not delta_rule_averaging``); they must be CPU floating-point
        tensors.
    :param delta_rule_averaging: apply a round as ``local += averaged - averaged_before``, so
        that local steps taken during the round are kept (two background threads).
    :param performance_ema_alpha: smoothing of :attr:`delay_before_averaging`.
    :param sync_epoch_when_averaging: after a round, take the highest epoch of the group.
    :param parameter_names: one name per parameter (default ``0 .. n-1``).
    :param average_opt_statistics: names of optimizer statistics to average, e.g.
        ``("exp_avg_sq",)``.
    :param extra_tensors: more tensors to average and share (e.g. BatchNorm statistics).
    :param status_loglevel: the level of status log lines.
    :param kwargs: for :class:`swarmavg.DecentralizedAverager` (``prefix``,
        ``target_group_size`` (``None``: everyone who shows up, up to 256), ``compression``,
        ``state_compression``, timeouts, ``start``...); ``tensor_infos`` is set here (roles
        ``parameter``, ``optimizer``, ``unspecified``).
    :raises TypeError: an argument has the wrong type (the message names it).
    :raises ValueError: an inconsistent configuration (the message names the arguments).
    """

    def __init__(
        self,
        *,
        dht: DHT,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        params: Parameters | ParamGroups | None = None,
        scheduler: LRScheduler | SchedulerFactory | None = None,
        initialize_optimizer: bool | None = None,
        offload_optimizer: bool = False,
        custom_gradients: bool = False,
        reuse_tensors: bool | None = None,
        delta_rule_averaging: bool = False,
        performance_ema_alpha: float = 0.1,
        sync_epoch_when_averaging: bool = False,
        parameter_names: Sequence[Any] | None = None,
        average_opt_statistics: Sequence[str] = (),
        extra_tensors: Sequence[torch.Tensor] = (),
        status_loglevel: int = logging.DEBUG,
        **kwargs: Any,
    ) -> None:
        for name, flag in (
            ("offload_optimizer", offload_optimizer),
            ("custom_gradients", custom_gradients),
            ("delta_rule_averaging", delta_rule_averaging),
            ("sync_epoch_when_averaging", sync_epoch_when_averaging),
        ):
            _check_bool(name, flag)
        if reuse_tensors is None:
            reuse_tensors = offload_optimizer and not delta_rule_averaging
        _check_bool("reuse_tensors", reuse_tensors)
        if initialize_optimizer is not None:
            _check_bool("initialize_optimizer", initialize_optimizer)
        if reuse_tensors and delta_rule_averaging:
            raise ValueError("reuse_tensors and delta_rule_averaging are mutually exclusive")
        if custom_gradients and not offload_optimizer:
            logger.warning("custom_gradients=True has no effect: the optimizer is not offloaded")
        if isinstance(performance_ema_alpha, bool) or not (
            isinstance(performance_ema_alpha, int | float) and 0 < performance_ema_alpha <= 1
        ):
            raise ValueError(
                f"performance_ema_alpha must be in (0, 1], not {performance_ema_alpha!r:.40}"
            )
        if isinstance(status_loglevel, bool) or not isinstance(status_loglevel, int):
            raise TypeError(
                f"status_loglevel must be a logging level (int), not {status_loglevel!r:.40}"
            )
        if isinstance(average_opt_statistics, str) or not all(
            isinstance(key, str) for key in average_opt_statistics
        ):
            raise TypeError("average_opt_statistics must be a sequence of names (str)")
        extras: object = extra_tensors
        if isinstance(extras, torch.Tensor) or not all(
            isinstance(t, torch.Tensor) for t in extra_tensors
        ):
            raise TypeError("extra_tensors must be a sequence of tensors")
        if "tensor_infos" in kwargs:
            raise TypeError(
                "tensor_infos is set by TrainingStateAverager (roles parameter, optimizer, "
                "unspecified): choose codecs with a RoleAdaptiveCompression instead"
            )
        if kwargs.get("target_group_size") is None:
            kwargs["target_group_size"] = EVERYONE
            kwargs.setdefault("min_group_size", 2)

        optimizer_is_factory = not isinstance(optimizer, torch.optim.Optimizer)
        if optimizer_is_factory and not callable(optimizer):
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer or a factory callable(params), "
                f"not {type(optimizer).__name__}"
            )
        scheduler_is_factory = scheduler is not None and not isinstance(scheduler, LRScheduler)
        if scheduler_is_factory and not callable(scheduler):
            raise TypeError(
                "scheduler must be an LR scheduler or a factory callable(optimizer), "
                f"not {type(scheduler).__name__}"
            )
        if optimizer_is_factory and scheduler is not None and not scheduler_is_factory:
            raise ValueError(
                "optimizer is a factory, so scheduler must be one too (callable(optimizer)): "
                "a scheduler instance is bound to another optimizer"
            )
        if offload_optimizer and not optimizer_is_factory:
            raise ValueError(
                "offload_optimizer=True needs an optimizer factory (callable(params)): the "
                "optimizer is created over the offloaded parameters"
            )
        if optimizer_is_factory and params is None:
            raise ValueError("params is required when optimizer is a factory")

        self.status_loglevel = status_loglevel
        self.offload_optimizer = offload_optimizer
        self.custom_gradients = custom_gradients
        self.reuse_tensors = reuse_tensors
        self.delta_rule_averaging = delta_rule_averaging
        self.sync_epoch_when_averaging = sync_epoch_when_averaging
        self.average_opt_statistics = tuple(average_opt_statistics)
        self.opt_keys_for_averaging = self.average_opt_statistics  # (hivemind's name)
        self.extra_tensors = tuple(extra_tensors)

        groups = _param_groups(params if params is not None else optimizer.param_groups)  # type: ignore[union-attr]
        self.main_parameters: tuple[torch.Tensor, ...] = tuple(
            p for group in groups for p in group["params"]
        )
        if len(set(map(id, self.main_parameters))) != len(self.main_parameters):
            raise ValueError("params holds the same parameter twice")
        self.parameter_names = _parameter_names(parameter_names, len(self.main_parameters))
        trained = sum(p.numel() for p in self.main_parameters if p.requires_grad)
        frozen = sum(p.numel() for p in self.main_parameters if not p.requires_grad)
        if frozen and frozen >= trained:
            logger.warning(
                "most parameters have requires_grad=False but are averaged with peers all the "
                "same: leave frozen parameters out of the optimizer to save bandwidth"
            )

        self.optimizer = self._make_optimizer(optimizer, groups, optimizer_is_factory)
        if initialize_optimizer is None:
            initialize_optimizer = not any(
                isinstance(value, torch.Tensor)
                for state in self.optimizer.state.values()
                for value in state.values()
            )
        if initialize_optimizer:
            logger.log(status_loglevel, "creating the optimizer's state (no step is taken)")
            _initialize_optimizer_state(self.optimizer)
        self.scheduler = self._make_scheduler(scheduler, scheduler_is_factory)

        local = self._local_tensors()  # (raises if a statistic is missing)
        if reuse_tensors:
            for index, tensor in enumerate(local):
                if tensor.device.type != "cpu" or not tensor.is_floating_point():
                    raise ValueError(
                        f"reuse_tensors=True needs CPU floating-point tensors: averaged tensor "
                        f"{index} is {tensor.dtype} on {tensor.device}"
                    )
            averaged = [tensor.detach() for tensor in local]
        else:
            averaged = _flat_copies(local)
        infos = self._tensor_infos(local)

        self.local_epoch = 0
        self.delay_before_averaging = _SecondsEMA(float(performance_ema_alpha))
        self.lock_optimizer = threading.Lock()
        self.lock_averaging = threading.Lock()
        self._epoch_lock = threading.Lock()
        self._pending: list[_Job] = []
        self._closing = False
        self.step_executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=2 if delta_rule_averaging else 1,
            thread_name_prefix="swarmavg-state-averager",
        )
        super().__init__(averaged, dht, tensor_infos=infos, **kwargs)

    # -- construction ----------------------------------------------------------------------------

    def _make_optimizer(
        self,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        groups: list[dict[str, Any]],
        is_factory: bool,
    ) -> torch.optim.Optimizer:
        if not is_factory:
            assert isinstance(optimizer, torch.optim.Optimizer)
            made = optimizer
        else:
            assert callable(optimizer)
            if self.offload_optimizer:
                offloaded = iter(_offloaded_copy(p) for p in self.main_parameters)
                groups = [
                    dict(group, params=[next(offloaded) for _ in group["params"]])
                    for group in groups
                ]
            made = optimizer(groups)
            if not isinstance(made, torch.optim.Optimizer):
                raise TypeError(
                    f"the optimizer factory returned a {type(made).__name__}, not a "
                    "torch.optim.Optimizer"
                )
        own = [p for group in made.param_groups for p in group["params"]]
        if len(made.param_groups) != len(groups) or len(own) != len(self.main_parameters):
            raise ValueError(
                f"the optimizer has {len(own)} parameters in {len(made.param_groups)} groups; "
                f"params has {len(self.main_parameters)} in {len(groups)}"
            )
        if not self.offload_optimizer and any(
            a is not b for a, b in zip(own, self.main_parameters, strict=True)
        ):
            raise ValueError("params are not the parameters of the optimizer (in its order)")
        return made

    def _make_scheduler(
        self, scheduler: LRScheduler | SchedulerFactory | None, is_factory: bool
    ) -> LRScheduler | None:
        if scheduler is None:
            return None
        made = scheduler(self.optimizer) if is_factory else scheduler  # type: ignore[operator]
        if not isinstance(made, LRScheduler):
            raise TypeError(
                f"the scheduler factory returned a {type(made).__name__}, not an LR scheduler"
            )
        if made.optimizer is not self.optimizer:
            raise ValueError("the scheduler is bound to another optimizer")
        return made

    def _tensor_infos(self, local: Sequence[torch.Tensor]) -> list[TensorInfo]:
        roles = (
            ["parameter"] * len(self.main_parameters)
            + ["optimizer"] * (len(self.average_opt_statistics) * len(self.main_parameters))
            + ["unspecified"] * len(self.extra_tensors)
        )
        return [
            TensorInfo(role=role, size=tensor.numel())
            for role, tensor in zip(roles, local, strict=True)
        ]

    # -- the tensors -----------------------------------------------------------------------------

    def _optimizer_parameters(self) -> list[torch.Tensor]:
        """The parameters the optimizer updates (the offloaded copies with offloading)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _local_tensors(self) -> list[torch.Tensor]:
        """The tensors averaged with peers, in their order: parameters, statistics, extras.

        :raises ValueError: the optimizer's state lacks a statistic of ``average_opt_statistics``.
        """
        params = self._optimizer_parameters()
        statistics = []
        for name in self.average_opt_statistics:
            for index, param in enumerate(params):
                value = self.optimizer.state.get(param, {}).get(name)
                if not isinstance(value, torch.Tensor):
                    raise ValueError(
                        f"average_opt_statistics names {name!r}, but the optimizer's state of "
                        f"parameter {index} has no such tensor (initialize_optimizer=False?)"
                    )
                statistics.append(value)
        return [*params, *statistics, *self.extra_tensors]

    @contextlib.contextmanager
    def _reading_averaged_tensors(self) -> Iterator[None]:
        """Hold the averaged tensors' lock to read them (results are not written meanwhile);
        unlike :meth:`get_tensors`, it does not count as a change of the tensors."""
        with self._averager._lock:
            yield

    def _averaged_if_reused(self) -> contextlib.AbstractContextManager[object]:
        """The averaged tensors' lock where the local tensors are averaged in place."""
        return self._reading_averaged_tensors() if self.reuse_tensors else contextlib.nullcontext()

    @torch.no_grad()
    def _load_local_grads_into_optimizer(self) -> None:
        """Copy the model's gradients into the offloaded optimizer's (a missing gradient leaves
        the offloaded parameter without one: the optimizer skips it, as it would the model's)."""
        for main, offloaded in zip(self.main_parameters, self._optimizer_parameters(), strict=True):
            if main.grad is None:
                offloaded.grad = None
            elif offloaded.grad is None:
                offloaded.grad = main.grad.detach().to(offloaded.device, offloaded.dtype, copy=True)
            else:
                offloaded.grad.copy_(main.grad, non_blocking=True)

    @torch.no_grad()
    def _copy_offloaded_to_main(self, *, locked: bool = False) -> None:
        """Write the offloaded parameters into the model's (``locked``: the caller holds
        ``lock_optimizer`` and, with ``reuse_tensors``, the averaged tensors' lock)."""
        with (
            contextlib.nullcontext() if locked else self.lock_optimizer,
            contextlib.nullcontext() if locked else self._averaged_if_reused(),
        ):
            for main, offloaded in zip(
                self.main_parameters, self._optimizer_parameters(), strict=True
            ):
                main.copy_(offloaded, non_blocking=True)

    @torch.no_grad()
    def _copy_local_into_averager(self, job: _Job) -> None:
        """Copy the local tensors into the averaged ones (unless they are the same) and, with
        the delta rule, remember them. (Under ``lock_optimizer``: a local step in the other
        thread does not tear the copy.)"""
        if self.reuse_tensors:
            return  # (they are the same tensors; reuse_tensors excludes the delta rule)
        with self.lock_optimizer, self.get_tensors() as averaged:
            for target, source in zip(averaged, self._local_tensors(), strict=True):
                target.copy_(source, non_blocking=True)
            if self.delta_rule_averaging:
                job.old_tensors = [tensor.detach().clone() for tensor in averaged]

    @torch.no_grad()
    def _apply_averaging_results(self, job: _Job) -> None:
        """Write a finished round's results into the local tensors: copy them, or with the
        delta rule add what the round changed (``averaged - averaged_before``)."""
        with self.lock_optimizer, self.get_tensors() as averaged:
            local = self._local_tensors()
            if self.delta_rule_averaging and job.old_tensors is not None:
                for target, new, old in zip(local, averaged, job.old_tensors, strict=True):
                    delta = torch.sub(new, old, out=old)
                    target.add_(delta.to(device=target.device, dtype=target.dtype))
            else:
                for target, new in zip(local, averaged, strict=True):
                    target.copy_(new, non_blocking=True)
        job.old_tensors = None

    # -- stepping --------------------------------------------------------------------------------

    def schedule_step(self, scheduled_time: float | None = None, **kwargs: Any) -> StepHandle:
        """Look for a group now, to average at ``scheduled_time`` (DHT time): a
        ``require_trigger`` handle to pass to :meth:`step` as ``averaging_control`` (used
        once). ``kwargs``: ``gather`` (default: :attr:`local_epoch`), ``timeout``,
        ``allow_retries``.

        :raises ValueError: a ``weight`` is given (state rounds weigh every peer equally).
        :raises TypeError: another keyword.
        """
        if kwargs.pop("weight", None) is not None:
            raise ValueError("schedule_step takes no weight: state rounds weigh peers equally")
        unknown = set(kwargs) - {"gather", "timeout", "allow_retries"}
        if unknown:
            raise TypeError(f"schedule_step got unexpected keywords {sorted(unknown)}")
        return DecentralizedAverager.step(
            self,
            gather=kwargs.get("gather", self.local_epoch),
            timeout=kwargs.get("timeout"),
            allow_retries=kwargs.get("allow_retries", True),
            wait=False,
            scheduled_time=scheduled_time,
            require_trigger=True,
        )

    def step(  # type: ignore[override]  # (hivemind's TrainingStateAverager.step)
        self,
        wait_for_delayed_updates: bool | None = None,
        apply_delayed_updates: bool = True,
        increment_epoch: bool = False,
        optimizer_step: bool = False,
        zero_grad: bool = False,
        delay_optimizer_step: bool = False,
        averaging_round: bool = False,
        delay_averaging: bool | None = None,
        averaging_control: StepHandle | None = None,
        wait_for_trigger: Callable[[], Any] | None = None,
        grad_scaler: Any = None,
        set_to_none: bool = True,
        averaging_opts: Mapping[str, Any] | None = None,
    ) -> StepResult | None:
        """Do what the flags ask, in this order:

        1. ``wait_for_delayed_updates``: wait for background steps (default: when an
           ``averaging_round`` is asked, and with the delta rule also for ``optimizer_step`` or
           ``zero_grad``; with ``reuse_tensors`` a round may be queued behind a pending one
           with ``False``: the background thread runs them in order);
        2. ``apply_delayed_updates``: apply finished background rounds (their averages into the
           local tensors) and steps (offloaded parameters into the model);
        3. ``increment_epoch``: ``local_epoch += 1`` at once (the scheduler follows after this
           call's optimizer step, or at once if there is none);
        4. ``optimizer_step`` (``grad_scaler.step(optimizer)`` with a scaler, e.g. torch's
           ``GradScaler`` for standalone use: the caller calls ``update()``), ``zero_grad``
           (``set_to_none``), then the scheduler, in the background thread: after
           ``wait_for_trigger()`` if given; waited for unless ``delay_optimizer_step``;
        5. ``averaging_round``: average the parameters, ``average_opt_statistics`` and
           ``extra_tensors`` with a group (equal weights; ``averaging_control`` a handle from
           :meth:`schedule_step`; ``averaging_opts``: ``timeout``, ``allow_retries``,
           ``scheduled_time``); waited for unless ``delay_averaging`` (default:
           ``delay_optimizer_step``), else applied by a later call.

        A round that fails changes nothing (the failure is logged); ``wait_for_trigger`` that
        raises cancels this call's optimizer step and round (logged).

        :returns: the round's result when this call waited for one that succeeded, else
            ``None``.
        :raises ValueError: inconsistent flags: ``delay_optimizer_step`` without
            ``delay_averaging`` or ``offload_optimizer``; ``averaging_round`` without applying
            the previous one, or without waiting for it (unless ``reuse_tensors``);
            ``averaging_control`` without ``averaging_round``; ``wait_for_trigger`` with
            nothing to trigger or without ``reuse_tensors``/``custom_gradients``; unknown
            ``averaging_opts``; a ``grad_scaler`` with ``delay_optimizer_step``.
        :raises RuntimeError: the averager was shut down.
        :raises Exception: what the optimizer step, ``zero_grad`` or the scheduler raised, when
            this call waited for them (a delayed one is logged instead).
        """
        if self._closing:
            raise RuntimeError("this TrainingStateAverager was shut down")
        for name, flag in (
            ("apply_delayed_updates", apply_delayed_updates),
            ("increment_epoch", increment_epoch),
            ("optimizer_step", optimizer_step),
            ("zero_grad", zero_grad),
            ("delay_optimizer_step", delay_optimizer_step),
            ("averaging_round", averaging_round),
            ("set_to_none", set_to_none),
        ):
            _check_bool(name, flag)
        if delay_averaging is None:
            delay_averaging = delay_optimizer_step
        updates_parameters = optimizer_step or zero_grad
        if wait_for_delayed_updates is None:
            wait_for_delayed_updates = averaging_round or (
                self.delta_rule_averaging and updates_parameters
            )
        if averaging_round and not apply_delayed_updates:
            raise ValueError(
                "averaging_round needs apply_delayed_updates: the previous round must be "
                "applied before the next one begins"
            )
        if averaging_round and not wait_for_delayed_updates and not self.reuse_tensors:
            # (with reuse_tensors a round averages the local tensors in place: nothing is left
            # to apply, and the background thread runs the jobs one after the other)
            raise ValueError(
                "averaging_round needs wait_for_delayed_updates unless reuse_tensors: the "
                "previous round must be over and applied before the next one copies the local "
                "tensors"
            )
        if delay_optimizer_step and not delay_averaging:
            raise ValueError("delay_optimizer_step=True needs delay_averaging=True")
        if delay_optimizer_step and not self.offload_optimizer:
            raise ValueError("delay_optimizer_step=True needs offload_optimizer=True")
        opts = dict(averaging_opts or {})
        unknown = set(opts) - _AVERAGING_OPTS
        if unknown:
            raise ValueError(
                f"averaging_opts takes {sorted(_AVERAGING_OPTS)}, not {sorted(unknown)}"
            )
        if opts and not averaging_round:
            logger.warning("averaging_opts %s unused: averaging_round=False", opts)
        if averaging_control is not None and not averaging_round:
            raise ValueError("averaging_control is used only with averaging_round=True")
        if wait_for_trigger is not None:
            if not callable(wait_for_trigger):
                raise TypeError("wait_for_trigger must be a callable")
            if not (updates_parameters or averaging_round):
                raise ValueError(
                    "wait_for_trigger needs optimizer_step, zero_grad or averaging_round"
                )
            if not (self.reuse_tensors or self.custom_gradients):
                # which gradients should the step use: those of now, or those after the trigger?
                raise ValueError(
                    "wait_for_trigger needs reuse_tensors or custom_gradients: the caller must "
                    "fill the optimizer's gradients itself before the trigger returns"
                )
        if grad_scaler is not None:
            if not callable(getattr(grad_scaler, "step", None)):
                raise TypeError("grad_scaler must have a step(optimizer) method (a GradScaler)")
            if delay_optimizer_step:
                # the caller's grad_scaler.update() would race the step in the background thread
                raise ValueError("grad_scaler needs delay_optimizer_step=False")

        if wait_for_delayed_updates:
            self._wait_for_pending(opts.get("timeout"))
        self._forget_finished()
        if apply_delayed_updates:
            self._apply_finished()
        if increment_epoch:
            with self._epoch_lock:
                self.local_epoch += 1
            if not (updates_parameters or averaging_round):
                with self.lock_optimizer:
                    self._update_scheduler()

        if not (updates_parameters or averaging_round):
            return None
        if self.offload_optimizer and not self.custom_gradients:
            self._load_local_grads_into_optimizer()
        job = _Job(optimizer_step, zero_grad, averaging_round)
        job.future = self.step_executor.submit(
            self._do, job, averaging_control, wait_for_trigger, grad_scaler, set_to_none, opts
        )
        self._pending.append(job)
        await_step = updates_parameters and not delay_optimizer_step
        await_round = averaging_round and not delay_averaging
        if await_step:
            job.stepped.wait()
            job.step_applied = True
            if self.offload_optimizer and not await_round:
                self._copy_offloaded_to_main()
        if await_round:
            job.averaged.wait()
            self._apply_round(job)
            if self.offload_optimizer:
                self._copy_offloaded_to_main()
        if (averaging_round and delay_averaging) or (updates_parameters and delay_optimizer_step):
            return None
        try:
            return job.future.result()
        finally:
            self._pending.remove(job)

    def _do(
        self,
        job: _Job,
        control: StepHandle | None,
        wait_for_trigger: Callable[[], Any] | None,
        grad_scaler: Any,
        set_to_none: bool,
        opts: dict[str, Any],
    ) -> StepResult | None:
        """One job, in the background thread: the round's group, the trigger, the optimizer
        step, zero_grad and the scheduler, then the round. Sets the job's events whatever
        happens; re-raises what the optimizer raised."""
        started = time.perf_counter()
        try:
            if self._closing:
                if control is not None:
                    control.cancel()
                return None
            if job.averaging_round:
                if control is not None and (control.triggered or control.done()):
                    logger.log(self.status_loglevel, "discarding a used pre-scheduled round")
                    control = None
                if control is None:
                    try:
                        control = DecentralizedAverager.step(
                            self,
                            gather=self.local_epoch,
                            timeout=opts.get("timeout"),
                            allow_retries=opts.get("allow_retries", True),
                            wait=False,
                            scheduled_time=opts.get("scheduled_time"),
                            require_trigger=True,
                        )
                    except Exception as exc:  # (shut down meanwhile): the step goes on alone
                        level = self.status_loglevel if self._closing else logging.WARNING
                        logger.log(level, "state averaging did not start: %r", exc)
                job.control = control
            if wait_for_trigger is not None:
                try:
                    wait_for_trigger()
                except Exception as exc:
                    logger.warning(
                        "%s: the step was aborted (no optimizer step, no averaging): "
                        "wait_for_trigger raised %r",
                        type(self).__name__,
                        exc,
                    )
                    if control is not None:
                        control.cancel()
                    return None
            with self.lock_optimizer:
                if job.optimizer_step:
                    self._optimizer_step(grad_scaler)
                if job.zero_grad:
                    self._zero_grad(set_to_none)
                self._update_scheduler()
            job.stepped.set()
            if control is None:
                return None
            with self.lock_averaging:
                self._copy_local_into_averager(job)
                self.delay_before_averaging.update(1, time.perf_counter() - started)
                try:
                    control.allow_allreduce()
                    result = control.result(timeout=opts.get("timeout"))
                except Exception as exc:
                    control.cancel()
                    level = self.status_loglevel if self._closing else logging.WARNING
                    logger.log(level, "state averaging failed (nothing changed): %r", exc)
                    return None
                job.result = result
                logger.log(self.status_loglevel, "averaged the state with %d peers", len(result))
            if self.sync_epoch_when_averaging:
                # (before the caller that awaits the round goes on: its epoch and learning
                # rate have moved together when step() returns)
                self._sync_epoch(result)
            job.averaged.set()
            return result
        except BaseException:
            if control is not None and not control.done():
                control.cancel()
            raise
        finally:
            job.stepped.set()
            job.averaged.set()

    def _optimizer_step(self, grad_scaler: Any) -> None:
        with self.get_tensors() if self.reuse_tensors else contextlib.nullcontext():
            if grad_scaler is None:
                self.optimizer.step()
                return
            grad_scaler.step(self.optimizer)

    @torch.no_grad()
    def _zero_grad(self, set_to_none: bool) -> None:
        if not self.offload_optimizer:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            return
        # the offloaded gradients stay allocated: they may be another averager's buffers
        for offloaded in self._optimizer_parameters():
            if offloaded.grad is not None:
                offloaded.grad.zero_()
        for main in self.main_parameters:
            if main.grad is not None:
                if set_to_none:
                    main.grad = None
                else:
                    main.grad.zero_()

    def _sync_epoch(self, result: StepResult) -> None:
        """Take the highest epoch the group gathered (values that are not epochs are ignored:
        they come from the network)."""
        epochs = [e for e in result.values() if type(e) is int and 0 <= e < 2**63]
        with self._epoch_lock:
            old = self.local_epoch
            self.local_epoch = max([old, *epochs])
            changed = self.local_epoch != old
        if changed:
            logger.log(self.status_loglevel, "a peer is at epoch %d: caught up", self.local_epoch)
            with self.lock_optimizer:
                self._update_scheduler()

    def _update_scheduler(self) -> None:
        """Step the scheduler until it counts :attr:`local_epoch` (so that during epoch ``e``
        the learning rate is ``lr(e)``). The caller holds ``lock_optimizer``."""
        scheduler = self.scheduler
        if scheduler is None:
            return
        if self.local_epoch - scheduler._step_count > _MAX_SCHEDULER_STEPS:
            # An epoch far ahead (a state downloaded from a peer says so): step by step would
            # take as long as the epoch is large. Jump instead, with torch's closed form (the
            # deprecated step(epoch)); exact for the closed-form schedulers (LambdaLR, StepLR,
            # ExponentialLR, CosineAnnealingLR, ...), an approximation for the others.
            logger.warning(
                "the learning-rate scheduler jumps from step %d to epoch %d",
                scheduler._step_count,
                self.local_epoch,
            )
            self.optimizer._opt_called = True  # type: ignore[attr-defined]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                scheduler.step(self.local_epoch)
            scheduler._step_count = self.local_epoch + 1
            return
        while scheduler._step_count <= self.local_epoch:
            if scheduler._step_count == 1:
                # torch warns when a scheduler steps before its optimizer did: ours follows
                # the epoch on purpose (and the optimizer need not have stepped yet)
                self.optimizer._opt_called = True  # type: ignore[attr-defined]
            scheduler.step()

    def _wait_for_pending(self, timeout: float | None) -> None:
        """Wait for the background jobs, ``timeout`` seconds for all of them together (two
        may be pending: a round queued behind another)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in list(self._pending):
            assert job.future is not None
            logger.log(self.status_loglevel, "waiting for a background step to finish")
            try:
                job.future.result(
                    None if deadline is None else max(0.0, deadline - time.monotonic())
                )
            except TimeoutError:
                logger.warning("a background step still runs after %s s", timeout)
            except Exception as exc:  # (reported by _forget_finished)
                logger.debug("a background step failed: %r", exc)

    def wait_for_delayed_optimizer_steps(self, timeout: float | None = None) -> None:
        """Wait until the optimizer steps of the background jobs are over (taken, or failed),
        not for their averaging rounds, and apply them. A round that still runs goes on (its
        result is applied by a later :meth:`step`).

        Used by :class:`swarmavg.Optimizer` with ``delay_optimizer_step`` before the next
        gradient round: that round writes into the gradients the step reads, while waiting
        for the step's state round too would tie this peer's next gradient round to its
        groupmates' previous ones (a cycle, when groups of two epochs mixed).

        :param timeout: seconds to wait for each step (``None``: as long as it takes); a step
            still running then is logged and left running.
        """
        for job in list(self._pending):
            if not job.updates_parameters:
                continue
            if not job.stepped.wait(timeout):
                logger.warning("a background optimizer step still runs after %s s", timeout)
        self._apply_finished()

    @property
    def averaging_pending(self) -> bool:
        """Whether a round was submitted and is not over yet (it may still wait for its
        trigger or the optimizer step before it; :attr:`averaging_in_progress` says only
        whether it averages now)."""
        return any(job.averaging_round and not job.averaged.is_set() for job in self._pending)

    def _forget_finished(self) -> None:
        """Report failed background jobs; drop those that are over and applied."""
        for job in list(self._pending):
            assert job.future is not None
            if not job.future.done():
                continue
            if not job.reported:
                job.reported = True
                if job.future.cancelled():
                    logger.log(self.status_loglevel, "a background step was cancelled")
                elif (exc := job.future.exception()) is not None:
                    logger.error("a background step failed", exc_info=exc)
            if job.applied:
                self._pending.remove(job)

    def _apply_round(self, job: _Job) -> bool:
        """Apply a finished round once; whether it changed the local tensors."""
        if job.average_applied:
            return False
        job.average_applied = True
        if job.result is None:
            return False
        if not self.reuse_tensors:
            self._apply_averaging_results(job)
        return True

    def _apply_finished(self) -> None:
        changed = False
        for job in list(self._pending):
            finished = job.averaging_round and job.averaged.is_set()
            if finished and not job.average_applied and self._apply_round(job):
                changed = True
                logger.log(self.status_loglevel, "applied a background averaging round")
            if job.updates_parameters and job.stepped.is_set() and not job.step_applied:
                job.step_applied = True
                changed = True
        if changed and self.offload_optimizer:
            self._copy_offloaded_to_main()
        self._forget_finished()

    @property
    def averaging_in_progress(self) -> bool:
        """Whether a round is averaging now (from the copy into the averaged tensors on)."""
        return self.lock_averaging.locked()

    # -- state sharing ---------------------------------------------------------------------------

    def get_current_state(self) -> tuple[Any, list[torch.Tensor], list[TensorInfo]]:  # type: ignore[override]
        """What this peer serves: metadata ``{"epoch", "group_bits", "optimizer_metadata"}``
        (msgpack) and copies of the optimizer's parameters, the extra tensors and the tensors of
        the optimizer's state dict, with their roles. Called in a worker thread.

        :raises TypeError: the optimizer's state dict holds a value that cannot be shared
            (not a tensor, number, string, bytes, None, list, tuple or dict).
        """
        optimizer_tensors: list[torch.Tensor] = []
        with self.lock_optimizer, self._averaged_if_reused(), torch.no_grad():
            params = [p.detach().to("cpu", copy=True) for p in self._optimizer_parameters()]
            extras = [t.detach().to("cpu", copy=True) for t in self.extra_tensors]
            optimizer_metadata = _encode_tree(self.optimizer.state_dict(), optimizer_tensors)
            epoch = self.local_epoch
        metadata = {
            "epoch": epoch,
            "group_bits": self.get_group_bits(),
            "optimizer_metadata": optimizer_metadata,
        }
        infos = [
            *(TensorInfo("parameter", t.numel()) for t in params),
            *(TensorInfo("unspecified", t.numel()) for t in extras),
            *(TensorInfo("optimizer", t.numel()) for t in optimizer_tensors),
        ]
        return metadata, [*params, *extras, *optimizer_tensors], infos

    def load_state_from_peers(  # type: ignore[override]  # (returns whether it loaded)
        self,
        wait: Literal[True] = True,
        timeout: float | None = None,
        *,
        max_epoch: int | None = None,
    ) -> bool:
        """Finish and apply the background steps, then download a peer's state and take it:
        parameters (also the offloaded ones and the model's), extra tensors, the optimizer's
        state, the epoch, and the scheduler follows.

        A state is refused (this peer unchanged, a warning says why) when its epoch is behind
        :attr:`local_epoch` or past ``max_epoch`` (what the run's progress records support: a
        donor's epoch is its own word), or when it does not fit this peer: other parameter
        shapes, another optimizer's state, non-finite values, malformed metadata.

        :param timeout: seconds for the download (``None``: each donor is bounded by its own
            timeouts).
        :param max_epoch: the highest epoch to take (``None``: any).
        :returns: whether a state was loaded (``False``: nobody shares one, or it was
            refused).
        :raises RuntimeError: the averager is not running.
        """
        if wait is not True:
            raise ValueError("wait must be True: the state is loaded once downloaded")
        if self._closing:
            raise RuntimeError("this TrainingStateAverager was shut down")
        self.step(wait_for_delayed_updates=True, apply_delayed_updates=True)
        loaded = super().load_state_from_peers(True, timeout)
        if loaded is None:
            logger.log(self.status_loglevel, "no peer served its state")
            return False
        metadata, tensors = loaded
        try:
            epoch, optimizer_state = self._check_state(metadata, tensors)
            if max_epoch is not None and epoch > max_epoch:
                raise _Refused(
                    f"its epoch {epoch} is past what the run's progress records support"
                    f" ({max_epoch})"
                )
            self._take_state(epoch, tensors, optimizer_state)
        except _Refused as exc:
            logger.warning("refusing the state downloaded from a peer: %s", exc)
            return False
        logger.log(self.status_loglevel, "loaded the state of a peer at epoch %d", epoch)
        return True

    def _check_state(
        self, metadata: Any, tensors: Sequence[torch.Tensor]
    ) -> tuple[int, dict[str, Any]]:
        """The epoch and the optimizer state dict of a downloaded state, checked against ours.

        :raises _Refused: it is older than ours or does not fit (the message says how).
        """
        if not isinstance(metadata, dict):
            raise _Refused(f"its metadata is a {type(metadata).__name__}, not a mapping")
        epoch = metadata.get("epoch")
        if type(epoch) is not int or epoch < 0:
            raise _Refused(f"its epoch is {epoch!r:.40}, not an int >= 0")
        if epoch < self.local_epoch:
            raise _Refused(f"its epoch {epoch} is behind ours ({self.local_epoch})")
        state = _check_training_state(
            metadata,
            tensors,
            self._optimizer_parameters(),
            self.extra_tensors,
            self.parameter_names,
            self.optimizer,
            self.average_opt_statistics,
        )
        return epoch, state

    @torch.no_grad()
    def _take_state(
        self, epoch: int, tensors: Sequence[torch.Tensor], state: dict[str, Any]
    ) -> None:
        params = self._optimizer_parameters()
        local = [*params, *self.extra_tensors]
        with self.lock_optimizer:
            with self.get_tensors() if self.reuse_tensors else contextlib.nullcontext():
                # the averaged statistics stay the same tensors (reuse_tensors averages them)
                kept = {
                    (index, name): self.optimizer.state[param][name]
                    for name in self.average_opt_statistics
                    for index, param in enumerate(params)
                }
                # The donor's param groups carry its learning rate, lr(its epoch); the scheduler
                # below steps ours from our epoch to that one, and schedulers that multiply the
                # current rate (ExponentialLR, StepLR, ...) would step the donor's rate again
                # (lr(2E - e) for good). So the rate stays ours, for our scheduler to move.
                rates = [group["lr"] for group in self.optimizer.param_groups]
                try:
                    self.optimizer.load_state_dict(state)
                except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as exc:
                    raise _Refused(f"the optimizer does not take its state: {exc!r:.200}") from None
                if self.scheduler is not None:
                    for group, rate in zip(self.optimizer.param_groups, rates, strict=True):
                        group["lr"] = rate
                for (index, name), tensor in kept.items():
                    tensor.copy_(self.optimizer.state[params[index]][name])
                    self.optimizer.state[params[index]][name] = tensor
                for mine, theirs in zip(local, tensors, strict=False):
                    mine.copy_(theirs)
                if self.offload_optimizer:
                    self._copy_offloaded_to_main(locked=True)
            if not self.reuse_tensors:
                with self.get_tensors() as averaged:
                    for target, source in zip(averaged, self._local_tensors(), strict=True):
                        target.copy_(source)
            with self._epoch_lock:
                self.local_epoch = epoch
            self._update_scheduler()

    # -- lifecycle -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop: cancel the rounds in progress and queued background steps, stop the averager
        and join the background threads. Idempotent."""
        if not self._closing:
            self._closing = True
            for job in list(self._pending):
                if job.control is not None and not job.control.done():
                    job.control.cancel()
            self.step_executor.shutdown(wait=False, cancel_futures=True)
        super().shutdown()
        self.step_executor.shutdown(wait=True)


# -- helpers -------------------------------------------------------------------------------------


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, not {value!r:.40}")


def _param_groups(params: object) -> list[dict[str, Any]]:
    """``params`` as a list of param groups (dicts with a list of tensors under ``"params"``).

    :raises TypeError: not tensors nor param groups.
    """
    if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
        raise TypeError("params must be an iterable of tensors or of param groups (dicts)")
    items = list(params)
    if all(isinstance(item, torch.Tensor) for item in items):
        items = [{"params": items}]
    groups = []
    for index, group in enumerate(items):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"param group {index} is not a dict with 'params'")
        tensors = group["params"]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            raise TypeError(f"param group {index} holds something other than tensors")
        groups.append(dict(group, params=tensors))
    if not any(group["params"] for group in groups):
        raise ValueError("params holds no parameters")
    return groups


def _parameter_names(names: Sequence[Any] | None, count: int) -> tuple[Any, ...]:
    if names is None:
        return tuple(range(count))
    if isinstance(names, str):
        raise TypeError("parameter_names must be a sequence of names, not a str")
    names = tuple(names)
    if len(names) != count:
        raise ValueError(f"parameter_names has {len(names)} names for {count} parameters")
    return names


def _offloaded_copy(param: torch.Tensor) -> torch.Tensor:
    """An fp32 CPU copy of ``param`` for the offloaded optimizer, with a zero gradient."""
    copy = param.detach().to(device="cpu", dtype=torch.float32, copy=True)
    copy.requires_grad_(param.requires_grad)
    copy.grad = torch.zeros_like(copy)
    return copy


def _flat_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 CPU copies of ``tensors``, views of one flat buffer (back to back, in order), so
    that the averager averages them in place."""
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float32)
    copies, offset = [], 0
    with torch.no_grad():
        for tensor in tensors:
            view = flat[offset : offset + tensor.numel()].view(tensor.shape)
            view.copy_(tensor.detach())
            copies.append(view)
            offset += tensor.numel()
    return copies


@torch.no_grad()
def _initialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (e.g. Adam's moments) without changing the parameters or
    any ``step`` counter: one step with zero gradients and no weight decay, after which the
    parameters are restored and the ``step`` counters set back to 0. (hivemind took that step
    for real: weight decay shrank the weights once and Adam's bias correction started at step
    1.) Statistics that start from zero stay zero; counters other than ``step`` may move (e.g.
    ASGD's ``eta``)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    values = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    decays = [group.get("weight_decay") for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            if isinstance(group.get("weight_decay"), int | float):
                group["weight_decay"] = 0.0
        for param in params:
            param.grad = torch.zeros_like(param)
        with torch.enable_grad():
            optimizer.step()
    finally:
        for group, decay in zip(optimizer.param_groups, decays, strict=True):
            if "weight_decay" in group:
                group["weight_decay"] = decay
        for param, value, grad in zip(params, values, grads, strict=True):
            param.copy_(value)
            param.grad = grad
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif isinstance(step, int | float) and not isinstance(step, bool):
            state["step"] = type(step)(0)


def _encode_tree(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """``tree`` (a state dict) as msgpack-serializable data: scalars as they are, containers as
    ``[tag, body]`` (``"L"`` list, ``"U"`` tuple, ``"D"`` dict with a flat key/value list), and
    each tensor as ``["T", index]``, the tensor (a CPU copy) appended to ``tensors``.

    :raises TypeError: a value that is none of these (named by its type).
    """
    if isinstance(tree, torch.Tensor):
        tensors.append(tree.detach().to("cpu", copy=True))
        return [_TENSOR, len(tensors) - 1]
    if tree is None or isinstance(tree, bool | str | bytes):
        return tree
    if isinstance(tree, int):
        return int(tree)
    if isinstance(tree, float):
        return float(tree)
    if isinstance(tree, list):
        return [_LIST, [_encode_tree(item, tensors) for item in tree]]
    if isinstance(tree, tuple):
        return [_TUPLE, [_encode_tree(item, tensors) for item in tree]]
    if isinstance(tree, dict):
        body: list[Any] = []
        for key, value in tree.items():
            if not isinstance(key, _SCALARS):
                raise TypeError(f"the optimizer's state dict has a {type(key).__name__} key")
            body += [_encode_tree(key, tensors), _encode_tree(value, tensors)]
        return [_DICT, body]
    raise TypeError(
        f"the optimizer's state dict holds a {type(tree).__name__}: only tensors, numbers, "
        "strings, bytes, None, lists, tuples and dicts can be shared"
    )


def _decode_tree(encoded: Any, tensors: list[torch.Tensor]) -> Any:
    """The tree :func:`_encode_tree` encoded, with its tensors. Every tensor must be used
    exactly once.

    :raises _Refused: malformed (a bad tag, a tensor index out of range or used twice, a tree
        deeper than 16, a key that is not a scalar, tensors left over).
    """
    used = [False] * len(tensors)

    def decode(node: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise _Refused("its optimizer metadata is nested too deep")
        if isinstance(node, _SCALARS):
            return node
        if not (isinstance(node, list) and len(node) == 2 and isinstance(node[0], str)):
            raise _Refused("its optimizer metadata is malformed")
        tag, body = node
        if tag == _TENSOR:
            if type(body) is not int or not 0 <= body < len(tensors) or used[body]:
                raise _Refused(f"its optimizer metadata names tensor {body!r:.20} wrongly")
            used[body] = True
            return tensors[body]
        if not isinstance(body, list):
            raise _Refused("its optimizer metadata is malformed")
        if tag == _LIST:
            return [decode(item, depth + 1) for item in body]
        if tag == _TUPLE:
            return tuple(decode(item, depth + 1) for item in body)
        if tag == _DICT and len(body) % 2 == 0:
            decoded = {}
            for at in range(0, len(body), 2):
                key = body[at]
                if not isinstance(key, _SCALARS):
                    raise _Refused("its optimizer metadata has a key that is not a scalar")
                decoded[key] = decode(body[at + 1], depth + 1)
            return decoded
        raise _Refused(f"its optimizer metadata has an unknown tag {tag!r:.20}")

    tree = decode(encoded, 0)
    if not all(used):
        raise _Refused(f"{used.count(False)} of its optimizer tensors are not in its metadata")
    return tree


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, list | tuple):
        return "sequence"
    return type(value).__name__


def _check_training_state(
    metadata: Mapping[str, Any],
    tensors: Sequence[torch.Tensor],
    parameters: Sequence[torch.Tensor],
    extra_tensors: Sequence[torch.Tensor],
    parameter_names: Sequence[str],
    optimizer: torch.optim.Optimizer,
    statistics: Sequence[str],
) -> dict[str, Any]:
    """The optimizer state dict of a downloaded training state (tensors: the parameters, the
    extra tensors, then the state dict's), after checking that every tensor fits ours and is
    finite and that the state dict fits ``optimizer`` (shared by the training averagers).

    :raises _Refused: it does not fit (the message says how).
    """
    local = [*parameters, *extra_tensors]
    if len(tensors) < len(local):
        raise _Refused(
            f"it holds {len(tensors)} tensors, fewer than our {len(local)} parameters and "
            "extra tensors"
        )
    for index, (mine, theirs) in enumerate(zip(local, tensors, strict=False)):
        what = (
            f"parameter {parameter_names[index]!r}"
            if index < len(parameters)
            else f"extra tensor {index - len(parameters)}"
        )
        if tuple(theirs.shape) != tuple(mine.shape):
            raise _Refused(f"its {what} has shape {tuple(theirs.shape)}, ours {tuple(mine.shape)}")
        _check_finite(what, theirs)
    state: dict[str, Any] = _decode_tree(
        metadata.get("optimizer_metadata"), list(tensors[len(local) :])
    )
    _check_optimizer_state(optimizer, state, statistics)
    return state


def _check_finite(what: str, tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise _Refused(f"its {what} holds NaN or an infinity")


def _check_optimizer_state(
    optimizer: torch.optim.Optimizer, state: Any, averaged: Sequence[str]
) -> None:
    """Check a downloaded optimizer state dict against ``optimizer`` (its groups, the kinds of
    values, the shapes of tensors where ours has them, finite values, the ``averaged``
    statistics of every parameter); fill hyperparameters it lacks from ours.

    :raises _Refused: it does not fit (the message says where).
    """
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict):
        raise _Refused("its optimizer state is not a state dict")
    groups, ours = state.get("param_groups"), optimizer.param_groups
    if not isinstance(groups, list) or len(groups) != len(ours):
        count = len(groups) if isinstance(groups, list) else groups
        raise _Refused(f"its optimizer has {count!r:.20} param groups, ours {len(ours)}")
    ids: list[int] = []
    for index, (group, mine) in enumerate(zip(groups, ours, strict=True)):
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise _Refused(f"its param group {index} is malformed")
        if len(group["params"]) != len(mine["params"]):
            raise _Refused(
                f"its param group {index} has {len(group['params'])} parameters, ours "
                f"{len(mine['params'])}"
            )
        if not all(type(i) is int for i in group["params"]):
            raise _Refused(f"its param group {index} names parameters by other than ints")
        ids += group["params"]
        for key, value in mine.items():
            if key == "params":
                continue
            if key not in group:
                group[key] = value
            elif group[key] is not None and value is not None and _kind(group[key]) != _kind(value):
                raise _Refused(
                    f"its param group {index} has a {_kind(group[key])} {key!r}, ours a "
                    f"{_kind(value)}"
                )
            numbers = group[key] if isinstance(group[key], list | tuple) else [group[key]]
            if not all(math.isfinite(x) for x in numbers if type(x) in (int, float)):
                # (a NaN or infinite lr, momentum or beta makes every step non-finite)
                raise _Refused(f"its param group {index} has a non-finite {key!r}")
    if len(set(ids)) != len(ids):
        raise _Refused("its param groups name a parameter twice")
    params = dict(zip(ids, (p for group in ours for p in group["params"]), strict=True))
    for pid, entry in state["state"].items():
        param = params.get(pid) if type(pid) is int else None
        if param is None or not isinstance(entry, dict):
            raise _Refused(f"its optimizer state has an entry for unknown parameter {pid!r:.20}")
        mine = optimizer.state.get(param, {})
        for key, value in entry.items():
            if not isinstance(key, str):
                raise _Refused("its optimizer state has a key that is not a str")
            if isinstance(value, torch.Tensor):
                _check_finite(f"optimizer state {key!r}", value)
            if key not in mine:
                continue
            if _kind(value) != _kind(mine[key]):
                raise _Refused(
                    f"its optimizer state {key!r} is a {_kind(value)}, ours a {_kind(mine[key])}"
                )
            if isinstance(value, torch.Tensor) and value.shape != mine[key].shape:
                raise _Refused(
                    f"its optimizer state {key!r} has shape {tuple(value.shape)}, ours "
                    f"{tuple(mine[key].shape)}"
                )
        missing = [key for key in mine if key not in entry]
        if missing:
            raise _Refused(f"its optimizer state lacks {missing} (another optimizer?)")
    for name in averaged:
        for pid, param in params.items():
            value = state["state"].get(pid, {}).get(name)
            if not isinstance(value, torch.Tensor) or value.shape != param.shape:
                raise _Refused(f"its optimizer state has no {name!r} of the parameter's shape")
