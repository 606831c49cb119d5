"""``swarmavg.optim.TrainingAverager``: two peers over TCP on 127.0.0.1 in one process
(hivemind's ``test_training_averager``, spec B.3), the delta rule, state sharing, failures."""

from __future__ import annotations

import logging
import threading
from contextlib import ExitStack

import pytest
import torch

from swarmavg.optim.training_averager import TrainingAverager, TrainingStepHandle
from tests.optim.optim_helpers import FAST, swarm

pytestmark = pytest.mark.timeout(120)


def _averager(opt: torch.optim.Optimizer, dht: object, **options: object) -> TrainingAverager:
    return TrainingAverager(
        opt,
        average_parameters=True,
        average_gradients=True,
        average_opt_statistics=("exp_avg_sq",),
        dht=dht,  # type: ignore[arg-type]
        prefix="test",
        target_group_size=2,
        **{**FAST, **options},  # type: ignore[arg-type]
    )


def test_training_averager_equals_the_mean_after_every_round() -> None:
    torch.manual_seed(42)
    x1, x2 = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    opt1, opt2 = torch.optim.Adam([x1], lr=0.05), torch.optim.Adam([x2], lr=0.05)
    with swarm(2) as dhts, ExitStack() as stack:
        avgr1 = stack.enter_context(_averager(opt1, dhts[0]))
        avgr2 = stack.enter_context(_averager(opt2, dhts[1]))
        # initialize_optimizer created the state without a step: parameters unchanged
        assert int(opt1.state[x1]["step"]) == 0
        for _ in range(10):
            (x1**2 + x1).sum().backward()
            opt1.step()
            (-(x2**2) + 2 * x2).sum().backward()
            opt2.step()
            expected = [
                0.5 * (x1 + x2).detach(),
                0.5 * (x1.grad + x2.grad),  # type: ignore[operator]
                0.5 * (opt1.state[x1]["exp_avg_sq"] + opt2.state[x2]["exp_avg_sq"]),
            ]
            handle1, handle2 = avgr1.step(wait=False), avgr2.step(wait=False)
            assert isinstance(handle1, TrainingStepHandle)
            assert isinstance(handle2, TrainingStepHandle)
            result1, result2 = handle1.result(), handle2.result()
            assert result1 is not None
            assert result2 is not None
            assert handle1.done()
            assert len(result1) == 2
            for x, opt in ((x1, opt1), (x2, opt2)):
                got = [x.detach(), x.grad, opt.state[x]["exp_avg_sq"]]
                for value, want in zip(got, expected, strict=True):
                    assert torch.allclose(value, want, atol=1e-6), (value, want)
        assert avgr1.local_step == avgr2.local_step == 10
        assert avgr1.rounds_succeeded == 10
        assert avgr1.rounds_failed == 0
        assert avgr1.last_round is not None
        assert avgr1.last_round.succeeded
        assert avgr1.last_round.group_size == 2


class _StepBeforeApplying:
    """A data lock whose second acquisition (the round writing its result back) first takes a
    "local step" ``tensor += 10``, as a training thread would have during the round."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._lock = threading.Lock()
        self._tensor = tensor
        self.acquired = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        self.acquired += 1
        if self.acquired == 2:
            with torch.no_grad():
                self._tensor += 10
        return True

    def release(self) -> None:
        self._lock.release()


def test_delta_rule_keeps_local_steps_taken_during_the_round() -> None:
    a, b = torch.zeros(4, requires_grad=True), torch.ones(4, requires_grad=True)
    with swarm(2) as dhts, ExitStack() as stack:
        averagers = [
            stack.enter_context(
                TrainingAverager(
                    torch.optim.SGD([x], lr=1.0),
                    average_parameters=True,
                    average_gradients=False,
                    dht=dht,
                    prefix="delta",
                    target_group_size=2,
                    **FAST,  # type: ignore[arg-type]
                )
            )
            for x, dht in ((a, dhts[0]), (b, dhts[1]))
        ]
        lock = _StepBeforeApplying(a)
        handle = averagers[0].step(data_lock=lock, wait=False)
        assert isinstance(handle, TrainingStepHandle)
        assert averagers[1].step() is not None  # no lock: local = averaged
        assert handle.result() is not None
        assert lock.acquired == 2
    assert torch.equal(b, torch.full((4,), 0.5))
    assert torch.equal(a, torch.full((4,), 10.5))  # the mean, plus the step taken meanwhile


def test_state_sharing_without_pickle() -> None:
    torch.manual_seed(0)
    x1, x2 = torch.randn(5, requires_grad=True), torch.zeros(5, requires_grad=True)
    extra1, extra2 = torch.randn(2), torch.zeros(2)
    opt1, opt2 = torch.optim.Adam([x1], lr=0.1), torch.optim.Adam([x2], lr=0.1)
    (x1**2).sum().backward()
    opt1.step()
    with swarm(2) as dhts, ExitStack() as stack:
        donor = stack.enter_context(
            TrainingAverager(
                opt1,
                average_parameters=True,
                average_gradients=False,
                extra_tensors=[extra1],
                dht=dhts[0],
                prefix="s",
                target_group_size=2,
                **FAST,  # type: ignore[arg-type]
            )
        )
        donor.local_step = 7
        taker = stack.enter_context(
            TrainingAverager(
                opt2,
                average_parameters=True,
                average_gradients=False,
                extra_tensors=[extra2],
                dht=dhts[1],
                prefix="s",
                target_group_size=2,
                **FAST,  # type: ignore[arg-type]
            )
        )
        assert taker.load_state_from_peers(timeout=30)
        assert torch.equal(x2, x1)
        assert torch.equal(extra2, extra1)
        assert torch.equal(opt2.state[x2]["exp_avg_sq"], opt1.state[x1]["exp_avg_sq"])
        assert int(opt2.state[x2]["step"]) == int(opt1.state[x1]["step"]) == 1
        assert taker.local_step == 7


def test_a_failed_round_is_counted_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    x = torch.zeros(3, requires_grad=True)
    with swarm(1) as dhts:
        averager = TrainingAverager(
            torch.optim.SGD([x], lr=0.1),
            average_parameters=True,
            average_gradients=False,
            dht=dhts[0],
            prefix="alone",
            target_group_size=2,
            **FAST,  # type: ignore[arg-type]
        )
        try:
            with caplog.at_level(logging.WARNING, logger="swarmavg.optim.training_averager"):
                assert averager.step(timeout=0.5) is None
            assert averager.rounds_failed == 1
            assert averager.local_step == 1
            assert averager.last_round is not None
            assert not averager.last_round.succeeded
            assert averager.last_round.error
            assert any("averaging round failed" in r.getMessage() for r in caplog.records)
        finally:
            averager.shutdown()
            averager.shutdown()  # idempotent
        with pytest.raises(RuntimeError, match="shut down"):
            averager.step()


def test_bad_arguments_are_named() -> None:
    x = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([x], lr=0.1)
    with swarm(1) as dhts:
        with pytest.raises(TypeError, match="opt"):
            TrainingAverager(
                [x],  # type: ignore[arg-type]
                average_parameters=True,
                average_gradients=False,
                dht=dhts[0],
                prefix="b",
            )
        with pytest.raises(TypeError, match="average_parameters"):
            TrainingAverager(
                opt,
                average_parameters=1,  # type: ignore[arg-type]
                average_gradients=False,
                dht=dhts[0],
                prefix="b",
            )
        with pytest.raises(ValueError, match="exp_avg_sq"):
            TrainingAverager(
                opt,
                average_parameters=True,
                average_gradients=False,
                average_opt_statistics=("exp_avg_sq",),
                dht=dhts[0],
                prefix="b",
            )
        with pytest.raises(TypeError, match="tensor_infos"):
            TrainingAverager(
                opt,
                average_parameters=True,
                average_gradients=False,
                dht=dhts[0],
                prefix="b",
                tensor_infos=[],
            )


def test_initialize_optimizer_does_not_move_parameters_with_weight_decay() -> None:
    x = torch.ones(3, requires_grad=True)
    opt = torch.optim.AdamW([x], lr=0.1, weight_decay=0.5)
    with swarm(1) as dhts:
        averager = TrainingAverager(
            opt,
            average_parameters=True,
            average_gradients=False,
            average_opt_statistics=("exp_avg_sq",),
            dht=dhts[0],
            prefix="i",
            target_group_size=2,
            start=False,
        )
        try:
            assert torch.equal(x, torch.ones(3))
            assert x.grad is None
            assert int(opt.state[x]["step"]) == 0
        finally:
            averager.shutdown()
