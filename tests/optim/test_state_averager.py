"""``swarmavg.optim.TrainingStateAverager``: peers over TCP on 127.0.0.1 in one process (hivemind's
``test_state_averager`` and ``test_load_state_from_peers``, and the fixes of the spec's A.4)."""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from typing import Any

import msgpack
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from swarmavg import DHT
from swarmavg.optim.state_averager import (
    TrainingStateAverager,
    _check_optimizer_state,
    _decode_tree,
    _encode_tree,
    _initialize_optimizer_state,
    _Refused,
)
from swarmavg.proto.dht_validation import owner_marker

pytestmark = pytest.mark.timeout(120)


def _lambda_lr(factor: Callable[[int], float]) -> Callable[[torch.optim.Optimizer], Any]:
    return partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=factor)


def _dhts(stack: ExitStack, count: int) -> list[DHT]:
    first = stack.enter_context(DHT())
    return [first] + [
        stack.enter_context(DHT(first.get_visible_maddrs())) for _ in range(count - 1)
    ]


def _wait_declared(dht: DHT, prefix: str, *peers: Any) -> None:
    """Until ``peers`` declared their state under ``prefix`` (bounded)."""
    deadline = time.monotonic() + 20
    while True:
        found = dht.get(f"{prefix}.state", latest=True)
        if found is not None and all(
            isinstance(found.value.get(owner_marker(p), (None,))[0], dict) for p in peers
        ):
            return
        assert time.monotonic() < deadline, found
        time.sleep(0.05)


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("offload_optimizer", "reuse_tensors", "sync_epoch_when_averaging"),
    [
        (False, False, False),
        (True, True, False),
        (True, False, False),
        (False, True, True),
        (True, False, True),
    ],
)
def test_state_averager(
    offload_optimizer: bool, reuse_tensors: bool, sync_epoch_when_averaging: bool
) -> None:
    torch.manual_seed(1337)
    model1, model2 = nn.Linear(2, 3), nn.Linear(2, 3)
    extras1 = (torch.randn(2, 2), -torch.rand(1))
    extras2 = (-torch.randn(2, 2), torch.rand(1))
    common: dict[str, Any] = {
        "optimizer": partial(torch.optim.Adam, lr=0.1, betas=(0.9, 0.9)),
        "scheduler": _lambda_lr(lambda t: 1.0 / max(1, t)),
        "sync_epoch_when_averaging": sync_epoch_when_averaging,
        "average_opt_statistics": ("exp_avg_sq",),
        "offload_optimizer": offload_optimizer,
        "reuse_tensors": reuse_tensors,
        "target_group_size": 2,
        "prefix": "my_exp",
    }
    with ExitStack() as stack:
        dht1, dht2 = _dhts(stack, 2)
        avgr1 = stack.enter_context(
            TrainingStateAverager(
                dht=dht1, params=model1.parameters(), extra_tensors=extras1, **common
            )
        )
        avgr2 = stack.enter_context(
            TrainingStateAverager(
                dht=dht2, params=model2.parameters(), extra_tensors=extras2, **common
            )
        )
        x = torch.ones(2)
        for step in range(20):
            F.mse_loss(model1(x), torch.ones(3)).mul(2).backward()
            avgr1.step(
                optimizer_step=True,
                zero_grad=True,
                averaging_round=(step == 10),
                delay_averaging=True,
            )
            F.mse_loss(model2(x), -torch.ones(3)).backward()
            avgr2.step(
                optimizer_step=True,
                zero_grad=True,
                averaging_round=(step == 10),
                delay_averaging=False,
            )

        assert model1.weight.grad is None, "zero_grad did not run"
        assert model2.weight.grad is None
        assert model1(x).mean() > 0.5, "the models did not train"
        assert model2(x).mean() < -0.5
        assert torch.allclose(extras1[0], extras2[0]), "the extra tensors were not averaged"
        assert torch.allclose(extras1[1], extras2[1])
        stats1 = avgr1.optimizer.state_dict()["state"][0]["exp_avg_sq"].clone()
        stats2 = avgr2.optimizer.state_dict()["state"][0]["exp_avg_sq"].clone()
        assert not torch.allclose(stats1, stats2)

        avgr1.step(increment_epoch=True)
        avgr1.step(increment_epoch=True, averaging_round=True, delay_averaging=True)
        avgr2.step(increment_epoch=True, averaging_round=True, delay_averaging=True)
        avgr1.step(wait_for_delayed_updates=True)
        avgr2.step(wait_for_delayed_updates=True)

        assert torch.allclose(model1(x), model2(x)), "the parameters were not averaged"
        average = (stats1 + stats2) / 2
        assert torch.allclose(avgr1.optimizer.state_dict()["state"][0]["exp_avg_sq"], average)
        assert torch.allclose(avgr2.optimizer.state_dict()["state"][0]["exp_avg_sq"], average)
        assert avgr1.local_epoch == 2
        assert avgr2.local_epoch == (2 if sync_epoch_when_averaging else 1)
        if sync_epoch_when_averaging:  # the scheduler followed the epoch taken from the group
            assert avgr2.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 2)


@pytest.mark.parametrize(
    ("scheduler", "expected"),
    [
        (_lambda_lr(lambda t: 1.0 / (1 + t)), lambda epoch: 0.1 / (1 + epoch)),
        (
            partial(torch.optim.lr_scheduler.StepLR, step_size=10**8, gamma=0.5),
            lambda epoch: 0.1 * 0.5 ** (epoch // 10**8),
        ),
    ],
)
def test_an_epoch_far_ahead_makes_the_scheduler_jump_not_loop(
    scheduler: Any, expected: Callable[[int], float], caplog: pytest.LogCaptureFixture
) -> None:
    """A downloaded state may say epoch 10**9 (a peer's word): stepping the scheduler there one
    epoch at a time would take hours; it jumps (torch's closed form), with a WARNING."""
    model = nn.Linear(2, 3)
    with ExitStack() as stack:
        (dht,) = _dhts(stack, 1)
        averager = stack.enter_context(
            TrainingStateAverager(
                dht=dht,
                params=model.parameters(),
                optimizer=partial(torch.optim.SGD, lr=0.1),
                scheduler=scheduler,
                target_group_size=2,
                prefix="far",
            )
        )
        epoch = 10**9 + 7
        averager.local_epoch = epoch
        started = time.monotonic()
        with caplog.at_level(logging.WARNING), averager.lock_optimizer:
            averager._update_scheduler()
        assert time.monotonic() - started < 5  # (step by step: hours)
        assert averager.optimizer.param_groups[0]["lr"] == pytest.approx(expected(epoch))
        assert any("jumps" in r.getMessage() for r in caplog.records)
        with averager.lock_optimizer:  # and from there, one step per epoch again
            averager.local_epoch = epoch + 1
            averager._update_scheduler()
        assert averager.optimizer.param_groups[0]["lr"] == pytest.approx(expected(epoch + 1))


def test_load_state_from_peers() -> None:
    model1, model2 = nn.Linear(2, 3), nn.Linear(2, 3)
    common: dict[str, Any] = {
        "optimizer": partial(torch.optim.SGD, lr=0.1),
        "scheduler": _lambda_lr(lambda t: 1.0 / max(1, t)),
        "target_group_size": 2,
        "prefix": "my_exp",
    }
    with ExitStack() as stack:
        dht1, dht2 = _dhts(stack, 2)
        avgr1 = stack.enter_context(
            TrainingStateAverager(
                dht=dht1, params=model1.parameters(), allow_state_sharing=False, **common
            )
        )
        avgr2 = stack.enter_context(
            TrainingStateAverager(dht=dht2, params=model2.parameters(), **common)
        )
        avgr2.local_epoch = 1337
        with torch.no_grad():
            model2.weight[...] = 42
        _wait_declared(dht1, "my_exp", dht2.peer_id)

        assert avgr1.load_state_from_peers(timeout=20) is True
        assert avgr1.local_epoch == 1337
        assert torch.all(model1.weight == 42).item()
        assert avgr1.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 1337)

        # nobody shares: False, not an error
        avgr2.allow_state_sharing = False
        deadline = time.monotonic() + 20
        while avgr1.load_state_from_peers(timeout=20):
            assert time.monotonic() < deadline
            time.sleep(0.05)


@pytest.mark.parametrize(
    "scheduler",
    [
        partial(torch.optim.lr_scheduler.ExponentialLR, gamma=0.9),
        partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5),
    ],
    ids=["ExponentialLR", "StepLR"],
)
def test_a_loaded_state_leaves_the_learning_rate_of_its_epoch(scheduler: Any) -> None:
    """A peer at epoch 1 loads a donor's state at epoch 3: its rate is lr(3), as the donor's,
    also with a scheduler that multiplies the current rate (the donor's rate stepped again
    from epoch 1 would be lr(5))."""
    common: dict[str, Any] = {
        "optimizer": partial(torch.optim.SGD, lr=0.1),
        "scheduler": scheduler,
        "prefix": "rates",
    }
    with ExitStack() as stack:
        dht1, dht2 = _dhts(stack, 2)
        receiver = stack.enter_context(
            TrainingStateAverager(
                dht=dht1, params=nn.Linear(2, 3).parameters(), allow_state_sharing=False, **common
            )
        )
        donor = stack.enter_context(
            TrainingStateAverager(dht=dht2, params=nn.Linear(2, 3).parameters(), **common)
        )
        for averager, epoch in ((receiver, 1), (donor, 3)):
            with averager.lock_optimizer:
                averager.local_epoch = epoch
                averager._update_scheduler()
        expected = donor.optimizer.param_groups[0]["lr"]
        assert expected < receiver.optimizer.param_groups[0]["lr"]
        _wait_declared(dht1, "rates", dht2.peer_id)

        assert receiver.load_state_from_peers(timeout=20) is True
        assert receiver.local_epoch == 3
        assert receiver.optimizer.param_groups[0]["lr"] == pytest.approx(expected)
        with receiver.lock_optimizer:  # and one step per epoch from there
            receiver.local_epoch = 4
            receiver._update_scheduler()
        with donor.lock_optimizer:
            donor.local_epoch = 4
            donor._update_scheduler()
        assert receiver.optimizer.param_groups[0]["lr"] == pytest.approx(
            donor.optimizer.param_groups[0]["lr"]
        )


def test_loading_with_offloading_writes_the_offloaded_parameters_too() -> None:
    """hivemind PR #417's regression: the old offloaded parameters must not overwrite the loaded
    ones at the next optimizer step."""
    receiver_model, donor_model = nn.Linear(2, 3), nn.Linear(2, 3)
    common: dict[str, Any] = {"optimizer": partial(torch.optim.SGD, lr=0.1), "prefix": "offload"}
    with ExitStack() as stack:
        dht1, dht2 = _dhts(stack, 2)
        receiver = stack.enter_context(
            TrainingStateAverager(
                dht=dht1,
                params=receiver_model.parameters(),
                offload_optimizer=True,
                allow_state_sharing=False,
                **common,
            )
        )
        stack.enter_context(
            TrainingStateAverager(dht=dht2, params=donor_model.parameters(), **common)
        )
        with torch.no_grad():
            donor_model.weight[...] = 42
            donor_model.bias[...] = -1
        _wait_declared(dht1, "offload", dht2.peer_id)

        assert receiver.load_state_from_peers(timeout=20)
        offloaded = receiver.optimizer.param_groups[0]["params"]
        assert torch.all(receiver_model.weight == 42)
        assert torch.all(offloaded[0] == 42)
        assert torch.all(receiver_model.bias == -1)
        assert torch.all(offloaded[1] == -1)
        for param in receiver_model.parameters():
            param.grad = torch.zeros_like(param)
        receiver.step(optimizer_step=True)
        assert torch.all(receiver_model.weight == 42), "stale offloaded parameters came back"
        assert torch.all(receiver_model.bias == -1)


def test_a_peer_refuses_an_older_state_or_one_that_does_not_fit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The donor is at epoch 3 with SGD(momentum) over Linear(2, 3): a peer at epoch 5 refuses
    it (an older epoch), so does one with Linear(3, 3) (hivemind's IndexError, #453/#504) and
    one with Adam (another optimizer's state); each says why and keeps its own state."""
    sgd = partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    with ExitStack() as stack:
        dhts = _dhts(stack, 4)
        donor_model = nn.Linear(2, 3)
        donor = stack.enter_context(
            TrainingStateAverager(
                dht=dhts[0], params=donor_model.parameters(), optimizer=sgd, prefix="refuse"
            )
        )
        donor.local_epoch = 3
        models = [nn.Linear(2, 3), nn.Linear(3, 3), nn.Linear(2, 3)]
        optimizers: list[Any] = [sgd, sgd, partial(torch.optim.Adam, lr=0.1)]
        receivers = [
            stack.enter_context(
                TrainingStateAverager(
                    dht=dht,
                    params=model.parameters(),
                    optimizer=optimizer,
                    allow_state_sharing=False,
                    prefix="refuse",
                )
            )
            for dht, model, optimizer in zip(dhts[1:], models, optimizers, strict=True)
        ]
        receivers[0].local_epoch = 5
        before = [[p.detach().clone() for p in model.parameters()] for model in models]
        _wait_declared(dhts[1], "refuse", dhts[0].peer_id)

        reasons = ["behind ours", "has shape (3, 2), ours (3, 3)", "optimizer state lacks"]
        for receiver, model, kept, reason in zip(receivers, models, before, reasons, strict=True):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="swarmavg.optim.state_averager"):
                assert receiver.load_state_from_peers(timeout=20) is False
            refusals = [r for r in caplog.records if r.levelno == logging.WARNING]
            assert any(reason in r.getMessage() for r in refusals), refusals
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), kept, strict=True))
        assert receivers[0].local_epoch == 5
        assert receivers[1].local_epoch == 0
        # (Trust I's F2: a donor's epoch is its word: past what the run's records support, the
        # caller's max_epoch, it is refused; at it, taken)
        taker = receivers[0]
        taker.local_epoch = 0
        for max_epoch, taken in ((2, False), (3, True)):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="swarmavg.optim.state_averager"):
                assert taker.load_state_from_peers(timeout=20, max_epoch=max_epoch) is taken
            if not taken:
                message = "its epoch 3 is past what the run's progress records support (2)"
                assert any(message in r.getMessage() for r in caplog.records), caplog.records
        assert taker.local_epoch == 3


def test_the_delta_rule_keeps_local_steps_taken_during_the_round() -> None:
    own = torch.zeros(4, requires_grad=True)
    other = torch.full((4,), 2.0, requires_grad=True)
    with ExitStack() as stack:
        dht1, dht2 = _dhts(stack, 2)
        common: dict[str, Any] = {
            "optimizer": partial(torch.optim.SGD, lr=1.0),
            "prefix": "delta",
            "target_group_size": 2,
        }
        mine = stack.enter_context(
            TrainingStateAverager(dht=dht1, params=[own], delta_rule_averaging=True, **common)
        )
        theirs = stack.enter_context(TrainingStateAverager(dht=dht2, params=[other], **common))

        mine.step(averaging_round=True, delay_averaging=True)
        _until(lambda: mine.delay_before_averaging.num_updates == 1)  # (the round took 0s)
        own.grad = torch.ones(4)
        mine.step(optimizer_step=True, wait_for_delayed_updates=False)  # during the round
        assert torch.equal(own.detach(), torch.full((4,), -1.0))
        assert mine.averaging_in_progress  # (the other peer has not joined yet)
        theirs.step(averaging_round=True)
        mine.step(wait_for_delayed_updates=True)

        assert torch.equal(other.detach(), torch.full((4,), 1.0))  # (0 + 2) / 2
        assert torch.equal(own.detach(), torch.full((4,), 0.0))  # the mean, then the local step


def test_the_scheduler_follows_the_epoch_without_warnings() -> None:
    """During epoch e the learning rate is lr(e); the optimizer step that ends an epoch runs with
    that epoch's rate (the warning torch gives a scheduler stepped before its optimizer would
    fail this test: warnings are errors)."""
    param = torch.zeros(1, requires_grad=True)
    with ExitStack() as stack:
        (dht,) = _dhts(stack, 1)
        averager = stack.enter_context(
            TrainingStateAverager(
                dht=dht,
                optimizer=partial(torch.optim.SGD, lr=0.1),
                params=[param],
                scheduler=_lambda_lr(lambda t: 0.5**t),
                prefix="lr",
            )
        )
        assert averager.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
        averager.step(increment_epoch=True)
        assert averager.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
        param.grad = torch.ones(1)
        averager.step(increment_epoch=True, optimizer_step=True)
        assert param.item() == pytest.approx(-0.05)  # epoch 1's rate
        assert averager.local_epoch == 2
        assert averager.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


def test_the_optimizer_state_is_created_without_a_step() -> None:
    """hivemind took one real step with zero gradients: weight decay shrank the weights and
    Adam's bias correction started at step 1. Here the parameters and step counters stay."""
    torch.manual_seed(0)
    start = torch.randn(5)
    grads = [torch.randn(5) for _ in range(3)]
    factories: list[Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = [
        partial(torch.optim.AdamW, lr=0.1, weight_decay=0.5),
        partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.5),
        partial(torch.optim.Adam, lr=0.1, weight_decay=0.1, amsgrad=True),
    ]
    for factory in factories:
        ours, plain = start.clone().requires_grad_(), start.clone().requires_grad_()
        initialized, reference = factory([ours]), factory([plain])
        _initialize_optimizer_state(initialized)
        assert torch.equal(ours.detach(), start)
        assert ours.grad is None
        state = initialized.state[ours]
        assert state, "no state was created"
        assert all(
            float(value) == 0 if key == "step" else bool((value == 0).all())
            for key, value in state.items()
        ), state
        for grad in grads:  # then it trains exactly as a fresh optimizer
            ours.grad, plain.grad = grad.clone(), grad.clone()
            initialized.step()
            reference.step()
        assert torch.equal(ours.detach(), plain.detach()), factory


def test_the_state_is_shared_without_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pickle was used")

    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "save", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    torch.manual_seed(2)
    donor_model, receiver_model = nn.Linear(3, 2), nn.Linear(3, 2)
    adam = partial(torch.optim.Adam, lr=0.01, betas=(0.8, 0.95))
    with ExitStack() as stack:
        dht1, dht2 = _dhts(stack, 2)
        extra = torch.arange(4.0)
        donor = stack.enter_context(
            TrainingStateAverager(
                dht=dht1,
                params=donor_model.parameters(),
                optimizer=adam,
                extra_tensors=[extra],
                average_opt_statistics=("exp_avg",),
                prefix="nopickle",
            )
        )
        receiver = stack.enter_context(
            TrainingStateAverager(
                dht=dht2,
                params=receiver_model.parameters(),
                optimizer=adam,
                extra_tensors=[torch.zeros(4)],
                average_opt_statistics=("exp_avg",),
                allow_state_sharing=False,
                prefix="nopickle",
            )
        )
        for _ in range(3):
            donor_model(torch.ones(3)).sum().backward()
            donor.step(optimizer_step=True, zero_grad=True, increment_epoch=True)
        metadata, tensors, infos = donor.get_current_state()
        assert msgpack.unpackb(msgpack.packb(metadata), strict_map_key=False) == metadata
        assert [i.role for i in infos] == ["parameter"] * 2 + ["unspecified"] + ["optimizer"] * (
            len(tensors) - 3
        )
        averaged_before = receiver.optimizer.state[receiver_model.weight]["exp_avg"]
        _wait_declared(dht2, "nopickle", dht1.peer_id)

        assert receiver.load_state_from_peers(timeout=20)
        assert receiver.local_epoch == 3
        assert torch.equal(receiver.extra_tensors[0], extra)
        for mine, theirs in zip(receiver_model.parameters(), donor_model.parameters(), strict=True):
            assert torch.equal(mine, theirs)
            assert torch.equal(
                receiver.optimizer.state[mine]["exp_avg_sq"],
                donor.optimizer.state[theirs]["exp_avg_sq"],
            )
            assert float(receiver.optimizer.state[mine]["step"]) == 3
        assert receiver.optimizer.param_groups[0]["betas"] == (0.8, 0.95)
        # the averaged statistic is still the tensor the averager knows
        assert receiver.optimizer.state[receiver_model.weight]["exp_avg"] is averaged_before
        with receiver.get_tensors() as averaged:
            assert torch.equal(averaged[2], donor.optimizer.state[donor_model.weight]["exp_avg"])


def test_malformed_optimizer_metadata_is_refused() -> None:
    """What a donor sends is checked before anything changes: a bad tree or a state that does
    not fit raises ``_Refused`` (a clear reason), never IndexError or KeyError."""
    param = torch.zeros(2, 2, requires_grad=True)
    optimizer = torch.optim.Adam([param], lr=0.1)
    _initialize_optimizer_state(optimizer)
    tensors: list[torch.Tensor] = []
    good = _encode_tree(optimizer.state_dict(), tensors)
    assert _check_optimizer_state(optimizer, _decode_tree(good, list(tensors)), ()) is None

    bad_trees = [
        ["T", len(tensors)],  # a tensor that was not sent
        ["T", -1],
        ["X", []],
        ["D", [1]],  # an odd key/value list
        ["D", [["L", []], 1]],  # a key that is not a scalar
        {"a": 1},  # (maps are not in the encoding)
        ["L", [["T", 0], ["T", 0]]],  # a tensor used twice
    ]
    deep: Any = 0
    for _ in range(40):
        deep = ["L", [deep]]
    for tree in [*bad_trees, deep]:
        with pytest.raises(_Refused):
            _decode_tree(tree, list(tensors))
    with pytest.raises(_Refused, match="not in its metadata"):
        _decode_tree(good, [*tensors, torch.zeros(1)])

    def refused(edit: Callable[[dict[str, Any]], None], match: str) -> None:
        state = _decode_tree(good, [t.clone() for t in tensors])
        edit(state)
        with pytest.raises(_Refused, match=match):
            _check_optimizer_state(optimizer, state, ("exp_avg",))

    refused(lambda s: s["param_groups"].append(dict(s["param_groups"][0])), "param groups")
    refused(lambda s: s["param_groups"][0]["params"].append(7), "parameters")
    refused(lambda s: s["param_groups"][0].update(lr="fast"), "'lr'")
    refused(lambda s: s["param_groups"][0].update(lr=float("nan")), "non-finite 'lr'")
    refused(lambda s: s["param_groups"][0].update(lr=float("inf")), "non-finite 'lr'")
    refused(lambda s: s["param_groups"][0].update(betas=(float("nan"), 0.9)), "'betas'")
    refused(lambda s: s["state"].update({9: {}}), "unknown parameter")
    refused(lambda s: s["state"][0].update(exp_avg=torch.zeros(3)), "shape")
    refused(lambda s: s["state"][0].update(exp_avg=torch.full((2, 2), float("nan"))), "NaN")
    refused(lambda s: s["state"][0].update(step=1), "is a number, ours a tensor")
    refused(lambda s: s["state"][0].pop("exp_avg_sq"), "lacks")
    refused(lambda s: s["state"].clear(), "no 'exp_avg'")


def test_arguments_are_checked_and_shutdown_is_idempotent() -> None:
    model = nn.Linear(2, 2)
    with ExitStack() as stack:
        (dht,) = _dhts(stack, 1)
        sgd = partial(torch.optim.SGD, lr=0.1)
        make = partial(TrainingStateAverager, dht=dht, prefix="args")
        with pytest.raises(ValueError, match="mutually exclusive"):
            make(
                optimizer=sgd,
                params=model.parameters(),
                reuse_tensors=True,
                delta_rule_averaging=True,
            )
        with pytest.raises(ValueError, match="offload_optimizer=True needs an optimizer factory"):
            make(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), offload_optimizer=True)
        with pytest.raises(ValueError, match="params is required"):
            make(optimizer=sgd)
        bound = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), 1)
        with pytest.raises(ValueError, match="scheduler must be one too"):
            make(optimizer=sgd, params=model.parameters(), scheduler=bound)
        with pytest.raises(ValueError, match="no such tensor"):
            make(optimizer=sgd, params=model.parameters(), average_opt_statistics=("exp_avg",))
        with pytest.raises(TypeError, match="tensor_infos"):
            make(optimizer=sgd, params=model.parameters(), tensor_infos=[])

        averager = make(optimizer=sgd, params=model.parameters())
        with pytest.raises(ValueError, match="delay_optimizer_step=True needs offload"):
            averager.step(optimizer_step=True, delay_optimizer_step=True)
        with pytest.raises(ValueError, match="averaging_control"):
            averager.step(averaging_control=averager.schedule_step())
        with pytest.raises(ValueError, match="wait_for_trigger needs reuse_tensors"):
            averager.step(optimizer_step=True, wait_for_trigger=lambda: None)
        with pytest.raises(ValueError, match="averaging_opts takes"):
            averager.step(averaging_round=True, averaging_opts={"weight": 2.0})
        with pytest.raises(ValueError, match="no weight"):
            averager.schedule_step(weight=2.0)
        averager.shutdown()
        averager.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            averager.step(optimizer_step=True)


class _Scaler:
    """A GradScaler's protocol as the averager uses it (``step(optimizer)``)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls.append("step")
        optimizer.step()

    def update(self) -> None:
        self.calls.append("update")


def test_offloaded_delayed_and_triggered_steps(caplog: pytest.LogCaptureFixture) -> None:
    """With offloading and custom gradients, the step waits for ``wait_for_trigger`` (which
    fills the offloaded gradients), may run in the background (``delay_optimizer_step``: the
    model gets the result at a later call) and goes through a grad scaler; a trigger that
    raises cancels the step."""
    param = torch.zeros(3, requires_grad=True)
    with ExitStack() as stack:
        (dht,) = _dhts(stack, 1)
        averager = stack.enter_context(
            TrainingStateAverager(
                dht=dht,
                optimizer=partial(torch.optim.SGD, lr=1.0),
                params=[param],
                offload_optimizer=True,
                custom_gradients=True,
                prefix="trigger",
            )
        )
        (offloaded,) = averager.optimizer.param_groups[0]["params"]
        assert offloaded is not param
        assert offloaded.grad is not None
        buffer = offloaded.grad

        def fill() -> None:
            buffer.fill_(2.0)

        scaler = _Scaler()
        averager.step(optimizer_step=True, wait_for_trigger=fill, grad_scaler=scaler)
        assert torch.equal(param.detach(), torch.full((3,), -2.0))
        assert scaler.calls == ["step"]

        averager.step(
            optimizer_step=True, zero_grad=True, delay_optimizer_step=True, delay_averaging=True
        )
        averager.step(wait_for_delayed_updates=True)
        assert torch.equal(param.detach(), torch.full((3,), -4.0))
        assert offloaded.grad is buffer
        assert torch.equal(buffer, torch.zeros(3))

        def fail() -> None:
            raise OSError("no gradients today")

        buffer.fill_(1.0)
        with caplog.at_level(logging.WARNING, logger="swarmavg.optim.state_averager"):
            averager.step(optimizer_step=True, wait_for_trigger=fail)
        assert "no gradients today" in caplog.text
        assert torch.equal(param.detach(), torch.full((3,), -4.0))


def test_a_pre_scheduled_round_is_used() -> None:
    tensors = [torch.zeros(2, requires_grad=True), torch.full((2,), 4.0, requires_grad=True)]
    with ExitStack() as stack:
        dhts = _dhts(stack, 2)
        averagers = [
            stack.enter_context(
                TrainingStateAverager(
                    dht=dht,
                    optimizer=partial(torch.optim.SGD, lr=0.1),
                    params=[tensor],
                    prefix="scheduled",
                    target_group_size=2,
                )
            )
            for dht, tensor in zip(dhts, tensors, strict=True)
        ]
        control = averagers[0].schedule_step(gather=7, timeout=30)
        assert control.require_trigger
        averagers[0].step(averaging_round=True, averaging_control=control, delay_averaging=True)
        result = averagers[1].step(averaging_round=True)
        averagers[0].step(wait_for_delayed_updates=True)
        assert control.done()
        assert control.result().group_size == 2
        assert result is not None
        assert sorted(result.values()) == [0, 7]
        assert all(torch.equal(t.detach(), torch.full((2,), 2.0)) for t in tensors)


def test_delayed_steps_are_waited_for_without_their_rounds() -> None:
    """``wait_for_delayed_optimizer_steps`` returns once the background optimizer step is over
    while its round still looks for a group (swarmavg.Optimizer's next gradient round must not
    wait for the previous state round: a cycle when rounds of two epochs share a group); with
    ``reuse_tensors`` a round may be queued behind the pending one, without it that raises."""
    param = torch.zeros(3, requires_grad=True)
    with ExitStack() as stack:
        (dht,) = _dhts(stack, 1)
        averager = stack.enter_context(
            TrainingStateAverager(
                dht=dht,
                optimizer=partial(torch.optim.SGD, lr=1.0),
                params=[param],
                offload_optimizer=True,
                custom_gradients=True,
                prefix="no_cycle",
                target_group_size=2,
                min_group_size=2,
                averaging_expiration=60.0,
            )
        )
        assert averager.reuse_tensors
        (offloaded,) = averager.optimizer.param_groups[0]["params"]
        assert offloaded.grad is not None
        offloaded.grad.fill_(1.0)
        options = {
            "optimizer_step": True,
            "delay_optimizer_step": True,
            "averaging_round": True,
            "delay_averaging": True,
            "averaging_opts": {"timeout": 60.0},
        }
        averager.step(increment_epoch=True, **options)  # (alone: the round waits for a peer)
        averager.wait_for_delayed_optimizer_steps()
        assert torch.equal(param.detach(), torch.full((3,), -1.0))  # stepped and applied
        assert averager.averaging_pending
        # the next epoch's round is queued behind it (no wait, no error)
        averager.step(increment_epoch=True, wait_for_delayed_updates=False, **options)
        assert averager.local_epoch == 2
        assert averager.averaging_pending


def test_a_round_without_reuse_tensors_waits_for_the_previous_one() -> None:
    with ExitStack() as stack:
        (dht,) = _dhts(stack, 1)
        averager = stack.enter_context(
            TrainingStateAverager(
                dht=dht,
                optimizer=partial(torch.optim.SGD, lr=1.0),
                params=[torch.zeros(3, requires_grad=True)],
                prefix="must_wait",
            )
        )
        assert not averager.reuse_tensors
        with pytest.raises(ValueError, match="wait_for_delayed_updates unless reuse_tensors"):
            averager.step(averaging_round=True, wait_for_delayed_updates=False)
        with pytest.raises(ValueError, match="needs apply_delayed_updates"):
            averager.step(averaging_round=True, apply_delayed_updates=False)
