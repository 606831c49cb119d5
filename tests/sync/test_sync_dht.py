"""``swarmavg.DHT``: the DHT for synchronous code, on swarmavg's event-loop thread, over TCP."""

from __future__ import annotations

import concurrent.futures
import os
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

import swarmavg.sync
from swarmavg import DHT, Address, ConnectError, Identity, ValueWithExpiration, get_dht_time
from swarmavg.aio.dht import DHTNode
from swarmavg.sync import TaskHandle

pytestmark = pytest.mark.timeout(20)

#: Seconds any one blocking wait in these tests may take.
WAIT = 10


def _inet_sockets() -> set[tuple[int, str]]:
    """This process's TCP/UDP sockets as (fd, status): psutil if installed, else /proc."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return {(c.fd, c.status) for c in psutil.Process().net_connections(kind="inet")}
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs psutil or /proc to list sockets")
    inodes: set[str] = set()
    for table in ("tcp", "tcp6", "udp", "udp6"):
        try:
            with open(f"/proc/net/{table}", encoding="ascii") as lines:
                inodes.update(line.split()[9] for line in list(lines)[1:])
        except OSError:
            continue
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:[") and link[8:-1] in inodes:
            found.add((int(fd), "?"))
    return found


@contextmanager
def _no_sockets_left_behind() -> Iterator[None]:
    """Every TCP/UDP socket opened in the block is closed when it ends."""
    before = _inet_sockets()
    yield
    left = _inet_sockets() - before
    assert left == set(), f"sockets left open: {left}"


def _unreachable(n: int) -> list[str]:
    """Multiaddrs (with PeerIDs) of loopback ports nothing listens on."""
    ports = []
    with ExitStack() as stack:
        for _ in range(n):
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    return [
        Address("tcp", "127.0.0.1", port, Identity.generate().peer_id).to_multiaddr()
        for port in ports
    ]


def test_store_and_get_between_three_peers() -> None:
    with _no_sockets_left_behind(), DHT() as first, DHT(first.get_visible_maddrs()) as second:
        with DHT(second.get_visible_maddrs()) as third:
            expiration = get_dht_time() + 60
            assert second.store("key", {"a": [1, 2]}, expiration) is True
            got = third.get("key")
            assert isinstance(got, ValueWithExpiration)
            value, expiration_back = got
            assert value == {"a": [1, 2]}
            assert expiration_back == expiration

            assert first.store("dict", "x", expiration, subkey="one")
            assert third.store("dict", "y", expiration + 1, subkey="two")
            merged = second.get("dict", latest=True)
            assert merged == ValueWithExpiration(
                {
                    "one": ValueWithExpiration("x", expiration),
                    "two": ValueWithExpiration("y", expiration + 1),
                },
                expiration + 1,
            )
            assert first.get("nobody stored this") is None
        # the first two go on without the third
        assert first.get("key", latest=True) == ValueWithExpiration({"a": [1, 2]}, expiration)


def test_return_future_gives_a_handle_to_the_result() -> None:
    with DHT() as first, DHT(first.get_visible_maddrs()) as second:
        expiration = get_dht_time() + 60
        stored = first.store("later", 42, expiration, return_future=True)
        assert isinstance(stored, TaskHandle)
        assert isinstance(stored, concurrent.futures.Future)
        assert stored.result(WAIT) is True
        got = second.get("later", return_future=True)
        assert isinstance(got, TaskHandle)
        assert got.result(WAIT) == ValueWithExpiration(42, expiration)
        missing = second.get("missing", latest=True, return_future=True)
        assert missing.result(WAIT) is None


def test_run_coroutine_runs_on_the_loop_thread_with_the_dht_and_its_node() -> None:
    with DHT() as first, DHT(first.get_visible_maddrs()) as second:
        seen: list[tuple[DHT, DHTNode, bool]] = []

        async def fn(dht: DHT, node: DHTNode) -> int:
            seen.append((dht, node, swarmavg.sync.in_loop_thread()))
            assert await node.store("from fn", "v", get_dht_time() + 30)
            return node.routing_table_size

        assert second.run_coroutine(fn) == 1
        assert len(seen) == 1
        dht, node, on_loop_thread = seen[0]
        assert dht is second
        assert isinstance(node, DHTNode)
        assert node.peer_id == second.peer_id
        assert on_loop_thread
        assert first.get("from fn").value == "v"  # type: ignore[union-attr]

        handle = first.run_coroutine(fn, return_future=True)
        assert isinstance(handle, TaskHandle)
        assert handle.result(WAIT) == 1
        assert seen[1][0] is first

        async def fails(dht: DHT, node: DHTNode) -> None:
            raise LookupError("raised in fn")

        with pytest.raises(LookupError, match="raised in fn"):
            first.run_coroutine(fails)
        failed = first.run_coroutine(fails, return_future=True)
        assert isinstance(failed.exception(WAIT), LookupError)


def test_the_context_manager_shuts_down_and_later_calls_are_refused() -> None:
    with _no_sockets_left_behind():
        with DHT() as dht:
            assert dht.is_alive()
            assert dht.ready.done()
            peer_id = dht.peer_id
            assert repr(dht) == f"<swarmavg.DHT {peer_id}>"
        assert not dht.is_alive()
    dht.shutdown()  # idempotent
    dht.shutdown()
    assert dht.peer_id == peer_id

    async def fn(dht: DHT, node: DHTNode) -> None:
        pytest.fail("ran after shutdown")

    for refused in (
        lambda: dht.get("key"),
        lambda: dht.get("key", return_future=True),
        lambda: dht.store("key", 1, get_dht_time() + 10),
        lambda: dht.run_coroutine(fn),
        lambda: dht.get_visible_maddrs(),
        lambda: dht.run_in_background(),
    ):
        with pytest.raises(RuntimeError, match="shut down"):
            refused()


def test_start_false_waits_for_run_in_background() -> None:
    with _no_sockets_left_behind():
        dht = DHT(start=False)
        try:
            assert not dht.is_alive()
            assert not dht.ready.done()
            with pytest.raises(RuntimeError, match="not started"):
                dht.get("key")
            with pytest.raises(RuntimeError, match="not started"):
                dht.get_visible_maddrs()
            dht.run_in_background()
            assert dht.ready.done()
            assert dht.is_alive()
            dht.run_in_background()  # starting again is a no-op
            assert dht.store("key", "v", get_dht_time() + 30)
            assert dht.get("key").value == "v"  # type: ignore[union-attr]
            assert dht.get_visible_maddrs()
        finally:
            dht.shutdown()
        assert not dht.is_alive()
        # entering the context manager starts one too
        with DHT(start=False) as other:
            assert other.is_alive()
        assert not other.is_alive()


def test_shutdown_of_a_dht_never_started() -> None:
    with _no_sockets_left_behind():
        dht = DHT(start=False)
        dht.shutdown()
        dht.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            dht.run_in_background()
        assert not dht.is_alive()


def test_identity_path_keeps_the_peer_id(tmp_path: Path) -> None:
    key = tmp_path / "dht.key"
    with DHT(identity_path=key) as first:
        peer_id = first.peer_id
        assert all(m.endswith(f"/p2p/{peer_id}") for m in first.get_visible_maddrs())
    assert key.exists()
    with DHT(identity_path=str(key)) as second:
        assert second.peer_id == peer_id
    with DHT() as fresh:
        assert fresh.peer_id != peer_id


def test_identity_and_identity_path_together_are_refused(tmp_path: Path) -> None:
    key = tmp_path / "dht.key"
    with pytest.raises(ValueError, match="identity_path"):
        DHT(identity=Identity.generate(), identity_path=key)
    assert not key.exists()


def test_host_maddrs_listens_where_it_says() -> None:
    with DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"]) as first:
        (maddr,) = first.get_visible_maddrs()
        address = Address.parse(maddr)
        assert (address.scheme, address.host) == ("tcp", "127.0.0.1")
        assert address.port != 0
        assert address.peer_id == first.peer_id
        with DHT([maddr]) as second:
            assert second.store("via maddr", 3, get_dht_time() + 30)
            assert first.get("via maddr").value == 3  # type: ignore[union-attr]


def test_unreachable_initial_peers_raise_connect_error_from_the_constructor() -> None:
    ghosts = _unreachable(2)
    with _no_sockets_left_behind(), pytest.raises(ConnectError) as info:
        DHT(ghosts, request_timeout=2, startup_timeout=WAIT)
    for ghost in ghosts:
        assert str(Address.parse(ghost).peer_id) in str(info.value)


def test_shutdown_called_on_the_loop_thread_still_stops_the_dht() -> None:
    """Regression: shutdown() in a run_coroutine function used to swallow run_sync()'s
    "called on the loop thread" RuntimeError as "the loop is gone", after marking the DHT shut
    down: the DHT kept running and listening, and every later shutdown() was a no-op."""
    dht = DHT()

    async def shut(dht: DHT, node: DHTNode) -> str:
        dht.shutdown()  # on the loop thread: starts the shutdown, does not wait for it
        return "returned"

    before = _inet_sockets()
    assert dht.run_coroutine(shut) == "returned"
    deadline = time.monotonic() + WAIT
    while dht.is_alive():  # it stops on its own, without a second call
        assert time.monotonic() < deadline, "the DHT is still running"
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="shut down"):
        dht.get("key")
    dht.shutdown()  # idempotent from this thread too
    assert _inet_sockets() < before  # its listener is closed
