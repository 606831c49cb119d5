"""Transport and runtime benchmarks, each printed beside a reference measured in the same run.

    python benchmarks/transport.py [--quick] [--json results.json] [--no-tcp] [--no-quic]
    python benchmarks/transport.py --quic-only [--quick] [--json results.json]

Rows:
- memory bulk: one stream of the in-process MemoryTransport, 1 MiB messages from a mutable buffer
  (so the transport copies each once), beside a plain ``bytes(buffer)`` copy loop of the same
  size (the cost of that one copy alone). Target: >= 2 GB/s.
- memory unary round trip: a 64-byte message there and back over one stream.
- sync handle no-op: one call through swarmavg's event-loop thread, beside a plain
  ``asyncio.run_coroutine_threadsafe(...).result()`` on a bare loop thread. Target: <= 2x.
- tcp (unless ``--no-tcp``; see ``_tcp_bench.py``): two processes on loopback. Bulk 1 GiB in
  1 MiB messages over raw asyncio sockets (reference A) and over our TCP transport, encrypted
  (target >= 0.6x A) and plain (>= 0.8x A), with CPU s/GB and peak RSS of each side as footnotes;
  a 64-byte raw asyncio ping-pong (reference B) and a unary RPC over our encrypted transport,
  with an async handler and with an inline one (target <= 4x B and <= 250 µs). Client and
  server are pinned to two different CPUs where Linux allows. Rows that could not be measured
  carry an ``error``.
- quic (unless ``--no-quic``; see ``_quic_bench.py``): two processes on loopback, pinned the
  same way. Bulk in 1 MiB messages on one stream of our QUIC transport beside a plain aioquic
  client/server pair with the same datagram size, windows (16 MiB stream, 64 MiB connection),
  4 MiB socket buffers and reno: at 1200 B (128 MiB) and 9000 B (512 MiB), target >= 0.9x the
  reference; at the size ours picks from the route's MTU (16383 B on loopback, 1 GiB), target
  >= 100 MB/s (the plain aioquic figure beside it is for information). CPU s/GB and peak RSS of
  each side as footnotes, and a row for how far each side's peak RSS rose above its RSS before
  that 1 GiB transfer (target <= 200 MB). A unary RPC over QUIC beside the same over our
  encrypted TCP in the same run: median <= 4x TCP's. ``--quick`` sends 32, 64 and 256 MiB.
  ``--quic-only`` prints these rows alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from swarmavg.identity import Identity
from swarmavg.testing import MemoryNetwork, MemoryTransport

MiB = 1 << 20


async def _memory_pair() -> tuple[Any, Any, Any, Any]:
    network = MemoryNetwork()
    a = MemoryTransport(Identity.generate(), network=network)
    b = MemoryTransport(Identity.generate(), network=network)
    listener = await b.listen("memory://local:0")
    conn = await a.connect(listener.address)
    peer = await listener.accept()
    return a, b, conn, peer


async def _memory_bulk(total_bytes: int, chunk: int) -> float:
    a, b, conn, peer = await _memory_pair()
    buf = memoryview(bytearray(chunk))
    stream = await conn.open_stream()
    await stream.send(b"start")
    remote = await peer.accept_stream()
    await remote.receive()
    received = 0

    async def drain() -> None:
        nonlocal received
        async for msg in remote:
            received += len(msg)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(drain)
        for _ in range(total_bytes // chunk):
            await stream.send(buf)
        await stream.send_eof()
    elapsed = time.perf_counter() - start
    assert received == total_bytes
    await a.aclose()
    await b.aclose()
    return total_bytes / elapsed


def _copy_reference(total_bytes: int, chunk: int) -> float:
    buf = memoryview(bytearray(chunk))
    start = time.perf_counter()
    for _ in range(total_bytes // chunk):
        bytes(buf)
    return total_bytes / (time.perf_counter() - start)


async def _memory_rtt(iterations: int) -> list[float]:
    a, b, conn, peer = await _memory_pair()
    stream = await conn.open_stream()
    await stream.send(b"start")
    remote = await peer.accept_stream()
    await remote.receive()
    payload = bytes(64)
    samples = []

    async def echo() -> None:
        async for msg in remote:
            await remote.send(msg)

    async with anyio.create_task_group() as tg:
        tg.start_soon(echo)
        for _ in range(iterations):
            start = time.perf_counter()
            await stream.send(payload)
            await stream.receive()
            samples.append(time.perf_counter() - start)
        await stream.send_eof()
    await a.aclose()
    await b.aclose()
    return samples


def _quantiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return statistics.median(samples), samples[int(0.9 * (len(samples) - 1))]


def run(quick: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    total = (256 if quick else 1024) * MiB
    repeats = 3
    ours = max(anyio.run(_memory_bulk, total, MiB) for _ in range(repeats))
    ref = max(_copy_reference(total, MiB) for _ in range(repeats))
    rows.append(
        {
            "name": "memory bulk stream, 1 MiB messages",
            "unit": "GB/s",
            "ours": ours / 1e9,
            "reference": ref / 1e9,
            "reference_name": "bytes() copy of the same data",
            "ratio": ours / ref,
            "target": ">= 2 GB/s",
            "ok": ours >= 2e9,
        }
    )
    samples = anyio.run(_memory_rtt, 2000 if quick else 10000)
    median, p90 = _quantiles(samples)
    rows.append(
        {
            "name": "memory unary round trip, 64 B",
            "unit": "µs",
            "ours": median * 1e6,
            "p90": p90 * 1e6,
        }
    )
    try:
        from _sync_handle import measure
    except ImportError:  # the sync runtime benchmark is optional while it is being built
        return rows
    sync_rows = measure(2000 if quick else 10000)
    references = {
        str(r["name"]).rsplit("[", 1)[1]: r for r in sync_rows if "reference" in str(r["name"])
    }
    for row in sync_rows:
        name = str(row["name"])
        if not name.startswith("sync "):
            continue
        ref_row = references[name.rsplit("[", 1)[1]]
        ratio = float(row["median_us"]) / float(ref_row["median_us"])
        rows.append(
            {
                "name": name.replace("sync no-op ", "sync handle no-op "),
                "unit": "µs",
                "ours": row["median_us"],
                "p90": row.get("p90_us"),
                "reference": ref_row["median_us"],
                "reference_name": "asyncio.run_coroutine_threadsafe round trip, same placement",
                "ratio": ratio,
                "target": "<= 2x reference",
                "ok": ratio <= 2.0,
            }
        )
    return rows


def _tcp_rows(quick: bool) -> list[dict[str, Any]]:
    from _tcp_bench import measure

    return measure(quick)


def _quic_rows(quick: bool) -> list[dict[str, Any]]:
    try:
        from _quic_bench import measure
    except ImportError as exc:
        return [{"name": "quic rows", "unit": "", "error": f"{type(exc).__name__}: {exc}"}]
    return measure(quick)


def _footnote(row: dict[str, Any]) -> str | None:
    """A row's error, or its CPU and memory figures, if it has any."""
    if "error" in row:
        return f"  {row['name']!r} not measured: {row['error']}"
    if "rss_growth_mb_client" in row:
        return (
            f"  {row['name']!r}: peak RSS above the RSS before the transfer: client "
            f"{row['rss_growth_mb_client']:.0f} MB, server {row['rss_growth_mb_server']:.0f} MB"
        )
    if "cpu_s_per_gb_client" not in row:
        return None
    lifetime = "" if row.get("client_rss_reset", True) else " (client: process lifetime peak)"

    def rss(side: str) -> str:
        start = row.get(f"start_rss_mib_{side}")
        before = f" ({start:.0f} before)" if start is not None else ""
        return f"{row[f'peak_rss_mib_{side}']:.0f} MiB{before}"

    return (
        f"  {row['name']!r}: CPU s/GB client {row['cpu_s_per_gb_client']:.3f}, "
        f"server {row['cpu_s_per_gb_server']:.3f}; peak RSS client {rss('client')}, "
        f"server {rss('server')}{lifetime}"
    )


def _print_table(rows: list[dict[str, Any]]) -> None:
    width = max([52, *(len(str(row["name"])) for row in rows)])
    header = f"{'benchmark':{width}} {'ours':>10} {'reference':>10} {'ratio':>7}  {'target':20} ok"
    print(header)
    print("-" * len(header))
    for row in rows:
        ref, ratio = row.get("reference"), row.get("ratio")
        ref_text = f"{ref:.2f}" if ref is not None else ""
        ratio_text = f"{ratio:.2f}x" if ratio is not None else ""
        ok = "" if "ok" not in row else ("yes" if row["ok"] else "NO")
        ours = f"{row['ours']:.2f} {row['unit']}" if "ours" in row else "error"
        print(
            f"{row['name']:{width}} {ours:>10} {ref_text:>10} {ratio_text:>7}  "
            f"{row.get('target', ''):20} {ok}"
        )
    for row in rows:
        if "reference_name" in row:
            print(f"  reference for {row['name']!r}: {row['reference_name']}")
    for row in rows:
        note = _footnote(row)
        if note:
            print(note)
    placements = sorted({row["placement"] for row in rows if "placement" in row})
    for placement in placements:
        print(f"  tcp and quic rows, both ours and the references: {placement}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller transfers, fewer samples")
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    parser.add_argument(
        "--tcp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the two-process loopback TCP rows (default: on)",
    )
    parser.add_argument(
        "--quic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the two-process loopback QUIC rows (default: on)",
    )
    parser.add_argument("--quic-only", action="store_true", help="only the QUIC rows")
    args = parser.parse_args()
    rows = [] if args.quic_only else run(args.quick)
    if args.tcp and not args.quic_only:
        rows += _tcp_rows(args.quick)
    if args.quic or args.quic_only:
        rows += _quic_rows(args.quick)
    _print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
