"""The network lab's own checks (Linux, root): its links have the profile's round trip, rate and
loss (loose bounds: these are sanity checks on a shared machine, not measurements), a cut link
blocks traffic and restoring it lets a TCP connection carry on, a profile changes live, and
nothing of a lab outlives it, also after an exception or the death of its owner."""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from swarmavg.testing import netlab
from swarmavg.testing.netlab import LinkProfile, NetLab, NetLabError

_reason = netlab.unavailable_reason()
pytestmark = [
    pytest.mark.skipif(_reason is not None, reason=_reason or ""),
    pytest.mark.timeout(40),
]

PORT = 9100


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split(" ")[0] for line in out.stdout.splitlines() if line.startswith(prefix)]


def _udp_pair(lab: NetLab, a: int, b: int) -> tuple[socket.socket, socket.socket]:
    """A UDP socket in host ``a`` and one bound to host ``b``'s address, each in its host."""
    with lab.host(b).entered():
        server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        server.bind((lab.host(b).address, PORT))
    with lab.host(a).entered():
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    return client, server


class _Echo:
    """Echoes UDP datagrams on ``server`` from a thread until stopped."""

    def __init__(self, server: socket.socket) -> None:
        self.server = server
        self.stop = threading.Event()
        server.settimeout(0.1)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                data, peer = self.server.recvfrom(2048)
            except TimeoutError:
                continue
            except OSError:
                return
            self.server.sendto(data, peer)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.server.close()


def _pings(client: socket.socket, address: str, count: int, wait: float) -> list[float]:
    """Round trips of ``count`` UDP pings (lost ones left out)."""
    client.settimeout(wait)
    rtts = []
    for i in range(count):
        payload = i.to_bytes(4, "big")
        start = time.monotonic()
        client.sendto(payload, (address, PORT))
        deadline = start + wait
        while time.monotonic() < deadline:
            try:
                data, _ = client.recvfrom(2048)
            except TimeoutError:
                break
            if data == payload:
                rtts.append(time.monotonic() - start)
                break
    return rtts


@pytest.fixture
def wan_lab() -> Iterator[NetLab]:
    with NetLab(2, profile=netlab.WAN.replace(loss=0.0)) as lab:
        yield lab


def test_udp_round_trip_is_the_profiles(wan_lab: NetLab) -> None:
    client, server = _udp_pair(wan_lab, 0, 1)
    echo = _Echo(server)
    try:
        rtts = _pings(client, wan_lab.host(1).address, 15, wait=1.0)
    finally:
        echo.close()
        client.close()
    assert len(rtts) == 15  # no loss in this profile
    assert min(rtts) >= 0.040  # the emulator never delivers early
    assert statistics.median(rtts) < 0.040 + 0.040  # loose: a busy machine adds its own


def test_tcp_connect_takes_one_round_trip_and_live_profile_change(wan_lab: NetLab) -> None:
    def connect_time() -> float:
        with wan_lab.host(1).entered():
            listener = socket.create_server((wan_lab.host(1).address, PORT))
        with wan_lab.host(0).entered():
            start = time.monotonic()
            conn = socket.create_connection((wan_lab.host(1).address, PORT), timeout=5)
            elapsed = time.monotonic() - start
        conn.close()
        listener.close()
        return elapsed

    assert 0.040 <= connect_time() < 0.040 + 0.060
    wan_lab.set_profile(1, LinkProfile(rate_bps=100e6, rtt_s=0.300))
    # host 0 keeps 10 ms per hop, host 1 now has 75 ms: 2 x (10 + 75) ms
    assert 0.170 <= connect_time() < 0.170 + 0.100


def test_a_slowly_paced_flow_on_a_long_path_still_hands_over_large_frames(
    wan_lab: NetLab,
) -> None:
    """With offload, a TCP flow paced at 1 MB/s over the 40 ms path builds offload frames of
    ~16 KiB and more (``TSO_RTT_LOG``), not the one or two packets the kernel's default sizes
    them to (a millisecond of its rate): many slow flows at once would otherwise bring the
    emulator to its frame rate before the links reach theirs."""
    assert wan_lab.offload
    with wan_lab.host(1).entered():
        listener = socket.create_server((wan_lab.host(1).address, PORT))
    received = [0]

    def sink() -> None:
        conn, _ = listener.accept()
        with conn:
            while chunk := conn.recv(1 << 16):
                received[0] += len(chunk)

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    with wan_lab.host(0).entered():
        conn = socket.create_connection((wan_lab.host(1).address, PORT), timeout=5)
    conn.setsockopt(socket.SOL_SOCKET, 47, 1_000_000)  # SO_MAX_PACING_RATE: 1 MB/s
    before = wan_lab.stats()[0]
    total = 1 << 20
    conn.sendall(b"\0" * total)
    conn.close()
    thread.join(timeout=15)
    listener.close()
    after = wan_lab.stats()[0]
    assert received[0] == total
    frames = after["rx_frames"] - before["rx_frames"]
    assert frames > 0
    # host 0's frames into the emulator: its data (and its few ACKs of nothing)
    assert (after["rx_bytes"] - before["rx_bytes"]) / frames > 8000


def test_tcp_traffic_counts_what_reached_the_peer_also_behind_a_lost_packet() -> None:
    """The TCP transport's ``traffic()`` counts data the peer acknowledged selectively (SACK)
    as it arrives: over a lossy 40 ms path its count of bytes sent grows at the link's rate,
    where the cumulative acknowledgement alone stalls behind each lost packet and then jumps
    (the averager measures its bandwidth from the peaks of these counts)."""
    from swarmavg_tcp._connection import _tcp_traffic

    rate = 40e6  # bits/s
    lossy = LinkProfile(rate_bps=rate, rtt_s=0.040, loss=0.01)
    with NetLab(2, profile=lossy, seed=5) as lab:
        with lab.host(1).entered():
            listener = socket.create_server((lab.host(1).address, PORT))

        def sink() -> None:
            conn, _ = listener.accept()
            with conn:
                while conn.recv(1 << 16):
                    pass

        thread = threading.Thread(target=sink, daemon=True)
        thread.start()
        with lab.host(0).entered():
            conn = socket.create_connection((lab.host(1).address, PORT), timeout=5)
        conn.setblocking(False)
        data = memoryview(bytes(1 << 20))
        samples: list[tuple[float, int, int]] = []  # (time, traffic's sent, bytes acked)
        end = time.monotonic() + 4.0
        while time.monotonic() < end:
            with contextlib.suppress(BlockingIOError):
                conn.send(data)
            traffic = _tcp_traffic(conn)
            acked = struct.unpack_from("=Q", conn.getsockopt(socket.IPPROTO_TCP, 11, 136), 120)[0]
            assert traffic is not None
            samples.append((time.monotonic(), traffic[0], acked))
            time.sleep(0.01)
        conn.close()
        thread.join(timeout=15)
        listener.close()

    def peak(column: int, span: float = 0.2) -> float:
        """The highest rate (bytes/s) over ``span`` seconds, after the first second."""
        best = 0.0
        first = 0
        for sample in samples:
            while samples[first][0] < sample[0] - span:
                first += 1
            if samples[first][0] > samples[0][0] + 1.0 and sample[0] > samples[first][0]:
                moved = sample[column] - samples[first][column]
                best = max(best, moved / (sample[0] - samples[first][0]))
        return best

    link = rate / 8 * 1448 / 1514  # bytes/s of TCP payload
    assert peak(1) < link * 1.3
    assert peak(2) > peak(1)  # (the cumulative acknowledgement's jumps)


def test_rate_is_limited_both_ways() -> None:
    fast = LinkProfile(rate_bps=200e6, rtt_s=0.002)
    slow = LinkProfile(rate_bps=8e6, rtt_s=0.002)
    with NetLab([fast, slow]) as lab:
        assert lab.offload  # (no reordering: offload frames, losses still per packet)
        rates = {}
        for sender, receiver in ((1, 0), (0, 1)):  # slow upload, then slow download
            with lab.host(receiver).entered():
                listener = socket.create_server((lab.host(receiver).address, PORT))
            received = [0, 0.0]

            def sink(listener: socket.socket = listener, received: list[float] = received) -> None:
                conn, _ = listener.accept()
                with conn:
                    start = time.monotonic()
                    while chunk := conn.recv(1 << 16):
                        received[0] += len(chunk)
                    received[1] = time.monotonic() - start

            thread = threading.Thread(target=sink, daemon=True)
            thread.start()
            with lab.host(sender).entered():
                conn = socket.create_connection((lab.host(receiver).address, PORT), timeout=5)
            data = b"\0" * (1 << 16)
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                conn.sendall(data)
            conn.close()
            thread.join(timeout=15)
            listener.close()
            rates[sender] = received[0] * 8 / received[1]
    for rate in rates.values():
        assert 8e6 / 2 < rate < 8e6 * 1.1  # the shaper's rate, give or take a factor


def test_loss_is_as_configured_and_counted_exactly() -> None:
    lossy = LinkProfile(rate_bps=50e6, rtt_s=0.001, loss=0.2)
    sent = 600
    with NetLab(2, profile=lossy, seed=7) as lab:
        client, server = _udp_pair(lab, 0, 1)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        for i in range(sent):
            client.sendto(i.to_bytes(4, "big"), (lab.host(1).address, PORT))
            if i % 50 == 49:
                time.sleep(0.005)  # (stay far below the rate: no queue drops)
        server.settimeout(0.5)
        got = set()
        try:
            while True:
                got.add(int.from_bytes(server.recv(16), "big"))
        except TimeoutError:
            pass
        stats = lab.stats()
        client.close()
        server.close()
    assert stats[0]["rx_frames"] == sent
    assert stats[0]["lost"] + len(got) == sent  # every missing datagram is an emulated loss
    assert stats[0]["queue_drops"] == stats[0]["socket_drops"] == 0
    assert 0.2 * sent / 2 < stats[0]["lost"] < 0.2 * sent * 1.6


def test_offload_frames_lose_and_reorder_single_packets_and_tcp_carries_every_byte() -> None:
    """With offload, a lossy link that reorders loses and reorders packets, not whole 64 KiB
    frames: the emulator cuts a frame with lost or reordered segments into valid frames of the
    kept ones and sends a reordered segment ahead alone (a wrong cut would corrupt the stream or
    stall it), and counts the lost and reordered packets."""
    lossy = LinkProfile(rate_bps=200e6, rtt_s=0.002, loss=0.02, reorder=0.02)
    data = os.urandom(6 << 20)
    with NetLab(2, profile=lossy, seed=3) as lab:
        assert lab.offload
        with lab.host(1).entered():
            listener = socket.create_server((lab.host(1).address, PORT))
        received = bytearray()

        def sink() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(20)
                while chunk := conn.recv(1 << 16):
                    received.extend(chunk)

        thread = threading.Thread(target=sink, daemon=True)
        thread.start()
        with lab.host(0).entered():
            conn = socket.create_connection((lab.host(1).address, PORT), timeout=5)
        conn.sendall(data)
        conn.close()
        thread.join(timeout=30)
        listener.close()
        stats = lab.stats()
    assert bytes(received) == data
    packets = len(data) // 1448
    # ~2% of the data packets (retransmissions and ACKs add some); frames lost whole would
    # lose every segment of ~1 frame in 6 (8 segments or more a frame)
    assert 0.01 * packets < stats[0]["lost"] < 0.04 * packets
    assert 0.01 * packets < stats[0]["reordered"] < 0.04 * packets
    assert stats[0]["rx_frames"] < packets / 2  # offload frames: several packets each


def test_cut_link_blocks_traffic_and_restoring_it_lets_tcp_carry_on(wan_lab: NetLab) -> None:
    client, server = _udp_pair(wan_lab, 0, 1)
    echo = _Echo(server)
    with wan_lab.host(1).entered():
        listener = socket.create_server((wan_lab.host(1).address, PORT + 1))
    with wan_lab.host(0).entered():
        tcp = socket.create_connection((wan_lab.host(1).address, PORT + 1), timeout=5)
    peer, _ = listener.accept()
    peer.settimeout(10)
    try:
        wan_lab.host(1).set_link(False)
        assert _pings(client, wan_lab.host(1).address, 3, wait=0.3) == []
        tcp.sendall(b"sent while cut")
        peer.settimeout(0.5)
        with pytest.raises(TimeoutError):
            peer.recv(100)
        assert wan_lab.stats()[0]["link_drops"] >= 4
        wan_lab.host(1).set_link(True)
        assert len(_pings(client, wan_lab.host(1).address, 3, wait=1.0)) == 3
        peer.settimeout(10)  # TCP retransmits what was lost while the link was cut
        assert peer.recv(100) == b"sent while cut"
    finally:
        echo.close()
        for sock in (client, tcp, peer, listener):
            sock.close()


def test_processes_and_functions_run_inside_a_host() -> None:
    with NetLab(2) as lab:
        assert lab.offload  # lan: 1 Gbit/s is beyond the emulator without offload
        assert sorted(lab.host(0).call(os.listdir, "/sys/class/net", timeout=20)) == [
            "eth0",
            "lo",
        ]
        done = lab.host(1).run(["ip", "-4", "-o", "addr", "show", "dev", "eth0"], timeout=10)
        assert f"{lab.host(1).address}/24" in done.stdout
        # the hosts reach each other and nothing else (no route out of the lab)
        with lab.host(0).entered():
            probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with pytest.raises(OSError):  # (in the lab's /16, outside its hosts' /24)
            probe.connect(("10.77.1.1", 1))
        probe.close()


def test_nothing_outlives_a_lab_even_after_an_exception() -> None:
    seen: dict[str, Any] = {}

    def use_and_fail() -> None:
        with NetLab(3, profile="bad") as lab:
            seen.update(lab=lab, sleeper=lab.host(2).popen(["sleep", "60"]))
            seen.update(emulator=lab._emulator, namespaces=_namespaces(lab.name))
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        use_and_fail()
    lab, sleeper, emulator = seen["lab"], seen["sleeper"], seen["emulator"]
    name = lab.name
    assert len(seen["namespaces"]) == 4
    assert _namespaces(name) == []
    assert sleeper.poll() is not None
    assert emulator.poll() is not None
    with pytest.raises(NetLabError):
        lab.host(0).popen(["true"])
    lab.close()  # idempotent


def test_a_dead_owners_lab_is_removed_by_the_next_one() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"{netlab.PREFIX}{dead.pid}-0-core"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    orphan = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "60"])
    try:
        with NetLab(1, profile=LinkProfile(rate_bps=None)) as lab:
            assert _namespaces(stale) == []
            assert orphan.wait(timeout=10) != 0  # killed
            assert _namespaces(lab.name)
    finally:
        if orphan.poll() is None:
            orphan.kill()
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True, check=False)


def test_each_host_builds_large_frames_on_its_longest_path() -> None:
    """A host's ``tcp_tso_rtt_log`` follows its longest path (frames of at least 16 KiB there,
    see ``tso_rtt_log``), also when a profile changes while the lab runs."""

    def logs(lab: NetLab) -> list[int]:
        return [
            int(host.run(["sysctl", "-n", "net.ipv4.tcp_tso_rtt_log"], timeout=10).stdout)
            for host in lab.hosts
        ]

    with NetLab([netlab.WAN, netlab.BAD, netlab.WAN]) as lab:
        assert lab.offload
        # wan to bad: 95 ms of round trip and up to 10 ms of jitter; wan to wan: 40 ms
        assert logs(lab) == [16, 16, 16]
        lab.set_profile(1, netlab.LAN)  # wan to wan: 40 ms; lan to wan: 20 ms
        assert logs(lab) == [14, 13, 14]
        assert [host.tso_rtt_log for host in lab.hosts] == [14, 13, 14]
    assert [netlab.tso_rtt_log(rtt) for rtt in (0.0, 0.0005, 0.040, 0.170, 0.5)] == [
        9,
        9,
        14,
        16,
        18,
    ]
    for rtt in (0.003, 0.040, 0.170, 2.0):  # the kernel's addition at that log
        assert 65536 >> (int(rtt * 1e6) >> netlab.tso_rtt_log(rtt)) >= netlab.TSO_MIN_FRAME


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="hosts"):
        NetLab(0)
    with pytest.raises(ValueError, match="profile"):
        NetLab(2, profile="moon")
    with pytest.raises(TypeError, match="hosts"):
        NetLab(2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loss"):
        LinkProfile(rate_bps=1e6, loss=1.5)
    with pytest.raises(ValueError, match="emulate=False"):
        NetLab(2, profile="wan", emulate=False)
    with pytest.raises(TypeError, match="offload"):
        NetLab(2, offload=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rtt_s"):
        netlab.tso_rtt_log(-1.0)


def test_a_partition_cuts_the_paths_between_groups_only() -> None:
    with NetLab(3, profile=netlab.WAN.replace(loss=0.0)) as lab:
        client0, server1 = _udp_pair(lab, 0, 1)
        client1, server2 = _udp_pair(lab, 1, 2)
        echoes = [_Echo(server1), _Echo(server2)]
        paths = {(0, 1): client0, (0, 2): client0, (1, 2): client1}

        def reachable() -> dict[tuple[int, int], bool]:
            return {
                (a, b): len(_pings(client, lab.host(b).address, 2, wait=0.4)) == 2
                for (a, b), client in paths.items()
            }

        try:
            assert reachable() == {(0, 1): True, (0, 2): True, (1, 2): True}
            lab.partition([0], [1, 2])
            assert reachable() == {(0, 1): False, (0, 2): False, (1, 2): True}
            assert lab.stats()[0]["link_drops"] >= 4
            lab.set_path(0, 2, True)
            assert reachable() == {(0, 1): False, (0, 2): True, (1, 2): True}
            lab.partition()
            assert reachable() == {(0, 1): True, (0, 2): True, (1, 2): True}
            with pytest.raises(ValueError, match="two groups"):
                lab.partition([0, 1], [1])
            with pytest.raises(ValueError, match="two different hosts"):
                lab.set_path(1, 1, False)
        finally:
            for echo in echoes:
                echo.close()
            client0.close()
            client1.close()


def test_a_small_message_does_not_queue_behind_seconds_of_bulk_in_the_kernel() -> None:
    """On a slow path, a connection busy with bulk keeps only ~0.1 s of its rate unsent in the
    kernel (``TCP_NOTSENT_LOWAT``, from its pacing rate): an RPC on another stream of the same
    connection goes before the bulk's next batch and answers within a fraction of a second,
    where a full 4 MiB send buffer would hold it behind ~4 s of data at 1 MB/s."""
    import anyio

    from swarmavg.identity import Identity
    from swarmavg_tcp import TcpTransport

    slow = LinkProfile(rate_bps=8e6, rtt_s=0.040)
    round_trips: list[float] = []
    received = [0]

    async def main(lab: NetLab) -> None:
        async with (
            TcpTransport(Identity.generate()) as server,
            TcpTransport(Identity.generate()) as client,
        ):
            with lab.host(1).entered():
                listener = await server.listen(f"tcp://{lab.host(1).address}:{PORT}")
            with lab.host(0).entered():
                dialed = await client.connect(listener.address)
            accepted = await listener.accept()
            chunk = bytes(1 << 20)

            async def serve() -> None:
                bulk = await accepted.accept_stream()
                rpc = await accepted.accept_stream()

                async def drain() -> None:
                    async for message in bulk:
                        received[0] += len(message)

                async with anyio.create_task_group() as inner:
                    inner.start_soon(drain)
                    async for message in rpc:
                        await rpc.send(message)

            async def send_bulk(stream: Any) -> None:
                while True:
                    await stream.send(chunk)

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(serve)
                    bulk = await dialed.open_stream()
                    await bulk.send(b"bulk")
                    rpc = await dialed.open_stream()
                    await rpc.send(b"hello")
                    assert bytes(await rpc.receive()) == b"hello"
                    tg.start_soon(send_bulk, bulk)
                    await anyio.sleep(3.0)  # the link busy for a while: the socket full
                    for i in range(5):
                        start = time.monotonic()
                        await rpc.send(b"ping %d" % i)
                        assert bytes(await rpc.receive()) == b"ping %d" % i
                        round_trips.append(time.monotonic() - start)
                        await anyio.sleep(0.2)
                    tg.cancel_scope.cancel()

    with NetLab(2, profile=slow) as lab:
        anyio.run(main, lab)
    assert received[0] > 2 << 20  # the bulk moved meanwhile (~1 MB/s)
    # the path's 40 ms, ~0.1 s of the rate unsent, and one batch's records ahead of it
    assert max(round_trips) < 0.8, round_trips
