"""Code that runs in raw event-loop callbacks (the TCP reader, QUIC's scheduled pump, the
stream callbacks and inline handlers they call) calls no anyio function that needs a task.

anyio < 4.16 (``anyio>=4.11`` is allowed) cannot tell the async library outside a task unless
the loop was started by ``anyio.run``: ``anyio.current_time()``, ``anyio.Event()`` or
``anyio.CancelScope()`` raise there. So these tests run their nodes under a plain
``asyncio.run`` (as an asyncio application, or a task started from another context, does), and
fail on any ERROR log (a transport logs what its callback raised) or a call that was not
answered inline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest

from swarmavg import get_dht_time
from swarmavg.aio import DHT
from swarmavg.aio.node import Node
from swarmavg.aio.rpc import CallContext
from swarmavg.identity import PeerID
from swarmavg.proto import Ping, Pong

#: (real TCP and QUIC sockets, under asyncio's own loop)
pytestmark = pytest.mark.realtime


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def _count_inline(node: Node) -> list[bool]:
    """What ``node``'s RPC layer answered from its transport's reader: one entry per call
    offered to it (``True``: answered there)."""
    served: list[bool] = []
    serve_inline: Callable[..., bool] = node.rpc.serve_inline

    def counting(*args: Any) -> bool:
        served.append(serve_inline(*args))
        return served[-1]

    node.rpc.serve_inline = counting  # type: ignore[method-assign]
    return served


@pytest.mark.parametrize("scheme", ["tcp", "quic"])
def test_inline_calls_under_plain_asyncio(scheme: str, caplog: pytest.LogCaptureFixture) -> None:
    tasks: list[asyncio.Task[Any] | None] = []

    def pong(request: Ping, ctx: CallContext) -> Pong:
        tasks.append(asyncio.current_task())
        assert ctx.deadline > 0
        return Pong(request.nonce)

    async def main() -> list[bool]:
        async with Node(listen=[f"{scheme}://127.0.0.1:0"]) as server, Node() as client:
            server.rpc.register("ping", pong, request_type=Ping, inline=True)
            served = _count_inline(server)
            address = server.addresses[0]
            for i in range(20):
                assert await client.rpc.call(address, "ping", Ping(i), timeout=5) == Pong(i)
            return served

    served = asyncio.run(asyncio.wait_for(main(), 30))
    assert _errors(caplog) == []
    assert len(tasks) == 20
    if scheme == "tcp":  # (QUIC serves no call inline: its callbacks still must not fail)
        assert served[1:] == [True] * (len(served) - 1)  # (the first may race the adoption)
        assert len(served) >= 19
        assert tasks[1:] == [None] * 19, "the calls should be answered from the TCP reader"


def test_dht_calls_over_tcp_under_plain_asyncio(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> list[bool]:
        async with DHT(transport="tcp") as first:
            served = _count_inline(first.node)
            peers = [str(a) for a in first.visible_addresses()]
            async with DHT(peers, transport="tcp") as second:
                for i in range(5):
                    assert await second.store(f"key{i}", i, get_dht_time() + 60)
                for i in range(5):
                    found = await second.get(f"key{i}", latest=True)
                    assert found is not None
                    assert found.value == i
                assert isinstance(second.peer_id, PeerID)
            return served

    served = asyncio.run(asyncio.wait_for(main(), 30))
    assert _errors(caplog) == []
    assert served.count(True) >= 10  # the stores and gets (and the bootstrap's ping and find)
    assert False not in served[1:]
