"""The Accumulator with real processes over TCP on 127.0.0.1: four peers in one cohort (three
``swarmavg.Accumulator`` in moolib's loop, one ``swarmavg.aio.accumulator.Accumulator``: async
and sync peers mixed), each contributing a constant gradient equal to its value (1, 2, 3, 4);
one (value 4) is SIGKILLed right after its first contribution that follows a result all four
applied: mid-accumulation. The survivors must
apply exactly the mean of the contributions that reached each result, go on to the last round
and end at the same model version with the same parameter, bit for bit.

Every result's expected value is known: the survivors report their contributions since their
previous result (``mine``), and the killed peer's are the rest of the result's
``num_gradients`` (its value is 4), so ``.grad`` must be
``(sum of mine_i * value_i + rest * 4) / num_gradients`` everywhere.

The sync peers run moolib's loop as it is: a ``reduce_gradients`` that ``wants_gradients()``
allowed is never refused, even when the cohort changed in between (a member joining while the
others already train): the contribution waits for the next count.

Each peer waits, before it trains, until its accumulator's epoch holds all four members:
waiting for ``Group.members()`` to list four was not enough (in one run of two, one peer then
applied 30 results alone within 0.8 s while the group listed four members; reported too)."""

from __future__ import annotations

import contextlib
import math
import queue
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.e2e._jsonl import JsonLinesPeer

pytestmark = pytest.mark.process

PEER = Path(__file__).with_name("_accumulator_peer.py")
VALUES = (1.0, 2.0, 3.0, 4.0)
APIS = ("sync", "sync", "async", "sync")
VICTIM = 3
ROUNDS = 30


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_survivors_apply_the_exact_mean_after_a_peer_is_killed_mid_round(tmp_path: Path) -> None:
    peers: list[JsonLinesPeer] = []

    def start(i: int, initial: str) -> JsonLinesPeer:
        argv = [sys.executable, str(PEER), "--api", APIS[i], "--members", str(len(VALUES))]
        argv += ["--value", str(VALUES[i]), "--rounds", str(ROUNDS), "--round-timeout", "10"]
        argv += ["--deadline", "110", "--step-delay", "0.02"]
        argv += ["--initial-peers", initial] if initial else []
        peer = JsonLinesPeer(i, tmp_path, argv)
        peers.append(peer)
        return peer

    results: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)  # version -> peer -> event

    def record(peer: JsonLinesPeer) -> Any:
        def seen(event: dict[str, Any]) -> bool:
            if event["event"] == "result":
                results[event["version"]][peer.index] = event
            return event["event"] == "done"

        return seen

    try:
        first = start(0, "")
        for i in range(1, len(VALUES)):  # (all at once: they import while peer 0 starts)
            start(i, "-")
        address = first.wait_for(lambda e: e["event"] == "started", 90)["address"]
        for peer in peers[1:]:
            peer.send(address)
        victim = peers[VICTIM]
        # armed once all four applied the same result (peers that start alone may first apply
        # results of their own, until they meet and download the leader's model)
        deadline = time.monotonic() + 100
        while not (full := [v for v, seen in results.items() if len(seen) == len(VALUES)]):
            assert time.monotonic() < deadline, f"no result of all four peers: {dict(results)}"
            for peer in peers:
                with contextlib.suppress(queue.Empty):
                    event = peer.events.get(timeout=0.01)
                    assert event["event"] not in ("error", "eof"), (peer.index, event)
                    if event["event"] == "result":
                        results[event["version"]][peer.index] = event
        victim.wait_for(lambda e: e["event"] == "contributed", 30)  # (at once, usually)
        victim.proc.kill()
        survivors = [p for p in peers if p.index != VICTIM]
        done = {p.index: p.wait_for(record(p), 90) for p in survivors}
        for p in survivors:
            p.send("exit")
        for p in survivors:
            assert p.proc.wait(30) == 0
    finally:
        for p in peers:
            p.close()

    # the survivors end at the same version with the same parameter
    assert {d["version"] for d in done.values()} == {ROUNDS}
    assert len({d["digest"] for d in done.values()}) == 1
    survivor_values = {p: VALUES[p] for p in done}
    survivors_only = 0
    for version in range(min(full), ROUNDS + 1):
        seen = results[version]
        assert set(done) <= set(seen), f"version {version}: results from {sorted(seen)}"
        # the same result everywhere, one value in every element
        assert len({(e["min"], e["max"]) for e in seen.values()}) == 1
        assert len({tuple(sorted(e["stats"].items())) for e in seen.values()}) == 1
        event = next(iter(seen.values()))
        value, stats = event["min"], event["stats"]
        assert event["max"] == value
        n = stats["num_gradients"]
        mine = {p: e["mine"] for p, e in seen.items() if p in survivor_values}
        rest = n - sum(mine.values())  # the victim's contributions to this result
        assert rest >= 0, f"version {version}: {stats} but survivors made {mine}"
        expected = (
            sum(m * survivor_values[p] for p, m in mine.items()) + rest * VALUES[VICTIM]
        ) / n
        assert math.isclose(value, expected, rel_tol=1e-6), (version, value, expected, mine, stats)
        assert stats["num_skipped"] == 0
        assert stats["batch_size"] == n
        if VICTIM in seen:
            assert seen[VICTIM]["mine"] == rest
        if rest == 0:
            survivors_only += 1
    # after the kill, results of the survivors alone
    assert survivors_only >= ROUNDS - min(full) - 2
