"""What an averager's and an optimizer's rounds did: counters and sums, read as snapshots.

:attr:`swarmavg.aio.DecentralizedAverager.metrics` (and the sync facade's,
:attr:`swarmavg.DecentralizedAverager.metrics`) returns an :class:`AveragerMetrics`;
:attr:`swarmavg.Optimizer.metrics` returns an :class:`OptimizerMetrics`, which holds the
snapshots of its two averagers; :attr:`swarmavg.optim.DiLoCo.metrics` a :class:`DiLoCoMetrics`.
A snapshot is a frozen dataclass of plain numbers taken at one moment: counters only grow (from
0 when the averager was made), ``last_*`` fields are gauges.
``as_dict()`` gives the same as a dict of plain values (for JSON or a log line).
``docs/guides/metrics.md`` describes every field, and the Prometheus exporter (``metrics_port=``).

Theory of operation: the counting is sans-IO. The averager owns an :class:`AveragerCounter` and
calls it on its event-loop thread at each event of a step (started, group formed, round ended,
step ended): a few integer and float additions, no lock. Readers on other threads (the sync
facade, the HTTP exporter) take a consistent snapshot without a lock too, as a sequence lock
does: the writer makes its sequence number odd while it updates and even again after; a reader
retries until it saw the same even number before and after copying the fields.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Final

from swarmavg.errors import AllReduceFailed, MatchmakingFailed, NonFiniteTensors
from swarmavg.proto.butterfly import Fault, Reason

__all__ = [
    "GROUP_SIZE_BUCKETS",
    "LOCAL_EPOCH_REASONS",
    "ROUND_FAULTS",
    "STEP_FAILURE_CAUSES",
    "AveragerCounter",
    "AveragerMetrics",
    "DiLoCoMetrics",
    "OptimizerCounter",
    "OptimizerMetrics",
    "step_failure_cause",
]

#: The upper bounds of the group-size histogram (members per round, this peer included).
GROUP_SIZE_BUCKETS: Final = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)

#: Why a step failed, as :meth:`AveragerMetrics.failures` and the exporter's ``cause`` label
#: name it: no group formed in time (:class:`~swarmavg.MatchmakingFailed`), the group's
#: all-reduce failed or timed out (:class:`~swarmavg.AllReduceFailed`), our own tensors held
#: NaN or an infinity (:class:`~swarmavg.NonFiniteTensors`), the step was cancelled (its
#: control or handle, or the averager closing), or any other exception.
STEP_FAILURE_CAUSES: Final = ("matchmaking", "allreduce", "nonfinite", "cancelled", "other")
#: Why a member was left out of (part of) a completed round: the values of
#: :class:`swarmavg.proto.butterfly.Fault`, and ``other`` for a reason a runner gave untyped.
ROUND_FAULTS: Final = (*(fault.value for fault in Fault), "other")

#: Optimizer epochs that stepped on this peer's own gradients, by why (see OptimizerMetrics).
LOCAL_EPOCH_REASONS: Final = ("alone", "not_started", "failed")


@dataclass(frozen=True, slots=True)
class AveragerMetrics:
    """What one averager did since it was made (a snapshot; see ``docs/guides/metrics.md``).

    Steps are calls of ``step()``; a step runs one or more *rounds* (a group formed and its
    all-reduce began): a round that fails as a whole is retried in a new group while the
    step's time lasts. Times are in seconds of the event loop's clock, sizes in bytes.
    """

    #: the averager's ``prefix`` (its DHT key)
    prefix: str
    #: ``step()`` calls that began (after their arguments were checked)
    steps_started: int = 0
    #: steps that returned a result (the tensors hold the group's average, maybe incomplete)
    steps_succeeded: int = 0
    #: steps that raised :class:`~swarmavg.MatchmakingFailed` (no group in time)
    steps_failed_matchmaking: int = 0
    #: steps that raised :class:`~swarmavg.AllReduceFailed` (the last round failed: a member
    #: left or failed, a timeout), the retries being spent
    steps_failed_allreduce: int = 0
    #: steps refused because our own tensors held NaN or an infinity
    #: (:class:`~swarmavg.NonFiniteTensors`)
    steps_failed_nonfinite: int = 0
    #: steps cancelled (their control's or handle's ``cancel()``, the averager closing)
    steps_cancelled: int = 0
    #: steps that raised anything else
    steps_failed_other: int = 0
    #: searches for a group that ended without one, not cancelled (a step may search several
    #: times: each failed search counts)
    matchmaking_failures: int = 0
    #: rounds that began: a group formed for them (retries included; a ``require_trigger``
    #: step's all-reduce starts when ``allow_allreduce()`` is called)
    rounds_started: int = 0
    #: rounds whose all-reduce completed (their average was written)
    rounds_completed: int = 0
    #: completed rounds where part of the tensors kept local values or left a sender out
    #: (:attr:`StepResult.incomplete <swarmavg.StepResult.incomplete>`)
    rounds_incomplete: int = 0
    #: rounds that failed as a whole (:class:`~swarmavg.AllReduceFailed`: a member left or
    #: failed, a timeout; nothing was averaged). Started rounds that neither completed nor
    #: failed were cancelled (or run now)
    rounds_failed: int = 0
    #: groupmates left out of completed rounds for sending NaN or infinite values
    peers_excluded: int = 0
    #: ``(fault, count)`` for each of :data:`ROUND_FAULTS`: the members left out of a
    #: completed round's span (``StepResult.dropped``) or whose span kept our values
    #: (``StepResult.local_spans``), by why (see :meth:`fault_counts`)
    faults: tuple[tuple[str, int], ...] = ()
    #: members (this peer included) of the last round's group; 0 before the first round
    last_group_size: int = 0
    #: members of every round's group, summed (divide by ``rounds_started`` for the mean)
    group_size_sum: int = 0
    #: ``(bound, rounds whose group had at most bound members)`` for each bound of
    #: :data:`GROUP_SIZE_BUCKETS`: cumulative, as a Prometheus histogram's buckets
    group_size_histogram: tuple[tuple[int, int], ...] = ()
    #: bytes this peer sent in completed rounds' all-reduces (its parts, its means)
    bytes_sent: int = 0
    #: bytes this peer received in completed rounds' all-reduces
    bytes_received: int = 0
    #: seconds spent looking for groups (successful searches and failed ones)
    matchmaking_seconds: float = 0.0
    #: seconds spent in all-reduces, from their start (after any wait for
    #: ``allow_allreduce()``) to their end: completed, failed or cancelled
    allreduce_seconds: float = 0.0
    #: state downloads by other peers that this peer served to the end (one per range asked)
    state_requests_served: int = 0
    #: bytes of state this peer sent to peers that download it
    state_bytes_served: int = 0
    #: ``load_state_from_peers()`` calls that began
    state_downloads_started: int = 0
    #: downloads that returned a state
    state_downloads_succeeded: int = 0
    #: downloads that returned ``None`` (nobody shares, every donor failed, the timeout),
    #: raised or were cancelled
    state_downloads_failed: int = 0
    #: bytes of the tensors of the states downloaded
    state_bytes_downloaded: int = 0

    @property
    def steps_failed(self) -> int:
        """Steps that ended without a result, whatever the cause (cancelled ones included)."""
        return (
            self.steps_failed_matchmaking
            + self.steps_failed_allreduce
            + self.steps_failed_nonfinite
            + self.steps_cancelled
            + self.steps_failed_other
        )

    @property
    def steps_in_progress(self) -> int:
        """Steps that began and have not ended yet."""
        return self.steps_started - self.steps_succeeded - self.steps_failed

    def failures(self) -> dict[str, int]:
        """The failed steps by cause (the names of :data:`STEP_FAILURE_CAUSES`)."""
        return dict(
            zip(
                STEP_FAILURE_CAUSES,
                (
                    self.steps_failed_matchmaking,
                    self.steps_failed_allreduce,
                    self.steps_failed_nonfinite,
                    self.steps_cancelled,
                    self.steps_failed_other,
                ),
                strict=True,
            )
        )

    def fault_counts(self) -> dict[str, int]:
        """Members left out of completed rounds (or whose span kept our values), by why:
        ``{fault: count}`` over :data:`ROUND_FAULTS` (``silent``, ``bad_data``, ...)."""
        counts = dict.fromkeys(ROUND_FAULTS, 0)
        counts.update(self.faults)
        return counts

    def as_dict(self) -> dict[str, Any]:
        """Every field by name, as plain values: ``group_size_histogram`` and ``faults``
        become dicts (``{bound: rounds}``, ``{fault: count}``); the rest are str, int and
        float."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["group_size_histogram"] = dict(self.group_size_histogram)
        out["faults"] = self.fault_counts()
        return out


class AveragerCounter:
    """Counts an averager's events (sans-IO: no clock, no I/O; the caller passes durations).

    Written by one thread (the averager's event loop); :meth:`snapshot` may be called from any
    thread and returns a consistent :class:`AveragerMetrics` without locking the writer.
    """

    _FIELDS: Final = (
        "steps_started",
        "steps_succeeded",
        "steps_failed_matchmaking",
        "steps_failed_allreduce",
        "steps_failed_nonfinite",
        "steps_cancelled",
        "steps_failed_other",
        "matchmaking_failures",
        "rounds_started",
        "rounds_completed",
        "rounds_incomplete",
        "rounds_failed",
        "peers_excluded",
        "last_group_size",
        "group_size_sum",
        "bytes_sent",
        "bytes_received",
        "matchmaking_seconds",
        "allreduce_seconds",
        "state_downloads_started",
        "state_downloads_succeeded",
        "state_downloads_failed",
        "state_bytes_downloaded",
    )

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        #: odd while the writer updates (see the module docstring)
        self._seq = 0
        self.steps_started = 0
        self.steps_succeeded = 0
        self.steps_failed_matchmaking = 0
        self.steps_failed_allreduce = 0
        self.steps_failed_nonfinite = 0
        self.steps_cancelled = 0
        self.steps_failed_other = 0
        self.matchmaking_failures = 0
        self.rounds_started = 0
        self.rounds_completed = 0
        self.rounds_incomplete = 0
        self.rounds_failed = 0
        self.peers_excluded = 0
        self.last_group_size = 0
        self.group_size_sum = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.matchmaking_seconds = 0.0
        self.allreduce_seconds = 0.0
        self.state_downloads_started = 0
        self.state_downloads_succeeded = 0
        self.state_downloads_failed = 0
        self.state_bytes_downloaded = 0
        #: rounds by group size: index ``i`` counts sizes in ``(bound[i-1], bound[i]]``, the
        #: last index the sizes above every bound
        self._group_sizes = [0] * (len(GROUP_SIZE_BUCKETS) + 1)
        self._faults = dict.fromkeys(ROUND_FAULTS, 0)

    # (each event updates its fields between two increments of _seq)

    def step_started(self) -> None:
        self._seq += 1
        self.steps_started += 1
        self._seq += 1

    def step_succeeded(self) -> None:
        self._seq += 1
        self.steps_succeeded += 1
        self._seq += 1

    def step_failed(self, cause: str) -> None:
        """A step ended without a result; ``cause`` is one of :data:`STEP_FAILURE_CAUSES`.

        :raises ValueError: another ``cause``.
        """
        if cause not in STEP_FAILURE_CAUSES:
            raise ValueError(f"cause must be one of {STEP_FAILURE_CAUSES}, not {cause!r}")
        name = "steps_cancelled" if cause == "cancelled" else f"steps_failed_{cause}"
        self._seq += 1
        setattr(self, name, getattr(self, name) + 1)
        self._seq += 1

    def group_search_ended(self, seconds: float, *, failed: bool) -> None:
        """A search for a group ended after ``seconds``: with a group, cancelled, or (``failed``)
        without one."""
        self._seq += 1
        self.matchmaking_seconds += seconds
        self.matchmaking_failures += int(failed)
        self._seq += 1

    def round_started(self, group_size: int) -> None:
        """A group of ``group_size`` members (this peer included) began its all-reduce."""
        self._seq += 1
        self.rounds_started += 1
        self.last_group_size = group_size
        self.group_size_sum += group_size
        self._group_sizes[bisect.bisect_left(GROUP_SIZE_BUCKETS, group_size)] += 1
        self._seq += 1

    def round_completed(
        self,
        seconds: float,
        *,
        bytes_sent: int,
        bytes_received: int,
        incomplete: bool,
        peers_excluded: int,
        faults: Sequence[str] = (),
    ) -> None:
        """A round's all-reduce completed; ``faults``: why each member left out of it (or
        whose span kept our values) was (a :class:`~swarmavg.proto.butterfly.Reason` says its
        fault; another string counts as ``other``)."""
        kinds = [reason.fault.value if isinstance(reason, Reason) else "other" for reason in faults]
        self._seq += 1
        for kind in kinds:
            self._faults[kind] += 1
        self.rounds_completed += 1
        self.allreduce_seconds += seconds
        self.bytes_sent += bytes_sent
        self.bytes_received += bytes_received
        self.rounds_incomplete += int(incomplete)
        self.peers_excluded += peers_excluded
        self._seq += 1

    def round_ended_without_result(self, seconds: float, *, failed: bool) -> None:
        """A round's all-reduce failed (``failed``) or was cancelled after ``seconds``."""
        self._seq += 1
        self.allreduce_seconds += seconds
        self.rounds_failed += int(failed)
        self._seq += 1

    def state_download_started(self) -> None:
        self._seq += 1
        self.state_downloads_started += 1
        self._seq += 1

    def state_download_ended(self, nbytes: int | None) -> None:
        """A download returned a state of ``nbytes`` (``None``: it returned none, raised or
        was cancelled)."""
        self._seq += 1
        if nbytes is None:
            self.state_downloads_failed += 1
        else:
            self.state_downloads_succeeded += 1
            self.state_bytes_downloaded += nbytes
        self._seq += 1

    def snapshot(
        self, *, state_requests_served: int = 0, state_bytes_served: int = 0
    ) -> AveragerMetrics:
        """The counts now, consistent even while the writer thread counts (it retries until
        no update ran while it copied; an update takes a few bytecodes)."""
        values: dict[str, Any] = {}
        sizes: list[int] = []
        faults: tuple[tuple[str, int], ...] = ()
        for _ in range(10_000):  # (bounded; a retry is rare, several in a row rarer still)
            before = self._seq
            if before % 2 == 0:
                values = {name: getattr(self, name) for name in self._FIELDS}
                sizes = list(self._group_sizes)
                faults = tuple(self._faults.items())
                if self._seq == before:
                    break
            time.sleep(0)  # (let the writer finish its update)
        cumulative, total = [], 0
        for bound, count in zip(GROUP_SIZE_BUCKETS, sizes, strict=False):
            total += count
            cumulative.append((bound, total))
        return AveragerMetrics(
            prefix=self.prefix,
            group_size_histogram=tuple(cumulative),
            faults=faults,
            state_requests_served=state_requests_served,
            state_bytes_served=state_bytes_served,
            **values,
        )


def step_failure_cause(exc: BaseException) -> str:
    """The :data:`STEP_FAILURE_CAUSES` name of the exception a step raised (cancellation is
    told by the caller, who knows its event loop's cancellation exception)."""
    if isinstance(exc, MatchmakingFailed):
        return "matchmaking"
    if isinstance(exc, AllReduceFailed):
        return "allreduce"
    if isinstance(exc, NonFiniteTensors):
        return "nonfinite"
    return "other"


@dataclass(frozen=True, slots=True)
class OptimizerMetrics:
    """What a :class:`swarmavg.Optimizer` did since it was made (a snapshot; see
    ``docs/guides/metrics.md``): its epochs, how each stepped, its state downloads, and the
    snapshots of its two averagers."""

    #: the run's ``run_id``
    run_id: str
    #: this peer's epoch now (a gauge: it jumps when the state is downloaded)
    local_epoch: int
    #: epochs this peer ended (each an optimizer step, unless auxiliary)
    epochs: int
    #: epochs whose gradients were averaged with other peers
    epochs_averaged: int
    #: epochs stepped on this peer's own gradients because the progress records showed no
    #: other peer (no round was tried)
    epochs_local_alone: int
    #: epochs stepped on own gradients because the gradient round could not start
    epochs_local_not_started: int
    #: epochs stepped on own gradients because the gradient round failed or timed out
    epochs_local_failed: int
    #: ``load_state_from_peers()`` that loaded a state (by ``step()`` catching up, or called)
    state_loads: int
    #: ``load_state_from_peers()`` that raised :class:`~swarmavg.LoadStateFailed`
    state_load_failures: int
    #: the gradient averager's snapshot (``None`` with ``use_local_updates=True``: no gradient
    #: averaging)
    gradients: AveragerMetrics | None
    #: the state averager's snapshot (parameters and optimizer statistics; state sharing)
    state: AveragerMetrics

    @property
    def epochs_local(self) -> int:
        """Epochs stepped on this peer's own gradients, whatever the reason (with gradient
        averaging; ``use_local_updates=True`` steps locally by design and counts none)."""
        return self.epochs_local_alone + self.epochs_local_not_started + self.epochs_local_failed

    def local_epochs_by_reason(self) -> dict[str, int]:
        """:attr:`epochs_local` by reason: ``alone``, ``not_started``, ``failed``."""
        return dict(
            zip(
                LOCAL_EPOCH_REASONS,
                (self.epochs_local_alone, self.epochs_local_not_started, self.epochs_local_failed),
                strict=True,
            )
        )

    @property
    def bytes_sent(self) -> int:
        """All-reduce bytes sent by both averagers."""
        grads = 0 if self.gradients is None else self.gradients.bytes_sent
        return grads + self.state.bytes_sent

    @property
    def bytes_received(self) -> int:
        """All-reduce bytes received by both averagers."""
        grads = 0 if self.gradients is None else self.gradients.bytes_received
        return grads + self.state.bytes_received

    def as_dict(self) -> dict[str, Any]:
        """Every field by name as plain values; the averagers' snapshots as their own
        :meth:`AveragerMetrics.as_dict` (``gradients`` may be ``None``)."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["gradients"] = None if self.gradients is None else self.gradients.as_dict()
        out["state"] = self.state.as_dict()
        return out


class OptimizerCounter:
    """Counts an optimizer's epochs and downloads. Written from the training thread and, with
    ``delay_grad_averaging``, the thread that ends a delayed gradient round: a lock guards it
    (neither is an event loop)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._lock = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(
            (
                "epochs",
                "epochs_averaged",
                "epochs_local_alone",
                "epochs_local_not_started",
                "epochs_local_failed",
                "state_loads",
                "state_load_failures",
            ),
            0,
        )

    def _add(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def epoch_ended(self) -> None:
        self._add("epochs")

    def gradients_averaged(self) -> None:
        self._add("epochs_averaged")

    def stepped_locally(self, reason: str) -> None:
        """An epoch stepped on own gradients; ``reason`` is one of ``alone``, ``not_started``,
        ``failed``. :raises ValueError: another reason."""
        if reason not in LOCAL_EPOCH_REASONS:
            raise ValueError(f"reason must be one of {LOCAL_EPOCH_REASONS}, not {reason!r}")
        self._add(f"epochs_local_{reason}")

    def state_loaded(self, *, ok: bool) -> None:
        self._add("state_loads" if ok else "state_load_failures")

    def snapshot(
        self, *, local_epoch: int, gradients: AveragerMetrics | None, state: AveragerMetrics
    ) -> OptimizerMetrics:
        with self._lock:
            counts: Mapping[str, int] = dict(self._counts)
        return OptimizerMetrics(
            run_id=self.run_id,
            local_epoch=local_epoch,
            gradients=gradients,
            state=state,
            **counts,
        )


@dataclass(frozen=True, slots=True)
class DiLoCoMetrics:
    """What a :class:`swarmavg.optim.DiLoCo` did since it was made (a snapshot; see
    ``docs/guides/metrics.md``): its rounds by outcome, its state downloads, and its
    averager's snapshot (the all-reduces of the pseudo-gradient; state sharing)."""

    #: the run's ``run_id``
    run_id: str
    #: this peer's outer epoch now (a gauge: it jumps when the state is downloaded)
    outer_epoch: int
    #: inner steps since θ_global (a gauge)
    inner_step: int
    #: where the inner schedule is: ``outer_epoch · sync_every + inner_step`` (a gauge)
    global_step: int
    #: rounds whose pseudo-gradient was averaged with other peers (an outer step followed)
    rounds_averaged: int
    #: rounds that stepped on this peer's own pseudo-gradient: no other peer in the run
    rounds_alone: int
    #: rounds that failed (no outer step; rolled back or kept local, see ``on_round_failure``)
    rounds_failed: int
    #: failed rounds in which this peer's θ_global was not the round's reference (it rolled
    #: back and downloaded the reference's next state); also in ``rounds_failed``
    rounds_diverged: int
    #: downloads of θ_global and the outer state that were taken
    state_loads: int
    #: downloads that failed or were refused
    state_load_failures: int
    #: seconds the last round took (0 before the first)
    last_round_seconds: float
    #: the averager's snapshot (all-reduces of Δ, state served and downloaded)
    averager: AveragerMetrics

    @property
    def rounds(self) -> int:
        """Rounds in all: averaged, alone and failed."""
        return self.rounds_averaged + self.rounds_alone + self.rounds_failed

    @property
    def bytes_sent(self) -> int:
        """All-reduce bytes sent (the averager's)."""
        return self.averager.bytes_sent

    @property
    def bytes_received(self) -> int:
        """All-reduce bytes received (the averager's)."""
        return self.averager.bytes_received

    def as_dict(self) -> dict[str, Any]:
        """Every field by name as plain values; the averager's snapshot as its own
        :meth:`AveragerMetrics.as_dict`."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["averager"] = self.averager.as_dict()
        return out
