"""A peer process killed with SIGKILL: every operation pending on its connection fails at once.

The peer (``_dying_peer.py``, a real process on loopback) dials us, opens a stream and sends on
it, then is killed while we wait on that connection: in ``receive()`` on its stream, in a
``send()`` it does not read, or in ``accept_stream()``. Each must raise a
:class:`~swarmavg.errors.TransportError` within seconds: TCP learns it from the kernel (FIN or
RST), QUIC from the ICMP port-unreachable that answers our next packet (a PING to a peer quiet
for a second while streams are open, or the data we send), confirmed by an unanswered probe.
Before, QUIC waited for its idle timeout (45 s) and a cancelled QUIC send for write_timeout.
"""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from swarmavg.abc import Connection, Stream
from swarmavg.errors import TransportError
from swarmavg.identity import Identity
from swarmavg.transport import resolve_transport

pytestmark = [pytest.mark.process, pytest.mark.anyio]

PEER = Path(__file__).with_name("_dying_peer.py")
#: An operation pending on the dead peer's connection must fail within this many seconds of
#: the kill (typically: TCP milliseconds, QUIC about 1.5 s; before the fix, QUIC 45-60 s).
NOTICED_WITHIN = 5.0
TRANSPORTS = pytest.mark.parametrize("scheme", ["tcp", "quic"])


@asynccontextmanager
async def _peer(
    scheme: str, mode: str
) -> AsyncIterator[tuple[anyio.abc.Process, Connection, Stream]]:
    """Our transport listening, the peer process connected to it in ``mode``, its connection
    and its stream (whose ``hello`` we have read, and answered: the peer then enters
    ``mode``)."""
    async with resolve_transport(scheme)(Identity.generate()) as transport:
        listener = await transport.listen(f"{scheme}://127.0.0.1:0")
        process = await anyio.open_process(
            [sys.executable, str(PEER), str(listener.address), mode], stderr=None
        )
        try:
            assert process.stdout is not None
            with anyio.fail_after(30):
                line = await BufferedByteReceiveStream(process.stdout).receive_until(b"\n", 64)
                assert line == b"ready"
                conn = await listener.accept()
                stream = await conn.accept_stream()
                assert bytes(await stream.receive()) == b"hello"
                await stream.send(b"go")
            yield process, conn, stream
        finally:
            if process.returncode is None:
                process.kill()
            with anyio.CancelScope(shield=True):
                await process.wait()
                await process.aclose()


async def _kill_while(
    process: anyio.abc.Process, operation: Callable[[], Awaitable[object]]
) -> tuple[BaseException | None, float]:
    """Start ``operation``, kill the peer once it is under way; what it raised and how many
    seconds after the kill."""
    outcome: list[BaseException | None] = []
    started = anyio.Event()
    killed_at = 0.0

    async def run() -> None:
        started.set()
        try:
            await operation()
        except Exception as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    with anyio.fail_after(NOTICED_WITHIN + 30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await started.wait()
            await anyio.wait_all_tasks_blocked()
            assert not outcome, f"the operation ended before the kill: {outcome}"
            killed_at = time.monotonic()
            process.kill()
    return outcome[0], time.monotonic() - killed_at


def _check(outcome: BaseException | None, after: float) -> None:
    assert isinstance(outcome, TransportError), f"expected a TransportError, got {outcome!r}"
    assert after < NOTICED_WITHIN, f"the death was noticed after {after:.1f} s ({outcome!r})"


@TRANSPORTS
async def test_a_pending_receive_fails_when_the_peer_is_killed(scheme: str) -> None:
    async with _peer(scheme, "idle") as (process, _, stream):
        outcome, after = await _kill_while(process, stream.receive)
    _check(outcome, after)


@TRANSPORTS
async def test_a_pending_accept_stream_fails_when_the_peer_is_killed(scheme: str) -> None:
    async with _peer(scheme, "idle") as (process, conn, _):
        outcome, after = await _kill_while(process, conn.accept_stream)
    _check(outcome, after)


@TRANSPORTS
async def test_a_blocked_send_fails_when_the_peer_is_killed(scheme: str) -> None:
    """The peer's event loop runs but it reads nothing: the first message (larger than the
    windows) still arrives (a receiver takes one incomplete message past its windows), the
    second cannot."""
    async with _peer(scheme, "idle") as (process, _, stream):
        payload = bytes(24 << 20)

        async def send_until_blocked() -> None:
            for _ in range(8):  # (at most 2 fit)
                await stream.send(payload)

        outcome, after = await _kill_while(process, send_until_blocked)
    _check(outcome, after)


@TRANSPORTS
async def test_a_send_to_a_stalled_peer_fails_when_it_is_killed(scheme: str) -> None:
    """The peer's event loop is blocked (it reads and acknowledges nothing), then it dies: our
    send, stuck on the socket (TCP) or on acknowledgements (QUIC), fails."""
    async with _peer(scheme, "frozen") as (process, _, stream):
        outcome, after = await _kill_while(process, lambda: stream.send(bytes(24 << 20)))
    _check(outcome, after)
