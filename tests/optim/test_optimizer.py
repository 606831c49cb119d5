"""``swarmavg.Optimizer``: hivemind's optimizer tests ported, and the multi-peer cases they lack.

Peers run in threads of one process, each with its own :class:`swarmavg.DHT` over TCP on
127.0.0.1 (the sync facade's event-loop thread carries all of them).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import ExitStack
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from optim_helpers import FAST, run_threads, swarm

import swarmavg
from swarmavg import DHT
from swarmavg.optim import Optimizer

pytestmark = pytest.mark.timeout(120)


# -- hivemind's test_optimizer, one peer (spec A.3) ---------------------------------------------


@pytest.mark.parametrize(
    (
        "use_local_updates",
        "delay_state_averaging",
        "delay_optimizer_step",
        "delay_grad_averaging",
        "reuse_grad_buffers",
    ),
    [
        (False, False, False, False, False),
        (False, True, False, False, False),
        (False, True, True, True, False),
        (False, False, False, False, True),
        (False, True, True, True, True),
        (False, True, True, False, True),
        (True, False, False, False, False),
        (True, True, False, False, False),
    ],
)
def test_one_peer_runs_three_epochs(
    use_local_updates: bool,
    delay_state_averaging: bool,
    delay_optimizer_step: bool,
    delay_grad_averaging: bool,
    reuse_grad_buffers: bool,
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    features = torch.randn(100, 5)
    targets = features @ torch.randn(5, 1)
    batch_size, target_batch_size = 4, 32
    with swarm(1) as (dht,):
        opt = Optimizer(
            dht=dht,
            run_id="one_peer",
            target_batch_size=target_batch_size,
            batch_size_per_step=batch_size,
            params=model.parameters(),
            optimizer=partial(torch.optim.SGD, lr=0.1),
            scheduler=partial(torch.optim.lr_scheduler.StepLR, gamma=0.5, step_size=1),
            matchmaking_time=1.0,
            averaging_timeout=5.0,
            use_local_updates=use_local_updates,
            delay_state_averaging=delay_state_averaging,
            delay_optimizer_step=delay_optimizer_step,
            delay_grad_averaging=delay_grad_averaging,
            reuse_grad_buffers=reuse_grad_buffers,
            averager_opts=FAST,
            tracker_opts={"min_refresh_period": 0.05, "default_refresh_period": 0.1},
        )
        assert (opt.grad_averager is None) == use_local_updates
        total = 0
        for step in range(200):
            if opt.local_epoch == 3:
                break
            time.sleep(0.02)  # the compute of a batch
            x = features[(step * batch_size) % 96 :][:batch_size]
            y = targets[(step * batch_size) % 96 :][:batch_size]
            F.mse_loss(model(x), y).backward()
            opt.step()
            total += batch_size
            if not reuse_grad_buffers:
                opt.zero_grad()
        assert opt.local_epoch == opt.tracker.global_epoch == 3
        assert 3 * target_batch_size <= total <= 3 * target_batch_size * 1.2
        # the schedule is by epoch: lr(3) = 0.1 * 0.5**3 (a delayed step, with the scheduler's,
        # may still run in the background: it is applied by a later step, or waited for here)
        opt.state_averager.step(wait_for_delayed_updates=True)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
        assert opt.scheduled_grads is None or opt.scheduled_grads.done()
        opt.shutdown()
        opt.shutdown()  # idempotent
        assert not opt.is_alive()
        with pytest.raises(RuntimeError, match="shut down"):
            opt.step(batch_size=1)


def test_load_state_dict_moves_the_tracker_to_the_saved_epoch() -> None:
    """A peer resumed from a checkpoint alone trains on from the saved epoch (its progress
    record at epoch 0 made it look out of sync with itself: it tried to download the state from
    no one, and its epochs stalled)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    with swarm(1) as (dht,):
        opt = Optimizer(
            dht=dht,
            run_id="resumed",
            target_batch_size=2,
            batch_size_per_step=1,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            matchmaking_time=1.0,
            averaging_timeout=5.0,
            averager_opts=FAST,
            tracker_opts={"min_refresh_period": 0.05, "default_refresh_period": 0.1},
        )
        saved = opt.state_dict()
        saved["state"] = {**saved["state"], "local_epoch": 3}
        opt.load_state_dict(saved)
        assert opt.local_epoch == opt.tracker.local_progress.epoch == 3
        assert opt.tracker.global_epoch == 3
        for _ in range(40):  # (two steps an epoch; bounded)
            if opt.local_epoch == 5:
                break
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
        assert opt.local_epoch == 5
        assert opt.metrics.state_load_failures == 0
        opt.shutdown()


def test_argument_errors_name_the_argument() -> None:
    model = torch.nn.Linear(2, 1)
    with swarm(1) as (dht,):
        common: dict[str, Any] = {"dht": dht, "run_id": "args", "target_batch_size": 8}
        with pytest.raises(ValueError, match="delay_grad_averaging"):
            Optimizer(
                **common,
                optimizer=torch.optim.SGD,
                params=model.parameters(),
                delay_grad_averaging=True,
                delay_optimizer_step=False,
            )
        with pytest.raises(ValueError, match="optimizer factory"):
            Optimizer(
                **common,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                offload_optimizer=True,
            )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ValueError, match="scheduler must be a factory"):
            Optimizer(
                **common,
                optimizer=torch.optim.SGD,
                params=model.parameters(),
                scheduler=torch.optim.lr_scheduler.StepLR(opt, 1),
            )
        with pytest.raises(ValueError, match="optimizer must be"):
            Optimizer(**common, optimizer=42)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="target_batch_size"):
            Optimizer(
                **{**common, "target_batch_size": 0},
                optimizer=torch.optim.SGD(model.parameters(), lr=1),
            )
        with pytest.raises(ValueError, match="reuse_grad_buffers"):
            Optimizer(
                **common,
                optimizer=torch.optim.SGD(model.parameters(), lr=1),
                use_local_updates=True,
                reuse_grad_buffers=True,
            )
        with pytest.raises(TypeError, match="matchmaking_time"):
            Optimizer(
                **common, optimizer=torch.optim.SGD(model.parameters(), lr=1), matchmaking_time="5"
            )  # type: ignore[arg-type]


def test_torch_hooks_and_public_names() -> None:
    assert swarmavg.Optimizer is Optimizer
    assert issubclass(Optimizer, torch.optim.Optimizer)
    model = torch.nn.Linear(3, 1)
    calls: list[str] = []
    with (
        swarm(1) as (dht,),
        Optimizer(
            dht=dht,
            run_id="hooks",
            target_batch_size=4,
            batch_size_per_step=2,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
            matchmaking_time=1.0,
            averager_opts=FAST,
        ) as opt,
    ):
        opt.register_step_pre_hook(lambda *_: calls.append("pre"))
        opt.register_step_post_hook(lambda *_: calls.append("post"))
        assert opt.defaults["lr"] == 0.5
        assert opt.defaults["momentum"] == 0.9
        assert opt.param_groups[0]["params"] == list(model.parameters())
        with pytest.raises(ValueError, match="add_param_group"):
            opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        assert calls == ["pre", "post"]
        state = opt.state_dict()
        assert state["state"]["local_epoch"] == opt.local_epoch


# -- several peers -------------------------------------------------------------------------------


def _peer_data(peer: int, count: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + peer)
    x = torch.randn(count, dim, generator=generator)
    w = torch.arange(1.0, dim + 1).unsqueeze(1) / dim
    return x, x @ w + 0.5


@pytest.mark.parametrize("batch_sizes", [(4, 4, 4, 4), (1, 3, 5, 7)])
def test_peers_average_gradients_exactly_by_samples(batch_sizes: tuple[int, ...]) -> None:
    """Four peers; an epoch whose gradient round held all four peers makes one SGD step on the
    mean gradient of every sample the peers contributed to it (exact sample weighting, also
    with uneven batch sizes), the same on every peer.

    The peers step on wall-clock sleeps, so under load a peer may miss a round: it then steps
    on its own gradients, or downloads the state, dropping the batch it computed on stale
    parameters (as hivemind's). Such an epoch has no exact reference and is not compared;
    each epoch that is starts from the parameters the peers held before it. (Compared from the
    initial ones instead, a batch dropped by a download failed every peer, a 1-in-16 flake of
    the suite under load.)"""
    dim, epochs, lr = 6, 3, 0.05
    count = len(batch_sizes)
    torch.manual_seed(3)
    initial = torch.nn.Linear(dim, 1)
    used: list[dict[int, list[tuple[torch.Tensor, torch.Tensor]]]] = [{} for _ in range(count)]
    snapshots: list[dict[int, torch.Tensor]] = [{} for _ in range(count)]
    #: per peer, the epochs it ended in a gradient round with every peer, without a download
    full: list[set[int]] = [set() for _ in range(count)]
    ready = threading.Barrier(count)

    def flat(model: torch.nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    def train(peer: int, dht: DHT) -> None:
        model = torch.nn.Linear(dim, 1)
        model.load_state_dict(initial.state_dict())
        x_all, y_all = _peer_data(peer, 400, dim)
        b = batch_sizes[peer]
        with Optimizer(
            dht=dht,
            run_id="exact",
            target_batch_size=96,
            optimizer=torch.optim.SGD(model.parameters(), lr=lr),
            matchmaking_time=2.0,
            averaging_timeout=20.0,
            delay_state_averaging=False,
            averager_opts=FAST,
            tracker_opts={"min_refresh_period": 0.05, "default_refresh_period": 0.2},
        ) as opt:
            ready.wait(30)
            for step in range(400 // b):
                time.sleep(0.01 * b)  # the compute of a batch: 10 ms per sample
                epoch = opt.local_epoch
                if epoch >= epochs:
                    break
                x, y = x_all[step * b : (step + 1) * b], y_all[step * b : (step + 1) * b]
                F.mse_loss(model(x), y).backward()
                before = opt.metrics
                opt.step(batch_size=b)
                opt.zero_grad()
                after = opt.metrics
                if after.state_loads != before.state_loads:
                    # (the batch was dropped: it was computed on stale parameters; the peer
                    # starts its epoch from the downloaded ones)
                    snapshots[peer][opt.local_epoch] = flat(model)
                    continue
                used[peer].setdefault(epoch, []).append((x, y))
                if opt.local_epoch != epoch:
                    snapshots[peer][opt.local_epoch] = flat(model)
                    if (
                        opt.local_epoch == epoch + 1
                        and after.epochs_averaged == before.epochs_averaged + 1
                        and opt.last_epoch_info.get("grad_group") == count
                    ):
                        full[peer].add(epoch)
            # stay until every peer finished its last round
            assert opt.local_epoch >= epochs, f"peer {peer} stopped at epoch {opt.local_epoch}"

    with swarm(count) as dhts:
        run_threads([partial(train, i, dht) for i, dht in enumerate(dhts)])

    compared = [epoch for epoch in range(epochs) if all(epoch in f for f in full)]
    assert compared, f"no epoch averaged over all {count} peers: {full}"
    reference = torch.nn.Linear(dim, 1)
    for epoch in compared:
        if epoch == 0:
            reference.load_state_dict(initial.state_dict())
        else:  # (where the peers stood: the same on every one)
            begin = snapshots[0][epoch]
            for peer in range(1, count):
                torch.testing.assert_close(snapshots[peer][epoch], begin, atol=1e-6, rtol=0)
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(begin, reference.parameters())
        batches = [batch for peer in used for batch in peer.get(epoch, [])]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        reference.zero_grad()
        F.mse_loss(reference(x), y).backward()  # the mean over every sample of the epoch
        with torch.no_grad():
            for p in reference.parameters():
                p -= lr * p.grad  # type: ignore[operator]
        expected = flat(reference)
        for peer in range(count):
            torch.testing.assert_close(snapshots[peer][epoch + 1], expected, atol=1e-6, rtol=0)


def test_a_late_joiner_downloads_the_state_and_trains_in_lockstep(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dim = 4
    torch.manual_seed(5)
    results: dict[str, Any] = {}
    first_done = threading.Event()
    late_done = threading.Event()

    def make(dht: DHT, model: torch.nn.Module) -> Optimizer:
        return Optimizer(
            dht=dht,
            run_id="late",
            target_batch_size=16,
            batch_size_per_step=4,
            optimizer=partial(torch.optim.SGD, lr=0.1),
            params=model.parameters(),
            scheduler=partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda t: 1 / (1 + t)),
            matchmaking_time=1.0,
            averaging_timeout=10.0,
            averager_opts=FAST,
            tracker_opts={"min_refresh_period": 0.05, "default_refresh_period": 0.2},
        )

    def early(dht: DHT) -> None:
        model = torch.nn.Linear(dim, 1)
        x_all, y_all = _peer_data(0, 4000, dim)
        with make(dht, model) as opt:
            step = 0
            while opt.local_epoch < 3:
                time.sleep(0.02)
                F.mse_loss(model(x_all[step * 4 :][:4]), y_all[step * 4 :][:4]).backward()
                opt.step()
                opt.zero_grad()
                step += 1
            first_done.set()
            snapshots: dict[int, torch.Tensor] = {}
            while not late_done.is_set() and step < 3000:  # until the late peer is done
                epoch = opt.local_epoch
                time.sleep(0.02)
                F.mse_loss(model(x_all[step * 4 :][:4]), y_all[step * 4 :][:4]).backward()
                opt.step()
                opt.zero_grad()
                step += 1
                if opt.local_epoch != epoch:
                    snapshots[opt.local_epoch] = torch.cat(
                        [p.detach().flatten() for p in model.parameters()]
                    )
            results["early"] = snapshots

    def late(dht: DHT) -> None:
        assert first_done.wait(60)
        model = torch.nn.Linear(dim, 1)  # other initial weights
        x_all, y_all = _peer_data(1, 4000, dim)
        with make(dht, model) as opt:
            assert opt.local_epoch == 0
            step = 0
            while opt.local_epoch < 6:
                time.sleep(0.02)
                F.mse_loss(model(x_all[step * 4 :][:4]), y_all[step * 4 :][:4]).backward()
                opt.step()
                opt.zero_grad()
                step += 1
                if "joined_at" not in results and opt.local_epoch >= 3:
                    results["joined_at"] = opt.local_epoch
                    results["lr_after_load"] = opt.param_groups[0]["lr"]
            results["late"] = torch.cat([p.detach().flatten() for p in model.parameters()])
            results["late_epoch"] = opt.local_epoch
            late_done.set()

    with caplog.at_level(logging.INFO, logger="swarmavg.optim"), swarm(2) as dhts:
        run_threads([partial(early, dhts[0]), partial(late, dhts[1])])
    assert results["joined_at"] >= 3
    epoch = results["joined_at"]
    assert results["lr_after_load"] == pytest.approx(0.1 / (1 + epoch))
    # Trained together since: the same averaged gradients on the same parameters (a download
    # that raced the donor's epoch end is checked at the next read of the progress and made
    # again, so the newcomer is never a step behind): exactly equal, unless a round since the
    # join did not average (on a loaded machine, a peer may read the progress before the
    # newcomer's first record and step alone once); then the state averaging pulls the two
    # together, not exactly.
    notes = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    # (from the first download on: a peer that stepped alone after it and was loaded again
    # later is the case above, not an exact one)
    joined = min(i for i, note in enumerate(notes) if "loaded the swarm's state" in note)
    alone = any("local gradients" in note for note in notes[joined:])
    torch.testing.assert_close(
        results["late"],
        results["early"][results["late_epoch"]],
        atol=0.05 if alone else 1e-6,
        rtol=0,
        msg=lambda m: m + "\n" + "\n".join(notes),
    )
    assert any("loaded the swarm's state" in r.getMessage() for r in caplog.records)


def test_a_download_that_is_behind_the_swarm_is_made_again() -> None:
    """The donor's epoch ended while it served us (simulated: the first download comes back
    one epoch old): the newcomer downloads again instead of taking the epoch number without
    the step (hivemind's catch-up), so it is not a step behind the others."""
    torch.manual_seed(3)

    def make(dht: DHT, model: torch.nn.Module) -> Optimizer:
        return Optimizer(
            dht=dht,
            run_id="behind",
            target_batch_size=8,
            batch_size_per_step=4,
            optimizer=partial(torch.optim.SGD, lr=0.1),
            params=model.parameters(),
            matchmaking_time=1.0,
            averaging_timeout=5.0,
            averager_opts=FAST,
            tracker_opts={"min_refresh_period": 0.05, "default_refresh_period": 0.1},
        )

    with swarm(2) as dhts:
        donor_model = torch.nn.Linear(3, 1)
        x, y = _peer_data(0, 400, 3)
        with make(dhts[0], donor_model) as donor:
            for step in range(100):
                if donor.local_epoch == 2:
                    break
                time.sleep(0.01)
                F.mse_loss(donor_model(x[step * 4 :][:4]), y[step * 4 :][:4]).backward()
                donor.step()
                donor.zero_grad()
            assert donor.local_epoch == 2
            model = torch.nn.Linear(3, 1)
            with make(dhts[1], model) as late:
                assert late.tracker.global_epoch == 2
                real = late.state_averager.load_state_from_peers
                calls = []

                def first_one_is_old(**kwargs: Any) -> Any:
                    result = real(**kwargs)
                    calls.append(late.state_averager.local_epoch)
                    if len(calls) == 1:
                        late.state_averager.local_epoch -= 1
                    return result

                late.state_averager.load_state_from_peers = first_one_is_old  # type: ignore[method-assign]
                late.load_state_from_peers()
                assert calls == [2, 2]
                assert late.local_epoch == 2
                for mine, theirs in zip(model.parameters(), donor_model.parameters(), strict=True):
                    torch.testing.assert_close(mine, theirs, atol=0, rtol=0)


def test_client_and_auxiliary_peers_take_part(caplog: pytest.LogCaptureFixture) -> None:
    """Two full peers, a client-mode peer (no incoming connections) and an auxiliary peer (no
    samples): the trainers stay identical epoch after epoch, the auxiliary follows the epochs
    and changes no result."""
    dim, epochs = 5, 3
    torch.manual_seed(7)
    initial = torch.nn.Linear(dim, 1)
    finals: dict[str, torch.Tensor] = {}
    aux_epochs: list[int] = []
    ready = threading.Barrier(4)

    def options(dht: DHT) -> dict[str, Any]:
        return {
            "dht": dht,
            "run_id": "roles",
            "target_batch_size": 48,
            "matchmaking_time": 2.0,
            "averaging_timeout": 20.0,
            "delay_state_averaging": False,
            "averager_opts": FAST,
            "tracker_opts": {"min_refresh_period": 0.05, "default_refresh_period": 0.2},
        }

    def trainer(name: str, peer: int, dht: DHT) -> None:
        model = torch.nn.Linear(dim, 1)
        model.load_state_dict(initial.state_dict())
        x_all, y_all = _peer_data(peer, 800, dim)
        with Optimizer(
            **options(dht), optimizer=torch.optim.SGD(model.parameters(), lr=0.05)
        ) as opt:
            assert opt.client_mode == (name == "client")
            ready.wait(30)
            step = 0
            while opt.local_epoch < epochs:
                time.sleep(0.04)
                F.mse_loss(model(x_all[step * 4 :][:4]), y_all[step * 4 :][:4]).backward()
                opt.step(batch_size=4)
                opt.zero_grad()
                step += 1
            finals[name] = torch.cat([p.detach().flatten() for p in model.parameters()])

    def auxiliary(dht: DHT) -> None:
        model = torch.nn.Linear(dim, 1)
        model.load_state_dict(initial.state_dict())
        with Optimizer(
            **options(dht),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
            auxiliary=True,
        ) as opt:
            ready.wait(30)
            while opt.local_epoch < epochs - 1 and len(finals) < 3:
                time.sleep(0.05)
                opt.step()
                aux_epochs.append(opt.local_epoch)
            with pytest.raises(ValueError, match="auxiliary"):
                opt.step(batch_size=4)

    with caplog.at_level(logging.INFO, logger="swarmavg.optim"), ExitStack() as stack:
        first = stack.enter_context(DHT())
        maddrs = first.get_visible_maddrs()
        second = stack.enter_context(DHT(maddrs))
        client = stack.enter_context(DHT(maddrs, client_mode=True))
        helper = stack.enter_context(DHT(maddrs))
        run_threads(
            [
                partial(trainer, "full0", 0, first),
                partial(trainer, "full1", 1, second),
                partial(trainer, "client", 2, client),
                partial(auxiliary, helper),
            ]
        )
    # Exactly equal, unless a gradient round failed (then its members stepped alone for an
    # epoch; the log says so). Rounds failed here when the auxiliary counted towards the
    # expected group size: two trainers and the auxiliary assembled without the third; and,
    # on a loaded machine, when a trainer's last gradient round found no group in time (its
    # local step at the last epoch is never averaged away: 0.115 apart in one CI run); and
    # when a peer's state averaging timed out there and its next epoch found no other peer
    # ("local gradients (no other peer)": 0.042 apart in another).
    failed = any(
        text in r.getMessage()
        for r in caplog.records
        for text in ("averaging gradients failed", "local gradients", "state averaging failed")
    )
    atol = 0.25 if failed else 1e-6
    torch.testing.assert_close(finals["full1"], finals["full0"], atol=atol, rtol=0)
    torch.testing.assert_close(finals["client"], finals["full0"], atol=atol, rtol=0)
    assert max(aux_epochs) >= 1


@pytest.mark.parametrize(
    "mode",
    [
        {"delay_optimizer_step": True, "delay_grad_averaging": True},
        {"delay_optimizer_step": True},
        {"reuse_grad_buffers": True, "delay_state_averaging": False},
        {"use_local_updates": True},
        {"use_local_updates": True, "delay_state_averaging": False, "average_state_every": 2},
    ],
    ids=["dpu", "delayed-step", "reuse-grad-buffers", "local-updates", "local-updates-every-2"],
)
def test_modes_converge_with_two_peers(mode: dict[str, Any]) -> None:
    """Two peers in each mode fit a linear map: the loss falls well below where it began, and
    the peers end close to each other (exactly equal is not promised with delays or local
    updates)."""
    dim, epochs = 4, 8
    torch.manual_seed(11)
    initial = torch.nn.Linear(dim, 1)
    finals: list[torch.Tensor] = [torch.empty(0), torch.empty(0)]
    losses: list[tuple[float, float]] = [(0.0, 0.0), (0.0, 0.0)]
    ready = threading.Barrier(2)
    x_eval, y_eval = _peer_data(9, 256, dim)

    def train(peer: int, dht: DHT) -> None:
        model = torch.nn.Linear(dim, 1)
        model.load_state_dict(initial.state_dict())
        x_all, y_all = _peer_data(peer, 4000, dim)
        with torch.no_grad():
            first = F.mse_loss(model(x_eval), y_eval).item()
        with Optimizer(
            dht=dht,
            run_id="modes",
            target_batch_size=32,
            batch_size_per_step=4,
            params=model.parameters(),
            optimizer=partial(torch.optim.SGD, lr=0.2 if mode.get("use_local_updates") else 0.3),
            matchmaking_time=1.0,
            averaging_timeout=10.0,
            averager_opts=FAST,
            tracker_opts={"min_refresh_period": 0.05, "default_refresh_period": 0.2},
            **mode,
        ) as opt:
            ready.wait(30)
            step = 0
            while opt.local_epoch < epochs and step < 900:
                time.sleep(0.01)
                F.mse_loss(model(x_all[step * 4 :][:4]), y_all[step * 4 :][:4]).backward()
                opt.step()
                if not mode.get("reuse_grad_buffers"):
                    opt.zero_grad()
                step += 1
            assert opt.local_epoch >= epochs
        with torch.no_grad():
            losses[peer] = (first, F.mse_loss(model(x_eval), y_eval).item())
        finals[peer] = torch.cat([p.detach().flatten() for p in model.parameters()])

    with swarm(2) as dhts:
        run_threads([partial(train, i, dht) for i, dht in enumerate(dhts)])
    for first, last in losses:
        assert last < 0.2 * first, losses
    torch.testing.assert_close(finals[0], finals[1], atol=0.05, rtol=0)


@pytest.mark.parametrize("delay_grad_averaging", [False, True])
def test_the_delayed_gradient_round_is_not_pre_scheduled(
    delay_grad_averaging: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``delay_grad_averaging`` the gradient round begins at the epoch's end, never
    pre-scheduled: a pre-scheduled round waits for a trigger that comes only after the previous
    delayed step and its state round, and a groupmate of the previous epoch that met it waited
    for that trigger while this peer's state round waited for the groupmate (a cycle broken only
    by the all-reduce's timeouts). Without the delays the round is still pre-scheduled."""
    from swarmavg._time import get_dht_time
    from swarmavg.optim.progress_tracker import ProgressTracker

    monkeypatch.setattr(  # the end of the epoch is near
        ProgressTracker, "estimated_next_update_time", property(lambda self: get_dht_time())
    )
    model = torch.nn.Linear(3, 1)
    with (
        swarm(1) as (dht,),
        Optimizer(
            dht=dht,
            run_id="not_pre_scheduled",
            target_batch_size=1 << 20,
            batch_size_per_step=4,
            params=model.parameters(),
            optimizer=partial(torch.optim.SGD, lr=0.1),
            matchmaking_time=1.0,
            averaging_timeout=10.0,
            averager_opts=FAST,
            delay_optimizer_step=delay_grad_averaging,
            delay_grad_averaging=delay_grad_averaging,
        ) as opt,
    ):
        model(torch.ones(4, 3)).sum().backward()
        opt.step()
        if delay_grad_averaging:
            assert opt.scheduled_grads is None
        else:
            assert opt.scheduled_grads is not None
            assert not opt.scheduled_grads.triggered


def test_an_epoch_whose_gradient_round_found_no_group_has_no_state_round() -> None:
    """A gradient round that finds nobody within ``averaging_timeout`` (the other peer's record
    is there, but it is not averaging) is followed by no state round that epoch: such a round
    would wait as long for nobody, and two peers that wait in different kinds of rounds (one
    in its gradient round, the other in its state round) missed each other epoch after epoch
    (seen after a third peer was SIGKILLed). The epoch still ends, on local gradients."""
    models = [torch.nn.Linear(3, 1) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    with swarm(2) as dhts, ExitStack() as stack:
        opts = [
            stack.enter_context(
                Optimizer(
                    dht=dht,
                    run_id="no_group_no_state_round",
                    target_batch_size=16,
                    batch_size_per_step=4,
                    params=model.parameters(),
                    optimizer=partial(torch.optim.SGD, lr=0.1),
                    matchmaking_time=0.5,
                    averaging_timeout=2.0,
                    delay_state_averaging=False,
                    averager_opts=FAST,
                    tracker_opts={
                        "min_refresh_period": 0.05,
                        "max_refresh_period": 0.2,
                        "default_refresh_period": 0.1,
                    },
                )
            )
            for dht, model in zip(dhts, models, strict=True)
        ]
        rounds: list[bool] = []
        state_step = opts[0].state_averager.step

        def spy(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("increment_epoch"):  # (the epoch's end)
                rounds.append(bool(kwargs.get("averaging_round")))
            return state_step(*args, **kwargs)

        opts[0].state_averager.step = spy  # type: ignore[method-assign]
        models[1](torch.ones(4, 3)).sum().backward()
        opts[1].step()  # (peer 1 reports its samples, then only watches)
        models[0](torch.ones(4, 3)).sum().backward()
        opts[0].step()  # (counted from now on, with peer 1: 8 of 16 samples)
        deadline = time.monotonic() + 30
        while opts[0].tracker.global_progress.num_peers < 2:  # peer 1's record is read
            assert time.monotonic() < deadline, "peer 1's progress record was never read"
            time.sleep(0.05)
        for _ in range(8):
            models[0](torch.ones(4, 3)).sum().backward()
            opts[0].step()
            if opts[0].local_epoch == 1:
                break
        assert opts[0].local_epoch == 1
        info = opts[0].last_epoch_info
        assert info is not None
        assert info["peers"] == 2, info
        assert info["grad_error"] is not None, info
        assert rounds == [False], rounds
