"""``GradientAverager``: accumulate gradients locally, then average them with peers, weighted by
samples (hivemind's ``hivemind.optim.GradientAverager``).

Theory of operation. Three sets of tensors are involved:

1. the parameters' ``.grad``, written by autograd (read fresh at every call: a ``.grad`` that
   ``zero_grad(set_to_none=True)`` dropped, or that a parameter never received, counts as zero,
   never as a tensor held from before);
2. the accumulators: this averager's own buffers (on the parameters' device, or
   ``accumulate_grads_on``), or with ``reuse_grad_buffers=True`` the ``.grad`` tensors
   themselves (autograd's running sum);
3. the averaged buffers: CPU tensors that the averaging round averages with the group. Made
   here, they are views of one flat contiguous tensor per dtype, so that a round averages
   them in place without a copy (see :mod:`swarmavg.aio.averager`); the Optimizer passes its
   own (the offloaded optimizer's ``.grad``) as ``averaged_grads``.

Micro-batch ``i`` (``b_i`` samples, gradient ``g_i`` = the mean over its samples) reaches the
accumulators with a weight ``w_i``. The accumulators hold ``sum_i w_i g_i / s`` (``s``, a scale
that keeps their magnitude near one gradient's) and
:meth:`~GradientAverager.load_accumulators_into_averager_` writes ``sum_i w_i g_i / sum_i w_i``
into the averaged buffers: a weighted mean of the micro-batches' gradients. The group then
averages these means weighted by each peer's sample count, ``sum_i b_i``, so the result is
every sample's gradient weighted equally wherever ``w_i = b_i``:

* own accumulators: ``w_i = b_i``, always (exact for any batch sizes; hivemind divided by the
  number of micro-batches instead, exact only when their mean size was the first one's);
* ``reuse_grad_buffers``: autograd adds ``g_i`` to ``.grad`` with weight 1, relative to what is
  there, before this averager learns ``b_i``. After each micro-batch the averager rescales
  ``.grad`` so that the next one's weight is the size it expects (``next_batch_size`` if given,
  else the last size): ``w_1 = b_1``, and ``w_i`` = the size expected for micro-batch ``i``,
  which is ``b_i`` whenever the sizes are equal or announced. A micro-batch of another size than
  expected is weighted with the expected size (logged once); its samples still count in full
  in the peer's weight.

PowerSGD (hivemind's ``PowerSGDGradientAverager``) is not provided.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, SupportsIndex, cast, overload

import torch

from swarmavg._step import AveragingStage, StepResult, _check_weight
from swarmavg.averager import DecentralizedAverager, StepHandle

if TYPE_CHECKING:
    from swarmavg.dht import DHT

__all__ = ["GradientAverager"]

logger = logging.getLogger(__name__)

#: ``target_group_size=None`` ("everyone who shows up", as hivemind): the bound used instead. A
#: group begins at its scheduled time, or earlier once every peer looking under the key joined.
EVERYONE = 256

_STEP_OPTIONS = ("gather", "allow_retries", "scheduled_time")


def _parameter_list(parameters: object) -> tuple[torch.Tensor, ...]:
    """``parameters`` as a tuple of distinct floating-point tensors.

    :raises TypeError: not an iterable of tensors (a single tensor, a mapping, an item that is
        not a floating-point tensor: the message names its index).
    :raises ValueError: no parameters, or one given twice.
    """
    if isinstance(parameters, torch.Tensor):
        raise TypeError("parameters must be an iterable of tensors, not a single tensor")
    if isinstance(parameters, dict):
        raise TypeError("parameters must be an iterable of tensors, not a mapping: pass .values()")
    if isinstance(parameters, str | bytes) or not isinstance(parameters, Iterable):
        raise TypeError(
            f"parameters must be an iterable of tensors, not {type(parameters).__name__}"
        )
    listed = tuple(parameters)
    seen: dict[int, int] = {}
    for index, param in enumerate(listed):
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"parameters[{index}] is a {type(param).__name__}, not a torch.Tensor")
        if not param.dtype.is_floating_point:
            raise TypeError(f"parameters[{index}] is {param.dtype}: gradients are floating point")
        first = seen.setdefault(id(param), index)
        if first != index:
            raise ValueError(f"parameters[{index}] is the same tensor as parameters[{first}]")
    if not listed:
        raise ValueError("parameters is empty: there are no gradients to average")
    return listed


def _averaged_buffers(parameters: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Zeroed CPU buffers shaped like ``parameters``: views of one flat tensor per dtype, in
    the parameters' order (so that a round averages them in place)."""
    sizes: dict[torch.dtype, int] = {}
    for param in parameters:
        sizes[param.dtype] = sizes.get(param.dtype, 0) + param.numel()
    flats = {dtype: torch.zeros(size, dtype=dtype) for dtype, size in sizes.items()}
    offsets = dict.fromkeys(sizes, 0)
    views = []
    for param in parameters:
        start = offsets[param.dtype]
        offsets[param.dtype] = start + param.numel()
        views.append(flats[param.dtype][start : start + param.numel()].view(param.shape))
    return views


def _given_buffers(
    averaged_grads: object, parameters: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """The caller's ``averaged_grads``, checked against the parameters.

    :raises TypeError: not a sequence of tensors (the message names the item).
    :raises ValueError: not one per parameter, or one of another shape than its parameter.
    """
    if isinstance(averaged_grads, torch.Tensor) or not isinstance(averaged_grads, Iterable):
        raise TypeError(
            f"averaged_grads must be a sequence of tensors, not {type(averaged_grads).__name__}"
        )
    listed = list(averaged_grads)
    for index, tensor in enumerate(listed):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"averaged_grads[{index}] is a {type(tensor).__name__}, not a torch.Tensor"
            )
    if len(listed) != len(parameters):
        raise ValueError(
            f"averaged_grads holds {len(listed)} tensors for {len(parameters)} parameters"
        )
    for index, (tensor, param) in enumerate(zip(listed, parameters, strict=True)):
        if tensor.shape != param.shape:
            raise ValueError(
                f"averaged_grads[{index}] has shape {tuple(tensor.shape)}, but parameters[{index}]"
                f" has shape {tuple(param.shape)}"
            )
    return listed


def _batch_size(name: str, value: object) -> int:
    """:raises TypeError: not an integer. :raises ValueError: not positive."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not {value!r}")
    try:
        size = operator.index(cast("SupportsIndex", value))  # (numpy and torch integers too)
    except TypeError:
        raise TypeError(f"{name} must be an int, not {value!r:.64}") from None
    if size <= 0:
        raise ValueError(f"{name} must be a positive number of samples, not {size}")
    return size


class GradientAverager(DecentralizedAverager):
    """Accumulates the parameters' gradients over micro-batches and averages them with peers,
    weighted by samples (hivemind's ``GradientAverager``; see the module docstring for what is
    sent).

    Usage, as in hivemind::

        averager = GradientAverager(model.parameters(), dht=dht, prefix="run_grad_averager")
        for batch in batches:
            loss(model, batch).backward()
            averager.accumulate_grads_(batch_size=len(batch))
            model.zero_grad()                   # (not with reuse_grad_buffers=True)
            if time_to_look_for_a_group:
                control = averager.schedule_step(scheduled_time=when)
            if time_to_step:
                averager.step(control=control)  # weight: the samples accumulated
                with averager.use_averaged_gradients():
                    opt.step()

    :param parameters: the parameters whose gradients are averaged (``model.parameters()``);
        floating point, each once.
    :param dht: a running :class:`swarmavg.DHT`.
    :param prefix: the key under which peers find each other (hivemind's Optimizer uses
        ``f"{run_id}_grad_averager"``).
    :param reuse_grad_buffers: accumulate in the parameters' ``.grad`` (autograd sums
        micro-batches there) instead of buffers of this averager: no extra memory, but the
        caller must not zero, clip or unscale ``.grad`` between micro-batches, and uneven
        micro-batches are weighted exactly only when announced (``next_batch_size``).
    :param accumulate_grads_on: the device of the accumulators (default: each parameter's);
        ignored, with a warning, with ``reuse_grad_buffers``.
    :param client_mode: see :class:`swarmavg.DecentralizedAverager` (default: the DHT's).
    :param warn: log a WARNING (once per kind, DEBUG after) when averaged gradients were not
        used before the next step, accumulators were not reset after one, or (with
        ``reuse_grad_buffers``) a micro-batch was weighted with another size than its own or a
        ``.grad`` was dropped; ``False``: all at DEBUG.
    :param averaged_grads: the CPU buffers to average in, one per parameter with its shape,
        used as they are (the Optimizer passes the offloaded optimizer's ``.grad``); default:
        views of one flat CPU tensor per dtype, made here.
    :param averager_kwargs: options of :class:`swarmavg.DecentralizedAverager` (``start``,
        ``min_group_size``, ``compression``, ``allreduce_timeout``, ...).
        ``target_group_size=None`` (the default) means everyone who shows up (at most
        :data:`EVERYONE`, ``min_group_size`` 2 unless given); ``allow_state_sharing`` defaults
        to ``False`` (nobody downloads gradients as state).
    :raises TypeError: an argument has the wrong type (the message names it).
    :raises ValueError: an argument is out of range (the message names it), such as
        ``averaged_grads`` of another shape than the parameters.
    """

    def __init__(
        self,
        parameters: Iterable[torch.Tensor],
        *,
        dht: DHT,
        prefix: str,
        reuse_grad_buffers: bool = False,
        accumulate_grads_on: torch.device | str | None = None,
        client_mode: bool | None = None,
        warn: bool = True,
        averaged_grads: Sequence[torch.Tensor] | None = (),
        **averager_kwargs: Any,
    ) -> None:
        self.parameters = _parameter_list(parameters)
        if not isinstance(reuse_grad_buffers, bool):
            raise TypeError(f"reuse_grad_buffers must be a bool, not {reuse_grad_buffers!r:.64}")
        if not isinstance(warn, bool):
            raise TypeError(f"warn must be a bool, not {warn!r:.64}")
        if accumulate_grads_on is not None:
            if not isinstance(accumulate_grads_on, torch.device | str):
                raise TypeError(
                    "accumulate_grads_on must be a torch.device, a str or None, not "
                    f"{accumulate_grads_on!r:.64}"
                )
            try:
                accumulate_grads_on = torch.device(accumulate_grads_on)
            except RuntimeError as exc:
                raise ValueError(f"accumulate_grads_on is not a device: {exc}") from None
            if reuse_grad_buffers:
                logger.warning("accumulate_grads_on has no effect with reuse_grad_buffers=True")
        if averaged_grads is None:  # (hivemind's PowerSGD averager's default)
            averaged_grads = ()
        if isinstance(averaged_grads, Sequence) and len(averaged_grads) == 0:
            buffers = _averaged_buffers(self.parameters)
        else:
            buffers = _given_buffers(averaged_grads, self.parameters)
        if averager_kwargs.get("target_group_size") is None:
            averager_kwargs["target_group_size"] = EVERYONE
            averager_kwargs.setdefault("min_group_size", 2)
        averager_kwargs.setdefault("allow_state_sharing", False)

        self.reuse_grad_buffers = reuse_grad_buffers
        self.accumulate_grads_on = None if reuse_grad_buffers else accumulate_grads_on
        self.warn = warn
        #: samples accumulated since the last reset (the weight of the next step)
        self.local_samples_accumulated = 0
        #: micro-batches accumulated since the last reset
        self.local_times_accumulated = 0
        #: ``s``: the accumulators hold ``sum_i w_i g_i / s`` (None: nothing accumulated yet)
        self._scale: float | None = None
        #: ``sum_i w_i``: the accumulated micro-batches' weights
        self._weight_total = 0.0
        #: with reuse_grad_buffers: each parameter's ``.grad`` after the last micro-batch (a
        #: different one now means the caller dropped or replaced the accumulated sum)
        self._grad_seen: list[weakref.ref[torch.Tensor] | None] = [None] * len(self.parameters)
        self._accumulators: tuple[torch.Tensor, ...] | None = None
        if not reuse_grad_buffers:
            self._accumulators = tuple(
                torch.zeros(p.shape, dtype=p.dtype, device=accumulate_grads_on or p.device)
                for p in self.parameters
            )
        self._accumulators_used_in_step = False
        self._new_averaged_grads = False
        self._warned: set[str] = set()
        super().__init__(buffers, dht, prefix=prefix, client_mode=client_mode, **averager_kwargs)

    # -- accumulating ----------------------------------------------------------------------------

    def _warn_once(self, kind: str, message: str, *args: object) -> None:
        """A WARNING the first time (with ``warn``), DEBUG after."""
        level = logging.DEBUG
        if self.warn and kind not in self._warned:
            self._warned.add(kind)
            level = logging.WARNING
        logger.log(level, message, *args)

    def _grad_accumulators(self) -> list[torch.Tensor | None]:
        """The accumulators: this averager's buffers, or with ``reuse_grad_buffers`` the
        parameters' current ``.grad`` (``None`` where a parameter has none: zero)."""
        if self._accumulators is not None:
            return list(self._accumulators)
        return [param.grad for param in self.parameters]

    @torch.no_grad()
    def accumulate_grads_(self, batch_size: int, *, next_batch_size: int | None = None) -> None:
        """Add the gradients of a micro-batch of ``batch_size`` samples (the parameters'
        ``.grad`` now) to the accumulators. A parameter without ``.grad`` adds zero.

        :param next_batch_size: with ``reuse_grad_buffers``, the size of the next micro-batch
            if it will differ from this one (its gradient is then weighted exactly); ignored
            otherwise (own accumulators weight every micro-batch exactly).
        :raises TypeError: a size is not an int.
        :raises ValueError: a size is not positive.
        """
        batch_size = _batch_size("batch_size", batch_size)
        expected = batch_size
        if next_batch_size is not None:
            expected = _batch_size("next_batch_size", next_batch_size)
        if self._accumulators_used_in_step:
            self._warn_once(
                "not reset",
                "gradient accumulators were not reset since the last averaging step: call "
                "reset_accumulated_grads_() after every step, or step(reset_accumulators=True)",
            )
            self._accumulators_used_in_step = False
        if self._scale is None:  # (the accumulators are zero: any scale holds; use b_1)
            self._scale = float(batch_size)
        scale = self._scale
        if self._accumulators is not None:
            for param, acc in zip(self.parameters, self._accumulators, strict=True):
                grad = param.grad
                if grad is not None:
                    acc.add_(grad.to(acc.device), alpha=batch_size / scale)
            self._weight_total += batch_size
        else:
            # .grad now holds (sum of earlier w_j g_j) / scale + g_i: g_i's weight is scale
            if batch_size != scale:
                self._warn_once(
                    "inexact",
                    "reuse_grad_buffers: a micro-batch of %d samples was weighted as %g samples "
                    "(the size expected when its gradient was accumulated into .grad); pass "
                    "accumulate_grads_(..., next_batch_size=n) before a micro-batch of another "
                    "size, or use reuse_grad_buffers=False, to weight every sample equally",
                    batch_size,
                    scale,
                )
            self._weight_total += scale
            for index, param in enumerate(self.parameters):
                grad, seen = param.grad, self._grad_seen[index]
                if seen is not None and seen() is not grad:
                    self._warn_once(
                        "dropped",
                        "reuse_grad_buffers: parameters[%d].grad was set to None or replaced "
                        "(zero_grad?) after it had accumulated gradients: what it held is not "
                        "in the average. Do not zero .grad between micro-batches with "
                        "reuse_grad_buffers=True",
                        index,
                    )
                self._grad_seen[index] = None if grad is None else weakref.ref(grad)
            if expected != scale:
                for param in self.parameters:
                    if param.grad is not None:
                        param.grad.mul_(scale / expected)
                self._scale = float(expected)
        self.local_samples_accumulated += batch_size
        self.local_times_accumulated += 1

    @torch.no_grad()
    def load_accumulators_into_averager_(self) -> None:
        """Write the local weighted mean of the accumulated micro-batches' gradients into the
        averaged buffers (zeros when nothing was accumulated). Waits while a round averages
        them in place."""
        accumulators = self._grad_accumulators()
        factor = 0.0
        if self._weight_total > 0 and self._scale is not None:
            factor = self._scale / self._weight_total
        with self.get_tensors() as averaged:
            for acc, buffer in zip(accumulators, averaged, strict=True):
                if acc is None or factor == 0.0:
                    buffer.zero_()
                else:
                    buffer.copy_(acc)
                    if factor != 1.0:
                        buffer.mul_(factor)

    @torch.no_grad()
    def reset_accumulated_grads_(self) -> None:
        """Zero the accumulators (with ``reuse_grad_buffers``, the parameters' ``.grad``; a
        missing one stays ``None``) and the counters."""
        self._accumulators_used_in_step = False
        self.local_samples_accumulated = self.local_times_accumulated = 0
        self._scale = None
        self._weight_total = 0.0
        self._grad_seen = [None] * len(self.parameters)
        for acc in self._grad_accumulators():
            if acc is not None:
                acc.zero_()

    # -- averaging -------------------------------------------------------------------------------

    def schedule_step(
        self,
        scheduled_time: float | None = None,
        *,
        gather: Any = None,
        weight: None = None,
        timeout: float | None = None,
        allow_retries: bool = True,
    ) -> StepHandle:
        """Begin looking for a group now, to average at ``scheduled_time`` (DHT time; default:
        as soon as a group forms): the step waits in ``AWAITING_TRIGGER`` until
        :meth:`step` is called with the returned handle. A handle serves one step.

        :param gather: metadata to share with the group (see
            :meth:`swarmavg.DecentralizedAverager.step`), as ``timeout`` and ``allow_retries``.
        :param weight: not accepted here: :meth:`step` sets it (the samples accumulated then).
        :raises ValueError: a ``weight`` was given, or another argument is out of range.
        :raises TypeError: an argument has the wrong type.
        :raises RuntimeError: the averager is not running.
        """
        if weight is not None:
            raise ValueError(
                "schedule_step() takes no weight: step() sets it (pass weight= to step())"
            )
        return super().step(
            gather=gather,
            timeout=timeout,
            allow_retries=allow_retries,
            wait=False,
            scheduled_time=scheduled_time,
            require_trigger=True,
        )

    @overload  # type: ignore[override]
    def step(
        self,
        weight: float | None = None,
        reset_accumulators: bool = True,
        control: StepHandle | None = None,
        timeout: float | None = None,
        wait: Literal[True] = True,
        **kwargs: Any,
    ) -> StepResult: ...

    @overload
    def step(
        self,
        weight: float | None = None,
        reset_accumulators: bool = True,
        control: StepHandle | None = None,
        timeout: float | None = None,
        *,
        wait: Literal[False],
        **kwargs: Any,
    ) -> StepHandle: ...

    def step(
        self,
        weight: float | None = None,
        reset_accumulators: bool = True,
        control: StepHandle | None = None,
        timeout: float | None = None,
        wait: bool = True,
        **kwargs: Any,
    ) -> StepResult | StepHandle:
        """Average the accumulated gradients with a group: load the local mean into the
        averaged buffers (:meth:`load_accumulators_into_averager_`), set this peer's weight,
        reset the accumulators if asked, and let the all-reduce begin.

        :param weight: this peer's weight; default: ``local_samples_accumulated`` (0 takes the
            group's mean without changing it).
        :param reset_accumulators: reset the accumulators once loaded (the round runs on the
            averaged buffers).
        :param control: a handle from :meth:`schedule_step` not used before; default: a new
            step (``kwargs``: ``gather``, ``allow_retries``, ``scheduled_time``).
        :param timeout: without ``control``: the new step's timeout (it returns or raises
            within it); with one: seconds to wait for its result (``wait=True``).
        :param wait: ``False`` returns the :class:`~swarmavg.averager.StepHandle` at once.
        :returns: the step's :class:`~swarmavg.StepResult` (``wait=True``), or
            its handle.
        :raises RuntimeError: ``kwargs`` given with a ``control`` (they would have no effect),
            or the averager is not running.
        :raises ValueError: ``control`` was used before (or was not made by
            :meth:`schedule_step`), or an argument is out of range.
        :raises TypeError: an argument has the wrong type or is unknown.
        :raises TimeoutError: ``wait=True`` and no result within ``timeout`` (the step is
            cancelled).
        :raises MatchmakingFailed: no group formed (``wait=True``).
        :raises AllReduceFailed: the group formed but the average was not computed.
        """
        if weight is not None:
            weight = _check_weight(weight)
        if not isinstance(reset_accumulators, bool):
            raise TypeError(f"reset_accumulators must be a bool, not {reset_accumulators!r:.64}")
        if not isinstance(wait, bool):
            raise TypeError(f"wait must be a bool, not {wait!r:.64}")
        wait_for = timeout
        if control is None:
            unknown = sorted(set(kwargs) - set(_STEP_OPTIONS))
            if unknown:
                raise TypeError(f"step() got unexpected keyword arguments: {', '.join(unknown)}")
            control = self.schedule_step(timeout=timeout, **kwargs)
            wait_for = None  # (the step itself ends within its timeout, with its own error)
        else:
            if kwargs:
                raise RuntimeError(
                    f"averaging in a pre-scheduled group: the arguments {sorted(kwargs)} would "
                    "have no effect (pass them to schedule_step())"
                )
            if not isinstance(control, StepHandle):
                raise TypeError(
                    f"control must be a StepHandle from schedule_step(), not "
                    f"{type(control).__name__}"
                )
            if not control.require_trigger:
                raise ValueError("control must come from schedule_step() (require_trigger=True)")
            if control.triggered:
                raise ValueError("control was already used in a step: schedule a new one")
        if self._new_averaged_grads:
            self._warn_once(
                "not used",
                "starting a new gradient averaging round, but the previous round's results "
                "were not used (use_averaged_gradients() or notify_used_averaged_gradients())",
            )
        self.load_accumulators_into_averager_()
        self._accumulators_used_in_step = True
        self._new_averaged_grads = True
        try:
            control.weight = float(self.local_samples_accumulated if weight is None else weight)
        except RuntimeError:
            if control.stage is not AveragingStage.FINISHED:
                raise
            # (the step already failed or was cancelled: its result says so)
        if reset_accumulators:
            self.reset_accumulated_grads_()
        control.allow_allreduce()
        if not wait:
            return control
        try:
            return control.result(wait_for)
        except BaseException:
            control.cancel()
            raise

    # -- using the results -----------------------------------------------------------------------

    @contextlib.contextmanager
    def use_averaged_gradients(self) -> Iterator[list[torch.Tensor]]:
        """Within the block, each parameter's ``.grad`` is its averaged gradient: the averaged
        buffer itself where its device and dtype are the parameter's (changes to ``.grad``
        change the buffer), else a copy on the parameter's device and dtype. The previous
        ``.grad`` (possibly ``None``) is restored on exit. Yields the averaged buffers, locked
        against averaging results. Marks the results as used."""
        self._new_averaged_grads = False
        with self.get_tensors() as averaged:
            old = [param.grad for param in self.parameters]
            try:
                with torch.no_grad():
                    for param, buffer in zip(self.parameters, averaged, strict=True):
                        if buffer.device == param.device and buffer.dtype == param.dtype:
                            param.grad = buffer
                        else:
                            param.grad = buffer.to(device=param.device, dtype=param.dtype)
                yield averaged
            finally:
                for param, grad in zip(self.parameters, old, strict=True):
                    param.grad = grad

    def notify_used_averaged_gradients(self) -> None:
        """Tell the averager that the last round's results were used (no warning at the next
        step)."""
        self._new_averaged_grads = False
