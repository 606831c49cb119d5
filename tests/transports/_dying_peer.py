"""The peer process of ``test_peer_death.py`` (not a test module).

``python _dying_peer.py ADDRESS MODE`` dials ADDRESS (its scheme picks the transport, default
options), opens a stream, sends ``hello`` on it, prints ``ready`` on stdout, waits for one
message on the stream (so that its own writes have gone out), then, by MODE:

- ``idle``: keeps the connection and the stream open, reads nothing; its event loop runs (it
  answers pings and acknowledges data);
- ``frozen``: blocks its event loop (``time.sleep``): it reads, acknowledges and answers
  nothing, as a peer stalled by a long computation.

The test then kills it with SIGKILL. It exits by itself after ``LIFETIME`` seconds.
"""

from __future__ import annotations

import sys
import time

import anyio

from swarmavg.address import Address
from swarmavg.identity import Identity
from swarmavg.transport import resolve_transport

LIFETIME = 60.0


async def main(address: str, mode: str) -> None:
    target = Address.parse(address)
    transport_class = resolve_transport(target.scheme)
    async with transport_class(Identity.generate()) as transport:
        conn = await transport.connect(target)
        stream = await conn.open_stream()
        await stream.send(b"hello")
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        await stream.receive()
        if mode == "frozen":
            time.sleep(LIFETIME)  # noqa: ASYNC251 (blocking the event loop is the point)
        else:
            await anyio.sleep(LIFETIME)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in ("idle", "frozen"):
        sys.exit("usage: _dying_peer.py ADDRESS idle|frozen")
    anyio.run(main, sys.argv[1], sys.argv[2])
