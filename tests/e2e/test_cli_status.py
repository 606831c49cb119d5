"""``swarmavg status``: a run's peers, epochs and ETA as a DHT client reads them (a swarm of
``swarmavg.DHT`` peers with progress trackers in this process, the command in-process through
``main`` or as ``python -m swarmavg``); and the snapshot logic on its own (records as they come
from the network, good and bad)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pty
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from swarmavg import DHT, Address, Identity
from swarmavg._status import (
    parse_declarations,
    parse_records,
    plain_text,
    summarize,
)
from swarmavg.cli import main
from swarmavg.optim.progress_tracker import ProgressTracker
from swarmavg.proto.dht_storage import ValueWithExpiration
from swarmavg.proto.dht_validation import owner_marker
from swarmavg.proto.progress import LocalTrainingProgress

pytestmark = pytest.mark.timeout(30)

FAST = {"min_refresh_period": 0.05, "default_refresh_period": 0.1, "max_refresh_period": 0.2}
WAIT = 10.0


def _wait_for(tracker: ProgressTracker, condition: Callable[[], bool]) -> None:
    """Wait for fetches of ``tracker`` until ``condition()`` holds (at most WAIT s)."""
    deadline = time.monotonic() + WAIT
    fetched = tracker.fetched_global_progress_this_epoch
    while not condition():
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"not true within {WAIT} s: {tracker.global_progress}"
        fetched.clear()
        if not condition():
            fetched.wait(min(remaining, 1.0))


@pytest.fixture
def swarm(fresh_loop: None) -> Iterator[tuple[list[DHT], list[ProgressTracker]]]:
    """Three peers of run ``"run"``: the first at epoch 1 with 7 samples, the second at epoch 0
    with 20, the third a client at epoch 0 with 5; every tracker has read every record."""
    with ExitStack() as stack:
        first = stack.enter_context(DHT())
        dhts = [first] + [stack.enter_context(DHT(first.get_visible_maddrs())) for _ in "ab"]
        trackers = [
            stack.enter_context(ProgressTracker(dht, "run", 100, client_mode=i == 2, **FAST))
            for i, dht in enumerate(dhts)
        ]
        trackers[1].report_local_progress(0, 20)
        trackers[2].report_local_progress(0, 5)
        trackers[0].report_local_progress(0, 3)
        with trackers[0].pause_updates():
            trackers[0].update_epoch(1)
        trackers[0].report_local_progress(1, 7)
        for tracker in trackers:
            _wait_for(
                tracker,
                lambda t=tracker: (
                    (t.global_progress.num_peers, t.global_epoch) == (3, 1)
                    and t.global_progress.samples_accumulated == 7
                ),
            )
        yield dhts, trackers


def _status(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["status", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_once_json_names_every_peer_with_its_epoch_and_the_global_epoch(
    swarm: tuple[list[DHT], list[ProgressTracker]], capsys: pytest.CaptureFixture[str]
) -> None:
    dhts, _ = swarm
    bootstrap = dhts[0].get_visible_maddrs()
    code, out, err = _status(
        capsys,
        "run",
        "--initial-peers",
        *bootstrap,
        "--once",
        "--json",
        "--target-batch-size",
        "100",
    )
    assert code == 0, err
    snapshot = json.loads(out)
    assert out.count("\n") == 1  # one object, one line
    assert snapshot["run_id"] == "run"
    assert snapshot["global_epoch"] == 1  # the client's epoch 0 and the full peer's 0 are behind
    assert snapshot["samples"] == 7  # only the peers at the global epoch count
    assert snapshot["target_batch_size"] == 100
    assert snapshot["num_peers"] == 3
    assert snapshot["num_clients"] == 1
    peers = {peer["peer_id"]: peer for peer in snapshot["peers"]}
    assert set(peers) == {str(dht.peer_id) for dht in dhts}
    epochs = {
        pid: (p["epoch"], p["samples_accumulated"], p["client_mode"]) for pid, p in peers.items()
    }
    assert epochs == {
        str(dhts[0].peer_id): (1, 7, False),
        str(dhts[1].peer_id): (0, 20, False),
        str(dhts[2].peer_id): (0, 5, True),
    }
    assert snapshot["peers"][0]["peer_id"] == str(dhts[0].peer_id)  # the global epoch's first
    assert all(0 <= p["age_s"] < 60 for p in snapshot["peers"])
    assert [view["key"] for view in snapshot["matchmaking"]] == [
        "run_grad_averager.0b",
        "run_state_averager.0b",
    ]
    assert all(view["looking"] == [] for view in snapshot["matchmaking"])  # no averager here


def test_once_text_is_a_headline_and_a_table_and_the_eta_needs_the_target(
    swarm: tuple[list[DHT], list[ProgressTracker]], capsys: pytest.CaptureFixture[str]
) -> None:
    dhts, _ = swarm
    code, out, err = _status(
        capsys, "run", "--initial-peers", *dhts[1].get_visible_maddrs(), "--once"
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == (
        "run 'run': global epoch 1, 7 samples, ETA unknown (pass --target-batch-size); "
        "3 peers (1 clients)"
    )
    assert lines[1].split() == ["peer", "epoch", "samples", "samples/s", "mode", "record", "age"]
    rows = {line.split()[0]: line for line in lines[2:5]}
    assert set(rows) == {dht.peer_id.short() for dht in dhts}
    assert rows[dhts[1].peer_id.short()].split()[1:4] == ["0", "(behind)", "20"]
    assert " client " in rows[dhts[2].peer_id.short()]
    assert "not shown" in lines[-1]  # finished rounds: said, not invented


def test_no_peer_of_the_run_exits_1_once(
    swarm: tuple[list[DHT], list[ProgressTracker]], capsys: pytest.CaptureFixture[str]
) -> None:
    bootstrap = swarm[0][0].get_visible_maddrs()
    code, out, err = _status(capsys, "elsewhere", "--initial-peers", *bootstrap, "--once")
    assert (code, out, err) == (1, "no peer of run 'elsewhere' found\n", "")
    code, out, err = _status(capsys, "elsewhere", "--initial-peers", *bootstrap, "--once", "--json")
    assert code == 1
    assert json.loads(out)["peers"] == []
    assert err == "no peer of run 'elsewhere' found\n"


def test_an_unreachable_bootstrap_peer_is_one_line_and_exit_code_2(
    capsys: pytest.CaptureFixture[str], fresh_loop: None
) -> None:
    ghost = str(Address("tcp", "127.0.0.1", 9, Identity.generate().peer_id))  # (discard port)
    code, out, err = _status(capsys, "run", "--initial-peers", ghost, "--once", "--timeout", "3")
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("swarmavg status: cannot join the swarm: no initial peer answered: ")
    assert ghost in err


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--initial-peers", "tcp://127.0.0.1:9"], "names no PeerID"),
        (["--initial-peers", "nonsense"], "initial peer: invalid address"),
        ([], "--initial-peers"),
    ],
)
def test_bad_arguments_are_usage_errors(
    args: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["status", "run", *args])
    assert exit_info.value.code == 2
    assert complaint in capsys.readouterr().err


def test_the_interval_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    ghost = str(Address("tcp", "127.0.0.1", 9, Identity.generate().peer_id))
    with pytest.raises(SystemExit) as exit_info:
        main(["status", "run", "--initial-peers", ghost, "--interval", "0"])
    assert exit_info.value.code == 2
    assert "interval must be a positive number of seconds" in capsys.readouterr().err


@pytest.mark.process
def test_the_live_view_refreshes_until_ctrl_c_and_exits_0(
    swarm: tuple[list[DHT], list[ProgressTracker]],
) -> None:
    dhts, _ = swarm
    command = [sys.executable, "-m", "swarmavg", "status", "run", "--json", "--interval", "0.1"]
    command += ["--initial-peers", *dhts[2].get_visible_maddrs()]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as child:
        assert child.stdout is not None
        assert child.stderr is not None
        lines: queue.Queue[str] = queue.Queue()
        stdout = child.stdout

        def read() -> None:
            for line in stdout:
                lines.put(line)

        reader = threading.Thread(target=read)
        reader.start()
        try:
            snapshots = [json.loads(lines.get(timeout=WAIT)) for _ in range(3)]
        finally:
            child.send_signal(signal.SIGINT)
            try:
                code = child.wait(WAIT)
            finally:
                if child.poll() is None:  # (it ignored Ctrl+C: fail, leaving no process)
                    child.kill()
                    child.wait()
                reader.join(WAIT)
        err = child.stderr.read()
    assert code == 0, err
    assert "Traceback" not in err
    assert all(s["global_epoch"] == 1 and s["num_peers"] == 3 for s in snapshots)
    assert snapshots[0]["time"] < snapshots[1]["time"] < snapshots[2]["time"]


# -- the snapshot logic, on records as they come from the network ---------------------------------


def _record(identity: Identity, **fields: Any) -> LocalTrainingProgress:
    values: dict[str, Any] = {
        "peer_id": identity.peer_id.to_bytes(),
        "epoch": 3,
        "samples_accumulated": 10,
        "samples_per_second": 5.0,
        "time": 1000.0,
        "client_mode": False,
    }
    values.update(fields)
    return LocalTrainingProgress(**values)


def _entries(*items: tuple[bytes, Any]) -> ValueWithExpiration[Any]:
    return ValueWithExpiration(
        {subkey: ValueWithExpiration(value, 2000.0) for subkey, value in items}, 2000.0
    )


def test_records_that_do_not_parse_or_sit_under_another_peers_subkey_are_left_out() -> None:
    honest, liar = Identity.generate(), Identity.generate()
    good = _record(honest)
    found = _entries(
        (owner_marker(honest.peer_id), good.to_wire()),
        (owner_marker(liar.peer_id), good.to_wire()),  # honest's record under liar's subkey
        (owner_marker(liar.peer_id) + b"x", {"epoch": "many"}),
        (b"tombstone", None),
        (b"junk", [1, 2, 3]),
    )
    assert parse_records(found) == [good]
    assert parse_records(None) == []
    assert parse_records(ValueWithExpiration(b"a plain value", 2000.0)) == []


def test_the_eta_divides_what_is_missing_by_every_peers_speed() -> None:
    a, b, c = (Identity.generate() for _ in range(3))
    records = [
        _record(a, epoch=3, samples_accumulated=30, samples_per_second=4.0, time=1000.0),
        _record(b, epoch=3, samples_accumulated=20, samples_per_second=6.0, time=1000.0),
        _record(c, epoch=2, samples_accumulated=50, samples_per_second=10.0, time=1000.0),
    ]
    snapshot = summarize("r", records, now=1000.0, target_batch_size=100)
    assert (snapshot.global_epoch, snapshot.samples) == (3, 50)
    assert snapshot.eta_s == pytest.approx(50 / 20)
    assert summarize("r", records, now=1000.0, target_batch_size=None).eta_s is None
    stalled = [_record(a, samples_per_second=0.0)]
    assert summarize("r", stalled, now=1000.0, target_batch_size=100).eta_s is None


def test_a_run_of_clients_only_shows_their_epoch_and_old_records_give_way_to_new() -> None:
    a, b = Identity.generate(), Identity.generate()
    records = [
        _record(a, epoch=5, client_mode=True, time=990.0),
        _record(a, epoch=7, client_mode=True, time=995.0),
        _record(b, epoch=6, client_mode=True, time=999.0),
    ]
    snapshot = summarize("r", records, now=1000.0, target_batch_size=None)
    assert snapshot.global_epoch == 7
    assert [(p.peer_id, p.epoch, p.age_s) for p in snapshot.peers] == [
        (a.peer_id, 7, 5.0),
        (b.peer_id, 6, 1.0),
    ]
    assert "(behind)" in plain_text(snapshot)


def test_declarations_show_who_looks_for_a_group_and_when_the_first_round_begins() -> None:
    a, b, c = (Identity.generate() for _ in range(3))
    found = _entries(
        (b.peer_id.to_bytes(), {"looking": True, "begin": 1002.0, "schema": b"s"}),
        (a.peer_id.to_bytes(), {"looking": True, "begin": 1001.5, "schema": b"s"}),
        (c.peer_id.to_bytes(), {"looking": False, "begin": 999.0, "schema": b"s"}),
        (b"not a peer id", {"looking": True, "begin": 1000.0}),
        (a.peer_id.to_bytes() + b"x", {"looking": True, "begin": math.nan}),
        (c.peer_id.to_bytes()[:-1], "garbage"),
    )
    view = parse_declarations("grad_averager", "k.0b", found, now=1000.0)
    assert view.looking == (a.peer_id, b.peer_id)
    assert view.withdrawn == 1
    assert view.next_begin_in_s == pytest.approx(1.5)
    empty = parse_declarations("grad_averager", "k.0b", None, now=1000.0)
    assert (empty.looking, empty.withdrawn, empty.next_begin_in_s) == ((), 0, None)


@pytest.mark.process
def test_on_a_terminal_the_live_view_is_a_rich_table_until_ctrl_c(
    swarm: tuple[list[DHT], list[ProgressTracker]],
) -> None:
    """stdout a terminal (a pty) and rich installed: a live rich table of the run, refreshed in
    place; Ctrl+C leaves it on the screen and exits 0."""
    pytest.importorskip("rich")
    dhts, _ = swarm
    command = [sys.executable, "-m", "swarmavg", "status", "run", "--interval", "0.1"]
    command += ["--target-batch-size", "100", "--initial-peers", *dhts[2].get_visible_maddrs()]
    controller, terminal = pty.openpty()
    env = {**os.environ, "COLUMNS": "160", "LINES": "40", "TERM": "xterm-256color"}
    with subprocess.Popen(
        command, stdout=terminal, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env
    ) as child:
        os.close(terminal)
        screen = b""
        deadline = time.monotonic() + WAIT
        try:  # until the table has been drawn twice (a refresh moves the cursor up)
            while screen.count(b"samples/s") < 2 and time.monotonic() < deadline:
                ready, _, _ = select.select([controller], [], [], 0.5)
                if ready:
                    screen += os.read(controller, 65536)
        finally:
            child.send_signal(signal.SIGINT)
            code = child.wait(WAIT)
            with contextlib.suppress(OSError):  # (the pty's other end is closed: EIO)
                while select.select([controller], [], [], 0.2)[0]:
                    screen += os.read(controller, 65536)
            os.close(controller)
        assert child.stderr is not None
        err = child.stderr.read().decode()
    assert code == 0, err
    assert "Traceback" not in err
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.decode(errors="replace"))
    assert "\x1b[" in screen.decode(errors="replace")  # drawn with escape codes, in place
    assert "global epoch 1, 7/100 samples" in text
    assert "3 peers (1" in text
    for column in ("peer", "epoch", "samples/s", "mode", "record age"):
        assert column in text
    assert "┃" in text or "│" in text  # a table's borders, not the plain text
    assert screen.count(b"samples/s") >= 2  # refreshed
    for dht in dhts:  # a row per peer, named by the end of its PeerID
        assert str(dht.peer_id)[-8:] in text
    assert "0 (behind)" in text
    assert "client" in text
