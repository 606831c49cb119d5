"""``benchmarks/averaging.py --faults``: survivors' step times before and after a peer leaves
(Ctrl+C) or dies (SIGKILL) at each stage of a round, swarmavg beside hivemind 1.1.12.

A scenario is (system, transport, N, fault, stage). N peer processes (``_fault_peer.py``, each a
process group of its own, under our Python or hivemind's) start a DHT each over the transport
(peer 0 the bootstrap, the others joining it in turn) and an averager over one float32 tensor
of ``--fault-size`` elements with ``target_group_size=N`` and the system's defaults otherwise
(hivemind: ``allreduce_timeout`` = the step timeout, so that its steps are bounded too; its
``step(timeout=...)`` bounds only the search for a group, ours the whole step). After
``--fault-settle`` s every peer runs a training loop from the same moment:
``step(timeout=--fault-step-timeout)``, then ``--fault-compute`` s of "compute" (its tensor
changed by a constant of its own), again. Peer N-1 (not the DHT's bootstrap) is the victim: in
its step number ``--fault-warmup`` + ``--fault-before`` it signals at the stage asked for
(``leave``: SIGINT to its training process, i.e. Ctrl+C: a step in progress ends with
``KeyboardInterrupt``, then the script shuts its averager and DHT down and exits; hivemind's
averager sets SIGINT to ``SIG_IGN`` in the training process, so the script puts Python's
handler back first, see ``_fault_peer.py``; ``die``: SIGKILL to its process group, i.e. the
whole peer, hivemind's DHT and averager processes and p2pd daemon too):

- ``idle``: halfway through its compute pause before that step (the others compute or begin);
- ``looking``: after a quarter of its median matchmaking time of the earlier steps in that
  step (its group often forms sooner than the median: half missed it 5 times in a row);
- ``allreduce``: as soon as it sees its all-reduce begin (stage polled every 2 ms);
- ``allreduce-mid``: half its median all-reduce time of the earlier steps after that
  (mid-transfer, when the all-reduce lasts long enough to tell).

When that moment finds the victim's step past the stage asked for (its group formed sooner
than usual, say), the fault moves to its next step (at most 5 times): the table's
"victim at" says where it landed.

Figures (over the survivors; a survivor's "round j after" is its j-th step after the one that
ended first after the fault, the "fault round"): the median over the rounds before (after the
warm-up) of the round's step time (max over survivors); the step time of the fault round and
of the first three after (max over survivors), and how many survivors' steps raised, with
what; whether the survivors' tensors agree exactly (BLAKE2b digests) after the first round
after the fault that was complete (every survivor's step returned a group of all N-1, with
every member contributing and, ours, the same group id and nothing kept local), or their
largest difference; whether the second round after is within 2x the median before (the
issue's target). The victim's stage at the fault as it saw it, and for ``leave`` how long its
shutdown took.

Everything is bounded: a scenario that does not finish within ``--fault-scenario-timeout``
is reported as hung (what was pending) and its processes killed. Processes are reused from
one scenario to the next (the victim's slot gets a fresh one); a scenario's failure kills its
processes and the next one starts fresh ones. Every process's stderr (our INFO logs,
hivemind's) goes to a file under ``--fault-logs``; the driver writes ``=== ...`` markers into
them, and the WARNING/ERROR lines survivors logged from the fault to the end of the scenario
are kept in the result.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from _averaging_common import hivemind_sockets, remove_stale_sockets

HERE = Path(__file__).resolve().parent
PEER_SCRIPT = HERE / "_fault_peer.py"
MiB = 1 << 20
STAGES = ("idle", "looking", "allreduce", "allreduce-mid")
KINDS = ("leave", "die")
SIGNALS = {"leave": "SIGINT", "die": "SIGKILL"}
MAX_REARM = 5  # (as _fault_peer.py: the victim moves its fault this many steps on at most)
#: starts a peer process as ``subprocess.Popen`` does (tests/test_bench_averaging_faults.py
#: puts in the tests' fork server: tests/forkserver.py)
start_peer: Callable[..., Any] = subprocess.Popen
SPAWN_TIMEOUT = 240.0  # processes up, torch and the system imported (2 CPUs, 8 imports)
OP_TIMEOUT = 90.0  # a DHT start, an averager made
EXIT_TIMEOUT = 60.0  # a leaving victim's shutdown, survivors' teardown
TARGET_RATIO = 2.0  # the issue: back within 2x by the second round after
ROUNDS_AFTER = 3
#: log lines kept per scenario (WARNING and worse, from the survivors, after the fault)
LOG_LINES = 12


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class ScenarioFailed(Exception):
    """A scenario could not run to its end (a process died, hung or answered an error)."""


class _Proc:
    """One peer process; its messages go to the pool's queue as ``(slot, message)``."""

    def __init__(
        self,
        python: str,
        system: str,
        slot: int,
        log_path: Path,
        messages: queue.Queue[tuple[int, dict[str, Any]]],
    ) -> None:
        self.slot = slot
        self.log_path = log_path
        self.ready = threading.Event()  # its "ready" came: torch and the system imported
        self.version = "?"
        self._seq = 0
        with open(log_path, "ab") as log:
            self.proc = start_peer(
                [python, str(PEER_SCRIPT), "--system", system, "--index", str(slot)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,  # its own process group: signals reach all of it
                cwd=str(HERE),
            )
        assert self.proc.stdout is not None
        self._reader = threading.Thread(
            target=self._read, args=(self.proc.stdout, messages), daemon=True
        )
        self._reader.start()

    def _read(self, stream: IO[bytes], messages: queue.Queue[tuple[int, dict[str, Any]]]) -> None:
        for line in stream:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if message.get("event") == "ready":
                self.version = str(message.get("version", "?"))
                self.ready.set()
                continue
            messages.put((self.slot, message))
        messages.put((self.slot, {"event": "eof", "proc": id(self)}))

    def send(self, op: str, **kwargs: Any) -> int:
        self._seq += 1
        line = json.dumps({"seq": self._seq, "op": op, **kwargs}) + "\n"
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise ScenarioFailed(f"slot {self.slot}: {op}: the process is gone ({exc})") from exc
        return self._seq

    def alive(self) -> bool:
        return self.proc.poll() is None

    def mark(self, text: str) -> None:
        with contextlib.suppress(OSError), open(self.log_path, "a") as log:
            log.write(f"=== {time.time():.3f} {text}\n")

    def kill(self) -> None:
        """SIGKILL to its whole group (hivemind's DHT, averager and p2pd too), then reaped."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        self._reader.join(timeout=5)  # its output ends with the group
        if not self._reader.is_alive() and self.proc.stdout is not None:
            self.proc.stdout.close()


class _Pool:
    """Peer processes of one system in slots 0..size-1; a scenario uses the first N."""

    def __init__(self, python: str, system: str, log_dir: Path) -> None:
        self.python = python
        self.system = system
        self.log_dir = log_dir
        self.procs: dict[int, _Proc] = {}
        self.messages: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self.stash: list[tuple[int, dict[str, Any]]] = []  # events read while waiting for answers
        self.version = "?"
        self._spawned = 0

    def spawn(self, slot: int) -> None:
        """A fresh process in ``slot`` (the old one killed); does not wait for it."""
        old = self.procs.pop(slot, None)
        if old is not None:
            old.kill()
        self._spawned += 1
        path = self.log_dir / f"{self.system}-slot{slot}-{self._spawned}.log"
        self.procs[slot] = _Proc(self.python, self.system, slot, path, self.messages)

    def ensure(self, n: int) -> None:
        """Slots 0..n-1 hold live, ready processes (spawning those missing or dead)."""
        for slot in range(n):
            proc = self.procs.get(slot)
            if proc is None or not proc.alive():
                self.spawn(slot)
        deadline = time.monotonic() + SPAWN_TIMEOUT
        for slot in range(n):
            proc = self.procs[slot]
            while not proc.ready.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
                if not proc.alive():
                    raise ScenarioFailed(f"{self.system} slot {slot} exited at start-up")
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{self.system} slot {slot}: not ready in time")
            self.version = proc.version

    def next(self, deadline: float, what: str) -> tuple[int, dict[str, Any]]:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{self.system}: {what}: nothing in time")
        try:
            return self.messages.get(timeout=left)
        except queue.Empty:
            raise TimeoutError(f"{self.system}: {what}: nothing in time") from None

    def call(self, requests: dict[int, tuple[str, dict[str, Any]]], timeout: float) -> list[Any]:
        """``op(**kwargs)`` on each slot at once; their results in slot order. Raises
        :class:`ScenarioFailed` on an error answer or a process gone, ``TimeoutError``."""
        seqs = {slot: self.procs[slot].send(op, **kw) for slot, (op, kw) in requests.items()}
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        what = "/".join(sorted({op for op, _ in requests.values()}))
        while len(results) < len(seqs):
            slot, message = self.next(deadline, what)
            if slot not in seqs or slot in results:
                self.stash.append((slot, message))
            elif message.get("seq") == seqs[slot]:
                if not message.get("ok"):
                    raise ScenarioFailed(f"slot {slot}: {what}: {message.get('error')}")
                results[slot] = message.get("result")
            elif message.get("event") == "eof" and message.get("proc") == id(self.procs[slot]):
                raise ScenarioFailed(f"slot {slot}: the process exited during {what}")
            else:
                self.stash.append((slot, message))
        return [results[s] for s in sorted(results)]

    def drain(self) -> None:
        """Forgets messages left over from an earlier scenario."""
        self.stash.clear()
        with contextlib.suppress(queue.Empty):
            while True:
                self.messages.get_nowait()

    def close(self) -> None:
        procs, self.procs = self.procs, {}
        for proc in procs.values():
            with contextlib.suppress(ScenarioFailed):
                proc.send("exit")
        deadline = time.monotonic() + 20.0
        for proc in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in procs.values():
            proc.kill()  # its group: hivemind's processes and daemons too


# -- one scenario ---------------------------------------------------------------------------------


def _complete(records: list[dict[str, Any]], n: int) -> bool:
    """Whether these steps (one per survivor) were one complete round of all N-1 survivors."""
    if any("error" in r or r.get("halted") for r in records):
        return False
    if any(r.get("group_size") != n - 1 for r in records):
        return False
    if any(r.get("contributors", n - 1) != n - 1 or r.get("incomplete") for r in records):
        return False
    if len({r.get("group_id") for r in records}) != 1:
        return False
    return max(r["start"] for r in records) <= min(r["end"] for r in records)  # at one time


def _first_after(records: list[dict[str, Any]], moment: float) -> int | None:
    return next((i for i, r in enumerate(records) if r["end"] > moment), None)


def _complete_round(
    records: dict[int, list[dict[str, Any]]],
    survivors: list[int],
    firsts: dict[int, int],
    n: int,
    check: int,
) -> tuple[int, dict[int, int]] | None:
    """The first complete round of the survivors after the fault round, within the first
    survivor's ``check`` steps after it: ``(j, {survivor: step})``, j counted in the first
    survivor's steps. A survivor's steps may be numbered differently from the others' (one
    took a step more, e.g. a group of two while the others formed another): the round's steps
    are those that overlap the first survivor's step in time."""
    first, *others = survivors
    for j in range(1, check + 1):
        i = firsts[first] + j
        if i >= len(records[first]):
            return None
        mine = records[first][i]
        picks = {first: i}
        for s in others:
            match = next(
                (
                    k
                    for k in range(firsts[s], len(records[s]))
                    if records[s][k]["start"] <= mine["end"]
                    and mine["start"] <= records[s][k]["end"]
                    and records[s][k].get("group_id") == mine.get("group_id")
                ),
                None,
            )
            if match is None:
                break
            picks[s] = match
        else:
            if _complete([records[s][k] for s, k in picks.items()], n):
                return j, picks
    return None


def _firsts(
    records: dict[int, list[dict[str, Any]]], survivors: list[int], fault_t: float
) -> dict[int, int] | None:
    """Each survivor's fault round: its first step that ended after the fault."""
    firsts: dict[int, int] = {}
    for s in survivors:
        first = _first_after(records[s], fault_t)
        if first is None:
            return None
        firsts[s] = first
    return firsts


def _enough(
    records: dict[int, list[dict[str, Any]]],
    survivors: list[int],
    fault_t: float,
    n: int,
    check: int,
) -> bool:
    """Whether the survivors' steps say all the scenario asks: the fault round, three after,
    and a complete round (or ``check`` rounds after without one)."""
    firsts = _firsts(records, survivors, fault_t)
    if firsts is None:
        return False
    have = min(len(records[s]) - 1 - firsts[s] for s in survivors)
    if have < ROUNDS_AFTER:
        return False
    return have >= check or _complete_round(records, survivors, firsts, n, check) is not None


def _log_lines(pool: _Pool, slots: list[int], after: str, end: str) -> list[str]:
    """WARNING/ERROR lines the slots' processes logged between two markers."""
    lines: list[str] = []
    for slot in slots:
        proc = pool.procs.get(slot)
        if proc is None:
            continue
        try:
            text = proc.log_path.read_text(errors="replace")
        except OSError:
            continue
        start = text.rfind(after)
        stop = text.find(end, start) if start >= 0 else -1
        if start < 0:
            continue
        for line in text[start : stop if stop >= 0 else None].splitlines():
            if any(word in line for word in ("WARN", "ERROR", "Traceback", "Exception")):
                lines.append(f"peer {slot}: {line.strip()[:300]}")
    return lines


def run_scenario(
    pool: _Pool, transport: str, n: int, kind: str, stage: str, args: Any
) -> dict[str, Any]:
    """One scenario on slots 0..n-1 of ``pool`` (see the module doc). Raises
    :class:`ScenarioFailed` or ``TimeoutError`` when it cannot run; a hang after the fault is
    reported in the result (``hung``) instead."""
    name = f"{pool.system} {transport} N={n} {kind} {stage}"
    victim = n - 1
    survivors = list(range(n - 1))
    slots = list(range(n))
    started = time.monotonic()
    deadline = started + args.fault_scenario_timeout
    pool.drain()
    pool.ensure(n)
    for slot in slots:
        pool.procs[slot].mark(f"scenario {name}: start")
    result: dict[str, Any] = {
        "system": pool.system,
        "version": pool.version,
        "transport": transport,
        "peers": n,
        "fault": kind,
        "stage": stage,
        "size": args.fault_size,
        "step_timeout": args.fault_step_timeout,
        "logs": [str(pool.procs[s].log_path) for s in slots],
    }
    (maddrs,) = pool.call({0: ("start", {"transport": transport, "initial_peers": []})}, OP_TIMEOUT)
    for slot in slots[1:]:
        pool.call({slot: ("start", {"transport": transport, "initial_peers": maddrs})}, OP_TIMEOUT)
    prefix = f"avgfault_{uuid.uuid4().hex[:8]}"
    averager = {
        "prefix": prefix,
        "group_size": n,
        "size": args.fault_size,
        "step_timeout": args.fault_step_timeout,
        "options": {},
    }
    made = pool.call({s: ("averager", {**averager, "index": s}) for s in slots}, OP_TIMEOUT)
    result["sigint_was"] = (made[victim] or {}).get("sigint_was")
    time.sleep(args.fault_settle)
    fault_step = args.fault_warmup + args.fault_before
    go_at = time.monotonic() + 0.3
    train = {
        "go_at": go_at,
        "step_timeout": args.fault_step_timeout,
        "compute": args.fault_compute,
        "max_steps": fault_step + MAX_REARM + 1 + args.fault_check_rounds + 3,
        "until": deadline,
    }
    fault = {"signal": SIGNALS[kind], "step": fault_step, "stage": stage, "skip": args.fault_warmup}
    seqs = {
        s: pool.procs[s].send("train", **train, fault=fault if s == victim else None) for s in slots
    }
    records: dict[int, list[dict[str, Any]]] = {s: [] for s in slots}
    fault_event: dict[str, Any] | None = None
    left: dict[str, Any] | None = None
    victim_proc = pool.procs[victim]
    victim_gone = False
    trained: set[int] = set()
    rearmed: list[dict[str, Any]] = []
    hung: str | None = None
    stash, pool.stash = pool.stash, []
    pending: Iterator[tuple[int, dict[str, Any]]] = iter(stash)

    def take(message_deadline: float, what: str) -> tuple[int, dict[str, Any]]:
        for item in pending:
            return item
        return pool.next(message_deadline, what)

    def note(slot: int, message: dict[str, Any]) -> None:
        nonlocal fault_event, left, victim_gone
        event = message.get("event")
        if event == "step":
            records[slot].append(message)
        elif event == "fault" and slot == victim:
            fault_event = message
            for s in survivors:
                pool.procs[s].mark(f"scenario {name}: fault")
        elif event == "left" and slot == victim:
            left = message
        elif event == "rearmed" and slot == victim:
            rearmed.append(message)
        elif event == "eof":
            if slot == victim and message.get("proc") == id(victim_proc):
                victim_gone = True
            elif slot in survivors and message.get("proc") == id(pool.procs.get(slot)):
                raise ScenarioFailed(f"survivor {slot} exited")
        elif message.get("seq") == seqs.get(slot):
            trained.add(slot)
            if not message.get("ok"):
                raise ScenarioFailed(f"slot {slot}: train: {message.get('error')}")

    try:
        while True:
            if fault_event is not None and _enough(
                records, survivors, fault_event["t"], n, args.fault_check_rounds
            ):
                break
            if trained >= set(survivors):
                hung = "the survivors' loops ended before the figures were complete"
                break
            if fault_event is None and (victim in trained or victim_gone):
                raise ScenarioFailed("the victim's loop ended without the fault")
            try:
                slot, message = take(deadline, "the rounds")
            except TimeoutError:
                hung = _pending(records, survivors, fault_event, trained)
                break
            note(slot, message)
    finally:
        for s in survivors:
            with contextlib.suppress(ScenarioFailed):
                pool.procs[s].send("halt")
    result["hung"] = hung
    if hung is not None:
        _progress(f"  {name}: HUNG: {hung}")
    # the survivors' loops end (a step in progress is cancelled), the victim's exit
    grace = time.monotonic() + 2 * args.fault_step_timeout + 30.0
    while not (trained >= set(survivors) and (victim_gone or kind == "die")):
        try:
            slot, message = take(grace, "the end of the loops")
        except TimeoutError:
            result["hung"] = (result["hung"] or "") + (
                f"; not ended in time: survivors {sorted(set(survivors) - trained)}"
                + ("" if victim_gone else ", the victim")
            )
            break
        note(slot, message)
    end_marker = f"scenario {name}: end"
    for s in survivors:
        pool.procs[s].mark(end_marker)
    result["log_lines"] = _log_lines(pool, survivors, f"scenario {name}: fault", end_marker)[
        :LOG_LINES
    ]
    if victim_gone:  # (its output closed as it exited: reap it)
        with contextlib.suppress(subprocess.TimeoutExpired):
            victim_proc.proc.wait(timeout=5)
    exit_status = victim_proc.proc.poll()
    victim_proc.kill()  # whatever is left of it (hivemind: its daemon)
    result["victim"] = {"fault": fault_event, "left": left, "exit": exit_status, "rearmed": rearmed}
    if fault_event is not None:
        result.update(_analyse(records, survivors, fault_event["t"], n, args))
        result["agree_diff"] = _agreement(pool, survivors, records, result, args)
    result["records"] = records
    result["seconds"] = time.monotonic() - started
    return result


def _pending(
    records: dict[int, list[dict[str, Any]]],
    survivors: list[int],
    fault_event: dict[str, Any] | None,
    trained: set[int],
) -> str:
    now = time.monotonic()
    parts = []
    if fault_event is None:
        parts.append("the fault never came")
    for s in survivors:
        last = records[s][-1] if records[s] else None
        since = now - last["end"] if last else None
        parts.append(
            f"survivor {s}: {len(records[s])} steps"
            + (f", last ended {since:.1f} s ago" if since is not None else "")
            + (", loop ended" if s in trained else "")
        )
    return "; ".join(parts)


def _analyse(
    records: dict[int, list[dict[str, Any]]],
    survivors: list[int],
    fault_t: float,
    n: int,
    args: Any,
) -> dict[str, Any]:
    """The figures of the module doc from the survivors' step records."""
    out: dict[str, Any] = {}

    def duration(r: dict[str, Any]) -> float:
        return float(r["end"] - r["start"])

    before = []
    for k in range(args.fault_warmup, args.fault_warmup + args.fault_before):
        steps = [records[s][k] for s in survivors if len(records[s]) > k]
        if len(steps) == len(survivors) and all(r["end"] <= fault_t for r in steps):
            before.append(max(duration(r) for r in steps))
    out["before_rounds_s"] = before
    out["before_s"] = statistics.median(before) if before else None
    out["before_errors"] = sorted(
        {
            r["error"]
            for s in survivors
            for r in records[s][: args.fault_warmup + args.fault_before]
            if "error" in r
        }
    )
    firsts = {s: _first_after(records[s], fault_t) for s in survivors}
    rounds = []
    for j in range(ROUNDS_AFTER + 1):
        steps = {
            s: records[s][f + j]
            for s, f in firsts.items()
            if f is not None and len(records[s]) > f + j
        }
        got: dict[str, Any] = {"j": j, "survivors": len(steps)}
        if steps:
            got["step_s"] = max(duration(r) for r in steps.values())
            got["per_survivor_s"] = {s: duration(r) for s, r in steps.items()}
            got["raised"] = sum("error" in r for r in steps.values())
            got["errors"] = sorted({r["error"] for r in steps.values() if "error" in r})
            got["groups"] = sorted(r.get("group_size", 0) for r in steps.values())
            got["incomplete"] = sum(bool(r.get("incomplete")) for r in steps.values())
        rounds.append(got)
    out["rounds"] = rounds
    out["fault_s"] = rounds[0].get("step_s")
    out["after_s"] = [rounds[j].get("step_s") for j in range(1, ROUNDS_AFTER + 1)]
    base = out["before_s"]
    second = out["after_s"][1]
    out["met"] = None if base is None or second is None else second <= TARGET_RATIO * base
    out["agree_round"] = None
    out["agree"] = None
    known = {s: f for s, f in firsts.items() if f is not None}
    found = None
    if len(known) == len(survivors):
        found = _complete_round(records, survivors, known, n, args.fault_check_rounds)
    if found is not None:
        j, picks = found
        out["agree_round"] = j
        out["agree"] = len({records[s][k]["digest"] for s, k in picks.items()}) == 1
        out["agree_steps"] = picks
    return out


def _agreement(
    pool: _Pool,
    survivors: list[int],
    records: dict[int, list[dict[str, Any]]],
    result: dict[str, Any],
    args: Any,
) -> float | None:
    """The largest difference between the survivors' tensors after the complete round (0 when
    the digests agree; ``None`` when there was no complete round or the tensors are gone)."""
    if result.get("agree") is None:
        return None
    if result["agree"]:
        return 0.0
    steps = result["agree_steps"]
    path = Path(args.fault_logs) / f"tensor-{uuid.uuid4().hex[:8]}.npy"
    try:
        first, *others = survivors
        pool.call({first: ("diff", {"step": steps[first], "path": str(path), "save": True})}, 30)
        diffs = pool.call(
            {s: ("diff", {"step": steps[s], "path": str(path), "save": False}) for s in others},
            30,
        )
        return None if any(d is None for d in diffs) else max(diffs)
    except (ScenarioFailed, TimeoutError):
        return None
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def _teardown(pool: _Pool, survivors: list[int], victim: int) -> None:
    """Survivors' averagers and DHTs shut down (the processes kept); the victim's slot gets a
    fresh process (starting now, ready by the next scenario)."""
    try:
        pool.call({s: ("teardown", {}) for s in survivors}, EXIT_TIMEOUT)
    except (ScenarioFailed, TimeoutError) as exc:
        _progress(f"  teardown failed ({exc}): fresh processes for the next scenario")
        for s in survivors:
            pool.spawn(s)
    pool.spawn(victim)


# -- every scenario -------------------------------------------------------------------------------


def scenarios(args: Any) -> list[tuple[str, str, int, str, str]]:
    """(system, transport, N, fault, stage) in the order they run: per N and transport ours,
    then hivemind (where it runs that transport)."""
    out = []
    systems = ["swarmavg"] + (["hivemind"] if args.hivemind else [])
    for n in args.fault_peers:
        for transport in args.fault_transports:
            for system in systems:
                if system == "hivemind" and transport not in args.fault_hivemind_transports:
                    continue
                for kind in args.fault_kinds:
                    for stage in args.fault_stages:
                        out.append((system, transport, n, kind, stage))
    return out


def run_faults(args: Any) -> list[dict[str, Any]]:
    """Every scenario of :func:`scenarios`; a scenario that fails gets ``{"error": ...}`` and
    fresh processes for the next one."""
    Path(args.fault_logs).mkdir(parents=True, exist_ok=True)
    pythons = {"swarmavg": sys.executable, "hivemind": str(args.hivemind_python)}
    pools: dict[str, _Pool] = {}
    results: list[dict[str, Any]] = []
    sockets_before = hivemind_sockets()
    try:
        for system, transport, n, kind, stage in scenarios(args):
            if system == "hivemind" and not Path(pythons["hivemind"]).exists():
                results.append(
                    {
                        "system": system,
                        "transport": transport,
                        "peers": n,
                        "fault": kind,
                        "stage": stage,
                        "error": f"skipped: {pythons['hivemind']} not found",
                    }
                )
                continue
            pool = pools.get(system)
            if pool is None:
                pool = pools[system] = _Pool(pythons[system], system, Path(args.fault_logs))
            label = f"{system} {transport} N={n} {kind} {stage}"
            _progress(f"running fault scenario {label} ...")
            try:
                got = run_scenario(pool, transport, n, kind, stage, args)
                if got.get("hung"):  # a process may be stuck: fresh ones for the next scenario
                    pool.close()
                    pools.pop(system)
                else:
                    _teardown(pool, list(range(n - 1)), n - 1)
            except (ScenarioFailed, TimeoutError, OSError) as exc:
                got = {
                    "system": system,
                    "transport": transport,
                    "peers": n,
                    "fault": kind,
                    "stage": stage,
                    "error": f"{type(exc).__name__}: {exc}"[:500],
                }
                pool.close()  # a process may be stuck: fresh ones for the next scenario
                pools.pop(system)
            if system == "hivemind":
                remove_stale_sockets(sockets_before)
            _progress(f"  {summary_line(got)}")
            results.append(got)
    finally:
        for pool in pools.values():
            pool.close()
        remove_stale_sockets(sockets_before)
    return results


# -- the table ------------------------------------------------------------------------------------


_STAGE_NAMES = {
    "IDLE": "idle",
    "LOOKING_FOR_GROUP": "looking",
    "AWAITING_TRIGGER": "trigger",
    "RUNNING_ALLREDUCE": "allreduce",
    "FINISHED": "finished",
}


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def summary_line(got: dict[str, Any]) -> str:
    if "error" in got:
        return f"failed: {got['error']}"
    rounds = got.get("rounds", [])
    raised = rounds[0].get("raised", 0) if rounds else 0
    return (
        f"before {_s(got.get('before_s'))} s, fault round {_s(got.get('fault_s'))} s"
        f"{f' ({raised} raised)' if raised else ''}, after "
        + " / ".join(_s(x) for x in got.get("after_s", []))
        + f" s, agree {got.get('agree')}, victim at "
        + str((got.get("victim", {}).get("fault") or {}).get("stage"))
        + (f", HUNG: {got['hung']}" if got.get("hung") else "")
    )


def fault_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per scenario (what the table shows), for JSON lines."""
    rows = []
    for got in results:
        row = {
            k: got.get(k)
            for k in ("system", "version", "transport", "peers", "fault", "stage", "error", "hung")
        }
        if "error" not in got:
            rounds = got.get("rounds", [])
            fault = (got.get("victim") or {}).get("fault") or {}
            left = (got.get("victim") or {}).get("left") or {}
            row.update(
                before_s=got.get("before_s"),
                fault_s=got.get("fault_s"),
                fault_raised=rounds[0].get("raised") if rounds else None,
                fault_errors=rounds[0].get("errors") if rounds else None,
                fault_groups=rounds[0].get("groups") if rounds else None,
                after_s=got.get("after_s"),
                after_raised=[r.get("raised") for r in rounds[1:]],
                after_errors=sorted({e for r in rounds[1:] for e in r.get("errors", [])}),
                after_groups=[r.get("groups") for r in rounds[1:]],
                ratio_second=(
                    got["after_s"][1] / got["before_s"]
                    if got.get("before_s") and got.get("after_s") and got["after_s"][1]
                    else None
                ),
                met=got.get("met"),
                agree=got.get("agree"),
                agree_round=got.get("agree_round"),
                agree_diff=got.get("agree_diff"),
                victim_stage=fault.get("stage"),
                victim_since_start_s=fault.get("since_start_s"),
                victim_since_allreduce_s=fault.get("since_allreduce_s"),
                victim_shutdown_s=left.get("shutdown_s"),
                victim_exit=(got.get("victim") or {}).get("exit"),
                victim_rearmed=len((got.get("victim") or {}).get("rearmed") or []),
                sigint_was=got.get("sigint_was"),
                log_lines=got.get("log_lines"),
                seconds=got.get("seconds"),
            )
        rows.append(row)
    return rows


def print_fault_table(rows: list[dict[str, Any]], args: Any) -> None:
    header = (
        f"{'system':8} {'tr':4} {'N':>2} {'fault':5} {'stage':13} {'victim at':18} "
        f"{'before':>7} {'fault round':>18} {'+1':>7} {'+2':>7} {'+3':>7} {'+2/bef':>6} "
        f"{'agree':>9} {'2x':>3}"
    )
    print(header)
    print("-" * len(header))
    notes = []
    sigint: set[str] = set()
    for row in rows:
        head = (
            f"{row['system']:8} {row['transport']:4} {row['peers']:>2} {row['fault']:5} "
            f"{row['stage']:13} "
        )
        if row.get("error"):
            print(head + f"failed: {row['error'][:80]}")
            continue
        raised = row.get("fault_raised") or 0
        cell = _s(row.get("fault_s")) + (f" ({raised} raised)" if raised else "")
        after = [
            _s(x) + ("!" if r else "")
            for x, r in zip(row["after_s"], row["after_raised"], strict=False)
        ]
        ratio = row.get("ratio_second")
        agree = row.get("agree")
        agree_cell = (
            "none"
            if agree is None
            else f"yes +{row['agree_round']}"
            if agree
            else f"NO {row['agree_diff']:.1e}"
            if row.get("agree_diff") is not None
            else "NO"
        )
        met = "" if row.get("met") is None else ("yes" if row["met"] else "NO")
        stage = _STAGE_NAMES.get(str(row.get("victim_stage")), str(row.get("victim_stage")))
        if stage == "allreduce" and row.get("victim_since_allreduce_s") is not None:
            stage += f"+{1e3 * row['victim_since_allreduce_s']:.0f}ms"
        if row.get("victim_rearmed"):
            stage += f" ({row['victim_rearmed']}>)"
        print(
            head
            + f"{stage[:18]:18} {_s(row.get('before_s')):>7} {cell:>18} "
            + " ".join(f"{a:>7}" for a in after)
            + f" {'' if ratio is None else f'{ratio:.2f}':>6} {agree_cell:>9} {met:>3}"
            + (" HUNG" if row.get("hung") else "")
        )
        label = f"{row['system']} {row['transport']} N={row['peers']} {row['fault']} {row['stage']}"
        errors = (row.get("fault_errors") or []) + (row.get("after_errors") or [])
        if errors:
            notes.append(f"{label}: raised: " + " | ".join(e[:160] for e in errors[:3]))
        if row.get("hung"):
            notes.append(f"{label}: HUNG: {row['hung'][:300]}")
        if row.get("victim_shutdown_s") is not None:
            notes.append(f"{label}: the victim's shutdown took {row['victim_shutdown_s']:.2f} s")
        elif row["fault"] == "leave":
            exit_status = row["victim_exit"]
            notes.append(f"{label}: the victim did not say it shut down (exit {exit_status})")
        if row.get("sigint_was") not in (None, "default_int_handler"):
            sigint.add(f"{row['system']} {row.get('version') or ''}: {row['sigint_was']}".strip())
    print(
        "  seconds; before: median over the rounds before the fault of the round's step time "
        "(max over survivors); fault round: the survivors' steps that ended first after the "
        "fault (max; how many raised); +1..+3: the rounds after (! = a step raised); +2/bef: "
        f"the issue's target is <= {TARGET_RATIO:.0f}; agree: survivors' tensors bit-identical "
        "after the first complete round after the fault (+j), else their largest difference "
        "(~1e-10: rounding, hivemind adds mean - local to its tensor); "
        "victim at: its step's stage when it signalled (allreduce+ms: that long after it saw "
        "its all-reduce begin; (k>): the stage had passed in k steps, the fault moved on)"
    )
    print(
        f"  S={args.fault_size} float32 ({args.fault_size * 4 / MiB:.0f} MiB) per peer, "
        f"step(timeout={args.fault_step_timeout:g}), {args.fault_compute:g} s compute between "
        f"steps, {args.fault_warmup} warm-up + {args.fault_before} rounds before the fault; "
        f"logs under {args.fault_logs}"
    )
    if sigint:
        notes.append(
            "SIGINT in the training process once its averager was made (the script puts "
            "Python's handler back before the fault): " + ", ".join(sorted(sigint))
        )
    for note in notes:
        print(f"  {note}")
