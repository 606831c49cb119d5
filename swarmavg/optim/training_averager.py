"""``swarmavg.TrainingAverager``: averages a torch optimizer's parameters, gradients, named
statistics and extra tensors with peers (hivemind's ``TrainingAverager``, the averager of the
decentralized optimizers).

Theory of operation
-------------------
The *local tensors* are, in this order: the optimizer's parameters (``average_parameters``),
their gradients (``average_gradients``; a zero tensor stands in for a missing ``.grad``, and
what the round computes for it is dropped), for each name of ``average_opt_statistics`` that
statistic of every parameter (``opt.state[p][name]``), then ``extra_tensors``. The *averaged
tensors* are fp32 CPU copies of them, views of one flat buffer, which the
:class:`swarmavg.DecentralizedAverager` underneath averages in place.

One :meth:`TrainingAverager.step` (one at a time, under :attr:`lock_averager_step`):

1. clears :attr:`pending_updates_done`; under ``data_lock`` (if given), :attr:`lock_optimizer`
   and the averaged tensors' lock, copies the local tensors into the averaged ones; sets it;
2. averages them with a group (weight 1 per peer unless ``weight=``);
3. on success clears :attr:`pending_updates_done` and, under the same locks, writes the result
   back: with a ``data_lock`` by the *delta rule* ``local += averaged - local_before`` (steps
   taken during the round are kept, hivemind PR #218), else ``local = averaged``; sets it;
4. ``local_step += 1``; returns the round's result, or ``None`` when it failed (counted in
   :attr:`rounds_failed`, one WARNING line, :attr:`last_round` says why).

A round whose results arrive after :meth:`load_state_from_peers` replaced the state is dropped
(its delta belongs to the state before).

Locks, always taken in this order: ``data_lock``, :attr:`lock_optimizer`, the averaged tensors'
lock. :attr:`lock_optimizer` is held while this averager reads or writes the optimizer's tensors
(results applied, state served to peers, state loaded): hold it around your own
``opt.step()`` if peers may download the state meanwhile.

The state served to peers (:meth:`get_current_state`) is msgpack metadata ``{"step",
"group_bits", "optimizer_metadata"}`` (plus ``"epoch"`` when :attr:`state_epoch` is set) and
tensors: parameters, extra tensors, then the tensors of ``opt.state_dict()`` (a tagged tree,
see :func:`swarmavg.optim.state_averager._encode_tree`). No pickle; a receiver checks it all
against its own optimizer before it changes anything.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from swarmavg.averager import DecentralizedAverager, StepHandle
from swarmavg.compression import TensorInfo
from swarmavg.optim.state_averager import (
    _check_training_state,
    _encode_tree,
    _flat_copies,
    _initialize_optimizer_state,
    _parameter_names,
    _Refused,
)

if TYPE_CHECKING:
    from swarmavg._step import StepResult
    from swarmavg.dht import DHT

__all__ = ["RoundOutcome", "TrainingAverager", "TrainingStepHandle"]

logger = logging.getLogger(__name__)

#: How often a round waiting for a lock checks whether the averager was shut down (seconds).
_LOCK_POLL = 0.1


class _Closed(Exception):
    """The averager was shut down while a round waited for a lock."""


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    """What one averaging round did.

    :ivar succeeded: the group averaged and the result was written into the local tensors.
    :ivar group_size: the members of the group (0 when none formed).
    :ivar seconds: from the copy into the averaged tensors to the end of the round.
    :ivar error: why it failed (``None`` when it succeeded).
    :ivar incomplete: some parts were averaged over fewer members (see
        :attr:`swarmavg.StepResult.incomplete`).
    """

    succeeded: bool
    group_size: int
    seconds: float
    error: str | None = None
    incomplete: bool = False


class TrainingStepHandle:
    """A :meth:`TrainingAverager.step` running in the background (``wait=False``)."""

    def __init__(self) -> None:
        self._future: concurrent.futures.Future[StepResult | None] | None = None
        self._cancelled = threading.Event()
        self._control: StepHandle | None = None

    def result(self, timeout: float | None = None) -> StepResult | None:
        """The round's result (``None``: it failed).

        :raises TimeoutError: not done within ``timeout`` seconds.
        :raises concurrent.futures.CancelledError: it was cancelled before it began.
        """
        assert self._future is not None
        return self._future.result(timeout)

    def done(self) -> bool:
        assert self._future is not None
        return self._future.done()

    def cancel(self) -> bool:
        """Cancel the step: before it began, it never runs; while it averages, its round is
        cancelled (the step then returns ``None``). Whether it was not over yet."""
        assert self._future is not None
        if self._future.cancel():
            return True
        if self._future.done():
            return False
        self._cancelled.set()
        control = self._control
        if control is not None:
            control.cancel()
        return True


class TrainingAverager(DecentralizedAverager):
    """Averages an optimizer's parameters, gradients, statistics and extra tensors with peers
    (hivemind's ``TrainingAverager``).

    :param opt: the ``torch.optim.Optimizer`` whose tensors are averaged.
    :param average_parameters: average the parameters.
    :param average_gradients: average the gradients (a missing ``.grad`` counts as zeros and
        stays missing).
    :param average_opt_statistics: names of optimizer statistics to average, e.g.
        ``("exp_avg_sq",)``.
    :param extra_tensors: more tensors to average and share (e.g. BatchNorm statistics).
    :param parameter_names: one name per parameter, for messages (default ``0 .. n-1``).
    :param initialize_optimizer: create the optimizer's state now if it has none. Unlike
        hivemind (one real ``opt.step()``: weight decay moved the parameters once and Adam's
        step counter started at 1), this changes neither the parameters, nor the gradients, nor
        any ``step`` counter: one step with zero gradients and no weight decay, undone.
        An optimizer that already has state is left alone.
    :param dht: a running :class:`swarmavg.DHT`.
    :param kwargs: for :class:`swarmavg.DecentralizedAverager` (``prefix``,
        ``target_group_size``, ``compression``, ``start``, timeouts...); ``tensor_infos`` is set
        here (roles ``parameter``, ``gradient``, ``optimizer``, ``unspecified``).
    :raises TypeError: an argument has the wrong type (the message names it).
    :raises ValueError: an argument is out of range, or a statistic is missing from the
        optimizer's state (named).
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        *,
        average_parameters: bool,
        average_gradients: bool,
        average_opt_statistics: Sequence[str] = (),
        extra_tensors: Sequence[torch.Tensor] = (),
        parameter_names: Sequence[Any] | None = None,
        initialize_optimizer: bool = True,
        dht: DHT,
        **kwargs: Any,
    ) -> None:
        given: object = opt
        if not isinstance(given, torch.optim.Optimizer):
            raise TypeError(f"opt must be a torch.optim.Optimizer, not {type(given).__name__}")
        for name, flag in (
            ("average_parameters", average_parameters),
            ("average_gradients", average_gradients),
            ("initialize_optimizer", initialize_optimizer),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, not {flag!r:.40}")
        if isinstance(average_opt_statistics, str) or not all(
            isinstance(key, str) for key in average_opt_statistics
        ):
            raise TypeError("average_opt_statistics must be a sequence of names (str)")
        extras: object = extra_tensors
        if isinstance(extras, torch.Tensor) or not all(
            isinstance(t, torch.Tensor) and t.is_floating_point() for t in extra_tensors
        ):
            raise TypeError("extra_tensors must be a sequence of floating-point tensors")
        if "tensor_infos" in kwargs:
            raise TypeError(
                "tensor_infos is set by TrainingAverager (roles parameter, gradient, optimizer, "
                "unspecified): choose codecs with a RoleAdaptiveCompression instead"
            )
        self.opt = opt
        self.average_parameters = average_parameters
        self.average_gradients = average_gradients
        self.average_opt_statistics = tuple(average_opt_statistics)
        self.opt_statistics = self.average_opt_statistics  # (hivemind's name)
        self.extra_tensors = tuple(extra_tensors)
        params = self._parameters()
        if not params:
            raise ValueError("opt has no parameters")
        self.parameter_names = _parameter_names(parameter_names, len(params))
        if initialize_optimizer and not any(
            isinstance(value, torch.Tensor)
            for state in opt.state.values()
            for value in state.values()
        ):
            _initialize_optimizer_state(opt)

        local = self.local_tensors()  # (raises if a statistic is missing)
        if not local:
            raise ValueError(
                "nothing to average: set average_parameters, average_gradients, "
                "average_opt_statistics or extra_tensors"
            )
        infos = self.tensor_infos()

        self.local_step = 0
        #: what the state served to peers says of the epoch (set by DecentralizedOptimizer)
        self.state_epoch: int | None = None
        self.pending_updates_done = threading.Event()
        self.pending_updates_done.set()
        self.lock_averager_step = threading.Lock()
        self.lock_optimizer = threading.Lock()
        #: what the last round did (``None``: no round yet)
        self.last_round: RoundOutcome | None = None
        self.rounds_succeeded = 0
        self.rounds_failed = 0
        self._generation = 0
        self._closing = False
        self._control: StepHandle | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        super().__init__(_flat_copies(local), dht, tensor_infos=infos, **kwargs)

    # -- the tensors -----------------------------------------------------------------------------

    def _parameters(self) -> list[torch.Tensor]:
        return [p for group in self.opt.param_groups for p in group["params"]]

    def _statistics(self) -> list[torch.Tensor]:
        params, found = self._parameters(), []
        for name in self.average_opt_statistics:
            for index, param in enumerate(params):
                value = self.opt.state.get(param, {}).get(name)
                if not isinstance(value, torch.Tensor):
                    raise ValueError(
                        f"average_opt_statistics names {name!r}, but the optimizer's state of "
                        f"parameter {self.parameter_names[index]!r} has no such tensor"
                    )
                found.append(value)
        return found

    @torch.no_grad()
    def local_tensors(self, replace_none: bool = True) -> list[torch.Tensor]:
        """The tensors averaged with peers, in order: parameters, gradients (a new zero tensor
        for a missing one if ``replace_none``, else it is skipped), statistics (per name, per
        parameter), extra tensors.

        :raises ValueError: the optimizer's state lacks a statistic of
            ``average_opt_statistics``.
        """
        params = self._parameters()
        tensors: list[torch.Tensor] = []
        if self.average_parameters:
            tensors += params
        if self.average_gradients:
            for param in params:
                if param.grad is not None:
                    tensors.append(param.grad)
                elif replace_none:
                    tensors.append(torch.zeros_like(param))
        return [*tensors, *self._statistics(), *self.extra_tensors]

    def tensor_infos(self) -> list[TensorInfo]:
        """The role and size of each averaged tensor (for adaptive compression)."""
        params = self._parameters()
        infos: list[TensorInfo] = []
        if self.average_parameters:
            infos += [TensorInfo("parameter", p.numel()) for p in params]
        if self.average_gradients:
            infos += [TensorInfo("gradient", p.numel()) for p in params]
        infos += [
            TensorInfo("optimizer", p.numel()) for _ in self.average_opt_statistics for p in params
        ]
        infos += [TensorInfo("unspecified", t.numel()) for t in self.extra_tensors]
        return infos

    # -- stepping --------------------------------------------------------------------------------

    def step(  # type: ignore[override]  # (hivemind's TrainingAverager.step)
        self,
        data_lock: Any = None,
        wait: bool = True,
        weight: float | None = None,
        timeout: float | None = None,
        gather: Any = None,
        allow_retries: bool = True,
    ) -> StepResult | TrainingStepHandle | None:
        """Average the local tensors with a group and write the result back (see the module's
        docstring).

        :param data_lock: a lock (anything with ``acquire``/``release``) guarding the local
            tensors; with one, the result is applied by the delta rule.
        :param wait: ``False``: run in a background thread and return a
            :class:`TrainingStepHandle` at once.
        :param weight: this peer's weight in the mean (default 1: equal weights, as hivemind).
        :param timeout: seconds for the round (matchmaking and all-reduce).
        :param gather: metadata for the groupmates (default: :attr:`local_step`).
        :returns: the round's result, ``None`` if it failed, or the handle.
        :raises RuntimeError: the averager was shut down.
        :raises TypeError: ``data_lock`` is not a lock.
        """
        if self._closing:
            raise RuntimeError("this TrainingAverager was shut down")
        if data_lock is not None and not (
            callable(getattr(data_lock, "acquire", None))
            and callable(getattr(data_lock, "release", None))
        ):
            raise TypeError(f"data_lock must be a lock or None, not {type(data_lock).__name__}")
        if not isinstance(wait, bool):
            raise TypeError(f"wait must be a bool, not {wait!r:.40}")
        if weight is not None and (
            isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0
        ):
            raise ValueError(f"weight must be a number >= 0 or None, not {weight!r:.40}")
        args = (data_lock, weight, timeout, gather, allow_retries)
        if wait:
            return self._step(*args, None)[0]
        handle = TrainingStepHandle()
        with self._executor_lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="swarmavg-training-averager"
                )
            handle._future = self._executor.submit(lambda: self._step(*args, handle)[0])
        return handle

    @contextlib.contextmanager
    def _holding(self, lock: Any) -> Iterator[None]:
        """Hold ``lock`` (if any), giving up when the averager is shut down meanwhile."""
        if lock is None:
            yield
            return
        while not lock.acquire(timeout=_LOCK_POLL):
            if self._closing:
                raise _Closed
        try:
            yield
        finally:
            lock.release()

    def _fail(self, error: str, seconds: float, group_size: int = 0) -> None:
        self.rounds_failed += 1
        self.last_round = RoundOutcome(False, group_size, seconds, error)
        if self._closing:
            logger.debug("averaging round ended by shutdown: %s", error)
        else:
            logger.warning(
                "averaging round failed after %.2f s (%d failed so far; nothing changed): %s",
                seconds,
                self.rounds_failed,
                error,
            )

    @torch.no_grad()
    def _step(
        self,
        data_lock: Any,
        weight: float | None,
        timeout: float | None,
        gather: Any,
        allow_retries: bool,
        handle: TrainingStepHandle | None,
    ) -> tuple[StepResult | None, RoundOutcome]:
        """One round under :attr:`lock_averager_step`: its result and what it did (read under
        the lock, so it is this round's even when other threads step too)."""
        with self.lock_averager_step:
            try:
                result = self._round(data_lock, weight, timeout, gather, allow_retries, handle)
            finally:
                self.local_step += 1
            outcome = self.last_round
            assert outcome is not None  # (every path of _round sets it)
            return result, outcome

    def _round(
        self,
        data_lock: Any,
        weight: float | None,
        timeout: float | None,
        gather: Any,
        allow_retries: bool,
        handle: TrainingStepHandle | None,
    ) -> StepResult | None:
        generation = self._generation
        started = time.perf_counter()
        self.pending_updates_done.clear()
        old: list[torch.Tensor] | None = None
        try:
            with (
                self._holding(data_lock),
                self._holding(self.lock_optimizer),
                self.get_tensors() as averaged,
            ):
                for target, source in zip(averaged, self.local_tensors(), strict=True):
                    target.copy_(source)
                if data_lock is not None:
                    old = [t.clone() for t in averaged]
        except _Closed:
            self._fail("shut down", time.perf_counter() - started)
            return None
        finally:
            self.pending_updates_done.set()

        try:
            control = DecentralizedAverager.step(
                self,
                gather=self.local_step if gather is None else gather,
                weight=weight,
                timeout=timeout,
                allow_retries=allow_retries,
                wait=False,
            )
            self._control = control
            if handle is not None:
                handle._control = control
                if handle._cancelled.is_set():
                    control.cancel()
            result = control.result()
        except Exception as exc:
            self._fail(repr(exc), time.perf_counter() - started)
            return None
        finally:
            self._control = None

        self.pending_updates_done.clear()
        try:
            with (
                self._holding(data_lock),
                self._holding(self.lock_optimizer),
                self.get_tensors() as averaged,
            ):
                if generation != self._generation:
                    self._fail(
                        "the state was loaded from a peer during the round: result dropped",
                        time.perf_counter() - started,
                        len(result),
                    )
                    return None
                local = self.local_tensors()
                if old is not None:
                    for target, new, before in zip(local, averaged, old, strict=True):
                        delta = torch.sub(new, before, out=before)
                        target.add_(delta.to(device=target.device, dtype=target.dtype))
                else:
                    for target, new in zip(local, averaged, strict=True):
                        target.copy_(new)
        except _Closed:
            self._fail("shut down", time.perf_counter() - started, len(result))
            return None
        finally:
            self.pending_updates_done.set()
        self.rounds_succeeded += 1
        self.last_round = RoundOutcome(
            True, len(result), time.perf_counter() - started, None, result.incomplete
        )
        return result

    # -- state sharing ---------------------------------------------------------------------------

    def get_current_state(self) -> tuple[Any, list[torch.Tensor], list[TensorInfo]]:  # type: ignore[override]
        """What this peer serves: metadata ``{"step", "group_bits", "optimizer_metadata"}``
        (and ``"epoch"`` if :attr:`state_epoch` is set) and copies of the parameters, the extra
        tensors and the tensors of the optimizer's state dict, with their roles. Taken under
        :attr:`lock_optimizer`, in a worker thread.

        :raises TypeError: the optimizer's state dict holds a value that cannot be shared.
        """
        optimizer_tensors: list[torch.Tensor] = []
        with self.lock_optimizer, torch.no_grad():
            params = [p.detach().to("cpu", copy=True) for p in self._parameters()]
            extras = [t.detach().to("cpu", copy=True) for t in self.extra_tensors]
            optimizer_metadata = _encode_tree(self.opt.state_dict(), optimizer_tensors)
            metadata: dict[str, Any] = {
                "step": self.local_step,
                "group_bits": self.get_group_bits(),
                "optimizer_metadata": optimizer_metadata,
            }
            if self.state_epoch is not None:
                metadata["epoch"] = self.state_epoch
        infos = [
            *(TensorInfo("parameter", t.numel()) for t in params),
            *(TensorInfo("unspecified", t.numel()) for t in extras),
            *(TensorInfo("optimizer", t.numel()) for t in optimizer_tensors),
        ]
        return metadata, [*params, *extras, *optimizer_tensors], infos

    def load_state_from_peers(  # type: ignore[override]  # (returns whether it loaded)
        self, wait: Literal[True] = True, timeout: float | None = None
    ) -> bool:
        """Download a peer's state and take it: parameters, extra tensors, the optimizer's
        state; ``local_step = max(ours, the peer's)``. A round in progress is dropped when it
        ends. As hivemind, a state is not refused for being older than ours; it is refused
        (nothing changes, a WARNING says why) when it does not fit: other shapes, another
        optimizer's state, non-finite values, malformed metadata. Hold your ``data_lock`` while
        this runs, if you step with one.

        :param timeout: seconds for the download.
        :returns: whether a state was loaded.
        :raises RuntimeError: the averager is not running.
        """
        if wait is not True:
            raise ValueError("wait must be True: the state is loaded once downloaded")
        return self._load_state(timeout) is not None

    def _load_state(self, timeout: float | None) -> dict[str, Any] | None:
        """:meth:`load_state_from_peers`, returning the loaded state's metadata."""
        if self._closing:
            raise RuntimeError("this TrainingAverager was shut down")
        loaded = DecentralizedAverager.load_state_from_peers(self, True, timeout)
        if loaded is None:
            logger.info("no peer served its state")
            return None
        metadata, tensors = loaded
        try:
            step, state = self._check_state(metadata, tensors)
        except _Refused as exc:
            logger.warning("refusing the state downloaded from a peer: %s", exc)
            return None
        params = self._parameters()
        local = [*params, *self.extra_tensors]
        with self.lock_optimizer, torch.no_grad():
            try:
                self.opt.load_state_dict(state)
            except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as exc:
                logger.warning("refusing the state downloaded from a peer: %r", exc)
                return None
            for mine, theirs in zip(local, tensors, strict=False):
                mine.copy_(theirs)
            self.local_step = max(self.local_step, step)
            self._generation += 1
        logger.info("loaded the state of a peer at step %d", step)
        assert isinstance(metadata, dict)
        return metadata

    def _check_state(
        self, metadata: Any, tensors: Sequence[torch.Tensor]
    ) -> tuple[int, dict[str, Any]]:
        if not isinstance(metadata, dict):
            raise _Refused(f"its metadata is a {type(metadata).__name__}, not a mapping")
        step = metadata.get("step")
        if type(step) is not int or not 0 <= step < 2**62:
            raise _Refused(f"its step is {step!r:.40}, not an int >= 0")
        epoch = metadata.get("epoch")
        if epoch is not None and (type(epoch) is not int or not 0 <= epoch < 2**62):
            raise _Refused(f"its epoch is {epoch!r:.40}, not an int >= 0")
        state = _check_training_state(
            metadata,
            tensors,
            self._parameters(),
            self.extra_tensors,
            self.parameter_names,
            self.opt,
            self.average_opt_statistics,
        )
        return step, state

    # -- lifecycle -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop: cancel the round in progress (its step returns ``None``), queued steps and the
        averager; join the background thread. Idempotent."""
        if not self._closing:
            self._closing = True
            control = self._control
            if control is not None:
                control.cancel()
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
        super().shutdown()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
