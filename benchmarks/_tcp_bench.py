"""Loopback TCP between two processes: swarmavg's TCP transport beside raw asyncio sockets.

Every figure comes from two processes on 127.0.0.1: this one (the client) and a server started for
each run as ``sys.executable benchmarks/_tcp_bench.py --serve MODE``. The server prints one JSON
line (the port or address to dial) on stdout, serves, and exits as soon as its stdin closes, which
the client does when it is done (and which happens by itself if the client dies); it also gives up
after ``--lifetime`` seconds. Every wait on either side has a timeout, and the client kills the
server if it is still there afterwards.

Bulk (one way, client to server, 1 GiB in 1 MiB messages; 256 MiB with ``quick``):

* reference A: raw asyncio sockets, ``loop.sock_sendall`` of a 1 MiB buffer on one side and
  ``loop.sock_recv_into`` a preallocated 1 MiB buffer on the other, read until EOF.
* ours: one stream of a :class:`swarmavg.aio.node.Node` over the ``tcp`` transport, ``send`` of
  one 1 MiB message at a time, the server ``receive``-ing until EOF; encrypted (the default) and
  with ``encryption=False``.

The clock runs from the first byte sent (after the connection, and for ours the stream, is open)
until the server's report arrives, which it sends once it has read everything. CPU seconds are
user + system time (``os.times()``, all threads) of each process over that span, per 1e9 bytes.
Peak RSS is each process's high-water mark: ``VmHWM`` of ``/proc/self/status`` on Linux (there
``getrusage(RUSAGE_SELF).ru_maxrss`` of a child starts at the RSS its parent had when it forked),
``ru_maxrss`` elsewhere. The server process is fresh each run, so its peak covers interpreter,
imports and transfer; the client process is this one, long-lived, so its high-water mark is reset
(``/proc/self/clear_refs``, Linux) before each run where the kernel allows, else it is the
lifetime peak (the row says ``client_rss_reset: false`` then). Each side's RSS just before the
transfer (the server's once it listens) is reported too, to tell imports from traffic.

Runs of the variants are interleaved, in rotating order, after a small warm-up run of each; the
reported throughput is the best run, CPU s/GB the median over runs, peak RSS the largest.

Round trip:

* reference B: ping-pong of a 64-byte message over raw asyncio sockets, ``loop.sock_sendall`` /
  ``loop.sock_recv_into`` a preallocated buffer, ``TCP_NODELAY`` on both ends.
* ours: a unary RPC ``node.rpc.call(address, "echo", Ping(nonce))`` over the encrypted TCP
  transport, the server's handler returning the request: once with an ``async def`` handler,
  once with the same handler as a plain function registered ``inline=True`` (answered from the
  transport's reader, the way the DHT's methods are).

Median and p90 over the samples after a warm-up; the rounds alternate reference and ours, and
ours takes a quarter as many samples (every call is a whole RPC on a stream of its own). Of
``sock_*``, streams (``write`` / ``readexactly``) and a ``Protocol`` echo, ``sock_*`` had the
lowest round trip on the machine this was written on, so it is the reference.

If the ``tcp`` transport cannot be resolved, :func:`measure` still returns the reference rows and
marks our rows with an ``error`` key.

Run alone: ``python benchmarks/_tcp_bench.py [--quick] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any

MiB = 1 << 20
GB = 1e9
CHUNK = MiB
PING_SIZE = 64
HOST = "127.0.0.1"

START_TIMEOUT = 30.0  # server process start until its address line
BULK_TIMEOUT = 180.0  # one bulk transfer, including the server's report
RTT_TIMEOUT = 180.0  # one round of round trips
EXIT_TIMEOUT = 3.0  # server exit after its stdin closed, before it is killed
SERVER_LIFETIME = 600.0  # a server gives up on its own after this

REF_BULK = "ref-bulk"
REF_PING = "ref-ping"
OURS_BULK = "ours-bulk"
OURS_RPC = "ours-rpc"
SERVE_MODES = (REF_BULK, REF_PING, OURS_BULK, OURS_RPC)


# -- measurements of this process ------------------------------------------------------------


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _proc_status_bytes(field: bytes) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (Linux) in bytes, or ``None``."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(field + b":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _rss_bytes() -> int | None:
    """This process's resident set size now (Linux only)."""
    return _proc_status_bytes(b"VmRSS")


def _peak_rss_bytes() -> int:
    """This process's peak resident set size.

    On Linux, ``VmHWM`` of ``/proc/self/status``: ``ru_maxrss`` is no good there for a child,
    since ``execve`` carries the RSS the parent had at ``fork`` into it. The kernel updates the
    mark lazily, so the current RSS counts too.
    """
    peak = _proc_status_bytes(b"VmHWM")
    if peak is not None:
        return max(peak, _rss_bytes() or 0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def _reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _report(cpu_start: float, **extra: Any) -> bytes:
    """What a server sends back: its CPU seconds since ``cpu_start`` and its peak RSS."""
    report = {"cpu_s": _cpu_seconds() - cpu_start, "peak_rss": _peak_rss_bytes(), **extra}
    return json.dumps(report).encode()


def _quantiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[int(0.9 * (len(ordered) - 1))]


# -- server process ----------------------------------------------------------------------------


def _announce(info: dict[str, Any]) -> None:
    """Tell the client where to dial, and our RSS once ready (before any traffic)."""
    sys.stdout.write(json.dumps({**info, "rss": _rss_bytes()}) + "\n")
    sys.stdout.flush()


def _exit_when_stdin_closes() -> None:
    """Daemon thread: the client closes our stdin when it is done with us (or when it dies)."""
    try:
        while os.read(sys.stdin.fileno(), 4096):  # no Python-level lock, unlike sys.stdin
            pass
    finally:
        os._exit(0)


def _listen_socket() -> socket.socket:
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((HOST, 0))
    lsock.listen(1)
    lsock.setblocking(False)
    return lsock


async def _serve_ref_bulk() -> None:
    loop = asyncio.get_running_loop()
    lsock = _listen_socket()
    _announce({"port": lsock.getsockname()[1]})
    conn, _ = await loop.sock_accept(lsock)
    cpu_start = _cpu_seconds()
    view = memoryview(bytearray(CHUNK))
    received = 0
    while n := await loop.sock_recv_into(conn, view):
        received += n
    await loop.sock_sendall(conn, _report(cpu_start, received=received))
    conn.close()


async def _serve_ref_ping() -> None:
    loop = asyncio.get_running_loop()
    lsock = _listen_socket()
    _announce({"port": lsock.getsockname()[1]})
    conn, _ = await loop.sock_accept(lsock)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    cpu_start = _cpu_seconds()
    view = memoryview(bytearray(PING_SIZE))
    pings = 0
    while await _recv_exactly(loop, conn, view):
        await loop.sock_sendall(conn, view)
        pings += 1
    await loop.sock_sendall(conn, _report(cpu_start, pings=pings))
    conn.close()


async def _recv_exactly(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview
) -> bool:
    """Fill ``view`` from ``sock``; ``False`` on a clean EOF before the first byte."""
    got = 0
    while got < len(view):
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError("EOF in the middle of a message")
        got += n
    return True


def _tcp_options(encryption: bool) -> dict[str, dict[str, Any]]:
    return {"tcp": {"encryption": encryption}}


def _ours_bulk_handler() -> Callable[[Any], Coroutine[Any, Any, None]]:
    """The server's stream handler: count messages until EOF, then answer with a report."""
    import anyio

    async def handler(stream: Any) -> None:
        cpu_start = _cpu_seconds()
        received = messages = 0
        while True:
            try:
                msg = await stream.receive()
            except anyio.EndOfStream:
                break
            received += msg.nbytes
            messages += 1
        await stream.send(_report(cpu_start, received=received, messages=messages))
        await stream.send_eof()

    return handler


async def _echo(request: Any, ctx: Any) -> Any:
    return request


def _echo_inline(request: Any, ctx: Any) -> Any:
    return request


async def _serve_ours(mode: str, encryption: bool) -> None:
    import anyio

    from swarmavg.aio.node import Node

    async with Node(listen=[f"tcp://{HOST}:0"], transports=_tcp_options(encryption)) as node:
        if mode == OURS_BULK:
            node.set_stream_handler(_ours_bulk_handler())
        else:
            node.rpc.register("echo", _echo)
            node.rpc.register("echo_inline", _echo_inline, inline=True)
        _announce({"address": str(node.addresses[0])})
        await anyio.sleep_forever()  # until our stdin closes or the lifetime runs out


def _serve(mode: str, encryption: bool, lifetime: float) -> int:
    threading.Thread(target=_exit_when_stdin_closes, name="stdin watch", daemon=True).start()
    if mode in (OURS_BULK, OURS_RPC):
        import anyio

        async def bounded() -> None:
            with anyio.fail_after(lifetime):
                await _serve_ours(mode, encryption)

        anyio.run(bounded)
    else:
        serve = _serve_ref_bulk if mode == REF_BULK else _serve_ref_ping

        async def bounded_ref() -> None:
            async with asyncio.timeout(lifetime):
                await serve()
                await asyncio.Event().wait()  # until our stdin closes

        asyncio.run(bounded_ref())
    return 0


# -- client side: managing a server ----------------------------------------------------------


@dataclass
class _Placement:
    """The CPUs of the client (this process) and the server during a measurement."""

    server: set[int] | None = None
    client: set[int] | None = None


_PLACEMENT = _Placement()


@contextlib.contextmanager
def _pinned() -> Iterator[str]:
    """Pin this process (the client) and the servers it starts to two different CPUs, where
    Linux lets us: whether both processes share a core or not changes loopback throughput by
    up to 2x on a small machine, and the kernel's choice varies from run to run. Yields a
    description of the placement."""
    getaff = getattr(os, "sched_getaffinity", None)
    setaff = getattr(os, "sched_setaffinity", None)
    allowed = sorted(getaff(0)) if getaff is not None else []
    if setaff is None or len(allowed) < 2:
        yield "not pinned (needs Linux and 2 CPUs)"
        return
    before = set(allowed)
    client, server = {allowed[0]}, {allowed[1]}
    try:
        setaff(0, client)
    except OSError as exc:
        yield f"not pinned ({exc})"
        return
    _PLACEMENT.client, _PLACEMENT.server = client, server
    try:
        yield f"client on CPU {allowed[0]}, server on CPU {allowed[1]}"
    finally:
        _PLACEMENT.client = _PLACEMENT.server = None
        setaff(0, before)


class _Server:
    """A server subprocess: started on enter, its stdin closed and it reaped (or killed) on exit.

    ``script`` is the benchmark file the server runs (this one by default), ``args`` more
    arguments for it after ``--serve MODE --lifetime S``.
    """

    def __init__(
        self,
        mode: str,
        *,
        encryption: bool = True,
        script: Path | None = None,
        args: Sequence[str] = (),
    ) -> None:
        self.argv = [
            sys.executable,
            str(script if script is not None else Path(__file__).resolve()),
            "--serve",
            mode,
            "--lifetime",
            str(SERVER_LIFETIME),
            *args,
        ]
        if not encryption:
            self.argv.append("--plain")
        self._stderr: IO[bytes] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}

    def __enter__(self) -> _Server:
        self._stderr = tempfile.TemporaryFile()
        try:
            self._proc = subprocess.Popen(
                self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr
            )
            if _PLACEMENT.server is not None:
                os.sched_setaffinity(self._proc.pid, _PLACEMENT.server)
            self.info = json.loads(self._read_line(START_TIMEOUT))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                if proc.stdin is not None:
                    proc.stdin.close()  # the server exits when it sees EOF on its stdin
                proc.wait(EXIT_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(EXIT_TIMEOUT)
                if proc.stdout is not None:
                    proc.stdout.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def _read_line(self, timeout: float) -> str:
        assert self._proc is not None
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        data = b""
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in data:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"server gave no address in {timeout} s{self._tail()}")
                if sel.select(left):
                    chunk = os.read(fd, 4096)
                    if not chunk:
                        raise ConnectionError(f"server exited before its address{self._tail()}")
                    data += chunk
        return data.split(b"\n", 1)[0].decode()

    def _tail(self) -> str:
        """The end of the server's stderr, for error messages."""
        if self._stderr is None:
            return ""
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(0.5)  # let a crashing server finish writing its traceback
        self._stderr.seek(0)
        text = self._stderr.read().decode(errors="replace").strip()
        return f"; server stderr:\n{text[-2000:]}" if text else ""


# -- client side: one run of each kind -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BulkRun:
    """One bulk transfer: its duration, each side's CPU time and peak RSS."""

    nbytes: int
    seconds: float
    client_cpu_s: float
    server_cpu_s: float
    client_peak_rss: int
    server_peak_rss: int
    client_rss_reset: bool
    client_start_rss: int | None  # RSS before the run: the client before its node, if any,
    server_start_rss: int | None  # the server once listening

    @property
    def throughput(self) -> float:
        return self.nbytes / self.seconds


def _payload() -> memoryview:
    return memoryview(bytearray(os.urandom(CHUNK)))


async def _read_to_eof(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    parts = []
    while chunk := await loop.sock_recv(sock, 65536):
        parts.append(chunk)
    return b"".join(parts)


def _connect(port: int, *, nodelay: bool = False) -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=START_TIMEOUT)
    if nodelay:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    return sock


def _ref_bulk(total: int) -> BulkRun:
    """Reference A: ``total`` bytes over a raw asyncio socket."""
    view = _payload()

    async def client(port: int) -> tuple[float, float, dict[str, Any]]:
        loop = asyncio.get_running_loop()
        with _connect(port) as sock:
            async with asyncio.timeout(BULK_TIMEOUT):
                start, cpu_start = time.perf_counter(), _cpu_seconds()
                for _ in range(total // CHUNK):
                    await loop.sock_sendall(sock, view)
                sock.shutdown(socket.SHUT_WR)
                report = json.loads(await _read_to_eof(loop, sock))
                return time.perf_counter() - start, _cpu_seconds() - cpu_start, report

    with _Server(REF_BULK) as server:
        reset, start_rss = _reset_peak_rss(), _rss_bytes()
        seconds, cpu, report = asyncio.run(client(server.info["port"]))
    return _bulk_run(total, seconds, cpu, report, reset, start_rss, server.info.get("rss"))


async def _send_bulk(
    node: Any, address: str, view: memoryview, total: int
) -> tuple[float, float, dict[str, Any]]:
    """Send ``total`` bytes as ``view``-sized messages on one stream; seconds, CPU s, report."""
    stream = await node.open_stream(address)
    if stream.max_message_size < len(view):
        raise ValueError(f"the stream carries at most {stream.max_message_size} B per message")
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    for _ in range(total // len(view)):
        await stream.send(view)
    await stream.send_eof()
    report = json.loads(bytes(await stream.receive()))
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu_start
    await stream.aclose()
    return seconds, cpu, report


def _ours_bulk(total: int, encryption: bool) -> BulkRun:
    """Ours: ``total`` bytes as 1 MiB messages on one stream of the TCP transport."""
    import anyio

    from swarmavg.aio.node import Node

    view = _payload()

    async def client(address: str) -> tuple[float, float, dict[str, Any]]:
        with anyio.fail_after(BULK_TIMEOUT):  # around the node too: its start and its close
            async with Node(transports=_tcp_options(encryption)) as node:
                return await _send_bulk(node, address, view, total)

    with _Server(OURS_BULK, encryption=encryption) as server:
        reset, start_rss = _reset_peak_rss(), _rss_bytes()
        seconds, cpu, report = anyio.run(client, server.info["address"])
    return _bulk_run(total, seconds, cpu, report, reset, start_rss, server.info.get("rss"))


def _bulk_run(
    total: int,
    seconds: float,
    cpu: float,
    report: dict[str, Any],
    reset: bool,
    client_start_rss: int | None,
    server_start_rss: int | None,
) -> BulkRun:
    if report.get("received") != total:
        raise RuntimeError(f"server received {report.get('received')} of {total} bytes")
    return BulkRun(
        nbytes=total,
        seconds=seconds,
        client_cpu_s=cpu,
        server_cpu_s=float(report["cpu_s"]),
        client_peak_rss=_peak_rss_bytes(),
        server_peak_rss=int(report["peak_rss"]),
        client_rss_reset=reset,
        client_start_rss=client_start_rss,
        server_start_rss=server_start_rss,
    )


def _ref_rtt(iterations: int, warmup: int) -> list[float]:
    """Reference B: round trips (seconds) of a 64-byte message over raw asyncio sockets."""

    async def client(port: int) -> list[float]:
        loop = asyncio.get_running_loop()
        out = memoryview(bytearray(os.urandom(PING_SIZE)))
        back = memoryview(bytearray(PING_SIZE))
        samples: list[float] = []
        clock = time.perf_counter
        with _connect(port, nodelay=True) as sock:
            async with asyncio.timeout(RTT_TIMEOUT):
                for i in range(warmup + iterations):
                    start = clock()
                    await loop.sock_sendall(sock, out)
                    if not await _recv_exactly(loop, sock, back):
                        raise ConnectionError("server closed the connection")
                    if i >= warmup:
                        samples.append(clock() - start)
                sock.shutdown(socket.SHUT_WR)
                json.loads(await _read_to_eof(loop, sock))
        return samples

    with _Server(REF_PING) as server:
        return asyncio.run(client(server.info["port"]))


async def _rpc_round_trips(
    node: Any, address: str, iterations: int, warmup: int, method: str = "echo"
) -> list[float]:
    """Round trips (seconds) of ``echo(Ping)`` calls, the first ``warmup`` left out."""
    from swarmavg.proto import Ping

    samples: list[float] = []
    clock = time.perf_counter
    for i in range(warmup + iterations):
        start = clock()
        answer = await node.rpc.call(address, method, Ping(i), response_type=Ping)
        if i >= warmup:
            samples.append(clock() - start)
        if answer.nonce != i:
            raise RuntimeError(f"echo answered nonce {answer.nonce}, not {i}")
    return samples


def _ours_rtt(iterations: int, warmup: int, method: str = "echo") -> list[float]:
    """Ours: round trips (seconds) of a unary ``echo(Ping)`` RPC over the encrypted transport
    (``method``: ``"echo"``, an async handler, or ``"echo_inline"``)."""
    import anyio

    from swarmavg.aio.node import Node

    async def client(address: str) -> list[float]:
        with anyio.fail_after(RTT_TIMEOUT):  # around the node too: its start and its close
            async with Node(transports=_tcp_options(True)) as node:
                return await _rpc_round_trips(node, address, iterations, warmup, method)

    with _Server(OURS_RPC) as server:
        return anyio.run(client, server.info["address"])


# -- rows ------------------------------------------------------------------------------------


def tcp_transport_error() -> str | None:
    """Why the ``tcp`` transport cannot be used here, or ``None`` if it resolves."""
    from swarmavg.errors import TransportNotFound
    from swarmavg.transport import resolve_transport

    try:
        resolve_transport("tcp")
    except (TransportNotFound, ImportError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _error_text(exc: BaseException) -> str:
    traceback.print_exception(exc, file=sys.stderr)
    return f"{type(exc).__name__}: {exc}"


def _size_label(nbytes: int) -> str:
    return f"{nbytes >> 30} GiB" if nbytes >= 1 << 30 else f"{nbytes >> 20} MiB"


def _max_mib(values: Iterable[int | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) / MiB if known else None


def _bulk_extras(runs: list[BulkRun]) -> dict[str, Any]:
    gb = runs[0].nbytes / GB
    return {
        "runs": len(runs),
        "transfer_bytes": runs[0].nbytes,
        "cpu_s_per_gb_client": statistics.median(r.client_cpu_s for r in runs) / gb,
        "cpu_s_per_gb_server": statistics.median(r.server_cpu_s for r in runs) / gb,
        "peak_rss_mib_client": max(r.client_peak_rss for r in runs) / MiB,
        "peak_rss_mib_server": max(r.server_peak_rss for r in runs) / MiB,
        "client_rss_reset": all(r.client_rss_reset for r in runs),
        "start_rss_mib_client": _max_mib(r.client_start_rss for r in runs),
        "start_rss_mib_server": _max_mib(r.server_start_rss for r in runs),
    }


def _bulk_rows(total: int, repeats: int, ours_error: str | None) -> list[dict[str, Any]]:
    label = f"tcp bulk {_size_label(total)}/1 MiB msgs"
    variants: dict[str, Callable[[int], BulkRun]] = {"ref": _ref_bulk}
    if ours_error is None:
        variants["encrypted"] = lambda n: _ours_bulk(n, encryption=True)
        variants["plain"] = lambda n: _ours_bulk(n, encryption=False)
    runs: dict[str, list[BulkRun]] = {name: [] for name in variants}
    errors: dict[str, str] = {}
    if ours_error is not None:
        errors = {"encrypted": ours_error, "plain": ours_error}
    warmup = min(total, 32 * MiB)
    order = list(variants)
    for repeat in range(-1, repeats):  # -1: the warm-up round, not recorded
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

    rows: list[dict[str, Any]] = []
    ref_name = "raw asyncio sockets, sock_sendall / sock_recv_into"
    ref_speed: float | None = None
    if "ref" in errors:
        rows.append({"name": f"{label}, reference A", "unit": "GB/s", "error": errors["ref"]})
    else:
        ref_speed = max(r.throughput for r in runs["ref"])
        rows.append(
            {
                "name": f"{label}, reference A",
                "unit": "GB/s",
                "ours": ref_speed / GB,
                **_bulk_extras(runs["ref"]),
            }
        )
    for name, minimum in (("encrypted", 0.6), ("plain", 0.8)):
        row: dict[str, Any] = {
            "name": f"{label}, ours {name}",
            "unit": "GB/s",
            "reference_name": f"reference A: {ref_name}",
            "target": f">= {minimum}x reference",
        }
        if name in errors:
            row.update(error=errors[name], ok=False)
        else:
            speed = max(r.throughput for r in runs[name])
            row.update(ours=speed / GB, **_bulk_extras(runs[name]))
            if ref_speed is not None:
                ratio = speed / ref_speed
                row.update(reference=ref_speed / GB, ratio=ratio, ok=ratio >= minimum)
        rows.append(row)
    return rows


def _rtt_rows(iterations: int, rounds: int, ours_error: str | None) -> list[dict[str, Any]]:
    """Round-trip rows; ``iterations`` reference samples in all, a quarter as many of each of
    ours (async and inline handler)."""
    per_round = max(1, iterations // rounds)
    warmup = max(100, per_round // 10)
    ref_samples: list[float] = []
    ours: dict[str, list[float]] = {"echo": [], "echo_inline": []}
    ref_error: str | None = None
    errors: dict[str, str | None] = {name: ours_error for name in ours}

    def sample(fn: Callable[[], list[float]], out: list[float]) -> str | None:
        try:
            out += fn()
        except Exception as exc:
            return _error_text(exc)
        return None

    order = ["ref", *ours]
    for _ in range(rounds):
        for name in order:
            if name == "ref" and ref_error is None:
                ref_error = sample(partial(_ref_rtt, per_round, warmup), ref_samples)
            elif name != "ref" and errors[name] is None:
                errors[name] = sample(
                    partial(_ours_rtt, max(1, per_round // 4), warmup, name), ours[name]
                )
        order = order[1:] + order[:1]

    rows: list[dict[str, Any]] = []
    ref_name = "raw asyncio sockets ping-pong, sock_sendall / sock_recv_into, 64 B"
    ref_median: float | None = None
    ref_row: dict[str, Any] = {"name": "tcp round trip 64 B, reference B", "unit": "µs"}
    if ref_error:
        ref_row["error"] = ref_error
    else:
        ref_median, ref_p90 = _quantiles(ref_samples)
        ref_row.update(
            ours=ref_median * 1e6,
            p90=ref_p90 * 1e6,
            samples=len(ref_samples),
        )
    rows.append(ref_row)
    labels = {
        "echo": "tcp unary RPC echo(Ping), ours encrypted",
        "echo_inline": "tcp unary RPC echo(Ping), inline handler, ours encrypted",
    }
    for name, samples in ours.items():
        row: dict[str, Any] = {
            "name": labels[name],
            "unit": "µs",
            "reference_name": f"reference B: {ref_name}",
            "target": "<= 4x ref, <= 250 µs",
        }
        error = errors[name]
        if error:
            row.update(error=error, ok=False)
        else:
            median, p90 = _quantiles(samples)
            row.update(ours=median * 1e6, p90=p90 * 1e6, samples=len(samples))
            if ref_median is not None:
                ratio = median / ref_median
                row.update(
                    reference=ref_median * 1e6,
                    ratio=ratio,
                    ok=ratio <= 4.0 and median <= 250e-6,
                )
        rows.append(row)
    return rows


def measure(quick: bool) -> list[dict[str, Any]]:
    """The rows of this benchmark (see the module docstring); ``quick``: 256 MiB, fewer samples.

    Rows have the keys of ``benchmarks/transport.py`` (name, unit, ours, p90, reference,
    reference_name, ratio, target, ok); bulk rows add runs, transfer_bytes,
    cpu_s_per_gb_client/_server, peak_rss_mib_client/_server, start_rss_mib_client/_server (RSS
    before the transfer, ``None`` off Linux) and client_rss_reset; round-trip rows add samples.
    A row that could not be measured has ``error`` (and no ``ours``).
    """
    ours_error = tcp_transport_error()
    total = (256 if quick else 1024) * MiB
    with _pinned() as placement:
        rows = _bulk_rows(total, repeats=2 if quick else 3, ours_error=ours_error)
        # Our RPC samples are a quarter as many as the reference's: each is a whole call.
        rows += _rtt_rows(4000 if quick else 20000, rounds=2, ours_error=ours_error)
    for row in rows:
        row["placement"] = placement
    return rows


def format_extras(row: dict[str, Any]) -> str | None:
    """A footnote line with a row's CPU and memory figures or its error, if it has any."""
    if "error" in row:
        return f"  {row['name']}: not measured: {row['error']}"
    if "cpu_s_per_gb_client" not in row:
        return None
    note = "" if row.get("client_rss_reset", True) else " (client: lifetime peak)"
    return (
        f"  {row['name']}: CPU s/GB client {row['cpu_s_per_gb_client']:.3f}, "
        f"server {row['cpu_s_per_gb_server']:.3f}; peak RSS client "
        f"{_rss_text(row['peak_rss_mib_client'], row.get('start_rss_mib_client'))}, server "
        f"{_rss_text(row['peak_rss_mib_server'], row.get('start_rss_mib_server'))}{note}; "
        f"best of {row['runs']}"
    )


def _rss_text(peak: float, start: float | None) -> str:
    return f"{peak:.0f} MiB" + (f" ({start:.0f} before)" if start is not None else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB transfers, fewer samples")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--serve", choices=SERVE_MODES, help=argparse.SUPPRESS)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lifetime", type=float, default=SERVER_LIFETIME, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return _serve(args.serve, encryption=not args.plain, lifetime=args.lifetime)
    rows = measure(args.quick)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        if "ours" in row:
            ratio = f"  {row['ratio']:.2f}x ref" if "ratio" in row else ""
            p90 = f" (p90 {row['p90']:.1f})" if "p90" in row else ""
            print(f"{row['name']:48} {row['ours']:9.2f} {row['unit']}{p90}{ratio}")
        extras = format_extras(row)
        if extras:
            print(extras)
    return 0


if __name__ == "__main__":
    sys.exit(main())
