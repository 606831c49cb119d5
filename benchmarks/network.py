"""All-reduce over the network lab (``swarmavg.testing.netlab``): our round beside the bandwidth
bound, gloo, hivemind 1.1.12 and raw TCP; a heterogeneous swarm beside the best split's bound;
TCP beside QUIC (Linux, root).

    python benchmarks/network.py [--sizes 64] [--peers 4,8] [--profiles wan,bad,lan,mixed]
                                 [--rounds 3] [--systems ours,gloo,hivemind,tcp]
                                 [--transports tcp,quic] [--rates-only] [--lossless]
                                 [--offload on|off] [--round-timeout S]
                                 [--json FILE] [--logs DIR] [--quick]

Every cell (profile, peers, size) gets a lab of its own: ``peers`` hosts, each with the profile
(``mixed``: the first half ``lan`` rates, 1 Gbit/s, the others 50 Mbit/s, both 0.5 ms round
trip). The lab's default offload: TCP hands the emulator offload frames of up to 64 KiB (at
least 16 KiB on every path, see ``netlab.tso_rtt_log``), which still lose and reorder single
packets (the emulator cuts a frame with lost or reordered segments).
``--rates-only`` keeps only the profiles' rates and joins the hosts with a kernel bridge
(``NetLab(emulate=False)``): no emulator, so what differs from the emulated run is what the
emulator (a Python process on the same cores) cost. ``--lossless`` drops the profiles' loss
and reordering (delay and jitter stay); ``--offload off`` makes every frame one packet (the
emulator sustains ~300 Mbit/s of those).

In a cell, one system after the other, each with ``1 + --rounds`` rounds (the first a warm-up,
not timed) of one float32 tensor of ``size`` MiB per peer:

- ``ours``: one ``benchmarks/_netlab_peer.py`` process per host (the sync ``swarmavg.DHT`` and
  ``DecentralizedAverager``, peer ``i``'s tensor all ``10**i``), per transport (TCP plaintext,
  QUIC); a round's time is the largest ``StepResult.allreduce_seconds`` over the peers (from the
  group's formation to the peer's mean). The warm-up round is checked: every peer in one
  complete group holding the exact float32 mean (``exact``). A fresh averager runs each round
  (each peer's tensor back at ``10**i``), except in ``ours, measured``. On ``mixed``, each
  peer passes ``bandwidth=`` its link's rate (bytes/s; the best split); a second row
  (``ours, even``) passes none, and its fresh averagers have measured nothing (an even
  split); a third (``ours, measured``) passes none and keeps its averagers from the warm-up
  round on: each peer announces the bandwidth it measured in the rounds before (the warm-up
  round is even), and the row's note says what each measured after the last round (MB/s).
  On the uniform profiles, ``ours`` (fresh averagers: a peer's first round, nothing
  measured) and ``ours, measured`` (kept averagers, as in training: from the first timed
  round on, each announces the throughput it measured, which sets the split and, on slow
  links, the part size);
- ``gloo``: ``torch.distributed`` gloo ``all_reduce`` (``benchmarks/_netlab_gloo.py``, one rank
  per host, TCP over the lab), the max over ranks of a call;
- ``hivemind``: hivemind 1.1.12's ``DecentralizedAverager`` (``benchmarks/_netlab_hivemind.py``
  under ``/tmp/hm-venv/bin/python``, its p2pd daemon in the host too), from the first poll that
  saw ``RUNNING_ALLREDUCE`` to the step's end, max over peers;
- ``tcp`` (row ``raw TCP``): what TCP itself achieves with an all-reduce's traffic on these
  links, nothing else (``benchmarks/_netlab_tcp.py``): one connection per pair of hosts, made
  once; in a round every host sends ``2 S / N`` on each and receives as much, all flows at
  once from a common start time, no computation, no flow waiting for another; the time to the
  last host's last byte. An all-reduce moves the same bytes with dependencies between them,
  so this is the ceiling for any system on the lab's TCP (its headers, its congestion
  control), as the bound is for the links.

The time per round is bounded (``--round-timeout``; by default 4x the bound + 60 s): a system
past it is reported as ``hung`` (its processes killed), never waited for. The lab and every
process are removed on exit, also on an exception or Ctrl+C.

Bounds (``B``: a host's rate, the same up and down; ``S``: bytes per peer):

- uniform: ``2(N-1)/N * S / B`` (each peer sends and receives ``(N-1)/N * S`` twice);
- heterogeneous, best split: a peer reducing a fraction ``f_i`` of the vector sends
  ``(1-f_i) S`` of its own values and ``(N-1) f_i S`` of means, and receives as much:
  ``(1 + (N-2) f_i) S`` each way, taking ``(1 + (N-2) f_i) S / B_i``. The fastest round makes
  these equal where ``f_i > 0``: ``T = max(2(N-1) S / sum(B_i), S / min(B_i))`` (the first term
  when every peer takes a share, ``f_i = (T B_i / S - 1) / (N-2)``; the second when the slowest
  peer's own tensor, sent and received once, already takes longer: it reduces nothing). The
  even split's bound is ``(1 + (N-2)/N) S / min(B_i)``.

Beside each figure: the 1-minute load average when the cell began and ``busy``, the machine's
busy CPU over the timed rounds divided by (rounds' wall time x CPUs): near 1.0 the machine, not
the network, was the limit; ``emu``, the link emulator's CPU seconds per second over them (it
is one Python process: near 1.0, or less than its share of a loaded machine, it was the
limit); ``CPU s``, the system's own processes' CPU seconds per timed round (gloo's: the
ranks' own CPU time of a timed call, summed over ranks). ``drops``: frames the emulator's
sockets dropped (it fell behind).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _averaging_common import (
    hivemind_sockets,
    machine_busy_seconds,
    remove_stale_sockets,
    tree_cpu_seconds,
)
from network_faults import ROOT, LabSwarm, check_round

from swarmavg.testing.netlab import LAN, PROFILES, LinkProfile, NetLab

GLOO = Path(__file__).with_name("_netlab_gloo.py")
HIVEMIND = Path(__file__).with_name("_netlab_hivemind.py")
HIVEMIND_PYTHON = Path("/tmp/hm-venv/bin/python")
RAW_TCP = Path(__file__).with_name("_netlab_tcp.py")
SLOW = LinkProfile(rate_bps=50e6, rtt_s=0.0005)
"""The slow half of ``mixed``: 50 Mbit/s, 0.5 ms round trip."""
SYSTEMS = ("ours", "gloo", "hivemind", "tcp")
STEP_TIMEOUT = 60.0
START_TIMEOUT = 90.0
MIB = 1 << 20


def swarm_profiles(
    profile: str, n: int, rates_only: bool, lossless: bool = False
) -> list[LinkProfile]:
    """The hosts' profiles of a cell (``lossless``: without loss and reordering)."""
    if profile == "mixed":
        hosts = [LAN if i < n // 2 else SLOW for i in range(n)]
    else:
        hosts = [PROFILES[profile]] * n
    if lossless:
        hosts = [p.replace(loss=0.0, reorder=0.0) for p in hosts]
    if rates_only:
        hosts = [LinkProfile(rate_bps=p.rate_bps, down_rate_bps=p.down_rate_bps) for p in hosts]
    return hosts


def _rate(profile: LinkProfile) -> float:
    assert profile.rate_bps is not None
    return min(profile.rate_bps, profile.down_rate_bps or profile.rate_bps)


def bound_s(size_bytes: int, rates_bps: Sequence[float]) -> float:
    """The best split's all-reduce time (see the module's docstring), in seconds."""
    n = len(rates_bps)
    bits = 8.0 * size_bytes
    if n == 1:
        return 0.0
    return max(2 * (n - 1) * bits / sum(rates_bps), bits / min(rates_bps))


def even_bound_s(size_bytes: int, rates_bps: Sequence[float]) -> float:
    """An even split's all-reduce time: ``(1 + (N-2)/N) S / min(B_i)``."""
    n = len(rates_bps)
    return (1 + (n - 2) / n) * 8.0 * size_bytes / min(rates_bps)


@dataclasses.dataclass
class Row:
    profile: str
    peers: int
    size_mib: float
    system: str
    transport: str
    bound_s: float
    times_s: list[float] = dataclasses.field(default_factory=list)
    median_s: float | None = None
    status: str = "ok"
    exact: bool | None = None
    load: float = 0.0
    busy: float | None = None
    emulator: float | None = None
    cpu_s: float | None = None
    drops: int | None = None
    note: str = ""

    @property
    def fraction(self) -> float | None:
        if self.median_s is None or not self.median_s:
            return None
        return self.bound_s / self.median_s


def _process_cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` (``None``: none, or no /proc)."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Meter:
    """The machine's busy CPU, and the lab's link emulator's, over some windows: :meth:`window`
    adds one."""

    def __init__(self, lab: NetLab) -> None:
        emulator = getattr(lab, "_emulator", None)  # (the lab's own process: read-only use)
        self.emulator_pid: int | None = None if emulator is None else emulator.pid
        self.busy = 0.0
        self.emulator = 0.0
        self.tree = 0.0
        self.wall = 0.0
        self.windows = 0

    @contextlib.contextmanager
    def window(self) -> Any:
        busy = machine_busy_seconds()
        emulator = _process_cpu_seconds(self.emulator_pid)
        tree = tree_cpu_seconds(os.getpid())
        wall = time.monotonic()
        try:
            yield
        finally:
            end = machine_busy_seconds()
            emulator_end = _process_cpu_seconds(self.emulator_pid)
            tree_end = tree_cpu_seconds(os.getpid())
            self.windows += 1
            if tree is not None and tree_end is not None:
                self.tree += tree_end - tree
            if busy is not None and end is not None:
                self.busy += end - busy
                self.wall += time.monotonic() - wall
            if emulator is not None and emulator_end is not None:
                self.emulator += emulator_end - emulator

    def fill(self, row: Row) -> None:
        """Sets ``row.busy`` (busy CPUs / CPUs) and ``row.emulator`` (the emulator's CPU
        seconds per second: near 1.0 it was the limit) and ``row.cpu_s`` (the system's own
        processes' CPU seconds per window: everything this process started, less the
        emulator)."""
        if self.windows:
            row.cpu_s = round((self.tree - self.emulator) / self.windows, 1)
        if self.wall:
            row.busy = round(self.busy / (self.wall * (os.cpu_count() or 1)), 2)
            if self.emulator_pid is not None:
                row.emulator = round(self.emulator / self.wall, 2)


def _drops(lab: NetLab) -> int | None:
    if not lab.emulate:
        return None
    return sum(s.get("socket_drops", 0) for s in lab.stats())


def _finish(row: Row) -> Row:
    if row.times_s:
        row.median_s = round(statistics.median(row.times_s), 3)
    return row


# -- ours


def run_ours(
    lab: NetLab,
    row: Row,
    swarm: LabSwarm,
    transport: str,
    size: int,
    rounds: int,
    timeout: float,
    bandwidths: Sequence[float] | None,
    out: Path,
    part_bytes: int | None = None,
    keep: bool = False,
) -> Row:
    """``1 + rounds`` rounds of our averager on ``swarm`` (the first checked, not timed);
    ``part_bytes``: ``part_size_bytes`` (``None``: the library's default); ``keep``: one
    averager per peer for every round (its measured bandwidth carries over), not a fresh one
    each round."""
    options: dict[str, Any] = {
        "allreduce_timeout": timeout,
        "sender_timeout": timeout,
        "reducer_timeout": timeout,
    }
    if part_bytes is not None:
        options["part_size_bytes"] = part_bytes
    meter = Meter(lab)
    for number in range(1 + rounds):
        if number == 0 or not keep:
            _prepare(swarm, transport, size, options, bandwidths)
        save = number == 0
        for path in out.glob("peer*.npy"):
            path.unlink()
        with meter.window() if number else contextlib.nullcontext():
            # (the step's timeout bounds its all-reduce too)
            swarm.step(STEP_TIMEOUT + timeout, out if save else None)
            deadline = time.monotonic() + STEP_TIMEOUT + timeout + 5
            try:
                results = {p.index: p.expect("result", deadline) for p in swarm.peers}
            except (TimeoutError, RuntimeError) as exc:
                row.status = f"hung ({exc})"
                raise _Hung from exc
        errors = [f"peer {i}: {r['error']}" for i, r in results.items() if "error" in r]
        if errors:
            row.status = "failed: " + "; ".join(errors)[:200]
            return _finish(row)
        if save:
            tensors = {i: np.load(out / f"peer{i}.npy") for i in results}
            problems = check_round(swarm, results, tensors, None)
            problems += [
                f"peer {i}: group of {len(r['group'])}, incomplete={r['incomplete']}"
                for i, r in results.items()
                if len(r["group"]) != len(swarm.peers) or r["incomplete"]
            ]
            del tensors
            row.exact = not problems
            if problems:
                row.note = "; ".join(problems)[:200]
                # (in full, with what each peer's result says was left out and why)
                said = {
                    i: {k: r.get(k) for k in ("incomplete", "local_spans", "dropped", "relayed")}
                    for i, r in results.items()
                }
                print("# " + json.dumps({"problems": problems, "results": said}), flush=True)
        else:
            row.times_s.append(round(max(r["allreduce_s"] for r in results.values()), 3))
    if keep:
        measured = [results[i].get("measured_bandwidth") for i in sorted(results)]
        said = "measured MB/s: " + ", ".join(
            "unknown" if m is None else f"{m / 1e6:.3g}" for m in measured
        )
        row.note = f"{row.note}; {said}" if row.note else said
    meter.fill(row)
    row.drops = _drops(lab)
    return _finish(row)


class _Hung(Exception):
    """A system passed its round's timeout (its processes are to be restarted)."""


def _prepare(
    swarm: LabSwarm,
    transport: str,
    size: int,
    options: dict[str, Any],
    bandwidths: Sequence[float] | None,
) -> None:
    """A fresh averager on every peer (as ``LabSwarm.prepare``), with peer ``i``'s
    ``bandwidth`` from ``bandwidths`` (bytes/s; ``None``: the library's default)."""
    swarm.transport = transport
    prefix = f"net_{uuid.uuid4().hex[:8]}"
    n = len(swarm.peers)
    for peer in swarm.peers:
        peer_options = dict(options)
        if bandwidths is not None:
            peer_options["bandwidth"] = bandwidths[peer.index]
        peer.send(
            op="averager",
            transport=transport,
            prefix=prefix,
            size=size,
            value=10.0**peer.index,
            group_size=n,
            min_group_size=n,
            options=peer_options,
        )
    deadline = time.monotonic() + 30
    for peer in swarm.peers:
        peer.expect("ready", deadline)


# -- gloo


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _exit(processes: Sequence[subprocess.Popen[str]], grace: float) -> None:
    """Ask processes driven by JSON lines to exit, give them ``grace`` seconds, then kill them."""
    for process in processes:
        with contextlib.suppress(OSError, ValueError):
            assert process.stdin is not None
            process.stdin.write('{"op": "exit"}\n')
            process.stdin.flush()
    end = time.monotonic() + grace
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.1, end - time.monotonic()))
    _stop(processes)


def _stop(processes: Sequence[subprocess.Popen[Any]]) -> None:
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)


def run_gloo(lab: NetLab, row: Row, size: int, rounds: int, timeout: float, logs: Path) -> Row:
    """gloo's ``all_reduce``, one rank per host (``_netlab_gloo.py``)."""
    n = len(lab.hosts)
    master = f"{lab.host(0).address}:29{500 + (os.getpid() % 400)}"
    processes: list[subprocess.Popen[str]] = []
    meter = Meter(lab)
    with (logs / "gloo.log").open("a") as log:
        try:
            for i in range(n):
                processes.append(
                    lab.host(i).popen(
                        [
                            *(sys.executable, str(GLOO), "--rank", str(i), "--world", str(n)),
                            *("--master", master, "--size", str(size)),
                            *("--rounds", str(rounds), "--warmup", "1"),
                            *("--timeout", str(timeout)),
                        ],
                        stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL,
                        stderr=log,
                        text=True,
                        env=_env(),
                    )
                )
            with meter.window():  # (start and the warm-up call too: gloo times only the calls)
                try:
                    out, _ = processes[0].communicate(
                        timeout=START_TIMEOUT + timeout * (1 + rounds)
                    )
                except subprocess.TimeoutExpired:
                    row.status = "hung"
                    return row
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if not lines:
                row.status = f"failed (rank 0 exited {processes[0].returncode}, see {log.name})"
                return row
            got = json.loads(lines[-1])
            row.times_s = [round(t, 3) for t in got["times_s"]]
            row.exact = got["exact"]
        finally:
            _stop(processes)
    meter.fill(row)
    row.cpu_s = round(statistics.median(got["cpu_s"]), 1)  # (the ranks' own, per call)
    row.drops = _drops(lab)
    return _finish(row)


# -- hivemind


def run_hivemind(lab: NetLab, row: Row, size: int, rounds: int, timeout: float, logs: Path) -> Row:
    """hivemind 1.1.12's ``DecentralizedAverager``, one peer per host (``_netlab_hivemind.py``)."""
    if not HIVEMIND_PYTHON.exists():
        row.status = f"skipped (no {HIVEMIND_PYTHON})"
        return row
    n = len(lab.hosts)
    prefix = f"hm_{uuid.uuid4().hex[:8]}"
    sockets = hivemind_sockets()
    processes: list[subprocess.Popen[str]] = []
    meter = Meter(lab)
    log = (logs / "hivemind.log").open("a")
    try:

        def start(i: int, initial: list[str]) -> subprocess.Popen[str]:
            process = lab.host(i).popen(
                [
                    *(str(HIVEMIND_PYTHON), str(HIVEMIND), "--host", lab.host(i).address),
                    *("--initial", json.dumps(initial), "--size", str(size)),
                    *("--value", str(float(10**i)), "--group", str(n), "--prefix", prefix),
                    *("--allreduce-timeout", str(timeout)),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            processes.append(process)
            return process

        readers: list[_Lines] = []
        readers.append(_Lines(start(0, [])))
        first = readers[0].expect("started", time.monotonic() + START_TIMEOUT)
        readers += [_Lines(start(i, first["maddrs"])) for i in range(1, n)]
        deadline = time.monotonic() + START_TIMEOUT
        for reader in readers:
            reader.expect("ready", deadline)
        for number in range(1 + rounds):
            with meter.window() if number else contextlib.nullcontext():
                for reader in readers:  # (hivemind's step timeout bounds its all-reduce too)
                    reader.send(op="step", timeout=STEP_TIMEOUT + timeout)
                deadline = time.monotonic() + STEP_TIMEOUT + 2 * timeout + 10
                try:
                    results = [r.expect("result", deadline) for r in readers]
                except (TimeoutError, RuntimeError) as exc:
                    row.status = f"hung ({exc})"
                    return row
            errors = [r["error"] for r in results if "error" in r]
            if errors:
                row.status = "failed: " + "; ".join(errors)[:200]
                return _finish(row)
            if number:
                row.times_s.append(round(max(r["allreduce_s"] for r in results), 3))
            else:
                expected = float(np.float32(sum(10.0**i for i in range(n)) / n))
                worst = 0.0
                for reader in readers:
                    reader.send(op="check", expected=expected)
                    got = reader.expect("check", time.monotonic() + 30)["max_abs_error"]
                    worst = max(worst, got)
                row.exact = worst == 0.0
                row.note = f"max abs error {worst:.3g}" if worst else ""
    finally:
        _exit(processes, grace=15)
        log.close()
        remove_stale_sockets(sockets)
    meter.fill(row)
    row.drops = _drops(lab)
    return _finish(row)


class _Lines:
    """JSON lines of a process's stdout, read with a deadline (a thread per process)."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        import queue
        import threading

        self.process = process
        self.queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._empty = queue.Empty
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        with contextlib.suppress(OSError, ValueError):
            for line in self.process.stdout:
                if line.startswith("{"):
                    self.queue.put(json.loads(line))
        self.queue.put(None)

    def send(self, **request: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()

    def expect(self, event: str, deadline: float) -> dict[str, Any]:
        while True:
            try:
                got = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except self._empty:
                raise TimeoutError(f"no {event!r} in time") from None
            if got is None:
                self.queue.put(None)
                raise RuntimeError(f"exited (code {self.process.poll()})")
            if got.get("event") == event:
                return got


# -- raw TCP


def run_tcp(lab: NetLab, row: Row, size: int, rounds: int, timeout: float, logs: Path) -> Row:
    """What TCP itself achieves: an all-reduce's bytes, ``2 S / N`` each way on one connection
    per pair of hosts, no computation (``_netlab_tcp.py``); from a common start time to the last
    host's last byte."""
    n = len(lab.hosts)
    addresses = ",".join(host.address for host in lab.hosts)
    port = 30000 + os.getpid() % 20000
    processes: list[subprocess.Popen[str]] = []
    meter = Meter(lab)
    log = (logs / "tcp.log").open("a")
    try:
        for i in range(n):
            processes.append(
                lab.host(i).popen(
                    [
                        *(sys.executable, str(RAW_TCP), "--rank", str(i)),
                        *("--addresses", addresses, "--port", str(port)),
                        *("--bytes", str(2 * size * 4 // n)),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                )
            )
        readers = [_Lines(process) for process in processes]
        for reader in readers:
            reader.send(op="connect")
        if _answers(readers, "connected", START_TIMEOUT, row) is None:
            return row
        for number in range(1 + rounds):  # (the first a warm-up round)
            time.sleep(1.0)  # (the links drain between rounds)
            with meter.window() if number else contextlib.nullcontext():
                at = time.time() + 0.2  # (every host starts then: they share the clock)
                for reader in readers:
                    reader.send(op="go", at=at)
                answers = _answers(readers, "done", timeout, row)
            if answers is None:
                return _finish(row)
            if number:
                row.times_s.append(round(max(a["t"] for a in answers), 3))
    finally:
        _exit(processes, grace=5)
        log.close()
    meter.fill(row)
    row.drops = _drops(lab)
    return _finish(row)


def _answers(
    readers: Sequence[_Lines], event: str, timeout: float, row: Row
) -> list[dict[str, Any]] | None:
    """Every reader's next ``event`` within ``timeout`` seconds (``None``, with ``row.status``
    saying why, if one did not come or said an error)."""
    deadline = time.monotonic() + timeout
    try:
        answers = [reader.expect(event, deadline) for reader in readers]
    except (TimeoutError, RuntimeError) as exc:
        row.status = f"hung ({exc})"
        return None
    errors = [f"host {i}: {a['error']}" for i, a in enumerate(answers) if "error" in a]
    if errors:
        row.status = "failed: " + "; ".join(errors)[:200]
        return None
    return answers


# -- cells


def run_cell(
    profile: str,
    n: int,
    size_mib: float,
    *,
    systems: Sequence[str],
    transports: Sequence[str],
    rounds: int,
    rates_only: bool,
    lossless: bool = False,
    offload: bool = True,
    part_bytes: int | None = None,
    measured: bool = True,
    round_timeout: float | None,
    logs: Path,
    say: Callable[[str], None] = print,
    rows: list[Row] | None = None,
) -> list[Row]:
    """Every system's rows for one lab of ``n`` hosts on ``profile``, ``size_mib`` per peer,
    appended to ``rows`` (a new list by default) as each is done; returns ``rows``.
    ``measured``: also the ``ours, measured`` row on a uniform profile."""
    hosts = swarm_profiles(profile, n, rates_only, lossless)
    rates = [_rate(p) for p in hosts]
    size = int(size_mib * MIB) // 4
    nbytes = size * 4
    bound = round(bound_s(nbytes, rates), 3)
    timeout = round_timeout or 4 * bound + 60
    label = profile + (" (rates only)" if rates_only else "") + (" (lossless)" if lossless else "")
    label += "" if offload else " (offload off)"
    label += "" if part_bytes is None else f" (parts {part_bytes / MIB:g} MiB)"
    rows = [] if rows is None else rows

    def new(system: str, transport: str, cell_bound: float = bound) -> Row:
        return Row(
            label, n, size_mib, system, transport, cell_bound, load=round(os.getloadavg()[0], 1)
        )

    cell_logs = logs / f"{profile}-{n}-{size_mib:g}"
    cell_logs.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory() as tmp,
        NetLab(hosts, seed=0, emulate=not rates_only, offload=offload) as lab,
    ):
        out = Path(tmp)
        if "ours" in systems:
            variants: list[tuple[str, Sequence[float] | None, float]] = [("ours", None, bound)]
            if measured:
                variants.append(("ours, measured", None, bound))
            if profile == "mixed":
                variants = [
                    ("ours", [rate / 8 for rate in rates], bound),
                    ("ours, even", None, round(even_bound_s(nbytes, rates), 3)),
                    ("ours, measured", None, bound),
                ]
            swarm: LabSwarm | None = None
            try:
                for transport in transports:
                    for name, bandwidths, cell_bound in variants:
                        if swarm is None:
                            swarm = LabSwarm(lab, list(transports), cell_logs)
                        row = new(name, transport, cell_bound)
                        try:
                            run_ours(
                                *(lab, row, swarm, transport, size, rounds, timeout),
                                *(bandwidths, out, part_bytes),
                                keep=name == "ours, measured",
                            )
                        except _Hung:
                            swarm.close()
                            swarm = None
                        rows.append(row)
                        say(_line(row))
            finally:
                if swarm is not None:
                    swarm.close()
        if "gloo" in systems:
            rows.append(run_gloo(lab, new("gloo", "tcp"), size, rounds, timeout, cell_logs))
            say(_line(rows[-1]))
        if "tcp" in systems:
            rows.append(run_tcp(lab, new("raw TCP", "tcp"), size, rounds, timeout, cell_logs))
            say(_line(rows[-1]))
        if "hivemind" in systems:
            row = new("hivemind", "tcp+noise")
            rows.append(run_hivemind(lab, row, size, rounds, timeout, cell_logs))
            say(_line(rows[-1]))
    return rows


def _line(row: Row) -> str:
    return "# " + json.dumps({**dataclasses.asdict(row), "fraction": row.fraction})


def _fmt(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def table(rows: Sequence[Row]) -> str:
    """The markdown table of ``rows`` (gloo and hivemind beside ours' rows of their cell)."""
    head = (
        "| profile | N | MiB | system | transport | time s (median) | bound s | of bound"
        " | exact | load | busy | emu | CPU s | drops | rounds s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        time_s = _fmt(r.median_s) if r.status == "ok" else r.status
        share = "" if r.fraction is None else f"{100 * r.fraction:.0f}%"
        lines.append(
            f"| {r.profile} | {r.peers} | {r.size_mib:g} | {r.system} | {r.transport} | {time_s}"
            f" | {_fmt(r.bound_s)} | {share} | {'' if r.exact is None else r.exact} | {r.load}"
            f" | {_fmt(r.busy)} | {_fmt(r.emulator)} | {_fmt(r.cpu_s, 1)}"
            f" | {'' if r.drops is None else r.drops}"
            f" | {' '.join(f'{t:.2f}' for t in r.times_s)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None, help="MiB per peer, comma-separated (64)")
    parser.add_argument("--peers", default=None, help="comma-separated (4,8)")
    parser.add_argument("--profiles", default=None, help="lan, wan, bad, mixed (wan,bad,lan,mixed)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per system (3)")
    parser.add_argument("--systems", default="ours,gloo,hivemind")
    parser.add_argument(
        "--transports",
        default="tcp,quic",
        help="ours' transports: tcp, quic, quic/<congestion control> (quic/bbr)",
    )
    parser.add_argument("--rates-only", action="store_true", help="rates only, no emulator")
    parser.add_argument("--lossless", action="store_true", help="the profiles without loss")
    parser.add_argument(
        "--offload", choices=("on", "off"), default="on", help="the lab's offload frames"
    )
    parser.add_argument("--part-mib", type=float, default=None, help="ours' part size, MiB")
    parser.add_argument("--round-timeout", type=float, default=None, help="s (4x bound + 60)")
    parser.add_argument("--quick", action="store_true", help="a check: small sizes, 3 peers")
    parser.add_argument("--logs", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    quick = args.quick
    sizes = [float(s) for s in (args.sizes or ("0.25" if quick else "64")).split(",") if s]
    peers = [int(p) for p in (args.peers or ("3" if quick else "4,8")).split(",") if p]
    profiles = [p for p in (args.profiles or ("wan" if quick else "wan,bad,lan,mixed")).split(",")]
    rounds = args.rounds if args.rounds is not None else (1 if quick else 3)
    systems = [s for s in args.systems.split(",") if s]
    transports = [t for t in args.transports.split(",") if t]
    for profile in profiles:
        if profile not in (*PROFILES, "mixed"):
            parser.error(f"--profiles: unknown profile {profile!r}")
    for system in systems:
        if system not in SYSTEMS:
            parser.error(f"--systems: unknown system {system!r} (one of {SYSTEMS})")
    for transport in transports:
        name, _, congestion = transport.partition("/")
        if name not in ("tcp", "quic") or (congestion and name != "quic"):
            parser.error(f"--transports: unknown transport {transport!r}")
    if any(n < 2 for n in peers) or any(s <= 0 for s in sizes) or rounds < 1:
        parser.error("--peers must be at least 2, --sizes positive, --rounds at least 1")
    logs = args.logs or Path(tempfile.mkdtemp(prefix="netbench-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"# logs in {logs}; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    rows: list[Row] = []

    def on_term(signum: int, frame: object) -> None:  # (as Ctrl+C: the labs are removed)
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    try:
        for profile in profiles:
            for n in peers:
                for size_mib in sizes:
                    run_cell(
                        profile,
                        n,
                        size_mib,
                        systems=systems,
                        transports=transports,
                        rounds=rounds,
                        rates_only=args.rates_only,
                        lossless=args.lossless,
                        part_bytes=None if args.part_mib is None else int(args.part_mib * MIB),
                        measured=not quick,  # (its rounds are too small to measure)
                        offload=args.offload == "on",
                        round_timeout=args.round_timeout,
                        logs=logs,
                        say=lambda line: print(line, flush=True),
                        rows=rows,
                    )
    except KeyboardInterrupt:
        print("# interrupted: the lab and its processes are removed", flush=True)
        rows.append(Row("interrupted", 0, 0.0, "", "", 0.0, status="interrupted"))
    print(table(rows))
    if args.json:
        args.json.write_text(
            json.dumps([{**dataclasses.asdict(r), "fraction": r.fraction} for r in rows], indent=1)
        )
    bad = [r for r in rows if r.status != "ok" or r.exact is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
