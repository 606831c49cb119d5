"""``swarmavg demo``: peer processes train the workload together with ``swarmavg.Optimizer``
(and one process alone); a peer killed halfway does not stop the others; Ctrl+C leaves no
process behind. Short settings (2-3 peers, a few epochs); the output is not a terminal, so the
view is plain lines; the rich view is checked on its own, on a stand-in terminal."""

from __future__ import annotations

import csv
import importlib
import io
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from swarmavg._train_demo import (
    CSV_NAME,
    PLOT_NAME,
    TrainOptions,
    _PlainView,
    _RichView,
    _Swarm,
    _view,
    _write_plot,
)

CLI = [sys.executable, "-m", "swarmavg.cli", "demo"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: the summary's line on the peers that finished
REACHED = re.compile(
    r"^peers? ([\d, ]+) reached epoch (\d+) of (\d+) .*validation loss fell from "
    r"([0-9.]+) to ([0-9.]+)",
    re.M,
)


def _demo(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=100, cwd=cwd)


@pytest.mark.process
@pytest.mark.timeout(120)
def test_two_peers_train_and_plot(tmp_path: Path) -> None:
    out = _demo("--peers", "2", "--epochs", "3", "--out", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    # not a terminal: one line per swarm epoch, with every process
    lines = [line for line in out.stdout.splitlines() if line.startswith("swarm epoch 3/3")]
    assert lines, out.stdout
    assert all(f"{name}: " in lines[-1] for name in ("peer 0", "peer 1", "alone"))
    reached = REACHED.search(out.stdout)
    assert reached, out.stdout
    peers, epoch, epochs, first, last = reached.groups()
    assert (peers, epoch, epochs) == ("0, 1", "3", "3")
    assert float(last) < float(first) - 0.3  # from ~5.5 (a uniform guess) down
    alone = re.search(r"^one process alone .*: validation loss ([0-9.]+)", out.stdout, re.M)
    assert alone, out.stdout
    assert float(alone.group(1)) < float(first) - 0.3
    plot = tmp_path / PLOT_NAME
    assert f"plot: {plot}" in out.stdout
    data = plot.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000


@pytest.mark.process
@pytest.mark.timeout(120)
def test_kill_one_the_survivors_finish(tmp_path: Path) -> None:
    out = _demo("--peers", "3", "--epochs", "6", "--kill-one", "--no-plot", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    killed = re.search(r"^killed peer 2 \(SIGKILL\) at swarm epoch (\d+)", out.stdout, re.M)
    assert killed, out.stdout
    assert 3 <= int(killed.group(1)) < 6
    reached = REACHED.search(out.stdout)
    assert reached, out.stdout
    assert reached.groups()[:3] == ("0, 1", "6", "6")
    assert re.search(r"^peer 2 +killed ", out.stdout, re.M), out.stdout
    # the view went on after the kill, showing it gone
    after = out.stdout[killed.end() :]
    assert "swarm epoch 6/6" in after
    assert "peer 2: killed" in after
    assert list(tmp_path.iterdir()) == []  # --no-plot: no PNG, no CSV


def _children(demo: subprocess.Popen[str]) -> list[psutil.Process]:
    children: list[psutil.Process] = psutil.Process(demo.pid).children(recursive=True)
    return children


@pytest.mark.process
@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    with subprocess.Popen(
        [*CLI, "--peers", "2", "--epochs", "1000", "--no-plot"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    ) as demo:
        try:
            assert demo.stdout is not None
            for line in demo.stdout:  # bounded by the test's timeout
                if line.startswith("swarm epoch 1/"):
                    break
            else:
                pytest.fail("the demo ended before its first epoch")
            children = _children(demo)
            assert len(children) == 3  # two peers, one alone
            demo.send_signal(signal.SIGINT)
            assert demo.wait(30) == 130
            assert demo.stderr is not None
            assert demo.stderr.read().endswith("interrupted\n")
            # the demo waited for them: none is left, not even as a zombie
            assert [p.pid for p in children if p.is_running()] == []
        finally:
            if demo.poll() is None:
                for child in _children(demo):
                    child.kill()
                demo.kill()
                demo.wait()


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (["--peers", "1"], "--peers"),
        (["--epochs", "0"], "--epochs"),
        (["--optimizer", "sgd"], "--optimizer"),
        (["--target-batch-size", "8"], "--target-batch-size"),
        (["--out", "no/such/directory"], "--out"),
    ],
)
def test_bad_arguments_are_named(
    tmp_path: Path, args: list[str], name: str, usage_error: Callable[[list[str]], str]
) -> None:
    err = usage_error(["demo", *args])
    assert name in err.splitlines()[-1], err
    assert list(tmp_path.iterdir()) == []


def _swarm_with_history() -> _Swarm:
    """Two peers and the process alone, as their reports would leave them after 2 epochs."""
    swarm = _Swarm(TrainOptions(peers=2, epochs=2, target_batch_size=64))
    for index in range(3):
        swarm.on_event(index, {"event": "ready"})
        for epoch, loss in ((0, 5.5), (1, 4.0), (2, 3.0)):
            report = {"event": "epoch", "epoch": epoch, "val_loss": loss + index / 10}
            swarm.on_event(index, report | {"seconds": 1.0, "averaging": 0.25, "group": 2})
        swarm.on_event(index, {"event": "done", "epoch": 2, "samples": 128, "loss": 3.1})
    return swarm


def test_without_matplotlib_a_csv_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    line = _write_plot(tmp_path, _swarm_with_history(), "title")
    assert "pip install swarmavg[demo]" in line
    assert not (tmp_path / PLOT_NAME).exists()
    with open(tmp_path / CSV_NAME, newline="") as file:
        rows = list(csv.reader(file))
    assert rows[0] == ["process", "epoch", "samples", "val_loss", "compute_s", "averaging_s"]
    assert rows[1:4] == [
        ["peer 0", "0", "0", "5.5", "", ""],
        ["peer 0", "1", "64", "4.0", "0.75", "0.25"],
        ["peer 0", "2", "128", "3.0", "0.75", "0.25"],
    ]
    assert [row[0] for row in rows[1:]] == ["peer 0"] * 3 + ["peer 1"] * 3 + ["alone"] * 3


def test_the_eta_follows_the_swarm_pace() -> None:
    swarm = _Swarm(TrainOptions(peers=2, epochs=10))
    assert swarm.eta() is None
    now = time.monotonic()
    swarm.epoch_reached = {0: now - 6.0, 1: now - 4.0, 2: now - 2.0}
    for process in swarm.peers:
        process.epoch = 2
    eta = swarm.eta()
    assert eta == pytest.approx(2.0 * 8)
    assert "swarm epoch 2/10, 2 peers, ETA 16 s" in swarm.headline()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _swarm_at_epoch_two_with_peer_one_killed() -> _Swarm:
    swarm = _Swarm(TrainOptions(peers=3, epochs=10))
    for index in range(4):  # three peers and the process alone
        swarm.on_event(index, {"event": "ready"})
        swarm.on_event(index, {"event": "epoch", "epoch": 0, "val_loss": 5.5})
        for epoch in (1, 2):
            if index == 1 and epoch == 2:
                continue
            swarm.on_event(
                index,
                {
                    "event": "epoch",
                    "epoch": epoch,
                    "seconds": 1.0,
                    "averaging": 0.25,
                    "group": None if index == 3 else 3 - (epoch == 2),
                    "val_loss": 5.0 - epoch,
                },
            )
        swarm.on_event(
            index,
            {
                "event": "progress",
                "samples": 100 + index,
                "samples_per_s": 321.0 + index,
                "loss": 2.5 + index / 10,
                "group": None if index == 3 else 2,
            },
        )
    swarm.processes[1].state = "killed"
    swarm.killed = (1, 1)
    return swarm


def test_on_a_terminal_the_live_view_is_a_rich_table() -> None:
    """With rich and a terminal: a table with the swarm's headline (epoch, peers, ETA, the peer
    killed) and a row per process (state, epoch, samples/s, loss, last group)."""
    pytest.importorskip("rich")
    swarm = _swarm_at_epoch_two_with_peer_one_killed()
    out = _Terminal()
    view = _view(swarm, out)
    assert isinstance(view, _RichView)
    with view:
        view.note("peer 1 killed")
        view.refresh()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    assert "peer 1 killed" in text
    assert "swarm epoch 2/10, 2 peers" in text  # (a killed peer is not counted)
    assert "(peer 1 was killed at epoch 1)" in text
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if "│" in line}
    assert set(rows) >= {"peer 0", "peer 1", "peer 2", "alone"}
    cells = [cell.strip() for cell in rows["peer 2"].split("│")[1:-1]]
    assert cells == ["peer 2", "training", "2", "323", "2.700", "2"]
    assert [cell.strip() for cell in rows["peer 1"].split("│")[1:-1]][:3] == [
        "peer 1",
        "killed",
        "1",
    ]
    assert [cell.strip() for cell in rows["alone"].split("│")[1:-1]][-1] == "-"


def test_the_view_is_plain_lines_off_a_terminal_or_without_rich(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    swarm = _swarm_at_epoch_two_with_peer_one_killed()
    off_terminal = io.StringIO()
    view = _view(swarm, off_terminal)
    assert isinstance(view, _PlainView)
    view.refresh()
    line = off_terminal.getvalue()
    assert line.startswith("swarm epoch 2/10, 2 peers")
    assert "peer 1: killed" in line
    assert "peer 2: epoch 2, 323/s, loss 2.70, group 2" in line
    real_import = importlib.import_module

    def without_rich(name: str, package: str | None = None) -> object:
        if name.startswith("rich"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", without_rich)
    assert isinstance(_view(swarm, _Terminal()), _PlainView)
