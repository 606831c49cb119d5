"""``swarmavg dht``: a long-lived DHT peer in its own process that others bootstrap from."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import pytest

from swarmavg import DHT, Address, Identity, get_dht_time

pytestmark = pytest.mark.timeout(30)

CLI = [sys.executable, "-m", "swarmavg.cli"]
#: Seconds any one wait on the child process may take.
WAIT = 10.0
STATUS = re.compile(r"(\d+) peers in the routing table, (\d+) records stored, (\d+) cached")


class _Lines:
    """The lines of a child's pipe, read by a thread so that every wait can be bounded."""

    def __init__(self, stream: IO[str]) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def next(self, timeout: float = WAIT) -> str:
        """The next line; fails at end of output or after ``timeout`` seconds."""
        try:
            line = self._queue.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no line within {timeout} s; so far: {self.seen}")
        if line is None:
            self._queue.put(None)
            pytest.fail(f"the output ended; it was: {self.seen}")
        self.seen.append(line)
        return line

    def wait_for(self, matches: Callable[[str], bool], timeout: float = WAIT) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self.next(max(0.0, deadline - time.monotonic()))
            if matches(line):
                return line

    def join(self, timeout: float = WAIT) -> None:
        self._thread.join(timeout)


class _DHTProcess:
    def __init__(self, child: subprocess.Popen[str]) -> None:
        assert child.stdout is not None
        assert child.stderr is not None
        self.child = child
        self.stdout = _Lines(child.stdout)
        self.stderr = _Lines(child.stderr)

    def banner(self) -> tuple[str, list[str]]:
        """The PeerID and the multiaddrs the peer printed."""
        first = self.stdout.next()
        match = re.fullmatch(r"DHT peer (\S+) \(identity in (.+)\)", first)
        assert match, first
        assert self.stdout.next() == "other peers join with initial_peers=[...] any of:"
        maddrs = []
        while (line := self.stdout.next()) != "Ctrl+C stops.":
            assert line.startswith("  /"), line
            maddrs.append(line.strip())
        return match.group(1), maddrs

    def stop(self) -> int:
        """Close its stdin (the signal to stop) and return its exit code."""
        assert self.child.stdin is not None
        self.child.stdin.close()
        code = self.child.wait(WAIT)
        self.stdout.join()
        self.stderr.join()
        return code


@contextmanager
def _dht_process(key: Path, *args: str) -> Iterator[_DHTProcess]:
    command = [*CLI, "dht", "--listen", "tcp://127.0.0.1:0", "--identity", str(key)]
    command += ["--log-interval", "0.3", "--until-stdin-closes", *args]
    child = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        yield _DHTProcess(child)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(WAIT)
        for pipe in (child.stdin, child.stdout, child.stderr):
            if pipe is not None:
                pipe.close()


@pytest.mark.process
def test_peers_bootstrap_from_it_and_its_peer_id_survives_a_restart(tmp_path: Path) -> None:
    key = tmp_path / "k.key"
    with _dht_process(key) as peer:
        peer_id, maddrs = peer.banner()
        assert key.exists()
        assert maddrs
        for maddr in maddrs:
            address = Address.parse(maddr)
            assert (address.scheme, address.host) == ("tcp", "127.0.0.1")
            assert address.port != 0
            assert str(address.peer_id) == peer_id

        with DHT(maddrs, startup_timeout=WAIT) as dht:
            assert dht.peer_id != peer_id
            expiration = get_dht_time() + 60
            assert dht.store("through the cli peer", [1, "two"], expiration)
            # the CLI peer is the only other one: the record lives there, not just in our cache
            value, expiration_back = dht.get("through the cli peer", latest=True)  # type: ignore[misc]
            assert value == [1, "two"]
            assert expiration_back == expiration

            def knows_us(line: str) -> bool:
                status = STATUS.search(line)
                return status is not None and int(status[1]) >= 1 and int(status[2]) >= 1

            line = peer.stderr.wait_for(knows_us)
            assert " INFO swarmavg.cli: up " in line

        assert peer.stop() == 0
        assert not any("Traceback" in line for line in peer.stderr.seen), peer.stderr.seen

    with _dht_process(key) as restarted:
        assert restarted.banner()[0] == peer_id
        assert restarted.stop() == 0


@pytest.mark.process
def test_the_status_line_appears_every_log_interval(tmp_path: Path) -> None:
    with _dht_process(tmp_path / "k.key") as peer:
        peer.banner()
        start = time.monotonic()
        lines = [peer.stderr.wait_for(STATUS.search) for _ in range(3)]
        elapsed = time.monotonic() - start
        assert all(STATUS.search(line)[1] == "0" for line in lines)  # type: ignore[index]
        assert elapsed < 5  # every 0.3 s, not every minute
        assert peer.stop() == 0


@pytest.mark.process
def test_a_second_cli_peer_joins_the_first(tmp_path: Path) -> None:
    with _dht_process(tmp_path / "a.key") as first:
        first_id, maddrs = first.banner()
        with _dht_process(tmp_path / "b.key", "--initial-peer", maddrs[0]) as second:
            second_id, _ = second.banner()
            assert second_id != first_id
            for peer in (first, second):
                line = peer.stderr.wait_for(
                    lambda text: (s := STATUS.search(text)) is not None and int(s[1]) >= 1
                )
                assert "1 peers in the routing table" in line
            assert second.stop() == 0
        assert first.stop() == 0


@pytest.mark.process
def test_unreachable_initial_peer_fails_cleanly(tmp_path: Path) -> None:
    ghost = Address("tcp", "127.0.0.1", 9, Identity.generate().peer_id).to_multiaddr()
    key = str(tmp_path / "k.key")
    out = subprocess.run(
        [*CLI, "dht", "--listen", "tcp://127.0.0.1:0", "--identity", key, "--initial-peer", ghost],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert out.returncode == 1, out.stderr
    assert "swarmavg dht: ConnectError: no initial peer answered" in out.stderr
    assert str(Address.parse(ghost).peer_id) in out.stderr
    assert "Traceback" not in out.stderr


def test_a_log_interval_that_is_not_positive_is_refused(
    tmp_path: Path, usage_error: Callable[[list[str]], str]
) -> None:
    err = usage_error(["dht", "--identity", str(tmp_path / "k.key"), "--log-interval", "0"])
    assert "--log-interval" in err
    assert not (tmp_path / "k.key").exists()
