"""The ``swarmavg`` command: ``link-demo`` and the two-machine commands (serve, ping) on loopback
(``swarmavg demo``, the averaging main job, is tested in ``test_cli_demo.py``)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Callable

import pytest

CLI = [sys.executable, "-m", "swarmavg.cli"]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.process
@pytest.mark.parametrize("encryption", [True, False])
def test_link_demo_runs_two_processes_over_tcp(encryption: bool) -> None:
    args = ["link-demo", "--calls", "50", "--megabytes", "32"]
    out = _run(*args, *([] if encryption else ["--no-encryption"]))
    assert out.returncode == 0, out.stderr
    address = re.search(r"listening at (tcp://127\.0\.0\.1:\d+/p/(\S+))", out.stdout)
    assert address, out.stdout
    peer_id = address.group(2)
    # the caller checked the key behind the PeerID it dialed, and says whether data is secret
    how = "encrypted" if encryption else "NOT encrypted"
    assert f"connected to {peer_id} over tcp in " in out.stdout
    assert f"its key is proven, {how}\n" in out.stdout
    assert re.search(r"rpc round trip \(50 unary calls\): median \d+ µs, p90 \d+ µs", out.stdout)
    assert re.search(r"bulk upload: 32 MiB in [0-9.]+ s = [0-9.]+ [GM]B/s", out.stdout), out.stdout
    assert out.stderr == ""


@pytest.mark.process
def test_link_demo_runs_two_processes_over_quic() -> None:
    out = _run("link-demo", "--transport", "quic", "--calls", "50", "--megabytes", "32")
    assert out.returncode == 0, out.stderr
    address = re.search(r"listening at (quic://127\.0\.0\.1:\d+/p/(\S+))", out.stdout)
    assert address, out.stdout
    assert f"connected to {address.group(2)} over quic in " in out.stdout
    assert "its key is proven, encrypted\n" in out.stdout
    assert re.search(r"bulk upload: 32 MiB in [0-9.]+ s = [0-9.]+ [GM]B/s", out.stdout), out.stdout
    assert out.stderr == ""


@pytest.mark.process
def test_one_server_on_tcp_and_quic_at_once() -> None:
    """A node listens on both transports; callers dial whichever scheme their address names."""
    with subprocess.Popen(
        [*CLI, "serve", "--listen", "tcp://127.0.0.1:0", "--listen", "quic://127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as server:
        try:
            assert server.stdout is not None
            assert server.stdout.readline().startswith("serving as ")
            addresses = [server.stdout.readline().split("dial me at: ")[1].strip() for _ in "ab"]
            assert sorted(a.split(":")[0] for a in addresses) == ["quic", "tcp"]
            for address in addresses:
                out = _run("ping", address, "--calls", "10", "--megabytes", "2")
                assert out.returncode == 0, out.stderr
                assert f"over {address.split(':')[0]} in " in out.stdout
            server.send_signal(signal.SIGINT)
            assert server.wait(30) == 130
        finally:
            if server.poll() is None:
                server.kill()


@pytest.mark.process
def test_serve_and_ping() -> None:
    """What the README tells two machines to do, on one: serve prints an address, ping uses it."""
    with subprocess.Popen(
        [*CLI, "serve", "--listen", "tcp://127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as server:
        try:
            assert server.stdout is not None
            first = server.stdout.readline()
            assert first.startswith("serving as "), first
            line = server.stdout.readline()
            address = line.split("dial me at: ")[1].strip()
            out = _run("ping", address, "--calls", "10", "--megabytes", "4")
            assert out.returncode == 0, out.stderr
            assert "its key is proven, encrypted" in out.stdout
            assert "bulk upload: 4 MiB" in out.stdout
            # the wrong PeerID for that address: the caller refuses to talk to the impostor
            other = "12D3KooWKXBdwiTBFFaqe9Ls3mi9giZCrDoSATMBqRFEhCrCK7EA"
            wrong = address.rsplit("/p/", 1)[0] + "/p/" + other
            out = _run("ping", wrong, "--calls", "1", "--megabytes", "0")
            assert out.returncode == 1
            assert "PeerIdentityMismatch" in out.stderr, out.stderr
            # Ctrl+C stops the server cleanly
            server.send_signal(signal.SIGINT)
            assert server.wait(30) == 130
            assert server.stderr is not None
            assert server.stderr.read() == "interrupted\n"
        finally:
            if server.poll() is None:
                server.kill()


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (["link-demo", "--megabytes", "-1"], "--megabytes"),
        (["link-demo", "--calls", "0"], "--calls"),
        (["ping", "not an address"], "address"),
    ],
)
def test_bad_arguments_are_named(
    args: list[str], name: str, usage_error: Callable[[list[str]], str]
) -> None:
    assert name in usage_error(args)


@pytest.mark.process
def test_ping_without_a_server_fails_cleanly() -> None:
    out = _run(
        "ping",
        "tcp://127.0.0.1:9/p/12D3KooWKXBdwiTBFFaqe9Ls3mi9giZCrDoSATMBqRFEhCrCK7EA",
        "--calls",
        "1",
        timeout=60,
    )
    assert out.returncode == 1
    assert out.stderr.startswith("swarmavg ping: ")
    assert "Traceback" not in out.stderr


def test_help_reads_cleanly_and_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    from swarmavg.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out  # (no raw reStructuredText)
    assert ":mod:" not in out
    for command in ("demo", "link-demo", "serve", "dht", "ping", "status", "doctor"):
        assert command in out
    assert max(len(line) for line in out.splitlines()) <= 100
