"""Starting and stopping a Node or a ``swarmavg.aio.DHT`` fails with the exception that says
why (a :class:`~swarmavg.SwarmError` that ``except swarmavg.SwarmError`` catches), never with
the ExceptionGroup of a task group inside."""

from __future__ import annotations

import errno
import importlib
import socket
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from unittest import mock

import anyio
import pytest

import swarmavg
from swarmavg import AddressInUse, SwarmError, TransportError, TransportNotFound
from swarmavg import transport as transport_module
from swarmavg.aio import DHT
from swarmavg.aio.node import Node
from swarmavg.errors import ConnectError

pytestmark = pytest.mark.anyio


@pytest.fixture
def busy_port(request: pytest.FixtureRequest) -> Iterator[tuple[str, int]]:
    """A loopback port another socket holds: TCP (listening) or UDP, as the scheme needs."""
    scheme = request.param
    kind = socket.SOCK_STREAM if scheme == "tcp" else socket.SOCK_DGRAM
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        if kind == socket.SOCK_STREAM:
            sock.listen()
        yield scheme, sock.getsockname()[1]


def _assert_address_in_use(exc: BaseException, port: int) -> None:
    assert isinstance(exc, AddressInUse)
    assert isinstance(exc, TransportError)
    assert str(port) in str(exc)
    assert isinstance(exc.__cause__, OSError)
    assert exc.__cause__.errno == errno.EADDRINUSE


@pytest.mark.realtime  # (real ports)
@pytest.mark.parametrize("busy_port", ["tcp", "quic"], indirect=True)
async def test_a_port_in_use_raises_address_in_use(busy_port: tuple[str, int]) -> None:
    scheme, port = busy_port
    with pytest.raises(SwarmError) as caught:
        async with Node(listen=[f"{scheme}://127.0.0.1:{port}"]):
            pass
    _assert_address_in_use(caught.value, port)
    with pytest.raises(SwarmError) as caught:
        async with DHT(transport=scheme, port=port):
            pass
    _assert_address_in_use(caught.value, port)


async def test_a_failed_start_leaves_the_node_closed() -> None:
    node = Node(listen=["pigeon://127.0.0.1:0"])
    with pytest.raises(TransportNotFound):
        await node.__aenter__()
    assert not node.is_running
    with pytest.raises(RuntimeError, match="started once"):
        await node.__aenter__()


async def test_an_unknown_transport_name_raises_transport_not_found() -> None:
    with pytest.raises(TransportNotFound, match="no transport named 'pigeon'"):
        async with Node(listen=["pigeon://127.0.0.1:0"]):
            pass
    with pytest.raises(TransportNotFound, match="no transport named 'pigeon'"):
        async with DHT(transport="pigeon"):
            pass
    async with Node() as node:  # dialing resolves it too
        with pytest.raises(TransportNotFound, match="pigeon"):
            await node.connect("pigeon://127.0.0.1:1", allow_unknown_peer=True)


@pytest.fixture
def entry_points(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The ``swarmavg.transports`` entry points as this test sets them (name -> target); the
    others are hidden."""
    registered: dict[str, str] = {}

    def fake(*, group: str, name: str | None = None) -> list[EntryPoint]:
        assert group == transport_module.ENTRY_POINT_GROUP
        return [
            EntryPoint(ep_name, target, group)
            for ep_name, target in registered.items()
            if name is None or ep_name == name
        ]

    monkeypatch.setattr(transport_module, "entry_points", fake)
    transport_module.resolve_transport.cache_clear()
    yield registered
    transport_module.resolve_transport.cache_clear()


async def test_quic_not_installed_says_what_to_install(entry_points: dict[str, str]) -> None:
    """swarmavg's metadata lost its ``quic`` entry point (a broken install), or the quic extra
    (aioquic) is not installed: the message says what to install."""
    entry_points["tcp"] = "swarmavg_tcp:TcpTransport"
    with pytest.raises(TransportNotFound, match=r'pip install "swarmavg\[quic\]"') as caught:
        async with DHT(transport="quic"):
            pass
    assert "available: memory, tcp" in str(caught.value)
    with pytest.raises(TransportNotFound, match=r'pip install "swarmavg\[quic\]"'):
        async with Node(listen=["quic://127.0.0.1:0"]):
            pass
    transport_module.resolve_transport.cache_clear()
    entry_points["quic"] = "swarmavg_quic:QuicTransport"
    real_import = importlib.import_module

    def without_aioquic(name: str, package: str | None = None) -> object:
        if name == "swarmavg_quic":
            raise ModuleNotFoundError("No module named 'aioquic'", name="aioquic")
        return real_import(name, package)

    with (
        mock.patch.object(transport_module.importlib, "import_module", without_aioquic),
        pytest.raises(
            TransportNotFound, match=r'install it with `pip install "swarmavg\[quic\]"`'
        ) as caught,
    ):
        async with DHT(transport="quic"):
            pass
    assert "force-reinstall" not in str(caught.value)


async def test_a_registered_transport_that_cannot_be_imported(
    entry_points: dict[str, str],
) -> None:
    """A broken install: the entry point names a module that does not exist."""
    entry_points["quic"] = "swarmavg_quic_not_there:QuicTransport"
    entry_points["pigeon"] = "swarmavg:Address"  # (importable, but no transport)
    with pytest.raises(TransportNotFound, match="cannot be loaded") as caught:
        async with DHT(transport="quic"):
            pass
    assert 'pip install --force-reinstall "swarmavg[quic]"' in str(caught.value)
    assert isinstance(caught.value.__cause__, ImportError)
    with pytest.raises(TransportNotFound, match="not a Transport subclass"):
        async with Node(listen=["pigeon://127.0.0.1:0"]):
            pass


async def test_the_callers_own_exception_leaves_the_node_as_it_is() -> None:
    cause = OSError("the cause")
    with pytest.raises(ConnectError) as caught:
        async with Node(listen=["memory://a:0"]):
            raise ConnectError("the caller's own") from cause
    assert caught.value.__cause__ is cause  # (not replaced on the way out)
    with pytest.raises(ExceptionGroup) as group:
        async with Node(listen=["memory://a:0"]):
            raise ExceptionGroup("the caller's own group", [KeyError(1), KeyError(2)])
    assert group.value.message == "the caller's own group"  # whole, not split up
    with pytest.raises(ValueError, match="plain"):
        async with DHT(transport="memory"):
            raise ValueError("plain")


async def test_a_failure_beside_the_callers_is_noted_on_it() -> None:
    from swarmavg._groups import sole_error

    mine, other = KeyError("mine"), RuntimeError("a task of the node failed")
    assert sole_error(ExceptionGroup("", [other, mine]), mine) is mine
    assert "a task of the node failed" in "".join(mine.__notes__)
    interrupt = KeyboardInterrupt()
    assert sole_error(BaseExceptionGroup("", [ValueError(), interrupt])) is interrupt
    nested = ExceptionGroup("", [ExceptionGroup("", [TypeError("deep")])])
    assert isinstance(sole_error(nested), TypeError)


@pytest.mark.realtime  # (a real port)
async def test_swarm_error_catches_every_start_failure() -> None:
    """What a new user writes: ``except swarmavg.SwarmError``."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for make in (
            lambda: Node(listen=[f"tcp://127.0.0.1:{port}"]),
            lambda: DHT(port=port),
            lambda: DHT(transport="nonexistent"),
        ):
            try:
                async with make():
                    pytest.fail("it started")
            except swarmavg.SwarmError:
                pass
            await anyio.lowlevel.checkpoint()


async def test_dht_names_an_unknown_option() -> None:
    with pytest.raises(TypeError, match="DHT\\(\\) got an unexpected keyword argument 'listen'"):
        DHT(listen=["tcp://127.0.0.1:0"])
    with pytest.raises(ValueError, match="request_timeout"):
        DHT(transport="memory", request_timeout=True)
    with pytest.raises(TypeError, match="client_mode"):
        DHT(transport="memory", client_mode="yes")  # type: ignore[arg-type]


async def test_an_averager_on_a_dht_that_is_not_running_says_so() -> None:
    import torch

    from swarmavg.aio import DecentralizedAverager

    dht = DHT(transport="memory")
    averager = DecentralizedAverager([torch.zeros(3)], dht, prefix="x", target_group_size=2)
    with pytest.raises(RuntimeError, match="DHT is not running"):
        async with averager:
            pass
