"""Serve :mod:`swarmavg.metrics` snapshots over HTTP in Prometheus' text format (``metrics_port=``).

Needs the ``prometheus`` extra (``pip install swarmavg[prometheus]``: ``prometheus-client``),
imported here only when a ``metrics_port`` is given. Each averager or optimizer that serves its
metrics gets its own registry (several in one process do not collide) with one collector that
turns the current snapshot into metric families at each scrape, and its own HTTP server thread
(the standard library's WSGI server running ``prometheus_client.make_wsgi_app``), which
:meth:`MetricsServer.close` stops and joins.
"""

from __future__ import annotations

import errno
import importlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from swarmavg.errors import AddressInUse
from swarmavg.metrics import AveragerMetrics, DiLoCoMetrics, OptimizerMetrics

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["MetricsServer", "check_metrics_options", "require_prometheus"]

_INSTALL_HINT = "pip install swarmavg[prometheus]"


def require_prometheus() -> ModuleType:
    """The ``prometheus_client`` module.

    :raises ImportError: it is not installed (the message says ``pip install
        swarmavg[prometheus]``).
    """
    try:  # (by name: mypy need not find it)
        return importlib.import_module("prometheus_client")
    except ImportError as exc:
        raise ImportError(
            "metrics_port needs the prometheus-client package, which is not installed: "
            f"{_INSTALL_HINT}"
        ) from exc


def check_metrics_options(port: object, host: object) -> None:
    """Check ``metrics_port`` (``None``, or an int 0-65535: 0 picks a free port) and
    ``metrics_host``; with a port, check that the extra is installed.

    :raises TypeError: not an int (a bool is none) or ``None``; a host that is not a str.
    :raises ValueError: a port out of range.
    :raises ImportError: a port is given and prometheus-client is missing.
    """
    if port is None:
        return
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"metrics_port must be an int or None, not {port!r:.64}")
    if not 0 <= port <= 65535:
        raise ValueError(f"metrics_port must be in 0-65535 (0: any free port), not {port}")
    if not isinstance(host, str) or not host:
        raise TypeError(f"metrics_host must be a non-empty str, not {host!r:.64}")
    require_prometheus()


class _QuietHandler(WSGIRequestHandler):
    """Logs no line per scrape to stderr (the default handler does)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server4(WSGIServer):
    address_family = socket.AF_INET


class _Server6(WSGIServer):
    address_family = socket.AF_INET6


Snapshot = AveragerMetrics | OptimizerMetrics | DiLoCoMetrics


class MetricsServer:
    """An HTTP endpoint that serves ``collect()``'s snapshot at each scrape (any path, as
    ``prometheus_client`` serves; ``/metrics`` by convention).

    :param collect: returns the snapshot to serve; called on the server's thread.
    :param port: TCP port (0: a free one, see :attr:`port`).
    :param host: the address to listen on (``"0.0.0.0"``/``"::"``: every interface).
    :raises ImportError: prometheus-client is not installed.
    :raises AddressInUse: ``port`` is taken (the ``OSError`` is the ``__cause__``).
    :raises OSError: another reason the address could not be bound.
    """

    def __init__(self, collect: Callable[[], Snapshot], *, port: int, host: str) -> None:
        client = require_prometheus()
        registry = client.CollectorRegistry(auto_describe=False)
        registry.register(_Collector(collect))
        server_class = _Server6 if ":" in host else _Server4
        try:
            self._server = make_server(
                host,
                port,
                client.make_wsgi_app(registry),
                server_class=server_class,
                handler_class=_QuietHandler,
            )
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise AddressInUse(f"metrics_port {port} on {host} is taken: {exc}") from exc
            raise
        self.host = host
        #: the port it listens on (the one picked, for ``port=0``)
        self.port: int = self._server.server_port
        self._closed = False
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"swarmavg-metrics:{self.port}",
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving and join the server's thread (within a scrape's time). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class _Collector:
    """A custom collector (``collect()`` yields metric families) over one snapshot source."""

    def __init__(self, collect: Callable[[], Snapshot]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Any]:
        snapshot = self._collect()
        if isinstance(snapshot, OptimizerMetrics):
            yield from _optimizer_families(snapshot)
            averagers = [m for m in (snapshot.gradients, snapshot.state) if m is not None]
        elif isinstance(snapshot, DiLoCoMetrics):
            yield from _diloco_families(snapshot)
            averagers = [snapshot.averager]
        else:
            averagers = [snapshot]
        yield from _averager_families(averagers)


def _averager_families(snapshots: list[AveragerMetrics]) -> Iterator[Any]:
    """The families of one or more averagers, labelled by ``prefix``."""
    core = importlib.import_module("prometheus_client.core")

    def counter(name: str, doc: str, attr: str) -> Any:
        family = core.CounterMetricFamily(f"swarmavg_averager_{name}", doc, labels=["prefix"])
        for m in snapshots:
            family.add_metric([m.prefix], getattr(m, attr))
        return family

    yield counter("steps_started", "step() calls that began", "steps_started")
    yield counter("steps_succeeded", "steps that returned a result", "steps_succeeded")
    failed = core.CounterMetricFamily(
        "swarmavg_averager_steps_failed",
        "steps that ended without a result, by cause",
        labels=["prefix", "cause"],
    )
    for m in snapshots:
        for cause, count in m.failures().items():
            failed.add_metric([m.prefix, cause], count)
    yield failed
    yield counter(
        "matchmaking_failures",
        "searches for a group that ended without one",
        "matchmaking_failures",
    )
    yield counter("rounds_started", "rounds whose group formed", "rounds_started")
    yield counter("rounds_completed", "rounds whose all-reduce completed", "rounds_completed")
    yield counter(
        "rounds_incomplete",
        "completed rounds where some parts kept local values",
        "rounds_incomplete",
    )
    yield counter("rounds_failed", "rounds whose all-reduce failed as a whole", "rounds_failed")
    yield counter("peers_excluded", "groupmates left out for non-finite values", "peers_excluded")
    faults = core.CounterMetricFamily(
        "swarmavg_averager_round_faults",
        "members left out of completed rounds (or whose span kept local values), by why",
        labels=["prefix", "fault"],
    )
    for m in snapshots:
        for fault, count in m.fault_counts().items():
            faults.add_metric([m.prefix, fault], count)
    yield faults
    yield counter("sent_bytes", "bytes sent in completed all-reduces", "bytes_sent")
    yield counter("received_bytes", "bytes received in completed all-reduces", "bytes_received")
    yield counter("matchmaking_seconds", "seconds spent looking for groups", "matchmaking_seconds")
    yield counter("allreduce_seconds", "seconds spent in all-reduces", "allreduce_seconds")
    yield counter(
        "state_requests_served", "state downloads served to the end", "state_requests_served"
    )
    yield counter("state_served_bytes", "bytes of state served", "state_bytes_served")
    downloads = core.CounterMetricFamily(
        "swarmavg_averager_state_downloads",
        "load_state_from_peers() calls that ended, by outcome",
        labels=["prefix", "outcome"],
    )
    for m in snapshots:
        downloads.add_metric([m.prefix, "succeeded"], m.state_downloads_succeeded)
        downloads.add_metric([m.prefix, "failed"], m.state_downloads_failed)
    yield downloads
    yield counter(
        "state_downloaded_bytes", "bytes of the states downloaded", "state_bytes_downloaded"
    )
    last = core.GaugeMetricFamily(
        "swarmavg_averager_last_group_size",
        "members of the last round's group (0: no round yet)",
        labels=["prefix"],
    )
    for m in snapshots:
        last.add_metric([m.prefix], m.last_group_size)
    yield last
    sizes = core.HistogramMetricFamily(
        "swarmavg_averager_group_size", "members of each round's group", labels=["prefix"]
    )
    for m in snapshots:
        buckets = [(str(float(bound)), float(count)) for bound, count in m.group_size_histogram]
        buckets.append(("+Inf", float(m.rounds_started)))
        sizes.add_metric([m.prefix], buckets, float(m.group_size_sum))
    yield sizes


def _optimizer_families(m: OptimizerMetrics) -> Iterator[Any]:
    core = importlib.import_module("prometheus_client.core")

    labels = [m.run_id]
    epoch = core.GaugeMetricFamily(
        "swarmavg_optimizer_local_epoch", "this peer's epoch", labels=["run_id"]
    )
    epoch.add_metric(labels, m.local_epoch)
    yield epoch
    epochs = core.CounterMetricFamily(
        "swarmavg_optimizer_epochs", "epochs this peer ended", labels=["run_id"]
    )
    epochs.add_metric(labels, m.epochs)
    yield epochs
    averaged = core.CounterMetricFamily(
        "swarmavg_optimizer_epochs_averaged",
        "epochs whose gradients were averaged with other peers",
        labels=["run_id"],
    )
    averaged.add_metric(labels, m.epochs_averaged)
    yield averaged
    yield _counter_by(
        "swarmavg_optimizer_epochs_local",
        "epochs stepped on this peer's own gradients, by reason",
        m.run_id,
        "reason",
        m.local_epochs_by_reason(),
    )
    yield _counter_by(
        "swarmavg_optimizer_state_loads",
        "load_state_from_peers() calls, by outcome",
        m.run_id,
        "outcome",
        {"succeeded": m.state_loads, "failed": m.state_load_failures},
    )


def _diloco_families(m: DiLoCoMetrics) -> Iterator[Any]:
    core = importlib.import_module("prometheus_client.core")

    labels = [m.run_id]
    for name, doc, value in (
        ("outer_epoch", "this peer's outer epoch", m.outer_epoch),
        ("global_step", "outer_epoch * sync_every + inner steps since theta_global", m.global_step),
        ("last_round_seconds", "seconds the last round took", m.last_round_seconds),
    ):
        gauge = core.GaugeMetricFamily(f"swarmavg_diloco_{name}", doc, labels=["run_id"])
        gauge.add_metric(labels, value)
        yield gauge
    yield _counter_by(
        "swarmavg_diloco_rounds",
        "rounds, by outcome (averaged, alone, failed)",
        m.run_id,
        "outcome",
        {"averaged": m.rounds_averaged, "alone": m.rounds_alone, "failed": m.rounds_failed},
    )
    diverged = core.CounterMetricFamily(
        "swarmavg_diloco_rounds_diverged",
        "failed rounds where this peer held another theta_global than the reference",
        labels=["run_id"],
    )
    diverged.add_metric(labels, m.rounds_diverged)
    yield diverged
    yield _counter_by(
        "swarmavg_diloco_state_loads",
        "downloads of theta_global and the outer state, by outcome",
        m.run_id,
        "outcome",
        {"succeeded": m.state_loads, "failed": m.state_load_failures},
    )


def _counter_by(name: str, doc: str, run_id: str, label: str, counts: dict[str, int]) -> Any:
    """A counter family of one run, one sample per value of ``label``."""
    core = importlib.import_module("prometheus_client.core")
    family = core.CounterMetricFamily(name, doc, labels=["run_id", label])
    for value, count in counts.items():
        family.add_metric([run_id, value], count)
    return family
