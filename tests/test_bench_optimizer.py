"""``benchmarks/optimizer.py`` and its peer script: a process training alone reports its epochs
and learns; two ``swarmavg.Optimizer`` peers finish their epochs; two peers of
``DecentralizedSGD``, ``DecentralizedAdam`` and ``DiLoCo`` (``--system dsgd|dadam|diloco``)
finish theirs, average and report their traffic and group sizes (with ``--wait-for-round`` and
``--step-compute-ms`` too); the convergence figure's interpolation; the diagnostic ordered
reduction sums in member order whatever the arrival order; ``--outer`` pairs."""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import forkserver
import pytest

pytestmark = pytest.mark.process

PEER = Path(__file__).parents[1] / "benchmarks" / "_optimizer_peer.py"


def _records(stdout: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.timeout(120)
def test_local_peer_reports_epochs_and_learns() -> None:
    """``--system local`` accumulates batches of 16 to T=32 samples per epoch."""
    out = forkserver.run(
        [
            sys.executable,
            str(PEER),
            "--system=local",
            "--target-batch-size=32",
            "--batch-size=16",
            "--epochs=6",
            "--eval-every=3",
            "--eval-batches=2",
            "--final-eval",
            "--lr=3e-3",
            "--warmup-epochs=1",
        ],
        capture_output=True,
        text=True,
        timeout=110,
        check=True,
    )
    records = _records(out.stdout)
    assert [r["event"] for r in records] == ["ready"] + ["epoch"] * 7 + ["done", "exit"]
    epochs = [r for r in records if r["event"] == "epoch"]
    assert [r["epoch"] for r in epochs] == list(range(7))
    assert [r["samples"] for r in epochs] == [0] + [32] * 6
    assert [r["steps"] for r in epochs] == [0] + [2] * 6
    losses = [r["val_loss"] for r in epochs if "val_loss" in r]
    assert len(losses) == 3  # epochs 0, 3, 6
    assert losses[0] > 5.4
    assert losses[2] < losses[0] - 0.5  # 6 Adam steps at batch 32 already help
    done = records[-2]
    assert done["samples"] == 6 * 32
    assert done["val_loss"] == losses[2]
    assert done["timed_out"] is False
    assert len({r.get("corpus") for r in records if r["event"] == "ready"}) == 1


@pytest.mark.timeout(240)
def test_two_swarmavg_peers_finish_their_epochs(
    load_benchmark: Callable[[str], ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_benchmark("optimizer.py")
    monkeypatch.setattr(bench, "start_peer", forkserver.popen)
    args = argparse.Namespace(
        batch_size=16,
        lr=2e-3,
        warmup_epochs=1,
        stdlib=sysconfig.get_paths()["stdlib"],
        run_timeout=120.0,
        averaging_timeout=20.0,
        verbose=False,
        hivemind_python="/nonexistent",
        logs=tmp_path,
    )
    config = {
        "name": "t",
        "run_id": "test-bench-optimizer",
        "system": "swarmavg",
        "peers": 2,
        "target": 64,
        "epochs": 3,
        "eval_every": 3,
        "matchmaking_time": 1.0,
    }
    result = bench.run_config(args, config)
    assert result["epochs_reached"] == 3
    assert not result["timed_out"]
    assert result["samples"] >= 3 * 64
    assert [p["epoch"] for p in result["curve"]] == [0, 3]
    assert result["curve"][1]["val_loss"] < result["curve"][0]["val_loss"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("system", ["dsgd", "dadam", "diloco"])
def test_two_peers_of_each_parameter_averaging_system(
    system: str,
    load_benchmark: Callable[[str], ModuleType],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Per-step systems: an epoch is T / (batch x peers) = 2 local steps of each peer, so 3
    epochs are exactly 3 x 64 samples; the peers average (bytes sent, rounds) and learn."""
    bench = load_benchmark("optimizer.py")
    monkeypatch.setattr(bench, "start_peer", forkserver.popen)
    args = argparse.Namespace(
        batch_size=16,
        lr=2e-3,
        warmup_epochs=1,
        sgd_lr=0.1,
        momentum=0.9,
        stdlib=sysconfig.get_paths()["stdlib"],
        run_timeout=60.0,
        averaging_timeout=20.0,
        verbose=False,
        hivemind_python="/nonexistent",
        logs=tmp_path,
        identity_seed=7,
    )
    config = {
        "name": system,
        "run_id": f"test-bench-{system}",
        "system": system,
        "peers": 2,
        "target": 64,
        "epochs": 3,
        "eval_every": 3,
        "matchmaking_time": 2.0,
        "steps_per_epoch": 2,
    }
    if system == "diloco":
        config |= {"sync_every": 2, "compression": "fp16", "go_delay": 2.0}
    else:  # (every round waited for: the same PeerIDs, 2 rounds per 2-step epoch of 2 peers)
        config |= {
            "group_size": 2,
            "averaging_steps_period": 2,
            "wait_for_round": True,
            "step_compute_ms": 1.0,
        }
    result = bench.run_config(args, config)
    assert result["epochs_reached"] == 3
    assert not result["timed_out"]
    assert result["samples"] == 3 * 64
    assert result["steps_per_peer"] == 6
    assert [p["epoch"] for p in result["curve"]] == [0, 3]
    assert result["curve"][1]["val_loss"] < result["curve"][0]["val_loss"]
    traffic = result["traffic"]
    assert traffic["rounds"] >= 1
    assert traffic["bytes_sent"] > 0
    # rounds begun, by group size, summed over both peers (a round alone is not averaged)
    assert set(traffic["group_sizes"]) <= {"1", "2"}
    assert sum(traffic["group_sizes"].values()) >= 2 * traffic["rounds"]
    if system == "diloco":
        assert "waited" not in traffic
    else:  # 3 rounds asked for (steps 2, 4, 6) and waited for by each peer
        assert sum(traffic["waited"].values()) == 2 * 3
        assert traffic["waited"].get("none", 0) == 0


def test_interpolate(load_benchmark: Callable[[str], ModuleType]) -> None:
    bench = load_benchmark("optimizer.py")
    curve = [
        {"epoch": 0, "samples": 0, "val_loss": 5.0},
        {"epoch": 5, "samples": 100, "val_loss": 3.0},
        {"epoch": 10, "samples": 200, "val_loss": 2.0},
    ]
    assert bench._interpolate(curve, 150) == pytest.approx(2.5)
    assert bench._interpolate(curve, 100) == pytest.approx(3.0)
    assert bench._interpolate(curve, 250) is None


def test_ordered_reduction_sums_in_member_order() -> None:
    """The peer script's diagnostic ``--ordered-reduction``: a part's float32 mean is the same
    to the last bit whatever order its senders' values arrive in (the library sums in arrival
    order, which is not associative), and equals summing in member order."""
    import numpy as np

    sys.path.insert(0, str(PEER.parent))
    try:
        import _optimizer_peer as peer_script
    finally:
        sys.path.remove(str(PEER.parent))
    from swarmavg.proto import allreduce

    rng = np.random.default_rng(0)
    values = [rng.standard_normal(257).astype(np.float32) * 10.0**k for k in range(-3, 1)]

    def reduce(order: list[int]) -> bytes:
        reducer = allreduce.PartReducer(257, "float32", range(4))
        for sender in order:
            reducer.add(sender, values[sender], 1.0)
        assert reducer.done
        mean = reducer.result()
        assert mean is not None
        return mean.tobytes()

    orders = [[0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]]
    original = (allreduce.PartReducer.add, allreduce.PartReducer.add_nothing)
    unordered = {reduce(order) for order in orders}
    assert len(unordered) > 1  # (else this test shows nothing)
    try:
        peer_script._order_reductions()
        ordered = {reduce(order) for order in orders}
        # one sender sends nothing (weight 0, as a dropped one): the others still sum in order
        reducer = allreduce.PartReducer(257, "float32", range(4))
        reducer.add(2, values[2], 1.0)
        reducer.add(0, values[0], 1.0)
        reducer.add(1, values[1], 1.0)
        reducer.add_nothing(3)
        partial = reducer.result()
    finally:
        allreduce.PartReducer.add, allreduce.PartReducer.add_nothing = original
    assert ordered == {reduce([0, 1, 2, 3])}
    assert partial is not None
    expected = allreduce.PartReducer(257, "float32", range(3))
    for sender in range(3):
        expected.add(sender, values[sender], 1.0)
    expected_mean = expected.result()
    assert expected_mean is not None
    assert partial.tobytes() == expected_mean.tobytes()


def test_parse_outer(load_benchmark: Callable[[str], ModuleType]) -> None:
    bench = load_benchmark("optimizer.py")
    assert bench._parse_outer("0.7:0.9, 1:0,1.5") == [(0.7, 0.9), (1.0, 0.0), (1.5, 0.9)]
    with pytest.raises(argparse.ArgumentTypeError):
        bench._parse_outer("fast:0")
    with pytest.raises(argparse.ArgumentTypeError):
        bench._parse_outer(",")
