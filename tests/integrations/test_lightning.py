"""``SwarmStrategy`` with real Lightning ``Trainer``\\ s (spec C.3, ported from lightning-Hivemind's
tests, plus what they lacked): under both namespaces, single-process fits on a tiny model; and,
under ``lightning.pytorch``, processes training the workload together over TCP on 127.0.0.1."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import forkserver
import pytest

torch = pytest.importorskip("torch")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


NAMESPACES = [
    pytest.param(
        "lightning.pytorch",
        marks=pytest.mark.skipif(not _installed("lightning.pytorch"), reason="no lightning"),
    ),
    pytest.param(
        "pytorch_lightning",
        marks=pytest.mark.skipif(
            not _installed("pytorch_lightning"), reason="no pytorch_lightning"
        ),
    ),
]
if not (_installed("lightning.pytorch") or _installed("pytorch_lightning")):
    pytest.skip(
        "Lightning is not installed (pip install swarmavg[lightning])", allow_module_level=True
    )

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    # Lightning's own warnings about itself and its loaders (not the strategy's)
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning:lightning"),
    pytest.mark.filterwarnings("ignore::UserWarning:pytorch_lightning"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
]


@pytest.fixture(autouse=True)
def _fresh_loop(fresh_loop: None) -> None:
    """Every fit starts without swarmavg's loop thread and leaves no thread behind (the
    strategy's teardown stops the optimizer and the DHT)."""


@pytest.fixture(autouse=True)
def _no_peer_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PL_INITIAL_PEERS", "SWARMAVG_INITIAL_PEERS", "SWARMAVG_TARGET_BATCH_SIZE"):
        monkeypatch.delenv(name, raising=False)


# The tests that start ``lightning_peer.py`` processes run under one namespace only: the two
# differ only in the import path (the same strategy class serves both), which the in-process
# tests check under each; every process start imports torch and Lightning again, and these
# tests start three or more each.
PROCESS_NAMESPACES = NAMESPACES[:1] if _installed("lightning.pytorch") else NAMESPACES[1:]


@pytest.fixture(params=NAMESPACES)
def pl(request: pytest.FixtureRequest) -> SimpleNamespace:
    """One namespace's ``Trainer``, ``BoringModel`` and ``SwarmStrategy``."""
    return _namespace(request.param)


@pytest.fixture(params=PROCESS_NAMESPACES)
def pl_processes(request: pytest.FixtureRequest) -> SimpleNamespace:
    """``pl`` for the tests with peer processes: ``lightning.pytorch`` only (see above)."""
    return _namespace(request.param)


def _namespace(name: str) -> SimpleNamespace:
    module_name = (
        "swarmavg.integrations.lightning"
        if name == "lightning.pytorch"
        else "swarmavg.integrations.pytorch_lightning"
    )
    integration = importlib.import_module(module_name)
    return SimpleNamespace(
        name=name,
        Trainer=importlib.import_module(name).Trainer,
        BoringModel=importlib.import_module(f"{name}.demos.boring_classes").BoringModel,
        callbacks=importlib.import_module(f"{name}.callbacks"),
        MisconfigurationException=importlib.import_module(
            f"{name}.utilities.exceptions"
        ).MisconfigurationException,
        MixedPrecision=_mixed_precision(name),
        SwarmStrategy=integration.SwarmStrategy,
        HivemindStrategy=integration.HivemindStrategy,
    )


def _mixed_precision(name: str) -> Any:
    precision = importlib.import_module(f"{name}.plugins.precision")
    return getattr(precision, "MixedPrecision", None) or precision.MixedPrecisionPlugin


def _trainer(pl: SimpleNamespace, strategy: Any, **options: Any) -> Any:
    options = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        **options,
    }
    return pl.Trainer(strategy=strategy, **options)


def _swarm_optimizer_class() -> type:
    import swarmavg

    return swarmavg.Optimizer


# -- construction --------------------------------------------------------------------------------


def test_strategy_is_the_trainers_and_starts_nothing(pl: SimpleNamespace) -> None:
    strategy = pl.SwarmStrategy(target_batch_size=1)
    trainer = _trainer(pl, strategy)
    assert trainer.strategy is strategy
    assert strategy.dht is None  # the DHT starts in setup (upstream started it in __init__)
    assert strategy.num_peers == 1
    assert strategy.local_epoch == 0
    assert pl.HivemindStrategy is pl.SwarmStrategy


def test_the_other_namespaces_trainer_refuses_it(pl: SimpleNamespace) -> None:
    other = "pytorch_lightning" if pl.name == "lightning.pytorch" else "lightning.pytorch"
    if not _installed(other):
        pytest.skip(f"{other} is not installed")
    trainer_cls = importlib.import_module(other).Trainer
    with pytest.raises(ValueError, match="invalid strategy"):
        trainer_cls(strategy=pl.SwarmStrategy(target_batch_size=1), accelerator="cpu")


def test_registered_name_reads_the_target_from_the_environment(
    pl: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="SWARMAVG_TARGET_BATCH_SIZE"):
        _trainer(pl, "swarm")
    monkeypatch.setenv("SWARMAVG_TARGET_BATCH_SIZE", "64")
    trainer = _trainer(pl, "swarm")
    assert isinstance(trainer.strategy, pl.SwarmStrategy)
    assert trainer.strategy._target_batch_size == 64


def test_env_variables_parsed(pl: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    assert pl.SwarmStrategy(1, initial_peers="a, b")._initial_peers == ["a", "b"]
    monkeypatch.setenv("PL_INITIAL_PEERS", "TEST_PEERS")
    strategy = pl.SwarmStrategy(target_batch_size=1, initial_peers=["ignored"])
    assert strategy._initial_peers == ["TEST_PEERS"]
    assert strategy._initial_peers_source == "PL_INITIAL_PEERS"
    monkeypatch.setenv("SWARMAVG_INITIAL_PEERS", "p1,p2")
    strategy = pl.SwarmStrategy(target_batch_size=1)
    assert strategy._initial_peers == ["p1", "p2"]
    assert strategy._initial_peers_source == "SWARMAVG_INITIAL_PEERS"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"target_batch_size": 0}, ValueError, "target_batch_size"),
        ({"target_batch_size": True}, TypeError, "target_batch_size"),
        ({"target_batch_size": 8, "batch_size": 0}, ValueError, "batch_size"),
        ({"target_batch_size": 8, "run_id": ""}, ValueError, "run_id"),
        ({"target_batch_size": 8, "matchmaking_time": 0}, ValueError, "matchmaking_time"),
        ({"target_batch_size": 8, "use_ipfs": True}, TypeError, "use_ipfs"),
        ({"target_batch_size": 8, "optimizer": None}, TypeError, "optimizer: set by"),
        ({"target_batch_size": 8, "no_such_option": 1}, TypeError, "no_such_option"),
        ({"target_batch_size": 8, "initial_peers": 5}, TypeError, "initial_peers"),
        ({"target_batch_size": 8, "delay_optimizer_step": True}, ValueError, "delay_state"),
    ],
)
def test_bad_arguments_are_named(
    pl: SimpleNamespace, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        pl.SwarmStrategy(**kwargs)


# -- fitting alone -------------------------------------------------------------------------------


def test_optimizer_wrapped_and_everything_stopped_after_fit(pl: SimpleNamespace) -> None:
    seen: list[Any] = []

    class TestModel(pl.BoringModel):  # type: ignore[name-defined,misc]
        def on_before_backward(self, loss: Any) -> None:
            seen.append(self.trainer.optimizers[0])
            seen.append(self.trainer.strategy.dht)

    strategy = pl.SwarmStrategy(target_batch_size=1)
    _trainer(pl, strategy, fast_dev_run=True).fit(TestModel())
    assert isinstance(seen[0], _swarm_optimizer_class())
    assert seen[1] is not None
    assert strategy.dht is None
    assert strategy.optimizer is None


def test_lr_follows_the_swarm_epoch(pl: SimpleNamespace) -> None:
    """lr(local_epoch) at every batch, never one epoch ahead (lightning-Hivemind's scheduler
    stepped once too early); the scheduler of configure_optimizers, interval "epoch"."""
    records: list[tuple[int, float]] = []

    class TestModel(pl.BoringModel):  # type: ignore[name-defined,misc]
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.1)
            return [optimizer], [torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)]

        def on_before_backward(self, loss: Any) -> None:
            strategy = self.trainer.strategy
            records.append((strategy.local_epoch, self.trainer.optimizers[0].param_groups[0]["lr"]))
            assert type(self.trainer.lr_scheduler_configs[0].scheduler).__name__ == (
                "_EpochScheduler"
            )

    # BoringModel's batches hold 1 sample: a lone peer's epoch is two batches
    strategy = pl.SwarmStrategy(target_batch_size=2)
    _trainer(pl, strategy, max_epochs=2, limit_train_batches=3).fit(TestModel())
    epochs = [epoch for epoch, _ in records]
    assert epochs == [0, 0, 1, 1, 2, 2], epochs
    for epoch, lr in records:
        assert lr == pytest.approx(0.1 * 0.5**epoch)


def test_short_last_batch_is_counted_by_its_real_size(pl: SimpleNamespace) -> None:
    counted: list[int] = []

    class TestModel(pl.BoringModel):  # type: ignore[name-defined,misc]
        def train_dataloader(self) -> Any:
            data = torch.utils.data.TensorDataset(torch.randn(5, 32))
            return torch.utils.data.DataLoader(data, batch_size=2)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return super().training_step(batch[0], batch_idx)

        def on_train_batch_end(self, *args: Any) -> None:
            optimizer = self.trainer.strategy.optimizer
            counted.append(int(optimizer.local_progress.samples_accumulated))

    strategy = pl.SwarmStrategy(target_batch_size=1000)
    _trainer(pl, strategy, max_epochs=1).fit(TestModel())
    assert counted == [2, 4, 5]
    assert strategy._batch_size is None


class _Box:
    """A batch Lightning cannot size."""

    def __init__(self, x: Any) -> None:
        self.x = x


def _box_model(pl: SimpleNamespace) -> Any:
    class TestModel(pl.BoringModel):  # type: ignore[name-defined,misc]
        def train_dataloader(self) -> Any:
            data = [torch.randn(32) for _ in range(4)]
            return torch.utils.data.DataLoader(
                data, batch_size=2, collate_fn=lambda items: _Box(torch.stack(items))
            )

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return super().training_step(batch.x, batch_idx)

    return TestModel()


def test_raise_exception_no_batch_size(pl: SimpleNamespace) -> None:
    strategy = pl.SwarmStrategy(target_batch_size=1)
    with pytest.raises(pl.MisconfigurationException, match="Please provide the batch size"):
        _trainer(pl, strategy, max_epochs=1).fit(_box_model(pl))
    # given, it is used
    strategy = pl.SwarmStrategy(target_batch_size=1, batch_size=2)
    _trainer(pl, strategy, max_epochs=1).fit(_box_model(pl))


def test_raise_exception_multiple_optimizers(pl: SimpleNamespace) -> None:
    """Lightning refuses several optimizers in automatic optimization itself; in manual
    optimization the strategy does."""

    class TestModel(pl.BoringModel):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def configure_optimizers(self) -> Any:
            return [torch.optim.SGD(self.layer.parameters(), lr=0.1) for _ in range(2)]

        def training_step(self, batch: Any, batch_idx: int) -> None:
            raise AssertionError("never reached")

    strategy = pl.SwarmStrategy(target_batch_size=1)
    with pytest.raises(pl.MisconfigurationException, match="only supports training with one"):
        _trainer(pl, strategy, fast_dev_run=True).fit(TestModel())


def test_reduce_lr_on_plateau_is_refused(pl: SimpleNamespace) -> None:
    class TestModel(pl.BoringModel):  # type: ignore[name-defined,misc]
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
            return {"optimizer": optimizer, "lr_scheduler": scheduler, "monitor": "x"}

    strategy = pl.SwarmStrategy(target_batch_size=1)
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        _trainer(pl, strategy, fast_dev_run=True).fit(TestModel())


def test_reuse_grad_buffers_warning_and_hook_restored(pl: SimpleNamespace) -> None:
    hooks: list[Any] = []

    class TestModel(pl.BoringModel):  # type: ignore[name-defined,misc]
        def on_before_backward(self, loss: Any) -> None:
            hooks.append(self.optimizer_zero_grad)

        def optimizer_zero_grad(self, *args: Any) -> None:
            raise AssertionError("disabled while reuse_grad_buffers")

    model = TestModel()
    strategy = pl.SwarmStrategy(target_batch_size=4, reuse_grad_buffers=True)
    with pytest.warns(UserWarning, match="You have overridden `optimizer_zero_grad`"):
        _trainer(pl, strategy, max_epochs=1, limit_train_batches=3).fit(model)
    assert hooks == [None, None, None]
    assert "optimizer_zero_grad" not in vars(model)  # the class's method again
    assert strategy.local_epoch == 0


@pytest.mark.parametrize(
    ("options", "warns"),
    [
        (
            {
                "delay_grad_averaging": True,
                "delay_optimizer_step": True,
                "delay_state_averaging": True,
            },
            True,
        ),
        ({"offload_optimizer": True}, True),
        ({"delay_state_averaging": True}, False),  # (needs no re-created optimizer here)
    ],
)
def test_warn_if_scheduler_fn_missing(
    pl: SimpleNamespace, options: dict[str, Any], warns: bool
) -> None:
    strategy = pl.SwarmStrategy(target_batch_size=1, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(pl, strategy, fast_dev_run=True).fit(pl.BoringModel())
    messages = [str(w.message) for w in caught]
    assert any("requires a `scheduler_fn`" in m for m in messages) == warns, messages


def test_args_passed_to_optimizer(pl: SimpleNamespace) -> None:
    from swarmavg.compression import ScaledFloat16Compression

    compression = ScaledFloat16Compression()
    seen: dict[str, Any] = {}

    class TestModel(pl.BoringModel):  # type: ignore[name-defined,misc]
        def on_before_backward(self, loss: Any) -> None:
            opt = self.trainer.strategy.optimizer
            assert opt.grad_averager is not None
            assert opt.state_averager is not None
            seen.update(
                offload=opt.offload_optimizer,
                delay_step=opt.delay_optimizer_step,
                delay_state=opt.delay_state_averaging,
                reuse=opt.grad_averager.reuse_grad_buffers,
                target=opt.target_batch_size,
                every=opt.average_state_every,
                inner=type(opt.opt),
                scheduler=type(opt.state_averager.scheduler),
            )

    strategy = pl.SwarmStrategy(
        target_batch_size=1,
        reuse_grad_buffers=True,
        delay_state_averaging=True,
        delay_optimizer_step=True,
        offload_optimizer=True,
        grad_compression=compression,
        state_averaging_compression=compression,
        average_state_every=2,
        scheduler_fn=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 1),
    )
    model = TestModel()
    _trainer(pl, strategy, fast_dev_run=True).fit(model)
    assert seen == {
        "offload": True,
        "delay_step": True,
        "delay_state": True,
        "reuse": True,
        "target": 1,
        "every": 2,
        "inner": torch.optim.SGD,
        "scheduler": torch.optim.lr_scheduler.StepLR,
    }
    assert callable(model.optimizer_zero_grad)


def test_host_maddrs(pl: SimpleNamespace) -> None:
    seen: list[str] = []

    class TestModel(pl.BoringModel):  # type: ignore[name-defined,misc]
        def on_train_start(self) -> None:
            seen.extend(self.trainer.strategy.dht.get_visible_maddrs())

    strategy = pl.SwarmStrategy(target_batch_size=1, host_maddrs=["tcp://127.0.0.2:0"])
    _trainer(pl, strategy, fast_dev_run=True).fit(TestModel())
    assert seen
    assert all("127.0.0.2" in address for address in seen), seen


def test_checkpoint_holds_the_epoch_and_fit_resumes_from_it(
    pl: SimpleNamespace, tmp_path: Path
) -> None:
    epochs_seen: list[int] = []

    class TestModel(pl.BoringModel):  # type: ignore[name-defined,misc]
        def on_train_batch_end(self, *args: Any) -> None:
            epochs_seen.append(self.trainer.strategy.local_epoch)

    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    options = {"enable_checkpointing": True, "callbacks": [checkpoint], "limit_train_batches": 3}
    strategy = pl.SwarmStrategy(target_batch_size=1)  # (an epoch per batch)
    _trainer(pl, strategy, max_epochs=1, **options).fit(TestModel())
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    saved_epoch = saved["swarmavg"]["local_epoch"]
    assert saved_epoch == epochs_seen[-1] >= 2, epochs_seen
    assert saved["swarmavg"]["run_id"] == "lightning_run"
    assert saved["optimizer_states"][0]["state"]["local_epoch"] == saved_epoch

    epochs_seen.clear()
    strategy = pl.SwarmStrategy(target_batch_size=1)
    trainer = _trainer(pl, strategy, max_epochs=2, **options)
    trainer.fit(TestModel(), ckpt_path=tmp_path / "last.ckpt")
    # (alone, it first looks for a peer ahead of it to download from: none)
    assert saved_epoch <= epochs_seen[0], epochs_seen
    assert epochs_seen[-1] > saved_epoch, epochs_seen


def test_bf16_mixed_on_cpu(pl: SimpleNamespace) -> None:
    seen: list[Any] = []

    class TestModel(pl.BoringModel):  # type: ignore[name-defined,misc]
        def on_before_backward(self, loss: Any) -> None:
            seen.append((loss.dtype, self.trainer.precision_plugin.scaler))

    model = TestModel()
    before = [p.detach().clone() for p in model.parameters()]
    strategy = pl.SwarmStrategy(target_batch_size=2)
    _trainer(pl, strategy, precision="bf16-mixed", max_epochs=1, limit_train_batches=2).fit(model)
    assert [scaler for _, scaler in seen] == [None, None]
    assert strategy.local_epoch == 0  # (torn down: nothing to report)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_16_mixed_uses_swarmavgs_grad_scaler(pl: SimpleNamespace) -> None:
    """float16 autocast through the precision plugin (on CPU here; Lightning turns
    ``precision="16-mixed"`` on CPU into bf16, so the plugin is given explicitly)."""
    from swarmavg.optim import GradScaler

    seen: list[Any] = []

    class TestModel(pl.BoringModel):  # type: ignore[name-defined,misc]
        def on_before_backward(self, loss: Any) -> None:
            seen.append(self.trainer.precision_plugin.scaler)

    plugin = pl.MixedPrecision("16-mixed", "cpu")
    strategy = pl.SwarmStrategy(target_batch_size=2)
    trainer = _trainer(pl, strategy, plugins=[plugin], max_epochs=1, limit_train_batches=3)
    trainer.fit(TestModel())
    assert len(seen) == 3
    assert all(isinstance(scaler, GradScaler) for scaler in seen)
    assert seen[0].get_scale() > 1  # (the scale was applied and finite steps kept it)


# -- sync_metrics ----------------------------------------------------------------------------------


def _shared(step: dict[str, float], epoch: dict[str, float], count: dict[str, float]) -> Any:
    from swarmavg.integrations._lightning import _GATHER_KEY

    return {_GATHER_KEY: {"step": step, "epoch": epoch, "count": count}}


def test_swarm_metrics_reduce_with_the_other_members_last_values() -> None:
    from swarmavg.integrations._lightning import _SwarmMetrics

    metrics = _SwarmMetrics()
    assert metrics.reduce("step", "loss", 2.0, "mean") == 2.0  # (no round yet: local)
    metrics.update(
        {
            "me": _shared({"loss": 100.0}, {}, {}),  # (this peer's, as it was: ignored)
            "a": _shared({"loss": 4.0, "acc": 1.0}, {"loss": 30.0}, {"loss": 10}),
            "b": _shared({"loss": 6.0}, {}, {}),
            "c": _shared({"loss": float("nan")}, {}, {}),  # not finite: dropped
            "d": {"lightning_metrics": {"step": {"loss": "4"}}},  # not a number: dropped
            "e": 7,  # malformed: left out
            "f": {"lightning_metrics": [1, 2]},
        },
        me="me",
    )
    assert metrics.reduce("step", "loss", 2.0, "mean") == 4.0
    assert metrics.reduce("step", "loss", 2.0, "sum") == 12.0
    assert metrics.reduce("step", "loss", 2.0, "max") == 6.0
    assert metrics.reduce("step", "loss", 2.0, "min") == 2.0
    assert metrics.reduce("step", "other", 3.0, "mean") == 3.0  # (no one else has it)
    # an epoch's mean: the sums and the batch sizes averaged, then divided
    assert metrics.reduce("epoch", "loss", 2.0, "mean") / metrics.reduce(
        "count", "loss", 2, "mean"
    ) == pytest.approx(32 / 12)
    assert metrics.payload() == _shared({"loss": 2.0, "other": 3.0}, {"loss": 2.0}, {"loss": 2.0})


def test_swarm_metrics_share_a_bounded_number_of_names() -> None:
    from swarmavg.integrations._lightning import (
        _MAX_METRIC_NAME,
        _MAX_SYNCED_METRICS,
        _SwarmMetrics,
    )

    metrics = _SwarmMetrics()
    for i in range(_MAX_SYNCED_METRICS + 5):
        assert metrics.reduce("step", f"m{i}", float(i), "mean") == float(i)
    metrics.reduce("epoch", "x" * (_MAX_METRIC_NAME + 1), 1.0, "mean")
    shared = metrics.payload()["lightning_metrics"]
    assert len(shared["step"]) == _MAX_SYNCED_METRICS
    assert shared["epoch"] == {}


def test_sync_metrics_logs_the_mean_over_the_last_rounds_members(pl: SimpleNamespace) -> None:
    """With ``sync_metrics``, ``self.log(..., sync_dist=True)`` reads the other members' values
    of the last gradient round (here: the round's gathered metadata as one with a groupmate
    would leave it) at steps and at an epoch's end; metrics without ``sync_dist`` stay local,
    and ``log`` is the module's own again after ``fit``."""
    logged: list[tuple[float, float]] = []

    class TestModel(pl.BoringModel):  # type: ignore[name-defined,misc]
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            optimizer = self.trainer.strategy.optimizer
            if batch_idx == 1:
                me = optimizer.grad_averager.peer_id
                optimizer.last_grad_gathered = {
                    me: optimizer.grad_gather(),
                    "groupmate": _shared({"m": 5.0}, {"val": 30.0}, {"val": 10}),
                }
            self.log("m", 2.0, sync_dist=True)
            self.log("local", 2.0)
            return super().training_step(batch, batch_idx)

        def on_train_batch_end(self, *args: Any) -> None:
            metrics = self.trainer.callback_metrics
            logged.append((float(metrics["m"]), float(metrics["local"])))

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val", 1.0, sync_dist=True)  # (on_epoch: reduced at the epoch's end)

    model = TestModel()
    strategy = pl.SwarmStrategy(target_batch_size=100, sync_metrics=True)
    trainer = _trainer(pl, strategy, max_epochs=1, limit_train_batches=3, limit_val_batches=2)
    trainer.fit(model)
    assert logged == [(2.0, 2.0), (3.5, 2.0), (3.5, 2.0)]
    # this peer: 2 batches of 1 sample at 1.0 (a sum of 2); the groupmate: 30 over 10
    assert float(trainer.callback_metrics["val"]) == pytest.approx(32 / 12)
    assert "log" not in vars(model)


def test_without_sync_metrics_sync_dist_stays_local(pl: SimpleNamespace) -> None:
    logged: list[float] = []

    class TestModel(pl.BoringModel):  # type: ignore[name-defined,misc]
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            optimizer = self.trainer.strategy.optimizer
            assert optimizer.grad_gather is None
            self.log("m", 2.0, sync_dist=True)
            return super().training_step(batch, batch_idx)

        def on_train_batch_end(self, *args: Any) -> None:
            logged.append(float(self.trainer.callback_metrics["m"]))

    strategy = pl.SwarmStrategy(target_batch_size=100)
    _trainer(pl, strategy, max_epochs=1, limit_train_batches=2).fit(TestModel())
    assert logged == [2.0, 2.0]


# -- peers in processes ---------------------------------------------------------------------------


class _Peers:
    """``lightning_peer.py`` processes over TCP on 127.0.0.1, joined through a bootstrap DHT of
    this process (``SWARMAVG_INITIAL_PEERS``); their events arrive on one queue."""

    def __init__(self, ns: str, out: Path, run_id: str, num_peers: int) -> None:
        import swarmavg

        self.ns, self.out, self.run_id, self.num_peers = ns, out, run_id, num_peers
        self.bootstrap = swarmavg.DHT()
        self.env = {
            **os.environ,
            # (the checkout first, then ours: the transports of a checkout without an install)
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "SWARMAVG_INITIAL_PEERS": ",".join(self.bootstrap.get_visible_maddrs()),
        }
        self.procs: dict[int, forkserver.Process] = {}
        self.events: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self.threads: list[threading.Thread] = []

    def start(self, index: int, epochs: int) -> None:
        config = {
            "index": index,
            "out": str(self.out),
            "epochs": epochs,
            "ns": self.ns,
            "num_peers": self.num_peers,
            "run_id": self.run_id,
        }
        with open(self.out / f"peer{index}.err", "w") as stderr:
            proc = forkserver.popen(
                [sys.executable, "-m", "tests.integrations.lightning_peer", json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                cwd=ROOT,
                env=self.env,
                preload=[self.ns, "swarmavg.integrations.lightning"],
            )
        self.procs[index] = proc
        thread = threading.Thread(target=self._read, args=(index, proc), daemon=True)
        thread.start()
        self.threads.append(thread)

    def _read(self, index: int, proc: forkserver.Process) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("{"):
                self.events.put((index, json.loads(line)))
        self.events.put((index, {"event": "eof"}))

    def wait_for(self, check: Any, timeout: float = 120) -> dict[int, dict[str, Any]]:
        """The last event of each peer until ``check(index, event)`` held for one; raises if a
        peer exits first or none does within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                index, event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"timed out waiting\n{self.stderr()}") from None
            if event["event"] == "eof" and self.procs[index].poll() != -signal.SIGKILL:
                raise AssertionError(f"peer {index} exited\n{self.stderr()}")
            if check(index, event):
                return {index: event}

    def send(self, index: int, line: str) -> None:
        stdin = self.procs[index].stdin
        assert stdin is not None
        stdin.write(line + "\n")
        stdin.flush()

    def join(self, indices: list[int], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        for index in indices:
            try:
                code = self.procs[index].wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"peer {index} did not exit\n{self.stderr()}") from None
            assert code == 0, self.stderr()

    def result(self, index: int) -> dict[str, Any]:
        import numpy as np

        result: dict[str, Any] = json.loads((self.out / f"peer{index}.json").read_text())
        result["params"] = np.load(self.out / f"peer{index}.npy")
        return result

    def stderr(self) -> str:
        return "\n".join(
            f"--- peer{i}:\n{(self.out / f'peer{i}.err').read_text()[-3000:]}"
            for i in sorted(self.procs)
        )

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        for thread in self.threads:
            thread.join(timeout=10)
        self.bootstrap.shutdown()


def _is(kind: str, who: int | None = None, epoch: int = -1) -> Any:
    def check(index: int, event: dict[str, Any]) -> bool:
        return (
            event["event"] == kind
            and (who is None or index == who)
            and event.get("epoch", 0) >= epoch
        )

    return check


def _metric_means(index: int, peers: int) -> set[float]:
    """What ``peer_index`` can read on peer ``index``: its own index averaged with those of any
    other peers of its last round."""
    others = [i for i in range(peers) if i != index]
    return {
        (index + sum(group)) / (1 + len(group))
        for size in range(peers)
        for group in itertools.combinations(others, size)
    }


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_three_processes_train_together(pl_processes: SimpleNamespace, tmp_path: Path) -> None:
    """Three processes run ``Trainer.fit`` on the workload with SwarmStrategy over TCP: each
    sees 3 peers and epochs > 0, the learning rate follows the epoch, ``self.log(...,
    sync_dist=True)`` reads the mean over the round's peers (sync_metrics), and all hold the
    same parameters after the same epoch."""
    import numpy as np

    epochs = 4
    peers = _Peers(pl_processes.name, tmp_path, "lightning_three_peers", num_peers=3)
    try:
        for index in range(3):
            peers.start(index, epochs)
        ready: set[int] = set()
        while len(ready) < 3:  # all are in fit, their optimizers made: go
            ready |= set(peers.wait_for(_is("ready")))
        for index in range(3):
            peers.send(index, "go")
        peers.join([0, 1, 2])
    finally:
        peers.close()
    results = [peers.result(i) for i in range(3)]
    for index, result in enumerate(results):
        assert 3 in result["num_peers"], result["num_peers"]
        assert result["stop_epoch"] == epochs, result["epochs"]
        for epoch, lr in zip(result["epochs"], result["lrs"], strict=True):
            assert lr == pytest.approx(2e-3 * 0.9**epoch)
        # the logged metric: this peer's index averaged with its groupmates' (0, 1, 2: 1.0)
        assert set(result["metric"]) <= _metric_means(index, 3), result["metric"]
        assert 1.0 in result["metric"], result["metric"]
    for result in results[1:]:
        np.testing.assert_allclose(result["params"], results[0]["params"], rtol=0, atol=1e-6)


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_late_peer_catches_up_and_a_killed_one_leaves_the_others_training(
    pl_processes: SimpleNamespace, tmp_path: Path
) -> None:
    """Two processes train; a third joins at epoch >= 2 and starts from the swarm's state (its
    first batch at the swarm's epoch, the state downloaded); then one of the first two is
    SIGKILLed mid-fit, and the other two train on to 4 more epochs, equal after the last."""
    import numpy as np

    peers = _Peers(pl_processes.name, tmp_path, "lightning_churn", num_peers=3)
    try:
        for index in (0, 1):
            peers.start(index, epochs=1 << 30)
        ready: set[int] = set()
        while len(ready) < 2:
            ready |= set(peers.wait_for(_is("ready")))
        for index in (0, 1):
            peers.send(index, "go")
        peers.wait_for(_is("epoch", who=0, epoch=2))
        peers.start(2, epochs=1 << 30)
        peers.wait_for(_is("ready", who=2))
        peers.send(2, "go")
        joined = peers.wait_for(_is("epoch", who=2, epoch=2))[2]["epoch"]
        peers.procs[1].send_signal(signal.SIGKILL)
        stop_at = joined + 4
        for index in (0, 2):
            peers.send(index, json.dumps({"stop_at": stop_at}))
        peers.join([0, 2])
    finally:
        peers.close()
    first, late = peers.result(0), peers.result(2)
    assert late["state_loads"] >= 1
    assert late["epochs"][0] >= 2, late["epochs"]  # (its first batch at the swarm's epoch)
    assert first["stop_epoch"] == late["stop_epoch"] == stop_at
    np.testing.assert_allclose(late["params"], first["params"], rtol=0, atol=1e-6)
