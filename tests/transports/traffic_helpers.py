"""What the transports' ``traffic()`` tests share (not a test module)."""

from __future__ import annotations

import anyio

from swarmavg.abc import Connection


async def exchange_and_count(
    dialed: Connection, accepted: Connection, size: int, reply: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Send ``size`` bytes from ``dialed`` to ``accepted`` and ``reply`` bytes back; return
    what each end's ``traffic()`` counted meanwhile: ``(sent, received)`` at ``dialed``, then
    at ``accepted`` (both ends must count)."""
    before = dialed.traffic(), accepted.traffic()
    assert before[0] is not None
    assert before[1] is not None
    with anyio.fail_after(30):
        stream = await dialed.open_stream()
        await stream.send(bytes(size))
        served = await accepted.accept_stream()
        assert len(await served.receive()) == size
        await served.send(b"y" * reply)
        assert len(await stream.receive()) == reply
        await anyio.sleep(0.05)  # (the last acknowledgements)
    after = dialed.traffic(), accepted.traffic()
    assert after[0] is not None
    assert after[1] is not None
    return (
        (after[0][0] - before[0][0], after[0][1] - before[0][1]),
        (after[1][0] - before[1][0], after[1][1] - before[1][1]),
    )
