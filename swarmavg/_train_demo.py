"""``swarmavg demo``: a swarm of peer processes on this machine trains a model together.

The demo starts ``--peers`` processes (:mod:`swarmavg._train_demo_peer`), each with a
``swarmavg.DHT`` on loopback (the first one's addresses are the others' ``initial_peers``) and
the chosen optimizer (``swarmavg.Optimizer`` today), and one more process that trains the same
model alone with the swarm's global batch (at a lower priority: the swarm comes first). They
train the workload of :mod:`swarmavg.testing.workload` (a byte-level transformer language
model on Python's standard library) for ``--epochs`` epochs of ``--target-batch-size``
samples, each peer drawing its own batches.

While they train, the demo shows each process's epoch, samples/s, training loss and last group
size, and the swarm's epoch and ETA: a live table with rich on a terminal, else one line per
swarm epoch. With ``--kill-one`` one peer is SIGKILLed halfway through and the others go on.
Then it prints a summary table and plots the validation loss against the samples trained on
(every peer, and the process alone) and each epoch's time split into compute and averaging
(a PNG with matplotlib, else a CSV file). The processes report in JSON lines on their stdout;
no tensor reaches the demo process, which does not import torch.
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import json
import queue
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from swarmavg._processes import KILL_TIMEOUT, STOP_TIMEOUT, ChildProcesses
from swarmavg._processes import interrupts_held as _interrupts_held
from swarmavg._train_demo_peer import OPTIMIZERS
from swarmavg.errors import SwarmError, TransportNotFound

__all__ = ["ProcessFailed", "TrainOptions", "option_error", "run_training_demo"]

#: The longest the processes may take to start (import torch, start their DHT and optimizer).
STARTUP_TIMEOUT = 120.0
#: The optimizer's ``matchmaking_time`` and ``averaging_timeout``.
MATCHMAKING_TIME = 2.0
AVERAGING_TIMEOUT = 15.0
#: The longest the swarm may go without any process finishing an epoch.
STALL_TIMEOUT = 4 * AVERAGING_TIMEOUT + 60.0
#: The most peers the demo starts (each one is a process with torch loaded).
MAX_PEERS = 16
#: Adam's learning rate (every process), and the seeds of the model and of the batches.
LR = 4e-3
MODEL_SEED = 0
DATA_SEED = 0
#: Validation batches (of 64 windows) per evaluation, and about how many evaluations a run has.
EVAL_BATCHES = 4
EVAL_POINTS = 12
#: Seconds between a process's progress reports.
REPORT_INTERVAL = 0.5
#: The file names (in ``--out``) of the plot and of the CSV that stands in for it.
PLOT_NAME = "swarmavg-training.png"
CSV_NAME = "swarmavg-training.csv"


@dataclass(frozen=True)
class TrainOptions:
    """The options of ``swarmavg demo`` (the defaults are the command's)."""

    peers: int = 4
    epochs: int = 80
    target_batch_size: int = 256
    batch_size: int = 16
    transport: str = "tcp"
    optimizer: str = "hivemind"
    kill_one: bool = False
    plot: bool = True
    out: Path = field(default_factory=lambda: Path("."))


def option_error(options: TrainOptions) -> str | None:
    """What is wrong with ``options``, naming the option; ``None`` if they are fine."""
    from swarmavg.transport import resolve_transport

    if not 2 <= options.peers <= MAX_PEERS:
        return f"--peers must be in 2..{MAX_PEERS}, not {options.peers}"
    if options.epochs < 1:
        return f"--epochs must be at least 1, not {options.epochs}"
    if options.kill_one and options.epochs < 2:
        return f"--kill-one needs --epochs of at least 2, not {options.epochs}"
    if options.batch_size < 1:
        return f"--batch-size must be at least 1, not {options.batch_size}"
    if options.target_batch_size < options.batch_size:
        return (
            f"--target-batch-size must be at least --batch-size ({options.batch_size}), "
            f"not {options.target_batch_size}"
        )
    if options.optimizer not in OPTIMIZERS:
        return f"--optimizer must be one of {', '.join(OPTIMIZERS)}, not {options.optimizer!r}"
    try:
        resolve_transport(options.transport)
    except TransportNotFound as exc:
        return f"--transport {options.transport}: {exc}"
    if not options.out.is_dir():
        return f"--out {options.out} is not a directory"
    return None


class ProcessFailed(SwarmError):
    """A process of the demo failed (its error), or was killed by another than the demo."""

    def __init__(self, name: str, index: int, message: str, log_tail: list[str]) -> None:
        super().__init__(f"{name} {message}")
        self.name = name
        self.index = index
        #: the last lines the process wrote to its stderr (a traceback, log messages)
        self.log_tail = log_tail


# -- the processes -------------------------------------------------------------------------------


class _Processes(ChildProcesses):
    """The peer processes and the one alone; their events read by threads into one queue."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, "swarmavg._train_demo_peer", "process")
        self.events: queue.Queue[tuple[int, dict[str, Any] | None]] = queue.Queue()

    def _deliver(self, index: int, line: str | None) -> None:
        if line is None:
            self.events.put((index, None))
            return
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict):
                self.events.put((index, event))

    def send(self, index: int, **command: Any) -> None:
        """Send a command; a process that is gone is not an error here (its end says why)."""
        stdin = self.processes[index].stdin
        if stdin is None:
            return
        with contextlib.suppress(OSError, ValueError):
            stdin.write(json.dumps(command) + "\n")
            stdin.flush()


# -- what the demo knows of each process ---------------------------------------------------------


@dataclass
class _Epoch:
    """One epoch as a process reported it."""

    epoch: int
    seconds: float
    averaging: float
    group: int | None
    val_loss: float | None


@dataclass
class _Process:
    """One process as the demo sees it."""

    name: str
    alone: bool
    state: str = "starting"
    epoch: int = 0
    samples: int = 0
    samples_per_s: float | None = None
    loss: float | None = None
    group: int | None = None
    swarm_peers: int | None = None
    started: float | None = None
    finished: float | None = None
    epochs: list[_Epoch] = field(default_factory=list)
    val: list[tuple[int, float]] = field(default_factory=list)  # (epoch, validation loss)

    @property
    def live(self) -> bool:
        return self.state in ("starting", "ready", "training")

    def on_event(self, event: dict[str, Any], now: float) -> None:
        kind = event.get("event")
        if kind == "ready":
            self.state = "ready"
        elif kind == "progress" and self.state != "done":  # (done: it steps on, uncounted)
            self.samples = int(event["samples"])
            self.samples_per_s = event.get("samples_per_s")
            self.loss = event.get("loss")
            self.group = event.get("group")
            self.swarm_peers = event.get("swarm_peers")
        elif kind == "epoch":
            if self.state == "ready":
                self.state, self.started = "training", now
            self.epoch = int(event["epoch"])
            if event.get("val_loss") is not None:
                self.val.append((self.epoch, float(event["val_loss"])))
            if self.epoch > 0:
                self.group = event.get("group", self.group)
                self.epochs.append(
                    _Epoch(
                        self.epoch,
                        float(event["seconds"]),
                        float(event["averaging"]),
                        event.get("group"),
                        event.get("val_loss"),
                    )
                )
        elif kind == "done":
            self.state, self.finished = "done", now
            self.samples = int(event["samples"])
            self.loss = event.get("loss")


def _seconds(value: float) -> str:
    if value >= 90:
        return f"{int(value) // 60} min {int(value) % 60:02d} s"
    return f"{value:.0f} s"


class _Swarm:
    """The processes' states, the swarm's epoch and its ETA."""

    def __init__(self, options: TrainOptions) -> None:
        self.options = options
        self.processes = [_Process(f"peer {i}", False) for i in range(options.peers)]
        self.processes.append(_Process("alone", True))  # (named "alone" in the view)
        self.epoch_reached: dict[int, float] = {}  # swarm epoch -> when the first peer got there
        self.killed: tuple[int, int] | None = None  # (peer, swarm epoch)

    @property
    def peers(self) -> list[_Process]:
        return self.processes[:-1]

    @property
    def alone(self) -> _Process:
        return self.processes[-1]

    @property
    def epoch(self) -> int:
        """The swarm's epoch: the highest any peer is at (alive or not)."""
        return max(p.epoch for p in self.peers)

    def on_event(self, index: int, event: dict[str, Any]) -> None:
        now = time.monotonic()
        self.processes[index].on_event(event, now)
        if not self.processes[index].alone and event.get("event") == "epoch":
            self.epoch_reached.setdefault(int(event["epoch"]), now)

    def eta(self) -> float | None:
        """Seconds until the swarm reaches the last epoch, from its last few epochs' pace."""
        epoch = self.epoch
        if epoch >= self.options.epochs:
            return 0.0
        known = sorted(e for e in self.epoch_reached if e <= epoch)
        recent = known[-6:]
        if len(recent) < 2:
            return None
        pace = (self.epoch_reached[recent[-1]] - self.epoch_reached[recent[0]]) / (
            recent[-1] - recent[0]
        )
        return pace * (self.options.epochs - epoch)

    def headline(self) -> str:
        live = sum(p.live for p in self.peers) + sum(p.state == "done" for p in self.peers)
        eta = self.eta()
        eta_text = "-" if eta is None else _seconds(eta)
        peers = f"{live} peer" + ("s" if live != 1 else "")
        text = f"swarm epoch {self.epoch}/{self.options.epochs}, {peers}, ETA {eta_text}"
        if self.killed is not None:
            text += f" (peer {self.killed[0]} was killed at epoch {self.killed[1]})"
        return text


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _row_cells(process: _Process) -> list[str]:
    return [
        process.name,
        process.state,
        str(process.epoch),
        _number(process.samples_per_s, 0),
        _number(process.loss, 3),
        "-" if process.group is None else str(process.group),
    ]


_COLUMNS = ["process", "state", "epoch", "samples/s", "train loss", "last group"]


# -- the live views ------------------------------------------------------------------------------


class _PlainView:
    """One line per swarm epoch and one per event, for a file, a pipe or a terminal without
    rich."""

    def __init__(self, swarm: _Swarm, out: TextIO) -> None:
        self.swarm = swarm
        self.out = out
        self._shown: tuple[int, int] = (-1, -1)

    def __enter__(self) -> _PlainView:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def note(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def refresh(self) -> None:
        """A line when the swarm's epoch changes (once it is done: every few epochs of the
        process alone)."""
        swarm_done = not any(p.live for p in self.swarm.peers)
        key = (1, self.swarm.alone.epoch // 5) if swarm_done else (0, self.swarm.epoch)
        if key == self._shown or not any(p.started is not None for p in self.swarm.processes):
            return
        self._shown = key
        parts = []
        for process in self.swarm.processes:
            if process.state in ("killed", "failed"):
                parts.append(f"{process.name}: {process.state}")
                continue
            rate = _number(process.samples_per_s, 0)
            loss = _number(process.loss, 2)
            group = "" if process.alone else f", group {process.group or '-'}"
            parts.append(f"{process.name}: epoch {process.epoch}, {rate}/s, loss {loss}{group}")
        self.note(f"{self.swarm.headline()} | " + " | ".join(parts))


class _RichView:
    """A live table (rich) on a terminal."""

    def __init__(self, swarm: _Swarm, out: TextIO) -> None:
        self.swarm = swarm
        console_module = importlib.import_module("rich.console")
        live_module = importlib.import_module("rich.live")
        self._table_module = importlib.import_module("rich.table")
        self._console = console_module.Console(file=out)
        self._live = live_module.Live(
            self._render(), console=self._console, refresh_per_second=4, transient=False
        )

    def __enter__(self) -> _RichView:
        self._live.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._live.update(self._render())
        self._live.__exit__(None, None, None)

    def note(self, text: str) -> None:
        self._console.print(text)

    def _render(self) -> Any:
        table = self._table_module.Table(title=self.swarm.headline(), title_justify="left")
        for column in _COLUMNS:
            table.add_column(column, justify="left" if column in _COLUMNS[:2] else "right")
        styles = {"killed": "red", "failed": "red", "done": "green"}
        for process in self.swarm.processes:
            table.add_row(*_row_cells(process), style=styles.get(process.state))
        return table

    def refresh(self) -> None:
        self._live.update(self._render())


def _view(swarm: _Swarm, out: TextIO) -> _PlainView | _RichView:
    """rich's live table on a terminal where rich is installed; plain lines otherwise."""
    if out.isatty():
        try:
            return _RichView(swarm, out)
        except ImportError:
            pass
    return _PlainView(swarm, out)


# -- the summary and the plot --------------------------------------------------------------------


def _summary(swarm: _Swarm) -> list[str]:
    """The summary table and the lines under it."""
    options = swarm.options
    header = (
        f"{'process':<8} {'state':<7} {'epochs':>6} {'samples':>8} {'samples/s':>9} "
        f"{'train loss':>10} {'val loss':>15} {'group':>5} {'compute':>8} {'averaging':>9}"
    )
    lines = [header]
    for process in swarm.processes:
        compute = sum(e.seconds - e.averaging for e in process.epochs)
        averaging = sum(e.averaging for e in process.epochs)
        trained = (process.finished or time.monotonic()) - (process.started or time.monotonic())
        rate = process.samples / trained if trained > 0 else None
        val = (
            f"{process.val[0][1]:.2f} -> {process.val[-1][1]:.2f}" if len(process.val) > 1 else "-"
        )
        groups = sorted({e.group for e in process.epochs if e.group is not None})
        group = "-" if process.alone or not groups else "/".join(map(str, groups[-2:]))
        lines.append(
            f"{process.name:<8} {process.state:<7} {process.epoch:>6} {process.samples:>8,} "
            f"{_number(rate, 0):>9} {_number(process.loss, 3):>10} {val:>15} {group:>5} "
            f"{compute:>7.1f}s {averaging:>8.1f}s"
        )
    lines.append(
        "samples: fed by this process; samples/s: its mean; train loss: moving average of its "
        "last batches; val loss: validation\nloss (nats/byte) at the start and at its last "
        "epoch; group: the sizes of its gradient rounds' groups; compute,\naveraging: its "
        "epochs' time training on batches and at the epochs' ends (averaging, optimizer step)."
    )
    finished = [p for p in swarm.peers if p.state == "done"]
    if finished:
        names = ("peers " if len(finished) > 1 else "peer ") + ", ".join(
            p.name.split()[1] for p in finished
        )
        start = min(p.val[0][1] for p in finished)
        end = max(p.val[-1][1] for p in finished)
        began = min(p.started for p in swarm.peers if p.started is not None)
        trained = max(p.finished for p in finished if p.finished is not None) - began
        lines.append(
            f"{names} reached epoch {options.epochs} of {options.epochs} "
            f"({options.epochs * options.target_batch_size:,} samples, "
            f"{options.target_batch_size} per epoch) in {_seconds(trained)}; validation loss "
            f"fell from {start:.2f} to {end:.2f}"
            + (" (the highest over the peers)" if len(finished) > 1 else "")
        )
    if swarm.killed is not None:
        lines.append(
            f"peer {swarm.killed[0]} was killed (SIGKILL) at swarm epoch {swarm.killed[1]}; "
            f"the others went on without it"
        )
    if swarm.alone.state == "done" and len(swarm.alone.val) > 1:
        lines.append(
            f"one process alone with the same global batch ({options.target_batch_size}): "
            f"validation loss {swarm.alone.val[-1][1]:.2f} after the same samples"
        )
    return lines


def _epoch_times(swarm: _Swarm) -> list[tuple[int, float, float]]:
    """Per swarm epoch: the peers' mean compute and averaging seconds."""
    by_epoch: dict[int, list[_Epoch]] = {}
    for process in swarm.peers:
        for record in process.epochs:
            by_epoch.setdefault(record.epoch, []).append(record)
    rows = []
    for epoch, records in sorted(by_epoch.items()):
        averaging = sum(r.averaging for r in records) / len(records)
        compute = sum(r.seconds - r.averaging for r in records) / len(records)
        rows.append((epoch, max(compute, 0.0), averaging))
    return rows


def _write_csv(path: Path, swarm: _Swarm) -> None:
    target = swarm.options.target_batch_size
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["process", "epoch", "samples", "val_loss", "compute_s", "averaging_s"])
        for process in swarm.processes:
            val = dict(process.val)
            records = {r.epoch: r for r in process.epochs}
            for epoch in sorted(set(val) | set(records)):
                record = records.get(epoch)
                writer.writerow(
                    [
                        process.name,
                        epoch,
                        epoch * target,
                        "" if epoch not in val else repr(val[epoch]),
                        "" if record is None else repr(record.seconds - record.averaging),
                        "" if record is None else repr(record.averaging),
                    ]
                )


#: Line styles of the peers' validation curves: they overlap (the peers hold the same averaged
#: model), so each has its own dash, marker and width, the first ones widest, under the others.
_DASHES = ["-", "--", "-.", ":"]
_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


def _write_plot(out: Path, swarm: _Swarm, title: str) -> str:
    """Plot into ``out`` (a CSV file there without matplotlib); the line to print about it."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        csv_path = out / CSV_NAME
        _write_csv(csv_path, swarm)
        return (
            f"matplotlib is not installed, so no plot: `pip install swarmavg[demo]` for one "
            f"(the validation losses and epoch times are in {csv_path})"
        )
    target = swarm.options.target_batch_size
    figure = Figure(figsize=(13, 5), layout="constrained")
    loss_axes, time_axes = figure.subplots(1, 2)
    count = len(swarm.peers)
    for i, process in enumerate(swarm.peers):
        if not process.val:
            continue
        xs = [epoch * target for epoch, _ in process.val]
        ys = [loss for _, loss in process.val]
        label = process.name + (" (killed)" if process.state == "killed" else "")
        loss_axes.plot(
            xs,
            ys,
            linestyle=_DASHES[i % len(_DASHES)],
            marker=_MARKERS[i % len(_MARKERS)],
            markersize=4 + 2 * (count - i) / count,
            fillstyle="none",
            linewidth=1.2 + 2.5 * (count - 1 - i) / max(count - 1, 1),
            alpha=0.85,
            label=label,
            zorder=2 + i,
        )
    if swarm.alone.val:
        loss_axes.plot(
            [epoch * target for epoch, _ in swarm.alone.val],
            [loss for _, loss in swarm.alone.val],
            color="black",
            linestyle=(0, (1, 1)),
            linewidth=2,
            label=f"one process alone, batch {target}",
            zorder=1,
        )
    if swarm.killed is not None:
        for axes, x in ((loss_axes, swarm.killed[1] * target), (time_axes, swarm.killed[1])):
            axes.axvline(x, color="tab:red", linewidth=1, linestyle="--", zorder=0)
        loss_axes.annotate(
            f"peer {swarm.killed[0]} killed",
            (swarm.killed[1] * target, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(4, -14),
            textcoords="offset points",
            color="tab:red",
        )
    loss_axes.set_xlabel("samples trained on by the swarm (epoch x target batch size)")
    loss_axes.set_ylabel("validation loss (nats/byte)")
    loss_axes.set_title("validation loss (the peers hold the same averaged model)")
    loss_axes.grid(True, alpha=0.3)
    loss_axes.legend()
    rows = _epoch_times(swarm)
    if rows:
        epochs = [r[0] for r in rows]
        compute = [r[1] for r in rows]
        averaging = [r[2] for r in rows]
        time_axes.bar(epochs, compute, width=0.8, color="tab:blue", label="compute")
        time_axes.bar(
            epochs, averaging, width=0.8, bottom=compute, color="tab:orange", label="averaging"
        )
    time_axes.set_xlabel("epoch")
    time_axes.set_ylabel("seconds (mean over the peers)")
    time_axes.set_title("time per epoch: compute and averaging (the epoch's end)")
    time_axes.grid(True, axis="y", alpha=0.3)
    time_axes.legend()
    figure.suptitle(title)
    path = out / PLOT_NAME
    figure.savefig(path, format="png", dpi=100)
    return f"plot: {path}"


# -- the demo ------------------------------------------------------------------------------------


def _peer_config(options: TrainOptions, index: int, alone: bool) -> dict[str, Any]:
    return {
        "index": 0 if alone else index,
        "role": "alone" if alone else "peer",
        "streams": options.peers,
        "optimizer": options.optimizer,
        "transport": options.transport,
        "run_id": "swarmavg-demo",
        "target": options.target_batch_size,
        "batch": options.batch_size,
        "epochs": options.epochs,
        "lr": LR,
        "model_seed": MODEL_SEED,
        "data_seed": DATA_SEED + 1 if alone else DATA_SEED,
        "eval_every": max(options.epochs // EVAL_POINTS, 1),
        "eval_batches": EVAL_BATCHES,
        "matchmaking_time": MATCHMAKING_TIME,
        "averaging_timeout": AVERAGING_TIMEOUT,
        "report_interval": REPORT_INTERVAL,
        "startup_timeout": STARTUP_TIMEOUT,
        "command_timeout": STARTUP_TIMEOUT + 3600.0,
    }


def run_training_demo(
    options: TrainOptions, out: TextIO | None = None, err: TextIO | None = None
) -> None:
    """Run the demo (see the module docstring); ``options`` must pass :func:`option_error`.

    :raises ProcessFailed: a process failed (its error is in the message) or was killed by
        another than the demo.
    :raises TimeoutError: the processes did not start in time, or the swarm stalled.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    started = time.monotonic()
    n = options.peers
    print(
        f"swarmavg demo: {n} peers (processes) on 127.0.0.1 over {options.transport} train a "
        f"byte-level transformer on Python's standard library with "
        f"{OPTIMIZERS[options.optimizer].description}: {options.epochs} epochs of "
        f"{options.target_batch_size} samples (batches of {options.batch_size}); one more "
        f"process trains alone with batch {options.target_batch_size}, to compare"
        + (f"; peer {n - 1} will be killed halfway" if options.kill_one else ""),
        file=out,
        flush=True,
    )
    swarm = _Swarm(options)
    with tempfile.TemporaryDirectory(prefix="swarmavg-demo-") as workdir:
        processes = _Processes(Path(workdir))
        try:
            with _view(swarm, out) as view:
                _run_swarm(options, processes, swarm, view)
        except ProcessFailed as exc:
            if exc.log_tail:
                print(f"--- the end of {exc.name}'s stderr ---", file=err)
                print("\n".join(exc.log_tail), file=err)
                print("---", file=err, flush=True)
            raise
        finally:
            with _interrupts_held():
                processes.close()
    elapsed = time.monotonic() - started
    for line in _summary(swarm):
        print(line, file=out)
    if options.plot:
        title = (
            f"swarmavg demo: {n} peers, --optimizer {options.optimizer}, "
            f"target batch size {options.target_batch_size}"
        )
        print(_write_plot(options.out, swarm, title), file=out)
    print(f"done in {_seconds(elapsed)}", file=out, flush=True)


def _failure(processes: _Processes, swarm: _Swarm, index: int, what: str) -> ProcessFailed:
    name = swarm.processes[index].name
    return ProcessFailed(name, index, what, processes.log_tail(index))


def _ended(processes: _Processes, index: int, errors: dict[int, str]) -> str:
    """How process ``index`` ended (it closed its stdout)."""
    process = processes.processes[index]
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(KILL_TIMEOUT)
    if index in errors:
        return f"failed: {errors[index]}"
    code = process.returncode
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"exited (killed by {signal.Signals(-code).name})"
    return f"exited (exit status {code})"


def _run_swarm(
    options: TrainOptions, processes: _Processes, swarm: _Swarm, view: _PlainView | _RichView
) -> None:
    """Start the processes, let them train, follow them and stop them."""
    n = options.peers
    with _interrupts_held():
        for i in range(n + 1):
            processes.spawn(_peer_config(options, i, alone=i == n))
    errors: dict[int, str] = {}
    phase = "starting"
    phase_deadline = time.monotonic() + STARTUP_TIMEOUT
    kill_at = max(options.epochs // 2, 1)
    last_epoch_event = time.monotonic()
    peers_stopped = False

    def name(index: int) -> str:
        return swarm.processes[index].name

    while True:
        try:
            index, event = processes.events.get(timeout=0.25)
        except queue.Empty:
            index, event = -1, {}
        now = time.monotonic()
        if event is None:  # its stdout closed: it is gone
            process = swarm.processes[index]
            if process.state == "killed":
                continue
            if process.state == "done" and peers_stopped and index < n:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    if processes.processes[index].wait(STOP_TIMEOUT) == 0:
                        continue  # told to stop, and it did
            raise _failure(processes, swarm, index, _ended(processes, index, errors))
        if event is not None and index >= 0 and swarm.processes[index].state != "killed":
            kind = event.get("event")
            if kind == "error":
                errors[index] = str(event.get("error"))
                continue
            if kind == "listening" and index == 0:
                for i in range(1, n):
                    processes.send(i, cmd="join", initial_peers=event["maddrs"])
            if kind == "epoch":
                last_epoch_event = now
            before = swarm.processes[index].state
            swarm.on_event(index, event)
            if kind == "done" and before != "done":
                view.note(f"{name(index)} reached epoch {event['epoch']}")
        if phase == "starting":
            if all(p.state == "ready" for p in swarm.processes):
                phase = "training"
                last_epoch_event = now
                for i in range(n + 1):
                    processes.send(i, cmd="go")
                started = now - (phase_deadline - STARTUP_TIMEOUT)
                view.note(f"{n + 1} processes ready in {_seconds(started)}; training")
            elif now > phase_deadline:
                late = [p.name for p in swarm.processes if p.state != "ready"]
                raise TimeoutError(
                    f"{', '.join(late)} did not start within {STARTUP_TIMEOUT:.0f} s"
                )
            view.refresh()
            continue
        if options.kill_one and swarm.killed is None and swarm.epoch >= kill_at:
            victim = n - 1
            with _interrupts_held():
                processes.kill(victim)
            swarm.killed = (victim, swarm.epoch)
            swarm.processes[victim].state = "killed"
            view.note(
                f"killed peer {victim} (SIGKILL) at swarm epoch {swarm.epoch}: "
                f"the {n - 1} others go on without it"
            )
        view.refresh()
        if not peers_stopped and not any(p.live for p in swarm.peers):
            # the swarm is done: its peers stop stepping, and the process alone has the cores
            peers_stopped = True
            for i in range(n):
                processes.send(i, cmd="stop")
            if swarm.alone.live:
                view.note(
                    f"the swarm is done; the process alone goes on to epoch {options.epochs} "
                    f"(it is at {swarm.alone.epoch})"
                )
        live = [p for p in swarm.processes if p.live]
        if not live:
            break
        if now - last_epoch_event > STALL_TIMEOUT:
            raise TimeoutError(
                f"no process finished an epoch within {STALL_TIMEOUT:.0f} s "
                f"({', '.join(p.name for p in live)} still training)"
            )
    view.refresh()
    failed = [(i, code) for i, code in processes.stop() if swarm.processes[i].state != "killed"]
    if failed:
        index, code = failed[0]
        raise _failure(processes, swarm, index, f"ended with exit status {code}")


def describe_optimizers() -> str:
    """``--optimizer``'s choices, one line each, for ``--help``."""
    return "; ".join(f"{name}: {spec.description}" for name, spec in OPTIMIZERS.items())
