"""``swarmavg.optim.DiLoCo``: the sign of Δ, the single-process reference loop, synchronous
averaging with H=1, and every peer holding the same θ_global and outer state after a join, a
leave and a failed round (spec E.3).

Peers run in threads of one process, each with its own :class:`swarmavg.DHT` over TCP on
127.0.0.1.
"""

from __future__ import annotations

import copy
import io
import threading
import time
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from optim_helpers import FAST, run_threads, swarm

import swarmavg.optim
from swarmavg import DHT
from swarmavg.compression import Float16Compression, Uniform8BitQuantization
from swarmavg.metrics import DiLoCoMetrics
from swarmavg.optim import DiLoCo

pytestmark = pytest.mark.timeout(120)

TRACKER = {"min_refresh_period": 0.05, "default_refresh_period": 0.1, "max_refresh_period": 0.2}


def _sgd(lr: float) -> Any:
    return partial(torch.optim.SGD, lr=lr)


def _flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().flatten().float().cpu() for t in tensors])


def _outer_state(diloco: DiLoCo) -> list[torch.Tensor]:
    """The outer optimizer's tensors, in parameter order."""
    state = diloco.outer_optimizer.state
    return [state[p][name].clone() for p in diloco.params for name in sorted(state.get(p, {}))]


def _wait_for_peers(diloco: DiLoCo, count: int, timeout: float = 30) -> None:
    """Until this peer's progress records show ``count`` peers (bounded). A peer publishes its
    record with its first inner step; with H=1 that step is already a round, so the record is
    published here first."""
    diloco.tracker.report_local_progress(diloco.outer_epoch, 1)
    deadline = time.monotonic() + timeout
    fetched = diloco.tracker.fetched_global_progress_this_epoch
    while diloco.tracker.global_progress.num_peers < count:  # (woken by each fetch)
        remaining = deadline - time.monotonic()
        assert remaining > 0, "the peers did not see each other"
        fetched.clear()
        if diloco.tracker.global_progress.num_peers < count:
            fetched.wait(min(remaining, 1.0))


# -- one peer ------------------------------------------------------------------------------------


def test_public_name_is_lazy() -> None:
    assert swarmavg.optim.DiLoCo is DiLoCo


def test_pseudo_gradient_sign_is_backup_minus_local() -> None:
    """torchft's test_gradient_correctness: parameters +2 after the backup, an all-reduce that
    doubles (here: two peers with Δ = −2 and Δ = −6 averaging to −4): the outer step sees
    grad = −4, and steps from θ_global."""
    seen: list[torch.Tensor] = []
    with swarm(1) as (dht,):
        param = torch.nn.Parameter(torch.zeros(3))
        inner = torch.optim.SGD([param], lr=1.0)

        def outer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
            opt = torch.optim.SGD(params, lr=0.5)
            opt.register_step_pre_hook(
                lambda o, *_: seen.extend(p.grad.clone() for p in o.param_groups[0]["params"])
            )
            return opt

        with DiLoCo(
            [param],
            inner_optimizer=inner,
            outer_optimizer=outer,
            dht=dht,
            run_id="sign",
            sync_every=1,
            averager_opts=FAST,
        ) as diloco:
            param.grad = torch.full((3,), -2.0)  # an inner step: θ_local = θ_global + 2
            inner.step()
            assert diloco.last_round is not None
            assert diloco.last_round.outcome == "alone"
            torch.testing.assert_close(seen[0], torch.full((3,), -2.0))  # Δ = 0 − 2
            # θ_global' = θ_global − lr·Δ = 0 − 0.5·(−2) = 1, the new backup
            torch.testing.assert_close(param.detach(), torch.full((3,), 1.0))
            torch.testing.assert_close(diloco.backup[0], torch.full((3,), 1.0))
            assert param.grad is not None  # the user's gradient is given back
            torch.testing.assert_close(param.grad, torch.full((3,), -2.0))


def _reference_loop(
    model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], sync_every: int
) -> None:
    """OpenDiLoCo's ``train_diloco_torch.py`` loop with world size 1 (no all-reduce)."""
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda t: 1 / (1 + 0.1 * t))
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    offloaded = [p.detach().clone() for p in model.parameters()]
    for step, (x, y) in enumerate(batches, 1):
        F.mse_loss(model(x), y).backward()
        inner.step()
        scheduler.step()
        inner.zero_grad()
        if step % sync_every == 0:
            for param, backup in zip(model.parameters(), offloaded, strict=True):
                param.grad = backup - param.data
                param.data = backup.clone()
            outer.step()
            outer.zero_grad()
            offloaded = [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("hook", [True, False])
def test_one_peer_equals_the_single_process_loop(hook: bool) -> None:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    x, y = torch.randn(26 * 4, 5), torch.randn(26 * 4, 2)
    batches = [(x[i * 4 : i * 4 + 4], y[i * 4 : i * 4 + 4]) for i in range(26)]
    _reference_loop(reference, batches, sync_every=5)
    with swarm(1) as (dht,):
        inner = torch.optim.AdamW(model.parameters(), lr=0.05)
        with DiLoCo(
            model.parameters(),
            inner_optimizer=inner,
            dht=dht,
            run_id="one",
            sync_every=5,
            scheduler=partial(
                torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda t: 1 / (1 + 0.1 * t)
            ),
            hook=hook,
            averager_opts=FAST,
        ) as diloco:
            for xb, yb in batches:
                F.mse_loss(model(xb), yb).backward()
                if hook:
                    inner.step()
                    inner.zero_grad()
                else:
                    diloco.step()
                    diloco.zero_grad()
            assert diloco.outer_epoch == 5
            assert diloco.inner_step == 1
            assert diloco.global_step == 26
            assert diloco.inner_optimizer.param_groups[0]["lr"] == pytest.approx(0.05 / 3.6)
            assert diloco.rounds_failed == 0
            metrics = diloco.metrics
            assert (metrics.outer_epoch, metrics.inner_step, metrics.global_step) == (5, 1, 26)
            assert (metrics.rounds_alone, metrics.rounds_averaged, metrics.rounds) == (5, 0, 5)
            assert metrics.averager.steps_started == 0  # (alone: no all-reduce)
            assert metrics.as_dict()["averager"]["prefix"] == "one_diloco"
    torch.testing.assert_close(
        _flat(model.parameters()), _flat(reference.parameters()), atol=1e-6, rtol=0
    )


# -- several peers -------------------------------------------------------------------------------


def _peer_batches(peer: int, count: int, dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + peer)
    x = torch.randn(count * 4, dim, generator=generator)
    y = x @ (torch.arange(1.0, dim + 1) / dim).unsqueeze(1) + 0.5 * peer
    return [(x[i * 4 : i * 4 + 4], y[i * 4 : i * 4 + 4]) for i in range(count)]


def _make(dht: DHT, model: torch.nn.Module, run_id: str, **kwargs: Any) -> DiLoCo:
    options: dict[str, Any] = {
        "inner_optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "dht": dht,
        "run_id": run_id,
        "sync_every": 1,
        "matchmaking_time": 2.0,
        "averaging_timeout": 20.0,
        "load_state_timeout": 20.0,
        "averager_opts": FAST,
        "tracker_opts": TRACKER,
    }
    options.update(kwargs)
    return DiLoCo(model.parameters(), **options)


@pytest.mark.parametrize(
    ("compression", "dim", "rounds", "atol"),
    [
        (None, 3, 6, 1e-6),
        (Float16Compression(), 3, 6, 2e-3),
        # (without error feedback 30 rounds of 8-bit Δ end 1.8e-2 away; with it 7e-3)
        (Uniform8BitQuantization(), 64, 30, 1e-2),
    ],
    ids=["fp32", "fp16", "8bit"],
)
def test_two_peers_with_h1_equal_synchronous_parameter_averaging(
    compression: Any, dim: int, rounds: int, atol: float
) -> None:
    """H=1, inner SGD, outer SGD lr 1 without momentum: θ' = θ − mean(θ − θ_i) = mean(θ_i),
    i.e. each step of synchronous parameter averaging (with fp16 Δ: to fp16's precision; with
    8-bit Δ and error feedback, on by default: within a round's quantization error, which
    does not add up over the rounds)."""
    count = 2
    torch.manual_seed(2)
    initial = torch.nn.Linear(dim, 1)
    data = [_peer_batches(peer, rounds, dim) for peer in range(count)]
    finals: dict[int, torch.Tensor] = {}
    reports: dict[int, list[Any]] = {}
    metrics: dict[int, DiLoCoMetrics] = {}
    ready = threading.Barrier(count)

    def train(peer: int, dht: DHT) -> None:
        model = copy.deepcopy(initial)
        with _make(dht, model, "h1", outer_optimizer=_sgd(1.0), compression=compression) as diloco:
            inner = diloco.inner_optimizer
            _wait_for_peers(diloco, count)
            ready.wait(30)
            for x, y in data[peer]:
                F.mse_loss(model(x), y).backward()
                inner.step()
                inner.zero_grad()
                reports.setdefault(peer, []).append(diloco.last_round)
            finals[peer] = _flat(model.parameters())
            metrics[peer] = diloco.metrics

    with swarm(count) as dhts:
        run_threads([partial(train, i, dht) for i, dht in enumerate(dhts)])

    reference = copy.deepcopy(initial)
    for step in range(rounds):
        locals_ = []
        for peer in range(count):
            local = copy.deepcopy(reference)
            x, y = data[peer][step]
            F.mse_loss(local(x), y).backward()
            with torch.no_grad():
                for p in local.parameters():
                    p -= 0.1 * p.grad  # type: ignore[operator]
            locals_.append(_flat(local.parameters()))
        mean = torch.stack(locals_).mean(0)
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(mean, reference.parameters())
    for peer in range(count):
        assert metrics[peer].rounds_averaged == rounds
        assert metrics[peer].averager.steps_succeeded == rounds
        # every round sends each member's half of Δ (2 bytes per element with fp16, else 4)
        assert metrics[peer].bytes_sent > 0
        assert [r.outcome for r in reports[peer]] == ["averaged"] * rounds
        assert all(r.group_size == count for r in reports[peer])
        torch.testing.assert_close(finals[peer], _flat(reference.parameters()), atol=atol, rtol=0)


def test_join_leave_and_failed_round_keep_one_global_state(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Three peers, H=2, the default outer optimizer (Nesterov momentum: a state to share).
    A and B start; C joins at outer epoch ≥ 2 with other initial weights and downloads the
    state; B's round at epoch 4 fails for B alone (rollback, then B downloads the state); A
    leaves at epoch 6; B and C go on to epoch 9. At every outer epoch whose rounds were one
    group, every peer that held it has the same θ_global and the same outer optimizer state; B
    and C end with the same."""
    dim, target = 4, 9
    torch.manual_seed(4)
    initial = torch.nn.Linear(dim, 1)
    snapshots: dict[str, dict[int, tuple[torch.Tensor, list[torch.Tensor]]]] = {}
    stats: dict[str, Any] = {}
    c_may_join = threading.Event()
    done = {name: threading.Event() for name in "ABC"}

    #: name -> epoch -> the size of the averaged round that brought the peer there
    arrivals: dict[str, dict[int, int]] = {}

    def record(name: str, diloco: DiLoCo) -> None:
        mine = snapshots.setdefault(name, {})
        if diloco.outer_epoch not in mine:
            mine[diloco.outer_epoch] = (_flat(diloco.backup), _outer_state(diloco))
            last = diloco.last_round
            if last and last.outcome == "averaged" and last.epoch == diloco.outer_epoch - 1:
                arrivals.setdefault(name, {})[diloco.outer_epoch] = last.group_size

    def train(name: str, dht: DHT) -> None:
        if name == "C":
            assert c_may_join.wait(60)
            model = torch.nn.Linear(dim, 1)  # other initial weights
        else:
            model = copy.deepcopy(initial)
        generator = torch.Generator().manual_seed(ord(name))
        with _make(dht, model, "churn", sync_every=2) as diloco:
            inner = diloco.inner_optimizer
            if name == "C":
                stats["C_joined_at"] = diloco.outer_epoch
                stats["C_loads_at_join"] = diloco.schedule.state_loads
                torch.testing.assert_close(_flat(model.parameters()), _flat(diloco.backup))
            else:
                _wait_for_peers(diloco, 2)
            if name == "B":
                real_step = diloco.averager.step

                def failing_step(*args: Any, **kwargs: Any) -> Any:
                    result = real_step(*args, **kwargs)
                    if diloco.outer_epoch == 4 and "B_failed" not in stats:
                        # the others' round succeeded, B's failed (as if its last part was
                        # lost): B rolls back to θ_global of epoch 4 and must catch up
                        stats["B_failed"] = True
                        raise RuntimeError("injected failure")
                    return result

                diloco.averager.step = failing_step  # type: ignore[method-assign]
            record(name, diloco)
            stop_at = 6 if name == "A" else target
            for _ in range(2000):
                if diloco.outer_epoch >= stop_at:
                    break
                time.sleep(0.01)  # the compute of a batch
                x = torch.randn(4, dim, generator=generator)
                F.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
                inner.step()
                inner.zero_grad()
                record(name, diloco)
                if name == "A" and diloco.outer_epoch >= 2:
                    c_may_join.set()
            assert diloco.outer_epoch == stop_at, f"{name} stopped at {diloco.outer_epoch}"
            stats[name] = diloco.schedule
            done[name].set()
            if name != "A":  # (serve the state until the other one is done too)
                assert done["B" if name == "C" else "C"].wait(60)

    with swarm(3) as dhts:
        run_threads([partial(train, name, dht) for name, dht in zip("ABC", dhts, strict=True)])

    assert stats["C_joined_at"] >= 2
    assert stats["C_loads_at_join"] == 1
    b = stats["B"]
    assert b.rounds_failed >= 1
    # (B catches up by downloading the next epoch's state, or, when C was late for the
    # others' round, by averaging epoch 4 again with C)
    failed = [r for r in caplog.records if "the round failed (RuntimeError: injected" in r.message]
    assert len(failed) == 1
    assert failed[0].levelname == "WARNING"
    # Every peer that held an epoch holds the same θ_global and outer state there, unless the
    # epoch's rounds were two groups (under heavy CPU load C can be late for the others' group,
    # and B, whose round failed, then averages the same epoch again with C): the next round's
    # digests make the members apart roll back and download the reference's state ("Diverged"
    # in docs/guides/diloco.md), and B and C end in one state.
    compared = 0
    mismatched: list[tuple[int, str, str]] = []

    def same(mine: tuple[torch.Tensor, list[torch.Tensor]], theirs: Any) -> bool:
        return (
            torch.equal(mine[0], theirs[0])
            and len(mine[1]) == len(theirs[1])
            and all(torch.equal(a, b) for a, b in zip(mine[1], theirs[1], strict=True))
        )

    for epoch in range(target + 1):
        held = {name: snap[epoch] for name, snap in snapshots.items() if epoch in snap}
        names = sorted(held)
        for other in names[1:]:
            if not same(held[other], held[names[0]]):
                mismatched.append((epoch, other, names[0]))
            compared += 1
    assert compared >= target  # (several peers held most epochs)
    assert set(snapshots["C"]) >= {target}
    assert set(snapshots["B"]) >= {target}
    assert same(snapshots["B"][target], snapshots["C"][target]), mismatched
    if mismatched:
        # the first epoch held apart was reached by two groups (more peers averaged into it
        # than the largest of their rounds held)
        first = min(epoch for epoch, _, _ in mismatched)
        sizes = [mine[first] for mine in arrivals.values() if first in mine]
        assert len(sizes) > max(sizes, default=0), (mismatched, arrivals)


@pytest.mark.parametrize("sync_every", [1, 3])
def test_peers_that_start_together_from_other_weights_agree(
    sync_every: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Two peers start at the same moment (no wait for each other) from other initial
    weights. Their first round finds them at outer epoch 0 with other θ_global (averaged, or
    each alone); the one that is not the round's reference rolls back and takes the next
    state of the other. From outer epoch 2 on, they hold the same θ_global and outer state at
    every epoch, and at the end."""
    dim, target = 4, 5
    snapshots: dict[int, dict[int, tuple[torch.Tensor, list[torch.Tensor]]]] = {}
    schedules: dict[int, Any] = {}
    start = threading.Barrier(2)
    done = [threading.Event() for _ in range(2)]

    def train(peer: int, dht: DHT) -> None:
        torch.manual_seed(10 + peer)
        model = torch.nn.Linear(dim, 1)  # other initial weights
        generator = torch.Generator().manual_seed(20 + peer)
        mine = snapshots.setdefault(peer, {})
        start.wait(30)
        with _make(dht, model, "together", sync_every=sync_every) as diloco:
            inner = diloco.inner_optimizer
            for _ in range(2000):
                if diloco.outer_epoch >= target:
                    break
                x = torch.randn(4, dim, generator=generator)
                F.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
                inner.step()
                inner.zero_grad()
                if diloco.outer_epoch not in mine:
                    mine[diloco.outer_epoch] = (_flat(diloco.backup), _outer_state(diloco))
            assert diloco.outer_epoch == target, f"peer {peer} stopped at {diloco.outer_epoch}"
            schedules[peer] = diloco.schedule
            done[peer].set()
            assert done[1 - peer].wait(60)  # (serve the state until the other one is done)

    with swarm(2) as dhts:
        run_threads([partial(train, i, dht) for i, dht in enumerate(dhts)])

    assert target in snapshots[0]
    assert target in snapshots[1]
    for epoch in set(snapshots[0]) & set(snapshots[1]) - {0, 1}:
        a, b = snapshots[0][epoch], snapshots[1][epoch]
        torch.testing.assert_close(a[0], b[0], atol=0, rtol=0)
        assert len(a[1]) == len(b[1]) == 2  # (the momentum buffers of the weight and bias)
        for mine, theirs in zip(a[1], b[1], strict=True):
            torch.testing.assert_close(mine, theirs, atol=0, rtol=0)
    assert sum(s.state_loads for s in schedules.values()) >= 1
    assert sum(s.rounds_diverged for s in schedules.values()) >= 1
    diverged = [r for r in caplog.records if "the round's reference" in r.message]
    assert diverged
    assert all(r.levelname == "WARNING" for r in diverged)


# -- arguments and lifecycle ---------------------------------------------------------------------


def test_bad_arguments_are_named() -> None:
    model = torch.nn.Linear(2, 1)
    other = torch.nn.Linear(2, 1)
    with swarm(1) as (dht,):
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        common: dict[str, Any] = {"inner_optimizer": inner, "dht": dht, "run_id": "args"}
        cases: list[tuple[type[Exception], str, dict[str, Any]]] = [
            (ValueError, "sync_every", {"sync_every": 0}),
            (TypeError, "sync_every", {"sync_every": 2.0}),
            (ValueError, "on_round_failure", {"sync_every": 2, "on_round_failure": "retry"}),
            (ValueError, "weighting", {"sync_every": 2, "weighting": "tokens"}),
            (ValueError, "batch_size", {"sync_every": 2, "batch_size": 0}),
            (TypeError, "compression", {"sync_every": 2, "compression": "fp16"}),
            (ValueError, "averaging_timeout", {"sync_every": 2, "averaging_timeout": 0}),
            (TypeError, "hook", {"sync_every": 2, "hook": 1}),
            (TypeError, "outer_optimizer", {"sync_every": 2, "outer_optimizer": inner}),
            (TypeError, "scheduler", {"sync_every": 2, "scheduler": 3}),
            (ValueError, "run_id", {"sync_every": 2, "run_id": ""}),
            (TypeError, "inner_optimizer", {"sync_every": 2, "inner_optimizer": "adam"}),
            (TypeError, "dht", {"sync_every": 2, "dht": object()}),
        ]
        for error, name, kwargs in cases:
            with pytest.raises(error, match=name):
                DiLoCo(model.parameters(), **{**common, **kwargs})
        with pytest.raises(ValueError, match="inner_optimizer"):
            DiLoCo(other.parameters(), **common, sync_every=2)
        # nothing was left running: the same run_id works
        with DiLoCo(model.parameters(), **common, sync_every=2, averager_opts=FAST):
            pass


def test_shutdown_is_idempotent_and_unhooks() -> None:
    model = torch.nn.Linear(2, 1)
    with swarm(1) as (dht,):
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        diloco = DiLoCo(
            model.parameters(),
            inner_optimizer=inner,
            dht=dht,
            run_id="bye",
            sync_every=1,
            averager_opts=FAST,
        )
        diloco.shutdown()
        diloco.shutdown()
        assert not diloco.is_alive()
        model(torch.ones(1, 2)).sum().backward()
        inner.step()  # the hook is gone: no round, no error
        assert diloco.outer_epoch == 0
        assert diloco.last_round is None
        with pytest.raises(RuntimeError, match="shut down"):
            diloco.step()
        with pytest.raises(RuntimeError, match="shut down"):
            diloco.load_state_from_peers()


@pytest.mark.parametrize("policy", ["rollback", "keep_local"])
def test_a_failed_round_rolls_back_or_keeps_local(policy: str) -> None:
    """A round that fails among several peers (here: the other peer never averages)."""
    param = torch.nn.Parameter(torch.zeros(2))
    with swarm(2) as (dht, other_dht):
        inner = torch.optim.SGD([param], lr=1.0)
        with (
            _make(other_dht, torch.nn.Linear(1, 1), "fail", sync_every=2) as silent,
            DiLoCo(
                [param],
                inner_optimizer=inner,
                dht=dht,
                run_id="fail",
                sync_every=2,
                on_round_failure=policy,
                matchmaking_time=0.5,
                averaging_timeout=2.0,
                averager_opts=FAST,
                tracker_opts=TRACKER,
            ) as diloco,
        ):
            silent.tracker.report_local_progress(0, 1)
            _wait_for_peers(diloco, 2)
            _wait_for_peers(silent, 2)
            for _ in range(2):
                param.grad = torch.ones(2)
                inner.step()
            report = diloco.last_round
            assert report is not None
            assert report.outcome == "failed"
            assert report.error
            assert diloco.rounds_failed == 1
            assert diloco.outer_epoch == 0
            torch.testing.assert_close(diloco.backup[0], torch.zeros(2))
            if policy == "rollback":
                assert report.action == "rollback"
                assert diloco.inner_step == 0
                torch.testing.assert_close(param.detach(), torch.zeros(2))
            else:
                assert report.action == "keep_local"
                assert diloco.inner_step == 2
                torch.testing.assert_close(param.detach(), torch.full((2,), -2.0))


def test_a_round_looking_for_a_group_stops_when_the_swarm_goes_on() -> None:
    """A peer whose round looks for a group (up to ``averaging_timeout``, 30 s here) while the
    records show the swarm at a later outer epoch stops looking at once: the round fails and
    the peer catches up, instead of waiting out the timeout while the others train on."""
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    param = model.weight
    with swarm(2) as (dht, other_dht):
        inner = torch.optim.SGD([param], lr=1.0)
        with (
            _make(other_dht, torch.nn.Linear(1, 1), "went-on", sync_every=2) as ahead,
            _make(
                dht,
                model,
                "went-on",
                inner_optimizer=inner,
                sync_every=2,
                matchmaking_time=0.5,
                averaging_timeout=30.0,
                load_state_timeout=5.0,
            ) as late,
        ):
            ahead.tracker.report_local_progress(0, 1)
            _wait_for_peers(late, 2)

            def go_on() -> None:  # (the other peer's record moves on while the round looks)
                deadline = time.monotonic() + 30
                while late.inner_step < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.5)
                ahead.tracker.report_local_progress(1, 1)

            mover = threading.Thread(target=go_on)
            mover.start()
            for _ in range(2):
                param.grad = torch.ones(1, 2)
                inner.step()
            mover.join()
            report = late.last_round
            assert report is not None
            assert report.outcome == "failed"
            assert report.error is not None
            assert "went on to outer epoch 1 while this peer looked for a group" in report.error
            assert report.seconds < 15.0  # (not the 30 s of averaging_timeout)
            assert late.outer_epoch == 0  # (the other's state is at epoch 0: nothing newer)
            assert late.inner_step == 0  # (rolled back to θ_global)
            torch.testing.assert_close(param.detach(), torch.zeros(1, 2))


# -- checkpoints and metrics ---------------------------------------------------------------------


def _checkpoint_run(batches: Any, model: torch.nn.Module, diloco: DiLoCo) -> None:
    for x, y in batches:
        F.mse_loss(model(x), y).backward()
        diloco.inner_optimizer.step()
        diloco.inner_optimizer.zero_grad()


def _diloco_for_checkpoint(dht: DHT, model: torch.nn.Module, run_id: str) -> DiLoCo:
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    return DiLoCo(
        model.parameters(),
        inner_optimizer=inner,
        dht=dht,
        run_id=run_id,
        sync_every=5,
        scheduler=partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda t: 1 / (1 + 0.1 * t)),
        averager_opts=FAST,
    )


def test_a_checkpoint_continues_the_run_exactly() -> None:
    """state_dict() mid-round (2 outer epochs and 3 inner steps), through torch.save/load
    (weights_only), into a fresh peer: it continues exactly as the original does (θ_global,
    Nesterov momentum, AdamW moments, the inner schedule by global step)."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    x, y = torch.randn(25 * 4, 5), torch.randn(25 * 4, 2)
    batches = [(x[i * 4 : i * 4 + 4], y[i * 4 : i * 4 + 4]) for i in range(25)]
    with swarm(1) as (dht,):
        with _diloco_for_checkpoint(dht, model, "ckpt") as diloco:
            _checkpoint_run(batches[:13], model, diloco)
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "diloco": diloco.state_dict()}, buffer)
            _checkpoint_run(batches[13:], model, diloco)
            expected = _flat(model.parameters())
            expected_epoch = diloco.outer_epoch
            expected_lr = diloco.inner_optimizer.param_groups[0]["lr"]
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        restored = torch.nn.Sequential(
            torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)
        )
        restored.load_state_dict(saved["model"])
        with _diloco_for_checkpoint(dht, restored, "ckpt-restored") as again:
            again.load_state_dict(saved["diloco"])
            assert (again.outer_epoch, again.inner_step, again.global_step) == (2, 3, 13)
            _checkpoint_run(batches[13:], restored, again)
            assert again.outer_epoch == expected_epoch == 5
            assert again.inner_optimizer.param_groups[0]["lr"] == pytest.approx(expected_lr)
    torch.testing.assert_close(_flat(restored.parameters()), expected, atol=1e-6, rtol=0)


def test_load_state_dict_refuses_what_does_not_fit() -> None:
    model = torch.nn.Linear(3, 1)
    with swarm(1) as (dht,), _diloco_for_checkpoint(dht, model, "refuse") as diloco:
        _checkpoint_run([(torch.randn(4, 3), torch.randn(4, 1))] * 7, model, diloco)
        good = diloco.state_dict()
        before = (copy.deepcopy(diloco.state_dict()), diloco.outer_epoch, diloco.inner_step)
        nan_theta = [t.clone() for t in good["theta_global"]]
        nan_theta[0][0, 0] = float("nan")
        cases: list[tuple[type[Exception], str, Any]] = [
            (TypeError, "state_dict", [1, 2]),
            (ValueError, "lacks", {k: v for k, v in good.items() if k != "outer_epoch"}),
            (ValueError, "sync_every", {**good, "sync_every": 4}),
            (ValueError, "theta_global", {**good, "theta_global": good["theta_global"][:1]}),
            (
                ValueError,
                r"theta_global\[0\] has shape",
                {**good, "theta_global": [torch.zeros(2, 3), good["theta_global"][1]]},
            ),
            (ValueError, "not finite|non-finite|NaN", {**good, "theta_global": nan_theta}),
            (ValueError, "inner_step", {**good, "inner_step": 5}),
            (ValueError, "outer_epoch", {**good, "outer_epoch": -1}),
            (ValueError, "inner_optimizer", {**good, "inner_optimizer": _adam_state_of_4()}),
        ]
        for error, match, value in cases:
            with pytest.raises(error, match=match):
                diloco.load_state_dict(value)
        after = diloco.state_dict()
        assert (diloco.outer_epoch, diloco.inner_step) == before[1:]
        torch.testing.assert_close(_flat(after["theta_global"]), _flat(before[0]["theta_global"]))
        assert (
            after["outer_optimizer"]["state"].keys() == before[0]["outer_optimizer"]["state"].keys()
        )
        diloco.load_state_dict(good)  # (a good one still loads)


def _adam_state_of_4() -> dict[str, Any]:
    """An AdamW state dict for a Linear(4, 1): two parameters of other shapes."""
    layer = torch.nn.Linear(4, 1)
    adam = torch.optim.AdamW(layer.parameters(), lr=0.05)
    layer(torch.ones(1, 4)).sum().backward()
    adam.step()
    return adam.state_dict()


def test_diloco_serves_its_metrics() -> None:
    pytest.importorskip("prometheus_client")
    import urllib.request

    model = torch.nn.Linear(3, 1)
    with swarm(1) as (dht,):
        with _make(dht, model, "served", sync_every=2, metrics_port=0) as diloco:
            _checkpoint_run([(torch.randn(4, 3), torch.randn(4, 1))] * 5, model, diloco)
            address = diloco.metrics_address
            assert address is not None
            with urllib.request.urlopen(
                f"http://{address[0]}:{address[1]}/metrics", timeout=10
            ) as r:
                text = r.read().decode()
        samples = dict(
            line.rpartition(" ")[::2] for line in text.splitlines() if not line.startswith("#")
        )
        assert float(samples['swarmavg_diloco_outer_epoch{run_id="served"}']) == 2
        assert float(samples['swarmavg_diloco_global_step{run_id="served"}']) == 5
        assert float(samples['swarmavg_diloco_rounds_total{outcome="alone",run_id="served"}']) == 2
        assert float(samples['swarmavg_diloco_rounds_total{outcome="failed",run_id="served"}']) == 0
        assert 'swarmavg_averager_steps_started_total{prefix="served_diloco"}' in samples
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=5)


def test_a_state_served_during_an_outer_step_has_its_own_epoch() -> None:
    """θ_global and the outer epoch move together under the state lock: a state served while a
    round ends is either the old epoch's or the new one's, never new θ_global labelled with the
    old epoch (a joiner taking that would hold another θ_global than the swarm's)."""
    param = torch.nn.Parameter(torch.zeros(2))
    with swarm(1) as (dht,):
        inner = torch.optim.SGD([param], lr=1.0)
        with DiLoCo(
            [param],
            inner_optimizer=inner,
            dht=dht,
            run_id="served",
            sync_every=1,
            averager_opts=FAST,
        ) as diloco:
            served: list[tuple[int, torch.Tensor]] = []
            real = diloco.schedule.round_succeeded

            def serve() -> None:
                metadata, tensors, _ = diloco.state_to_share()
                served.append((metadata["outer_epoch"], tensors[0].clone()))

            def round_succeeded(**kwargs: Any) -> Any:
                sharer = threading.Thread(target=serve)
                sharer.start()
                sharer.join(0.2)  # (time for a share that does not wait for the round)
                report = real(**kwargs)
                threads.append(sharer)
                return report

            threads: list[threading.Thread] = []
            diloco.schedule.round_succeeded = round_succeeded  # type: ignore[method-assign]
            param.grad = torch.ones(2)
            inner.step()
            threads[0].join(10)
            assert diloco.outer_epoch == 1
            ((epoch, theta),) = served
            assert epoch == 1
            torch.testing.assert_close(theta, diloco.backup[0])
            assert not torch.equal(theta, torch.zeros(2))
