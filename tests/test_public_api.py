from __future__ import annotations

import importlib
import inspect
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


def test_the_sync_averager_takes_the_async_averagers_keywords() -> None:
    """``swarmavg.DecentralizedAverager`` spells out the keyword arguments of
    ``swarmavg.aio.DecentralizedAverager`` (``help()`` shows them): the same names, defaults
    and annotations, plus its own, so the two cannot drift apart."""
    from swarmavg.aio import DecentralizedAverager as AsyncAverager

    def keywords(cls: type) -> dict[str, tuple[object, object]]:
        parameters = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
        assert not [p for p in parameters if p.kind is p.VAR_KEYWORD], cls
        return {
            p.name: (p.default, str(p.annotation)) for p in parameters if p.kind is p.KEYWORD_ONLY
        }

    sync_only = {"start", "daemon", "shutdown_timeout", "metrics_port", "metrics_host"}
    sync = keywords(swarmavg.DecentralizedAverager)
    async_ = keywords(AsyncAverager)
    assert sync_only <= set(sync)
    assert {name: value for name, value in sync.items() if name not in sync_only} == async_
