"""The anyio tests of this folder run on virtual time (:class:`swarmavg.testing.VirtualClockLoop`):
timeouts and sleeps cost no wall time, and a test sees the exact second a timeout fires
(``anyio.current_time()``). A test marked ``realtime`` (real sockets, threads that wait on the
wall clock) gets asyncio's own loop instead."""

from __future__ import annotations

from typing import Any

import pytest

from swarmavg.testing import VirtualClockLoop


def _virtual_clock_loop() -> VirtualClockLoop:
    # (its clock also stands still while anyio.to_thread work runs, as under run_on_virtual_time)
    return VirtualClockLoop(watch_default_thread_limiter=True)


@pytest.fixture
def anyio_backend(request: pytest.FixtureRequest) -> str | tuple[str, dict[str, Any]]:
    if request.node.get_closest_marker("realtime") is not None:
        return "asyncio"
    return ("asyncio", {"loop_factory": _virtual_clock_loop})
