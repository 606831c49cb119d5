"""The bulk-transfer reference of ``benchmarks/averaging.py --state``: ``total`` bytes over one
plain asyncio TCP connection on 127.0.0.1 between two processes (this one sends, a "spawn"
child receives), in 1 MiB writes from one buffer, timed from the connection made to the
receiver's one-byte acknowledgement after the last byte. No framing, no encryption, no
checksum: what loopback TCP through asyncio streams gives."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from multiprocessing.connection import Connection

CHUNK = 1 << 20
TIMEOUT = 120.0


def receiver_main(conn: Connection, total: int) -> None:
    """The child: listens on a free port (sent over ``conn``), reads ``total`` bytes from one
    connection, acknowledges, exits."""

    async def serve() -> None:
        done = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            left = total
            while left > 0:
                data = await reader.read(min(left, 4 * CHUNK))
                if not data:
                    break
                left -= len(data)
            writer.write(b"k")
            await writer.drain()
            writer.close()
            done.set()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        conn.send(server.sockets[0].getsockname()[1])
        await asyncio.wait_for(done.wait(), TIMEOUT)
        server.close()

    try:
        asyncio.run(serve())
    finally:
        conn.close()


async def _send(port: int, total: int) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    buffer = memoryview(bytearray(CHUNK))
    start = time.perf_counter()
    left = total
    while left > 0:
        n = min(left, CHUNK)
        writer.write(buffer[:n])
        await writer.drain()
        left -= n
    ack = await reader.readexactly(1)
    elapsed = time.perf_counter() - start
    assert ack == b"k"
    writer.close()
    return elapsed


def measure(total: int) -> float:
    """Seconds to move ``total`` bytes to another process over loopback TCP (see the doc)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(child, total), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(60.0):
            raise TimeoutError("the receiver did not start")
        port = parent.recv()
        return asyncio.run(asyncio.wait_for(_send(port, total), TIMEOUT))
    finally:
        proc.join(10.0)
        if proc.is_alive():
            proc.kill()
            proc.join(10.0)
        parent.close()
