"""``swarmavg.aio.DecentralizedAverager`` with several real peers (MemoryTransport)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any, TypeVar

import anyio
import msgpack
import pytest
import torch
from averager_swarm import averagers as _averagers
from averager_swarm import step_all as _step_all

from swarmavg import get_dht_time
from swarmavg.abc import AllReduceRunner, Group, GroupInfo, GroupMember, Matchmaker
from swarmavg.aio import DHT
from swarmavg.aio.allreduce import AllReduceFailed, AllReduceService
from swarmavg.aio.averager import (
    AveragingStage,
    DecentralizedAverager,
    MatchmakingFailed,
    StepControl,
    _unpack_gathered,
)
from swarmavg.compression import (
    Float16Compression,
    RoleAdaptiveCompression,
    TensorInfo,
    Uniform8BitQuantization,
)
from swarmavg.testing import MemoryNetwork

pytestmark = pytest.mark.anyio

R = TypeVar("R", bound=AllReduceRunner)


async def test_four_peers_average_in_place_and_gather() -> None:
    torch.manual_seed(0)
    tensors = [
        [torch.randn(100, 10), torch.randn(7, dtype=torch.float64), torch.randn(3).half()]
        for _ in range(4)
    ]
    weights = [1.0, 2.0, 0.5, 0.0]
    expected = [
        sum(t[k].double() * w for t, w in zip(tensors, weights, strict=True)) / sum(weights)
        for k in range(3)
    ]
    async with _averagers(tensors, prefix="test", target_group_size=4) as averagers:
        results = await _step_all(averagers, gather=[{"rank": i} for i in range(4)], weight=weights)
        for averager in averagers:
            with averager.get_tensors() as own:
                torch.testing.assert_close(own[0].double(), expected[0], atol=1e-5, rtol=0)
                torch.testing.assert_close(own[1], expected[1], atol=1e-12, rtol=0)
                torch.testing.assert_close(own[2].double(), expected[2], atol=2e-3, rtol=0)
        peers = [a.dht.peer_id for a in averagers]
    for result in results:
        assert dict(result) == {peers[i]: {"rank": i} for i in range(4)}
        assert result.group_size == 4
        assert set(result.contributors) == set(peers[:3])  # weight 0 does not contribute
        assert result.total_weight == pytest.approx(3.5)
        assert result.matchmaking_seconds >= 0
        assert result.allreduce_seconds > 0


async def test_a_grid_of_eight_reaches_the_exact_mean_in_three_rounds() -> None:
    tensors = [[torch.full((50,), float(i))] for i in range(8)]
    bits = [format(i // 2, "02b") for i in range(8)]  # four groups of two
    async with _averagers(tensors, prefix="grid", target_group_size=2) as averagers:
        for averager, own_bits in zip(averagers, bits, strict=True):
            averager.set_group_bits(own_bits)
        spreads = []
        for _ in range(3):
            await _step_all(averagers, timeout=10)
            values = []
            for averager in averagers:
                with averager.get_tensors() as own:
                    values.append(own[0].clone())
            mean = torch.stack(values).mean()
            assert mean.item() == pytest.approx(3.5)  # the mean is preserved each round
            spreads.append((torch.stack(values).max() - torch.stack(values).min()).item())
    assert spreads[-1] < 1e-6
    assert spreads[0] > 0.1


async def test_too_few_peers_raise_matchmaking_failed_in_time() -> None:
    async with _averagers([[torch.zeros(3)]], prefix="lonely", target_group_size=2) as (avg,):
        started = anyio.current_time()
        with pytest.raises(MatchmakingFailed):
            await avg.step(timeout=0.5, allow_retries=False)
        assert anyio.current_time() - started == pytest.approx(0.5, abs=1e-3)  # its timeout


async def test_bad_arguments_are_named() -> None:
    network = MemoryNetwork()
    async with DHT(transport="memory", transport_options={"network": network}) as dht:
        with pytest.raises(TypeError, match="floating point"):
            DecentralizedAverager(
                [torch.zeros(3, dtype=torch.int64)], dht, prefix="x", target_group_size=2
            )
        with pytest.raises(ValueError, match="averaging_alpha"):
            DecentralizedAverager(
                [torch.zeros(3)], dht, prefix="x", target_group_size=2, averaging_alpha=2
            )
        with pytest.raises(ValueError, match="bits"):
            DecentralizedAverager(
                [torch.zeros(3)], dht, prefix="y", target_group_size=2, initial_group_bits="2"
            )


async def test_argument_errors_name_what_the_user_passed() -> None:
    network = MemoryNetwork()
    async with DHT(transport="memory", transport_options={"network": network}) as dht:

        def make(tensors: Any = None, **options: Any) -> DecentralizedAverager:
            options = {"prefix": "x", "target_group_size": 2, **options}
            return DecentralizedAverager(
                [torch.zeros(3)] if tensors is None else tensors, dht, **options
            )

        checks: list[tuple[type[Exception], str, Any, dict[str, Any]]] = [
            # (the error, what its message says, the tensors, the options)
            (TypeError, r"averaged_tensors\[1\] is a numpy.ndarray, not a torch.Tensor",
             [torch.zeros(3), torch.zeros(3).numpy()], {}),
            (TypeError, r"averaged_tensors\[0\] is a builtins.list", [[1.0, 2.0]], {}),
            (TypeError, r"averaged_tensors\[0\] is torch.int64", [torch.zeros(3).long()], {}),
            (TypeError, "not a single tensor: pass \\[tensor\\]", torch.zeros(3), {}),
            (TypeError, "not a mapping", {"w": torch.zeros(3)}, {}),
            (TypeError, "averaged_tensors must be an iterable of tensors, not int", 3, {}),
            (ValueError, "averaged_tensors is empty", iter([]), {}),
            (ValueError, "min_group_size=3 is larger than target_group_size=2", None,
             {"min_group_size": 3}),
            (ValueError, "target_group_size must be an int >= 1, not 0", None,
             {"target_group_size": 0}),
            (TypeError, "target_group_size must be an int, not 2.0", None,
             {"target_group_size": 2.0}),
            (TypeError, "min_group_size must be an int, not True", None,
             {"min_group_size": True}),
            (TypeError, "request_timeout must be a number of seconds, not True", None,
             {"request_timeout": True}),
            (ValueError, "averaging_expiration must be a positive, finite", None,
             {"averaging_expiration": float("inf")}),
            (TypeError, "allreduce_timeout must be a number of seconds or None", None,
             {"allreduce_timeout": "60"}),
            (TypeError, "averaging_alpha must be a number, not '1'", None,
             {"averaging_alpha": "1"}),
            (TypeError, "part_size_bytes must be an int", None, {"part_size_bytes": 4096.0}),
            (ValueError, "bandwidth must be a finite number >= 0", None, {"bandwidth": -1}),
            (TypeError, "min_vector_size must be an int", None, {"min_vector_size": None}),
            (TypeError, "auxiliary must be a bool", None, {"auxiliary": 1}),
            (TypeError, "client_mode must be a bool", None, {"client_mode": "no"}),
            (TypeError, "error_feedback must be a bool", None, {"error_feedback": 0}),
            (TypeError, "prefix must be a str", None, {"prefix": b"x"}),
            (TypeError, "matchmaker must be a swarmavg.abc.Matchmaker", None,
             {"matchmaker": object()}),
            (TypeError, "declare_state_period must be a number of seconds", None,
             {"declare_state_period": False}),
            (ValueError, "state_max_donors must be an int >= 1", None, {"state_max_donors": 0}),
            (ValueError, "min_matchmaking_time must be a positive, finite", None,
             {"min_matchmaking_time": 0}),
            (ValueError, "pass averaging_expiration or min_matchmaking_time", None,
             {"min_matchmaking_time": 5.0, "averaging_expiration": 3.0}),
        ]  # fmt: skip
        for error, message, tensors, options in checks:
            with pytest.raises(error, match=message):
                make(tensors, **options)
        with pytest.raises(TypeError, match=r"dht must be a swarmavg\.aio\.DHT, not str"):
            DecentralizedAverager([torch.zeros(3)], "dht", prefix="x", target_group_size=2)  # type: ignore[arg-type]
        # none of those claimed the prefix; a generator (model.parameters()) is fine, and
        # min_group_size follows a target of one
        model = torch.nn.Linear(3, 2)
        averager = make(model.parameters(), target_group_size=1)
        assert len(averager._tensors) == 2
        assert (averager.target_group_size, averager.min_group_size) == (1, 1)
        assert make(prefix="y").min_group_size == 2
        # hivemind 1.1's name for the matchmaking window
        assert make(prefix="z", min_matchmaking_time=4.0).averaging_expiration == 4.0


class _FixedGroup(Matchmaker):
    """A matchmaker that hands out one group known in advance (the protocol swapped out)."""

    def __init__(self, group: Group, gathered: dict[Any, bytes]) -> None:
        self.group = group
        self.gathered = gathered
        self.calls: list[str] = []

    async def look_for_group(self, bits: str, *, gather: bytes, begin_at: float) -> GroupInfo:
        self.calls.append(bits)
        return GroupInfo(self.group, self.gathered, self.group.members[0].peer_id)


async def test_the_matchmaker_can_be_swapped_out() -> None:
    network = MemoryNetwork()
    tensors = [[torch.full((20,), float(i))] for i in range(3)]
    async with AsyncExitStack() as stack:
        dhts = [
            await stack.enter_async_context(
                DHT(transport="memory", transport_options={"network": network})
            )
            for _ in range(3)
        ]
        group = Group(
            b"fixed-group-id-0",
            tuple(GroupMember(d.peer_id, d.node.addresses[0]) for d in dhts),
        )
        gathered = {d.peer_id: msgpack.packb(i) for i, d in enumerate(dhts)}
        fixed = [_FixedGroup(group, gathered) for _ in dhts]
        averagers = [
            await stack.enter_async_context(
                DecentralizedAverager(
                    own, dht, prefix="fixed", target_group_size=3, matchmaker=matchmaker
                )
            )
            for own, dht, matchmaker in zip(tensors, dhts, fixed, strict=True)
        ]
        results = await _step_all(averagers)
        for averager in averagers:
            with averager.get_tensors() as own:
                assert torch.equal(own[0], torch.full((20,), 1.0))
    assert all(m.calls == [""] for m in fixed)
    assert dict(results[0]) == {d.peer_id: i for i, d in enumerate(dhts)}


async def test_bad_step_arguments_and_garbage_metadata() -> None:
    async with _averagers([[torch.zeros(3)]], prefix="args", target_group_size=2) as (avg,):
        with pytest.raises(TypeError, match="gather"):
            await avg.step(gather=object())
        with pytest.raises(ValueError, match="timeout"):
            await avg.step(timeout=-1)
        for weight in (float("nan"), -1.0, 2e9):  # (2e9: past MAX_WEIGHT, Trust I's F1)
            with pytest.raises(ValueError, match="weight must be a number from 0 to 1e"):
                await avg.step(weight=weight)
    peer = avg.dht.peer_id
    assert _unpack_gathered(peer, b"\xc1") is None  # never valid msgpack
    assert _unpack_gathered(peer, msgpack.packb({"a": 1})) == {"a": 1}


async def _wait_for_stage(controls: Sequence[StepControl], stage: AveragingStage) -> None:
    for _ in range(750):  # 15 s
        if all(c.stage is stage for c in controls):
            return
        await anyio.sleep(0.02)
    raise AssertionError(f"stages {[c.stage for c in controls]}, not all {stage}")


async def test_a_triggered_step_waits_in_its_group_and_takes_the_weights_set_meanwhile() -> None:
    tensors = [[torch.full((20,), float(i))] for i in range(3)]
    async with _averagers(tensors, prefix="trig", target_group_size=3) as averagers:
        controls = [await a.step(wait=False, require_trigger=True, timeout=10) for a in averagers]
        assert all(isinstance(c, StepControl) for c in controls)
        await _wait_for_stage(controls, AveragingStage.AWAITING_TRIGGER)
        await anyio.sleep(0.3)  # in a group, yet nothing is averaged before the trigger
        for i, averager in enumerate(averagers):
            with averager.get_tensors() as own:
                assert own[0][0].item() == float(i)
        for control, weight in zip(controls, [1.0, 0.0, 3.0], strict=True):
            control.weight = weight
        with pytest.raises(ValueError, match="weight"):
            controls[0].weight = -1.0
        controls[2].allow_allreduce()
        controls[0].allow_allreduce()
        await anyio.sleep(0.2)
        assert controls[0].stage is AveragingStage.RUNNING_ALLREDUCE  # waits for peer 1
        controls[1].allow_allreduce()
        with anyio.fail_after(15):
            results = [await c for c in controls]
        expected = (0.0 * 1.0 + 2.0 * 3.0) / 4.0
        for averager in averagers:
            with averager.get_tensors() as own:
                torch.testing.assert_close(own[0], torch.full((20,), expected))
        assert results[0].total_weight == 4.0
        assert set(results[0].contributors) == {averagers[0].dht.peer_id, averagers[2].dht.peer_id}
        assert all(c.stage is AveragingStage.FINISHED and c.done() for c in controls)
        with pytest.raises(RuntimeError, match="weight cannot change"):
            controls[0].weight = 2.0


async def test_cancelling_a_step_in_a_group_tells_the_groupmates_who_go_on() -> None:
    tensors = [[torch.full((20,), float(i))] for i in range(3)]
    async with _averagers(
        tensors, prefix="cancel", target_group_size=3, allreduce_timeout=30
    ) as averagers:
        controls = [await a.step(wait=False, require_trigger=True, timeout=10) for a in averagers]
        await _wait_for_stage(controls, AveragingStage.AWAITING_TRIGGER)
        controls[0].allow_allreduce()
        controls[1].allow_allreduce()
        await anyio.sleep(0.2)  # members 0 and 1 are averaging, waiting for member 2
        started = anyio.current_time()
        assert controls[2].cancel()
        with anyio.fail_after(10):
            results = [await control for control in controls[:2]]
        assert anyio.current_time() - started < 0.01  # told, not timed out (30 s)
        assert all(r.group_size == 3 for r in results)
        with pytest.raises(concurrent.futures.CancelledError):
            await controls[2]
        assert not controls[2].cancel()  # already over
        with averagers[2].get_tensors() as own:  # the leaver took nothing
            assert torch.equal(own[0], torch.full((20,), 2.0))
        survivors = []
        for i, averager in enumerate(averagers[:2]):
            with averager.get_tensors() as own:
                # averaged between the survivors, but for the leaver's span (kept local)
                assert all(v in (0.5, float(i)) for v in own[0].tolist())
                assert 0.5 in own[0].tolist()
                survivors.append(own[0].clone())
        averaged = survivors[0] == 0.5
        assert torch.equal(averaged, survivors[1] == 0.5)  # the same parts, for both
        # the averagers still work afterwards
        for averager, value in zip(averagers, (0.0, 1.0, 2.0), strict=True):
            with averager.get_tensors() as own:
                own[0].fill_(value)
        await _step_all(averagers, timeout=10)
        with averagers[0].get_tensors() as own:
            torch.testing.assert_close(own[0], torch.full((20,), 1.0))


async def test_a_step_waiting_for_its_trigger_needs_wait_false() -> None:
    async with _averagers([[torch.zeros(3)]], prefix="t", target_group_size=2) as (avg,):
        with pytest.raises(ValueError, match="require_trigger"):
            await avg.step(require_trigger=True)


async def test_bfloat16_and_non_contiguous_tensors_are_averaged_in_place() -> None:
    torch.manual_seed(3)
    tensors = []
    for _ in range(3):
        base = torch.randn(12, 8)
        tensors.append([base.t(), torch.randn(5, 4).to(torch.bfloat16), torch.randn(6)[::2]])
    assert not tensors[0][0].is_contiguous()
    assert not tensors[0][2].is_contiguous()
    expected = [sum(t[k].double() for t in tensors) / 3 for k in range(3)]
    storages = [[t.data_ptr() for t in own] for own in tensors]
    async with _averagers(tensors, prefix="layouts", target_group_size=3) as averagers:
        for _ in range(2):  # the flat buffers are reused from round to round
            await _step_all(averagers, timeout=10)
        for averager, pointers in zip(averagers, storages, strict=True):
            with averager.get_tensors() as own:
                assert [t.data_ptr() for t in own] == pointers  # updated in place
                torch.testing.assert_close(own[0].double(), expected[0], atol=1e-6, rtol=0)
                assert own[1].dtype == torch.bfloat16
                torch.testing.assert_close(own[1].double(), expected[1], atol=2e-2, rtol=0)
                torch.testing.assert_close(own[2].double(), expected[2], atol=1e-6, rtol=0)


async def test_parameters_are_written_in_place_where_autograd_sees_it() -> None:
    # (plain contiguous CPU tensors are copied with numpy, which bypasses torch's version
    # counter: it is bumped by hand, so a backward through the old values still fails loudly)
    torch.manual_seed(4)
    params = [[torch.nn.Parameter(torch.randn(4, 3)), torch.zeros(0)] for _ in range(2)]
    expected = (params[0][0].detach() + params[1][0].detach()) / 2
    pending = (params[0][0] ** 2).sum()  # saves params[0][0] for its backward
    versions = [own[0]._version for own in params]
    pointers = [own[0].data_ptr() for own in params]
    async with _averagers(params, prefix="autograd", target_group_size=2) as averagers:
        await _step_all(averagers, timeout=10)
    for own, version, pointer in zip(params, versions, pointers, strict=True):
        assert own[0].data_ptr() == pointer
        assert own[0].requires_grad
        assert own[0]._version > version
        torch.testing.assert_close(own[0].detach(), expected, atol=1e-6, rtol=0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        pending.backward()


async def test_parameters_that_torch_copies_are_averaged_too() -> None:
    """Parameters that are not plain contiguous CPU float16/32/64 (bfloat16, strided) are
    written back with torch's ``copy_``: outside grad mode (a leaf that requires grad refuses
    an in-place op in it; ``inference_mode(False)`` had turned grad mode back on, and every
    round of such parameters failed)."""
    torch.manual_seed(6)
    params = [
        [
            torch.nn.Parameter(torch.randn(5, 4).to(torch.bfloat16)),
            torch.nn.Parameter(torch.randn(8, 3).t()),
        ]
        for _ in range(2)
    ]
    assert not params[0][1].is_contiguous()
    expected = [
        (params[0][k].detach().double() + params[1][k].detach().double()) / 2 for k in (0, 1)
    ]
    pending = (params[0][1] ** 2).sum()
    async with _averagers(params, prefix="copied", target_group_size=2) as averagers:
        results = await _step_all(averagers, timeout=10)
    assert all(r.group_size == 2 for r in results)
    for own in params:
        assert all(p.requires_grad for p in own)
        torch.testing.assert_close(own[0].detach().double(), expected[0], atol=2e-2, rtol=0)
        torch.testing.assert_close(own[1].detach().double(), expected[1], atol=1e-6, rtol=0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        pending.backward()


async def test_a_group_that_formed_early_withdraws_its_declarations() -> None:
    tensors = [[torch.full((10,), float(i))] for i in range(3)]
    async with _averagers(
        tensors, prefix="early", target_group_size=3, averaging_expiration=20
    ) as averagers:
        for _ in range(3):  # full groups form long before their declared time (20 s)
            results = await _step_all(averagers, timeout=25)
            assert all(r.group_size == 3 for r in results)
            # stale declarations would pass for leaders and stall the next round for ~20 s
            assert max(r.matchmaking_seconds for r in results) < 5
        with anyio.fail_after(10):
            while True:  # the withdrawals are stored in the background
                found = await averagers[0].dht.get("early.0b", latest=True)
                assert found is not None
                assert len(found.value) == 3
                if all(item.value["looking"] is False for item in found.value.values()):
                    break
                await anyio.sleep(0.05)


class _TrainingAverager(DecentralizedAverager):
    """A subclass, as optimizers make: it must average with plain averagers."""

    steps = 0

    async def step(self, *args: Any, **kwargs: Any) -> Any:
        type(self).steps += 1
        return await super().step(*args, **kwargs)


async def test_a_subclass_and_its_base_class_average_together() -> None:
    network = MemoryNetwork()
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(
            DHT(transport="memory", transport_options={"network": network})
        )
        second = await stack.enter_async_context(
            DHT(
                first.get_visible_maddrs(),
                transport="memory",
                transport_options={"network": network},
            )
        )
        plain = await stack.enter_async_context(
            DecentralizedAverager([torch.zeros(4)], first, prefix="mixed", target_group_size=2)
        )
        derived = await stack.enter_async_context(
            _TrainingAverager([torch.ones(4)], second, prefix="mixed", target_group_size=2)
        )
        results = await _step_all([plain, derived], timeout=10)
    assert _TrainingAverager.steps == 1
    assert all(r.group_size == 2 for r in results)
    for averager in (plain, derived):
        with averager.get_tensors() as own:
            assert torch.equal(own[0], torch.full((4,), 0.5))


async def test_a_groupmate_that_goes_silent_is_done_without_and_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tensors = [[torch.full((30,), float(i))] for i in range(3)]
    async with _averagers(
        tensors,
        prefix="silent",
        target_group_size=3,
        sender_timeout=0.5,
        reducer_timeout=1.0,
        allreduce_timeout=30,
    ) as averagers:
        controls = [await a.step(wait=False, require_trigger=True, timeout=10) for a in averagers]
        await _wait_for_stage(controls, AveragingStage.AWAITING_TRIGGER)
        started = anyio.current_time()
        controls[0].allow_allreduce()
        controls[1].allow_allreduce()  # member 2 never comes (and never says so)
        with anyio.fail_after(10):
            results = [await control for control in controls[:2]]
        # reducer_timeout (virtual time), not allreduce_timeout
        assert anyio.current_time() - started == pytest.approx(1.0, abs=1e-3)
        silent = averagers[2].dht.peer_id
        for result in results:
            assert result.incomplete
            assert [peer for peer, _ in result.local_spans] == [silent]
            assert {sender for _, sender, _ in result.dropped} == {silent}
        values = []
        for averager in averagers[:2]:
            with averager.get_tensors() as own:
                values.append(own[0].clone())
        averaged = values[0] == 0.5
        assert averaged.any()
        assert torch.equal(averaged, values[1] == 0.5)  # the same parts, for both
        # one line in words naming the silent peer, both ways it failed the others
        (line,) = [r.message for r in caplog.records if "not completely" in r.message][:1]
        assert f"peer {silent.short()}'s values were left out by 2 groupmates" in line
        assert f"peer {silent.short()}'s share kept our own values" in line
        controls[2].cancel()


async def test_compressed_averaging_ends_identical_with_per_tensor_codecs() -> None:
    torch.manual_seed(1)
    tensors = [[torch.randn(3000), torch.randn(200, dtype=torch.float64)] for _ in range(4)]
    expected = [sum(t[k].double() for t in tensors) / 4 for k in range(2)]
    compression = RoleAdaptiveCompression(
        gradient=Uniform8BitQuantization(), default=Float16Compression()
    )
    infos = [TensorInfo("gradient", 3000), TensorInfo("parameter", 200)]
    async with _averagers(
        tensors,
        prefix="compressed",
        target_group_size=4,
        compression=compression,
        tensor_infos=infos,
        error_feedback=True,
        part_size_bytes=4096,
    ) as averagers:
        results = await _step_all(averagers)
        own = []
        for averager in averagers:
            with averager.get_tensors() as values:
                own.append([v.clone() for v in values])
    assert all(r.group_size == 4 and not r.incomplete for r in results)
    for values in own[1:]:
        for got, first in zip(values, own[0], strict=True):
            assert torch.equal(got, first)
    assert (own[0][0].double() - expected[0]).abs().max() < 0.1
    assert 0 < (own[0][1] - expected[1]).abs().max() < 3e-3


async def test_compression_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match="codec or a chooser"):
        async with _averagers([[torch.zeros(3)]], prefix="x", target_group_size=2, compression=1):
            pass
    with pytest.raises(ValueError, match="one TensorInfo per averaged tensor"):
        async with _averagers(
            [[torch.zeros(3)]],
            prefix="x",
            target_group_size=2,
            compression=RoleAdaptiveCompression(),
            tensor_infos=[TensorInfo(), TensorInfo()],
        ):
            pass


async def test_a_peer_that_finds_no_group_moves_to_other_bits() -> None:
    async with _averagers([[torch.zeros(3)]], prefix="alone", target_group_size=2) as (avg,):
        old = "0110" * 8  # (new bits are random: the same 32 again is a 2**-32 chance)
        avg.set_group_bits(old)
        with pytest.raises(MatchmakingFailed):
            await avg.step(timeout=0.3)
        bits = avg.get_group_bits()
        assert len(bits) == len(old)
        assert bits != old
        avg.set_group_bits("")  # no bits: nowhere else to go
        with pytest.raises(MatchmakingFailed):
            await avg.step(timeout=0.3)
        assert avg.get_group_bits() == ""


async def test_a_scheduled_time_already_past_counts_as_none() -> None:
    tensors = [[torch.full((4,), float(i))] for i in range(2)]
    async with _averagers(tensors, prefix="late", target_group_size=2) as averagers:
        started = anyio.current_time()
        results = await _step_all(averagers, scheduled_time=get_dht_time() - 10, timeout=8)
        assert anyio.current_time() - started < 5  # (it used to fail every attempt until 8 s)
        assert [r.group_size for r in results] == [2, 2]
        for averager in averagers:
            with averager.get_tensors() as own:
                assert own[0].tolist() == [0.5] * 4


async def test_clip_norm_bounds_what_one_loud_peer_can_do_to_the_mean() -> None:
    tensors = [[torch.full((100,), 1.0)], [torch.full((100,), 1.0)], [torch.full((100,), 1e6)]]
    async with _averagers(tensors, prefix="clip", target_group_size=3, clip_norm=20.0) as avgs:
        await _step_all(avgs, timeout=10)
        for averager in avgs:
            with averager.get_tensors() as own:
                # honest ones have norm 10 (kept); the loud one is cut to norm 20 (2 each)
                torch.testing.assert_close(own[0], torch.full((100,), 4.0 / 3.0))
    with pytest.raises(ValueError, match="clip_norm"):
        async with _averagers([[torch.zeros(2)]], prefix="c", target_group_size=2, clip_norm=-1):
            pass


class _FailsFirst(AllReduceRunner):
    """The node's all-reduce, but the first round scribbles on the buffers and fails."""

    def __init__(self, inner: AllReduceRunner) -> None:
        self.inner = inner
        self.calls = 0

    async def run(self, group: Group, buffers: Any, layout: Any, **options: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            for buffer in buffers:
                buffer[...] = 1e9
            raise AllReduceFailed("injected: the round fell apart")
        return await self.inner.run(group, buffers, layout, **options)


async def _pair_failing_first(
    stack: AsyncExitStack, prefix: str, bits: Sequence[str] = ("", ""), **options: Any
) -> tuple[list[DecentralizedAverager], list[_FailsFirst]]:
    """Two averagers (tensors of 0s and 1s, groups of 2) whose first all-reduce fails."""
    return await _pair(stack, prefix, _FailsFirst, bits, **options)


async def _pair(
    stack: AsyncExitStack,
    prefix: str,
    wrap: Callable[[AllReduceRunner], R],
    bits: Sequence[str] = ("", ""),
    **options: Any,
) -> tuple[list[DecentralizedAverager], list[R]]:
    """Two averagers (tensors of 0s and 1s, groups of 2), each with its node's all-reduce
    wrapped by ``wrap``."""
    network = MemoryNetwork()
    dhts: list[DHT] = []
    for _ in range(2):
        seeds = [a for d in dhts for a in d.get_visible_maddrs()]
        dhts.append(
            await stack.enter_async_context(
                DHT(seeds, transport="memory", transport_options={"network": network})
            )
        )
    runners = [wrap(AllReduceService.for_node(d.node)) for d in dhts]
    averagers = [
        await stack.enter_async_context(
            DecentralizedAverager(
                [torch.full((50,), float(i))],
                dht,
                prefix=prefix,
                target_group_size=2,
                initial_group_bits=own_bits,
                allreduce=runner,
                **options,
            )
        )
        for i, (dht, runner, own_bits) in enumerate(zip(dhts, runners, bits, strict=True))
    ]
    return averagers, runners


@pytest.mark.parametrize("allow_retries", [True, False])
async def test_a_failed_round_is_retried_in_a_new_group_within_the_timeout(
    allow_retries: bool,
) -> None:
    async with AsyncExitStack() as stack:
        averagers, runners = await _pair_failing_first(stack, "retry", averaging_expiration=1.0)
        if not allow_retries:
            with pytest.raises(ExceptionGroup) as caught:
                await _step_all(averagers, timeout=10, allow_retries=False)
            assert all(isinstance(e, AllReduceFailed) for e in caught.value.exceptions)
            for averager, own in zip(averagers, range(2), strict=True):
                with averager.get_tensors() as got:  # untouched by the failed round
                    assert torch.equal(got[0], torch.full((50,), float(own)))
            return
        results = await _step_all(averagers, timeout=10)
        assert [r.calls for r in runners] == [2, 2]
        assert results[0].group_id == results[1].group_id
        for averager in averagers:
            with averager.get_tensors() as got:
                assert torch.equal(got[0], torch.full((50,), 0.5))


async def test_a_failed_round_formed_under_the_prefix_key_is_retried_there() -> None:
    """Two peers under different group bits find no group, meet under the prefix's own key,
    and their round fails: the retry looks under that key again (where the other one looks),
    not under the step's new random bits."""
    async with AsyncExitStack() as stack:
        averagers, runners = await _pair_failing_first(
            stack, "retry_here", "01", averaging_expiration=0.5, request_timeout=0.5
        )
        looked: list[list[str]] = [[], []]
        for averager, log in zip(averagers, looked, strict=True):
            look = averager.matchmaker.look_for_group

            async def spy(bits: str, *, _look: Any = look, _log: Any = log, **kw: Any) -> Any:
                _log.append(bits)
                return await _look(bits, **kw)

            averager.matchmaker.look_for_group = spy  # type: ignore[method-assign]
        results = await _step_all(averagers, timeout=20)
        assert [r.calls for r in runners] == [2, 2]
        assert results[0].group_id == results[1].group_id
        for log, bits in zip(looked, "01", strict=True):
            assert log[0] == bits  # alone under its own bits
            assert log[1:] == ["", ""], log  # met under the prefix key; retried there
        for averager in averagers:
            with averager.get_tensors() as got:
                assert torch.equal(got[0], torch.full((50,), 0.5))


class _NeverRuns(AllReduceRunner):
    """A runner that does not say it works in place (and is never run)."""

    async def run(self, group: Group, buffers: Any, layout: Any, **options: Any) -> Any:
        raise AssertionError("not run in this test")


class _Paused(AllReduceRunner):
    """The node's all-reduce (in place), held at its start until ``go`` is set."""

    in_place = True

    def __init__(self, inner: AllReduceRunner) -> None:
        self.inner = inner
        self.entered = anyio.Event()
        self.go = anyio.Event()
        self.results_valid: Any = None

    async def run(self, group: Group, buffers: Any, layout: Any, **options: Any) -> Any:
        self.results_valid = options.get("results_valid")
        self.entered.set()
        await self.go.wait()
        return await self.inner.run(group, buffers, layout, **options)

    def expect(self, group: Group) -> None:
        self.inner.expect(group)

    async def leave(self, group: Group, reason: str) -> None:
        await self.inner.leave(group, reason)


async def _paused_round(
    stack: AsyncExitStack, prefix: str
) -> tuple[list[DecentralizedAverager], list[_Paused], list[StepControl]]:
    """Two peers whose in-place round has begun (the tensors are held) and is paused."""
    averagers, runners = await _pair(stack, prefix, _Paused)
    controls = [await a.step(wait=False, timeout=10) for a in averagers]
    with anyio.fail_after(10):
        for runner in runners:
            await runner.entered.wait()
    return averagers, runners, controls


async def test_which_tensors_are_averaged_in_place() -> None:
    """A dtype's tensors are averaged in their own memory when they are one plain contiguous
    CPU tensor, or views that lie back to back in one storage in the order given; anything
    else is copied in and out."""
    flat = torch.zeros(10)
    cases: list[tuple[list[torch.Tensor], list[bool]]] = [
        ([torch.zeros(2, 3)], [True]),
        ([flat[:4].view(2, 2), flat[4:]], [True]),  # views of one flat tensor, in order
        ([flat[4:], flat[:4]], [False]),  # out of order
        ([flat[:4], flat[5:]], [False]),  # a gap
        ([torch.zeros(3), torch.zeros(3)], [False]),  # two storages
        ([torch.zeros(4, 4).t()], [False]),  # not contiguous
        ([torch.zeros(3, dtype=torch.bfloat16)], [False]),  # averaged in float32
        ([torch.zeros(3), torch.zeros(2, dtype=torch.float64), torch.zeros(0)], [False, True]),
    ]
    for tensors, expected in cases:
        async with _averagers([tensors], prefix="which", target_group_size=2) as (averager,):
            with averager._lock:
                own = averager._in_place_buffers()
            assert [memory is not None for memory in own] == expected
            for memory, (dtype, size) in zip(own, averager.layout.buffers, strict=True):
                if memory is not None:
                    assert memory.shape == (size,)
                    assert str(memory.dtype) == dtype
                    assert any(memory.ctypes.data == t.data_ptr() for t in tensors)
    # a runner that does not say it works in place gets copies
    async with _averagers(
        [[torch.zeros(3)]], prefix="which", target_group_size=2, allreduce=_NeverRuns()
    ) as (averager,):
        with averager._lock:
            assert averager._in_place_buffers() == [None]


async def test_views_of_one_flat_tensor_are_averaged_without_copies() -> None:
    torch.manual_seed(11)
    tensors = []
    for _ in range(3):
        flat = torch.randn(100)
        tensors.append([flat[:60].view(6, 10), flat[60:], torch.randn(7, dtype=torch.float64)])
    expected = [sum(t[k].double() for t in tensors) / 3 for k in range(3)]
    async with _averagers(tensors, prefix="views", target_group_size=3) as averagers:
        for _ in range(2):
            results = await _step_all(averagers, timeout=10)
            assert all(r.group_size == 3 and not r.incomplete for r in results)
        for averager in averagers:
            assert averager._buffers == [None, None]  # no flat copy was ever made
            with averager.get_tensors() as own:
                for got, want in zip(own, expected, strict=True):
                    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)


# (a worker thread blocks until the loop lets go of the tensors: a virtual clock would wait 5 real
# seconds for it before moving on, see swarmavg/testing/_clock.py)
@pytest.mark.realtime
async def test_an_in_place_round_holds_the_tensors_until_its_results_are_written() -> None:
    """While a round averages the tensors in place, a training thread that wants them waits
    and then sees the averaged values; on the event loop itself, where waiting would never
    end, ``get_tensors`` says so."""
    async with AsyncExitStack() as stack:
        averagers, runners, controls = await _paused_round(stack, "held")
        with pytest.raises(RuntimeError, match="wait for itself"), averagers[0].get_tensors():
            pass
        entered = []

        def train() -> torch.Tensor:
            with averagers[0].get_tensors() as own:
                entered.append(True)
                return own[0].clone()

        async with anyio.create_task_group() as tg:
            seen: list[torch.Tensor] = []

            async def training_thread() -> None:
                seen.append(await anyio.to_thread.run_sync(train))

            tg.start_soon(training_thread)
            await anyio.sleep(0.3)
            assert not entered  # the round holds the tensors
            assert runners[0].results_valid() is True  # (the round has them)
            for runner in runners:
                runner.go.set()
            with anyio.fail_after(10):
                results = [await control for control in controls]
        assert all(r.group_size == 2 for r in results)
        torch.testing.assert_close(seen[0], torch.full((50,), 0.5))
        # what a groupmate may be relayed from our tensors: until someone enters them again
        valid = runners[1].results_valid
        assert valid() is True
        with averagers[1].get_tensors() as own:
            assert torch.equal(own[0], torch.full((50,), 0.5))
        assert valid() is False
        # ... or changes them with torch, even without get_tensors
        controls = [await a.step(wait=False, timeout=10) for a in averagers]
        for runner in runners:
            runner.go.set()
        with anyio.fail_after(10):
            for control in controls:
                await control
        valid = runners[0].results_valid
        assert valid() is True
        averagers[0]._tensors[0].add_(1.0)
        assert valid() is False


async def test_a_parameter_averaged_in_place_is_seen_changed_by_autograd() -> None:
    torch.manual_seed(5)
    params = [[torch.nn.Parameter(torch.randn(4, 3))] for _ in range(2)]
    expected = (params[0][0].detach() + params[1][0].detach()) / 2
    pending = (params[0][0] ** 2).sum()  # saves params[0][0] for its backward
    versions = [own[0]._version for own in params]
    async with _averagers(params, prefix="autograd1", target_group_size=2) as averagers:
        assert all(a._in_place_buffers()[0] is not None for a in averagers)
        await _step_all(averagers, timeout=10)
        assert all(a._buffers == [None] for a in averagers)
    for own, version in zip(params, versions, strict=True):
        assert own[0]._version > version
        torch.testing.assert_close(own[0].detach(), expected, atol=1e-6, rtol=0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        pending.backward()


async def test_inference_tensors_are_averaged_too() -> None:
    # (they have no version counter to bump, and torch refuses to write them outside
    # inference mode: a round used to average them and then fail)
    torch.manual_seed(6)
    with torch.inference_mode():
        tensors = [[torch.randn(8), torch.randn(5).to(torch.bfloat16)] for _ in range(2)]
    expected = [(tensors[0][k].double() + tensors[1][k].double()) / 2 for k in range(2)]
    async with _averagers(tensors, prefix="inference", target_group_size=2) as averagers:
        results = await _step_all(averagers, timeout=10)
        assert all(r.group_size == 2 for r in results)
        for averager in averagers:
            with averager.get_tensors() as own:
                torch.testing.assert_close(own[0].double(), expected[0], atol=1e-6, rtol=0)
                torch.testing.assert_close(own[1].double(), expected[1], atol=2e-2, rtol=0)


async def test_a_step_cancelled_during_an_in_place_round_gives_the_tensors_back() -> None:
    async with AsyncExitStack() as stack:
        averagers, runners, controls = await _paused_round(stack, "cancelled")
        assert averagers[0]._in_place_thread is not None  # the round holds the tensors
        assert controls[0].cancel()
        with anyio.fail_after(10), pytest.raises(concurrent.futures.CancelledError):
            await controls[0]
        lock = averagers[0]._lock  # given back once the cancelled round has left
        assert await anyio.to_thread.run_sync(lambda: lock.acquire(timeout=5))
        lock.release()
        assert averagers[0]._in_place_thread is None
        with averagers[0].get_tensors() as own:  # unlocked, untouched (the round never ran)
            assert torch.equal(own[0], torch.zeros(50))
        runners[1].go.set()
        controls[1].cancel()
