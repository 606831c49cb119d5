"""``swarmavg demo averaging``: a swarm of peer processes on this machine averages random tensors
(the mechanism under ``swarmavg demo``, which trains a model: :mod:`swarmavg._train_demo`).

The demo starts ``--peers`` processes (:mod:`swarmavg._demo_peer`), each with a ``swarmavg.DHT``
on loopback (the first one's addresses are the others' ``initial_peers``) and a
``swarmavg.DecentralizedAverager`` over random tensors of its own. It steps them in lockstep:
each round every peer calls ``step()`` once, and the next round starts when all have reported.
The peers start in a Moshpit grid (initial group bits), so with 4 peers in groups of 2 the first
round averages pairs and the second mixes the pairs: every peer then holds the exact mean.

The demo process shows a progress bar on stderr (plain lines when stderr is not a terminal),
prints a table per round on stdout and plots the distance to the mean per round. It computes
the exact mean of all peers' initial tensors itself (they are seeded), and every peer reports
how far its tensors are from it; no tensor data reaches the demo process.
"""

from __future__ import annotations

import contextlib
import csv
import json
import queue
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from swarmavg._demo_peer import initial_values, split_sizes
from swarmavg._processes import KILL_TIMEOUT, LOG_TAIL, ChildProcesses
from swarmavg._processes import interrupts_held as _interrupts_held
from swarmavg.errors import SwarmError, TransportNotFound

__all__ = ["DemoOptions", "option_error", "run_demo"]

#: The longest the peers may take to start (import torch, start their DHT and averager).
STARTUP_TIMEOUT = 120.0
#: How long a peer's leader waits for its group to fill (``averaging_expiration``).
AVERAGING_EXPIRATION = 3.0
#: A peer's budget to get into a group in one round (``step(timeout=...)``); without a group by
#: then it sits the round out.
STEP_TIMEOUT = 15.0
#: The averager's ``allreduce_timeout``.
ALLREDUCE_TIMEOUT = 60.0
#: The longest one round may take, for all peers together.
ROUND_TIMEOUT = STEP_TIMEOUT + ALLREDUCE_TIMEOUT + 30.0
#: The peers' ``min_group_size``.
MIN_GROUP_SIZE = 2
#: Below this distance to the mean, the peers hold the exact mean up to float32 rounding.
EXACT = 1e-5
#: The most peers the demo starts (each one is a process with torch loaded).
MAX_PEERS = 32


@dataclass(frozen=True)
class DemoOptions:
    """The options of ``swarmavg demo`` (the defaults are the command's)."""

    peers: int = 4
    rounds: int = 5
    size: int = 4_000_000
    group_size: int = 2
    transport: str = "tcp"
    encryption: bool = True
    plot: Path = field(default_factory=lambda: Path("swarmavg-demo.png"))
    seed: int = 0


def option_error(options: DemoOptions) -> str | None:
    """What is wrong with ``options``, naming the option; ``None`` if they are fine."""
    from swarmavg.transport import resolve_transport

    if not 2 <= options.peers <= MAX_PEERS:
        return f"--peers must be in 2..{MAX_PEERS}, not {options.peers}"
    if options.rounds < 1:
        return f"--rounds must be at least 1, not {options.rounds}"
    if options.size < 1:
        return f"--size must be at least 1, not {options.size}"
    if not 2 <= options.group_size <= options.peers:
        return f"--group-size must be in 2..{options.peers} (--peers), not {options.group_size}"
    if options.seed < 0:
        return f"--seed must be at least 0, not {options.seed}"
    try:
        resolve_transport(options.transport)
    except TransportNotFound as exc:
        return f"--transport {options.transport}: {exc}"
    if options.transport != "tcp" and not options.encryption:
        return f"--no-encryption applies to tcp only; {options.transport} always encrypts"
    if options.plot.is_dir():
        return f"--plot {options.plot} is a directory; name a file"
    if not options.plot.absolute().parent.is_dir():
        return f"--plot {options.plot}: the directory {options.plot.parent} does not exist"
    return None


def group_bits(peers: int, group_size: int) -> list[str]:
    """Initial group bits that lay ``peers`` out as a Moshpit grid: ``2**width`` groups of at
    least ``group_size`` peers each (exactly that many when ``peers = group_size * 2**k``)."""
    width = max(peers // group_size, 1).bit_length() - 1
    groups = 1 << width
    return [format(i * groups // peers, f"0{width}b") if width else "" for i in range(peers)]


def reaches_exact_mean(peers: int, group_size: int) -> bool:
    """Whether the grid is even, so that every round fills every group and the peers reach the
    exact mean (a power-of-two group size lets the next round's bits split each group evenly)."""
    width = max(peers // group_size, 1).bit_length() - 1
    power_of_two = group_size & (group_size - 1) == 0
    return peers == group_size << width and (width == 0 or power_of_two)


def lonely_peers(bits: Sequence[str], reported: dict[int, dict[str, Any]]) -> list[int]:
    """The peers that cannot find a group this round: those still looking (not in ``reported``,
    the round's reports so far) alone under their group bits (``bits``, per peer), where no
    group still averaging (some of its members have not reported) might be theirs."""
    reports = Counter(event["group"] for event in reported.values() if event["group"] is not None)
    averaging = {
        event["bits"]
        for event in reported.values()
        if event["group"] is not None and reports[event["group"]] < event["group_size"]
    }
    looking = Counter(bits[i] for i in range(len(bits)) if i not in reported)
    return [
        i
        for i in range(len(bits))
        if i not in reported and looking[bits[i]] < MIN_GROUP_SIZE and bits[i] not in averaging
    ]


# -- the peer processes --------------------------------------------------------------------------


class PeerFailed(SwarmError):
    """A peer process failed (its error), or broke the demo's protocol."""

    def __init__(self, index: int, message: str, log_tail: Sequence[str] = ()) -> None:
        super().__init__(f"peer {index} {message}")
        self.index = index
        #: the last lines the peer wrote to its stderr (a traceback, log messages)
        self.log_tail = list(log_tail)


class _Peers(ChildProcesses):
    """The peer processes, their stdout read by threads into one queue."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, "swarmavg._demo_peer", "peer")
        self._queue: queue.Queue[tuple[int, str | None]] = queue.Queue()
        self._inbox: list[deque[dict[str, Any]]] = []

    def _spawned(self, index: int) -> None:
        self._inbox.append(deque())

    def _deliver(self, index: int, line: str | None) -> None:
        self._queue.put((index, line))

    def send(self, index: int, **command: Any) -> None:
        stdin = self.processes[index].stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps(command) + "\n")
            stdin.flush()
        except OSError:  # it is gone: say why
            raise self.failure(index, "stopped taking commands") from None

    def collect(
        self,
        expected: dict[int, str],
        timeout: float,
        on_event: Callable[[int, dict[str, Any]], None],
        tick: Callable[[], None] | None = None,
    ) -> dict[int, dict[str, Any]]:
        """Wait until each peer ``i`` in ``expected`` has sent an event ``expected[i]`` (other
        peers' events wait their turn); ``on_event(i, event)`` for each.

        A ``loaded`` event (a peer has imported torch and made its tensors) goes to
        ``on_event`` whenever it comes.

        :raises PeerFailed: a peer reported an error, exited, or sent another event.
        :raises TimeoutError: not all of them within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        got: dict[int, dict[str, Any]] = {}
        while True:
            for index, name in expected.items():
                inbox = self._inbox[index]
                if index in got or not inbox:
                    continue
                event = inbox.popleft()
                if event.get("event") == "error":
                    raise self.failure(index, f"failed: {event.get('error')}")
                if event.get("event") != name:
                    what = f"sent {event.get('event')!r} instead of {name!r}"
                    raise self.failure(index, what, ending=False)
                got[index] = event
                on_event(index, event)
            if len(got) == len(expected):
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                late = sorted(set(expected) - set(got))
                raise TimeoutError(
                    f"peers {late} did not send {sorted(set(expected.values()))} "
                    f"within {timeout:.0f} s"
                )
            try:
                index, line = self._queue.get(timeout=min(left, 0.2))
            except queue.Empty:
                if tick is not None:
                    tick()
                continue
            if line is None:
                raise self.failure(index, "exited")
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict) and event.get("event") == "loaded":
                    on_event(index, event)  # news of its progress, whatever we wait for
                elif isinstance(event, dict):
                    self._inbox[index].append(event)

    def failure(self, index: int, what: str, *, ending: bool = True) -> PeerFailed:
        """The error for peer ``index``, with the end of its stderr; ``ending``: it is exiting
        (or gone), so wait a moment for its exit status and its last words."""
        process = self.processes[index]
        if ending:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(KILL_TIMEOUT)
        code = process.returncode
        if what in ("exited", "stopped taking commands"):
            for event in self._pending_events(index):  # it may have said why before it went
                if event.get("event") == "error":
                    what = f"failed: {event.get('error')}"
            if code is not None and code < 0:
                with contextlib.suppress(ValueError):
                    what += f" (killed by {signal.Signals(-code).name})"
            elif code is not None:
                what += f" (exit status {code})"
        self._log_files[index].flush()
        lines = self.logs[index].read_text(errors="replace").splitlines()[-LOG_TAIL:]
        return PeerFailed(index, what, lines)

    def _pending_events(self, index: int) -> list[dict[str, Any]]:
        """The events of peer ``index`` received but not handled yet (its last words)."""
        while True:
            try:
                other, line = self._queue.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if isinstance(event, dict):
                        self._inbox[other].append(event)
        return list(self._inbox[index])


# -- progress and the table ----------------------------------------------------------------------


class _Progress:
    """A progress bar on a terminal, or one line per finished phase elsewhere."""

    WIDTH = 30

    def __init__(self, stream: TextIO, total: int) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.total = total
        self.done = 0
        self.label = ""
        self.started = time.monotonic()
        self._phase_started = self.started
        self._drawn = False

    def phase(self, label: str) -> None:
        self.label = label
        self._phase_started = time.monotonic()
        self.draw()

    def advance(self) -> None:
        self.done += 1
        self.draw()

    def finished(self, what: str) -> None:
        """The phase is over: a line when not on a terminal."""
        if not self.tty:
            seconds = time.monotonic() - self._phase_started
            print(f"swarmavg demo: {what} in {seconds:.1f} s", file=self.stream, flush=True)

    def draw(self) -> None:
        if not self.tty:
            return
        filled = self.WIDTH * self.done // max(self.total, 1)
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        percent = 100 * self.done // max(self.total, 1)
        elapsed = time.monotonic() - self.started
        text = f"[{bar}] {percent:3d}%  {self.label}  {elapsed:.1f} s"
        self.stream.write("\r\x1b[K" + text)
        self.stream.flush()
        self._drawn = True

    def clear(self) -> None:
        if self.tty and self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False


@dataclass
class _Round:
    number: int
    groups: str
    matchmaking: float | None
    allreduce: float | None
    gbps: float | None
    distances: list[float]

    @property
    def distance(self) -> float:
        return max(self.distances)


def _groups_text(events: dict[int, dict[str, Any]]) -> str:
    """The round's groups: their members for a few peers (``0+1 2+3``, ``(4)`` for a peer that
    found no group), their sizes for more (``8x2``)."""
    members: dict[str, list[int]] = {}
    alone = []
    for index, event in sorted(events.items()):
        if event["group"] is None:
            alone.append(index)
        else:
            members.setdefault(event["group"], []).append(index)
    groups = sorted(members.values())
    if len(events) <= 8:
        parts = ["+".join(map(str, g)) for g in groups] + [f"({i})" for i in alone]
    else:
        sizes = Counter(len(g) for g in groups)
        parts = [f"{count}x{size}" for size, count in sorted(sizes.items(), reverse=True)]
        parts += [f"{len(alone)} alone"] if alone else []
    return " ".join(parts)


def _summarize(number: int, events: dict[int, dict[str, Any]]) -> _Round:
    averaged = [e for e in events.values() if e["group"] is not None]
    rates = [e["bytes"] / e["allreduce_seconds"] / 1e9 for e in averaged if e["allreduce_seconds"]]
    return _Round(
        number=number,
        groups=_groups_text(events),
        matchmaking=max(e["matchmaking_seconds"] for e in events.values()),
        allreduce=max((e["allreduce_seconds"] for e in averaged), default=None),
        gbps=sum(rates) / len(rates) if rates else None,
        distances=[events[i]["distance"] for i in sorted(events)],
    )


_HEADER = (
    f"{'round':>5}  {'groups':<16} {'matchmaking':>11}  {'all-reduce':>10}  {'GB/s':>6}  "
    f"{'distance to mean':>16}"
)


def _row(r: _Round) -> str:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f} s"

    rate = "-" if r.gbps is None else f"{r.gbps:.2f}"
    label = "start" if r.number == 0 else str(r.number)
    return (
        f"{label:>5}  {r.groups or '-':<16} {seconds(r.matchmaking):>11}  "
        f"{seconds(r.allreduce):>10}  {rate:>6}  {r.distance:>16.2e}"
    )


_LEGEND = """\
groups: the peers (0..{last}) that averaged together, (i): peer i found no group; matchmaking,
all-reduce: the slowest peer's time to find its group and to average in it; GB/s: bytes sent +
received / all-reduce time, per peer (mean over peers); distance to mean: max over peers of
||x_i - m|| / ||m||, m the exact mean of all peers' initial tensors (computed in float64 from
their seeds)."""


# -- the plot ------------------------------------------------------------------------------------

#: The peers' markers, in turn.
_MARKERS = "osD^v<>PX*"
#: Log axes cannot show 0: smaller distances are drawn at this value.
_FLOOR = 1e-12


def _write_plot(path: Path, rounds: list[_Round], title: str) -> str:
    """Plot the distance to the mean per round into ``path`` (a CSV file beside it without
    matplotlib); the line to print about it."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        csv_path = path.with_suffix(".csv")
        with open(csv_path, "w", newline="") as file:
            writer = csv.writer(file)
            peers = len(rounds[0].distances)
            writer.writerow(["round", "max_distance", *(f"peer_{i}" for i in range(peers))])
            for r in rounds:
                writer.writerow([r.number, repr(r.distance), *map(repr, r.distances)])
        return (
            f"matplotlib is not installed, so no plot: `pip install swarmavg[demo]` for one "
            f"(the distances per round are in {csv_path})"
        )
    figure = Figure(figsize=(7, 4.5), layout="constrained")
    axes = figure.add_subplot()
    numbers = [r.number for r in rounds]
    peers = len(rounds[0].distances)
    # below EXACT the peers hold the mean up to float32 rounding: a zone the curves enter (not
    # a target line drawn above where they end)
    lowest = min(max(d, _FLOOR) for r in rounds for d in r.distances)
    axes.axhspan(
        min(lowest, EXACT) / 10,
        EXACT,
        color="tab:green",
        alpha=0.12,
        linewidth=0,
        label=f"the exact mean, up to float32 rounding (< {EXACT:.0e})",
    )
    # one line per peer, each its own colour, marker and width (the first ones widest, under
    # the others): where they coincide, every one still shows
    for i in range(peers):
        values = [max(r.distances[i], _FLOOR) for r in rounds]
        axes.plot(
            numbers,
            values,
            marker=_MARKERS[i % len(_MARKERS)],
            markersize=4 + 3 * (peers - i) / peers,
            fillstyle="none",
            linewidth=1 + 2 * (peers - 1 - i) / max(peers - 1, 1),
            alpha=0.85,
            zorder=2 + i,
            label=f"peer {i}" if peers <= 8 else ("each peer" if i == 0 else None),
        )
    axes.set_yscale("log")
    axes.set_xticks(numbers)
    axes.set_xlabel("round (0: before averaging)")
    axes.set_ylabel("distance to the mean, ||x_i - mean|| / ||mean||")
    axes.set_title(title)
    axes.grid(True, which="major", alpha=0.3)
    axes.legend()
    suffix = path.suffix.lower().lstrip(".")
    figure.savefig(path, format=suffix if suffix in {"png", "svg", "pdf"} else "png", dpi=100)
    return f"convergence plot: {path}"


# -- the demo ------------------------------------------------------------------------------------


def _size_text(count: int) -> str:
    return f"{count / 1e6:.1f} M" if count >= 1_000_000 else f"{count:,}"


def _bytes_text(count: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"


def run_demo(options: DemoOptions, out: TextIO | None = None, err: TextIO | None = None) -> None:
    """Run the demo (see the module docstring); ``options`` must pass :func:`option_error`.

    :raises PeerFailed: a peer failed (its error is in the message).
    :raises TimeoutError: the peers did not start or finish a round in time.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    started = time.monotonic()
    n = options.peers
    tensors = len(split_sizes(options.size))
    how = (
        "" if options.transport != "tcp" else (" encrypted" if options.encryption else " in clear")
    )
    print(
        f"swarmavg demo: {n} peers (processes) on 127.0.0.1 over {options.transport}{how}, "
        f"each with {tensors} random tensors of {_size_text(options.size)} float32 in all "
        f"({_bytes_text(options.size * 4)}), average in groups of {options.group_size} "
        f"for {options.rounds} rounds (seed {options.seed})",
        file=out,
        flush=True,
    )
    if not reaches_exact_mean(n, options.group_size):
        print(
            f"note: {n} peers do not fill a grid of groups of {options.group_size} (that takes "
            f"peers = group size x 2^k, a group size that is a power of 2): peers may sit rounds "
            f"out and the mean is approached rather than reached exactly",
            file=out,
            flush=True,
        )
    # the bar counts the peers' round reports only: it stands at 0% until round 1 has begun
    # (the startup shows in its label: peers loaded, ready)
    progress = _Progress(err, total=n * options.rounds)
    with tempfile.TemporaryDirectory(prefix="swarmavg-demo-") as workdir:
        progress.phase("computing the mean")
        total = np.zeros(options.size, dtype=np.float64)
        for i in range(n):
            total += initial_values(options.seed, i, options.size)
        mean_path = Path(workdir) / "mean.npy"
        np.save(mean_path, total / n)
        del total
        peers = _Peers(Path(workdir))
        try:
            rounds = _run_swarm(options, peers, mean_path, progress, out)
        except PeerFailed as exc:
            progress.clear()
            if exc.log_tail:
                print(f"--- the end of peer {exc.index}'s stderr ---", file=err)
                print("\n".join(exc.log_tail), file=err)
                print("---", file=err, flush=True)
            raise
        finally:
            progress.clear()
            with _interrupts_held():
                peers.close()
    print(_LEGEND.format(last=n - 1), file=out)
    final = rounds[-1].distance
    if final < EXACT:
        exact = min(r.number for r in rounds if all(s.distance < EXACT for s in rounds[r.number :]))
        print(
            f"every peer holds the exact mean (up to float32 rounding) from round {exact}", file=out
        )
    else:
        print(f"distance to the mean after {options.rounds} rounds: {final:.2e}", file=out)
    title = f"swarmavg demo averaging: {n} peers in groups of {options.group_size}"
    print(_write_plot(options.plot, rounds, title), file=out)
    print(f"done in {time.monotonic() - started:.1f} s", file=out, flush=True)


def _run_round(
    peers: _Peers, number: int, bits: list[str], progress: _Progress
) -> dict[int, dict[str, Any]]:
    """Step every peer once (``bits``: their group bits); their reports."""
    reported: dict[int, dict[str, Any]] = {}
    released: set[int] = set()

    def on_report(index: int, event: dict[str, Any]) -> None:
        """Progress; and a peer that nobody is left to make a group with stops looking now
        rather than at its timeout (in a grid that the groups do not fill evenly)."""
        if event["event"] == "round":
            reported[index] = event
            progress.advance()
        for lonely in set(lonely_peers(bits, reported)) - released:
            peers.send(lonely, cmd="skip", round=number)
            released.add(lonely)

    for i in range(len(bits)):
        peers.send(i, cmd="step", round=number)
    on_report(-1, {"event": "started"})
    expected = dict.fromkeys(range(len(bits)), "round")
    return peers.collect(expected, ROUND_TIMEOUT, on_report, progress.draw)


def _run_swarm(
    options: DemoOptions, peers: _Peers, mean_path: Path, progress: _Progress, out: TextIO
) -> list[_Round]:
    """Start the peers, step them round after round, print the table and stop them; the rounds
    (round 0: before averaging)."""
    n = options.peers
    bits = group_bits(n, options.group_size)
    progress.phase(f"starting {n} peers")
    with _interrupts_held():
        for i in range(n):
            peers.spawn(
                {
                    "index": i,
                    "size": options.size,
                    "seed": options.seed,
                    "mean_path": str(mean_path),
                    "transport": options.transport,
                    "encryption": options.encryption,
                    "group_size": options.group_size,
                    "bits": bits[i],
                    "averaging_expiration": AVERAGING_EXPIRATION,
                    "step_timeout": STEP_TIMEOUT,
                    "allreduce_timeout": ALLREDUCE_TIMEOUT,
                    "startup_timeout": STARTUP_TIMEOUT,
                    "command_timeout": STARTUP_TIMEOUT + ROUND_TIMEOUT,
                }
            )

    started: Counter[str] = Counter()

    def on_event(index: int, event: dict[str, Any]) -> None:
        if event["event"] in ("loaded", "ready"):
            started[event["event"]] += 1
            progress.phase(
                f"starting {n} peers: {started['loaded']} loaded, {started['ready']} ready"
            )

    def show(row: _Round) -> None:
        progress.clear()
        print(_row(row), file=out, flush=True)
        progress.draw()

    startup = time.monotonic()
    first = peers.collect({0: "listening"}, STARTUP_TIMEOUT, on_event, progress.draw)
    for i in range(1, n):
        peers.send(i, cmd="join", initial_peers=first[0]["maddrs"])
    left = STARTUP_TIMEOUT - (time.monotonic() - startup)
    ready = peers.collect(dict.fromkeys(range(n), "ready"), left, on_event, progress.draw)
    progress.finished(f"{n} peers ready")
    rounds = [_Round(0, "", None, None, None, [ready[i]["distance"] for i in range(n)])]
    progress.clear()
    print(_HEADER, file=out)
    show(rounds[0])
    bits = [ready[i]["bits"] for i in range(n)]
    for number in range(1, options.rounds + 1):
        progress.phase(f"round {number}/{options.rounds}")
        events = _run_round(peers, number, bits, progress)
        bits = [events[i]["next_bits"] for i in range(n)]
        progress.finished(f"round {number}/{options.rounds}")
        rounds.append(_summarize(number, events))
        show(rounds[-1])
    progress.phase("stopping the peers")
    failed = peers.stop()
    if failed:
        index, code = failed[0]
        raise peers.failure(index, f"ended with exit status {code}")
    return rounds
