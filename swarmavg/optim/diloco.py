"""``swarmavg.optim.DiLoCo``: DiLoCo's outer optimization over a swarm (spec section E).

Each peer takes ``sync_every`` (H) steps of its own *inner* optimizer; then the peers average
the pseudo-gradient Δ = θ_global − θ_local with a :class:`swarmavg.DecentralizedAverager`, and
each one restores θ_global, sets ``p.grad = Δ̄`` and takes a step of the *outer* optimizer
(Nesterov SGD by default). The bookkeeping (when to synchronize, outer epochs, what a failed
round does) is :class:`swarmavg.proto.diloco.DiLoCoSchedule`; this module holds the tensors.

Two ways to use it, with the same effect::

    inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
    with DiLoCo(model.parameters(), inner_optimizer=inner, dht=dht, run_id="run",
                sync_every=500):
        for batch in data:             # the loop is unchanged: every 500th inner.step()
            loss(model, batch).backward()   # synchronizes (a hook on the inner optimizer)
            inner.step()
            inner.zero_grad()

    diloco = DiLoCo(model.parameters(), inner_optimizer=inner, dht=dht, run_id="run",
                    sync_every=500, hook=False)
    for batch in data:                 # as a wrapper: diloco.step() runs inner.step() and
        loss(model, batch).backward()  # synchronizes every 500th time
        diloco.step()
        diloco.zero_grad()
    diloco.shutdown()

See ``docs/guides/diloco.md``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Self

import torch

from swarmavg._step import AveragingStage, StepResult
from swarmavg.averager import DecentralizedAverager, StepHandle
from swarmavg.compression import CompressionBase, NoCompression, TensorInfo
from swarmavg.metrics import DiLoCoMetrics
from swarmavg.optim.progress_tracker import ProgressTracker
from swarmavg.optim.state_averager import (
    EVERYONE,
    _check_finite,
    _check_optimizer_state,
    _decode_tree,
    _encode_tree,
    _Refused,
)
from swarmavg.proto.diloco import (
    DIGEST_SIZE,
    WEIGHTINGS,
    DiLoCoSchedule,
    RoundPlan,
    RoundReport,
    epoch_group_bits,
    gather_payload,
    round_weight,
)
from swarmavg.proto.progress import GlobalTrainingProgress, hyperparameters_digest
from swarmavg.sync._loop import shut_down_at_exit

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from swarmavg._prometheus import MetricsServer
    from swarmavg.dht import DHT

__all__ = ["DiLoCo"]

logger = logging.getLogger(__name__)

OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]

#: Scheduler steps beyond which a rebuilt schedule jumps (torch's closed form) instead of
#: stepping one by one.
_MAX_SCHEDULER_STEPS = 10_000
#: Seconds between looks at the records while a round looks for its group.
_ROUND_POLL = 0.1


def default_outer_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: SGD, lr 0.7, momentum 0.9, Nesterov (the paper's and
    OpenDiLoCo's defaults)."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, not {value!r:.40}")
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"{name} must be positive and finite, not {value!r}")
    return float(value)


class DiLoCo:
    """DiLoCo over a swarm: ``sync_every`` inner steps, then an outer step on the averaged
    pseudo-gradient (Douillard et al. 2023; OpenDiLoCo; torchft's ``DiLoCo``).

    :param params: the parameters to train (tensors or param groups); every one must be in
        ``inner_optimizer``'s param groups.
    :param inner_optimizer: a ``torch.optim.Optimizer`` instance over ``params`` (AdamW in the
        paper); its state stays local.
    :param outer_optimizer: a factory ``list_of_params -> torch.optim.Optimizer`` (default:
        :func:`default_outer_optimizer`, SGD lr 0.7, momentum 0.9, Nesterov). Its state and
        θ_global are the same on every peer (a joiner downloads them).
    :param dht: a running :class:`swarmavg.DHT`.
    :param run_id: the run's name: peers with the same ``run_id`` train together (progress
        records under ``f"{run_id}_progress"``, averaging under ``f"{run_id}_diloco"``).
    :param sync_every: inner steps per round (H, an int ≥ 1).
    :param scheduler: a factory ``inner_optimizer -> LRScheduler`` for the inner learning
        rate, or ``None``. It is driven by the global step ``outer_epoch · sync_every +
        inner_step`` (not by local calls), so a peer that joins late gets the swarm's rate.
    :param weighting: ``"equal"`` (every peer's Δ weighs the same, DiLoCo's rule, the default)
        or ``"samples"`` (weighted by ``batch_size`` · inner steps since θ_global).
    :param batch_size: samples per inner step, for ``weighting="samples"`` and the progress
        records (an int ≥ 1).
    :param compression: a codec of :mod:`swarmavg.compression` for Δ in the all-reduce
        (``Float16Compression()``, ``Uniform8BitQuantization()``, ...; default none).
    :param error_feedback: keep what compression lost and add it to the next round's Δ
        (``None``: on with a lossy ``compression``).
    :param on_round_failure: what a failed round (among several peers) does: ``"rollback"``
        (default: back to θ_global, the local progress discarded, as torchft) or
        ``"keep_local"`` (keep θ_local; the next round's Δ holds both rounds' steps).
    :param matchmaking_time: seconds a round waits for the others to join its group.
    :param averaging_timeout: seconds a round may take in all.
    :param load_state_timeout: seconds for a download of the state.
    :param target_group_size: the largest group (default: everyone, up to 256).
    :param averager_opts: more options of :class:`swarmavg.DecentralizedAverager`.
    :param tracker_opts: more options of :class:`swarmavg.optim.ProgressTracker`.
    :param client_mode: a client (behind NAT) averages but serves nothing; ``None``: the DHT's.
    :param hook: hook ``inner_optimizer.step`` (``register_step_post_hook``) so that every
        ``sync_every``-th ``inner.step()`` synchronizes (default ``True``; with ``False`` call
        :meth:`step` instead of ``inner.step()``).
    :param load_state_on_join: download θ_global and the outer state at once when another
        peer is at a later outer epoch (default ``True``).
    :param status_loglevel: the level of the per-round status lines (INFO).
    :param metrics_port: serve :attr:`metrics` over HTTP in Prometheus' text format on this
        port (0: a free one, see :attr:`metrics_address`); needs ``pip install
        "swarmavg[prometheus]"``. Default: no server. See ``docs/guides/metrics.md``.
    :param metrics_host: the address the metrics server listens on (default loopback only).
    :raises TypeError: an argument has the wrong type (the message names it).
    :raises ValueError: an argument is out of range, or a parameter is not in
        ``inner_optimizer`` (the message names the argument).
    :raises RuntimeError: the DHT is not running.
    :raises ImportError: ``metrics_port`` is given and prometheus-client is not installed.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        inner_optimizer: torch.optim.Optimizer,
        outer_optimizer: OuterFactory | None = None,
        dht: DHT,
        run_id: str,
        sync_every: int,
        scheduler: SchedulerFactory | None = None,
        weighting: str = "equal",
        batch_size: int = 1,
        compression: CompressionBase | None = None,
        error_feedback: bool | None = None,
        on_round_failure: str = "rollback",
        matchmaking_time: float = 15.0,
        averaging_timeout: float = 60.0,
        load_state_timeout: float = 60.0,
        target_group_size: int | None = None,
        averager_opts: dict[str, Any] | None = None,
        tracker_opts: dict[str, Any] | None = None,
        client_mode: bool | None = None,
        hook: bool = True,
        load_state_on_join: bool = True,
        status_loglevel: int = logging.INFO,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
    ) -> None:
        from swarmavg._prometheus import check_metrics_options
        from swarmavg.dht import DHT as SyncDHT

        self._closed = True  # (until made: shutdown() of a half-made one does nothing)
        self._hook_handle: RemovableHandle | None = None
        self._metrics_server: MetricsServer | None = None
        given: object = dht
        if not isinstance(given, SyncDHT):
            raise TypeError(f"dht must be a swarmavg.DHT, not {type(given).__name__}")
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"run_id must be a non-empty str, not {run_id!r:.64}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(
                "inner_optimizer must be a torch.optim.Optimizer instance, not "
                f"{type(inner_optimizer).__name__}"
            )
        if outer_optimizer is None:
            outer_optimizer = default_outer_optimizer
        if isinstance(outer_optimizer, torch.optim.Optimizer) or not callable(outer_optimizer):
            raise TypeError(
                "outer_optimizer must be a factory params -> optimizer (e.g. "
                "functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)), not "
                f"{type(outer_optimizer).__name__}"
            )
        if scheduler is not None and (
            isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) or not callable(scheduler)
        ):
            raise TypeError(
                "scheduler must be a factory inner_optimizer -> LRScheduler or None, not "
                f"{type(scheduler).__name__}"
            )
        self.schedule = DiLoCoSchedule(sync_every, on_round_failure)
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, not {weighting!r:.40}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int):
            raise TypeError(f"batch_size must be an int, not {batch_size!r:.40}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, not {batch_size}")
        if compression is not None and not isinstance(compression, CompressionBase):
            raise TypeError(
                f"compression must be a swarmavg.compression codec or None, not {compression!r:.64}"
            )
        for name, flag in (
            ("hook", hook),
            ("load_state_on_join", load_state_on_join),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, not {flag!r:.40}")
        for name, maybe in (("error_feedback", error_feedback), ("client_mode", client_mode)):
            if maybe is not None and not isinstance(maybe, bool):
                raise TypeError(f"{name} must be a bool or None, not {maybe!r:.40}")
        check_metrics_options(metrics_port, metrics_host)
        self.matchmaking_time = _check_seconds("matchmaking_time", matchmaking_time)
        self.averaging_timeout = _check_seconds("averaging_timeout", averaging_timeout)
        self.load_state_timeout = _check_seconds("load_state_timeout", load_state_timeout)
        if target_group_size is None:
            target_group_size = EVERYONE
        for name, opts in (("averager_opts", averager_opts), ("tracker_opts", tracker_opts)):
            if opts is not None and not isinstance(opts, dict):
                raise TypeError(f"{name} must be a dict or None, not {type(opts).__name__}")

        self.params = self._check_params(params, inner_optimizer)
        self.inner_optimizer = inner_optimizer
        self.run_id = run_id
        self.weighting = weighting
        self.batch_size = batch_size
        self.status_loglevel = status_loglevel
        self.client_mode = bool(dht.client_mode if client_mode is None else client_mode)
        self.dht = dht
        self._scheduler_factory = scheduler
        self.scheduler = None if scheduler is None else self._make_scheduler()

        with torch.no_grad():
            #: θ_global: fp32 copies on the CPU
            self.backup = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        self.outer_optimizer = outer_optimizer(list(self.params))
        if not isinstance(self.outer_optimizer, torch.optim.Optimizer):
            raise TypeError(
                "outer_optimizer must return a torch.optim.Optimizer, not "
                f"{type(self.outer_optimizer).__name__}"
            )
        outer_params = [p for group in self.outer_optimizer.param_groups for p in group["params"]]
        if len(outer_params) != len(self.params) or any(
            a is not b for a, b in zip(outer_params, self.params, strict=False)
        ):
            raise ValueError("outer_optimizer must optimize exactly the params it is given")
        #: held while θ_global and the outer state change or are copied (a state share runs
        #: in a worker thread)
        self._state_lock = threading.Lock()
        self.compression = NoCompression() if compression is None else compression
        if error_feedback is None:
            error_feedback = not isinstance(self.compression, NoCompression)

        self.tracker = ProgressTracker(
            dht,
            run_id,
            target_batch_size=sync_every * batch_size,
            client_mode=self.client_mode,
            hyperparameters=self._hyperparameter_digest(),
            **(tracker_opts or {}),
        )
        try:
            options: dict[str, Any] = {
                "averaging_expiration": self.matchmaking_time,
                "allreduce_timeout": self.averaging_timeout,
                "next_chunk_timeout": self.matchmaking_time,
                **(averager_opts or {}),
            }
            self.averager = _DiLoCoAverager(
                self,
                [torch.zeros_like(b) for b in self.backup],
                dht,
                prefix=f"{run_id}_diloco",
                target_group_size=target_group_size,
                client_mode=self.client_mode,
                compression=self.compression,
                tensor_infos=[TensorInfo("gradient", b.numel()) for b in self.backup],
                error_feedback=error_feedback,
                **options,
            )
        except BaseException:
            self.tracker.shutdown()
            raise
        #: the first round has not been planned yet: it may not go alone on the records read
        #: before this peer began to train (see :meth:`_plan`)
        self._first_round = True
        self._closed = False
        shut_down_at_exit(self)
        if hook:
            self._hook_handle = inner_optimizer.register_step_post_hook(self._post_hook)
        if metrics_port is not None:
            from swarmavg._prometheus import MetricsServer

            try:
                self._metrics_server = MetricsServer(
                    lambda: self.metrics, port=metrics_port, host=metrics_host
                )
            except BaseException:
                self.shutdown()
                raise
        self.tracker.report_local_progress(0, 0)
        if load_state_on_join and self.tracker.global_epoch > 0:
            self._catch_up(force=True)

    @staticmethod
    def _check_params(
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], inner: torch.optim.Optimizer
    ) -> list[torch.Tensor]:
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors or param groups, not a tensor")
        flat: list[torch.Tensor] = []
        for item in params:
            if isinstance(item, dict):
                group = item.get("params")
                flat += [group] if isinstance(group, torch.Tensor) else list(group or ())
            else:
                flat.append(item)
        if not flat:
            raise ValueError("params is empty")
        for index, param in enumerate(flat):
            if not isinstance(param, torch.Tensor) or not param.is_floating_point():
                raise TypeError(f"params[{index}] is not a floating-point tensor")
        if len({id(p) for p in flat}) != len(flat):
            raise ValueError("params names a tensor twice")
        known = {id(p) for group in inner.param_groups for p in group["params"]}
        missing = [i for i, p in enumerate(flat) if id(p) not in known]
        if missing:
            raise ValueError(f"params{missing[:5]} are not optimized by inner_optimizer")
        return flat

    def _hyperparameter_digest(self) -> str:
        inner = self.inner_optimizer
        return hyperparameters_digest(
            {
                "kind": "diloco",
                "inner": type(inner).__qualname__,
                "sync_every": self.schedule.sync_every,
                "weighting": self.weighting,
            }
        )

    # -- the training loop -----------------------------------------------------------------------

    @property
    def outer_epoch(self) -> int:
        """Rounds of the run so far (the number of θ_global updates this peer holds)."""
        return self.schedule.outer_epoch

    @property
    def inner_step(self) -> int:
        """Inner steps since θ_global."""
        return self.schedule.inner_step

    @property
    def global_step(self) -> int:
        """``outer_epoch · sync_every + inner_step``: the step the inner schedule is at."""
        return self.schedule.global_step

    @property
    def last_round(self) -> RoundReport | None:
        """What the latest round did (:class:`swarmavg.proto.diloco.RoundReport`), or
        ``None`` before the first."""
        return self.schedule.last_round

    @property
    def rounds_failed(self) -> int:
        return self.schedule.rounds_failed

    @property
    def metrics(self) -> DiLoCoMetrics:
        """What this peer did so far: rounds by outcome, state downloads, and its averager's
        :class:`~swarmavg.metrics.AveragerMetrics` (a :class:`swarmavg.metrics.DiLoCoMetrics`
        snapshot, see ``docs/guides/metrics.md``). Any thread may read it; the counters are
        written by the training thread, so a snapshot taken during a round may show the
        round's counters before its outer epoch."""
        schedule = self.schedule
        last = schedule.last_round
        return DiLoCoMetrics(
            run_id=self.run_id,
            outer_epoch=schedule.outer_epoch,
            inner_step=schedule.inner_step,
            global_step=schedule.global_step,
            rounds_averaged=schedule.rounds_averaged,
            rounds_alone=schedule.rounds_alone,
            rounds_failed=schedule.rounds_failed,
            rounds_diverged=schedule.rounds_diverged,
            state_loads=schedule.state_loads,
            state_load_failures=schedule.state_load_failures,
            last_round_seconds=0.0 if last is None else last.seconds,
            averager=self.averager.metrics,
        )

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """``(host, port)`` where :attr:`metrics` are served (``None``: no ``metrics_port``)."""
        server = self._metrics_server
        return None if server is None else (server.host, server.port)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups."""
        return self.inner_optimizer.param_groups

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The wrapper's step: ``inner_optimizer.step(closure)``, then (every
        ``sync_every``-th time) a round. Returns what the inner step returned.

        :raises RuntimeError: after :meth:`shutdown`.
        """
        if self._closed:
            raise RuntimeError("this DiLoCo was shut down")
        loss = self.inner_optimizer.step(closure)
        if self._hook_handle is None:
            self.inner_step_done()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``inner_optimizer.zero_grad(set_to_none)``."""
        self.inner_optimizer.zero_grad(set_to_none)

    def _post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._closed:
            self.inner_step_done()

    def inner_step_done(self) -> None:
        """Count one inner step that the caller took; runs the round when one is due. Called
        by the hook or by :meth:`step`; call it yourself only with ``hook=False`` and your own
        ``inner_optimizer.step()``.

        :raises RuntimeError: after :meth:`shutdown`.
        """
        if self._closed:
            raise RuntimeError("this DiLoCo was shut down")
        due = self.schedule.inner_step_done()
        if not due and self.schedule.should_load_state(self.tracker.global_epoch, time.monotonic()):
            self._catch_up()  # (the swarm moved on: this peer's steps since θ_global are stale)
        self._drive_scheduler()
        if self._first_round and self.schedule.inner_step == 1:
            # (the tracker reads the records again soon after this first report of samples;
            # the first round waits for that read if it would otherwise go alone)
            self.tracker.fetched_global_progress_this_epoch.clear()
        self.tracker.report_local_progress(
            self.outer_epoch, self.schedule.inner_step * self.batch_size
        )
        if due:
            self._round()

    # -- rounds ----------------------------------------------------------------------------------

    def _plan(self) -> tuple[RoundPlan, GlobalTrainingProgress]:
        """What the due round does. A peer's first round goes alone only on records read after
        it began to train (it waits for that read, at most ``matchmaking_time``): peers that
        start together publish their records at about the same moment, and each one's earlier
        reads may miss the others."""
        progress = self.tracker.global_progress
        plan = self.schedule.plan_round(progress.num_peers, progress.epoch, time.monotonic())
        last = self.schedule.last_round
        if plan == "alone" and (self._first_round or last is None or last.outcome != "alone"):
            # (a first round, or the peers of the last one are gone from the records: confirm
            # it on a read made after the round was due, at most matchmaking_time; a read that
            # found nothing under load would otherwise split this peer from the swarm)
            if not self._first_round:
                self.tracker.fetched_global_progress_this_epoch.clear()
            self.tracker.fetched_global_progress_this_epoch.wait(self.matchmaking_time)
            progress = self.tracker.global_progress
            plan = self.schedule.plan_round(progress.num_peers, progress.epoch, time.monotonic())
        self._first_round = False
        return plan, progress

    def _theta_digest(self) -> bytes:
        """A digest of θ_global (its shapes and fp32 bytes): equal on two peers exactly when
        they hold the same θ_global."""
        digest = hashlib.blake2b(digest_size=DIGEST_SIZE)
        with self._state_lock:
            for backup in self.backup:
                digest.update(repr(tuple(backup.shape)).encode())
                digest.update(backup.contiguous().numpy().data)
        return digest.digest()

    def _round(self) -> None:
        started = time.perf_counter()
        plan, progress = self._plan()
        if plan == "behind":
            self._fail(f"the swarm is at outer epoch {self.tracker.global_epoch}", started)
            self._catch_up(force=True)
            return
        with self._state_lock, torch.no_grad(), self.averager.get_tensors() as deltas:
            for delta, backup, param in zip(deltas, self.backup, self.params, strict=True):
                delta.copy_(backup)
                delta.sub_(param.detach().to("cpu", torch.float32))
        group_size, diverged = 1, 0
        if plan == "average":
            weight = round_weight(self.weighting, self.schedule.inner_step, self.batch_size)
            self.averager.expected_group_size = max(1, progress.num_active_peers)
            # groups form per outer epoch: a peer behind (its records not read yet) does not
            # meet the peers ahead, whose mean would take its Δ against an older θ_global
            self.averager.set_group_bits(epoch_group_bits(self.outer_epoch))
            try:
                handle = self.averager.step(
                    gather=gather_payload(self.outer_epoch, self._theta_digest()),
                    weight=weight,
                    timeout=self.averaging_timeout,
                    wait=False,
                )
                result = self._await_round(handle)
            except Exception as exc:
                self._fail(f"{type(exc).__name__}: {exc}"[:200], started)
                return
            if result is None:
                self._fail(
                    f"the swarm went on to outer epoch {self.tracker.global_epoch} while this "
                    "peer looked for a group",
                    started,
                )
                self._catch_up(force=True)
                return
            if result.local_spans:
                # some parts of Δ̄ kept this peer's own values: the members disagree on it
                who = ", ".join(f"{peer}: {why}" for peer, why in result.local_spans[:3])
                self._fail(f"the all-reduce was partial ({who})"[:200], started)
                return
            members = {peer.to_bytes(): peer for peer in result.gathered}
            check = self.schedule.check_round(
                {peer.to_bytes(): value for peer, value in result.gathered.items()},
                self._theta_digest(),
            )
            if check.verdict == "behind":
                self._fail("a groupmate is at a later outer epoch", started)
                self._catch_up(force=True)
                return
            if check.verdict == "diverged":
                assert check.reference is not None
                reference = members[check.reference]
                self._fail(
                    f"this peer's θ_global differs from that of {reference.short()}, the "
                    "round's reference; taking its next state",
                    started,
                    diverged=True,
                )
                self._catch_up(force=True, diverged=True)
                return
            diverged = check.diverged
            group_size = result.group_size
        with self._state_lock:  # (a state served meanwhile has θ_global and its epoch together)
            self._outer_step()
            report = self.schedule.round_succeeded(
                alone=plan == "alone", group_size=group_size, seconds=time.perf_counter() - started
            )
        self._after_epoch_change()
        if report.outcome == "alone":
            how = "no other peer: its own pseudo-gradient"
        else:
            how = f"averaged with {group_size - 1} peers in {report.seconds:.2f} s"
            if diverged:
                how += f" ({diverged} held another θ_global and take this one)"
        logger.log(self.status_loglevel, "%s outer epoch %d: %s", self.run_id, report.epoch, how)

    def _await_round(self, handle: StepHandle) -> StepResult | None:
        """The round's result; ``None`` if, while it still looked for a group, the records
        showed the swarm at a later outer epoch (and no failed download asks to wait): the
        round is cancelled then. Its peers averaged this epoch without this one (groups form
        per epoch: it would find nobody), and waiting out ``averaging_timeout`` only put it
        further behind: under load, a peer whose first round missed the others' waited 10 s
        there while they trained on, and it never averaged again in that run."""
        try:
            while True:
                done, _ = concurrent.futures.wait([handle], timeout=_ROUND_POLL)
                if done:
                    return handle.result()
                if handle.stage in (
                    AveragingStage.IDLE,
                    AveragingStage.LOOKING_FOR_GROUP,
                ) and self.schedule.should_load_state(self.tracker.global_epoch, time.monotonic()):
                    handle.cancel()
                    return None
        except BaseException:  # (Ctrl+C included: the step does not outlive the wait)
            handle.cancel()
            raise

    @torch.no_grad()
    def _outer_step(self) -> None:
        """θ_global ← outer step from θ_global on Δ̄ (in the averaged tensors). The caller
        holds ``_state_lock`` and moves the epoch under it too."""
        saved = [p.grad for p in self.params]
        with self.averager.get_tensors() as deltas:
            for param, backup, delta in zip(self.params, self.backup, deltas, strict=True):
                param.copy_(backup)
                param.grad = delta.to(param.device, param.dtype, copy=True)
        try:
            self.outer_optimizer.step()
        finally:
            for param, grad in zip(self.params, saved, strict=True):
                param.grad = grad
        for backup, param in zip(self.backup, self.params, strict=True):
            backup.copy_(param.detach())

    def _fail(self, error: str, started: float, *, diverged: bool = False) -> None:
        report = self.schedule.round_failed(error, time.perf_counter() - started, diverged=diverged)
        if report.action == "rollback":
            with torch.no_grad(), self._state_lock:
                for param, backup in zip(self.params, self.backup, strict=True):
                    param.copy_(backup)
            self._drive_scheduler()
            what = "rolled back to θ_global"
        else:
            what = "keeping the local parameters"
        logger.warning(
            "%s outer epoch %d: the round failed (%s); %s",
            self.run_id,
            report.epoch,
            error,
            what,
        )

    def _after_epoch_change(self) -> None:
        self._drive_scheduler()
        self.tracker.report_local_progress(self.outer_epoch, 0)
        if not self.client_mode:
            self.averager.state_sharing_priority = self.outer_epoch

    # -- the inner learning rate -----------------------------------------------------------------

    def _make_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        assert self._scheduler_factory is not None
        made = self._scheduler_factory(self.inner_optimizer)
        if not isinstance(made, torch.optim.lr_scheduler.LRScheduler):
            raise TypeError(f"scheduler must return an LRScheduler, not {type(made).__name__}")
        return made

    def _drive_scheduler(self) -> None:
        """Bring the inner schedule to :attr:`global_step` (forwards step by step; backwards,
        after a rollback or a download, from a fresh schedule)."""
        scheduler = self.scheduler
        if scheduler is None:
            return
        target = self.global_step
        if target < scheduler.last_epoch or target - scheduler.last_epoch > _MAX_SCHEDULER_STEPS:
            for group in self.inner_optimizer.param_groups:
                if "initial_lr" in group:
                    group["lr"] = group["initial_lr"]
            self.scheduler = scheduler = self._make_scheduler()
            if target > _MAX_SCHEDULER_STEPS:
                # far ahead: torch's closed form (exact for LambdaLR, StepLR, CosineAnnealingLR,
                # ExponentialLR, ...)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    scheduler.step(target)
                return
        with warnings.catch_warnings():
            # (torch warns when a scheduler steps before its optimizer: ours follows the step)
            warnings.simplefilter("ignore")
            while scheduler.last_epoch < target:
                scheduler.step()

    # -- state sharing ---------------------------------------------------------------------------

    def state_to_share(self) -> tuple[dict[str, Any], list[torch.Tensor], list[TensorInfo]]:
        """What this peer serves a joiner: metadata ``{"outer_epoch", "sync_every",
        "outer_metadata"}`` (msgpack) and copies of θ_global and the outer optimizer's tensors.

        :raises TypeError: the outer optimizer's state holds a value that cannot be shared.
        """
        tensors: list[torch.Tensor] = []
        with self._state_lock:
            backup = [b.clone() for b in self.backup]
            outer_metadata = _encode_tree(self.outer_optimizer.state_dict(), tensors)
            epoch = self.outer_epoch
        metadata = {
            "outer_epoch": epoch,
            "sync_every": self.schedule.sync_every,
            "outer_metadata": outer_metadata,
        }
        infos = [
            *(TensorInfo("parameter", t.numel()) for t in backup),
            *(TensorInfo("optimizer", t.numel()) for t in tensors),
        ]
        return metadata, [*backup, *tensors], infos

    def load_state_from_peers(self, timeout: float | None = None) -> bool:
        """Download θ_global, the outer optimizer's state and the outer epoch from a peer and
        take them: the parameters become θ_global (the local progress is discarded) and the
        inner schedule follows. A state behind ours or one that does not fit is refused.

        :param timeout: seconds (default ``load_state_timeout``).
        :returns: whether a state was taken.
        :raises RuntimeError: after :meth:`shutdown`.
        """
        return self._load_state(timeout, self.outer_epoch)

    def _load_state(self, timeout: float | None, min_epoch: int) -> bool:
        """:meth:`load_state_from_peers`, refusing a state before ``min_epoch``."""
        if self._closed:
            raise RuntimeError("this DiLoCo was shut down")
        loaded = self.averager.load_state_from_peers(
            timeout=self.load_state_timeout if timeout is None else timeout
        )
        if loaded is None:
            logger.log(self.status_loglevel, "%s: no peer served its state", self.run_id)
            return False
        metadata, tensors = loaded
        try:
            epoch, outer_state = self._check_state(metadata, tensors, min_epoch)
            with torch.no_grad(), self._state_lock:
                try:
                    self.outer_optimizer.load_state_dict(outer_state)
                except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as exc:
                    raise _Refused(
                        f"the outer optimizer does not take its state: {exc!r:.200}"
                    ) from None
                for backup, param, theirs in zip(self.backup, self.params, tensors, strict=False):
                    backup.copy_(theirs)
                    param.copy_(theirs)
                self.schedule.state_loaded(epoch)
        except _Refused as exc:
            logger.warning("%s: refusing the state downloaded from a peer: %s", self.run_id, exc)
            return False
        self._after_epoch_change()
        logger.log(
            self.status_loglevel,
            "%s: loaded the swarm's state at outer epoch %d",
            self.run_id,
            epoch,
        )
        return True

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue this peer (with the model's own
        ``state_dict()`` for θ_local): ``{"outer_epoch", "inner_step", "sync_every",
        "theta_global": [fp32 CPU tensors], "outer_optimizer": ..., "inner_optimizer": ...}``
        (copies; ``torch.save`` it). Error-feedback residues of a lossy ``compression`` are
        not part of it (a fresh peer starts them at zero).

        :raises RuntimeError: after :meth:`shutdown`.
        """
        if self._closed:
            raise RuntimeError("this DiLoCo was shut down")
        with self._state_lock:
            return {
                "outer_epoch": self.schedule.outer_epoch,
                "inner_step": self.schedule.inner_step,
                "sync_every": self.schedule.sync_every,
                "theta_global": [b.clone() for b in self.backup],
                "outer_optimizer": _clone_tree(self.outer_optimizer.state_dict()),
                "inner_optimizer": _clone_tree(self.inner_optimizer.state_dict()),
            }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s checkpoint: θ_global, both optimizers' states, the
        outer epoch and the inner steps since θ_global (load the model's parameters, θ_local,
        yourself). Nothing changes unless every part fits. If the swarm has moved on, the
        next inner step downloads its state, as for a peer that fell behind.

        :raises TypeError: ``state_dict`` is not a mapping, or a part has the wrong type.
        :raises ValueError: a part does not fit (another ``sync_every``, shapes, a non-finite
            θ_global, an optimizer state for other parameters); the message names it.
        :raises RuntimeError: after :meth:`shutdown`.
        """
        if self._closed:
            raise RuntimeError("this DiLoCo was shut down")
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, not {type(state_dict).__name__}")
        missing = {
            "outer_epoch",
            "inner_step",
            "sync_every",
            "theta_global",
            "outer_optimizer",
            "inner_optimizer",
        } - state_dict.keys()
        if missing:
            raise ValueError(f"state_dict lacks {sorted(missing)}")
        if state_dict["sync_every"] != self.schedule.sync_every:
            raise ValueError(
                f"state_dict's sync_every is {state_dict['sync_every']!r:.40}, ours "
                f"{self.schedule.sync_every}"
            )
        theta = state_dict["theta_global"]
        if not isinstance(theta, list | tuple) or len(theta) != len(self.backup):
            raise ValueError(
                f"state_dict's theta_global must be a list of {len(self.backup)} tensors"
            )
        for index, (mine, theirs) in enumerate(zip(self.backup, theta, strict=True)):
            if not isinstance(theirs, torch.Tensor):
                raise TypeError(f"state_dict's theta_global[{index}] is not a tensor")
            if tuple(theirs.shape) != tuple(mine.shape):
                raise ValueError(
                    f"state_dict's theta_global[{index}] has shape {tuple(theirs.shape)}, ours "
                    f"{tuple(mine.shape)}"
                )
            try:
                _check_finite(f"theta_global[{index}]", theirs.to("cpu", torch.float32))
            except _Refused as exc:
                raise ValueError(f"state_dict's {exc}") from None
        checked = DiLoCoSchedule(self.schedule.sync_every)
        checked.restore(state_dict["outer_epoch"], state_dict["inner_step"])
        for name, optimizer in (
            ("outer_optimizer", self.outer_optimizer),
            ("inner_optimizer", self.inner_optimizer),
        ):
            try:
                _check_optimizer_state(optimizer, state_dict[name], ())
            except _Refused as exc:
                raise ValueError(f"state_dict's {name} does not fit: {exc}") from None
        with torch.no_grad(), self._state_lock:
            saved = (self.outer_optimizer.state_dict(), self.inner_optimizer.state_dict())
            try:
                self.outer_optimizer.load_state_dict(state_dict["outer_optimizer"])
                self.inner_optimizer.load_state_dict(state_dict["inner_optimizer"])
            except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as exc:
                self.outer_optimizer.load_state_dict(saved[0])
                self.inner_optimizer.load_state_dict(saved[1])
                raise ValueError(
                    f"state_dict's optimizer states do not load: {exc!r:.200}"
                ) from None
            for backup, theirs in zip(self.backup, theta, strict=True):
                backup.copy_(theirs)
            self.schedule.restore(checked.outer_epoch, checked.inner_step)
        self._after_epoch_change()
        self.tracker.report_local_progress(
            self.outer_epoch, self.schedule.inner_step * self.batch_size
        )

    def _check_state(
        self, metadata: Any, tensors: list[torch.Tensor], min_epoch: int
    ) -> tuple[int, Any]:
        if not isinstance(metadata, dict):
            raise _Refused(f"its metadata is a {type(metadata).__name__}, not a mapping")
        epoch = metadata.get("outer_epoch")
        if type(epoch) is not int or epoch < 0:
            raise _Refused(f"its outer epoch is {epoch!r:.40}, not an int >= 0")
        if epoch < min_epoch:
            raise _Refused(
                f"its outer epoch {epoch} is before {min_epoch} (ours is {self.outer_epoch})"
            )
        if metadata.get("sync_every") != self.schedule.sync_every:
            raise _Refused(
                f"its sync_every is {metadata.get('sync_every')!r:.40}, "
                f"ours {self.schedule.sync_every}"
            )
        count = len(self.params)
        if len(tensors) < count:
            raise _Refused(f"it holds {len(tensors)} tensors, fewer than our {count} parameters")
        for index, (mine, theirs) in enumerate(zip(self.backup, tensors, strict=False)):
            if tuple(theirs.shape) != tuple(mine.shape):
                raise _Refused(
                    f"its parameter {index} has shape {tuple(theirs.shape)}, ours "
                    f"{tuple(mine.shape)}"
                )
            _check_finite(f"parameter {index}", theirs)
        state = _decode_tree(metadata.get("outer_metadata"), list(tensors[count:]))
        _check_optimizer_state(self.outer_optimizer, state, ())
        return epoch, state

    def _catch_up(self, force: bool = False, *, diverged: bool = False) -> None:
        """Download the state because the swarm is at a later epoch (backing off after a
        failure unless ``force``). After a diverged round (``diverged``), only a later epoch's
        state is taken: a peer at ours may hold another θ_global than the reference's."""
        now = time.monotonic()
        if not force and not self.schedule.should_load_state(self.tracker.global_epoch, now):
            return
        try:
            loaded = self._load_state(None, self.outer_epoch + int(diverged))
        except Exception as exc:
            loaded = False
            logger.warning("%s: could not download the state: %s", self.run_id, exc)
        if not loaded:
            wait = self.schedule.state_load_failed(time.monotonic())
            logger.warning(
                "%s: the swarm is at outer epoch %d, this peer at %d, and no state was "
                "downloaded; training on, next try in %.0f s",
                self.run_id,
                self.tracker.global_epoch,
                self.outer_epoch,
                wait,
            )

    # -- lifecycle -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Unhook the inner optimizer, leave the run (a tombstone for the progress record)
        and stop averaging. Idempotent; the parameters keep their values."""
        if self._closed:
            return
        self._closed = True
        if self._hook_handle is not None:
            self._hook_handle.remove()
            self._hook_handle = None
        try:
            if self._metrics_server is not None:
                self._metrics_server.close()
            self.averager.shutdown()
        finally:
            self.tracker.shutdown()

    def is_alive(self) -> bool:
        return not self._closed

    def __enter__(self) -> Self:
        if self._closed:
            raise RuntimeError("this DiLoCo was shut down")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (
            f"<swarmavg.optim.DiLoCo {self.run_id!r} H={self.schedule.sync_every} "
            f"epoch={self.outer_epoch} inner_step={self.inner_step}"
            f"{' closed' if self._closed else ''}>"
        )


def _clone_tree(value: Any) -> Any:
    """A copy of an optimizer's ``state_dict()`` whose tensors are cloned (the optimizer
    goes on changing its own)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _clone_tree(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_clone_tree(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_clone_tree(item) for item in value)
    return value


class _DiLoCoAverager(DecentralizedAverager):
    """Averages Δ; serves θ_global and the outer state (:meth:`DiLoCo.state_to_share`)."""

    def __init__(self, owner: DiLoCo, *args: Any, **options: Any) -> None:
        self._owner = owner
        super().__init__(*args, **options)

    def get_current_state(self) -> tuple[Any, list[torch.Tensor], list[TensorInfo]]:  # type: ignore[override]
        return self._owner.state_to_share()
