"""``SwarmStrategy``: collaborative training with :class:`swarmavg.Optimizer` under Lightning.

The strategy is written once (:class:`_SwarmStrategy`) and made into a ``Strategy`` subclass
for each Lightning namespace by :func:`strategy_class`: Lightning's ``Trainer`` accepts only
instances of its own namespace's ``Strategy`` (``lightning.pytorch.Trainer`` refuses a
``pytorch_lightning.strategies.Strategy`` and the other way round), and each namespace has its
own registry of strategy names. :mod:`swarmavg.integrations.lightning` and
:mod:`swarmavg.integrations.pytorch_lightning` hold the two classes.

What the strategy does, and how it differs from lightning-Hivemind's ``HivemindStrategy``:
``docs/guides/lightning.md``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from swarmavg.dht import DHT
    from swarmavg.optim.optimizer import Optimizer as SwarmOptimizer

    _StrategyBase = Any
else:
    _StrategyBase = object

__all__ = [
    "INITIAL_PEERS_ENV",
    "REGISTERED_NAME",
    "SWARMAVG_INITIAL_PEERS_ENV",
    "TARGET_BATCH_SIZE_ENV",
    "strategy_class",
]

logger = logging.getLogger("swarmavg.integrations.lightning")

#: lightning-Hivemind's variable of comma-separated initial peers (read, as upstream)
INITIAL_PEERS_ENV = "PL_INITIAL_PEERS"
#: swarmavg's variable of comma-separated initial peers (read first; named in the hint)
SWARMAVG_INITIAL_PEERS_ENV = "SWARMAVG_INITIAL_PEERS"
#: ``Trainer(strategy="swarm")`` reads the target batch size from this variable
TARGET_BATCH_SIZE_ENV = "SWARMAVG_TARGET_BATCH_SIZE"
#: the name under which the strategy is registered: ``Trainer(strategy="swarm")``
REGISTERED_NAME = "swarm"

#: options of hivemind's libp2p DHT that lightning-Hivemind took; swarmavg's DHT has none
_LIBP2P_OPTIONS = frozenset(
    {"use_ipfs", "use_relay", "use_auto_relay", "wait_timeout", "bootstrap_timeout"}
)
#: ``swarmavg.Optimizer`` parameters the strategy sets itself
_SET_BY_STRATEGY = {
    "dht": "pass dht= to the strategy",
    "run_id": "pass run_id= to the strategy",
    "target_batch_size": "pass target_batch_size= to the strategy",
    "batch_size_per_step": "pass batch_size= to the strategy",
    "optimizer": "the strategy wraps the optimizer of configure_optimizers",
    "params": "the strategy wraps the optimizer of configure_optimizers",
    "scheduler": "return it from configure_optimizers, or pass scheduler_fn= to the strategy",
}
_MISSING = object()


@dataclass(frozen=True)
class _Namespace:
    """What the strategy uses of one Lightning namespace (``lightning.pytorch`` or
    ``pytorch_lightning``)."""

    name: str
    Strategy: Any
    StrategyRegistry: Any
    TrainerFn: Any
    CPUAccelerator: Any
    CUDAAccelerator: Any
    MixedPrecision: Any
    MisconfigurationException: type[Exception]
    extract_batch_size: Callable[[Any], int]
    is_overridden: Callable[..., bool]


def _load_namespace(name: str) -> _Namespace:
    def load(module: str) -> Any:
        return importlib.import_module(f"{name}.{module}")

    precision = load("plugins.precision")
    return _Namespace(
        name=name,
        Strategy=load("strategies").Strategy,
        StrategyRegistry=load("strategies").StrategyRegistry,
        TrainerFn=load("trainer.states").TrainerFn,
        CPUAccelerator=load("accelerators").CPUAccelerator,
        CUDAAccelerator=load("accelerators").CUDAAccelerator,
        # (MixedPrecisionPlugin before Lightning 2.1)
        MixedPrecision=getattr(precision, "MixedPrecision", None) or precision.MixedPrecisionPlugin,
        MisconfigurationException=load("utilities.exceptions").MisconfigurationException,
        extract_batch_size=load("utilities.data").extract_batch_size,
        is_overridden=load("utilities.model_helpers").is_overridden,
    )


def _positive_int(name: str, value: object, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int{' or None' if optional else ''}, not {value!r:.64}")
    if value < 1:
        raise ValueError(f"{name} must be positive, not {value}")
    return value


def _flag(name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool{' or None' if optional else ''}, not {value!r:.64}")


def _seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, not {value!r:.64}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be positive and finite, not {value!r}")
    return float(value)


def _split_peers(value: str) -> list[str]:
    return [peer.strip() for peer in value.split(",") if peer.strip()]


def _optimizer_parameters() -> frozenset[str]:
    from swarmavg.optim.optimizer import Optimizer

    return frozenset(inspect.signature(Optimizer.__init__).parameters) - {"self"}


class _EpochScheduler:
    """What Lightning steps in place of a configured LR scheduler: :class:`swarmavg.Optimizer`
    steps the real one by epoch (during epoch ``e`` the learning rate is ``lr(e)``), so
    :meth:`step` does nothing; everything else is the scheduler's (``state_dict`` for
    checkpoints, ``get_last_lr`` for ``LearningRateMonitor``), but ``optimizer`` is the swarm's
    optimizer."""

    def __init__(self, scheduler: Any, optimizer: SwarmOptimizer) -> None:
        self.scheduler = scheduler
        self.optimizer = optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the schedule follows the swarm's epochs, not Lightning's."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # (not set yet: during unpickling or copy)
            raise AttributeError(name)
        return getattr(self.scheduler, name)


#: ``sync_metrics``: the most metrics a peer shares with each round, and their longest name
_MAX_SYNCED_METRICS = 32
_MAX_METRIC_NAME = 100
#: the key of the metrics in a gradient round's gathered metadata
_GATHER_KEY = "lightning_metrics"
#: what ``reduce`` is asked for: a value logged at a step (``self.log`` is on the stack), or at
#: an epoch's end the weighted sum of a metric (``epoch``) and of a mean's batch sizes (``count``)
_KINDS = ("step", "epoch", "count")
_REDUCE_OPS = ("mean", "avg", "sum", "max", "min")


class _MetricKey:
    """The ``sync_dist_group`` that ``self.log(name, ..., sync_dist=True)`` gets under
    ``sync_metrics``: Lightning passes it to ``reduce`` with each value of that metric (at its
    steps and at its epoch's end), so ``reduce`` knows which metric it reduces. Equal by name
    (Lightning compares a metric's options at each ``log``); not a dataclass (Lightning's
    ``apply_to_collection`` would try to rebuild it)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _MetricKey) and other.name == self.name

    def __hash__(self) -> int:
        return hash((_MetricKey, self.name))

    def __repr__(self) -> str:
        return f"_MetricKey({self.name!r})"


class _SwarmMetrics:
    """``sync_metrics``' bookkeeping (no torch, no I/O): this peer's last value of each metric
    it logged with ``sync_dist=True``, what it shares with a gradient round (:meth:`payload`),
    the other members' values from the last round that completed (:meth:`update`), and their
    reduction (:meth:`reduce`)."""

    def __init__(self) -> None:
        self.local: dict[str, dict[str, float]] = {kind: {} for kind in _KINDS}
        self.others: list[dict[str, dict[str, float]]] = []

    def payload(self) -> dict[str, Any]:
        """What this peer gathers to a round: its last value of each metric."""
        return {_GATHER_KEY: {kind: dict(values) for kind, values in self.local.items()}}

    def update(self, gathered: Mapping[Any, Any], me: Any) -> None:
        """The other members' values from a round's gathered metadata (``me``: this peer's
        key there). A member whose metadata is malformed is left out; values that are not
        finite numbers, and names unknown here, are dropped."""
        others: list[dict[str, dict[str, float]]] = []
        for peer, value in gathered.items():
            if peer == me or not isinstance(value, Mapping):
                continue
            shared = value.get(_GATHER_KEY)
            if not isinstance(shared, Mapping):
                continue
            member: dict[str, dict[str, float]] = {}
            for kind in _KINDS:
                values = shared.get(kind)
                if not isinstance(values, Mapping):
                    continue
                member[kind] = {
                    name: float(number)
                    for name, number in list(values.items())[:_MAX_SYNCED_METRICS]
                    if isinstance(name, str)
                    and isinstance(number, int | float)
                    and not isinstance(number, bool)
                    and math.isfinite(number)
                }
            others.append(member)
        self.others = others

    def reduce(self, kind: str, name: str, value: float, op: str) -> float:
        """``value`` (this peer's now) reduced by ``op`` with the other members' last values of
        the same metric (those that have one); records ``value`` as this peer's."""
        values = self.local[kind]
        if name in values or (len(values) < _MAX_SYNCED_METRICS and len(name) <= _MAX_METRIC_NAME):
            values[name] = value
        numbers = [value]
        for member in self.others:
            number = member.get(kind, {}).get(name)
            if number is not None:
                numbers.append(number)
        if op in ("mean", "avg"):
            return math.fsum(numbers) / len(numbers)
        if op == "sum":
            return math.fsum(numbers)
        return max(numbers) if op == "max" else min(numbers)


class _SwarmStrategy(_StrategyBase):  # type: ignore[misc]
    """Train with a swarm of peers through :class:`swarmavg.Optimizer` (lightning-Hivemind's
    ``HivemindStrategy``; same parameters). Each process is one peer with one device; peers
    join and leave at any time.

    ::

        trainer = Trainer(strategy=SwarmStrategy(target_batch_size=4096), max_epochs=10)
        trainer.fit(model)   # the first peer logs how others join it

    The DHT starts when ``fit`` begins (``setup``); at the first training batch the optimizer
    of ``configure_optimizers`` is wrapped in a :class:`swarmavg.Optimizer` and its LR
    scheduler is stepped by swarm epoch. ``self.log(..., sync_dist=True)`` (unless
    ``sync_metrics``), ``barrier``, ``broadcast`` and ``all_gather`` stay local (a swarm has no
    fixed world); every peer is rank 0 and writes its own checkpoints and logs. The strategy
    logs ``swarm/local_epoch`` and ``swarm/num_peers`` at each optimizer step.

    :param target_batch_size: samples per epoch (one optimizer step of the swarm), over all
        peers.
    :param run_id: the run's name; peers with the same ``run_id`` train together.
    :param batch_size: samples per training batch; default: inferred from each batch
        (``extract_batch_size``), so a short last batch counts its real size. Given, every
        batch counts ``batch_size``.
    :param delay_state_averaging: average parameters in the background.
    :param delay_optimizer_step: run the optimizer step in the background (re-creates the
        optimizer; pass ``scheduler_fn`` for a schedule).
    :param delay_grad_averaging: average gradients in the background (one step stale).
    :param offload_optimizer: run the optimizer on CPU float32 copies (re-creates it).
    :param reuse_grad_buffers: accumulate in ``param.grad``; disables the LightningModule's
        ``optimizer_zero_grad`` during ``fit`` (with a warning if it was overridden).
    :param scheduler_fn: ``callable(optimizer) -> LR scheduler`` (or a scheduler of the
        configured optimizer); needed for a schedule when the optimizer is re-created.
    :param matchmaking_time: seconds to form a group for a round.
    :param averaging_timeout: seconds after which a round is given up.
    :param verbose: log every event of the optimizer at INFO.
    :param averager_opts: keyword arguments of both averagers
        (:class:`swarmavg.DecentralizedAverager`'s).
    :param host_maddrs: addresses the DHT listens on (default: swarmavg.DHT's, loopback).
    :param initial_peers: peers to join (a list, or a comma-separated str); the environment
        variables ``SWARMAVG_INITIAL_PEERS`` and ``PL_INITIAL_PEERS`` override it (read in that
        order).
    :param dht: a running :class:`swarmavg.DHT` to use (not shut down by the strategy); then
        ``host_maddrs``, ``initial_peers``, ``transport`` and ``identity_path`` must be unset.
    :param transport: the DHT's transport (``"tcp"``, ``"quic"``; default swarmavg.DHT's).
    :param identity_path: a file holding this peer's identity (made if missing).
    :param sync_metrics: ``self.log(..., sync_dist=True)`` logs the metric's mean (or its
        ``reduce_fx``) over this peer's value and the values the other peers of the last
        gradient round that completed shared in it (their last ones then); it never waits for
        a peer. Default: local values, as every collective.
    :param optimizer_kwargs: more keyword arguments of :class:`swarmavg.Optimizer` (e.g.
        ``grad_compression``, ``average_state_every``).
    :raises TypeError: an argument of the wrong type, an unknown keyword argument, or one of
        hivemind's libp2p options (``use_ipfs``, ...), all named.
    :raises ValueError: an argument out of range or a conflicting combination (named).
    """

    INITIAL_PEERS_ENV: str = INITIAL_PEERS_ENV
    strategy_name = REGISTERED_NAME
    _ns: _Namespace  # (set on each namespace's class by strategy_class)
    # (Lightning's Strategy attributes used here)
    optimizers: list[Any]
    lr_scheduler_configs: list[Any]

    def __init__(
        self,
        target_batch_size: int,
        run_id: str = "lightning_run",
        batch_size: int | None = None,
        delay_state_averaging: bool = False,
        delay_optimizer_step: bool | None = None,
        delay_grad_averaging: bool = False,
        offload_optimizer: bool | None = None,
        reuse_grad_buffers: bool = False,
        scheduler_fn: Callable[..., Any] | torch.optim.lr_scheduler.LRScheduler | None = None,
        matchmaking_time: float = 5.0,
        averaging_timeout: float = 30.0,
        verbose: bool = False,
        averager_opts: Mapping[str, Any] | None = None,
        host_maddrs: Sequence[str] | None = None,
        initial_peers: str | Sequence[str] | None = None,
        *,
        dht: DHT | None = None,
        transport: str | None = None,
        identity_path: str | os.PathLike[str] | None = None,
        sync_metrics: bool = False,
        **optimizer_kwargs: Any,
    ) -> None:
        from swarmavg.dht import DHT as SyncDHT

        super().__init__()
        _positive_int("target_batch_size", target_batch_size)
        _positive_int("batch_size", batch_size, optional=True)
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"run_id must be a non-empty str, not {run_id!r:.64}")
        for name, flag in (
            ("delay_state_averaging", delay_state_averaging),
            ("delay_grad_averaging", delay_grad_averaging),
            ("reuse_grad_buffers", reuse_grad_buffers),
            ("verbose", verbose),
            ("sync_metrics", sync_metrics),
        ):
            _flag(name, flag)
        _flag("delay_optimizer_step", delay_optimizer_step, optional=True)
        _flag("offload_optimizer", offload_optimizer, optional=True)
        matchmaking_time = _seconds("matchmaking_time", matchmaking_time)
        averaging_timeout = _seconds("averaging_timeout", averaging_timeout)
        if (delay_optimizer_step or delay_grad_averaging) and not delay_state_averaging:
            # (swarmavg.Optimizer would fail at the first epoch's end)
            raise ValueError(
                "delay_optimizer_step and delay_grad_averaging need delay_state_averaging=True"
            )
        if (
            scheduler_fn is not None
            and not callable(scheduler_fn)
            and not isinstance(scheduler_fn, torch.optim.lr_scheduler.LRScheduler)
        ):
            raise TypeError(
                "scheduler_fn must be callable(optimizer) -> LR scheduler, or an LR "
                f"scheduler, not {type(scheduler_fn).__name__}"
            )
        if averager_opts is not None and not isinstance(averager_opts, Mapping):
            raise TypeError(f"averager_opts must be a dict or None, not {averager_opts!r:.64}")
        if dht is not None:
            if not isinstance(dht, SyncDHT):
                raise TypeError(f"dht must be a swarmavg.DHT or None, not {type(dht).__name__}")
            for name, value in (
                ("host_maddrs", host_maddrs),
                ("initial_peers", initial_peers),
                ("transport", transport),
                ("identity_path", identity_path),
            ):
                if value is not None:
                    raise ValueError(f"{name}: not with dht= (that DHT is configured already)")
        if (
            initial_peers is not None
            and not isinstance(initial_peers, str)
            and (
                not isinstance(initial_peers, Sequence)
                or not all(isinstance(peer, str) for peer in initial_peers)
            )
        ):
            raise TypeError(
                "initial_peers must be a comma-separated str or a list of str, "
                f"not {initial_peers!r:.64}"
            )
        if host_maddrs is not None and (
            isinstance(host_maddrs, str) or not isinstance(host_maddrs, Sequence)
        ):
            raise TypeError(f"host_maddrs must be a list of addresses, not {host_maddrs!r:.64}")
        known = _optimizer_parameters()
        for name in optimizer_kwargs:
            if name in _LIBP2P_OPTIONS:
                raise TypeError(
                    f"{name}: an option of hivemind's libp2p DHT; swarmavg's DHT has no "
                    "equivalent, drop it (docs/guides/lightning.md)"
                )
            if name in _SET_BY_STRATEGY:
                raise TypeError(f"{name}: set by the strategy ({_SET_BY_STRATEGY[name]})")
            if name not in known:
                raise TypeError(
                    f"unexpected keyword argument {name!r} (neither a SwarmStrategy nor a "
                    "swarmavg.Optimizer parameter)"
                )

        self._target_batch_size = target_batch_size
        self._run_id = run_id
        self._batch_size = batch_size
        self._scheduler_fn = scheduler_fn
        self._reuse_grad_buffers = reuse_grad_buffers
        # what swarmavg.Optimizer can only do with an optimizer it makes (a factory)
        self._recreate_optimizer = bool(
            offload_optimizer or delay_optimizer_step or delay_grad_averaging
        )
        self._optimizer_kwargs: dict[str, Any] = {
            "matchmaking_time": matchmaking_time,
            "averaging_timeout": averaging_timeout,
            "delay_optimizer_step": delay_optimizer_step,
            "delay_state_averaging": delay_state_averaging,
            "delay_grad_averaging": delay_grad_averaging,
            "offload_optimizer": offload_optimizer,
            "reuse_grad_buffers": reuse_grad_buffers,
            "averager_opts": dict(averager_opts) if averager_opts is not None else None,
            "verbose": verbose,
            **optimizer_kwargs,
        }
        self._host_maddrs = list(host_maddrs) if host_maddrs is not None else None
        self._transport = transport
        self._identity_path = identity_path
        self._initial_peers: list[str] | None
        self._initial_peers_source: str | None
        self._initial_peers, self._initial_peers_source = self._read_initial_peers(initial_peers)

        self.dht: DHT | None = dht
        self._owns_dht = False
        #: set by Lightning's accelerator connector (the devices of Trainer(devices=...))
        self.parallel_devices: list[torch.device] | None = None
        self._swarm_optimizer: SwarmOptimizer | None = None
        self._inferred_batch_size: int | None = None
        self._pending_samples = 0
        self._zero_grad_saved: Any = None
        self._sync_metrics = sync_metrics
        self._metrics = _SwarmMetrics()
        self._metrics_gathered: Any = None  # (the gathered dict self._metrics was updated from)
        self._log_saved: Any = None
        self._logging = 0  # (inside the LightningModule's log(): a step's value)
        self._restored_optimizer_states: list[dict[str, Any]] | None = None

    # -- configuration ---------------------------------------------------------------------------

    def _read_initial_peers(
        self, argument: str | Sequence[str] | None
    ) -> tuple[list[str] | None, str | None]:
        """The initial peers and where they came from: an environment variable (it overrides
        the argument, as upstream), the argument, or none."""
        for variable in (SWARMAVG_INITIAL_PEERS_ENV, self.INITIAL_PEERS_ENV):
            value = os.environ.get(variable)
            if value is not None and value.strip():
                return _split_peers(value), variable
        if argument is None:
            return None, None
        peers = _split_peers(argument) if isinstance(argument, str) else list(argument)
        return (peers or None), ("initial_peers" if peers else None)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"swarm"`` (``Trainer(strategy="swarm")``, the target batch size from
        ``SWARMAVG_TARGET_BATCH_SIZE``)."""
        if REGISTERED_NAME not in strategy_registry:
            strategy_registry.register(
                REGISTERED_NAME,
                functools.partial(_strategy_from_environment, cls),
                description="collaborative training over a swarm of peers (swarmavg)",
            )

    # -- what a swarm peer is to Lightning --------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices
        if devices:
            if len(devices) > 1:
                raise self._ns.MisconfigurationException(
                    f"SwarmStrategy trains on one device per peer, not {len(devices)}: start one "
                    "process (peer) per device"
                )
            return devices[0]
        if isinstance(self.accelerator, self._ns.CUDAAccelerator):
            return torch.device("cuda", torch.cuda.current_device())
        if isinstance(self.accelerator, self._ns.CPUAccelerator):
            return torch.device("cpu")
        raise self._ns.MisconfigurationException(
            "Was unable to infer device type from the accelerator: "
            f"{type(self.accelerator).__name__}."
        )

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_global_zero(self) -> bool:
        return True

    @property
    def is_distributed(self) -> bool:
        """Whether Lightning should sync what it asks to: only a ``self.log(...,
        sync_dist=True)`` under ``sync_metrics`` while it runs (Lightning keeps ``sync_dist``
        only when this is true; at any other time, e.g. when it prepares data loaders, a
        swarm is not a distributed world of fixed ranks)."""
        return self._logging > 0

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """This peer's value (local: a swarm has no fixed set of ranks to reduce over); with
        ``sync_metrics``, a metric of ``self.log(..., sync_dist=True)`` reduced with the other
        peers' values from the last gradient round (:class:`_SwarmMetrics`), at once."""
        if not (
            self._sync_metrics
            and isinstance(group, _MetricKey)
            and isinstance(tensor, torch.Tensor)
            and tensor.numel() == 1
        ):
            return tensor
        op = str(getattr(reduce_op, "name", reduce_op) or "mean").lower()
        if op not in _REDUCE_OPS:
            return tensor
        # (a mean at an epoch's end is reduced as a sum of values, then of batch sizes)
        kind = ("step" if self._logging else "epoch") if tensor.is_floating_point() else "count"
        self._refresh_metrics()
        value = self._metrics.reduce(kind, group.name, float(tensor.item()), op)
        dtype = tensor.dtype if tensor.is_floating_point() else torch.get_default_dtype()
        return torch.tensor(value, dtype=dtype, device=tensor.device).reshape(tensor.shape)

    def _refresh_metrics(self) -> None:
        """The other peers' metrics from the last gradient round, once per round."""
        swarm = self._swarm_optimizer
        if swarm is None or swarm.grad_averager is None:
            return
        gathered = swarm.last_grad_gathered
        if gathered is not self._metrics_gathered:
            self._metrics_gathered = gathered
            self._metrics.update(gathered, swarm.grad_averager.peer_id)

    def _wrap_log(self) -> None:
        """``sync_metrics``: the LightningModule's ``log`` passes a :class:`_MetricKey` as the
        ``sync_dist_group`` of each metric logged with ``sync_dist=True`` (restored at
        teardown)."""
        module = self.lightning_module
        if module is None or self._log_saved is not None:
            return
        original = module.log
        signature = inspect.signature(original)
        strategy = self

        @functools.wraps(original)
        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if args:  # (options given by position)
                bound = signature.bind(name, value, *args, **kwargs)
                name, value = bound.arguments.pop("name"), bound.arguments.pop("value")
                kwargs = dict(bound.arguments)
            if not kwargs.get("sync_dist"):
                original(name, value, **kwargs)
                return
            kwargs["sync_dist_group"] = _MetricKey(name)
            strategy._logging += 1
            try:
                original(name, value, **kwargs)
            finally:
                strategy._logging -= 1

        self._log_saved = module.__dict__.get("log", _MISSING)
        module.log = log

    def all_gather(
        self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> torch.Tensor:
        """This peer's tensor (local)."""
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Returns at once (local)."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """This peer's object (local)."""
        return obj

    # -- the swarm --------------------------------------------------------------------------------

    @property
    def optimizer(self) -> SwarmOptimizer | None:
        """The :class:`swarmavg.Optimizer` (from the first training batch of ``fit`` until its
        end), else ``None``."""
        return self._swarm_optimizer

    @property
    def num_peers(self) -> int:
        """Peers of the run, as the last read of the swarm's progress counted them, this one
        included (1 before the first training batch)."""
        if self._swarm_optimizer is None or self._swarm_optimizer.tracker is None:
            return 1
        return max(1, int(self._swarm_optimizer.tracker.global_progress.num_peers))

    @property
    def local_epoch(self) -> int:
        """This peer's swarm epoch (``target_batch_size`` samples over all peers each): the
        number of optimizer steps of the swarm so far (0 before training, or the epoch of the
        checkpoint ``fit`` resumes from)."""
        if self._swarm_optimizer is not None:
            return self._swarm_optimizer.local_epoch
        for state in self._restored_optimizer_states or ():
            epoch = state.get("state", {}).get("local_epoch")
            if epoch is not None:
                return int(epoch)
        return 0

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn != self._ns.TrainerFn.FITTING:
            return
        self._install_grad_scaler()
        self._start_dht()
        if self._sync_metrics:
            self._wrap_log()

    def _install_grad_scaler(self) -> None:
        """Float16 AMP (``precision="16-mixed"``): swap the precision plugin's torch scaler for
        :class:`swarmavg.optim.GradScaler` with the same settings (torch's cannot see the
        gradients accumulated over many batches)."""
        from swarmavg.optim.grad_scaler import GradScaler

        plugin = self.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        if not isinstance(plugin, self._ns.MixedPrecision) or scaler is None:
            return
        if isinstance(scaler, GradScaler):
            return
        device = getattr(plugin, "device", None) or "cuda"
        plugin.scaler = GradScaler(
            device=str(device).split(":")[0],
            init_scale=float(scaler.get_scale()) if scaler.is_enabled() else 2.0**16,
            growth_factor=float(scaler.get_growth_factor()),
            backoff_factor=float(scaler.get_backoff_factor()),
            growth_interval=int(scaler.get_growth_interval()),
            enabled=bool(scaler.is_enabled()),
        )
        logger.debug("%s: float16 AMP with swarmavg.optim.GradScaler", self._run_id)

    def _start_dht(self) -> None:
        if self.dht is not None:
            return
        from swarmavg.dht import DHT

        options: dict[str, Any] = {}
        if self._host_maddrs is not None:
            options["host_maddrs"] = self._host_maddrs
        if self._transport is not None:
            options["transport"] = self._transport
        if self._identity_path is not None:
            options["identity_path"] = self._identity_path
        self.dht = DHT(initial_peers=self._initial_peers or (), **options)
        self._owns_dht = True
        if self._initial_peers is None:
            addresses = self.dht.get_visible_maddrs()
            logger.info(
                "%s: the first peer. Other peers join with:\n  %s=%s python ...\n"
                "or SwarmStrategy(initial_peers=%r)",
                self._run_id,
                SWARMAVG_INITIAL_PEERS_ENV,
                ",".join(addresses),
                ",".join(addresses),
            )
        else:
            logger.info(
                "%s: joining through %d peer(s) from %s",
                self._run_id,
                len(self._initial_peers),
                self._initial_peers_source,
            )

    def on_train_batch_start(self, batch: Any, batch_idx: int, *args: Any) -> None:
        """Count this batch's samples (for the next optimizer step); at the first batch, infer
        the batch size and wrap the optimizer.

        :raises MisconfigurationException: the first batch's size cannot be inferred (pass
            ``batch_size``), several optimizers, or gradient clipping with
            ``reuse_grad_buffers``.
        """
        size = self._batch_size_of(batch)
        if self._swarm_optimizer is None:
            self._initialize_swarm()
        self._pending_samples += size

    def _batch_size_of(self, batch: Any) -> int:
        if self._batch_size is not None:
            return self._batch_size
        try:
            size = int(self._ns.extract_batch_size(batch))
        except (self._ns.MisconfigurationException, RecursionError, TypeError, ValueError) as err:
            if self._inferred_batch_size is not None:
                return self._inferred_batch_size  # (a later batch: the first one's size)
            raise self._ns.MisconfigurationException(
                "We tried to infer the batch size from the first batch of data. "
                "Please provide the batch size to the Strategy by "
                "``Trainer(strategy=SwarmStrategy(batch_size=x))``. "
            ) from err
        if size < 1:
            return self._inferred_batch_size or 1
        if self._inferred_batch_size is None:
            self._inferred_batch_size = size
            logger.info("%s: batch size %d (inferred from the first batch)", self._run_id, size)
        return size

    def _initialize_swarm(self) -> None:
        from swarmavg.optim.optimizer import Optimizer as SwarmOptimizer

        if len(self.optimizers) != 1:
            raise self._ns.MisconfigurationException(
                "SwarmStrategy only supports training with one optimizer "
                f"(configure_optimizers gave {len(self.optimizers)})."
            )
        if self.dht is None:
            raise RuntimeError("SwarmStrategy: the DHT is not started (setup() did not run)")
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self._reuse_grad_buffers and trainer is not None and trainer.gradient_clip_val:
            raise self._ns.MisconfigurationException(
                "gradient clipping with reuse_grad_buffers=True: .grad is the running sum of "
                "the epoch's gradients and cannot be clipped per batch"
            )
        inner = self.optimizers[0]
        configs = list(self.lr_scheduler_configs)
        for config in configs:
            if isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                raise ValueError(
                    "The `ReduceLROnPlateau` scheduler is not currently supported with "
                    f"`{type(self).__name__}`."
                )
        optimizer: Any
        params: list[dict[str, Any]] | None = None
        scheduler: Any = self._scheduler_fn
        if self._recreate_optimizer:
            # swarmavg.Optimizer makes the optimizer itself (offloaded or stepped in the
            # background), from the configured one's class and parameter groups
            params = [
                {key: value for key, value in group.items() if key != "initial_lr"}
                for group in inner.param_groups
            ]
            optimizer_class: Callable[..., Any] = type(inner)
            optimizer = functools.partial(optimizer_class, **inner.defaults)
            if configs and self._scheduler_fn is None:
                warnings.warn(
                    "Enabling `delay_optimizer_step`, `delay_grad_averaging` or "
                    "`offload_optimizer` requires a `scheduler_fn` to be passed to the strategy "
                    "if a scheduler is being used (this is because the optimizer is re-created "
                    "within swarmavg); the scheduler of configure_optimizers has no effect.",
                    UserWarning,
                    stacklevel=2,
                )
        else:
            optimizer = inner
            if configs and self._scheduler_fn is not None:
                raise ValueError(
                    "scheduler_fn and a scheduler of configure_optimizers would both set the "
                    "learning rate: use one of them"
                )
            if len(configs) > 1:
                raise ValueError(
                    f"SwarmStrategy steps one LR scheduler, configure_optimizers gave "
                    f"{len(configs)}: combine them (torch.optim.lr_scheduler.SequentialLR)"
                )
            if configs:
                scheduler = configs[0].scheduler

        swarm = SwarmOptimizer(
            dht=self.dht,
            run_id=self._run_id,
            target_batch_size=self._target_batch_size,
            batch_size_per_step=self._batch_size or self._inferred_batch_size,
            optimizer=optimizer,
            params=params,
            scheduler=scheduler,
            **self._optimizer_kwargs,
        )
        try:
            if self._restored_optimizer_states:
                swarm.load_state_dict(self._restored_optimizer_states[0])
                logger.info(
                    "%s: resumed from a checkpoint at epoch %d", self._run_id, swarm.local_epoch
                )
        except BaseException:
            swarm.shutdown()
            raise
        self._restored_optimizer_states = None
        self._swarm_optimizer = swarm
        if self._sync_metrics:
            swarm.grad_gather = self._metrics.payload
        for config in configs:
            # (re-created optimizer without scheduler_fn: the scheduler is bound to the
            # configured optimizer, which no longer trains; it stays as it is)
            config.scheduler = _EpochScheduler(config.scheduler, swarm)
        self.optimizers = [swarm]  # (Lightning wraps it in a LightningOptimizer)
        if self._reuse_grad_buffers:
            self._disable_zero_grad()

    def _disable_zero_grad(self) -> None:
        """``reuse_grad_buffers``: the gradients are the accumulators, so Lightning must not
        clear them (it skips a hook that is not callable)."""
        module = self.lightning_module
        assert module is not None
        if self._ns.is_overridden("optimizer_zero_grad", module):
            warnings.warn(
                "You have overridden `optimizer_zero_grad` which will be disabled. When "
                "`SwarmStrategy(reuse_grad_buffers=True)`, the optimizer cannot call zero grad, "
                "as this would delete the gradients before they are averaged.",
                UserWarning,
                stacklevel=2,
            )
        self._zero_grad_saved = module.__dict__.get("optimizer_zero_grad", _MISSING)
        module.optimizer_zero_grad = None

    def _restore_log(self) -> None:
        module = self.lightning_module
        if module is None or self._log_saved is None:
            return
        if self._log_saved is _MISSING:
            module.__dict__.pop("log", None)
        else:
            module.log = self._log_saved
        self._log_saved = None

    def _restore_zero_grad(self) -> None:
        module = self.lightning_module
        if module is None or self._zero_grad_saved is None:
            return
        if self._zero_grad_saved is _MISSING:
            module.__dict__.pop("optimizer_zero_grad", None)
        else:
            module.optimizer_zero_grad = self._zero_grad_saved
        self._zero_grad_saved = None

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """Lightning's optimizer step, telling :class:`swarmavg.Optimizer` how many samples
        the batches since the last step held; then log ``swarm/local_epoch`` and
        ``swarm/num_peers``."""
        swarm = self._swarm_optimizer
        if swarm is not None and optimizer is swarm and "batch_size" not in kwargs:
            samples = self._pending_samples or self._batch_size or self._inferred_batch_size
            kwargs["batch_size"] = samples
        self._pending_samples = 0
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._log_progress()
        return output

    def _log_progress(self) -> None:
        module = self.lightning_module
        if module is None or self._swarm_optimizer is None:
            return
        try:
            for name, value in (
                ("swarm/local_epoch", self.local_epoch),
                ("swarm/num_peers", self.num_peers),
            ):
                module.log(name, float(value), on_step=True, on_epoch=False, batch_size=1)
        except self._ns.MisconfigurationException:
            pass  # (a step outside the hooks that may log: nothing to log then)

    # -- checkpoints ------------------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Lightning's checkpoint, with ``checkpoint["swarmavg"] = {"run_id", "local_epoch"}``
        (the optimizer's state holds ``local_epoch`` too); every peer writes its own."""
        checkpoint = {
            **checkpoint,
            "swarmavg": {"run_id": self._run_id, "local_epoch": self.local_epoch},
        }
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Before the first batch the optimizer is not wrapped yet: keep its state (and epoch)
        for the :class:`swarmavg.Optimizer` made then; a peer behind the swarm downloads the
        swarm's state at its first step."""
        if self._swarm_optimizer is not None:
            super().load_optimizer_state_dict(checkpoint)
            return
        states = checkpoint.get("optimizer_states")
        if states:
            self._restored_optimizer_states = [dict(state) for state in states]

    # -- the end ----------------------------------------------------------------------------------

    def teardown(self) -> None:
        """Restore ``optimizer_zero_grad``, leave the run (shut the optimizer down) and stop
        the DHT if the strategy started it; the strategy can ``fit`` again."""
        try:
            self._restore_zero_grad()
            self._restore_log()
            if self._swarm_optimizer is not None:
                self._swarm_optimizer.shutdown()
        finally:
            self._swarm_optimizer = None
            self._pending_samples = 0
            self._inferred_batch_size = None
            self._metrics = _SwarmMetrics()
            self._metrics_gathered = None
            if self._owns_dht and self.dht is not None:
                logger.debug("%s: shutting the DHT down", self._run_id)
                self.dht.shutdown()
                self.dht = None
                self._owns_dht = False
            super().teardown()


def _strategy_from_environment(cls: type[Any]) -> Any:
    """``Trainer(strategy="swarm")``: the strategy with ``target_batch_size`` from
    ``SWARMAVG_TARGET_BATCH_SIZE`` (and the peers from the usual variables).

    :raises ValueError: the variable is missing or not a positive integer.
    """
    value = os.environ.get(TARGET_BATCH_SIZE_ENV, "").strip()
    if not value.isdigit() or int(value) < 1:
        raise ValueError(
            f'Trainer(strategy="{REGISTERED_NAME}") needs {TARGET_BATCH_SIZE_ENV}=<samples per '
            "epoch over all peers> in the environment"
            + (f" (it is {value!r})" if value else "")
            + "; or pass Trainer(strategy=SwarmStrategy(target_batch_size=...))"
        )
    return cls(target_batch_size=int(value))


@functools.cache
def strategy_class(namespace: str) -> Any:
    """The ``SwarmStrategy`` class for one Lightning namespace (``"lightning.pytorch"`` or
    ``"pytorch_lightning"``), registered as ``"swarm"`` in that namespace's
    ``StrategyRegistry``. One class per namespace (the same one at every call).

    :raises ModuleNotFoundError: that namespace is not installed.
    """
    if namespace not in ("lightning.pytorch", "pytorch_lightning"):
        raise ValueError(
            f"namespace must be 'lightning.pytorch' or 'pytorch_lightning', not {namespace!r}"
        )
    ns = _load_namespace(namespace)
    module = (
        "swarmavg.integrations.lightning"
        if namespace == "lightning.pytorch"
        else "swarmavg.integrations.pytorch_lightning"
    )
    cls: Any = type(
        "SwarmStrategy",
        (_SwarmStrategy, ns.Strategy),
        {
            "__module__": module,
            "__qualname__": "SwarmStrategy",
            "__doc__": _SwarmStrategy.__doc__,
            "_ns": ns,
        },
    )
    cls.register_strategies(ns.StrategyRegistry)
    return cls
