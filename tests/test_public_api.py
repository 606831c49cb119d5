from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import swarmavg
from swarmavg.errors import SwarmError, TransportNotFound
from swarmavg.testing import MemoryTransport


@pytest.mark.parametrize(
    "module",
    [
        "swarmavg",
        "swarmavg.abc",
        "swarmavg.testing",
        "swarmavg.proto",
        "swarmavg.sync",
        "swarmavg.optim",
        "swarmavg.metrics",
        "swarmavg_tcp",
    ],
)
def test_all_is_curated(module: str) -> None:
    mod = importlib.import_module(module)
    names = mod.__all__
    assert len(names) == len(set(names)), "duplicates in __all__"
    for name in names:
        assert hasattr(mod, name), f"{module}.__all__ names missing {name}"


@pytest.mark.process
def test_import_does_not_pull_torch_or_transports() -> None:
    code = (
        "import sys, swarmavg, swarmavg.proto, swarmavg.sync, swarmavg.testing, swarmavg.aio.node\n"
        "heavy = [m for m in ('torch', 'aioquic', 'swarmavg_tcp', 'swarmavg_quic') "
        "if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_resolve_transport_by_name() -> None:
    assert swarmavg.resolve_transport("memory") is MemoryTransport
    assert "memory" in swarmavg.available_transports()


def test_missing_transport_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from swarmavg import transport

    monkeypatch.setitem(transport.SHIPPED, "pigeonmail", "swarmavg[pigeonmail]")  # type: ignore[index]
    with pytest.raises(TransportNotFound, match=r'pip install "swarmavg\[pigeonmail\]"'):
        swarmavg.resolve_transport("pigeonmail")
    with pytest.raises(TransportNotFound, match="entry-point group"):
        swarmavg.resolve_transport("carrier-pigeon")
    with pytest.raises(TypeError, match="transport name"):
        swarmavg.resolve_transport(3)  # type: ignore[arg-type]
    assert issubclass(TransportNotFound, SwarmError)
