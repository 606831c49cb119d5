"""``swarmavg demo averaging``: a local swarm of peer processes averages to the exact mean;
failures and Ctrl+C stop every process."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from swarmavg._demo import STEP_TIMEOUT, group_bits, lonely_peers, reaches_exact_mean

CLI = [sys.executable, "-m", "swarmavg.cli"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: a table row: round, groups, matchmaking, all-reduce, GB/s, distance to the mean
ROW = re.compile(
    r"^\s+(\d+)  (\S.*?)\s+([0-9.]+) s\s+([0-9.]+) s\s+([0-9.]+)\s+([0-9.]+e[+-]\d+)$", re.M
)


def _demo(*args: str, cwd: Path, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "demo", "averaging", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


@pytest.mark.process
@pytest.mark.timeout(120)
def test_four_peers_reach_the_exact_mean(tmp_path: Path) -> None:
    out = _demo("--size", "100000", "--rounds", "3", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    # stderr is not a terminal: the progress is plain lines
    assert "swarmavg demo: 4 peers ready in " in out.stderr
    assert "swarmavg demo: round 3/3 in " in out.stderr
    start = re.search(r"^start  -\s+-\s+-\s+-\s+([0-9.]+e[+-]\d+)$", out.stdout, re.M)
    assert start, out.stdout
    assert float(start.group(1)) > 0.5  # the peers' random tensors are far from their mean
    rows = {int(m.group(1)): m.groups()[1:] for m in ROW.finditer(out.stdout)}
    assert sorted(rows) == [1, 2, 3], out.stdout
    # a 2x2 grid: pairs first, then pairs across the first round's pairs: the exact mean
    assert rows[1][0] == "0+1 2+3"
    assert rows[2][0] in ("0+2 1+3", "0+3 1+2")
    for number in (1, 2, 3):
        _, matchmaking, allreduce, rate, distance = rows[number]
        assert float(matchmaking) >= 0
        assert float(allreduce) > 0
        assert float(rate) > 0
        assert (float(distance) < 1e-5) == (number > 1)
    assert "every peer holds the exact mean (up to float32 rounding) from round 2" in out.stdout
    assert "||x_i - m|| / ||m||, m the exact mean of all peers' initial tensors" in out.stdout
    plot = tmp_path / "swarmavg-demo.png"
    assert f"convergence plot: {plot.name}" in out.stdout
    assert plot.read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.process
@pytest.mark.timeout(120)
def test_without_matplotlib_the_distances_go_to_a_csv_file(tmp_path: Path) -> None:
    """The plot is optional: without matplotlib one line says how to get it, and the demo
    writes the distances to a CSV file instead (two peers reach the mean in one round)."""
    code = (
        "import sys; sys.modules['matplotlib'] = None; from swarmavg.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    args = [
        "demo",
        "averaging",
        "--peers",
        "2",
        "--rounds",
        "2",
        "--size",
        "1k",
        "--plot",
        "out/conv.png",
    ]
    (tmp_path / "out").mkdir()
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    hints = [line for line in out.stdout.splitlines() if "pip install swarmavg[demo]" in line]
    assert len(hints) == 1, out.stdout
    assert not (tmp_path / "out" / "conv.png").exists()
    with open(tmp_path / "out" / "conv.csv", newline="") as file:
        rows = list(csv.reader(file))
    assert rows[0] == ["round", "max_distance", "peer_0", "peer_1"]
    assert [row[0] for row in rows[1:]] == ["0", "1", "2"]
    assert float(rows[1][1]) > 0.1
    assert float(rows[2][1]) < 1e-5
    assert float(rows[3][1]) < 1e-5


@pytest.mark.process
@pytest.mark.timeout(120)
def test_a_peer_without_a_group_sits_the_round_out_at_once(tmp_path: Path) -> None:
    """Three peers in groups of two: each round one is left over, and the demo tells it to stop
    looking as soon as the other two have their group, instead of letting it time out."""
    out = _demo("--peers", "3", "--rounds", "2", "--size", "1000", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "note: 3 peers do not fill a grid of groups of 2" in out.stdout
    rows = {int(m.group(1)): m.groups()[1:] for m in ROW.finditer(out.stdout)}
    assert sorted(rows) == [1, 2], out.stdout
    for groups, *_ in rows.values():
        assert re.fullmatch(r"\d\+\d \(\d\)", groups), groups
    seconds = [float(s) for s in re.findall(r"round \d/2 in ([0-9.]+) s", out.stderr)]
    assert len(seconds) == 2
    assert max(seconds) < STEP_TIMEOUT / 2  # not the leftover peer's step timeout
    assert "distance to the mean after 2 rounds: " in out.stdout


def test_the_initial_bits_make_a_grid() -> None:
    assert group_bits(4, 2) == ["0", "0", "1", "1"]
    assert group_bits(8, 2) == ["00", "00", "01", "01", "10", "10", "11", "11"]
    assert group_bits(8, 4) == ["0"] * 4 + ["1"] * 4
    assert group_bits(3, 2) == ["", "", ""]
    assert group_bits(5, 2) == ["0", "0", "0", "1", "1"]
    assert [reaches_exact_mean(p, g) for p, g in [(4, 2), (8, 2), (16, 4), (3, 3)]] == [True] * 4
    assert [reaches_exact_mean(p, g) for p, g in [(3, 2), (5, 2), (6, 3)]] == [False] * 3


def _report(group: str | None, bits: str, size: int = 2) -> dict[str, object]:
    return {"group": group, "bits": bits, "group_size": size}


def test_lonely_peers() -> None:
    bits = ["0", "0", "0", "1", "1"]
    assert lonely_peers(bits, {}) == []  # everyone may still find a partner
    # peers 0 and 1 averaged (both reported); 3 and 4 still look: 2 is alone under "0"
    done = {0: _report("a", "0"), 1: _report("a", "0")}
    assert lonely_peers(bits, done) == [2]
    # only peer 0 of group "a" reported: 1 is still in that group, and 2 may be too
    assert lonely_peers(bits, {0: _report("a", "0")}) == []
    # a peer that gave up (no group) leaves the others under its bits alone
    assert lonely_peers(["", ""], {0: _report(None, "")}) == [1]
    assert lonely_peers(["0", "1"], {}) == [0, 1]


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (["--peers", "1"], "--peers"),
        (["--peers", "many"], "--peers"),
        (["--group-size", "5"], "--group-size"),
        (["--group-size", "1"], "--group-size"),
        (["--rounds", "0"], "--rounds"),
        (["--size", "0"], "--size"),
        (["--size", "lots"], "--size"),
        (["--seed", "-1"], "--seed"),
        (["--transport", "udp"], "--transport"),
        (["--transport", "quic", "--no-encryption"], "--no-encryption"),
        (["--plot", "no/such/directory/plot.png"], "--plot"),
    ],
)
def test_bad_arguments_are_named(
    tmp_path: Path, args: list[str], name: str, usage_error: Callable[[list[str]], str]
) -> None:
    err = usage_error(["demo", "averaging", *args])
    assert name in err.splitlines()[-1], err
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


def _start(tmp_path: Path) -> subprocess.Popen[str]:
    """A demo with rounds enough to be stopped in the middle."""
    return subprocess.Popen(
        [*CLI, "demo", "averaging", "--size", "100000", "--rounds", "1000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )


def _wait_for_round(demo: subprocess.Popen[str], number: int) -> None:
    assert demo.stdout is not None
    for line in demo.stdout:  # bounded by the test's timeout
        match = ROW.match(line.rstrip("\n"))
        if match and int(match.group(1)) == number:
            return
    pytest.fail(f"the demo ended before round {number}")


def _kill(demo: subprocess.Popen[str]) -> None:
    """After a failed test: the demo and its peers, if still there."""
    if demo.poll() is None:
        for child in _children(demo):
            child.kill()
        demo.kill()
        demo.wait()


def _children(demo: subprocess.Popen[str]) -> list[psutil.Process]:
    children: list[psutil.Process] = psutil.Process(demo.pid).children(recursive=True)
    return children


@pytest.mark.process
@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["while the peers start", "between rounds"])
def test_ctrl_c_stops_every_peer(tmp_path: Path, when: str) -> None:
    with _start(tmp_path) as demo:
        try:
            if when == "between rounds":
                _wait_for_round(demo, 1)
                children = _children(demo)
            else:
                children = []
                while len(children) < 4 and demo.poll() is None:
                    time.sleep(0.05)
                    children = _children(demo)
            assert len(children) == 4
            demo.send_signal(signal.SIGINT)
            assert demo.wait(30) == 130
            assert demo.stderr is not None
            assert demo.stderr.read().endswith("interrupted\n")
            # the demo waited for its peers: none is left, not even as a zombie
            assert [p.pid for p in children if p.is_running()] == []
        finally:
            _kill(demo)


@pytest.mark.process
@pytest.mark.timeout(120)
def test_a_failing_peer_fails_the_demo_with_its_error(tmp_path: Path) -> None:
    with _start(tmp_path) as demo:
        try:
            _wait_for_round(demo, 1)
            children = _children(demo)
            assert len(children) == 4
            victim = children[2]
            index = json.loads(victim.cmdline()[-1])["index"]
            victim.kill()
            assert demo.wait(30) == 1
            assert demo.stderr is not None
            error = demo.stderr.read().splitlines()[-1]
            assert error == f"swarmavg demo: PeerFailed: peer {index} exited (killed by SIGKILL)"
            assert [p.pid for p in children if p.is_running()] == []
        finally:
            _kill(demo)


def _pythonpath() -> list[str]:
    return [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]


@pytest.mark.process
@pytest.mark.timeout(120)
def test_a_peer_error_is_the_demo_error(tmp_path: Path) -> None:
    """A peer that fails to start (here: torch does not import in the peer processes; the demo
    process itself does not need it) fails the demo with its error and its traceback."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    out = subprocess.run(
        [*CLI, "demo", "averaging", "--size", "1000"],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,
        # (an inherited PYTHONPATH stays behind ours: it may be where swarmavg comes from)
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *_pythonpath()])},
    )
    assert out.returncode == 1
    last = out.stderr.splitlines()[-1]
    assert re.fullmatch(
        r"swarmavg demo: PeerFailed: peer \d failed: ModuleNotFoundError: import of torch halted.*",
        last,
    ), out.stderr
    assert "stderr ---\nTraceback (most recent call last):" in out.stderr
    assert not (tmp_path / "swarmavg-demo.png").exists()


@pytest.mark.process
@pytest.mark.timeout(120)
def test_the_progress_bar_stands_at_zero_until_the_first_round(tmp_path: Path) -> None:
    """On a terminal the bar counts the rounds' reports: the peers' startup shows in its label,
    at 0% (it used to count the startup too, and stood at 40% before round 1)."""
    master, slave = os.openpty()
    chunks: list[bytes] = []

    def read() -> None:
        with contextlib.suppress(OSError):  # EIO once the demo closed its end
            while data := os.read(master, 4096):
                chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        out = subprocess.run(
            [*CLI, "demo", "averaging", "--peers", "2", "--rounds", "2", "--size", "1k"],
            stdout=subprocess.PIPE,
            stderr=slave,
            text=True,
            timeout=90,
            cwd=tmp_path,
        )
    finally:
        os.close(slave)
    reader.join(10)
    os.close(master)
    assert out.returncode == 0
    bars = re.findall(r"\[[#-]+\]\s+(\d+)%  (.*?)  [0-9.]+ s", b"".join(chunks).decode())
    assert bars
    first_round = next(i for i, (_, label) in enumerate(bars) if label.startswith("round 1"))
    assert first_round > 0
    assert {percent for percent, _ in bars[:first_round]} == {"0"}, bars[:first_round]
    assert any(label.startswith("starting 2 peers: 2 loaded") for _, label in bars)
    assert [percent for percent, _ in bars][-1] == "100"
