"""``swarmavg.optim.GradScaler``: float16 AMP with ``swarmavg.Optimizer``.

The key property: in float32 arithmetic (no autocast) a power-of-two scale divides out exactly,
so training through the scaler must give bit-identical parameters to training without it, in
every mode and with several peers. The runs here end their epochs after a fixed number of
local samples (the tracker's ``ready_to_update_epoch`` is patched to count local samples only:
the ETA clause and the fetch timing would make the epochs' composition depend on timing) and
two peers step in lockstep, so that two runs see the same batches in the same epochs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from optim_helpers import FAST, run_threads, swarm

import swarmavg
from swarmavg import DHT
from swarmavg.optim import GradScaler, Optimizer, TrainingStateAverager
from swarmavg.optim.progress_tracker import ProgressTracker

pytestmark = pytest.mark.timeout(180)

TRACKER = {"min_refresh_period": 0.05, "default_refresh_period": 0.1}
DIM, BATCH, STEPS_PER_EPOCH = 5, 4, 4
PER_PEER_TARGET = BATCH * STEPS_PER_EPOCH

MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "reuse-grad-buffers": {"reuse_grad_buffers": True},
    "local-updates": {"use_local_updates": True},
}


@pytest.fixture
def epochs_by_local_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every peer ends an epoch after exactly ``PER_PEER_TARGET`` local samples."""
    monkeypatch.setattr(
        ProgressTracker,
        "ready_to_update_epoch",
        property(lambda self: self.local_progress.samples_accumulated >= PER_PEER_TARGET),
    )


def _initial_model() -> torch.nn.Module:
    torch.manual_seed(21)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _batch(peer: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10_000 * peer + step)
    x = torch.randn(BATCH, DIM, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _make_optimizer(dht: DHT, model: torch.nn.Module, run_id: str, **mode: Any) -> Optimizer:
    mode.setdefault("delay_state_averaging", False)
    return Optimizer(
        dht=dht,
        run_id=run_id,
        # (epochs_by_local_samples ends the epochs; a target this far keeps the ETA away, so
        # that no round is scheduled ahead at a time that does not fit those ends)
        target_batch_size=10**9,
        batch_size_per_step=BATCH,
        params=model.parameters(),
        optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.5),
        matchmaking_time=1.0,
        averaging_timeout=15.0,
        averager_opts=FAST,
        tracker_opts=TRACKER,
        **mode,
    )


def _wait_for_peers(opt: Optimizer, count: int) -> None:
    """Until this peer's tracker saw ``count`` peers (``count > 1``), bounded."""
    assert opt.tracker is not None
    if count < 2:
        return
    deadline = time.monotonic() + 30
    while opt.tracker.global_progress.num_peers < count:
        assert time.monotonic() < deadline, "the peers did not see each other"
        time.sleep(0.05)


def _train(
    peers: int,
    mode: dict[str, Any],
    *,
    scaler_options: dict[str, Any] | None,
    epochs: int = 3,
    unscale_and_clip: bool = False,
    skip: frozenset[int] = frozenset(),
    poison: frozenset[int] = frozenset(),
    observe: Callable[[int, Optimizer, GradScaler | None], None] | None = None,
) -> list[torch.Tensor]:
    """Each peer trains ``epochs`` epochs on its batches ``0, 1, ...`` (peers in lockstep),
    through a ``GradScaler("cpu", **scaler_options)`` unless ``None``. Peer 0 leaves out the
    batches in ``skip`` and sets one gradient to inf after the backward of those in ``poison``;
    ``observe(step, opt, scaler)`` runs after each of its steps. The final parameters."""
    initial = _initial_model()
    finals: list[torch.Tensor] = [torch.empty(0)] * peers
    lockstep = threading.Barrier(peers)
    reuse = mode.get("reuse_grad_buffers", False)

    def peer(index: int, dht: DHT) -> None:
        model = _initial_model()
        model.load_state_dict(initial.state_dict())
        scaler = None if scaler_options is None else GradScaler("cpu", **scaler_options)
        with _make_optimizer(dht, model, f"amp{peers}", **mode) as opt:
            step = 0
            while opt.local_epoch < epochs:
                assert step < 200, "training did not progress"
                lockstep.wait(30)
                if index == 0 and step in skip:
                    step += 1
                    continue
                x, y = _batch(index, step)
                loss = F.mse_loss(model(x), y)
                (loss if scaler is None else scaler.scale(loss)).backward()
                if index == 0 and step in poison:
                    with torch.no_grad():
                        next(model.parameters()).grad[0, 0] = float("inf")  # type: ignore[index]
                if scaler is None:
                    opt.step()
                else:
                    if unscale_and_clip:
                        scaler.unscale_(opt)
                        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
                    scaler.step(opt)
                    scaler.update()
                if index == 0 and observe is not None:
                    observe(step, opt, scaler)
                if step == 0:
                    _wait_for_peers(opt, peers)  # (a peer publishes once it has samples)
                if not reuse:
                    opt.zero_grad()
                step += 1
            finals[index] = _flat(model)

    with swarm(peers) as dhts:
        run_threads([partial(peer, i, dht) for i, dht in enumerate(dhts)])
    return finals


# -- exactness ----------------------------------------------------------------------------------


@pytest.mark.usefixtures("epochs_by_local_samples")
@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
@pytest.mark.parametrize("peers", [1, 2])
def test_a_power_of_two_scale_divides_out_exactly(peers: int, mode: str) -> None:
    """fp32 arithmetic: with the scaler (its scale growing every step in the modes that allow
    it) the parameters are bit-identical to a run without it."""
    plain = _train(peers, MODES[mode], scaler_options=None)
    scaled = _train(peers, MODES[mode], scaler_options={"growth_interval": 1})
    assert not torch.equal(plain[0], _flat(_initial_model()))  # (it trained)
    for a, b in zip(plain, scaled, strict=True):
        assert torch.equal(a, b)
    if peers == 2 and mode != "local-updates":
        assert torch.equal(scaled[0], scaled[1])


@pytest.mark.usefixtures("epochs_by_local_samples")
def test_unscale_for_clipping_is_not_done_twice() -> None:
    """``scaler.unscale_(opt)`` before ``step`` (for clipping): the gradients are unscaled once
    (a clip that does not bind leaves the run bit-identical to one without a scaler)."""
    plain = _train(1, {}, scaler_options=None)
    clipped = _train(1, {}, scaler_options={}, unscale_and_clip=True)
    assert torch.equal(plain[0], clipped[0])


@pytest.mark.usefixtures("epochs_by_local_samples")
def test_every_epoch_averages_gradients_without_rounds_scheduled_ahead() -> None:
    """No round is scheduled ahead here (the ETA is far): the handle of the last epoch's round,
    used, must not keep the next epoch from averaging (hivemind's ``elif`` made every other
    epoch step on local gradients then). No state averaging that would hide it."""
    groups: dict[int, Any] = {}

    def observe(step: int, opt: Optimizer, scaler: GradScaler | None) -> None:
        if (step + 1) % STEPS_PER_EPOCH == 0:
            groups[opt.last_epoch_info["epoch"]] = opt.last_epoch_info["grad_group"]

    finals = _train(2, {"average_state_every": 1000}, scaler_options={}, epochs=3, observe=observe)
    assert groups == {0: 2, 1: 2, 2: 2}
    assert torch.equal(finals[0], finals[1])


# -- non-finite gradients -----------------------------------------------------------------------


@pytest.mark.usefixtures("epochs_by_local_samples")
@pytest.mark.parametrize("mode", ["default", "local-updates"])
def test_a_non_finite_batch_is_skipped_and_the_scale_backs_off(mode: str) -> None:
    """Own accumulators: the batch with an inf is left out (its samples are not counted, the
    result equals a run without that batch), what was accumulated before stays, and the
    scale halves at the update."""
    seen: dict[int, tuple[int, float]] = {}

    def observe(step: int, opt: Optimizer, scaler: GradScaler | None) -> None:
        assert scaler is not None
        assert opt.tracker is not None
        seen[step] = (opt.tracker.local_progress.samples_accumulated, scaler.get_scale())

    poisoned = _train(1, MODES[mode], scaler_options={}, poison=frozenset({5}), observe=observe)
    without = _train(1, MODES[mode], scaler_options=None, skip=frozenset({5}))
    assert torch.equal(poisoned[0], without[0])
    assert seen[4] == (BATCH, 2.0**16)  # the first batch of epoch 1
    assert seen[5] == (BATCH, 2.0**15)  # not counted; the scale backed off
    assert seen[6] == (2 * BATCH, 2.0**15)


@pytest.mark.usefixtures("epochs_by_local_samples")
def test_reuse_grad_buffers_resets_the_accumulation_on_a_non_finite_batch() -> None:
    """``reuse_grad_buffers``: ``.grad`` holds scaled sums; a non-finite one resets the
    accumulation (0 samples reported, ``.grad`` zero) and the scale backs off; the result
    equals a run without the epoch's batches up to the poisoned one."""
    seen: dict[int, tuple[int, int, bool, float]] = {}

    def observe(step: int, opt: Optimizer, scaler: GradScaler | None) -> None:
        assert scaler is not None
        assert opt.tracker is not None
        assert opt.grad_averager is not None
        zero = all(p.grad is None or not p.grad.any() for p in opt.param_groups[0]["params"])
        seen[step] = (
            opt.tracker.local_progress.samples_accumulated,
            opt.grad_averager.local_samples_accumulated,
            zero,
            scaler.get_scale(),
        )

    poisoned = _train(
        1, MODES["reuse-grad-buffers"], scaler_options={}, poison=frozenset({5}), observe=observe
    )
    without = _train(1, MODES["reuse-grad-buffers"], scaler_options=None, skip=frozenset({4, 5}))
    assert seen[4] == (BATCH, BATCH, False, 2.0**16)
    assert seen[5] == (0, 0, True, 2.0**15)
    assert seen[6] == (BATCH, BATCH, False, 2.0**15)
    assert torch.equal(poisoned[0], without[0])


# -- scale growth -------------------------------------------------------------------------------


@pytest.mark.usefixtures("epochs_by_local_samples")
@pytest.mark.parametrize("mode", ["default", "reuse-grad-buffers"])
def test_the_scale_grows_only_after_epoch_steps_with_reuse_grad_buffers(mode: str) -> None:
    """``growth_interval=1``: with own accumulators the scale doubles at every update; with
    ``reuse_grad_buffers`` only at the update after an epoch's step (every summand of the
    running sum in ``.grad`` carries one scale)."""
    scales: list[tuple[int, float]] = []

    def observe(step: int, opt: Optimizer, scaler: GradScaler | None) -> None:
        assert scaler is not None
        scales.append((opt.local_epoch, scaler.get_scale()))

    _train(1, MODES[mode], scaler_options={"growth_interval": 1}, epochs=2, observe=observe)
    if mode == "default":
        assert [s for _, s in scales] == [2.0 ** (17 + i) for i in range(len(scales))]
    else:
        # epoch e's local steps see 2**(16 + e); the update after its last step doubles it
        assert scales == [
            (0, 2.0**16),
            (0, 2.0**16),
            (0, 2.0**16),
            (1, 2.0**17),
            (1, 2.0**17),
            (1, 2.0**17),
            (1, 2.0**17),
            (2, 2.0**18),
        ]


# -- errors and torch's API ---------------------------------------------------------------------


def test_constructor_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="growth_factor"):
        GradScaler("cpu", growth_factor=1.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        GradScaler("cpu", backoff_factor=1.5)
    with pytest.raises(ValueError, match="init_scale"):
        GradScaler("cpu", init_scale=float("inf"))
    with pytest.raises(ValueError, match="init_scale"):
        GradScaler("cpu", init_scale=0)
    with pytest.raises(TypeError, match="growth_interval"):
        GradScaler("cpu", growth_interval=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="growth_interval"):
        GradScaler("cpu", growth_interval=0)
    with pytest.raises(ValueError, match="device"):
        GradScaler("cuda:0")
    with pytest.raises(TypeError, match="enabled"):
        GradScaler("cpu", enabled=1)  # type: ignore[arg-type]
    assert swarmavg.optim.GradScaler is GradScaler
    assert issubclass(GradScaler, torch.amp.GradScaler)


def test_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Linear(DIM, 1)
    x, y = _batch(0, 0)
    with swarm(1) as (dht,):
        with _make_optimizer(dht, model, "errors") as opt:
            F.mse_loss(model(x), y).backward()
            torch_scaler = torch.amp.GradScaler("cpu")
            with pytest.raises(ValueError, match="grad_scaler must be a swarmavg"):
                opt.step(grad_scaler=torch_scaler)
            torch_scaler.scale(torch.ones(()))
            # (torch's step() passes itself to step(grad_scaler=...) with a FutureWarning)
            with (
                pytest.raises(ValueError, match="grad_scaler must be a swarmavg"),
                pytest.warns(FutureWarning),
            ):
                torch_scaler.step(opt)
            scaler = GradScaler("cpu")
            scaler.scale(F.mse_loss(model(x), y)).backward()
            with pytest.raises(RuntimeError, match="Closure"):
                scaler.step(opt, closure=lambda: torch.zeros(()))
            with pytest.raises(ValueError, match="closure"):
                opt.step(closure=lambda: torch.zeros(()), grad_scaler=scaler)
            scaler.unscale_(opt)
            with pytest.raises(RuntimeError, match="already been called"):
                scaler.unscale_(opt)
            scaler.step(opt)
            with pytest.raises(RuntimeError, match="already been called"):
                scaler.step(opt)
            with pytest.raises(RuntimeError, match="after step"):
                scaler.unscale_(opt)
            scaler.update()
            state = scaler.state_dict()
            restored = GradScaler("cpu")
            restored.load_state_dict(state)
            assert restored.get_scale() == scaler.get_scale() == 2.0**16
            # a disabled scaler: a plain step
            disabled = GradScaler("cpu", enabled=False)
            F.mse_loss(model(x), y).backward()
            disabled.step(opt)
            disabled.update()
        half_model = torch.nn.Linear(DIM, 1).half()
        with _make_optimizer(
            dht, half_model, "half", reuse_grad_buffers=True, offload_optimizer=False
        ) as opt:
            scaler = GradScaler("cpu")
            scaler.scale(F.mse_loss(half_model(x.half()), y.half())).backward()
            with pytest.raises(ValueError, match="FP16"):
                scaler.step(opt)  # (at the first step, also where it only checks)
        reuse_model = torch.nn.Linear(DIM, 1)
        with _make_optimizer(dht, reuse_model, "reuse", reuse_grad_buffers=True) as opt:
            scaler = GradScaler("cpu")
            scaler.scale(F.mse_loss(reuse_model(x), y)).backward()
            with pytest.raises(RuntimeError, match="reuse_grad_buffers"):
                scaler.unscale_(opt)
        aux_model = torch.nn.Linear(DIM, 1)
        with (
            Optimizer(
                dht=dht,
                run_id="aux",
                target_batch_size=8,
                optimizer=torch.optim.SGD(aux_model.parameters(), lr=0.1),
                auxiliary=True,
                averager_opts=FAST,
            ) as opt,
            pytest.raises(ValueError, match="auxiliary"),
        ):
            opt.step(grad_scaler=GradScaler("cpu"))


def test_any_other_optimizer_gets_torchs_behaviour() -> None:
    """With a plain torch optimizer the scaler is torch's: it unscales, skips non-finite
    steps and updates the scale."""
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1)
    reference = torch.nn.Linear(DIM, 1)
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    x, y = _batch(0, 0)
    scaler.scale(F.mse_loss(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    F.mse_loss(reference(x), y).backward()
    ref_opt.step()
    assert torch.equal(_flat(model), _flat(reference))
    opt.zero_grad()
    scaler.scale(F.mse_loss(model(x), y) * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(_flat(model), _flat(reference))
    assert scaler.get_scale() == 2.0**15


def test_the_state_averager_steps_through_a_torch_scaler() -> None:
    """Standalone ``TrainingStateAverager.step(grad_scaler=...)`` with torch's own scaler;
    a scaler with a delayed step is refused (it would run in the background thread)."""
    param = torch.zeros(3, requires_grad=True)
    with ExitStack() as stack:
        (dht,) = stack.enter_context(swarm(1))
        averager = stack.enter_context(
            TrainingStateAverager(
                dht=dht,
                optimizer=partial(torch.optim.SGD, lr=1.0),
                params=[param],
                offload_optimizer=True,
                prefix="standalone_scaler",
            )
        )
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        scaler.scale((param * torch.tensor([1.0, 2.0, 3.0])).sum()).backward()
        averager.step(optimizer_step=True, grad_scaler=scaler)
        scaler.update()
        assert torch.equal(param.detach(), torch.tensor([-1.0, -2.0, -3.0]))
        with pytest.raises(ValueError, match="delay_optimizer_step"):
            averager.step(
                optimizer_step=True,
                delay_optimizer_step=True,
                delay_averaging=True,
                grad_scaler=scaler,
            )


# -- float16 ------------------------------------------------------------------------------------


def _cpu_fp16_autocast_works() -> bool:
    try:
        if not torch.amp.is_autocast_available("cpu"):
            return False
        with torch.autocast("cpu", dtype=torch.float16):
            out = torch.nn.functional.linear(torch.ones(2, 2), torch.ones(2, 2))
        return out.dtype == torch.float16
    except (RuntimeError, AssertionError):
        return False


@pytest.mark.skipif(not _cpu_fp16_autocast_works(), reason="no float16 autocast on CPU here")
def test_float16_autocast_trains_the_workload_on_cpu() -> None:
    """The workload (a small transformer LM) under float16 autocast on CPU: the loss falls
    over a few epochs, and the parameters stay finite and float32."""
    from swarmavg.testing import workload

    torch.manual_seed(0)
    corpus = workload.load_corpus()
    model = workload.make_model(seed=0, d_model=32, layers=1, heads=2)
    before = workload.evaluate(model, corpus, num_batches=2)
    scaler = GradScaler("cpu")
    with (
        swarm(1) as (dht,),
        Optimizer(
            dht=dht,
            run_id="fp16",
            target_batch_size=64,
            batch_size_per_step=16,
            params=model.parameters(),
            optimizer=partial(workload.make_optimizer, lr=5e-3),
            matchmaking_time=1.0,
            averager_opts=FAST,
            tracker_opts=TRACKER,
        ) as opt,
    ):
        for _, (x, y) in zip(range(60), workload.batches(corpus, 16, seed=0), strict=False):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = workload.loss_fn(model, x, y)
            assert loss.dtype == torch.float32  # (cross-entropy runs in float32)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if opt.local_epoch >= 8:
                break
        assert opt.local_epoch >= 4
    after = workload.evaluate(model, corpus, num_batches=2)
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())
    assert after < before - 0.5, (before, after)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.usefixtures("epochs_by_local_samples")
@pytest.mark.parametrize("mode", ["default", "reuse-grad-buffers"])
def test_two_cuda_peers_train_in_float16_and_agree(mode: str) -> None:
    """Two peers, CUDA tensors and float16 autocast: after every epoch both hold the same
    parameters, and the loss falls."""
    epochs = 4
    initial = _initial_model()
    finals: list[torch.Tensor] = [torch.empty(0), torch.empty(0)]
    losses: list[tuple[float, float]] = [(0.0, 0.0), (0.0, 0.0)]
    lockstep = threading.Barrier(2)
    x_eval, y_eval = (t.cuda() for t in _batch(99, 0))
    reuse = MODES[mode].get("reuse_grad_buffers", False)

    def peer(index: int, dht: DHT) -> None:
        model = _initial_model().cuda()
        model.load_state_dict(initial.state_dict())
        with torch.no_grad():
            first = F.mse_loss(model(x_eval), y_eval).item()
        scaler = GradScaler("cuda")
        with _make_optimizer(dht, model, "cuda_amp", **MODES[mode]) as opt:
            step = 0
            while opt.local_epoch < epochs:
                assert step < 200, "training did not progress"
                lockstep.wait(30)
                x, y = (t.cuda() for t in _batch(index, step))
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = F.mse_loss(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                if not reuse:
                    opt.zero_grad()
                if step == 0:
                    _wait_for_peers(opt, 2)
                step += 1
            finals[index] = _flat(model).cpu()
        with torch.no_grad():
            losses[index] = (first, F.mse_loss(model(x_eval), y_eval).item())

    with swarm(2) as dhts:
        run_threads([partial(peer, i, dht) for i, dht in enumerate(dhts)])
    torch.testing.assert_close(finals[0], finals[1], atol=0, rtol=0)
    for first, last in losses:
        assert last < first, losses
