"""The ``swarmavg`` command line.

``swarmavg demo`` starts two nodes in this process, connected over the in-process memory
transport, exchanges a few messages between them and measures a bulk transfer. Later releases
make it the averaging demo.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

import anyio

from swarmavg import __version__
from swarmavg.abc import Stream
from swarmavg.aio.node import Node
from swarmavg.testing import MemoryNetwork

__all__ = ["main"]


async def _serve(stream: Stream) -> None:
    """Answer every message with its length and a greeting; count bulk bytes until EOF."""
    async for msg in stream:
        await stream.send(f"got {len(msg)} bytes".encode())


async def _demo(megabytes: int) -> None:
    network = MemoryNetwork()
    options = {"memory": {"network": network}}
    async with (
        Node(listen=["memory://local:0"], transports=options, stream_handler=_serve) as alice,
        Node(listen=["memory://local:0"], transports=options) as bob,
    ):
        print(f"alice: {alice.addresses[0]}")
        print(f"bob:   {bob.addresses[0]}")
        conn = await bob.connect(alice.addresses[0])
        print(f"bob connected to {conn.peer_id} (identity checked against the address)")
        stream = await conn.open_stream()
        for text in ("hello alice", "how big is this?"):
            start = time.perf_counter()
            await stream.send(text.encode())
            reply = bytes(await stream.receive()).decode()
            rtt_us = (time.perf_counter() - start) * 1e6
            print(f"bob -> alice: {text!r:20} alice -> bob: {reply!r}  ({rtt_us:.0f} µs)")
        await stream.aclose()

        bulk = await conn.open_stream()
        chunk = memoryview(bytearray(1 << 20))  # mutable: the transport copies it
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:

            async def drain() -> None:
                async for _ in bulk:
                    pass

            tg.start_soon(drain)
            for _ in range(megabytes):
                await bulk.send(chunk)
            await bulk.send_eof()
        elapsed = time.perf_counter() - start
        print(f"bulk: {megabytes} MiB in {elapsed:.3f} s = {megabytes / 1024 / elapsed:.2f} GiB/s")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``swarmavg`` command."""
    parser = argparse.ArgumentParser(prog="swarmavg", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"swarmavg {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="two in-process nodes exchanging messages")
    demo.add_argument("--megabytes", type=int, default=512, help="size of the bulk transfer")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "demo":
        if args.megabytes < 1:
            parser.error("--megabytes must be at least 1")
        try:
            anyio.run(_demo, args.megabytes)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
