"""``swarmavg.optim.GradientAverager``: peers over TCP on 127.0.0.1 in one process (sync), and
the accumulation arithmetic on one peer (no round needed: the averaged buffers are read back)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from swarmavg import DHT, AveragingStage, DecentralizedAverager, StepHandle
from swarmavg._time import get_dht_time
from swarmavg.optim.grad_averager import EVERYONE, GradientAverager

pytestmark = pytest.mark.timeout(60)

LOGGER = "swarmavg.optim.grad_averager"


@contextmanager
def _dhts(count: int) -> Iterator[list[DHT]]:
    with ExitStack() as stack:
        first = stack.enter_context(DHT())
        rest = [stack.enter_context(DHT(first.get_visible_maddrs())) for _ in range(count - 1)]
        yield [first, *rest]


def _wait_for_stage(handles: Sequence[StepHandle], stage: AveragingStage) -> None:
    deadline = time.monotonic() + 20
    while not all(h.stage is stage for h in handles):
        assert time.monotonic() < deadline, [h.stage for h in handles]
        time.sleep(0.02)


def _sent(averager: GradientAverager) -> list[torch.Tensor]:
    """What the next step would send: the local mean, loaded into the averaged buffers."""
    averager.load_accumulators_into_averager_()
    with averager.get_tensors() as averaged:
        return [t.clone() for t in averaged]


# -- hivemind's tests (spec A.3) -------------------------------------------------------------------


def test_grad_averager() -> None:
    shape = (5, 5)
    with _dhts(2) as (dht1, dht2):
        model1 = nn.ParameterDict({"w": nn.Parameter(torch.zeros(shape))})
        model2 = nn.ParameterDict({"w": nn.Parameter(torch.zeros(shape))})
        with (
            GradientAverager(
                model1.parameters(), dht=dht1, prefix="test", target_group_size=2
            ) as averager1,
            GradientAverager(
                model2.parameters(),
                dht=dht2,
                prefix="test",
                target_group_size=2,
                reuse_grad_buffers=True,
            ) as averager2,
        ):
            control1 = averager1.schedule_step(get_dht_time() + 5)
            control2 = averager2.schedule_step(get_dht_time() + 5)
            for i in range(10):
                if i % 3 == 0:
                    F.mse_loss(model1.w, torch.ones(shape)).backward()
                    averager1.accumulate_grads_(batch_size=2)  # 4 times * 2 samples = 8
                    model1.zero_grad()  # (set_to_none=True)
                else:
                    F.mse_loss(model2.w, -torch.ones(shape)).backward()
                    averager2.accumulate_grads_(batch_size=3)  # 6 times * 3 samples = 18
                    # (no zero_grad: reuse_grad_buffers=True)
            _wait_for_stage([control1, control2], AveragingStage.AWAITING_TRIGGER)

            assert averager1.local_samples_accumulated == 8
            assert averager1.local_times_accumulated == 4
            assert averager2.local_samples_accumulated == 18
            assert averager2.local_times_accumulated == 6
            acc1 = averager1._grad_accumulators()[0]
            acc2 = averager2._grad_accumulators()[0]
            assert acc1 is not None
            assert acc2 is model2.w.grad
            torch.testing.assert_close(acc1, torch.full(shape, -2 / 25 * 4))
            torch.testing.assert_close(acc2, torch.full(shape, 2 / 25 * 6))

            averager1.step(control=control1, wait=False)
            averager2.step(control=control2, wait=False)
            for control in (control1, control2):
                assert control.result(timeout=30).group_size == 2
            for averager in (averager1, averager2):  # (the round averaged the buffers in place)
                assert averager._averager._last_in_place is not None

            expected = torch.full(shape, 8 / 26 * (-2 / 25) + 18 / 26 * (2 / 25))
            torch.testing.assert_close(expected, torch.full(shape, 2 / 65))
            with averager1.use_averaged_gradients():
                torch.testing.assert_close(model1.w.grad, expected)
            with averager2.use_averaged_gradients():
                torch.testing.assert_close(model2.w.grad, expected)
            # the grads are restored: peer 1's dropped one (None), peer 2's reset accumulator
            assert model1.w.grad is None
            assert model2.w.grad is not None
            assert torch.equal(model2.w.grad, torch.zeros(shape))
            assert averager1.local_samples_accumulated == averager2.local_times_accumulated == 0


def test_grad_averager_wrong_shape() -> None:
    model = nn.ParameterDict({"w": nn.Parameter(torch.zeros(5, 5))})
    with DHT() as dht:
        with pytest.raises(ValueError, match=r"averaged_grads\[0\] has shape \(5, 5, 1\)"):
            GradientAverager(
                model.parameters(),
                dht=dht,
                prefix="test_fail",
                target_group_size=2,
                averaged_grads=[torch.zeros(5, 5, 1)],
            )
        with pytest.raises(ValueError, match="holds 2 tensors for 1 parameters"):
            GradientAverager(
                model.parameters(),
                dht=dht,
                prefix="test_fail",
                averaged_grads=[torch.zeros(5, 5), torch.zeros(5, 5)],
            )


# -- exact sample weighting ------------------------------------------------------------------------


def _linear_batches(sizes: Sequence[int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 4, generator=generator), torch.randn(size, 2, generator=generator))
        for size in sizes
    ]


def _full_batch_grads(
    model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> list[torch.Tensor]:
    """The gradient of the mean loss over every sample: each sample weighted equally."""
    inputs = torch.cat([x for x, _ in batches])
    targets = torch.cat([y for _, y in batches])
    model.zero_grad()
    F.mse_loss(model(inputs), targets).backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    return grads


def test_uneven_batch_sizes_weight_every_sample_equally() -> None:
    """Peer A: micro-batches of 1, 3 and 5 samples in its own accumulators; peer B: 2, 4 and 4
    in .grad (reuse_grad_buffers), each size announced before its micro-batch; peer C tags
    along with weight 0 and other gradients. All three end with the gradient of the mean loss
    over the 19 samples of A and B."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    state = model.state_dict()
    batches_a = _linear_batches([1, 3, 5], seed=1)
    batches_b = _linear_batches([2, 4, 4], seed=2)
    expected = _full_batch_grads(model, batches_a + batches_b)
    # (hivemind's arithmetic for A alone, sum_i (b_i/b_1) g_i / n, is off by far more than 1e-6)
    models = [nn.Linear(4, 2) for _ in range(3)]
    for each in models:
        each.load_state_dict(state)
    with _dhts(3) as dhts:
        averagers = [
            GradientAverager(
                m.parameters(),
                dht=dht,
                prefix="uneven",
                target_group_size=3,
                reuse_grad_buffers=(i == 1),
            )
            for i, (m, dht) in enumerate(zip(models, dhts, strict=True))
        ]
        with ExitStack() as stack:
            for averager in averagers:
                stack.enter_context(averager)
            controls = [a.schedule_step() for a in averagers]
            a, b, c = averagers
            for x, y in batches_a:
                F.mse_loss(models[0](x), y).backward()
                a.accumulate_grads_(len(x))
                models[0].zero_grad()
            b_sizes = [len(x) for x, _ in batches_b]
            for k, (x, y) in enumerate(batches_b):
                F.mse_loss(models[1](x), y).backward()
                upcoming = b_sizes[k + 1] if k + 1 < len(b_sizes) else None
                b.accumulate_grads_(len(x), next_batch_size=upcoming)
            for x, y in _linear_batches([7], seed=3):
                F.mse_loss(models[2](x), y * 100).backward()
                c.accumulate_grads_(len(x))
            assert (a.local_samples_accumulated, b.local_samples_accumulated) == (9, 10)
            # each peer's local mean is exact
            for averager, own in ((a, batches_a), (b, batches_b)):
                local = _full_batch_grads(_with_state(state), own)
                for sent, want in zip(_sent(averager), local, strict=True):
                    torch.testing.assert_close(sent, want, atol=1e-6, rtol=0)

            a.step(control=controls[0], wait=False)
            b.step(control=controls[1], wait=False)
            c.step(control=controls[2], weight=0, wait=False)
            results = [control.result(timeout=30) for control in controls]
            assert all(r.group_size == 3 for r in results)
            assert sorted(map(str, results[0].contributors)) == sorted(
                str(averager.peer_id) for averager in (a, b)
            )
            for averager, m in zip(averagers, models, strict=True):
                with averager.use_averaged_gradients():
                    for param, want in zip(m.parameters(), expected, strict=True):
                        torch.testing.assert_close(param.grad, want, atol=1e-6, rtol=0)


def _with_state(state: dict[str, torch.Tensor]) -> nn.Linear:
    model = nn.Linear(4, 2)
    model.load_state_dict(state)
    return model


@pytest.fixture
def dht() -> Iterator[DHT]:
    with DHT() as node:
        yield node


def _one(dht: DHT, params: Sequence[torch.Tensor], **kwargs: object) -> GradientAverager:
    return GradientAverager(params, dht=dht, prefix="local", start=False, **kwargs)  # type: ignore[arg-type]


def test_reuse_grad_buffers_without_announcement_weights_as_documented(
    dht: DHT, caplog: pytest.LogCaptureFixture
) -> None:
    """.grad sums micro-batches of 1, 3 and 5 samples: their weights are 1 (the first is
    exact), then 1 and 3 (the size expected when each backward ran), logged once."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    state = model.state_dict()
    batches = _linear_batches([1, 3, 5], seed=1)
    grads = []
    for batch in batches:
        grads.append(_full_batch_grads(_with_state(state), [batch]))
    averager = _one(dht, list(model.parameters()), reuse_grad_buffers=True)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            for x, y in batches:
                F.mse_loss(model(x), y).backward()
                averager.accumulate_grads_(len(x))
        inexact = [r for r in caplog.records if "weighted as" in r.getMessage()]
        assert len(inexact) == 1
        assert inexact[0].levelno == logging.WARNING
        weights = [1, 1, 3]
        for k, sent in enumerate(_sent(averager)):
            want = sum(w * g[k] for w, g in zip(weights, grads, strict=True)) / sum(weights)
            torch.testing.assert_close(sent, want, atol=1e-6, rtol=0)
        assert averager.local_samples_accumulated == 9

        # equal sizes: exact without any announcement; .grad holds the plain sum as hivemind's
        averager.reset_accumulated_grads_()
        equal = _linear_batches([3, 3, 3], seed=4)
        for x, y in equal:
            F.mse_loss(model(x), y).backward()
            averager.accumulate_grads_(3)
        whole = _full_batch_grads(_with_state(state), equal)
        for sent, want in zip(_sent(averager), whole, strict=True):
            torch.testing.assert_close(sent, want, atol=1e-6, rtol=0)
        for param, want in zip(model.parameters(), whole, strict=True):
            torch.testing.assert_close(param.grad, want * 3, atol=1e-5, rtol=0)
    finally:
        averager.shutdown()


# -- missing .grad ---------------------------------------------------------------------------------


def test_a_dropped_grad_counts_as_zero_not_stale(dht: DHT) -> None:
    used = nn.Parameter(torch.zeros(3))
    skipped = nn.Parameter(torch.zeros(3))
    averager = _one(dht, [used, skipped])
    try:
        (used * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
        (skipped * 4.0).sum().backward()
        averager.accumulate_grads_(1)
        used.grad = skipped.grad = None  # zero_grad(set_to_none=True)
        (used * 2.0).sum().backward()  # `skipped` gets no gradient in this micro-batch
        assert skipped.grad is None
        averager.accumulate_grads_(3)
        sent_used, sent_skipped = _sent(averager)
        torch.testing.assert_close(sent_used, torch.tensor([7.0, 8.0, 9.0]) / 4)
        torch.testing.assert_close(sent_skipped, torch.full((3,), 4.0 / 4))  # not 4.0 (stale)
        assert skipped.grad is None  # (nothing made in its place)

        # next round: no gradient at all for `skipped`: its buffer becomes zero, not last round's
        averager.reset_accumulated_grads_()
        used.grad = None
        (used * 1.0).sum().backward()
        averager.accumulate_grads_(2)
        sent_used, sent_skipped = _sent(averager)
        torch.testing.assert_close(sent_used, torch.ones(3))
        assert torch.equal(sent_skipped, torch.zeros(3))
    finally:
        averager.shutdown()


def test_reuse_grad_buffers_missing_and_dropped_grads(
    dht: DHT, caplog: pytest.LogCaptureFixture
) -> None:
    used = nn.Parameter(torch.zeros(2))
    never = nn.Parameter(torch.zeros(2))
    averager = _one(dht, [used, never], reuse_grad_buffers=True)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            (used * 2.0).sum().backward()
            averager.accumulate_grads_(4)
            (used * 4.0).sum().backward()
            averager.accumulate_grads_(4)
            assert never.grad is None
            sent_used, sent_never = _sent(averager)
            torch.testing.assert_close(sent_used, torch.full((2,), 3.0))
            assert torch.equal(sent_never, torch.zeros(2))
            assert not caplog.records
            used.grad = None  # against the rules with reuse_grad_buffers: the sum is lost
            (used * 6.0).sum().backward()
            averager.accumulate_grads_(4)
        dropped = [r for r in caplog.records if "set to None" in r.getMessage()]
        assert len(dropped) == 1
        assert "parameters[0]" in dropped[0].getMessage()
        # (what .grad holds now, 6, over three micro-batches' weight: never the lost values)
        torch.testing.assert_close(_sent(averager)[0], torch.full((2,), 6.0 / 3))

        # next round: `used` has no .grad at all: its buffer becomes zero, not last round's
        averager.reset_accumulated_grads_()
        used.grad = None
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            (never * 1.0).sum().backward()
            averager.accumulate_grads_(4)
        assert not caplog.records
        sent_used, sent_never = _sent(averager)
        assert torch.equal(sent_used, torch.zeros(2))
        torch.testing.assert_close(sent_never, torch.ones(2))
    finally:
        averager.shutdown()


# -- buffers ---------------------------------------------------------------------------------------


def test_buffers_are_one_flat_cpu_tensor_per_dtype_and_defaults(dht: DHT) -> None:
    params = [
        nn.Parameter(torch.zeros(2, 3)),
        nn.Parameter(torch.zeros(4, dtype=torch.float64)),
        nn.Parameter(torch.zeros(5)),
    ]
    averager = _one(dht, params)
    try:
        with averager.get_tensors() as averaged:
            assert [t.shape for t in averaged] == [p.shape for p in params]
            assert [t.dtype for t in averaged] == [p.dtype for p in params]
            assert all(t.device.type == "cpu" for t in averaged)
            first, _, third = averaged
            assert first.untyped_storage().data_ptr() == third.untyped_storage().data_ptr()
            assert third.data_ptr() == first.data_ptr() + 6 * first.element_size()
        inner = averager._averager
        assert (inner.target_group_size, inner.min_group_size) == (EVERYONE, 2)
        assert averager.allow_state_sharing is False
        assert averager.parameters == tuple(params)
    finally:
        averager.shutdown()


def test_given_averaged_grads_are_used_as_they_are(dht: DHT) -> None:
    param = nn.Parameter(torch.zeros(3))
    given = torch.full((3,), 9.0, dtype=torch.float64)
    averager = _one(dht, [param], averaged_grads=[given])
    try:
        (param * 2.0).sum().backward()
        averager.accumulate_grads_(1)
        averager.load_accumulators_into_averager_()
        assert torch.equal(given, torch.full((3,), 2.0, dtype=torch.float64))
        before = param.grad
        with averager.use_averaged_gradients() as averaged:
            assert averaged[0] is given
            # another dtype than the parameter's: .grad is a copy in the parameter's dtype
            assert param.grad is not None
            assert param.grad.dtype == torch.float32
            torch.testing.assert_close(param.grad, torch.full((3,), 2.0))
        assert param.grad is before
    finally:
        averager.shutdown()


def test_use_averaged_gradients_aliases_buffers_and_restores_on_error(dht: DHT) -> None:
    param = nn.Parameter(torch.zeros(3))
    averager = _one(dht, [param], accumulate_grads_on="cpu")
    try:
        (param * 5.0).sum().backward()
        averager.accumulate_grads_(2)
        averager.load_accumulators_into_averager_()
        old = param.grad
        seen = []

        def clip_and_fail() -> None:
            with averager.use_averaged_gradients() as averaged:
                seen.append(param.grad is averaged[0])
                param.grad.mul_(2)  # type: ignore[union-attr]  # (in place: reaches the buffer)
                raise KeyError

        with pytest.raises(KeyError):
            clip_and_fail()
        assert seen == [True]
        assert param.grad is old
        with averager.get_tensors() as averaged:
            assert torch.equal(averaged[0], torch.full((3,), 10.0))
    finally:
        averager.shutdown()


# -- stepping and warnings -------------------------------------------------------------------------


def test_step_arguments_and_warnings(dht: DHT, caplog: pytest.LogCaptureFixture) -> None:
    param = nn.Parameter(torch.zeros(3))
    with GradientAverager([param], dht=dht, prefix="alone") as averager:
        with pytest.raises(ValueError, match="takes no weight"):
            averager.schedule_step(weight=1.0)  # type: ignore[arg-type]
        control = averager.schedule_step(timeout=30)
        with pytest.raises(RuntimeError, match="no effect"):
            averager.step(control=control, gather=1)
        with pytest.raises(TypeError, match="unexpected keyword arguments: bogus"):
            averager.step(bogus=1)
        with pytest.raises(ValueError, match="weight"):
            averager.step(control=control, weight=-1)
        with pytest.raises(TypeError, match="control"):
            averager.step(control=object())  # type: ignore[call-overload]
        plain = DecentralizedAverager.step(averager, wait=False, timeout=30)  # (no trigger)
        with pytest.raises(ValueError, match="schedule_step"):
            averager.step(control=plain)
        plain.cancel()
        with pytest.raises(TypeError, match="reset_accumulators"):
            averager.step(control=control, reset_accumulators=1)  # type: ignore[call-overload]
        assert not control.triggered

        param.grad = torch.ones(3)
        averager.accumulate_grads_(5)
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            handle = averager.step(control=control, wait=False, reset_accumulators=False)
            assert handle is control
            assert control.triggered
            assert control.weight == 5.0
            with pytest.raises(ValueError, match="already used"):
                averager.step(control=control, wait=False)
            averager.accumulate_grads_(5)  # not reset after the step: warned once
            averager.accumulate_grads_(5)
            second = averager.step(wait=False, weight=2)  # results unused: warned once
            assert second.weight == 2.0
            third = averager.step(wait=False)
            assert averager.local_samples_accumulated == 0
            for each in (control, second, third):
                each.cancel()
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 2, warnings
        assert "not reset" in warnings[0]
        assert "not used" in warnings[1]
        averager.notify_used_averaged_gradients()
        assert not averager._new_averaged_grads


def test_constructor_and_accumulate_arguments(dht: DHT) -> None:
    param = nn.Parameter(torch.zeros(3))

    def make(*args: object, **kwargs: object) -> None:
        GradientAverager(*args, dht=dht, prefix="args", start=False, **kwargs).shutdown()  # type: ignore[arg-type]

    with pytest.raises(TypeError, match="single tensor"):
        make(param)
    with pytest.raises(TypeError, match=r"parameters\[1\] is a int"):
        make([param, 3])
    with pytest.raises(TypeError, match=r"parameters\[0\] is torch.int64"):
        make([torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(ValueError, match=r"parameters\[1\] is the same tensor as parameters\[0\]"):
        make([param, param])
    with pytest.raises(ValueError, match="parameters is empty"):
        make([])
    with pytest.raises(TypeError, match="reuse_grad_buffers"):
        make([param], reuse_grad_buffers=1)
    with pytest.raises(TypeError, match="warn"):
        make([param], warn="yes")
    with pytest.raises(TypeError, match="accumulate_grads_on"):
        make([param], accumulate_grads_on=3)
    with pytest.raises(ValueError, match="accumulate_grads_on"):
        make([param], accumulate_grads_on="nowhere")
    with pytest.raises(TypeError, match=r"averaged_grads\[0\]"):
        make([param], averaged_grads=[[0.0, 0.0, 0.0]])
    with pytest.raises(TypeError, match="target_group_size"):
        make([param], target_group_size="2")

    averager = _one(dht, [param])
    try:
        for bad, error in ((0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError)):
            with pytest.raises(error, match="batch_size"):
                averager.accumulate_grads_(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="next_batch_size"):
            averager.accumulate_grads_(2, next_batch_size=0)
        assert averager.local_times_accumulated == 0
        import numpy as np

        averager.accumulate_grads_(np.int64(2))  # type: ignore[arg-type]
        assert averager.local_samples_accumulated == 2
    finally:
        averager.shutdown()


# -- devices ---------------------------------------------------------------------------------------

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["own", "on_cpu", "reuse"])
def test_parameters_on_a_device(dht: DHT, device: str, mode: str) -> None:
    """Accumulators on the parameters' device (or ``accumulate_grads_on``, or ``.grad``), the
    averaged buffers on the CPU, ``.grad`` on the parameter's device within
    ``use_averaged_gradients``."""
    param = nn.Parameter(torch.zeros(4, device=device))
    options: dict[str, object] = {
        "own": {},
        "on_cpu": {"accumulate_grads_on": "cpu"},
        "reuse": {"reuse_grad_buffers": True},
    }[mode]
    averager = _one(dht, [param], **options)
    try:
        accumulator = averager._grad_accumulators()[0]
        if mode == "reuse":
            assert accumulator is None
        else:
            assert accumulator is not None
            assert accumulator.device.type == ("cpu" if mode == "on_cpu" else device)
        for size, factor in ((1, 1.0), (3, 3.0)):
            (param * factor).sum().backward()
            averager.accumulate_grads_(size, next_batch_size=3)
            if mode != "reuse":
                param.grad = None
        averager.load_accumulators_into_averager_()
        with averager.get_tensors() as averaged:
            assert averaged[0].device.type == "cpu"
            torch.testing.assert_close(averaged[0], torch.full((4,), (1 * 1 + 3 * 3) / 4))
        with averager.use_averaged_gradients():
            assert param.grad is not None
            assert param.grad.device == param.device
            torch.testing.assert_close(param.grad.cpu(), torch.full((4,), 2.5))
    finally:
        averager.shutdown()
