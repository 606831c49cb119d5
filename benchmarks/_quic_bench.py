"""Loopback QUIC between two processes: swarmavg's QUIC transport beside a plain aioquic pair.

Set up as in ``_tcp_bench.py`` (whose helpers this reuses): every figure comes from two processes
on 127.0.0.1, this one (the client) and a server started for each run as ``sys.executable
benchmarks/_quic_bench.py --serve MODE --datagram N``, which prints one JSON line (the port or
address to dial), serves, and exits when its stdin closes (or after ``--lifetime`` seconds).
Every wait has a timeout, and the client kills a server still there afterwards. Client and
server are pinned to two different CPUs where Linux allows.

Bulk (one way, client to server, one stream, 1 MiB messages), at three datagram sizes:

* 1200 B (QUIC's minimum, aioquic's default): 128 MiB (32 MiB with ``quick``);
* 9000 B (jumbo): 512 MiB (64 MiB);
* the size our transport picks from the route's MTU (16383 B on loopback): 1 GiB (256 MiB).

* reference: plain aioquic through its asyncio API (``aioquic.asyncio.serve`` / ``connect``
  and a ``QuicConnectionProtocol`` subclass), a self-signed EC certificate, one bidirectional
  stream; the client writes 1 MiB with ``send_stream_data`` at a time, waiting while more than
  4 MiB of the stream is unacknowledged; the server counts bytes until the FIN and answers with
  its report and a FIN on the same stream. Same datagram size as the row it is compared with,
  the same windows as ours (16 MiB per stream, 64 MiB per connection), 4 MiB socket buffers
  (``SO_RCVBUF`` / ``SO_SNDBUF``, as our endpoints ask for), reno congestion control.
* ours: one stream of a :class:`swarmavg.aio.node.Node` over the ``quic`` transport with
  ``max_datagram_size`` set on both sides (``None`` for the automatic size) and its defaults
  otherwise (windows 16 / 64 MiB, send buffer 4 MiB), reno as the reference (our default,
  ``"bbr"``, is compared on the network lab), ``send`` of 1 MiB messages.

Targets: ours >= 0.9x the reference at 1200 B and at 9000 B; >= 100 MB/s at the automatic size
(the reference beside it is for information). The clock, CPU seconds per GB of each side and peak
RSS are measured as in ``_tcp_bench.py``; the runs of a size are interleaved, in rotating order,
after a small warm-up run of each; best throughput, median CPU, largest peak.

Memory: for the runs at the automatic size (1 GiB in full mode), how far each side's peak RSS
rose above its RSS just before the transfer (the server's once it listens, the client's before
its node starts): at most 200 MB (1e6 bytes) on either side.

Round trip: a unary RPC ``node.rpc.call(address, "echo", Ping(nonce))`` over our QUIC transport
(automatic datagram size) beside the same call over our encrypted TCP transport in the same run,
rounds alternating: median at most 4x TCP's. Median and p90 after a warm-up.

If the ``quic`` transport cannot be resolved, :func:`measure` still returns the plain aioquic
rows and marks ours with an ``error`` key; likewise the TCP row if ``tcp`` is missing.

Run alone: ``python benchmarks/_quic_bench.py [--quick] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _tcp_bench import (
    CHUNK,
    HOST,
    BulkRun,
    MiB,
    _announce,
    _bulk_extras,
    _bulk_run,
    _cpu_seconds,
    _echo,
    _error_text,
    _exit_when_stdin_closes,
    _ours_bulk_handler,
    _ours_rtt,
    _payload,
    _pinned,
    _quantiles,
    _report,
    _reset_peak_rss,
    _rpc_round_trips,
    _rss_bytes,
    _send_bulk,
    _Server,
    _size_label,
    tcp_transport_error,
)
from _tcp_bench import format_extras as _tcp_format_extras

MB = 1e6
SCRIPT = Path(__file__).resolve()

BULK_TIMEOUT = 180.0  # one bulk transfer, including the connection and the server's report
RTT_TIMEOUT = 120.0  # one round of round trips
SERVER_LIFETIME = 600.0  # a server gives up on its own after this

STREAM_WINDOW = 16 * MiB  # ours' defaults, given to the reference too
CONNECTION_WINDOW = 64 * MiB
SEND_BUFFER = 4 * MiB  # the reference waits while more than this is unacknowledged
SOCKET_BUFFER = 4 * MiB  # SO_RCVBUF / SO_SNDBUF, as our endpoints ask for
ALPN = "swarmavg-bench"

AUTO = 0  # --datagram 0: ours picks the size (the reference never runs with it)
LOOPBACK_DATAGRAM = 16383  # what ours picks on loopback, unless the transport says otherwise

MIN_RATIO = 0.9
MIN_AUTO_SPEED = 100 * MB
MAX_RSS_GROWTH = 200 * MB
MAX_RPC_RATIO = 4.0

REF_BULK = "ref-bulk"
OURS_BULK = "ours-bulk"
OURS_RPC = "ours-rpc"
SERVE_MODES = (REF_BULK, OURS_BULK, OURS_RPC)


# -- plain aioquic (the reference) ------------------------------------------------------------


def _ref_configuration(*, is_client: bool, datagram: int) -> Any:
    """An aioquic configuration with our windows; the server's has a fresh self-signed cert."""
    import ssl

    from aioquic.quic.configuration import QuicConfiguration

    config = QuicConfiguration(
        is_client=is_client,
        alpn_protocols=[ALPN],
        max_datagram_size=datagram,
        max_data=CONNECTION_WINDOW,
        max_stream_data=STREAM_WINDOW,
        congestion_control_algorithm="reno",
    )
    if is_client:
        config.verify_mode = ssl.CERT_NONE
    else:
        config.certificate, config.private_key = _self_signed()
    return config


def _self_signed() -> tuple[Any, Any]:
    """An EC P-256 key and a self-signed certificate for it (in memory, no files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _ref_protocol_class() -> type[Any]:
    """The ``QuicConnectionProtocol`` subclass of both reference peers (aioquic imported late,
    so that this module loads without it)."""
    from aioquic.asyncio.protocol import QuicConnectionProtocol
    from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamDataReceived

    class RefProtocol(QuicConnectionProtocol):
        """Server: count a stream's bytes, answer the FIN with a report. Client: collect the
        answer; ``acked`` is set on every datagram received (acknowledgements free the buffer)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.acked = asyncio.Event()
            self.answer = bytearray()
            self.answered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.received = 0
            self.cpu_start: float | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)

        def datagram_received(self, data: bytes | str, addr: Any) -> None:
            super().datagram_received(data, addr)
            self.acked.set()

        def unacked(self, stream_id: int) -> int:
            """Bytes of the stream written and not yet acknowledged."""
            stream = self._quic._streams.get(stream_id)
            return len(stream.sender._buffer) if stream is not None else 0

        def quic_event_received(self, event: QuicEvent) -> None:
            if isinstance(event, ConnectionTerminated):
                if not self.answered.done():
                    self.answered.set_exception(
                        ConnectionError(f"connection closed: {event.reason_phrase!r}")
                    )
                self.acked.set()
            if not isinstance(event, StreamDataReceived):
                return
            if self._quic.configuration.is_client:
                self.answer += event.data
                if event.end_stream and not self.answered.done():
                    self.answered.set_result(None)
                return
            if self.cpu_start is None:
                self.cpu_start = _cpu_seconds()
            self.received += len(event.data)
            if event.end_stream:
                report = _report(self.cpu_start, received=self.received)
                self._quic.send_stream_data(event.stream_id, report, end_stream=True)
                self.transmit()

    return RefProtocol


async def _serve_ref_bulk(datagram: int) -> None:
    from aioquic.asyncio.server import serve

    config = _ref_configuration(is_client=False, datagram=datagram)
    server = await serve(HOST, 0, configuration=config, create_protocol=_ref_protocol_class())
    transport = server._transport  # aioquic does not say otherwise which port it bound
    assert transport is not None
    _announce({"port": transport.get_extra_info("sockname")[1]})
    try:
        await asyncio.Event().wait()  # until our stdin closes
    finally:
        server.close()


def _ref_bulk(total: int, datagram: int) -> BulkRun:
    """The reference: ``total`` bytes on one stream of a plain aioquic connection."""
    from aioquic.asyncio.client import connect

    view = _payload()
    protocol_class = _ref_protocol_class()

    async def client(port: int) -> tuple[float, float, dict[str, Any]]:
        config = _ref_configuration(is_client=True, datagram=datagram)
        async with asyncio.timeout(BULK_TIMEOUT):  # around the handshake and the close too
            async with connect(
                HOST, port, configuration=config, create_protocol=protocol_class
            ) as protocol:
                peer = cast(Any, protocol)
                quic = peer._quic
                stream_id = quic.get_next_available_stream_id()
                count = total // CHUNK
                start, cpu_start = time.perf_counter(), _cpu_seconds()
                for i in range(count):
                    while peer.unacked(stream_id) > SEND_BUFFER:
                        if peer.answered.done():
                            peer.answered.result()  # the connection died: raise its error
                        peer.acked.clear()
                        await peer.acked.wait()
                    quic.send_stream_data(stream_id, view, end_stream=i == count - 1)
                    peer.transmit()
                await peer.answered
                seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu_start
                return seconds, cpu, json.loads(bytes(peer.answer))

    with _Server(REF_BULK, script=SCRIPT, args=_server_args(datagram)) as server:
        reset, start_rss = _reset_peak_rss(), _rss_bytes()
        seconds, cpu, report = asyncio.run(client(server.info["port"]))
    return _bulk_run(total, seconds, cpu, report, reset, start_rss, server.info.get("rss"))


# -- ours ------------------------------------------------------------------------------------


def _quic_options(datagram: int) -> dict[str, dict[str, Any]]:
    # (reno, as the reference: these rows compare the transports' own costs; the congestion
    # controls are compared on the network lab, benchmarks/network.py)
    return {"quic": {"max_datagram_size": datagram or None, "congestion_control": "reno"}}


def _server_args(datagram: int) -> list[str]:
    return ["--datagram", str(datagram)]


async def _serve_ours(mode: str, datagram: int) -> None:
    import anyio

    from swarmavg.aio.node import Node

    listen = [f"quic://{HOST}:0"]
    async with Node(listen=listen, transports=_quic_options(datagram)) as node:
        if mode == OURS_BULK:
            node.set_stream_handler(_ours_bulk_handler())
        else:
            node.rpc.register("echo", _echo)
        _announce({"address": str(node.addresses[0])})
        await anyio.sleep_forever()  # until our stdin closes or the lifetime runs out


def _serve(mode: str, datagram: int, lifetime: float) -> int:
    threading.Thread(target=_exit_when_stdin_closes, name="stdin watch", daemon=True).start()
    if mode == REF_BULK:

        async def bounded_ref() -> None:
            async with asyncio.timeout(lifetime):
                await _serve_ref_bulk(datagram)

        asyncio.run(bounded_ref())
    else:
        import anyio

        async def bounded() -> None:
            with anyio.fail_after(lifetime):
                await _serve_ours(mode, datagram)

        anyio.run(bounded)
    return 0


def _ours_bulk(total: int, datagram: int) -> BulkRun:
    """Ours: ``total`` bytes as 1 MiB messages on one stream of the QUIC transport."""
    import anyio

    from swarmavg.aio.node import Node

    view = _payload()

    async def client(address: str) -> tuple[float, float, dict[str, Any]]:
        with anyio.fail_after(BULK_TIMEOUT):  # around the node too: its start and its close
            async with Node(transports=_quic_options(datagram)) as node:
                return await _send_bulk(node, address, view, total)

    with _Server(OURS_BULK, script=SCRIPT, args=_server_args(datagram)) as server:
        reset, start_rss = _reset_peak_rss(), _rss_bytes()
        seconds, cpu, report = anyio.run(client, server.info["address"])
    return _bulk_run(total, seconds, cpu, report, reset, start_rss, server.info.get("rss"))


def _ours_quic_rtt(iterations: int, warmup: int) -> list[float]:
    """Ours: round trips (seconds) of a unary ``echo(Ping)`` RPC over the QUIC transport."""
    import anyio

    from swarmavg.aio.node import Node

    async def client(address: str) -> list[float]:
        with anyio.fail_after(RTT_TIMEOUT):  # around the node too: its start and its close
            async with Node(transports=_quic_options(AUTO)) as node:
                return await _rpc_round_trips(node, address, iterations, warmup)

    with _Server(OURS_RPC, script=SCRIPT, args=_server_args(AUTO)) as server:
        return anyio.run(client, server.info["address"])


# -- rows ------------------------------------------------------------------------------------


def quic_transport_error() -> str | None:
    """Why the ``quic`` transport cannot be used here, or ``None`` if it resolves."""
    from swarmavg.errors import TransportNotFound
    from swarmavg.transport import resolve_transport

    try:
        resolve_transport("quic")
    except (TransportNotFound, ImportError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def aioquic_error() -> str | None:
    """Why plain aioquic (the reference) cannot be used here, or ``None``."""
    try:
        import aioquic.asyncio.client  # noqa: F401
        import cryptography  # noqa: F401
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def auto_datagram_size() -> int:
    """The datagram size our transport picks towards 127.0.0.1 (16383 where it cannot tell)."""
    try:
        from swarmavg_quic._mtu import datagram_size_for
    except ImportError:
        return LOOPBACK_DATAGRAM
    return datagram_size_for(HOST, 0)


def _interleaved(
    variants: dict[str, Callable[[int], BulkRun]],
    total: int,
    warmup: int,
    repeats: int,
    errors: dict[str, str],
) -> dict[str, list[BulkRun]]:
    """Runs of each variant, in rotating order, after a warm-up round (not recorded); a variant
    that fails gets an entry in ``errors`` and is not run again."""
    runs: dict[str, list[BulkRun]] = {name: [] for name in variants}
    order = list(variants)
    for repeat in range(-1, repeats):  # -1: the warm-up round
        for name in order:
            if name in errors:
                continue
            try:
                run = variants[name](warmup if repeat < 0 else total)
            except Exception as exc:
                errors[name] = _error_text(exc)
                continue
            if repeat >= 0:
                runs[name].append(run)
        order = order[1:] + order[:1]
    return runs


def _speed_row(
    name: str, runs: list[BulkRun], error: str | None, **extra: Any
) -> tuple[dict[str, Any], float | None]:
    """A throughput row (MB/s, best run) and its speed in bytes/s, ``None`` if not measured."""
    row: dict[str, Any] = {"name": name, "unit": "MB/s", **extra}
    if error is not None or not runs:
        row["error"] = error or "no runs"
        if "target" in row:
            row["ok"] = False
        return row, None
    speed = max(r.throughput for r in runs)
    row.update(ours=speed / MB, **_bulk_extras(runs))
    return row, speed


def _bulk_rows(
    datagram: int, total: int, repeats: int, ours_error: str | None, ref_error: str | None
) -> list[dict[str, Any]]:
    """Reference and ours at one datagram size (``AUTO``: ours' own, the reference at the
    size ours picks), plus, at the automatic size, the peak-RSS row."""
    size = auto_datagram_size() if datagram == AUTO else datagram
    label = f"quic bulk {_size_label(total)}/1 MiB msgs"
    at = f"auto datagram size ({size} B on loopback)" if datagram == AUTO else f"@{size} B"
    ref_name = (
        f"plain aioquic, one stream, send_stream_data 1 MiB, <= 4 MiB unacked, {size} B "
        "datagrams, windows 16/64 MiB, 4 MiB socket buffers, reno"
    )
    variants: dict[str, Callable[[int], BulkRun]] = {
        "ref": lambda n: _ref_bulk(n, size),
        "ours": lambda n: _ours_bulk(n, datagram),
    }
    errors: dict[str, str] = {}
    if ref_error is not None:
        errors["ref"] = ref_error
    if ours_error is not None:
        errors["ours"] = ours_error
    runs = _interleaved(variants, total, min(total, 16 * MiB), repeats, errors)

    ref_row, ref_speed = _speed_row(
        f"{label} {at}, reference (plain aioquic)", runs["ref"], errors.get("ref")
    )
    if datagram == AUTO:
        target = f">= {MIN_AUTO_SPEED / MB:.0f} MB/s"
    else:
        target = f">= {MIN_RATIO}x reference"
    row, speed = _speed_row(
        f"{label} {at}, ours",
        runs["ours"],
        errors.get("ours"),
        reference_name=ref_name,
        target=target,
        datagram_size=size,
    )
    if speed is not None:
        if ref_speed is not None:
            row.update(reference=ref_speed / MB, ratio=speed / ref_speed)
        if datagram == AUTO:
            row["ok"] = speed >= MIN_AUTO_SPEED
        elif ref_speed is not None:
            row["ok"] = speed / ref_speed >= MIN_RATIO
    rows = [ref_row, row]
    if datagram == AUTO:
        rows.append(_rss_row(total, size, runs["ours"], errors.get("ours")))
    return rows


def _rss_row(total: int, size: int, runs: list[BulkRun], error: str | None) -> dict[str, Any]:
    """How far each side's peak RSS rose above its RSS just before the transfer."""
    row: dict[str, Any] = {
        "name": f"quic peak RSS above idle, {_size_label(total)} @{size} B, ours",
        "unit": "MB",
        "target": f"<= {MAX_RSS_GROWTH / MB:.0f} MB above idle",
        "transfer_bytes": total,
    }
    if error is not None or not runs:
        row.update(error=error or "no runs", ok=False)
        return row
    growth: dict[str, float] = {}
    for side in ("client", "server"):
        rises = [
            getattr(r, f"{side}_peak_rss") - start
            for r in runs
            if (start := getattr(r, f"{side}_start_rss")) is not None
        ]
        if not rises:
            row.update(error=f"no RSS before the transfer on the {side} (not Linux?)", ok=False)
            return row
        growth[side] = max(rises) / MB
    worst = max(growth.values())
    row.update(
        ours=worst,
        rss_growth_mb_client=growth["client"],
        rss_growth_mb_server=growth["server"],
        client_rss_reset=all(r.client_rss_reset for r in runs),
        runs=len(runs),
        ok=worst * MB <= MAX_RSS_GROWTH,
    )
    return row


def _rtt_rows(
    iterations: int, rounds: int, ours_error: str | None, tcp_error: str | None
) -> list[dict[str, Any]]:
    """Our unary RPC over QUIC beside the same over encrypted TCP, ``iterations`` samples of
    each per round, rounds alternating which goes first."""
    warmup = max(50, iterations // 10)
    samples: dict[str, list[float]] = {"tcp": [], "quic": []}
    errors: dict[str, str] = {}
    if tcp_error is not None:
        errors["tcp"] = tcp_error
    if ours_error is not None:
        errors["quic"] = ours_error
    measure_fns: dict[str, Callable[[int, int], list[float]]] = {
        "tcp": _ours_rtt,
        "quic": _ours_quic_rtt,
    }
    for i in range(rounds):
        for name in ("tcp", "quic") if i % 2 == 0 else ("quic", "tcp"):
            if name in errors:
                continue
            try:
                samples[name] += measure_fns[name](iterations, warmup)
            except Exception as exc:
                errors[name] = _error_text(exc)

    tcp_row: dict[str, Any] = {"name": "tcp unary RPC echo(Ping), reference for quic", "unit": "µs"}
    tcp_median: float | None = None
    if "tcp" in errors:
        tcp_row["error"] = errors["tcp"]
    else:
        tcp_median, tcp_p90 = _quantiles(samples["tcp"])
        tcp_row.update(ours=tcp_median * 1e6, p90=tcp_p90 * 1e6, samples=len(samples["tcp"]))
    row: dict[str, Any] = {
        "name": "quic unary RPC echo(Ping), ours",
        "unit": "µs",
        "reference_name": "our unary RPC echo(Ping) over encrypted TCP, same run",
        "target": f"<= {MAX_RPC_RATIO:.0f}x tcp RPC",
    }
    if "quic" in errors:
        row.update(error=errors["quic"], ok=False)
    else:
        median, p90 = _quantiles(samples["quic"])
        row.update(ours=median * 1e6, p90=p90 * 1e6, samples=len(samples["quic"]))
        if tcp_median is not None:
            ratio = median / tcp_median
            row.update(reference=tcp_median * 1e6, ratio=ratio, ok=ratio <= MAX_RPC_RATIO)
    return [tcp_row, row]


def measure(quick: bool) -> list[dict[str, Any]]:
    """The rows of this benchmark (see the module docstring); ``quick``: smaller transfers,
    one run each, fewer round trips.

    Rows have the keys of ``benchmarks/transport.py`` (name, unit, ours, p90, reference,
    reference_name, ratio, target, ok); bulk rows add the extras of ``_tcp_bench.py`` (runs,
    transfer_bytes, cpu_s_per_gb_client/_server, peak_rss_mib_client/_server,
    start_rss_mib_client/_server, client_rss_reset) and ours datagram_size; the RSS row adds
    rss_growth_mb_client/_server; round-trip rows add samples. A row that could not be measured
    has ``error`` (and no ``ours``).
    """
    ours_error = quic_transport_error()
    ref_error = aioquic_error()
    repeats = 1 if quick else 2
    sizes = (
        (1200, (32 if quick else 128) * MiB),
        (9000, (64 if quick else 512) * MiB),
        (AUTO, (256 if quick else 1024) * MiB),
    )
    rows: list[dict[str, Any]] = []
    with _pinned() as placement:
        for datagram, total in sizes:
            rows += _bulk_rows(datagram, total, repeats, ours_error, ref_error)
        rows += _rtt_rows(
            250 if quick else 1000,
            rounds=2 if quick else 4,
            ours_error=ours_error,
            tcp_error=tcp_transport_error(),
        )
    for row in rows:
        row["placement"] = placement
    return rows


def format_extras(row: dict[str, Any]) -> str | None:
    """A footnote line with a row's CPU and memory figures or its error, if it has any."""
    if "rss_growth_mb_client" in row:
        note = "" if row.get("client_rss_reset", True) else " (client: lifetime peak)"
        return (
            f"  {row['name']}: peak RSS above the RSS before the transfer: client "
            f"{row['rss_growth_mb_client']:.0f} MB, server {row['rss_growth_mb_server']:.0f} MB"
            f"{note}; largest of {row['runs']}"
        )
    return _tcp_format_extras(row)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller transfers, fewer samples")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--serve", choices=SERVE_MODES, help=argparse.SUPPRESS)
    parser.add_argument("--datagram", type=int, default=AUTO, help=argparse.SUPPRESS)
    parser.add_argument("--lifetime", type=float, default=SERVER_LIFETIME, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return _serve(args.serve, args.datagram, args.lifetime)
    rows = measure(args.quick)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        if "ours" in row:
            ratio = f"  {row['ratio']:.2f}x ref" if "ratio" in row else ""
            p90 = f" (p90 {row['p90']:.1f})" if "p90" in row else ""
            ok = "" if "ok" not in row else ("  ok" if row["ok"] else "  NOT OK")
            print(f"{row['name']:64} {row['ours']:9.2f} {row['unit']}{p90}{ratio}{ok}")
        extras = format_extras(row)
        if extras:
            print(extras)
    return 0


if __name__ == "__main__":
    sys.exit(main())
