"""``swarmavg.DecentralizedAverager``: the averager for synchronous code (training loops).

It runs a :class:`swarmavg.aio.DecentralizedAverager` on swarmavg's event-loop thread, attached
to a :class:`swarmavg.DHT` of this process. ``step(wait=False)`` returns a :class:`StepHandle`
(``result()``, ``done()``, ``cancel()``, awaitable, plus ``stage``, a settable ``weight`` and
``allow_allreduce()``), so the training loop goes on while the group forms and averages::

    averager = swarmavg.DecentralizedAverager(model_tensors, dht, prefix="run", target_group_size=4)
    handle = averager.step(wait=False)
    ...                                   # compute the next gradients meanwhile
    result = handle.result()              # {peer_id: gathered metadata}, contributors, timings
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, Self, overload

import anyio.to_thread

from swarmavg._step import AveragingStage, StepResult
from swarmavg.aio.averager import _NO_COMPRESSION, StepControl
from swarmavg.aio.averager import DecentralizedAverager as AsyncAverager
from swarmavg.aio.state import DEFAULT_MAX_DONORS, DEFAULT_MAX_STATE_SIZE
from swarmavg.metrics import AveragerMetrics
from swarmavg.proto.allreduce import MAX_SHARE
from swarmavg.sync import TaskHandle, call, run_sync
from swarmavg.sync._loop import _start_handle, shut_down_at_exit

if TYPE_CHECKING:
    import torch

    from swarmavg._prometheus import MetricsServer
    from swarmavg.abc import AllReduceRunner, Matchmaker
    from swarmavg.compression import AdaptiveCompression, CompressionBase, TensorInfo
    from swarmavg.dht import DHT

__all__ = ["AveragingStage", "DecentralizedAverager", "StepHandle"]

logger = logging.getLogger(__name__)


class DecentralizedAverager:
    """Averages ``averaged_tensors`` with other peers (hivemind's ``DecentralizedAverager``).

    The keyword arguments from ``prefix`` to ``min_matchmaking_time`` are those of
    :class:`swarmavg.aio.DecentralizedAverager`, with the same names, defaults and meaning (its
    docstring says what each one does), and go to it unchanged: the group (``prefix``,
    ``target_group_size``, ``min_group_size``, ``initial_group_bits``,
    ``averaging_expiration`` or hivemind 1.1's ``min_matchmaking_time``, ``auxiliary``,
    ``client_mode``, ``matchmaker``), the all-reduce (``request_timeout``, ``averaging_alpha``,
    ``part_size_bytes``, ``allreduce_timeout``, ``sender_timeout``, ``reducer_timeout``,
    ``clip_norm``, ``bandwidth``, ``min_vector_size``, ``max_share``, ``allreduce``), compression
    (``compression``, ``tensor_infos``, ``error_feedback``) and state sharing
    (``allow_state_sharing``, ``state_sharing_priority``, ``declare_state_period``,
    ``next_chunk_timeout``, ``max_state_size``, ``state_compression``, ``state_max_donors``).
    The others are the facade's own:

    :param averaged_tensors: any iterable of floating-point tensors (a list, or
        ``model.parameters()``).
    :param dht: a running :class:`swarmavg.DHT`; the averager shares its node.
    :param start: start at once (otherwise :meth:`run_in_background`).
    :param daemon: accepted for hivemind's sake, without effect: the averager runs on
        swarmavg's event-loop thread, not in a process of its own.
    :param shutdown_timeout: seconds :meth:`shutdown` waits for the averager to close (its
        steps are cancelled and their groupmates told); past it the closing is cancelled.
    :param metrics_port: serve :attr:`metrics` over HTTP on this TCP port, in Prometheus'
        text format, until :meth:`shutdown` (``None``, the default: off; 0: a free port, see
        :attr:`metrics_address`). Needs the ``prometheus`` extra
        (``pip install swarmavg[prometheus]``); see ``docs/guides/metrics.md``.
    :param metrics_host: the address the metrics server listens on (default loopback only;
        ``"0.0.0.0"`` lets a Prometheus server on another machine scrape it).
    :raises TypeError: an argument has the wrong type (the message names it; see
        :class:`swarmavg.aio.DecentralizedAverager` for the others).
    :raises ValueError: an argument is out of range (the message names it).
    :raises ImportError: ``metrics_port`` is given and prometheus-client is not installed.
    :raises AddressInUse: ``metrics_port`` is taken.
    :raises RuntimeError: ``start`` and the DHT is not running.
    """

    def __init__(
        self,
        averaged_tensors: Iterable[torch.Tensor],
        dht: DHT,
        *,
        prefix: str,
        target_group_size: int,
        min_group_size: int | None = None,
        initial_group_bits: str = "",
        averaging_expiration: float = 15.0,
        request_timeout: float = 3.0,
        averaging_alpha: float = 1.0,
        part_size_bytes: int | None = None,
        allreduce_timeout: float | None = 60.0,
        sender_timeout: float | None = None,
        reducer_timeout: float | None = None,
        clip_norm: float | None = None,
        bandwidth: float | None = None,
        min_vector_size: int = 0,
        max_share: float | None = MAX_SHARE,
        auxiliary: bool = False,
        client_mode: bool | None = None,
        matchmaker: Matchmaker | None = None,
        allreduce: AllReduceRunner | None = None,
        allow_state_sharing: bool | None = None,
        state_sharing_priority: float = 0.0,
        declare_state_period: float = 30.0,
        next_chunk_timeout: float | None = None,
        max_state_size: int = DEFAULT_MAX_STATE_SIZE,
        state_compression: CompressionBase | AdaptiveCompression = _NO_COMPRESSION,
        state_max_donors: int = DEFAULT_MAX_DONORS,
        compression: CompressionBase | AdaptiveCompression = _NO_COMPRESSION,
        tensor_infos: Sequence[TensorInfo] | None = None,
        error_feedback: bool = False,
        min_matchmaking_time: float | None = None,
        start: bool = True,
        daemon: bool = True,
        shutdown_timeout: float = 5.0,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
    ) -> None:
        from swarmavg._prometheus import check_metrics_options
        from swarmavg.dht import DHT

        given: object = dht
        if not isinstance(given, DHT):
            hint = ""
            if type(given).__module__ == "swarmavg.aio.dht_facade":
                hint = " (swarmavg.aio.DHT goes with swarmavg.aio.DecentralizedAverager)"
            raise TypeError(f"dht must be a swarmavg.DHT, not {type(given).__name__}{hint}")
        for name, flag in (("start", start), ("daemon", daemon)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, not {flag!r:.64}")
        if isinstance(shutdown_timeout, bool) or not isinstance(shutdown_timeout, int | float):
            raise TypeError(f"shutdown_timeout must be a number, not {shutdown_timeout!r:.64}")
        if not 0 < shutdown_timeout < math.inf:
            raise ValueError(f"shutdown_timeout must be > 0 seconds, not {shutdown_timeout}")
        self.shutdown_timeout = float(shutdown_timeout)
        check_metrics_options(metrics_port, metrics_host)
        self.dht = dht
        self._metrics_server: MetricsServer | None = None

        async def create() -> AsyncAverager:
            averager = _FacadeAverager(
                averaged_tensors,
                dht._dht,
                prefix=prefix,
                target_group_size=target_group_size,
                min_group_size=min_group_size,
                initial_group_bits=initial_group_bits,
                averaging_expiration=averaging_expiration,
                request_timeout=request_timeout,
                averaging_alpha=averaging_alpha,
                part_size_bytes=part_size_bytes,
                allreduce_timeout=allreduce_timeout,
                sender_timeout=sender_timeout,
                reducer_timeout=reducer_timeout,
                clip_norm=clip_norm,
                bandwidth=bandwidth,
                min_vector_size=min_vector_size,
                max_share=max_share,
                auxiliary=auxiliary,
                client_mode=client_mode,
                matchmaker=matchmaker,
                allreduce=allreduce,
                allow_state_sharing=allow_state_sharing,
                state_sharing_priority=state_sharing_priority,
                declare_state_period=declare_state_period,
                next_chunk_timeout=next_chunk_timeout,
                max_state_size=max_state_size,
                state_compression=state_compression,
                state_max_donors=state_max_donors,
                compression=compression,
                tensor_infos=tensor_infos,
                error_feedback=error_feedback,
                min_matchmaking_time=min_matchmaking_time,
            )
            averager._facade = self
            return averager

        self._averager = run_sync(create)
        self._started = False
        self._closed = False
        shut_down_at_exit(self)
        if metrics_port is not None:
            self._serve_metrics(metrics_port, metrics_host)
        if start:
            self.run_in_background()

    def _serve_metrics(self, port: int, host: str) -> None:
        """Start the metrics server (on failure, shut the averager down and raise)."""
        from swarmavg._prometheus import MetricsServer

        try:
            self._metrics_server = MetricsServer(lambda: self.metrics, port=port, host=host)
        except BaseException:
            self.shutdown()
            raise

    def run_in_background(self, await_ready: bool = True) -> None:
        """Start serving the averager's requests (``await_ready`` is accepted for hivemind's
        sake: starting is immediate)."""
        if self._closed:
            raise RuntimeError("this averager was shut down")
        if not self._started:
            if not self.dht.is_alive():
                raise RuntimeError(
                    "the averager's DHT is not running: start it first (swarmavg.DHT(...) "
                    "starts unless start=False) and shut it down after the averager"
                )
            run_sync(self._averager.__aenter__)
            self._started = True

    def shutdown(self) -> None:
        """Stop taking part (and serving the metrics). Idempotent."""
        if not self._closed:
            self._closed = True
            try:
                with contextlib.suppress(RuntimeError):  # the event loop is gone (exit)
                    try:
                        run_sync(self._averager.aclose, timeout=self.shutdown_timeout)
                    except TimeoutError:
                        logger.warning(
                            "%s: the averager did not close within shutdown_timeout=%.1f s; "
                            "its tasks were cancelled",
                            self._averager.prefix,
                            self.shutdown_timeout,
                        )
            finally:
                if self._metrics_server is not None:
                    self._metrics_server.close()

    def __enter__(self) -> Self:
        self.run_in_background()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    @property
    def peer_id(self) -> Any:
        return self.dht.peer_id

    @property
    def metrics(self) -> AveragerMetrics:
        """What this averager did since it was made: steps by outcome, rounds, group sizes,
        bytes, seconds, state shares (:class:`swarmavg.metrics.AveragerMetrics`, see
        ``docs/guides/metrics.md``). A consistent snapshot, cheap to take from any thread (it does
        not wait for the event loop); still readable after :meth:`shutdown`."""
        return self._averager.metrics

    @property
    def measured_bandwidth(self) -> float | None:
        """This peer's throughput in bytes/s as measured from its all-reduce rounds and
        announced as its ``bandwidth`` (``None`` until a round large enough to say something
        completed, and always when ``bandwidth`` was given); see
        :attr:`swarmavg.aio.DecentralizedAverager.measured_bandwidth`."""
        return self._averager.measured_bandwidth

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """``(host, port)`` where :attr:`metrics` are served (``None``: no ``metrics_port``)."""
        server = self._metrics_server
        return None if server is None else (server.host, server.port)

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[list[torch.Tensor]]:
        """The averaged tensors, locked against averaging results (update them in place).
        While a step averages them in place (one flat tensor per dtype, see
        :mod:`swarmavg.aio.averager`), this waits until the step's results are written."""
        with self._averager.get_tensors() as tensors:
            yield tensors

    def get_group_bits(self) -> str:
        return self._averager.get_group_bits()

    def set_group_bits(self, bits: str) -> None:
        self._averager.set_group_bits(bits)

    @property
    def expected_group_size(self) -> int | None:
        """How many peers (this one included) are expected to look for each group, or ``None``
        (unknown): the DHT matchmaker then does not assemble a group early while fewer are in
        (see :class:`swarmavg.proto.group_search.GroupSearch`); a training loop sets it from
        its progress records. Settable; read at the start of each search."""
        return getattr(self._averager.matchmaker, "expected_group_size", None)

    @expected_group_size.setter
    def expected_group_size(self, value: int | None) -> None:
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"expected_group_size must be None or an int >= 1, not {value!r}")
        matchmaker = self._averager.matchmaker
        if hasattr(matchmaker, "expected_group_size"):
            matchmaker.expected_group_size = value  # (an int: one store, any thread)

    # -- state sharing ---------------------------------------------------------------------------

    @property
    def allow_state_sharing(self) -> bool:
        """Whether this peer serves its state (:meth:`get_current_state`) to peers that
        :meth:`load_state_from_peers`; settable (see the async averager's)."""
        return self._averager.allow_state_sharing

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        async def set_it() -> None:
            self._averager.allow_state_sharing = value

        run_sync(set_it)

    @property
    def state_sharing_priority(self) -> float:
        """Takers try donors with a higher priority first; settable."""
        return self._averager.state_sharing_priority

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        async def set_it() -> None:
            self._averager.state_sharing_priority = value

        run_sync(set_it)

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor]]:
        """What this peer serves: ``(metadata, tensors)`` (or ``(metadata, tensors, infos)``);
        by default ``(None, copies of the averaged tensors)``, taken under :meth:`get_tensors`'s
        lock. Override it to share more; it is called in a worker thread (see
        :meth:`swarmavg.aio.DecentralizedAverager.get_current_state`)."""
        return None, self._averager._copy_tensors()

    @overload
    def load_state_from_peers(
        self, wait: Literal[True] = True, timeout: float | None = None
    ) -> tuple[Any, list[torch.Tensor]] | None: ...

    @overload
    def load_state_from_peers(
        self, wait: Literal[False], timeout: float | None = None
    ) -> TaskHandle[tuple[Any, list[torch.Tensor]] | None]: ...

    def load_state_from_peers(
        self, wait: bool = True, timeout: float | None = None
    ) -> tuple[Any, list[torch.Tensor]] | TaskHandle[tuple[Any, list[torch.Tensor]] | None] | None:
        """Download the state of a peer that shares it: ``(metadata, tensors)`` or ``None``
        (see :meth:`swarmavg.aio.DecentralizedAverager.load_state_from_peers`); with
        ``wait=False``, a :class:`~swarmavg.sync.TaskHandle` to the download."""
        if not self._started or self._closed:
            raise RuntimeError("the averager is not running")
        return call(self._averager.load_state_from_peers, True, timeout, wait=wait)

    # -- stepping --------------------------------------------------------------------------------

    @overload
    def step(
        self,
        gather: Any = None,
        weight: float | None = None,
        timeout: float | None = None,
        allow_retries: bool = True,
        wait: Literal[True] = True,
        scheduled_time: float | None = None,
        require_trigger: bool = False,
    ) -> StepResult: ...

    @overload
    def step(
        self,
        gather: Any = None,
        weight: float | None = None,
        timeout: float | None = None,
        allow_retries: bool = True,
        *,
        wait: Literal[False],
        scheduled_time: float | None = None,
        require_trigger: bool = False,
    ) -> StepHandle: ...

    def step(
        self,
        gather: Any = None,
        weight: float | None = None,
        timeout: float | None = None,
        allow_retries: bool = True,
        wait: bool = True,
        scheduled_time: float | None = None,
        require_trigger: bool = False,
    ) -> StepResult | StepHandle:
        """Find a group and average with it (see :meth:`swarmavg.aio.DecentralizedAverager.step`);
        with ``wait=False``, a :class:`StepHandle` to the step in progress (its ``stage``,
        settable ``weight``, ``allow_allreduce()`` for ``require_trigger=True``, ``cancel()``).

        :raises MatchmakingFailed: no group formed in time.
        :raises AllReduceFailed: the group formed but the average was not computed.
        """
        if not self._started or self._closed:
            raise RuntimeError("the averager is not running")
        if wait and require_trigger:
            raise ValueError("require_trigger=True needs wait=False (to call allow_allreduce())")
        control = self._averager._control(gather, weight, timeout, scheduled_time, require_trigger)
        handle = _start_handle(
            functools.partial(StepHandle, control=control),
            self._averager._run_step,
            control,
            allow_retries,
        )
        if wait:
            try:
                return handle.result()
            except BaseException:
                handle.cancel()
                raise
        return handle


class StepHandle(TaskHandle[StepResult]):
    """A step in progress (``DecentralizedAverager.step(wait=False)``): a :class:`TaskHandle`
    (``result()``, ``done()``, ``cancel()``, awaitable) that also shows the step's
    :attr:`stage`, lets the :attr:`weight` change until the all-reduce begins, and starts a
    ``require_trigger`` step's all-reduce (:meth:`allow_allreduce`). :meth:`cancel` tells the
    groupmates that this peer leaves, so they stop waiting for it."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        loop_thread_id: int,
        name: str,
        *,
        control: StepControl,
    ) -> None:
        super().__init__(loop, loop_thread_id, name)
        self.control = control
        control._attach(self.cancel)  # (the averager's shutdown cancels its steps)

    @property
    def stage(self) -> AveragingStage:
        return self.control.stage

    @property
    def weight(self) -> float:
        return self.control.weight

    @weight.setter
    def weight(self, value: float) -> None:
        self.control.weight = value

    @property
    def scheduled_time(self) -> float | None:
        return self.control.scheduled_time

    @property
    def require_trigger(self) -> bool:
        return self.control.require_trigger

    @property
    def triggered(self) -> bool:
        return self.control.triggered

    def allow_allreduce(self) -> None:
        """Let the step average once its group formed (``require_trigger=True``)."""
        self.control.allow_allreduce()


class _FacadeAverager(AsyncAverager):
    """The facade's async averager: serves the facade's :meth:`get_current_state` (run in a
    worker thread) when a subclass of the facade overrides it."""

    #: the facade that made it (set right after it is made, before it starts)
    _facade: DecentralizedAverager

    async def get_current_state(
        self,
    ) -> tuple[Any, Sequence[torch.Tensor]] | tuple[Any, Sequence[torch.Tensor], Sequence[Any]]:
        facade = self._facade
        if type(facade).get_current_state is DecentralizedAverager.get_current_state:
            return await super().get_current_state()
        return await anyio.to_thread.run_sync(facade.get_current_state)
