"""Fuzz a swarmavg-quic listener with hostile UDP datagrams (see fuzz/README.md for the invariant).

    python fuzz/fuzz_quic.py --seconds 20                    # CI: hypothesis, no native deps
    python fuzz/fuzz_quic.py --seconds 3600 --seed 7          # a long, reproducible run
    python fuzz/fuzz_quic.py --engine atheris --seconds 600   # coverage-guided (needs atheris)
    python fuzz/fuzz_quic.py --reproduce fuzz/crashes/quic-1234abcd.json

A real QuicTransport listens on 127.0.0.1 with small limits and serves one honest, authenticated
connection from another QuicTransport in the same process, while an attacker sends datagrams to
its port from sockets of its own: random bytes; packets shaped like long-header Initials;
short-header packets naming the honest connection's connection IDs; mutated replays of the
datagrams of an honest handshake and transfer; valid Initials it never follows up; and hostile
but valid QUIC clients (aioquic, with a proper certificate) that abuse streams, flow control and
frames. The listener must drop what is bad, in bounded time and state, and go on serving.

Exit status 0: no input broke the invariant; 1: a counterexample was found (it is printed and
written to ``fuzz/crashes/``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import random
import resource
import socket
import ssl
import sys
import tempfile
import threading
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "fuzz"))

import anyio  # noqa: E402
import anyio.abc  # noqa: E402
import anyio.from_thread  # noqa: E402
import anyio.lowlevel  # noqa: E402
from _engine import arg_parser, crash_dir, libfuzzer_args  # noqa: E402
from aioquic.quic import events  # noqa: E402
from aioquic.quic.configuration import QuicConfiguration  # noqa: E402
from aioquic.quic.connection import QuicConnection as AioQuicConnection  # noqa: E402
from aioquic.quic.packet_builder import QuicPacketBuilderStop  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from swarmavg.errors import ConnectionLost, RemoteProtocolError, StreamReset  # noqa: E402
from swarmavg.identity import Identity, PeerID  # noqa: E402
from swarmavg_quic import (  # noqa: E402
    QuicConnection,
    QuicListener,
    QuicStream,
    QuicTransport,
    _tls,
)
from swarmavg_quic._endpoint import Endpoint  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
#: Seconds any single honest wait may take (loopback answers in milliseconds).
BOUND = 5.0
#: The listener's options: small windows and limits, so that every bound is within reach.
HANDSHAKE_TIMEOUT = 0.5
KEEPALIVE = 0.5  # a peer that vanishes is dropped after 3 x this (QUIC's idle timeout)
STRICT: dict[str, Any] = {
    "stream_window": 256 * KiB,
    "connection_window": 1 * MiB,
    "max_message_size": 1 * MiB,
    "send_buffer": 256 * KiB,
    "handshake_timeout": HANDSHAKE_TIMEOUT,
    "max_pending_handshakes": 8,
    "keepalive_interval": KEEPALIVE,
    "write_timeout": 2.0,
}
#: Message bytes one connection may hold (the bound docs/design/quic.md, "Flow control",
#: documents).
MAX_HELD = STRICT["connection_window"] + STRICT["max_message_size"]
#: Peer streams aioquic lets a peer have open at once (bidirectional), and our own few.
PEER_STREAMS = 128
#: Stream objects one connection may hold: the peer's open ones, as many that it ended before
#: they were accepted (as the TCP transport caps its accept queue), and a few of ours.
MAX_HELD_STREAMS = 2 * PEER_STREAMS + 8
#: Connection IDs one connection may have at the endpoint: its original destination ID, the 8
#: aioquic issues at most, and one being replaced.
MAX_CIDS_PER_CONNECTION = 10
#: How long after the last hostile datagram the listener may take to get back to its baseline:
#: a handshake times out (or a vanished peer idles out), then aioquic's closing period (three
#: PTOs, 0.6 s before any RTT sample), plus scheduling slack.
SETTLE_BOUND = max(HANDSHAKE_TIMEOUT, 3 * KEEPALIVE) + 0.6 + 0.9
#: How long a hostile client waits for its handshake, and for the listener to deliver it.
PEER_HANDSHAKE = 2.0
#: Growth of the process' peak RSS a whole run may cause.
MAX_RSS_GROWTH = 1 << 30
#: What the transport may raise to its users.
USER_ERRORS = (ConnectionLost, StreamReset, anyio.EndOfStream, RemoteProtocolError)
U32 = (1 << 32) - 1
MAX_UDP = 65507


class InvariantBroken(AssertionError):
    """The listener did something other than drop the bad input and go on serving."""


#: Violations of the invariant that are known bugs of swarmavg_quic, not fixed yet (see "Known
#: issues" in fuzz/README.md): name -> (the problem's kind, texts that identify it). They are
#: counted and reported, and are failures only with ``--strict``. Each has a strict xfail test in
#: tests/transports/test_quic_fuzz.py, which fails once the bug is fixed: then delete it here.
KNOWN_ISSUES: dict[str, tuple[str, tuple[str, ...]]] = {
    # none open. The three this fuzzer found (a STOP_SENDING ahead of a stream's first data was
    # lost; streams ended before being accepted were queued without limit; out-of-order data in
    # aioquic's buffers escaped the connection's credit) are fixed, with regression tests in
    # tests/transports/test_quic_fuzz.py. Format: name -> (problem kind, texts it contains).
}


def known_issue(problem: str) -> str | None:
    """The name of the known issue ``problem`` is an instance of, if any."""
    for name, (kind, texts) in KNOWN_ISSUES.items():
        if problem.startswith(f"[{kind}]") and any(t in problem for t in texts):
            return name
    return None


# -- scenarios -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """One datagram, sent as it is."""

    data: bytes


@dataclass(frozen=True)
class ToCid:
    """``prefix + cid + suffix``, where ``cid`` is one of the honest connection's connection IDs
    at the listener (``which`` indexes them, sorted): its packets must fail AEAD and be dropped."""

    prefix: bytes
    which: int
    suffix: bytes


@dataclass(frozen=True)
class Replay:
    """A datagram captured during the honest handshake and transfer, edited, sent ``copies``
    times. ``source``: 0 the honest client's datagrams, 1 the listener's, 2 the first datagram
    (the Initial) of each honest connection; ``index`` is taken modulo their number. ``edits``
    are ``(op, position, argument)``, applied in order (see :func:`apply_edits`)."""

    source: int
    index: int
    edits: tuple[tuple[int, int, int], ...] = ()
    copies: int = 1


@dataclass(frozen=True)
class Initials:
    """Valid client Initials of ``count`` fresh aioquic clients, never followed up; with
    ``fleeting``, each from a socket closed right after it is sent (the listener's answer
    fails with an ICMP error, which ends the handshake at once)."""

    count: int
    fleeting: bool = False


@dataclass(frozen=True)
class Act:
    """One thing a hostile QUIC client does after its handshake (see ``HostilePeer.apply``)."""

    op: str
    stream: int = 0
    code: int = 0
    data: bytes = b""
    end: bool = False


@dataclass(frozen=True)
class Peer:
    """A hostile but valid QUIC client: a proper certificate, a complete handshake, then
    ``actions``; the listener's application treats its connection as ``APPS[app]`` does."""

    actions: tuple[Act, ...]
    app: int = 0
    datagram: int = 1200


@dataclass(frozen=True)
class Pause:
    """Let the listener run alone for a while."""

    ms: int


Step = Raw | ToCid | Replay | Initials | Peer | Pause


@dataclass(frozen=True)
class Scenario:
    """What the attacker does, in order. With ``linger``, its sockets stay open (and silent)
    until the listener is back to its baseline, so the handshakes it started time out;
    otherwise they close at once, and the listener's next datagram to them fails (ICMP)."""

    steps: tuple[Step, ...]
    linger: bool = False

    def to_json(self) -> str:
        return json.dumps(_encode(self))

    @classmethod
    def from_json(cls, text: str) -> Scenario:
        scenario = _decode(json.loads(text))
        if not isinstance(scenario, Scenario):
            raise ValueError("not a scenario")
        return scenario


_TYPES: dict[str, type] = {
    c.__name__: c for c in (Raw, ToCid, Replay, Initials, Act, Peer, Pause, Scenario)
}


def _encode(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if is_dataclass(value) and not isinstance(value, type):
        return {"type": type(value).__name__} | {
            f.name: _encode(getattr(value, f.name)) for f in fields(value)
        }
    if isinstance(value, tuple | list):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    if isinstance(value, dict):
        if "hex" in value:
            return bytes.fromhex(value["hex"])
        cls = _TYPES[value["type"]]
        return cls(**{k: _decode(v) for k, v in value.items() if k != "type"})
    return value


def describe(scenario: Scenario) -> str:
    def one(step: Step) -> str:
        if isinstance(step, Raw):
            shown = step.data[:24].hex() + ("..." if len(step.data) > 24 else "")
            return f"Raw({len(step.data)} B: {shown})"
        if isinstance(step, ToCid):
            return f"ToCid({step.prefix.hex()}, #{step.which}, {len(step.suffix)} B)"
        if isinstance(step, Peer):
            ops = ",".join(a.op for a in step.actions)
            return f"Peer(app={APPS[step.app % len(APPS)]}, {step.datagram} B, [{ops}])"
        return repr(step)

    return f"Scenario(linger={scenario.linger}, [{'; '.join(one(s) for s in scenario.steps)}])"


def varint(value: int) -> bytes:
    """QUIC's variable-length integer (values above 2^62 - 1 are cut to 62 bits)."""
    value &= (1 << 62) - 1
    if value < 1 << 6:
        return bytes([value])
    if value < 1 << 14:
        return (value | 0x4000).to_bytes(2, "big")
    if value < 1 << 30:
        return (value | 0x8000_0000).to_bytes(4, "big")
    return (value | 0xC000_0000_0000_0000).to_bytes(8, "big")


def apply_edits(data: bytes, edits: tuple[tuple[int, int, int], ...], pool: list[bytes]) -> bytes:
    """Edit a captured datagram: 0 flip a bit, 1 set a byte, 2 truncate, 3 duplicate a slice,
    4 delete a slice, 5 insert random bytes, 6 splice with another captured datagram (this one's
    head, the other's tail), 7 append another captured datagram (coalesced packets)."""
    out = bytearray(data)
    for op, pos, arg in edits:
        n = len(out)
        at = pos % (n + 1)
        op %= 8
        if op == 0 and n:
            out[at % n] ^= 1 << (arg % 8)
        elif op == 1 and n:
            out[at % n] = arg & 0xFF
        elif op == 2:
            del out[at:]
        elif op == 3:
            out[at:at] = out[at : at + 1 + arg * 4]
        elif op == 4:
            del out[at : at + 1 + arg]
        elif op == 5:
            out[at:at] = random.Random(pos).randbytes(1 + arg % 64)
        elif op == 6 and pool:
            other = pool[arg % len(pool)]
            out = out[:at] + other[at:]
        elif op == 7 and pool:
            out += pool[arg % len(pool)]
    return bytes(out[:MAX_UDP])


# -- the hypothesis strategies -------------------------------------------------------------------

SIZES = [0, 1, 2, 5, 20, 21, 40, 100, 1199, 1200, 1201, 1252, 1350, 1500, 9000, 16383, MAX_UDP]
VERSIONS = [1, 1, 1, 0x6B3343CF, 0, 0x0A0A0A0A, 0xFF00001D, 2, U32]
CID_LENGTHS = [8, 8, 8, 0, 1, 4, 7, 9, 18, 20, 21, 255]


def _noise(rng_seed: int, size: int) -> bytes:
    return random.Random(rng_seed).randbytes(size)


@st.composite
def blobs(draw: st.DrawFn, sizes: list[int] = SIZES, max_size: int = MAX_UDP) -> bytes:
    """Random bytes of a size around some limit (large ones from a seed: cheap to draw)."""
    size = draw(st.sampled_from(sizes) | st.integers(0, max_size))
    if size <= 64:
        return draw(st.binary(min_size=size, max_size=size))
    return _noise(draw(st.integers(0, U32)), size)


@st.composite
def long_headers(draw: st.DrawFn) -> Raw:
    """A datagram shaped like a long-header packet (mostly an Initial): any version, connection
    ID lengths around the limits, token and length fields right, wrong or huge, random inside."""
    ptype = draw(st.sampled_from([0, 0, 0, 0, 1, 2, 3]))
    first = 0xC0 | ptype << 4 | draw(st.integers(0, 15))
    if draw(st.integers(0, 9)) == 0:
        first &= ~0x40  # the fixed bit cleared
    version = draw(st.sampled_from(VERSIONS) | st.integers(0, U32))
    head = bytes([first]) + version.to_bytes(4, "big")
    for _ in range(2):  # destination, then source connection ID
        size = draw(st.sampled_from(CID_LENGTHS))
        declared = draw(st.sampled_from([size, size, size, size + 1, 255, 0])) & 0xFF
        head += bytes([declared]) + draw(
            st.binary(min_size=min(size, 255), max_size=min(size, 255))
        )
    if ptype == 0:
        token = draw(st.sampled_from([b"", b"", b"", bytes(16), _noise(1, 100)]))
        length = draw(st.sampled_from([len(token), len(token), 1 << 20, (1 << 62) - 1]))
        head += varint(length) + token
    total = draw(st.sampled_from([1200, 1200, 1200, 1250, 1350, 1500, 16383, MAX_UDP, 0, 40, 1199]))
    body_size = max(0, total - len(head) - 4)
    length_field = draw(st.sampled_from(["exact", "exact", "exact", "short", "long", "huge", "0"]))
    length_value = {
        "exact": body_size,
        "short": body_size // 2,
        "long": body_size + 100,
        "huge": (1 << 62) - 1,
        "0": 0,
    }[length_field]
    body = _noise(draw(st.integers(0, U32)), body_size)
    return Raw((head + varint(length_value) + body)[:MAX_UDP])


@st.composite
def to_cids(draw: st.DrawFn) -> ToCid:
    """A short-header packet (or a long-header one) to one of the honest connection's IDs."""
    if draw(st.integers(0, 3)):
        first = draw(st.sampled_from([0x40, 0x41, 0x43, 0x44, 0x47, 0x5F, 0x60, 0x00, 0x7F]))
        prefix = bytes([first])
        suffix = draw(blobs(sizes=[0, 1, 3, 4, 16, 20, 21, 22, 40, 100, 1200, 1500, 16383]))
    else:
        ptype = draw(st.sampled_from([0, 1, 2]))
        version = draw(st.sampled_from([1, 0x6B3343CF, 0]))
        prefix = bytes([0xC0 | ptype << 4]) + version.to_bytes(4, "big") + b"\x08"
        suffix = b"\x08" + _noise(draw(st.integers(0, U32)), 8)
        if ptype == 0:
            suffix += b"\x00"
        size = draw(st.sampled_from([1200, 100, 1500]))
        suffix += varint(size) + _noise(draw(st.integers(0, U32)), size)
    return ToCid(prefix, draw(st.integers(0, 15)), suffix[:MAX_UDP])


edits = st.lists(
    st.tuples(
        st.sampled_from([0, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7]),
        st.integers(0, 64) | st.integers(0, 1 << 16),
        st.integers(0, 255),
    ),
    max_size=4,
)


@st.composite
def replays(draw: st.DrawFn) -> Replay:
    source = draw(st.sampled_from([0, 0, 0, 0, 1, 1, 2]))
    index = draw(st.integers(0, 3) | st.integers(0, 255))
    return Replay(source, index, tuple(draw(edits)), draw(st.sampled_from([1, 1, 1, 2, 3])))


# frames a hostile client slips into its packets (types from RFC 9000 section 19)
FRAME_KINDS = (
    *("stream", "stream", "stream", "reset", "stop", "limit", "ncid", "rcid", "path"),
    *("close", "misc", "random"),
)
STREAM_IDS = [0, 0, 4, 8, 1, 2, 3, 6, 5, 4 * 127, 4 * 128, 4 * 1000, (1 << 62) - 4]
OFFSETS = [0, 1, 1000, 65535, 256 * KiB - 1, 256 * KiB, 1 * MiB, 16 * MiB, (1 << 62) - 2]
VALUES = [0, 1, 2, 100, 128, 129, 1 << 20, 1 << 60, (1 << 62) - 1]


@st.composite
def frames(draw: st.DrawFn) -> Act:
    """A frame with plausible or hostile fields: STREAM at any offset (gaps), RESET_STREAM and
    STOP_SENDING with any final size and code, limits, connection IDs, path frames,
    CONNECTION_CLOSE, HANDSHAKE_DONE from a client, unknown types, or any bytes."""
    kind = draw(st.sampled_from(FRAME_KINDS))
    value = st.sampled_from(VALUES) | st.integers(0, (1 << 62) - 1)
    sid = draw(st.sampled_from(STREAM_IDS))
    if kind == "stream":
        ftype = 0x08 | draw(st.integers(0, 7))  # OFF, LEN, FIN bits
        data = draw(st.binary(max_size=8) | st.sampled_from([bytes(900), b"\0\0\0\x05hello"]))
        body = varint(sid)
        if ftype & 4:
            body += varint(draw(st.sampled_from(OFFSETS)))
        if ftype & 2:
            body += varint(draw(st.sampled_from([len(data), len(data), len(data) + 5, 1 << 20])))
        return Act("frame", code=ftype, data=body + data)
    if kind == "reset":  # RESET_STREAM: id, code, final size
        body = varint(sid) + varint(draw(value)) + varint(draw(st.sampled_from(OFFSETS)))
        return Act("frame", code=0x04, data=body)
    if kind == "stop":
        return Act("frame", code=0x05, data=varint(sid) + varint(draw(value)))
    if kind == "limit":  # MAX_DATA ... STREAMS_BLOCKED
        ftype = draw(st.integers(0x10, 0x17))
        body = (varint(sid) if ftype in (0x11, 0x15) else b"") + varint(draw(value))
        return Act("frame", code=ftype, data=body)
    if kind == "ncid":  # NEW_CONNECTION_ID: seq, retire prior to, length, cid, reset token
        seq, prior = draw(value), draw(value)
        size = draw(st.sampled_from([8, 8, 0, 1, 20, 21]))
        body = varint(seq) + varint(prior) + bytes([size]) + _noise(seq, size) + bytes(16)
        return Act("frame", code=0x18, data=body)
    if kind == "rcid":
        return Act("frame", code=0x19, data=varint(draw(value)))
    if kind == "path":
        return Act(
            "frame",
            code=draw(st.sampled_from([0x1A, 0x1B])),
            data=draw(st.binary(min_size=8, max_size=8)),
        )
    if kind == "close":
        ftype = draw(st.sampled_from([0x1C, 0x1D]))
        body = varint(draw(value)) + (varint(draw(value)) if ftype == 0x1C else b"")
        reason = draw(st.binary(max_size=8))
        return Act("frame", code=ftype, data=body + varint(len(reason)) + reason)
    if kind == "misc":  # CRYPTO, NEW_TOKEN, HANDSHAKE_DONE, ACK, DATAGRAM, unknown
        ftype = draw(st.sampled_from([0x06, 0x07, 0x1E, 0x02, 0x03, 0x30, 0x31, 0x21, 0x3F, 0x40]))
        return Act("frame", code=ftype, data=draw(st.binary(max_size=32)))
    return Act("frame", code=draw(st.integers(0, 0x40)), data=draw(st.binary(max_size=64)))


#: Message sizes around the listener's limits (the 4-byte length prefix is not counted).
MSG_SIZES = [0, 1, 5, 100, 4096, 65536, 128 * KiB - 4, 256 * KiB - 4, 256 * KiB, 1 * MiB]
HUGE = [1 * MiB + 1, 1 << 31, U32]


@st.composite
def framed(draw: st.DrawFn) -> bytes:
    """What a hostile client writes on a stream: messages framed as swarmavg frames them (valid,
    truncated, announcing huge sizes), or garbage."""
    out = bytearray()
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["valid", "valid", "valid", "huge", "truncated", "garbage"]))
        if kind == "garbage":
            out += draw(st.binary(min_size=1, max_size=7))
            continue
        size = draw(st.sampled_from(HUGE if kind == "huge" else MSG_SIZES) | st.integers(0, 300))
        out += size.to_bytes(4, "big")
        if kind == "valid":
            if size > 64:
                out += bytes([size & 0xFF]) * size
            else:
                out += draw(st.binary(min_size=size, max_size=size))
        elif kind == "truncated":
            out += bytes(draw(st.integers(0, min(size, 5000))))
        else:
            out += draw(st.binary(max_size=16))
    return bytes(out)


ACT_WEIGHTS = (
    *("send", "send", "send", "send", "uni", "reset", "stop", "churn", "frame", "frame"),
    *("frame", "credit", "pump", "close", "gaps"),
)


@st.composite
def acts(draw: st.DrawFn) -> Act:
    op = draw(st.sampled_from(ACT_WEIGHTS))
    slot = draw(st.integers(0, 7))
    code = st.sampled_from([0, 1, 2, 3, 0x100]) | st.integers(0, (1 << 62) - 1)
    if op in ("send", "uni"):
        return Act(op, slot, data=draw(framed()), end=draw(st.booleans()))
    if op in ("reset", "stop"):
        return Act(op, slot, code=draw(code))
    if op == "churn":
        return Act(op, draw(st.sampled_from([1, 10, 100, 130, 300])), code=draw(st.integers(0, 5)))
    if op == "frame":
        return draw(frames())
    if op == "credit":
        return Act(op, code=draw(st.integers(0, 2)))
    if op == "gaps":
        count = draw(st.sampled_from([1, 4, 9, 32]))
        offset = draw(st.sampled_from([1, 1000, 65536, 256 * KiB - 1, 256 * KiB]))
        return Act(op, count, code=offset, end=draw(st.booleans()))
    if op == "pump":
        return Act(op, code=draw(st.sampled_from([0, 1, 10, 50, 200])))
    if op == "close":
        return Act(op, code=draw(code))
    return Act(op)


@st.composite
def peers(draw: st.DrawFn) -> Peer:
    actions = tuple(draw(st.lists(acts(), min_size=0, max_size=10)))
    if draw(st.integers(0, 11)) == 0:  # stop answering: the listener must idle it out
        actions += (Act("vanish"),)
    return Peer(actions, draw(st.integers(0, len(APPS) - 1)), draw(st.sampled_from([1200, 16383])))


#: Initials, replayed Initials of a closed honest connection and peers that vanish cost a
#: handshake timeout or an idle timeout of waiting afterwards (about 1.6 s): they are rarer.
steps = st.one_of(
    st.builds(Raw, blobs()),
    st.builds(Raw, blobs()),
    long_headers(),
    long_headers(),
    long_headers(),
    to_cids(),
    to_cids(),
    replays(),
    replays(),
    replays(),
    st.builds(Initials, st.sampled_from([1, 2, 8, 9, 12]), st.booleans()),
    peers(),
    peers(),
    peers(),
    st.builds(Pause, st.sampled_from([0, 5, 50, 200])),
)


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    """One to six attacks in a row; lingering sockets now and then (they cost a handshake
    timeout of waiting)."""
    chosen = tuple(draw(st.lists(steps, min_size=1, max_size=6)))
    return Scenario(chosen, linger=draw(st.integers(0, 5)) == 0)


# -- atheris inputs ------------------------------------------------------------------------------

#: Operations of a hostile client, as an atheris input numbers them.
OPS = [
    "send",
    "uni",
    "reset",
    "stop",
    "churn",
    "frame",
    "credit",
    "pump",
    "close",
    "vanish",
    "gaps",
]


def _chunks(data: bytes, limit: int) -> list[tuple[int, bytes]]:
    """Tag byte, 2-byte length, body; as many as fit."""
    out: list[tuple[int, bytes]] = []
    pos = 0
    while pos + 3 <= len(data) and len(out) < limit:
        tag = data[pos]
        size = int.from_bytes(data[pos + 1 : pos + 3], "big")
        out.append((tag, data[pos + 3 : pos + 3 + size]))
        pos += 3 + size
    return out


def _chunk(tag: int, body: bytes) -> bytes:
    body = body[:0xFFFF]
    return bytes([tag]) + len(body).to_bytes(2, "big") + body


def scenario_from_bytes(data: bytes) -> Scenario:
    """An atheris input as a scenario: byte 0 bit 0 = linger; then steps, each a tag byte (its
    value mod 6 is the kind: raw, to-cid, replay, initials, peer, pause), a 2-byte length and a
    body; a peer's body is actions in the same form (tag mod 11: the index in OPS; bit 7: end)."""
    if not data:
        return Scenario(())
    out: list[Step] = []
    for tag, body in _chunks(data[1:], 8):
        kind, arg = tag % 6, tag // 6
        if kind == 0:
            out.append(Raw(body[:MAX_UDP]))
        elif kind == 1:
            out.append(ToCid(body[:1] or b"\x40", arg, body[1:]))
        elif kind == 2:
            triples = tuple(
                (body[i], int.from_bytes(body[i + 1 : i + 3], "big"), body[i + 3])
                for i in range(2, len(body) - 3, 4)
            )[:8]
            out.append(Replay(arg % 3, body[0] if body else 0, triples, 1 + arg % 3))
        elif kind == 3:
            out.append(Initials(1 + (body[0] if body else 0) % 12, bool(arg & 1)))
        elif kind == 4:
            actions = []
            for atag, abody in _chunks(body, 16):
                op = OPS[atag % len(OPS)]
                number = int.from_bytes(abody[:2], "big")
                actions.append(Act(op, number % 1000, number, abody[2:], bool(atag & 0x80)))
            out.append(Peer(tuple(actions), arg % len(APPS), 16383 if arg & 16 else 1200))
        else:
            out.append(Pause((body[0] if body else 0) % 200))
    return Scenario(tuple(out), bool(data[0] & 1))


def scenario_to_bytes(scenario: Scenario) -> bytes:
    """A scenario in the atheris input form (approximately: to seed libFuzzer's corpus)."""
    out = bytearray([int(scenario.linger)])
    for step in scenario.steps:
        if isinstance(step, Raw):
            out += _chunk(0, step.data)
        elif isinstance(step, ToCid):
            out += _chunk(1 + 6 * (step.which % 42), step.prefix[:1] + step.suffix)
        elif isinstance(step, Replay):
            body = bytes([step.index & 0xFF, 0]) + b"".join(
                bytes([op]) + (pos & 0xFFFF).to_bytes(2, "big") + bytes([arg & 0xFF])
                for op, pos, arg in step.edits
            )
            out += _chunk(2 + 6 * step.source, body)
        elif isinstance(step, Initials):
            out += _chunk(3 + 6 * step.fleeting, bytes([step.count - 1]))
        elif isinstance(step, Peer):
            body = b"".join(
                _chunk(
                    OPS.index(a.op) | (0x80 if a.end else 0),
                    (
                        a.code if a.op in ("frame", "pump", "close", "credit", "gaps") else a.stream
                    ).to_bytes(8, "big")[-2:]
                    + a.data,
                )
                for a in step.actions
            )
            out += _chunk(4 + 6 * (step.app + (16 if step.datagram > 1200 else 0)), body)
        else:
            out += _chunk(5, bytes([step.ms % 200]))
    return bytes(out)


def load_scenario(path: Path) -> Scenario:
    """A saved scenario: JSON (hypothesis engine) or a raw atheris input."""
    data = path.read_bytes()
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return Scenario.from_json(data.decode())
    return scenario_from_bytes(data)


# -- the attacker --------------------------------------------------------------------------------


def udp_socket() -> socket.socket:
    """A non-blocking UDP socket on 127.0.0.1 (the attacker only ever uses loopback)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def send_datagram(sock: socket.socket, data: bytes, addr: tuple[str, int]) -> None:
    """Send one datagram, then let the listener read it (a few loop turns: its socket buffer
    never overflows, so every datagram reaches it)."""
    with contextlib.suppress(OSError):
        sock.sendto(data, addr)
    for _ in range(3 if len(data) > 16 * KiB else 2):
        await anyio.lowlevel.checkpoint()


class _Client(_tls.AuthenticatingConnection):
    """The hostile client's aioquic connection; it slips raw frames into its 1-RTT packets."""

    def __init__(self, *, configuration: QuicConfiguration) -> None:
        super().__init__(configuration=configuration)
        self.raw_frames: deque[tuple[int, bytes]] = deque()

    def _write_connection_limits(self, builder: Any, space: Any) -> None:
        super()._write_connection_limits(builder, space)
        while self.raw_frames:
            ftype, body = self.raw_frames[0]
            try:
                buf = builder.start_frame(ftype, capacity=len(body) + 8)
            except QuicPacketBuilderStop:
                if len(body) > 1000:  # it never fits
                    self.raw_frames.popleft()
                break
            buf.push_bytes(body)
            self.raw_frames.popleft()


class HostilePeer:
    """A QUIC client with a valid identity and certificate, pumped by hand over its own UDP
    socket, that does whatever its actions say once the handshake is complete."""

    def __init__(self, server: tuple[str, int], datagram: int) -> None:
        self.identity = Identity.generate()
        config = _tls.configuration(self.identity, is_client=True, max_datagram_size=datagram)
        self.quic = _Client(configuration=config)
        self.sock = udp_socket()
        self.server = server
        self.handshake_done = False
        self.terminated = False
        self.sent = 0
        self.client_errors: list[str] = []
        self._next_bidi = 4 * 8  # above the slots' streams (0, 4, ..., 28)
        self._next_uni = 2 + 4 * 8

    def _transmit(self) -> None:
        now = anyio.current_time()
        for data, addr in self.quic.datagrams_to_send(now):
            with contextlib.suppress(OSError):
                self.sock.sendto(data, addr)
                self.sent += 1

    def _receive(self) -> None:
        for _ in range(256):
            try:
                data, addr = self.sock.recvfrom(MAX_UDP + 28)
            except BlockingIOError:
                break
            except OSError:
                continue
            try:
                self.quic.receive_datagram(data, addr, anyio.current_time())
            except Exception as exc:  # what the listener sends must be valid QUIC
                self.client_errors.append(f"aioquic (client) failed on a datagram: {exc!r}")
                self.terminated = True
                return
        while (event := self.quic.next_event()) is not None:
            if isinstance(event, events.HandshakeCompleted):
                self.handshake_done = True
            elif isinstance(event, events.ConnectionTerminated):
                self.terminated = True

    async def pump(self, seconds: float, until: Callable[[], bool] | None = None) -> bool:
        """Send, receive and run timers for ``seconds`` or until ``until()``; ``False`` if the
        connection terminated first (or ``until`` never came true)."""
        deadline = anyio.current_time() + seconds
        while True:
            self._receive()
            timer = self.quic.get_timer()
            if timer is not None and anyio.current_time() >= timer:
                self.quic.handle_timer(anyio.current_time())
                self._receive()
            self._transmit()
            if until is not None and until():
                return True
            if self.terminated:
                return False
            now = anyio.current_time()
            if now >= deadline:
                return until is None
            timer = self.quic.get_timer()
            wake = deadline if timer is None else min(deadline, timer)
            if wake > now:
                with anyio.move_on_after(wake - now):
                    await anyio.wait_readable(self.sock)
            else:
                await anyio.lowlevel.checkpoint()

    async def settle(self, seconds: float = 1.0) -> None:
        """Pump until nothing more is sent (what the actions queued is out), within ``seconds``."""
        deadline = anyio.current_time() + seconds
        while not self.terminated and anyio.current_time() < deadline:
            before = self.sent
            await self.pump(0.02)
            if self.sent == before:
                return

    async def handshake(self, seconds: float) -> bool:
        self.quic.connect(self.server, anyio.current_time())
        return await self.pump(seconds, until=lambda: self.handshake_done)

    async def gaps(self, count: int, offset: int, uni: bool) -> None:
        """One byte at ``offset`` in each of ``count`` new streams (bytes before it never come):
        each as soon as the listener's connection credit allows it."""
        quic = self.quic
        size = offset + 1
        for _ in range(count):
            if not await self.pump(
                0.2, until=lambda: quic._remote_max_data - quic._remote_max_data_used >= size
            ):
                return
            if uni:
                sid, self._next_uni = self._next_uni, self._next_uni + 4
            else:
                sid, self._next_bidi = self._next_bidi, self._next_bidi + 4
            quic.raw_frames.append((0x0E, varint(sid) + varint(offset) + varint(1) + b"x"))
            quic._remote_max_data_used += size  # (raw frames bypass aioquic's accounting)
            quic.send_ping(0)

    async def stream_credit(self, count: int) -> bool:
        """Pump (a while at most) until the listener lets us open ``count`` more streams."""
        quic = self.quic
        return await self.pump(
            1.0, until=lambda: quic._remote_max_streams_bidi * 4 >= self._next_bidi + 4 * count
        )

    def apply(self, act: Act) -> None:
        """Queue what ``act`` does; aioquic refusing a call client-side is not interesting."""
        quic = self.quic
        with contextlib.suppress(ValueError, RuntimeError, AssertionError, KeyError, OverflowError):
            self._apply(quic, act)

    def _apply(self, quic: _Client, act: Act) -> None:
        op = act.op
        bidi, uni = 4 * (act.stream % 8), 2 + 4 * (act.stream % 8)
        if op == "send":
            quic.send_stream_data(bidi, act.data, end_stream=act.end)
        elif op == "uni":
            quic.send_stream_data(uni, act.data, end_stream=act.end)
        elif op == "reset":
            quic.reset_stream(bidi, act.code & ((1 << 62) - 1))
        elif op == "stop":
            quic.stop_stream(bidi, act.code & ((1 << 62) - 1))
        elif op == "churn":  # many short-lived streams, ended in one of six ways
            how = act.code % 6
            opened = []
            for _ in range(max(1, act.stream % 1000)):
                sid = self._next_bidi
                self._next_bidi += 4
                opened.append(sid)
                if how in (0, 3, 4):  # a message and FIN
                    quic.send_stream_data(sid, b"\0\0\0\x03abc", end_stream=True)
                else:  # the start of a message
                    quic.send_stream_data(sid, b"\0\0\0\x09abc")
            if how in (4, 5):
                self._transmit()  # the data first: STOP_SENDING/RESET_STREAM come after it
            for sid in opened:
                if how in (0, 1, 4, 5):
                    quic.stop_stream(sid, 1)
                if how in (1, 2, 5):
                    quic.reset_stream(sid, 1)
        elif op == "frame":
            if len(act.data) <= 1000:
                quic.raw_frames.append((act.code & 0x3FFF_FFFF, act.data))
            quic.send_ping(0)  # a packet to carry it
        elif op == "credit":  # pretend the listener gave more credit: send beyond its limits
            huge = 1 << 60
            if act.code % 3 == 0:
                quic._remote_max_stream_data_bidi_remote = huge
                quic._remote_max_stream_data_uni = huge
                for stream in quic._streams.values():
                    stream.max_stream_data_remote = huge
            elif act.code % 3 == 1:
                quic._remote_max_data = huge
            else:
                quic._remote_max_streams_bidi = huge
                quic._remote_max_streams_uni = huge
            quic.send_stream_data(bidi, bytes(300 * KiB))
        elif op == "close":
            quic.close(error_code=act.code & ((1 << 62) - 1), reason_phrase="hostile")


async def send_initials(
    sock: socket.socket, server: tuple[str, int], count: int, fleeting: bool
) -> None:
    """The first datagram of ``count`` fresh clients: valid Initials, never followed up."""
    for _ in range(count):
        config = QuicConfiguration(
            is_client=True, alpn_protocols=[_tls.ALPN], verify_mode=ssl.CERT_NONE
        )
        quic = AioQuicConnection(configuration=config)
        quic.connect(server, anyio.current_time())
        for data, _ in quic.datagrams_to_send(anyio.current_time())[:1]:
            if fleeting:
                with udp_socket() as once, contextlib.suppress(OSError):
                    once.sendto(data, server)
                for _ in range(2):  # let the listener read it
                    await anyio.lowlevel.checkpoint()
            else:
                await send_datagram(sock, data, server)


# -- the listener under attack -------------------------------------------------------------------


async def _echo(conn: QuicConnection, stream: QuicStream) -> None:
    while True:
        try:
            message = await stream.receive()
        except anyio.EndOfStream:
            await stream.send_eof()
            return
        await stream.send(b"ok %d" % len(message))


async def _read_one_then_close(conn: QuicConnection, stream: QuicStream) -> None:
    await stream.receive()
    await stream.aclose()


async def _abort(conn: QuicConnection, stream: QuicStream) -> None:
    await stream.abort()


async def _read_late(conn: QuicConnection, stream: QuicStream) -> None:
    await conn.wait_closed()
    while True:
        await stream.receive()


async def _drain(conn: QuicConnection, stream: QuicStream) -> None:
    while True:
        await stream.receive()


STREAM_POLICIES = [_echo, _read_one_then_close, _abort, _read_late, _drain]
#: What the listener's application does with a hostile client's connection: accept its streams
#: and treat them in turn as STREAM_POLICIES do; echo all; accept only after a while; never
#: accept a stream; abort every stream; close the connection at its first stream.
APPS = ["eager", "echo", "lazy", "never", "abort", "hangup"]


class _ErrorLog(logging.Handler):
    """Collects swarmavg_quic's records with a traceback (``logger.exception``, or a debug
    record of an exception it swallowed) and those of level ERROR and above."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.errors: list[str] = []
        self.swallowed: dict[str, int] = {}

    def emit(self, rec: logging.LogRecord) -> None:
        if rec.levelno >= logging.ERROR:
            detail = ""
            if rec.exc_info and rec.exc_info[1] is not None:
                detail = f": {rec.exc_info[1]!r}"
            self.errors.append(f"{rec.getMessage()}{detail}")
        elif rec.exc_info:
            self.swallowed[rec.msg] = self.swallowed.get(rec.msg, 0) + 1


class Harness:
    """A QuicTransport listening on 127.0.0.1 with STRICT limits, an honest QuicTransport
    connected to it, and datagrams of theirs captured during an honest handshake and transfer.

    :meth:`run` plays one scenario against the listener and returns what went wrong.
    """

    def __init__(self) -> None:
        self.problems: list[str] = []
        self._flagged: set[tuple[str, str]] = set()
        self.loop_errors: list[str] = []
        self.log = _ErrorLog()
        self.captured: list[list[bytes]] = [[], [], []]  # client's, listener's, Initials
        self.capturing = False
        self.peer_apps: dict[PeerID, int] = {}
        self.honest_conns: dict[PeerID, QuicConnection] = {}
        self.delivered: set[PeerID] = set()
        self.hostile_apps = 0
        self.stats: dict[str, int] = {}
        self.scenarios = 0
        self.honest_trips = 0

    # -- setting up ------------------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Harness]:
        loop = _asyncio_loop()
        previous = loop.get_exception_handler()
        loop.set_exception_handler(self._on_loop_error)
        logger = logging.getLogger("swarmavg_quic")
        level = logger.level
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self.log)
        quiet = logging.NullHandler()  # aioquic's own log (the peers' errors): not to stderr
        logging.getLogger("quic").addHandler(quiet)
        stack = contextlib.AsyncExitStack()
        try:
            self.server = await stack.enter_async_context(
                QuicTransport(Identity.generate(), **STRICT)
            )
            self.listener: QuicListener = await self.server.listen(
                "quic://127.0.0.1:0"  # type: ignore[arg-type]
            )
            self.endpoint: Endpoint = self.listener._endpoint
            self.address = ("127.0.0.1", self.endpoint.port)
            self._watch(self.endpoint, 1)
            self.client_identity = Identity.generate()
            self.client = await stack.enter_async_context(
                QuicTransport(self.client_identity, handshake_timeout=BOUND)
            )
            client_listener = await self.client.listen("quic://127.0.0.1:0")  # type: ignore[arg-type]
            client_endpoint = client_listener._endpoint  # (it dials from this socket too)
            self.client_address = ("127.0.0.1", client_endpoint.port)
            self._capture(client_endpoint, 0)
            self.tg = await stack.enter_async_context(anyio.create_task_group())
            self.tg.start_soon(self._serve)
            with anyio.fail_after(4 * BOUND):
                await self._capture_honest_traffic()
            yield self
        finally:
            if getattr(self, "tg", None) is not None:
                self.tg.cancel_scope.cancel()
            try:  # (the caller bounds this in time: scopes must nest with the task groups')
                await stack.aclose()
            except Exception as exc:  # the transports' task groups must end cleanly
                self.loop_errors.append(f"closing the transports raised {exc!r}")
            logger.removeHandler(self.log)
            logger.setLevel(level)
            logging.getLogger("quic").removeHandler(quiet)
            loop.set_exception_handler(previous)

    async def _capture_honest_traffic(self) -> None:
        """Connect honestly, exchange a few messages (one of 20 KiB), make and close a second
        connection: the datagrams of all this are what Replay steps replay."""
        self.capturing = True
        self.dialed = await self.client.connect(self.listener.address)
        self.accepted = await self._accepted(self.client_identity.peer_id)
        for payload in (b"hello", bytes(20 * KiB), b"bye"):
            await self._round_trip(self.dialed, payload)
        second = await self.client.connect(self.listener.address)
        await self._round_trip(second, b"second")
        await second.aclose()
        self.capturing = False
        if not await self._settle(draining_ok=False):  # the second connection is gone
            raise RuntimeError(f"the listener did not settle after its setup: {self._state()}")
        self.honest_cids = {cid for cid, c in self.endpoint._by_cid.items() if c is self.accepted}

    async def _accepted(self, peer: PeerID) -> QuicConnection:
        for _ in range(int(BOUND / 0.005)):
            conn = self.honest_conns.get(peer)
            if conn is not None:
                return conn
            await anyio.sleep(0.005)
        raise RuntimeError("the honest connection was not accepted")

    def _capture(self, endpoint: Endpoint, source: int) -> None:
        send = endpoint.send_datagrams

        def capturing(datagrams: Any) -> None:
            datagrams = list(datagrams)
            if self.capturing:
                for data, _ in datagrams:
                    self.captured[source].append(bytes(data))
                    initial = source == 0 and data[0] & 0xF0 == 0xC0  # (long header, type 0)
                    if initial and data not in self.captured[2]:
                        self.captured[2].append(bytes(data))
            send(datagrams)

        endpoint.send_datagrams = capturing  # type: ignore[method-assign]

    def _watch(self, endpoint: Endpoint, source: int) -> None:
        """Check the bounds right after each batch of datagrams the listener reads (nothing has
        had the chance to free memory yet), and note what escapes the batch."""
        self._capture(endpoint, source)
        read_batch = endpoint._read_batch

        def checked() -> None:
            try:
                read_batch()
            except BaseException as exc:
                self._flag("escaped", f"the endpoint's read batch raised {exc!r}")
                raise
            self._check_bounds()

        endpoint._read_batch = checked  # type: ignore[method-assign]

    def _on_loop_error(self, loop: Any, context: dict[str, Any]) -> None:
        self.loop_errors.append(f"{context.get('message')}: {context.get('exception')!r}")

    def errors(self) -> list[str]:
        out = [*self.loop_errors, *(f"logged: {m}" for m in self.log.errors)]
        self.loop_errors.clear()
        self.log.errors.clear()
        return out

    def _flag(self, kind: str, message: str, key: str = "") -> None:
        """Note a violation (once per kind and ``key`` per scenario)."""
        if (kind, key) not in self._flagged:
            self._flagged.add((kind, key))
            self.problems.append(f"[{kind}] {message}")

    def _check_bounds(self) -> None:
        server, endpoint = self.server, self.endpoint
        if server._pending_handshakes > STRICT["max_pending_handshakes"]:
            self._flag("pending", f"{server._pending_handshakes} handshakes pending")
        for conn in list(endpoint._connections):
            held = conn._unread + conn._partial
            self.stats["peak_held"] = max(self.stats.get("peak_held", 0), held)
            if held > MAX_HELD:
                self._flag("memory", f"{conn!r} holds {held} bytes of messages (> {MAX_HELD})")
            quic = conn._quic
            buffered = sum(len(s.receiver._buffer) for s in list(quic._streams.values()))
            self.stats["peak_buffered"] = max(self.stats.get("peak_buffered", 0), buffered)
            if held + buffered > MAX_HELD:
                self._flag(
                    "aioquic-memory",
                    f"{conn!r} holds {held} bytes of messages and aioquic {buffered} bytes of "
                    f"out-of-order stream data in {len(quic._streams)} streams: "
                    f"{held + buffered} > connection_window + max_message_size = {MAX_HELD}",
                )
            extra = sum(1 for s in conn._accept_queue if conn._streams.get(s.id) is not s)
            streams = len(conn._streams) + extra
            self.stats["peak_streams"] = max(self.stats.get("peak_streams", 0), streams)
            if streams > MAX_HELD_STREAMS:
                self._flag(
                    "streams",
                    f"{conn!r} holds {streams} stream objects ({len(conn._accept_queue)} waiting "
                    f"to be accepted, {extra} of them already ended) > {MAX_HELD_STREAMS}",
                )
        draining = sum(1 for c in endpoint._connections if self._draining_honest(c))
        if draining > 10:  # each is gone ~0.1 s after it closed
            self._flag("draining", f"{draining} closed honest connections still at the endpoint")
        cids = len(endpoint._by_cid)
        if cids > MAX_CIDS_PER_CONNECTION * max(1, endpoint.connection_count):
            self._flag("cids", f"{cids} connection IDs for {endpoint.connection_count} connections")

    # -- the listener's application --------------------------------------------------------------

    async def _serve(self) -> None:
        while True:
            try:
                conn = await self.listener.accept()
            except anyio.ClosedResourceError:
                return
            peer = conn.peer_id
            if peer == self.client_identity.peer_id:
                self.honest_conns.setdefault(peer, conn)  # the first; later ones are the checks'
                self.tg.start_soon(self._application, conn, "echo", False)
            else:
                self.delivered.add(peer)
                app = APPS[self.peer_apps.get(peer, 0) % len(APPS)]
                self.hostile_apps += 1
                self.tg.start_soon(self._application, conn, app, True)

    async def _application(self, conn: QuicConnection, app: str, hostile: bool) -> None:
        try:
            async with anyio.create_task_group() as tg:
                await self._guarded(self._accept_streams, conn, app, tg)
        finally:
            if hostile:
                self.hostile_apps -= 1

    async def _guarded(self, func: Callable[..., Awaitable[None]], *args: Any) -> None:
        try:
            await func(*args)
        except USER_ERRORS:
            pass
        except Exception as exc:
            self._flag("typed", f"{func.__name__} got {exc!r} from the transport", repr(exc))

    async def _accept_streams(self, conn: QuicConnection, app: str, tg: Any) -> None:
        if app == "never":
            await conn.wait_closed()
            return
        if app == "lazy":
            with anyio.move_on_after(0.2):
                await conn.wait_closed()
        for index in range(1 << 30):
            stream = await conn.accept_stream()
            if app == "hangup":
                await conn.aclose()
                return
            policy = {"echo": _echo, "abort": _abort}.get(
                app, STREAM_POLICIES[index % len(STREAM_POLICIES)]
            )
            tg.start_soon(self._guarded, policy, conn, stream)

    # -- the honest side -------------------------------------------------------------------------

    async def _round_trip(self, conn: QuicConnection, payload: bytes) -> None:
        stream = await conn.open_stream()
        await stream.send(payload)
        reply = bytes(await stream.receive())
        if reply != b"ok %d" % len(payload):
            raise InvariantBroken(f"an honest message got the wrong answer {reply[:40]!r}")
        await stream.aclose()

    async def _chatter(self, stop: anyio.Event) -> None:
        """Round trips on the honest connection while the attack goes on."""
        while not stop.is_set():
            try:
                with anyio.fail_after(BOUND):
                    await self._round_trip(self.dialed, b"chatter")
            except Exception as exc:
                self._flag("honest", f"the honest connection failed during the attack: {exc!r}")
                return
            self.honest_trips += 1
            with anyio.move_on_after(0.01):
                await stop.wait()

    async def _honest(self) -> None:
        """After the attack: a round trip on a new stream of the honest connection, and a new
        honest connection that does one too."""
        path = self.accepted._quic._network_paths[0].addr
        if tuple(path[:2]) != self.client_address:
            self._flag("path", f"the honest connection now sends to {path} (migrated)")
        try:
            with anyio.fail_after(BOUND):
                await self._round_trip(self.dialed, b"after")
        except Exception as exc:
            self._flag("honest", f"the honest connection is no longer served: {exc!r}")
        # The listener refuses a handshake that takes more than HANDSHAKE_TIMEOUT (0.5 s here,
        # to bound hostile ones); an honest one takes ~10 ms, but a stall of the whole process
        # (a full test-suite run once had one) can outlast that. A client then dials again, as
        # any would: the second attempt must be served, and the first is counted.
        for attempt in (1, 2):
            try:
                with anyio.fail_after(BOUND):
                    conn = await self.client.connect(self.listener.address)
                    try:
                        await self._round_trip(conn, b"new")
                    finally:
                        await conn.aclose()
            except ConnectionLost as exc:
                if attempt == 1:
                    self._count("honest_redials")
                    continue
                self._flag("honest", f"a new honest connection is not served: {exc!r}")
            except Exception as exc:
                self._flag("honest", f"a new honest connection is not served: {exc!r}")
            break

    def _draining_honest(self, conn: QuicConnection) -> bool:
        """Whether ``conn`` is a closed connection of the honest client (a check's new one, for
        the three PTOs of its closing period)."""
        return conn.is_closed and conn._peer_id == self.client_identity.peer_id

    def _at_baseline(self, draining_ok: bool = True) -> bool:
        """Only the honest connection (and, with ``draining_ok``, closed connections of the
        honest client: gone within milliseconds, not worth waiting for after each scenario)."""
        endpoint = self.endpoint
        others = [
            c
            for c in endpoint._connections
            if c is not self.accepted and not (draining_ok and self._draining_honest(c))
        ]
        return (
            not others
            and self.server._pending_handshakes == 0
            and len(self.server._connections) == 1
            and self.server._incoming_limits.total == 1
            and self.hostile_apps == 0
            and all(c in endpoint._connections for c in endpoint._by_cid.values())
        )

    def _state(self) -> str:
        return (
            f"{self.endpoint.connection_count} connections at the endpoint, "
            f"{len(self.server._connections)} in the transport "
            f"({self.server._incoming_limits.total} counted incoming), "
            f"{self.server._pending_handshakes} handshakes pending, "
            f"{len(self.endpoint._by_cid)} connection IDs, "
            f"{self.hostile_apps} hostile connections' applications running"
        )

    async def _settle(self, draining_ok: bool = True) -> bool:
        """Wait (polling) until the listener is back to its baseline: only the honest
        connection, no handshake pending; ``False`` after SETTLE_BOUND."""
        deadline = anyio.current_time() + SETTLE_BOUND
        while not self._at_baseline(draining_ok):
            if anyio.current_time() >= deadline:
                return False
            await anyio.sleep(0.005)
        return True

    # -- one scenario ----------------------------------------------------------------------------

    async def run(self, scenario: Scenario) -> list[str]:
        """Play ``scenario``; the violations of the invariant it caused (none: it held)."""
        self.scenarios += 1
        self.problems = []
        self._flagged.clear()
        self.delivered.clear()
        sockets: list[socket.socket] = []
        stop = anyio.Event()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._chatter, stop)
                limit = 10 + 5 * len(scenario.steps)
                begun = anyio.current_time()
                with anyio.move_on_after(limit) as timer:
                    attacker = udp_socket()
                    sockets.append(attacker)
                    for i, step in enumerate(scenario.steps):
                        await self._step(step, attacker, sockets, first=i == 0)
                if timer.cancelled_caught:
                    self._flag("hang", f"the attack did not end within {limit} s")
                if not scenario.linger:
                    _close_all(sockets)
                started = anyio.current_time()
                self._count("attack_ms", int((started - begun) * 1000))
                if not await self._settle():
                    self._flag(
                        "settle",
                        f"not back to the baseline {SETTLE_BOUND} s after the attack: "
                        f"{self._state()}",
                    )
                took = int((anyio.current_time() - started) * 1000)
                self.stats["max_settle_ms"] = max(self.stats.get("max_settle_ms", 0), took)
                self._count("settle_ms", took)
                self._count("slow_settles", took > 500)
                stop.set()
        finally:
            _close_all(sockets)
        await self._honest()
        if not await self._settle():
            self._flag(
                "settle", f"not back to the baseline after the honest checks: {self._state()}"
            )
        self.stats["swallowed"] = sum(self.log.swallowed.values())
        return [*self.problems, *self.errors()]

    def _count(self, key: str, value: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + value

    async def _step(
        self, step: Step, attacker: socket.socket, sockets: list[socket.socket], *, first: bool
    ) -> None:
        kind = type(step).__name__
        self.stats[kind] = self.stats.get(kind, 0) + 1
        if isinstance(step, Raw):
            await send_datagram(attacker, step.data, self.address)
        elif isinstance(step, ToCid):
            cids = sorted(self.honest_cids & set(self.endpoint._by_cid) or self.honest_cids)
            cid = cids[step.which % len(cids)]
            await send_datagram(attacker, step.prefix + cid + step.suffix, self.address)
        elif isinstance(step, Replay):
            pool = self.captured[step.source % 3] or self.captured[0]
            data = apply_edits(pool[step.index % len(pool)], step.edits, self.captured[0])
            for _ in range(max(1, min(step.copies, 5))):
                await send_datagram(attacker, data, self.address)
        elif isinstance(step, Initials):
            count = max(1, min(step.count, 32))
            await send_initials(attacker, self.address, count, step.fleeting)
        elif isinstance(step, Peer):
            await self._peer(step, sockets, first=first)
        else:
            await anyio.sleep(max(0, min(step.ms, 1000)) / 1000)

    async def _peer(self, step: Peer, sockets: list[socket.socket], *, first: bool) -> None:
        datagram = 16383 if step.datagram > 1200 else 1200
        peer = HostilePeer(self.address, datagram)
        sockets.append(peer.sock)
        self.peer_apps[peer.identity.peer_id] = step.app
        if not await peer.handshake(PEER_HANDSHAKE):
            if first:  # nothing before it could have filled the handshake slots
                self._flag("handshake", "a valid client did not complete its handshake")
            return
        self.stats["peers"] = self.stats.get("peers", 0) + 1
        accepted = await peer.pump(
            PEER_HANDSHAKE, until=lambda: peer.identity.peer_id in self.delivered
        )
        if first and not accepted:
            self._flag("accept", "the listener did not deliver a valid client's connection")
        vanished = False
        for act in step.actions[:32]:
            if peer.terminated:
                break
            if act.op == "vanish":
                vanished = True
                break
            if act.op == "gaps":
                await peer.gaps(max(1, min(act.stream, 64)), act.code % (1 << 24), act.end)
            elif act.op == "churn" and act.code % 6 in (4, 5):  # the well-paced cycles
                await peer.stream_credit(max(1, act.stream % 1000))
            peer.apply(act)
            await peer.pump(min(act.code, 200) / 1000 if act.op == "pump" else 0)
            if act.op == "close":
                break
        if not vanished:
            await peer.settle()
            if not peer.terminated:
                peer.quic.close(error_code=0, reason_phrase="done")
                await peer.pump(0.02)
        for error in peer.client_errors:
            self._flag("client", error)
        self.peer_apps.pop(peer.identity.peer_id, None)


def _close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def _asyncio_loop() -> Any:
    import asyncio

    return asyncio.get_running_loop()


# -- checking scenarios --------------------------------------------------------------------------


async def _run_batch(
    batch: list[Scenario], progress: Callable[[], None] | None = None, strict: bool = False
) -> tuple[Scenario | None, list[str], dict[str, int]]:
    """Play ``batch`` against one listener; the first scenario that broke the invariant (with
    what went wrong), and statistics (with ``known:<name>``: how many scenarios hit each known
    issue, which is a failure only if ``strict``)."""
    harness = Harness()
    failed: Scenario | None = None
    problems: list[str] = []

    def failures(found: list[str]) -> list[str]:
        out = []
        for problem in found:
            name = known_issue(problem)
            if name is not None:
                key = f"known:{name}"
                harness.stats[key] = harness.stats.get(key, 0) + 1
            if strict or name is None:
                out.append(problem)
        return out

    limit = sum(20 + 10 * len(s.steps) for s in batch) + 4 * BOUND
    with anyio.move_on_after(limit) as timer:
        async with harness.running():
            for scenario in batch:
                problems = failures(await harness.run(scenario))
                if progress is not None:
                    progress()
                if problems:
                    failed = scenario
                    break
            if failed is None and not await harness._settle(draining_ok=False):
                problems.append(f"[settle] not back to the baseline at the end: {harness._state()}")
    problems += failures(harness.errors())
    if timer.cancelled_caught:
        problems.append("hang: the batch did not end")
    if problems and failed is None:  # at setup or shutdown
        failed = batch[-1] if batch else Scenario(())
    harness.stats["honest_trips"] = harness.honest_trips
    harness.stats["scenarios"] = harness.scenarios
    return failed, problems, harness.stats


def check_batch(batch: list[Scenario], strict: bool = False) -> dict[str, int]:
    """The whole invariant for ``batch``, played in order against one listener in a fresh event
    loop; raises :class:`InvariantBroken` naming the first scenario that broke it (known issues
    count only if ``strict``). Returns the run's statistics."""
    failed, problems, stats = anyio.run(_run_batch, batch, None, strict)
    if failed is not None:
        raise InvariantBroken(f"{describe(failed)}: {'; '.join(dict.fromkeys(problems))}")
    return stats


def check_scenario(scenario: Scenario, strict: bool = False) -> dict[str, int]:
    """The whole invariant for one scenario, on a fresh listener."""
    return check_batch([scenario], strict)


def generate(count: int, first_seed: int | None, derandomize: bool = False) -> list[Scenario]:
    """``count`` scenarios from the hypothesis strategy."""
    generated: list[Scenario] = []

    def collect(scenario: Scenario) -> None:
        generated.append(scenario)

    test: Any = settings(
        max_examples=count,
        deadline=None,
        database=None,
        derandomize=derandomize,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )(given(scenarios())(collect))
    if first_seed is not None and not derandomize:
        test = seed(first_seed)(test)
    test()
    return generated


# -- the engines ---------------------------------------------------------------------------------


def save_crash(scenario: Scenario) -> Path:
    text = scenario.to_json()
    path = crash_dir() / f"quic-{zlib.crc32(text.encode()):08x}.json"
    path.write_text(text)
    return path


_RSS_FIRST: int | None = None


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10


def play(
    batch: list[Scenario], strict: bool
) -> tuple[Scenario | None, list[str], dict[str, int], int]:
    """One batch in this process (a worker of :func:`run_hypothesis`): what ``_run_batch``
    returns, and how much this process' peak RSS grew since its first batch."""
    global _RSS_FIRST
    if _RSS_FIRST is None:
        _RSS_FIRST = _peak_rss()
    failed, problems, stats = anyio.run(_run_batch, batch, None, strict)
    return failed, problems, stats, _peak_rss() - _RSS_FIRST


def run_hypothesis(
    seconds: float,
    first_seed: int | None,
    strict: bool = False,
    workers: int = 1,
    batch_size: int = 12,
) -> int:
    """Batches of generated scenarios until ``seconds`` are up, ``workers`` at a time, each in a
    worker process with its own listener (the listener mostly waits for timeouts: several at
    once use the CPU that waiting leaves idle). Batch ``n`` is generated from seed ``seed + n``."""
    deadline = time.monotonic() + seconds
    started = time.monotonic()
    batch_no = 0
    totals: dict[str, int] = {}
    growth = 0
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        running: dict[Future[Any], int] = {}
        while True:
            while len(running) < workers and time.monotonic() < deadline:
                batch_seed = None if first_seed is None else first_seed + batch_no
                batch = generate(batch_size, batch_seed)
                running[pool.submit(play, batch, strict)] = batch_no
                batch_no += 1
            if not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                number = running.pop(future)
                failed, problems, stats, grew = future.result()
                growth = max(growth, grew)
                for key, value in stats.items():
                    if key.startswith(("peak", "max")):
                        totals[key] = max(totals.get(key, 0), value)
                    else:
                        totals[key] = totals.get(key, 0) + value
                if failed is not None:
                    print("; ".join(dict.fromkeys(problems)), file=sys.stderr)
                    path = save_crash(failed)
                    print(
                        f"FAILED after {totals.get('scenarios', 0)} scenarios (batch {number}): "
                        f"{describe(failed)}\nsaved to {path}; re-check it alone with "
                        f"--reproduce {path}",
                        file=sys.stderr,
                    )
                    pool.shutdown(wait=False, cancel_futures=True)
                    return 1
    if growth > MAX_RSS_GROWTH:
        print(f"FAILED: peak RSS grew by {growth >> 20} MiB during the run", file=sys.stderr)
        return 1
    elapsed = time.monotonic() - started
    examples = totals.pop("scenarios", 0)
    known = {k: v for k, v in totals.items() if k.startswith("known:")}
    shown = ", ".join(f"{k}={v}" for k, v in sorted(totals.items()) if k not in known)
    print(
        f"ok: {examples} scenarios in {elapsed:.0f} s ({examples / elapsed:.1f}/s, {workers} "
        f"worker{'s' if workers > 1 else ''}), invariant held (hypothesis engine; peak RSS "
        f"of a worker grew {growth >> 20} MiB)\n   {shown}"
    )
    _print_known(known)
    return 0


def _print_known(stats: dict[str, int]) -> None:
    for key, value in sorted(stats.items()):
        if key.startswith("known:"):
            print(
                f"   KNOWN ISSUE {key[6:]}: hit by {value} scenarios (see fuzz/README.md; a "
                "failure with --strict)"
            )


def run_atheris(seconds: float, corpus: Path | None, extra: list[str], strict: bool) -> int:
    import atheris

    atheris.instrument_all()
    with anyio.from_thread.start_blocking_portal() as portal, tempfile.TemporaryDirectory() as tmp:
        harness = Harness()
        ready = threading.Event()

        async def serve() -> None:  # the listener lives in the portal's event loop
            async with harness.running():
                ready.set()
                await anyio.sleep_forever()

        portal.start_task_soon(serve)
        if not ready.wait(60):
            raise RuntimeError("the listener did not start")

        def test_one(data: bytes) -> None:
            found = portal.call(harness.run, scenario_from_bytes(data))
            problems = [p for p in found if strict or known_issue(p) is None]
            if problems:
                raise InvariantBroken("; ".join(dict.fromkeys(problems)))

        corpus_dir = corpus or Path(tmp)
        if corpus is None:
            for i, scenario in enumerate(generate(100, 0)):
                (corpus_dir / f"scenario-{i}").write_bytes(scenario_to_bytes(scenario))
        atheris.Setup(libfuzzer_args(sys.argv[0], seconds, extra, corpus_dir), test_one)
        atheris.Fuzz()  # exits the process: 0 when time is up, non-zero on a crash
    return 0


def main() -> int:
    parser = arg_parser((__doc__ or "").split("\n", 1)[0], "re-check one saved scenario file")
    parser.add_argument("--strict", action="store_true", help="known issues are failures too")
    parser.add_argument(
        "--workers",
        type=int,
        default=min(4, 2 * (os.cpu_count() or 1)),
        help="hypothesis: batches played at once, each in its own process",
    )
    args, extra = parser.parse_known_args()
    if args.reproduce is not None:
        scenario = load_scenario(args.reproduce)
        digest = hashlib.sha256(scenario.to_json().encode()).hexdigest()[:12]
        print(f"checking {describe(scenario)} [{digest}]")
        try:
            stats = check_scenario(scenario, args.strict)
        except InvariantBroken as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            return 1
        print("ok: the invariant holds for this input")
        _print_known(stats)
        return 0
    if args.engine == "atheris":
        return run_atheris(args.seconds, args.corpus, extra, args.strict)
    if extra:
        parser.error(f"unknown arguments: {extra}")
    return run_hypothesis(args.seconds, args.seed, args.strict, max(1, args.workers))


if __name__ == "__main__":
    sys.exit(main())
