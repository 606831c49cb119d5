"""``swarmavg status RUN_ID``: a training run as the DHT shows it, read by a client-mode peer.

Theory of operation
-------------------
Every peer of a run publishes its progress, signed, under the DHT key ``f"{run_id}_progress"``
(one subkey per peer, see :mod:`swarmavg.aio.progress`). A snapshot reads that key (with
``latest=True``: every subkey from the peers nearest the key), keeps the records that parse and
that their owner signed, and folds them with
:func:`swarmavg.proto.progress.aggregate_progress`, as a training peer does: the global epoch,
the samples reported towards its end, and (given the run's ``target_batch_size``, which the
records do not carry) the time until it ends. It reads the matchmaking keys of the run's two
averagers too (``f"{run_id}_grad_averager.0b"`` and ``f"{run_id}_state_averager.0b"``, the
group key of peers with no group bits, which :class:`swarmavg.Optimizer` uses): the peers that
look for an averaging group right now. Finished rounds leave nothing in the DHT, so they are
not shown.

The observer publishes nothing: it is a DHT client (it listens on nothing and no peer routes
through it), and its reads change no peer's view of the run. Records come from other peers
and are checked as the trackers check them; one that fails is left out.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, TextIO

import anyio

from swarmavg._time import get_dht_time
from swarmavg.address import Address
from swarmavg.aio.dht import GetResult
from swarmavg.aio.dht_facade import DHT
from swarmavg.errors import ConnectError, RemoteProtocolError, SwarmError
from swarmavg.identity import PeerID
from swarmavg.proto.dht_storage import ValueWithExpiration
from swarmavg.proto.dht_validation import owner_marker
from swarmavg.proto.matchmaking import group_key
from swarmavg.proto.progress import (
    LocalTrainingProgress,
    ProgressSettings,
    aggregate_progress,
    progress_key,
)

__all__ = ["MatchmakingView", "PeerView", "RunSnapshot", "StatusOptions", "read_snapshot", "run"]

#: The averagers of a :class:`swarmavg.Optimizer` run: their prefixes end with these.
AVERAGERS: Final = ("grad_averager", "state_averager")
#: Exit codes: no peer of the run found (``--once``), no initial peer reachable.
EXIT_NOT_FOUND: Final = 1
EXIT_UNREACHABLE: Final = 2
#: The longest run id whose averagers' group keys are valid (a group key's prefix is at most
#: 128 characters, see :func:`swarmavg.proto.matchmaking.group_key`).
MAX_RUN_ID: Final = 128 - len("_state_averager")
#: A sum of samples/s at most this means "no speed known": no ETA.
_NO_SPEED: Final = 1e-9


@dataclass(frozen=True, slots=True)
class PeerView:
    """One peer's latest progress record, as the observer read it.

    :ivar age_s: seconds since the peer wrote it (by our clock against its: skew shows here).
    """

    peer_id: PeerID
    epoch: int
    samples_accumulated: int
    samples_per_second: float
    client_mode: bool
    age_s: float
    hyperparameters: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "peer_id": str(self.peer_id),
            "epoch": self.epoch,
            "samples_accumulated": self.samples_accumulated,
            "samples_per_second": self.samples_per_second,
            "client_mode": self.client_mode,
            "age_s": round(self.age_s, 3),
            "hyperparameters": self.hyperparameters,
        }


@dataclass(frozen=True, slots=True)
class MatchmakingView:
    """The declarations under one averager's group key: who looks for a group right now.

    :ivar averager: ``"grad_averager"`` or ``"state_averager"``.
    :ivar key: the DHT key read.
    :ivar looking: peers that look for a group (in order of their planned begin).
    :ivar withdrawn: peers whose declaration says they stopped looking (it lapses soon).
    :ivar next_begin_in_s: seconds until the earliest planned begin of a looking peer (may be
        negative: it is late), or ``None``.
    """

    averager: str
    key: str
    looking: tuple[PeerID, ...]
    withdrawn: int
    next_begin_in_s: float | None

    def to_json(self) -> dict[str, Any]:
        begin = self.next_begin_in_s
        return {
            "averager": self.averager,
            "key": self.key,
            "looking": [str(peer) for peer in self.looking],
            "withdrawn": self.withdrawn,
            "next_begin_in_s": None if begin is None else round(begin, 3),
        }


@dataclass(frozen=True, slots=True)
class RunSnapshot:
    """A run as one read of the DHT showed it.

    :ivar time: when it was read (DHT time, seconds).
    :ivar global_epoch: the highest epoch of a non-client peer (of any peer, if all are
        clients); 0 with no peer.
    :ivar samples: the samples the peers at the global epoch reported towards its end.
    :ivar target_batch_size: samples per epoch if the caller said so, else ``None``.
    :ivar eta_s: seconds until the epoch ends, estimated; ``None`` without
        ``target_batch_size`` or while no peer has a speed.
    :ivar peers: one per live record, the global epoch's first, then by PeerID.
    :ivar matchmaking: one per averager, or ``None`` if those reads failed.
    """

    run_id: str
    time: float
    global_epoch: int
    samples: int
    target_batch_size: int | None
    eta_s: float | None
    peers: tuple[PeerView, ...]
    matchmaking: tuple[MatchmakingView, ...] | None

    @property
    def num_clients(self) -> int:
        return sum(peer.client_mode for peer in self.peers)

    def to_json(self) -> dict[str, Any]:
        """The snapshot as a JSON object (what ``--json`` prints, one per line)."""
        return {
            "run_id": self.run_id,
            "time": self.time,
            "global_epoch": self.global_epoch,
            "samples": self.samples,
            "target_batch_size": self.target_batch_size,
            "eta_s": None if self.eta_s is None else round(self.eta_s, 3),
            "num_peers": len(self.peers),
            "num_clients": self.num_clients,
            "peers": [peer.to_json() for peer in self.peers],
            "matchmaking": None
            if self.matchmaking is None
            else [view.to_json() for view in self.matchmaking],
        }


# -- reading -------------------------------------------------------------------------------------


def parse_records(found: GetResult) -> list[LocalTrainingProgress]:
    """The valid progress records in what a read of ``{run_id}_progress`` returned: those that
    parse and sit under their owner's subkey (signed by it: the DHT checked that); tombstones
    and anything else are left out."""
    if found is None or not isinstance(found.value, dict):
        return []
    records = []
    for subkey, item in found.value.items():
        if not isinstance(item, ValueWithExpiration) or item.value is None:
            continue
        try:
            record = LocalTrainingProgress.from_wire(item.value)
            owner = PeerID(record.peer_id)
        except (RemoteProtocolError, ValueError):
            continue
        if subkey == owner_marker(owner):
            records.append(record)
    return records


def parse_declarations(averager: str, key: str, found: GetResult, now: float) -> MatchmakingView:
    """The matchmaking declarations in what a read of ``key`` returned (see
    :mod:`swarmavg.aio.matchmaking`); entries that are not declarations are left out."""
    looking: list[tuple[float, PeerID]] = []
    withdrawn = 0
    entries = None if found is None else found.value
    for subkey, item in (entries if isinstance(entries, dict) else {}).items():
        if not isinstance(item, ValueWithExpiration) or not isinstance(item.value, dict):
            continue
        try:
            peer = PeerID(subkey) if isinstance(subkey, bytes) else None
        except ValueError:
            peer = None
        begin = item.value.get("begin", item.expiration_time)
        if (
            peer is None
            or isinstance(begin, bool)
            or not isinstance(begin, int | float)
            or not math.isfinite(begin)
        ):
            continue
        if item.value.get("looking") is True:
            looking.append((float(begin), peer))
        else:
            withdrawn += 1
    looking.sort(key=lambda entry: (entry[0], entry[1].to_bytes()))
    return MatchmakingView(
        averager,
        key,
        tuple(peer for _, peer in looking),
        withdrawn,
        looking[0][0] - now if looking else None,
    )


def summarize(
    run_id: str,
    records: Sequence[LocalTrainingProgress],
    now: float,
    target_batch_size: int | None,
    matchmaking: tuple[MatchmakingView, ...] | None = None,
) -> RunSnapshot:
    """Fold ``records`` (read at ``now``, DHT time) into a snapshot, by the trackers' rules
    (:func:`swarmavg.proto.progress.aggregate_progress`)."""
    latest: dict[bytes, LocalTrainingProgress] = {}
    for record in records:
        known = latest.get(record.peer_id)
        if known is None or record.time > known.time:
            latest[record.peer_id] = record
    if not latest:
        return RunSnapshot(run_id, now, 0, 0, target_batch_size, None, (), matchmaking)
    servers = [r.epoch for r in latest.values() if not r.client_mode]
    # The observer joins the fold as a peer with no samples (so it is not counted) at epoch 0,
    # or at the clients' highest when every peer is a client (theirs then is the run's epoch).
    observer = LocalTrainingProgress(
        peer_id=b"\x00status-observer",
        epoch=0 if servers else max(r.epoch for r in latest.values()),
        samples_accumulated=0,
        samples_per_second=0.0,
        time=now,
        client_mode=True,
    )
    settings = ProgressSettings(target_batch_size or 1)
    progress = aggregate_progress(latest.values(), observer, settings, now)
    speed = sum(r.samples_per_second for r in latest.values())
    eta = (
        max(0.0, progress.eta_next_epoch - now)
        if target_batch_size is not None and speed > _NO_SPEED
        else None
    )
    peers = sorted(
        (
            PeerView(
                PeerID(r.peer_id),
                r.epoch,
                r.samples_accumulated,
                r.samples_per_second,
                r.client_mode,
                now - r.time,
                r.hyperparameters,
            )
            for r in latest.values()
        ),
        key=lambda p: (-p.epoch, p.peer_id.to_bytes()),
    )
    return RunSnapshot(
        run_id,
        now,
        progress.epoch,
        progress.samples_accumulated,
        target_batch_size,
        eta,
        tuple(peers),
        matchmaking,
    )


async def read_snapshot(
    dht: DHT, run_id: str, target_batch_size: int | None, timeout: float
) -> RunSnapshot:
    """Read the run's progress records and matchmaking keys from ``dht`` (concurrently, each
    read bounded by ``timeout`` seconds) and summarize them.

    :raises SwarmError: the read of the progress records failed (the matchmaking reads may
        fail alone: then ``matchmaking`` is ``None``).
    :raises TimeoutError: that read took longer than ``timeout``.
    """
    found: dict[str, GetResult] = {}
    failed: dict[str, SwarmError | TimeoutError] = {}
    keys = {averager: group_key(f"{run_id}_{averager}", "") for averager in AVERAGERS}
    keys["progress"] = progress_key(run_id)

    async def read(name: str) -> None:
        try:
            with anyio.fail_after(timeout):
                found[name] = await dht.get(keys[name], latest=True)
        except (SwarmError, TimeoutError) as exc:
            failed[name] = exc

    async with anyio.create_task_group() as tg:  # (the reads raise nothing: no group)
        for name in keys:
            tg.start_soon(read, name)
    if "progress" in failed:
        raise failed["progress"]
    now = get_dht_time()
    matchmaking = (
        None
        if failed
        else tuple(
            parse_declarations(averager, keys[averager], found.get(averager), now)
            for averager in AVERAGERS
        )
    )
    return summarize(
        run_id, parse_records(found.get("progress")), now, target_batch_size, matchmaking
    )


# -- showing -------------------------------------------------------------------------------------


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _peers(count: int) -> str:
    return f"{count} peer" if count == 1 else f"{count} peers"


def headline(snapshot: RunSnapshot) -> str:
    """One line: the run, its epoch, samples, ETA and peers."""
    if not snapshot.peers:
        return f"no peer of run {snapshot.run_id!r} found"
    target = snapshot.target_batch_size
    samples = f"{snapshot.samples}/{target}" if target is not None else f"{snapshot.samples}"
    eta = (
        f"ETA {_duration(snapshot.eta_s)}"
        if target is not None
        else "ETA unknown (pass --target-batch-size)"
    )
    return (
        f"run {snapshot.run_id!r}: global epoch {snapshot.global_epoch}, {samples} samples, "
        f"{eta}; {_peers(len(snapshot.peers))} ({snapshot.num_clients} clients)"
    )


COLUMNS: Final = ("peer", "epoch", "samples", "samples/s", "mode", "record age")


def peer_rows(snapshot: RunSnapshot) -> list[tuple[str, ...]]:
    """The peers' table, as strings (one row per peer, :data:`COLUMNS`)."""
    digests = {p.hyperparameters for p in snapshot.peers if p.hyperparameters is not None}
    rows: list[tuple[str, ...]] = []
    for peer in snapshot.peers:
        mode = "client" if peer.client_mode else "full"
        if len(digests) > 1 and peer.hyperparameters is not None:
            mode += f", hparams {peer.hyperparameters[:8]}"
        epoch = str(peer.epoch)
        if peer.epoch < snapshot.global_epoch:
            epoch += " (behind)"
        rows.append(
            (
                peer.peer_id.short(),
                epoch,
                str(peer.samples_accumulated),
                f"{peer.samples_per_second:.1f}",
                mode,
                _duration(max(0.0, peer.age_s)),
            )
        )
    return rows


def matchmaking_lines(snapshot: RunSnapshot) -> list[str]:
    """What the averagers' group keys show, one line each (and what is not shown)."""
    if snapshot.matchmaking is None:
        return ["averaging: the matchmaking keys could not be read"]
    lines = []
    for view in snapshot.matchmaking:
        name = view.averager.replace("_", " ")
        if view.looking:
            begin = max(0.0, view.next_begin_in_s or 0.0)
            lines.append(
                f"{name}: {_peers(len(view.looking))} look for a group, the first round they "
                f"plan begins in {_duration(begin)}"
            )
        else:
            lately = f" ({view.withdrawn} stopped looking lately)" if view.withdrawn else ""
            lines.append(f"{name}: no peer looks for a group right now{lately}")
    lines.append("(finished averaging rounds leave no record in the DHT: not shown)")
    return lines


def plain_text(snapshot: RunSnapshot) -> str:
    """The snapshot as plain text: the headline, the peers' table, the averaging lines."""
    lines = [headline(snapshot)]
    if snapshot.peers:
        rows = [COLUMNS, *peer_rows(snapshot)]
        widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
        for row in rows:
            cells = [
                cell.ljust(width) if i in (0, 4) else cell.rjust(width)
                for i, (cell, width) in enumerate(zip(row, widths, strict=True))
            ]
            lines.append("  " + "  ".join(cells).rstrip())
        lines.extend(matchmaking_lines(snapshot))
    return "\n".join(lines)


def _rich_renderable(snapshot: RunSnapshot) -> Any:
    """The snapshot as a rich table (rich is imported by the caller, who checked it is there)."""
    table_module = importlib.import_module("rich.table")
    table = table_module.Table(title=headline(snapshot), title_justify="left")
    for i, column in enumerate(COLUMNS):
        table.add_column(column, justify="left" if i in (0, 4) else "right")
    for row in peer_rows(snapshot):
        table.add_row(*row)
    if snapshot.peers:
        table.caption = "\n".join(matchmaking_lines(snapshot))
        table.caption_justify = "left"
    return table


def _rich_available() -> bool:
    try:
        importlib.import_module("rich.live")
    except ImportError:
        return False
    return True


# -- the command ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StatusOptions:
    """What ``swarmavg status`` was asked (see :func:`run`)."""

    run_id: str
    initial_peers: tuple[str, ...]
    once: bool = False
    json: bool = False
    interval: float = 2.0
    target_batch_size: int | None = None
    timeout: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not self.run_id:
            raise ValueError(f"run_id must be a non-empty str, not {self.run_id!r:.40}")
        if len(self.run_id) > MAX_RUN_ID:
            raise ValueError(f"run_id must be at most {MAX_RUN_ID} characters long")
        if not self.initial_peers:
            raise ValueError("initial_peers must name at least one address")
        for text in self.initial_peers:
            try:
                address = Address.parse(text)
            except ValueError as exc:
                raise ValueError(f"initial peer: {exc}") from None
            if address.peer_id is None:
                raise ValueError(
                    f"initial peer {text} names no PeerID (/p/<peer-id> or /p2p/<peer-id>): "
                    f"give the address as `swarmavg dht` printed it"
                )
        for name in ("interval", "timeout"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
        if self.target_batch_size is not None and self.target_batch_size < 1:
            raise ValueError(f"target_batch_size must be ≥ 1, not {self.target_batch_size}")


async def _watch(options: StatusOptions, out: TextIO) -> int:
    async with DHT(
        list(options.initial_peers), client_mode=True, request_timeout=options.timeout
    ) as dht:
        if options.once:
            snapshot = await read_snapshot(
                dht, options.run_id, options.target_batch_size, options.timeout
            )
            print(
                json.dumps(snapshot.to_json()) if options.json else plain_text(snapshot), file=out
            )
            if not snapshot.peers:
                if options.json:  # (the text says so already)
                    print(headline(snapshot), file=sys.stderr)
                return EXIT_NOT_FOUND
            return 0
        if not options.json and out.isatty() and _rich_available():
            return await _watch_rich(dht, options, out)
        clear = not options.json and out.isatty()
        while True:
            started = time.monotonic()
            snapshot = await read_snapshot(
                dht, options.run_id, options.target_batch_size, options.timeout
            )
            if options.json:
                text = json.dumps(snapshot.to_json())
            else:
                text = plain_text(snapshot)
                text = ("\x1b[H\x1b[2J" + text) if clear else text + "\n"
            print(text, file=out, flush=True)
            await anyio.sleep(max(0.0, options.interval - (time.monotonic() - started)))


async def _watch_rich(dht: DHT, options: StatusOptions, out: TextIO) -> int:
    live_module = importlib.import_module("rich.live")
    console = importlib.import_module("rich.console").Console(file=out)
    with live_module.Live(console=console, auto_refresh=False) as live:
        while True:
            started = time.monotonic()
            snapshot = await read_snapshot(
                dht, options.run_id, options.target_batch_size, options.timeout
            )
            live.update(_rich_renderable(snapshot), refresh=True)
            await anyio.sleep(max(0.0, options.interval - (time.monotonic() - started)))


def run(options: StatusOptions, out: TextIO | None = None) -> int:
    """Run ``swarmavg status``: join the DHT as a client and print snapshots of the run to
    ``out`` (default ``sys.stdout``): one with ``once`` (exit code 1 if no peer of the run was
    found), else one every ``interval`` seconds until Ctrl+C (exit code 0). Errors are one line
    on ``sys.stderr``: no initial peer answered (exit code 2), a read failed (exit code 1).
    """
    out = sys.stdout if out is None else out
    try:
        return anyio.run(_watch, options, out)
    except KeyboardInterrupt:
        return 0
    except ConnectError as exc:
        print(f"swarmavg status: cannot join the swarm: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (SwarmError, OSError, TimeoutError) as exc:
        text = str(exc) or f"no answer within {options.timeout} s"
        print(f"swarmavg status: {type(exc).__name__}: {text}", file=sys.stderr)
        return 1


def options_from(**fields: Any) -> StatusOptions:
    """:class:`StatusOptions` from the parsed arguments' fields (unknown fields ignored)."""
    names = {field.name for field in dataclasses.fields(StatusOptions)}
    return StatusOptions(**{name: value for name, value in fields.items() if name in names})
