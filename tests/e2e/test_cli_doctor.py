"""``swarmavg doctor``: one line per check, ok / warn / FAIL; against a live DHT peer (TCP and
QUIC, in this process), a ``swarmavg serve`` node (no clock to read), a dead address, a taken
port; and the verdicts on clocks and missing transports on their own."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from swarmavg import DHT, Address, Identity
from swarmavg import _doctor as doctor
from swarmavg.cli import main
from swarmavg.errors import TransportNotFound

pytestmark = pytest.mark.timeout(30)

LINE = re.compile(r"(ok|warn|FAIL) +(.+?): (.+)")  # (names hold "://" and ":port", not ": ")


def _doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, str]]:
    """Run ``swarmavg doctor`` on loopback; the exit code and ``{check name: status}``."""
    code = main(["doctor", "--host", "127.0.0.1", "--timeout", "3", *args])
    out, err = capsys.readouterr()
    assert err == ""
    statuses: dict[str, str] = {}
    for line in out.splitlines():
        match = LINE.fullmatch(line)
        assert match, f"not a check line: {line!r}"
        statuses[match[2]] = match[1]
    return code, statuses


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def live_dht(fresh_loop: None) -> Iterator[DHT]:
    with DHT(host_maddrs=["tcp://127.0.0.1:0", "quic://127.0.0.1:0"]) as dht:
        yield dht


def test_a_live_dht_peer_answers_over_tcp_and_quic_and_its_clock_agrees(
    live_dht: DHT, capsys: pytest.CaptureFixture[str]
) -> None:
    tcp, quic = (str(Address.parse(m)) for m in live_dht.get_visible_maddrs())
    code, checks = _doctor(capsys, tcp, quic)
    assert code == 0
    tcp_name = f"peer {Address.parse(tcp).with_peer_id(None)} over tcp"
    quic_name = f"peer {Address.parse(quic).with_peer_id(None)} over quic"
    assert checks[tcp_name] == checks[quic_name] == "ok"
    clock = f"clock of {live_dht.peer_id.short()}"
    assert checks[clock] == "ok"
    assert checks["transport tcp"] == checks["transport quic"] == "ok"
    assert checks["listen tcp"] == checks["listen quic"] == "warn"  # loopback: said so
    assert "interfaces" in checks
    assert all(status != "FAIL" for status in checks.values())


def test_the_peer_line_has_the_round_trip_and_the_clock_line_the_skew(
    live_dht: DHT, capsys: pytest.CaptureFixture[str]
) -> None:
    tcp = Address.parse(live_dht.get_visible_maddrs()[0])
    assert main(["doctor", "--host", "127.0.0.1", str(tcp.with_peer_id(None))]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"ok    peer tcp://127\.0\.0\.1:\d+ over tcp: connected in [0-9.]+ ms \(key proven, "
        r"encrypted\), round trip [0-9.]+ ms \(median of 5 dht\.ping calls\)\n",
        out,
    ), out
    # no PeerID in the address: the peer's is named, to put in it
    assert f"warn  peer {tcp.with_peer_id(None)} identity: " in out
    assert str(tcp.with_peer_id(live_dht.peer_id)) in out
    # nothing names it on quic: the same port is tried (nobody there), a warning only
    bare = re.escape(str(tcp.with_peer_id(None)))
    assert re.search(rf"warn  peer {bare} over quic: no answer at the same port", out), out
    assert re.search(r"ok    clock of \S+: agrees with ours|ok    clock of \S+: .* ours \(± ", out)


def test_a_dead_address_fails_and_says_what_to_check(capsys: pytest.CaptureFixture[str]) -> None:
    dead = Address("tcp", "127.0.0.1", _free_port(), Identity.generate().peer_id)
    code, checks = _doctor(capsys, str(dead))
    assert code == 1
    assert checks[f"peer {dead.with_peer_id(None)} over tcp"] == "FAIL"
    # (no second transport tried after the first failed, and no clock line)
    assert [name for name in checks if name.startswith(("peer", "clock"))] == [
        f"peer {dead.with_peer_id(None)} over tcp"
    ]


def test_a_dead_address_line_names_the_cause(capsys: pytest.CaptureFixture[str]) -> None:
    dead = Address("tcp", "127.0.0.1", _free_port(), Identity.generate().peer_id)
    assert main(["doctor", "--host", "127.0.0.1", str(dead)]) == 1
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("FAIL"))
    assert "no answer (ConnectError: " in line
    assert "check that the peer runs, the host and port, and that no firewall drops TCP" in line


@pytest.mark.process
def test_a_serve_node_answers_but_tells_no_time(capsys: pytest.CaptureFixture[str]) -> None:
    command = [sys.executable, "-m", "swarmavg", "serve", "--listen", "tcp://127.0.0.1:0"]
    with subprocess.Popen(
        [*command, "--until-stdin-closes"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as server:
        assert server.stdin is not None
        assert server.stdout is not None
        try:
            address = server.stdout.readline().strip()
            assert address.startswith("tcp://127.0.0.1:"), address
            code = main(["doctor", "--host", "127.0.0.1", "--timeout", "3", address])
        finally:
            server.stdin.close()
            server.wait(10)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "(median of 5 ping calls)" in out  # it serves `ping`, not `dht.ping`
    assert re.search(r"warn  clock of \S+: not readable: the node is no DHT peer", out), out


def test_a_taken_port_fails_the_listening_check(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code, checks = _doctor(capsys, "--port", str(port))
    assert code == 1
    assert checks["listen tcp"] == "FAIL"
    assert checks["listen quic"] == "warn"  # (UDP's port of the same number is free)


def test_a_bad_address_is_a_failed_check(capsys: pytest.CaptureFixture[str]) -> None:
    code, checks = _doctor(capsys, "tcp://nowhere")
    assert code == 1
    assert checks["peer tcp://nowhere"] == "FAIL"


def test_a_timeout_that_is_not_positive_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["doctor", "--timeout", "0"])
    assert exit_info.value.code == 2
    assert "timeout must be a positive number of seconds" in capsys.readouterr().err


# -- verdicts on their own -----------------------------------------------------------------------


def _probe(*clocks: tuple[float, float]) -> doctor._Probe:
    return doctor._Probe(
        Identity.generate().peer_id, 0.001, True, "dht.ping", (0.001,), tuple(clocks)
    )


def test_clock_skew_verdicts() -> None:
    # the call with the shortest round trip gives the estimate
    assert doctor._clock_check("c", _probe((9.0, 0.5), (0.0001, 0.001))).status is doctor.Status.OK
    ahead = doctor._clock_check("c", _probe((2.5, 0.002)))
    assert ahead.status is doctor.Status.WARN
    assert ahead.detail.startswith("2.5 s ahead of ours")
    behind = doctor._clock_check("c", _probe((-12.0, 0.002)))
    assert behind.status is doctor.Status.FAIL
    assert behind.detail.startswith("12.0 s behind ours")
    assert "NTP" in behind.detail
    unknown = doctor._clock_check("c", _probe())
    assert unknown.status is doctor.Status.WARN
    assert "not readable" in unknown.detail


def test_a_missing_quic_warns_and_a_missing_tcp_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def nothing(name: str) -> type:
        # quic: registered, but its extra (aioquic) is not installed; tcp: not there at all
        error = TransportNotFound(f"no transport named {name!r} (install it)")
        if name == "quic":
            raise error from ModuleNotFoundError("No module named 'aioquic'", name="aioquic")
        raise error

    monkeypatch.setattr(doctor, "resolve_transport", nothing)
    checks, installed = doctor.transport_checks()
    assert installed == []
    verdicts = {check.name: check for check in checks}
    assert verdicts["transport quic"].status is doctor.Status.WARN
    assert 'pip install "swarmavg[quic]"' in verdicts["transport quic"].detail
    assert verdicts["transport tcp"].status is doctor.Status.FAIL
    assert "install it" in verdicts["transport tcp"].detail
