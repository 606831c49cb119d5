"""``swarmavg.Accumulator`` (the sync facade): moolib's reference loop among three peers in
threads of one process, over TCP on loopback; misuse raises."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from swarmavg import DHT
from swarmavg.accumulator import Accumulator, Group

pytestmark = pytest.mark.timeout(120)

ROUNDS = 40
W_TRUE = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + i)
    x = torch.randn(32, 4, generator=generator)
    return x, x @ W_TRUE + 0.01 * torch.randn(32, 1, generator=generator)


def loss_of(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return (
            sum(float(torch.nn.functional.mse_loss(model(x), y)) for x, y in map(data, range(3)))
            / 3
        )


def train(i: int, address: str, out: dict[int, dict[str, Any]], ready: threading.Barrier) -> None:
    torch.manual_seed(i)
    model = torch.nn.Sequential(torch.nn.Linear(4, 1))
    X, y = data(i)
    batch_size = len(X)
    # -- the reference's construction lines, with swarmavg's names --
    dht = DHT()
    group = Group("foo_group", dht)
    accumulator = Accumulator("bar", model.parameters(), model.buffers(), group=group)
    accumulator.connect(address)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    # (the test's: every peer is in the cohort before anyone trains)
    deadline = time.monotonic() + 60
    while len(group.members()) < 3 and time.monotonic() < deadline:
        group.update()
        time.sleep(0.05)
    ready.wait()
    initial = loss_of(model)
    # -- the reference's loop (bounded: ROUNDS results, or the deadline) --
    while accumulator.model_version() < ROUNDS and time.monotonic() < deadline:
        # Update the status of the objects across the network
        group.update()
        accumulator.update()

        # 0. Check we are connected.
        if not accumulator.connected():
            time.sleep(0.25)
            continue

        # 1. Synchronize our state.
        if accumulator.wants_state():
            accumulator.set_state({"optimizer": opt.state_dict()})
        if accumulator.has_new_state():
            opt.load_state_dict(accumulator.state()["optimizer"])  # type: ignore[index]

        # 2. Generate our gradients then reduce them.
        if accumulator.wants_gradients():
            y_pred = model(X)
            loss = torch.nn.functional.mse_loss(y_pred, y)
            loss.backward()
            accumulator.reduce_gradients(batch_size)  # has_gradients() -> True after this

        # 3. Step our gradients then reset.
        if accumulator.has_gradients():
            opt.step()
            accumulator.zero_gradients()  # has_gradients() -> False after this
    out[i] = {
        "version": accumulator.model_version(),
        "stats": accumulator.get_gradient_stats(),
        "params": [p.detach().clone() for p in model.parameters()],
        "initial": initial,
        "final": loss_of(model),
        "leader": accumulator.get_leader(),
        "me": str(dht.peer_id),
    }
    ready.wait()  # (nobody leaves while the others train)
    accumulator.shutdown()
    group.shutdown()
    dht.shutdown()


def test_the_reference_loop_trains_among_three_peers_in_threads() -> None:
    with DHT() as broker:  # (moolib's broker: any peer's address would do)
        address = broker.get_visible_maddrs()[0]
        out: dict[int, dict[str, Any]] = {}
        ready = threading.Barrier(3, timeout=90)
        threads = [threading.Thread(target=train, args=(i, address, out, ready)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=110)
    assert sorted(out) == [0, 1, 2]
    assert all(o["version"] == ROUNDS for o in out.values())
    assert len({o["leader"] for o in out.values()}) == 1
    assert all(
        o["stats"] == {"num_gradients": 3, "num_skipped": 0, "batch_size": 96} for o in out.values()
    )
    for o in out.values():  # the same model everywhere, bit for bit
        for mine, first in zip(o["params"], out[0]["params"], strict=True):
            assert torch.equal(mine, first)
    # (every peer started from the leader's model: the greatest name, as all started alone)
    (initial,) = [o["initial"] for o in out.values() if o["me"] == out[0]["leader"]]
    assert out[0]["final"] < 0.5 * initial  # it trains


def test_misuse_raises_a_clear_exception() -> None:
    model = torch.nn.Linear(2, 1)
    with DHT() as dht:
        with pytest.raises(TypeError, match=r"parameters\[1\]"):
            Accumulator("m", [model.weight, "bias"], dht=dht)  # type: ignore[list-item]
        with pytest.raises(TypeError, match=r"dht must be a swarmavg\.DHT"):
            Accumulator("m", model.parameters(), dht=object())  # type: ignore[arg-type]
        with Accumulator("m", model.parameters(), dht=dht) as acc:
            with pytest.raises(ValueError, match="PeerID"):
                acc.connect("/ip4/127.0.0.1/tcp/1")
            with pytest.raises(ValueError, match="n must be an int >= 1"):
                acc.set_parallel_gradients(0)
            with pytest.raises(TypeError, match="version must be an int"):
                acc.set_model_version(1.5)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match=r"state\['opt'\]\[0\]"):
                acc.set_state({"opt": [object()]})
            acc.set_state({"opt": [np.zeros(2), torch.ones(1)]})  # (fine)
            deadline = time.monotonic() + 30
            while not acc.connected() and time.monotonic() < deadline:
                acc.update()
                time.sleep(0.02)
            assert acc.connected()
            assert acc.is_leader()  # (alone: it leads)
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            acc.reduce_gradients(1)
            assert not acc.wants_gradients()
            assert model.weight.grad is not None
            assert not model.weight.grad.any()  # (read and zeroed)
            model.weight.grad += 5
            with pytest.raises(RuntimeError, match="wants_gradients"):
                acc.reduce_gradients(1)
            assert (model.weight.grad == 5).all()  # (refused: left as it was)
            while not acc.has_gradients() and time.monotonic() < deadline:
                acc.update()
                time.sleep(0.02)
            assert (model.weight.grad == 1).all()  # the mean of the one contribution
            assert acc.get_gradient_stats() == {
                "num_gradients": 1,
                "num_skipped": 0,
                "batch_size": 1,
            }
            assert acc.model_version() == 0
            acc.zero_gradients()
            assert acc.model_version() == 1
            with pytest.raises(ValueError, match="batch_size"):
                acc.reduce_gradients(0)
        with pytest.raises(RuntimeError, match="shut down"):
            acc.update()


def train_async(address: str, out: dict[int, dict[str, Any]], ready: threading.Barrier) -> None:
    """The third peer, in async code on an event loop of its own: the same cohort."""
    import anyio

    from swarmavg.aio import DHT as AsyncDHT
    from swarmavg.aio.accumulator import Accumulator as AsyncAccumulator
    from swarmavg.aio.accumulator import Group as AsyncGroup

    async def main() -> None:
        torch.manual_seed(2)
        model = torch.nn.Sequential(torch.nn.Linear(4, 1))
        X, y = data(2)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        async with (
            AsyncDHT([address]) as dht,
            AsyncGroup("foo_group", dht) as group,
            AsyncAccumulator("bar", model.parameters(), model.buffers(), group, dht=dht) as acc,
            anyio.create_task_group() as tg,
        ):

            async def serve_states() -> None:
                while True:
                    await acc.wait_state_request()
                    acc.set_state({"optimizer": opt.state_dict()})

            tg.start_soon(serve_states)
            with anyio.fail_after(60):
                while len(group.members) < 3:  # noqa: ASYNC110 (the test's wait, as the others')
                    await anyio.sleep(0.05)
            ready.wait()  # (blocks this loop a moment: every peer only waits here)
            initial = loss_of(model)
            with anyio.fail_after(60):
                while acc.model_version() < ROUNDS:
                    await acc.wait_state()
                    if acc.has_new_state():
                        opt.load_state_dict(acc.state()["optimizer"])  # type: ignore[index]
                    if acc.wants_gradients():
                        torch.nn.functional.mse_loss(model(X), y).backward()
                        await acc.reduce_gradients(len(X))
                    else:
                        await acc.wait_gradients()
                    if acc.has_gradients():
                        opt.step()
                        acc.zero_gradients()
            out[2] = {
                "version": acc.model_version(),
                "stats": acc.get_gradient_stats(),
                "params": [p.detach().clone() for p in model.parameters()],
                "initial": initial,
                "final": loss_of(model),
                "leader": acc.get_leader(),
                "me": str(dht.peer_id),
            }
            ready.wait()  # (blocks this loop a moment: every peer only waits here)
            tg.cancel_scope.cancel()

    anyio.run(main)


def test_async_and_sync_peers_share_a_cohort() -> None:
    with DHT() as broker:
        address = broker.get_visible_maddrs()[0]
        out: dict[int, dict[str, Any]] = {}
        ready = threading.Barrier(3, timeout=90)
        threads = [threading.Thread(target=train, args=(i, address, out, ready)) for i in range(2)]
        threads.append(threading.Thread(target=train_async, args=(address, out, ready)))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=110)
    assert sorted(out) == [0, 1, 2]
    assert all(o["version"] == ROUNDS for o in out.values())
    for o in out.values():
        assert o["stats"] == {"num_gradients": 3, "num_skipped": 0, "batch_size": 96}
        for mine, first in zip(o["params"], out[0]["params"], strict=True):
            assert torch.equal(mine, first)


def test_the_leaders_regular_update_reaches_a_member_through_update() -> None:
    """moolib's regular update through the facade: at the leader's version, a member's
    ``update()`` copies the leader's whole state as it is now (every ``state_sync_period``;
    the leader's ``wants_state()`` asks its loop for a fresh one, whatever it set before)."""
    nets = []
    for seed in range(2):
        torch.manual_seed(seed)
        nets.append(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)))
    with DHT() as dht_a, DHT(initial_peers=dht_a.get_visible_maddrs()) as dht_b:
        # (buffers come with the regular update alone here: they must be the leader's latest)
        options: dict[str, Any] = {"buffer_sync_period": None, "state_sync_period": 3.0}
        accs = [
            Accumulator("sync", net.parameters(), net.buffers(), dht=dht, **options)
            for net, dht in zip(nets, (dht_a, dht_b), strict=True)
        ]
        try:

            def turn() -> None:
                for acc, net in zip(accs, nets, strict=True):
                    acc.update()
                    if acc.wants_state():
                        acc.set_state({"tag": float(net[0].bias.detach()[0])})
                time.sleep(0.02)

            deadline = time.monotonic() + 60
            while not all(a.connected() for a in accs) or accs[0].get_leader() is None:
                assert time.monotonic() < deadline, "the cohort did not form"
                turn()
            leader = next(i for i, a in enumerate(accs) if a.is_leader())
            member = 1 - leader
            accs[member].state()  # (the join's)
            # a state the leader set before its buffers changed (as at the join): a regular
            # update must not serve it, the version being the same
            accs[leader].set_state({"tag": -1.0})
            with torch.no_grad():
                nets[leader][1].running_mean += 5.0
                for p in nets[member].parameters():
                    p += 1e-3
            while not accs[member].has_new_state():
                assert time.monotonic() < deadline, "the leader's regular update never came"
                turn()
            state: Any = accs[member].state()
            assert state["tag"] == float(nets[leader][0].bias.detach()[0])
            for mine, theirs in zip(
                nets[member].state_dict().values(), nets[leader].state_dict().values(), strict=True
            ):
                assert torch.equal(mine, theirs)
            assert accs[member].model_version() == accs[leader].model_version() == 0
        finally:
            for acc in accs:
                acc.shutdown()
