from __future__ import annotations

import pytest

from swarmavg.testing import TRANSPORT_CHECKS, run_transport_check
from swarmavg_tcp import TcpTransport

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("encryption", [True, False], ids=["encrypted", "plaintext"])
@pytest.mark.parametrize("check", list(TRANSPORT_CHECKS))
async def test_conformance(check: str, encryption: bool) -> None:
    await run_transport_check(
        check, lambda ident: TcpTransport(ident, encryption=encryption), "tcp://127.0.0.1:0"
    )


@pytest.mark.parametrize("check", ["stream_both_ways", "large_message", "many_concurrent_streams"])
async def test_conformance_ipv6(check: str) -> None:
    await run_transport_check(check, TcpTransport, "tcp://[::1]:0")
