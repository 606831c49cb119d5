"""``swarmavg.DHT`` and ``swarmavg.DecentralizedAverager`` fail to start with the exception
that says why, never an ExceptionGroup, and name the argument that is wrong."""

from __future__ import annotations

import errno
import socket

import pytest
import torch

import swarmavg
from swarmavg import DHT, AddressInUse, DecentralizedAverager, TransportNotFound

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("scheme", ["tcp", "quic"])
def test_a_port_in_use_raises_address_in_use(scheme: str) -> None:
    kind = socket.SOCK_STREAM if scheme == "tcp" else socket.SOCK_DGRAM
    with socket.socket(socket.AF_INET, kind) as held:
        held.bind(("127.0.0.1", 0))
        if kind == socket.SOCK_STREAM:
            held.listen()
        port = held.getsockname()[1]
        with pytest.raises(swarmavg.SwarmError) as caught:
            DHT(transport=scheme, port=port)
    assert isinstance(caught.value, AddressInUse)
    assert isinstance(caught.value.__cause__, OSError)
    assert caught.value.__cause__.errno == errno.EADDRINUSE


def test_an_unknown_transport_raises_transport_not_found() -> None:
    with pytest.raises(TransportNotFound, match="no transport named 'pigeon'"):
        DHT(transport="pigeon")
    dht = DHT(transport="pigeon", start=False)
    with pytest.raises(TransportNotFound):
        dht.run_in_background(await_ready=True)
    assert not dht.is_alive()
    dht.shutdown()


def test_bad_arguments_name_what_the_user_passed() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'listen'") as raised:
        DHT(listen=["tcp://127.0.0.1:0"])
    assert "request_timeout" in str(raised.value)  # (the options a user may pass are named)
    assert "clock" not in str(raised.value)  # (internal ones are not)
    with pytest.raises(TypeError, match="start must be a bool"):
        DHT(start="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="startup_timeout"):
        DHT(startup_timeout=0)
    with DHT() as dht:
        tensors = [torch.zeros(3)]
        with pytest.raises(TypeError, match=r"dht must be a swarmavg\.DHT, not DHT"):
            DecentralizedAverager(tensors, dht._dht, prefix="x", target_group_size=2)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"averaged_tensors\[1\] is a numpy.ndarray"):
            DecentralizedAverager(
                [torch.zeros(3), torch.zeros(3).numpy()],  # type: ignore[list-item]
                dht,
                prefix="x",
                target_group_size=2,
            )
        with pytest.raises(TypeError, match="target_group_size must be an int, not True"):
            DecentralizedAverager(tensors, dht, prefix="x", target_group_size=True)
        # a group of one needs no partner: min_group_size follows it down
        with DecentralizedAverager(
            (t for t in tensors), dht, prefix="x", target_group_size=1
        ) as averager:
            assert averager._averager.min_group_size == 1
            result = averager.step(timeout=5)
            assert result.group_size == 1
