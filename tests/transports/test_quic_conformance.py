from __future__ import annotations

import pytest

from swarmavg.testing import TRANSPORT_CHECKS, run_transport_check
from swarmavg_quic import QuicTransport

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("check", list(TRANSPORT_CHECKS))
async def test_conformance(check: str) -> None:
    await run_transport_check(check, QuicTransport, "quic://127.0.0.1:0")


@pytest.mark.parametrize("check", ["stream_both_ways", "large_message", "many_concurrent_streams"])
async def test_conformance_ipv6(check: str) -> None:
    await run_transport_check(check, QuicTransport, "quic://[::1]:0")
