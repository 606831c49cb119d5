"""``swarmavg.optim.GradScaler``: float16 mixed precision (AMP) with :class:`swarmavg.Optimizer`.

A subclass of ``torch.amp.GradScaler`` (same constructor, ``scale``, ``update``, ``state_dict``)
that knows how the optimizer accumulates gradients over many local steps before it steps::

    scaler = swarmavg.optim.GradScaler()          # GradScaler("cpu") for CPU autocast
    for x, y in data:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt, batch_size=len(x))       # = opt.step(batch_size=..., grad_scaler=scaler)
        scaler.update()
        opt.zero_grad()

What happens at each local step (the optimizer calls the private methods below):

* Own accumulators (``reuse_grad_buffers=False``, the default; also ``use_local_updates``): the
  model's ``.grad`` is unscaled in place and checked for inf/NaN (unless :meth:`unscale_` did
  it already, e.g. for clipping). A non-finite batch is skipped: not accumulated, no samples
  reported, and :meth:`update` backs the scale off. The accumulators hold unscaled gradients,
  so nothing accumulated before is lost, and the scale may change between local steps.
* ``reuse_grad_buffers=True``: ``.grad`` is the accumulator and holds a sum of *scaled*
  gradients, so it is only checked (never unscaled) at local steps, and unscaled once, before
  the gradients are averaged at the end of the epoch. A non-finite check resets the
  accumulators (all of this epoch's local gradients) and reports 0 samples; the scale backs off.
  The scale never grows during an accumulation: :meth:`update` counts growth steps as torch's,
  but applies a growth only at the update after an epoch's step (backoff applies at once, and
  it comes with a reset, so every summand of ``.grad`` carries the same scale).
  :meth:`unscale_` raises here: unscaling or clipping a running sum is not possible.

The gradients averaged and stepped on are unscaled, so the inner optimizer's step takes no
scaler: nothing of this class runs in the background thread of a delayed step.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.amp.grad_scaler import OptState

if TYPE_CHECKING:
    from swarmavg.optim.optimizer import Optimizer

__all__ = ["GradScaler"]

#: per-optimizer flag: a ``reuse_grad_buffers`` local step without an epoch step (hold growth)
_HOLD_GROWTH = "swarmavg_hold_growth"
#: a growth interval that is never reached (``torch._amp_update_scale_`` then only counts)
_NEVER = 2**31 - 1


def _fresh_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _check_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, not {value!r:.64}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, not {value!r}")
    return float(value)


def _swarmavg_optimizer(optimizer: object) -> Optimizer | None:
    from swarmavg.optim.optimizer import Optimizer

    return optimizer if isinstance(optimizer, Optimizer) else None


class GradScaler(torch.amp.GradScaler):
    """Loss scaling for float16 autocast, for :class:`swarmavg.Optimizer` (and, as torch's
    ``GradScaler``, for any other optimizer).

    :param device: the device type of the scaled losses (``"cuda"``, ``"cpu"``, ...); with
        ``"cuda"`` and no CUDA, scaling is disabled with a warning (as torch's).
    :param init_scale: the first scale (a power of two keeps fp32 arithmetic exact).
    :param growth_factor: the scale is multiplied by it after ``growth_interval`` steps without
        inf/NaN (> 1).
    :param backoff_factor: the scale is multiplied by it after a step with inf/NaN (in (0, 1)).
    :param growth_interval: steps without inf/NaN before a growth (with
        ``reuse_grad_buffers``: applied at the first update after an epoch's step from then on).
    :param enabled: ``False``: :meth:`step` calls ``optimizer.step()``, the rest does nothing.
    :raises TypeError: an argument of the wrong type (named).
    :raises ValueError: an argument out of range (named).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        if not isinstance(device, str):
            raise TypeError(f"device must be a device type such as 'cuda', not {device!r:.64}")
        if not device or ":" in device:
            raise ValueError(
                f"device must be a device type such as 'cuda' or 'cpu', not {device!r}"
            )
        if _check_number("init_scale", init_scale) <= 0:
            raise ValueError(f"init_scale must be positive, not {init_scale!r}")
        if _check_number("growth_factor", growth_factor) <= 1:
            raise ValueError(f"growth_factor must be > 1, not {growth_factor!r}")
        if not 0 < _check_number("backoff_factor", backoff_factor) < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), not {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
            raise TypeError(f"growth_interval must be an int, not {growth_interval!r:.64}")
        if not 1 <= growth_interval < _NEVER:
            raise ValueError(f"growth_interval must be in [1, {_NEVER}), not {growth_interval}")
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, not {enabled!r:.64}")
        super().__init__(
            device,
            init_scale=float(init_scale),
            growth_factor=float(growth_factor),
            backoff_factor=float(backoff_factor),
            growth_interval=growth_interval,
            enabled=enabled,
        )

    # -- torch's API ----------------------------------------------------------------------------

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """With a :class:`swarmavg.Optimizer`: ``optimizer.step(*args, grad_scaler=self,
        **kwargs)`` (which unscales, checks and skips non-finite batches itself). With any other
        optimizer: torch's ``GradScaler.step``.

        :raises RuntimeError: a closure (as torch's), or ``step`` twice without :meth:`update`.
        """
        swarm = _swarmavg_optimizer(optimizer)
        if swarm is None:
            return super().step(optimizer, *args, **kwargs)
        if not self._enabled:
            return swarm.step(*args, **kwargs)
        if "closure" in kwargs or (args and args[0] is not None):
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        if "grad_scaler" in kwargs:
            raise TypeError("GradScaler.step() passes itself as grad_scaler: do not pass one")
        kwargs["grad_scaler"] = self
        return swarm.step(*args, **kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the gradients in place now (for clipping or inspection before :meth:`step`);
        with a :class:`swarmavg.Optimizer`, the model's parameters' ``.grad``.

        :raises RuntimeError: called twice or after :meth:`step` before :meth:`update` (as
            torch's), or the optimizer has ``reuse_grad_buffers=True`` (``.grad`` is then the
            running sum of scaled gradients: it is unscaled once, at the end of the epoch).
        """
        swarm = _swarmavg_optimizer(optimizer)
        if swarm is None or not self._enabled:
            super().unscale_(optimizer)
            return
        if swarm.grad_averager is not None and swarm.grad_averager.reuse_grad_buffers:
            raise RuntimeError(
                "unscale_() with reuse_grad_buffers=True: .grad holds the running sum of scaled "
                "gradients and is unscaled only at the end of the epoch, so it cannot be unscaled "
                "or clipped per step; use reuse_grad_buffers=False to clip gradients under AMP"
            )
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(swarm)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        state["found_inf_per_device"] = self._unscale_and_find_inf(
            _main_parameters(swarm), self._inv_scale()
        )
        state["stage"] = OptState.UNSCALED

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """As torch's: back off after a non-finite step, grow after ``growth_interval`` finite
        ones. After a local step of a ``reuse_grad_buffers`` optimizer (no epoch step), a due
        growth waits for the update after the epoch's step."""
        if not self._enabled:
            return
        hold = any(state.get(_HOLD_GROWTH) for state in self._per_optimizer_states.values())
        if new_scale is not None or not hold:
            super().update(new_scale)
            return
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        found_infs = [
            found_inf.to(device=scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        if not found_infs:
            raise AssertionError("No inf checks were recorded prior to update.")
        combined = torch.stack(found_infs).sum()
        # count this step (or back off), never grow: at most growth_interval - 1 counted
        torch._amp_update_scale_(
            scale, growth_tracker, combined, self._growth_factor, self._backoff_factor, _NEVER
        )
        growth_tracker.clamp_(max=self._growth_interval - 1)
        self._per_optimizer_states = defaultdict(_fresh_state)

    # -- what swarmavg.Optimizer.step calls -------------------------------------------------------

    def _begin_optimizer_step(self, optimizer: Optimizer) -> None:
        """The checks of torch's ``step``: a scale exists, no step since the last update.

        :raises AssertionError: :meth:`scale` was never called (torch's message).
        :raises RuntimeError: a second step before :meth:`update`.
        """
        self._check_scale_growth_tracker("step")
        if self._per_optimizer_states[id(optimizer)]["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

    def _check_local_gradients(self, optimizer: Optimizer, *, unscale: bool) -> bool:
        """A local step: unscale the model's ``.grad`` in place (``unscale``; unless
        :meth:`unscale_` did) or only check it, record the result for :meth:`update`; whether
        every gradient is finite (waits for the device)."""
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is not OptState.UNSCALED:
            inv_scale = self._inv_scale()
            if not unscale:
                inv_scale = torch.ones_like(inv_scale)
            state["found_inf_per_device"] = self._unscale_and_find_inf(
                _main_parameters(optimizer), inv_scale
            )
        state["stage"] = OptState.STEPPED
        if not unscale:
            state[_HOLD_GROWTH] = True
        return not any(bool(found.item()) for found in state["found_inf_per_device"].values())

    def _skip_local_step(self, optimizer: Optimizer) -> None:
        """A step that used no gradients (the optimizer loaded the state from peers): record
        a finite step so that :meth:`update` works."""
        state = self._per_optimizer_states[id(optimizer)]
        if not state["found_inf_per_device"]:
            scale, _ = self._check_scale_growth_tracker("step")
            state["found_inf_per_device"] = {scale.device: torch.zeros_like(scale)}
        state["stage"] = OptState.STEPPED
        state.pop(_HOLD_GROWTH, None)

    def _unscale_accumulated(self, optimizer: Optimizer) -> None:
        """``reuse_grad_buffers``, at the end of an epoch: unscale the accumulated ``.grad`` in
        place before it is averaged; the next :meth:`update` may grow the scale."""
        state = self._per_optimizer_states[id(optimizer)]
        found = self._unscale_and_find_inf(_main_parameters(optimizer), self._inv_scale())
        recorded = state["found_inf_per_device"]
        for device, found_inf in found.items():
            recorded[device] = recorded[device] + found_inf if device in recorded else found_inf
        state.pop(_HOLD_GROWTH, None)

    # -- helpers ----------------------------------------------------------------------------------

    def _inv_scale(self) -> torch.Tensor:
        scale, _ = self._check_scale_growth_tracker("unscale_")
        return scale.double().reciprocal().float()  # (as torch's: the reciprocal in float64)

    @torch.no_grad()
    def _unscale_and_find_inf(
        self, params: Iterable[torch.Tensor], inv_scale: torch.Tensor
    ) -> dict[torch.device, torch.Tensor]:
        """Multiply every ``.grad`` by ``inv_scale`` in place; per device, a float tensor that
        is nonzero where a gradient had an inf or NaN. Never empty (the scale's device when no
        parameter has a gradient).

        :raises ValueError: a float16 gradient (as torch's; also when only checking, so that
            ``reuse_grad_buffers`` fails at the first step, not at the end of an epoch).
        """
        grouped: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        for param in params:
            grad = param.grad
            if grad is None:
                continue
            if grad.dtype == torch.float16:
                raise ValueError(
                    "Attempting to unscale FP16 gradients: keep the parameters in float32 and "
                    "let torch.autocast compute in float16"
                )
            if grad.is_sparse:
                if grad.dtype is torch.float16:
                    param.grad = grad = grad.coalesce()
                grad = grad._values()
            grouped[grad.device][grad.dtype].append(grad)
        found: dict[torch.device, torch.Tensor] = {}
        for device, by_dtype in grouped.items():
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
            device_inv_scale = inv_scale.to(device)
            for grads in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, device_inv_scale)
            found[device] = found_inf
        if not found:
            found[inv_scale.device] = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
        return found


def _main_parameters(optimizer: Optimizer) -> tuple[torch.Tensor, ...]:
    """The model's parameters (with ``offload_optimizer`` the inner optimizer holds copies)."""
    assert optimizer.state_averager is not None
    return optimizer.state_averager.main_parameters
