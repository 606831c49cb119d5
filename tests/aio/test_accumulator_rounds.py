"""The accumulator's anyio shell among peers of one process, on MemoryTransport and virtual
time: several rounds, late joiners, restored checkpoints, members that leave or die mid-round,
parallel slots, and garbage on the wire."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import pytest
import torch

from swarmavg.aio import DHT
from swarmavg.aio.accumulator import METHOD, Accumulator
from swarmavg.errors import AllReduceFailed, RemoteError
from swarmavg.proto.accumulator import AccAck, Count, Hello, SlotTotals
from swarmavg.testing import MemoryNetwork, MemoryTransport, run_on_virtual_time

pytestmark = pytest.mark.timeout(60)


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))


class Peer:
    """A member: its accumulator, model, an optimizer-like user state, and a task answering
    state requests with ``{"step": ..., "momentum": tensor, "tag": tuple}``."""

    def __init__(self, acc: Accumulator, net: torch.nn.Module, dht: DHT) -> None:
        self.acc, self.net, self.dht = acc, net, dht
        self.steps = 0
        self.momentum = torch.zeros(4)
        self.stop = anyio.Event()
        self.stopped = anyio.Event()
        self.scope = anyio.CancelScope()

    def user_state(self) -> dict[str, Any]:
        return {"step": self.steps, "momentum": self.momentum.clone(), "tag": ("sgd", 0.1)}

    async def serve_states(self) -> None:
        while True:
            await self.acc.wait_state_request()
            self.acc.set_state(self.user_state())

    def set_grads(self, value: float) -> None:
        for p in self.net.parameters():
            p.grad = torch.full_like(p, value)

    def step(self) -> None:
        """Apply the result (plain SGD), as a training loop's optimizer does, and read it."""
        with torch.no_grad():
            for p in self.net.parameters():
                assert p.grad is not None
                p -= 0.1 * p.grad
        self.steps += 1
        self.momentum += 1
        self.acc.zero_gradients()

    def grads(self) -> list[torch.Tensor]:
        return [p.grad.clone() for p in self.net.parameters() if p.grad is not None]


class Cohort:
    """Peers, each living in a task of its own (so that any of them can leave at any time)."""

    def __init__(self, tg: anyio.abc.TaskGroup) -> None:
        self.tg = tg
        self.network = MemoryNetwork()
        self.peers: list[Peer] = []
        self.everyone: list[Peer] = []

    async def add(self, seed: int, **options: Any) -> Peer:
        seeds = [a for p in self.peers[:2] for a in p.dht.get_visible_maddrs()]
        peer: Peer = await self.tg.start(self._live, seed, seeds, options)
        self.peers.append(peer)
        self.everyone.append(peer)
        return peer

    async def _live(
        self,
        seed: int,
        seeds: list[str],
        options: dict[str, Any],
        *,
        task_status: anyio.abc.TaskStatus[Peer],
    ) -> None:
        peer: Peer | None = None
        try:
            async with AsyncExitStack() as own:
                dht = await own.enter_async_context(
                    DHT(seeds, transport="memory", transport_options={"network": self.network})
                )
                net = model(seed)
                options = {"state_timeout": 10.0, "round_timeout": 10.0, **options}
                acc = Accumulator(
                    "c", list(net.parameters()), list(net.buffers()), dht=dht, **options
                )
                await own.enter_async_context(acc)
                peer = Peer(acc, net, dht)
                own.enter_context(peer.scope)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(peer.serve_states)
                    task_status.started(peer)
                    await peer.stop.wait()
                    tg.cancel_scope.cancel()
        finally:
            if peer is not None:
                peer.stopped.set()

    async def leave(self, peer: Peer) -> None:
        """As Ctrl+C: the accumulator says so, and the DHT shuts down."""
        self.peers.remove(peer)
        peer.stop.set()
        await peer.stopped.wait()

    async def kill(self, peer: Peer) -> None:
        """As SIGKILL: the node's connections end; nothing is said (its tasks end too)."""
        self.peers.remove(peer)
        peer.scope.cancel()
        await peer.dht.node.aclose()


@asynccontextmanager
async def cohort(n: int, **options: Any) -> AsyncIterator[Cohort]:
    async with anyio.create_task_group() as tg:
        made = Cohort(tg)
        for i in range(n):
            await made.add(i, **options)
        with anyio.fail_after(60):
            for peer in made.peers:
                await peer.acc.wait_state()
        yield made
        with anyio.fail_after(60):
            for peer in made.everyone:
                peer.stop.set()
                await peer.stopped.wait()


async def until(predicate: Callable[[], bool], timeout: float = 60) -> None:
    """Poll (virtual time) until ``predicate()``; bounded."""
    with anyio.fail_after(timeout):
        while not predicate():  # noqa: ASYNC110 (a predicate over several objects)
            await anyio.sleep(0.05)


async def together(*fns: Callable[[], Awaitable[Any]]) -> None:
    async with anyio.create_task_group() as tg:
        for fn in fns:
            tg.start_soon(fn)


def same_model(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


async def one_round(peers: list[Peer], values: list[float], batch: int = 1) -> None:
    """Each peer contributes ``values[i]``; all apply the same result."""
    for peer, value in zip(peers, values, strict=True):
        peer.set_grads(value)
    with anyio.fail_after(60):
        await together(*[lambda p=p: p.acc.reduce_gradients(batch) for p in peers])


def test_several_rounds_apply_the_same_mean_and_version_everywhere() -> None:
    async def main() -> list[list[tuple[int, dict[str, int], float]]]:
        seen: list[list[tuple[int, dict[str, int], float]]] = [[], [], []]
        async with cohort(3) as c:
            peers = c.peers
            assert len({p.acc.get_leader() for p in peers}) == 1
            for r in range(4):
                values = [float(r * 10 + i) for i in range(3)]
                await one_round(peers, values, batch=2)
                for i, peer in enumerate(peers):
                    assert peer.acc.has_gradients()
                    assert not peer.acc.wants_gradients()
                    grads = peer.grads()
                    assert all(
                        torch.equal(g, grads[0].new_full(g.shape, grads[0].flatten()[0]))
                        for g in grads
                    )
                    seen[i].append(
                        (
                            peer.acc.model_version(),
                            peer.acc.get_gradient_stats(),
                            float(grads[0].flatten()[0]),
                        )
                    )
                    peer.step()
                    assert peer.acc.model_version() == r + 1
            assert same_model(peers[0].net, peers[1].net)
            assert same_model(peers[0].net, peers[2].net)
        return seen

    seen = run_on_virtual_time(main)
    assert seen[0] == seen[1] == seen[2]
    assert [v for v, _, _ in seen[0]] == [0, 1, 2, 3]  # (before each result is read)
    assert [g for _, _, g in seen[0]] == [1.0, 11.0, 21.0, 31.0]  # the mean of r*10 + 0,1,2
    assert all(s == {"num_gradients": 3, "num_skipped": 0, "batch_size": 6} for _, s, _ in seen[0])


def test_skips_count_and_an_all_skip_round_applies_zeros() -> None:
    async def main() -> tuple[dict[str, int], dict[str, int], float]:
        async with cohort(3, virtual_batch_size=2) as c:
            a, b, d = c.peers
            a.set_grads(3.0)
            b.set_grads(5.0)
            await together(
                lambda: a.acc.reduce_gradients(1),
                lambda: b.acc.reduce_gradients(1),
                d.acc.skip_gradients,
            )
            stats = d.acc.get_gradient_stats()
            mean = float(d.grads()[0].flatten()[0])
            for p in c.peers:
                p.step()
            # every member skips: below the virtual batch, nothing; the slots open again
            await together(*[p.acc.skip_gradients for p in c.peers])
            assert not any(p.acc.has_gradients() for p in c.peers)
            assert all(p.acc.wants_gradients() for p in c.peers)
            return stats, a.acc.get_gradient_stats(), mean

    stats, again, mean = run_on_virtual_time(main)
    assert stats == again == {"num_gradients": 2, "num_skipped": 1, "batch_size": 2}
    assert mean == 4.0  # the mean over contributions (skips are not zeros)


def test_a_late_joiner_is_connected_only_with_the_leaders_state() -> None:
    async def main() -> None:
        async with cohort(2) as c:
            a, b = c.peers
            for r in range(2):
                await one_round([a, b], [1.0 + r, 3.0 + r])
                a.step()
                b.step()
            a.net[1].running_mean += 7  # (a buffer: travels with the state)
            b.net[1].running_mean += 7
            joiner = await c.add(5)
            assert not joiner.acc.connected()
            assert not joiner.acc.wants_gradients()
            with pytest.raises(RuntimeError, match="wants_gradients"):
                await joiner.acc.reduce_gradients(1)
            with anyio.fail_after(60):
                await joiner.acc.wait_state()
            assert joiner.acc.model_version() == a.acc.model_version() == 2
            assert same_model(joiner.net, a.net)
            assert joiner.acc.has_new_state()
            state: Any = joiner.acc.state()
            assert not joiner.acc.has_new_state()
            assert state["step"] == 2
            assert state["tag"] == ("sgd", 0.1)
            assert torch.equal(state["momentum"], torch.full((4,), 2.0))
            # and the three go on together
            await until(lambda: all(p.acc.wants_gradients() for p in c.peers))
            await one_round(c.peers, [1.0, 2.0, 6.0])
            for p in c.peers:
                assert float(p.grads()[0].flatten()[0]) == 3.0
                p.step()
            assert same_model(joiner.net, a.net)

    run_on_virtual_time(main)


def test_set_model_version_on_a_restored_peer_makes_it_the_leader() -> None:
    async def main() -> None:
        async with cohort(2) as c:
            a, b = c.peers
            await one_round([a, b], [1.0, 1.0])
            a.step()
            b.step()
            await c.leave(b)
            # b comes back from a checkpoint of version 10 (other weights)
            restored_net = model(9)
            restored = await c.add(9, model_version=10)
            assert restored.acc.model_version() == 10
            await until(lambda: a.acc.model_version() == 10 and a.acc.connected())
            assert restored.acc.is_leader()
            assert a.acc.get_leader() == str(restored.dht.peer_id)
            assert same_model(a.net, restored_net)
            await until(lambda: all(p.acc.wants_gradients() for p in c.peers))
            await one_round(c.peers, [2.0, 4.0])
            for p in c.peers:
                p.step()
                assert p.acc.model_version() == 11

    run_on_virtual_time(main)


def test_a_member_that_leaves_mid_count_costs_the_others_no_contribution() -> None:
    async def main() -> None:
        async with cohort(3, virtual_batch_size=3) as c:
            a, b, d = c.peers
            a.set_grads(1.0)
            b.set_grads(3.0)
            # a and b contribute; count 0 waits for d, which leaves instead
            async with anyio.create_task_group() as tg:
                tg.start_soon(a.acc.reduce_gradients, 1)
                tg.start_soon(b.acc.reduce_gradients, 1)
                await anyio.wait_all_tasks_blocked()
                await c.leave(d)
            # (they returned at the epoch change, their contributions kept)
            assert not a.acc.has_gradients()
            await until(lambda: a.acc.wants_gradients() and b.acc.wants_gradients())
            await one_round([a, b], [5.0, 7.0])
            for p in (a, b):
                assert p.acc.get_gradient_stats() == {
                    "num_gradients": 4,
                    "num_skipped": 0,
                    "batch_size": 4,
                }
                assert float(p.grads()[0].flatten()[0]) == (1 + 3 + 5 + 7) / 4

    run_on_virtual_time(main)


def test_a_member_that_dies_in_the_allreduce_costs_the_others_no_contribution() -> None:
    async def main() -> None:
        async with cohort(3) as c:
            a, b, d = c.peers

            async def die(*args: Any, **kwargs: Any) -> Any:
                await anyio.sleep(0.001)
                await c.kill(d)
                await anyio.sleep_forever()

            d.acc.allreduce.run = die  # type: ignore[method-assign]
            a.set_grads(2.0)
            b.set_grads(4.0)
            d.set_grads(100.0)

            async def dead_call() -> None:
                with contextlib.suppress(RuntimeError):  # (it is dead: what it raises is moot)
                    await d.acc.reduce_gradients(1)

            async with anyio.create_task_group() as tg:
                tg.start_soon(a.acc.reduce_gradients, 1)
                tg.start_soon(b.acc.reduce_gradients, 1)
                tg.start_soon(dead_call)
                await until(lambda: d not in c.peers)
                await anyio.wait_all_tasks_blocked()
                tg.cancel_scope.cancel()  # (d's own call: it is dead)
            # (their calls returned at the epoch change, the contributions kept); the next
            # round, among a and b alone, carries them
            assert not a.acc.has_gradients()
            await until(lambda: a.acc.wants_gradients() and b.acc.wants_gradients())
            await one_round([a, b], [6.0, 8.0])
            for p in (a, b):
                assert p.acc.get_gradient_stats()["num_gradients"] == 4
                assert float(p.grads()[0].flatten()[0]) == (2 + 4 + 6 + 8) / 4
                p.step()
                assert p.acc.model_version() == 1
            assert same_model(a.net, b.net)

    run_on_virtual_time(main)


def test_a_gradient_phase_that_fails_while_everyone_answers_is_retried_in_a_new_epoch() -> None:
    """Nobody leaves, so nothing else would end the epoch: the slot would stay stuck."""

    async def main() -> None:
        async with cohort(3) as c:
            a = c.peers[0]
            run = a.acc.allreduce.run
            calls = 0

            async def flaky(*args: Any, **kwargs: Any) -> Any:
                nonlocal calls
                calls += 1
                if calls == 1:
                    raise AllReduceFailed("injected")
                return await run(*args, **kwargs)

            a.acc.allreduce.run = flaky  # type: ignore[method-assign]
            await one_round(c.peers, [1.0, 2.0, 3.0])
            # (every call returned at the new epoch, without a result, contributions kept)
            assert not any(p.acc.has_gradients() for p in c.peers)
            await until(lambda: all(p.acc.wants_gradients() for p in c.peers))
            await one_round(c.peers, [5.0, 6.0, 7.0])
            for p in c.peers:
                assert p.acc.get_gradient_stats()["num_gradients"] == 6
                assert float(p.grads()[0].flatten()[0]) == 4.0
                p.step()
                assert p.acc.model_version() == 1
            assert calls == 2

    run_on_virtual_time(main)


def cable(peer: Peer) -> MemoryTransport:
    transport = peer.dht.node._transports["memory"]
    assert isinstance(transport, MemoryTransport)
    return transport


async def contribute_until_a_result(peer: Peer, value: float) -> None:
    """Contribute ``value``, then skip until a result comes (a call returns early, its
    contribution kept, when the cohort changes); bounded."""
    peer.set_grads(value)
    await peer.acc.reduce_gradients(1)
    with anyio.fail_after(120):
        while not peer.acc.has_gradients():
            await until(lambda: peer.acc.wants_gradients() or peer.acc.has_gradients())
            if peer.acc.wants_gradients():
                await peer.acc.skip_gradients()


def test_a_link_down_for_a_moment_does_not_split_the_cohort() -> None:
    """d's cable is pulled for 3 s (round_timeout is 10 s) while every member contributes:
    the counts to and from d are lost and their calls time out. They are sent again, so the
    round completes among all three, in the same epoch (one message lost used to make the
    sender suspect d, and d the others: two views, each applying its own result)."""

    async def main() -> None:
        async with cohort(3) as c:
            a, b, d = c.peers
            epochs = [p.acc.group.epoch for p in c.peers]
            for p, value in zip(c.peers, (1.0, 2.0, 6.0), strict=True):
                p.set_grads(value)
            cable(d).set_link(False)
            async with anyio.create_task_group() as tg:
                for p in c.peers:
                    tg.start_soon(p.acc.reduce_gradients, 1)
                await anyio.sleep(3)
                cable(d).set_link(True)
            assert [p.acc.group.epoch for p in c.peers] == epochs
            for p in c.peers:
                assert p.acc.has_gradients()
                assert p.acc.get_gradient_stats()["num_gradients"] == 3
                assert float(p.grads()[0].flatten()[0]) == 3.0
                p.step()
            assert same_model(a.net, d.net)
            assert same_model(b.net, d.net)

    run_on_virtual_time(main)


@pytest.mark.parametrize("delivered", [False, True])
def test_a_call_cut_mid_way_is_sent_again_not_taken_as_a_refusal(delivered: bool) -> None:
    """a's count to d is cut mid-call ("interrupted": the connection reset), before d got it
    or after: it is sent again (d refuses a copy it already has, which is an answer), so the
    round completes among all three in the same epoch. Taken as a refusal, the count was
    never sent again: d waited for it for ``round_timeout``, then suspected a."""

    async def main() -> None:
        async with cohort(3) as c:
            a, _, d = c.peers
            epochs = [p.acc.group.epoch for p in c.peers]
            rpc = a.dht.node.rpc
            real_call = rpc.call
            cut: list[Any] = []

            async def call(address: Any, method: str, message: Any, **kwargs: Any) -> Any:
                to_d = address == a.acc.group.addresses[d.dht.peer_id]
                if isinstance(message, Count) and to_d and not cut:
                    cut.append(message)
                    if delivered:
                        await real_call(address, method, message, **kwargs)
                    raise RemoteError(
                        f"call {method!r} was interrupted: connection reset", code="interrupted"
                    )
                return await real_call(address, method, message, **kwargs)

            rpc.call = call  # type: ignore[method-assign]
            with anyio.fail_after(5):  # (well under round_timeout: nobody waited it out)
                await one_round(c.peers, [1.0, 2.0, 6.0])
            assert cut
            assert [p.acc.group.epoch for p in c.peers] == epochs
            for p in c.peers:
                assert p.acc.get_gradient_stats()["num_gradients"] == 3
                assert float(p.grads()[0].flatten()[0]) == 3.0

    run_on_virtual_time(main)


def test_a_cohort_split_by_a_long_cut_is_one_again_once_the_link_is_back() -> None:
    """d's cable is pulled for 30 s while every member contributes: a and b go on without
    d, and d without them, each side applying its own result (the same version, other
    models). Once the cable is back they hear from each other, their views merge, the side
    behind the new leader takes its state, and the next results are the cohort's again:
    one leader, one model."""

    async def main() -> None:
        async with cohort(3) as c:
            a, b, d = c.peers
            cable(d).set_link(False)
            async with anyio.create_task_group() as tg:
                for p, value in zip(c.peers, (1.0, 2.0, 6.0), strict=True):
                    tg.start_soon(contribute_until_a_result, p, value)
                await anyio.sleep(30)
                cable(d).set_link(True)
            # (each side's result holds its own contributions only)
            assert float(a.grads()[0].flatten()[0]) == 1.5
            assert float(d.grads()[0].flatten()[0]) == 6.0
            assert a.acc.get_gradient_stats()["num_gradients"] == 2
            assert d.acc.get_gradient_stats()["num_gradients"] == 1
            for p in c.peers:
                p.step()
                assert p.acc.model_version() == 1
            assert not same_model(a.net, d.net)

            def one_cohort() -> bool:
                return (
                    len({p.acc.group.epoch for p in c.peers}) == 1
                    and len({p.acc.get_leader() for p in c.peers}) == 1
                    and all(p.acc.connected() for p in c.peers)
                )

            await until(one_cohort)
            await one_round(c.peers, [3.0, 4.0, 5.0])
            for p in c.peers:
                assert p.acc.get_gradient_stats()["num_gradients"] == 3
                p.step()
                assert p.acc.model_version() == 2
            assert same_model(a.net, d.net)
            assert same_model(b.net, d.net)

    run_on_virtual_time(main)


def test_parallel_gradients_apply_in_order() -> None:
    async def main() -> list[list[float]]:
        got: list[list[float]] = []
        async with cohort(3, parallel_gradients=2) as c:

            async def member(peer: Peer, i: int) -> None:
                seen: list[float] = []
                peer.set_grads(float(i + 1))
                await peer.acc.reduce_gradients(1, wait=False)
                assert peer.acc.wants_gradients()  # slot 1 is open
                peer.set_grads(float(10 + i))
                await peer.acc.reduce_gradients(1, wait=False)
                for _ in range(2):
                    with anyio.fail_after(60):
                        await peer.acc.wait_gradients()
                    seen.append(float(peer.grads()[0].flatten()[0]))
                    peer.step()
                got.append(seen)

            await together(*[lambda p=p, i=i: member(p, i) for i, p in enumerate(c.peers)])
            assert all(p.acc.model_version() == 2 for p in c.peers)
        return got

    got = run_on_virtual_time(main)
    assert got == [[2.0, 11.0]] * 3  # (the mean of 1, 2, 3, then of 10, 11, 12)


def test_garbage_on_acc_msg_is_refused_with_a_typed_error_and_the_cohort_goes_on() -> None:
    async def main() -> None:
        async with cohort(2) as c:
            a, b = c.peers
            epoch = a.acc.core.epoch
            assert epoch is not None
            address = b.acc.group.addresses[b.dht.peer_id]
            bad = [
                Count(epoch, 10**6, SlotTotals(1, 1, 0), 1),  # too far ahead
                Count(epoch, 0, SlotTotals(1, 1, 0), 99),  # another virtual batch size
                Hello(epoch, 3),  # a second hello in this epoch
                AccAck(epoch),  # not a request
            ]
            for message in bad:
                with pytest.raises(RemoteError):
                    await a.dht.node.rpc.call(address, METHOD, message, response_type=AccAck)
            await one_round([a, b], [1.0, 3.0])
            for p in (a, b):
                assert float(p.grads()[0].flatten()[0]) == 2.0

    run_on_virtual_time(main)


def test_a_contribution_the_cohort_cannot_take_yet_waits_for_the_next_count() -> None:
    """The sync facade's contribution (allowed by its last snapshot) that comes while the
    cohort cannot take one (it changed since, or the slot is busy) is queued, not refused:
    it goes to the next count the cohort allows, and the result holds it."""

    async def main() -> tuple[list[float], list[dict[str, int]], bool]:
        async with cohort(2) as c:
            a, b = c.peers
            a.set_grads(1.0)
            await a.acc.reduce_gradients(1, wait=False)  # (the only slot is counting)
            assert not a.acc.core.wants_gradients()
            a.set_grads(3.0)
            a.acc._contribute_nowait(1, a.acc._read_grads())  # queued
            queued = not a.acc._snapshot()["wants_gradients"]
            b.set_grads(5.0)
            await b.acc.reduce_gradients(1)
            await a.acc.wait_gradients()
            assert a.grads()[0].flatten()[0] == 3.0  # (1 + 5) / 2
            a.step()
            b.step()  # a's queued gradient went to this count
            b.set_grads(7.0)
            await b.acc.reduce_gradients(1)
            await a.acc.wait_gradients()
            means = [float(p.grads()[0].flatten()[0]) for p in (a, b)]
            stats = [p.acc.get_gradient_stats() for p in (a, b)]
        return means, stats, queued

    means, stats, queued = run_on_virtual_time(main)
    assert queued  # (the snapshot says no more until the queued one is in)
    assert means == [5.0, 5.0]  # (3 + 7) / 2
    assert stats == [{"num_gradients": 2, "num_skipped": 0, "batch_size": 2}] * 2


def buffers_of(peer: Peer) -> list[torch.Tensor]:
    return [b.clone() for b in peer.net.buffers()]


def test_every_member_copies_the_leaders_buffers_each_buffer_sync_period() -> None:
    async def main() -> None:
        async with cohort(3, buffer_sync_period=12.0) as c:
            leader = next(p for p in c.peers if p.acc.is_leader())
            members = [p for p in c.peers if p is not leader]
            # buffers are each member's own between syncs (e.g. batch-norm statistics)
            leader.net[1].running_mean += 5.0
            members[0].net[1].running_var *= 3.0
            params = [[t.clone() for t in p.net.parameters()] for p in c.peers]
            await until(lambda: all(p.acc.syncs["buffers"] >= 1 for p in members), 30)
            for peer in members:
                assert all(
                    torch.equal(x, y)
                    for x, y in zip(buffers_of(peer), buffers_of(leader), strict=True)
                )
            assert float(leader.net[1].running_mean[0]) != 0.0  # (the leader's own, kept)
            assert leader.acc.syncs["buffers"] == 0
            for peer, before in zip(c.peers, params, strict=True):  # (buffers only)
                assert all(
                    torch.equal(x, y) for x, y in zip(peer.net.parameters(), before, strict=True)
                )
            # and again at the next period
            leader.net[1].running_mean += 1.0
            await until(lambda: all(p.acc.syncs["buffers"] >= 2 for p in members), 30)
            assert all(same_model(p.net, leader.net) for p in members)

    run_on_virtual_time(main)


def test_without_a_buffer_sync_period_buffers_stay_each_members_own() -> None:
    async def main() -> None:
        async with cohort(2, buffer_sync_period=None) as c:
            a, b = c.peers
            a.net[1].running_mean += 5.0
            await anyio.sleep(60)
            assert not same_model(a.net, b.net)
            assert a.acc.syncs == b.acc.syncs == {"buffers": 0, "state": 0}

    run_on_virtual_time(main)


def test_a_regular_update_copies_the_leaders_state_only_into_its_own_version() -> None:
    async def main() -> None:
        async with cohort(2, state_sync_period=50.0, buffer_sync_period=None) as c:
            leader = next(p for p in c.peers if p.acc.is_leader())
            (member,) = [p for p in c.peers if p is not leader]
            await one_round(c.peers, [1.0, 3.0])
            leader.step()
            # the member's result is unread (its user has not stepped yet): the leader's
            # state of the next version is not its model, so it is not taken
            assert member.acc.has_gradients()
            await anyio.sleep(60)
            assert member.acc.syncs["state"] == 0
            member.step()
            # drifted (as if a kernel rounded otherwise), with its own user state
            with torch.no_grad():
                for p in member.net.parameters():
                    p += 1e-3
            member.momentum += 100
            member.acc.state()  # (clears has_new_state of the join)
            await until(lambda: member.acc.syncs["state"] >= 1, 60)
            assert member.acc.model_version() == leader.acc.model_version() == 1
            assert same_model(member.net, leader.net)
            assert member.acc.has_new_state()
            state: Any = member.acc.state()
            assert torch.equal(state["momentum"], leader.momentum)
            assert leader.acc.syncs["state"] == 0

    run_on_virtual_time(main)


def test_a_member_that_keeps_failing_the_gradient_phase_is_left_out() -> None:
    """A member that answers every message but never takes part in the all-reduce: each
    retry (a new epoch) would fail the same way; after three failed phases that name it, the
    others leave it out of their view and train."""

    async def main() -> list[float]:
        async with cohort(3) as c:
            bad = c.peers[2]

            async def absent(*args: Any, **kwargs: Any) -> Any:
                raise AllReduceFailed("injected: never takes part")

            bad.acc.allreduce.run = absent  # type: ignore[method-assign]
            good = c.peers[:2]
            async with anyio.create_task_group() as tg:
                # (it contributes, and answers every count: it is never silent)
                tg.start_soon(contribute_until_a_result, bad, 5.0)
                with anyio.fail_after(600):
                    await together(*[lambda p=p: contribute_until_a_result(p, 2.0) for p in good])
                tg.cancel_scope.cancel()
            members = {tuple(sorted(map(str, p.acc.group.members))) for p in good}
            assert members == {tuple(sorted(str(p.dht.peer_id) for p in good))}
            means = [float(p.grads()[0].flatten()[0]) for p in good]
            for p in good:
                p.step()
            return means

    assert run_on_virtual_time(main) == [2.0, 2.0]
