"""Fuzz the swarmavg-tcp record stream (see fuzz/README.md for the invariant).

    python fuzz/fuzz_tcp.py --seconds 20                   # CI: hypothesis, no native deps
    python fuzz/fuzz_tcp.py --seconds 3600 --seed 7         # a long, reproducible run
    python fuzz/fuzz_tcp.py --engine atheris --seconds 600  # coverage-guided (needs atheris)
    python fuzz/fuzz_tcp.py --reproduce fuzz/crashes/tcp-1234abcd.json

A hostile peer completes a valid handshake with a real TcpTransport listener on 127.0.0.1, then
writes arbitrary bytes as records; the server must drop at most that connection, with typed
errors, in bounded time and memory, and go on serving honest clients. The sans-IO decoders
(record headers, settings, HELLO, AUTH, AEAD opening) are fuzzed directly too.

Exit status 0: no input broke the invariant; 1: a counterexample was found (it is printed and
written to ``fuzz/crashes/``).
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import logging
import random
import resource
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
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
from anyio.streams.buffered import BufferedByteReceiveStream  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from swarmavg.abc import ConnectionAttribute  # noqa: E402
from swarmavg.errors import (  # noqa: E402
    ConnectionLost,
    PeerIdentityMismatch,
    RemoteProtocolError,
    StreamReset,
)
from swarmavg.identity import Identity  # noqa: E402
from swarmavg_tcp import TcpConnection, TcpListener, TcpStream, TcpTransport  # noqa: E402
from swarmavg_tcp import _frames as fr  # noqa: E402
from swarmavg_tcp._connection import _MAX_QUEUED_CONTROL  # noqa: E402
from swarmavg_tcp._frames import HEADER, HEADER_SIZE, TAG_SIZE, Sealer, Settings  # noqa: E402
from swarmavg_tcp._handshake import AUTH_SIZE, HELLO_SIZE, Handshake  # noqa: E402

#: Seconds any single wait may take (loopback answers in milliseconds).
BOUND = 5.0
#: Small limits for the server under attack (as tests/transports/test_tcp.py's STRICT), so that
#: every limit is within reach of short inputs.
STRICT = Settings(
    max_message_size=1 << 20,
    stream_window=256 << 10,
    connection_window=512 << 10,
    max_streams=4,
    max_record_size=64 << 10,
)
#: Control records the server may have queued (unsent) at once: the transport's own cap.
MAX_QUEUED_CONTROL = _MAX_QUEUED_CONTROL
#: Stream objects a connection may hold: max_streams live ones of the peer's, max_streams more
#: that the peer ended before they were accepted (the accept queue's cap), and the server's own.
MAX_HELD_STREAMS = 2 * STRICT.max_streams + 1
#: Growth of the process' peak RSS a whole run may cause.
MAX_RSS_GROWTH = 1 << 30

#: What the transport may raise to its users: a stream ends, is reset, or its connection died.
USER_ERRORS = (ConnectionLost, StreamReset, anyio.EndOfStream)


class InvariantBroken(AssertionError):
    """The transport did something other than serve, or drop the hostile connection cleanly."""


# -- scenarios -----------------------------------------------------------------------------------


@dataclass
class Scenario:
    """What a hostile peer does after a valid handshake.

    ``chunks`` are written in order, each with one ``send`` (the server gets to read between
    them). With ``encrypted``, they are the *plaintext* record stream: every complete record in
    their concatenation (16-byte header, then ``length`` payload bytes) is sealed with the session
    key before it is sent, so that the fuzzer reaches the state machine behind the AEAD; an
    incomplete tail is sent as it is. Chunk boundaries keep their place in the sealed stream.
    """

    encrypted: bool
    chunks: list[bytes]

    def to_json(self) -> str:
        return json.dumps({"encrypted": self.encrypted, "chunks": [c.hex() for c in self.chunks]})

    @classmethod
    def from_json(cls, text: str) -> Scenario:
        obj = json.loads(text)
        return cls(bool(obj["encrypted"]), [bytes.fromhex(c) for c in obj["chunks"]])

    @property
    def stream(self) -> bytes:
        return b"".join(self.chunks)


#: Chunk sizes an atheris input selects with the high bits of its first byte (0: one chunk).
_ATHERIS_CHUNKS = [0, 1, 2, 3, 5, 7, 13, 16, 17, 31, 32, 100, 1000, 4096, 4097, 65536]


def scenario_from_bytes(data: bytes) -> Scenario:
    """An atheris input as a scenario: byte 0 = encrypted (bit 0) and chunk size (bits 1-4)."""
    if not data:
        return Scenario(False, [])
    size = _ATHERIS_CHUNKS[(data[0] >> 1) & 15]
    body = data[1:]
    if size == 0:
        return Scenario(bool(data[0] & 1), [body])
    return Scenario(bool(data[0] & 1), [body[i : i + size] for i in range(0, len(body), size)])


def load_scenario(path: Path) -> Scenario:
    """A saved scenario: JSON (hypothesis engine) or a raw atheris input."""
    data = path.read_bytes()
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return Scenario.from_json(data.decode())
    return scenario_from_bytes(data)


def record(
    ftype: int,
    flags: int = 0,
    stream_id: int = 0,
    arg: int = 0,
    payload: bytes = b"",
    *,
    length: int | None = None,
    reserved: int = 0,
) -> bytes:
    """One plaintext record; ``length`` overrides the header's length field."""
    size = len(payload) if length is None else length
    return HEADER.pack(size, ftype, flags, reserved, stream_id, arg) + payload


def record_spans(data: bytes) -> list[tuple[int, int]]:
    """The complete records of a plaintext stream, as read by their length fields."""
    spans = []
    pos = 0
    while pos + HEADER_SIZE <= len(data):
        end = pos + HEADER_SIZE + int.from_bytes(data[pos : pos + 4], "big")
        if end > len(data):
            break
        spans.append((pos, end))
        pos = end
    return spans


def seal_chunks(sealer: Sealer, chunks: list[bytes]) -> list[bytes]:
    """The wire form of ``chunks`` (the plaintext record stream) on an encrypted connection."""
    data = b"".join(chunks)
    spans = record_spans(data)
    out = bytearray()
    for start, end in spans:
        header = data[start : start + HEADER_SIZE]
        sealed = bytearray(end - start - HEADER_SIZE + TAG_SIZE)
        sealer.seal_into(header, memoryview(data)[start + HEADER_SIZE : end], memoryview(sealed))
        out += header + sealed
    out += data[spans[-1][1] if spans else 0 :]
    ends = [end for _, end in spans]
    wire: list[bytes] = []
    prev = 0
    plain = 0
    for chunk in chunks:
        plain += len(chunk)
        cut = plain + TAG_SIZE * bisect.bisect_right(ends, plain)
        wire.append(bytes(out[prev:cut]))
        prev = cut
    if prev < len(out):
        wire.append(bytes(out[prev:]))
    return wire


# -- the hypothesis strategies -------------------------------------------------------------------

DATA, WINDOW, EOF, RESET = fr.DATA, fr.WINDOW, fr.EOF, fr.RESET
STOP, GOAWAY, PING, AUTH = fr.STOP, fr.GOAWAY, fr.PING, fr.AUTH
FIRST, LAST = fr.FIRST, fr.LAST
U32 = (1 << 32) - 1
#: 1 carries the harness' first message; 2 is the server's stream; 4 one it never opened.
STREAM_IDS = [1, 1, 2, 3, 3, 3, 4, 5, 5, 7, 9, 11, 13, 0, (1 << 31) + 1, U32]
#: Message sizes around every limit of STRICT.
_LARGE = STRICT.stream_window // 2 - fr.MESSAGE_OVERHEAD  # larger is a "large" message
SIZES = [0, 1, 5, 100, 4096, 4097, 5000, 65536, 65537, _LARGE, _LARGE + 1, 200_000]
_WINDOWS = [STRICT.stream_window, STRICT.connection_window]
_MAX_MSG = STRICT.max_message_size
ARGS = [0, 1, 5, 100, 4097, 65536, _LARGE, _LARGE + 1, *_WINDOWS, _MAX_MSG, _MAX_MSG + 1, U32]
_MAX_REC = STRICT.max_record_size
LENGTHS = [0, 1, 15, 16, 4097, _MAX_REC, _MAX_REC + 1, 1024, 1025, AUTH_SIZE, 1 << 31, U32]

stream_ids = st.one_of(st.sampled_from(STREAM_IDS), st.integers(0, U32))
args = st.one_of(st.sampled_from(ARGS), st.integers(0, U32))


def _payload(size: int, fill: int) -> bytes:
    return bytes([fill & 0xFF]) * size


@st.composite
def messages(draw: st.DrawFn) -> bytes:
    """A well-formed message on one stream: records of up to max_record_size, FIRST ... LAST."""
    stream_id = draw(stream_ids)
    size = draw(st.sampled_from(SIZES) | st.integers(0, 300))
    payload = (
        _payload(size, stream_id) if size > 64 else draw(st.binary(min_size=size, max_size=size))
    )
    limit = STRICT.max_record_size
    cuts = sorted(draw(st.lists(st.integers(0, size), max_size=3)))
    pieces: list[bytes] = []
    start = 0
    for stop in [*cuts, size]:
        while stop - start > limit:
            pieces.append(payload[start : start + limit])
            start += limit
        pieces.append(payload[start:stop])
        start = stop
    pieces = [p for i, p in enumerate(pieces) if p or i == 0]
    out = bytearray()
    for i, piece in enumerate(pieces):
        flags = (FIRST if i == 0 else 0) | (LAST if i == len(pieces) - 1 else 0)
        out += record(DATA, flags, stream_id, size if i == 0 else 0, piece)
    return bytes(out)


@st.composite
def control_records(draw: st.DrawFn) -> bytes:
    """A control record, mostly plausible (credit, EOF, RESET, STOP, PING; GOAWAY is rare)."""
    ftype = draw(st.sampled_from([WINDOW, WINDOW, EOF, EOF, RESET, STOP, PING, GOAWAY, AUTH]))
    flags = draw(st.sampled_from([0, 0, 0, fr.LARGE_DONE, 2, 255]))
    if ftype == WINDOW:
        arg = draw(st.sampled_from([0, 1, 64, 4096, 32768, STRICT.stream_window]) | args)
    else:
        arg = draw(st.sampled_from([0, 0, 1, 3]) | args)
    payload = draw(st.sampled_from([b"", b"", b"", b"x", bytes(116)]))
    return record(ftype, flags, draw(stream_ids), arg, payload)


@st.composite
def hostile_records(draw: st.DrawFn) -> bytes:
    """A record with any header: hostile length fields, unknown types, flags, reserved bits."""
    payload = draw(st.binary(max_size=48))
    length = draw(st.none() | st.sampled_from(LENGTHS) | st.integers(0, 200))
    return record(
        draw(st.integers(0, 255) | st.sampled_from([DATA, WINDOW, EOF, 8, 255])),
        draw(st.sampled_from([0, FIRST, LAST, FIRST | LAST, 4, 255]) | st.integers(0, 255)),
        draw(stream_ids),
        draw(args),
        payload,
        length=length,
        reserved=draw(st.sampled_from([0, 0, 0, 1, 0x8000])),
    )


@st.composite
def floods(draw: st.DrawFn) -> bytes:
    """One short record many times over (a burst the server must absorb in bounded memory):
    a control record, a small message, or the start of a large message."""
    stream_id = draw(stream_ids)
    one = draw(
        st.one_of(
            control_records(),
            messages().filter(lambda m: len(m) <= 64),
            st.just(record(DATA, FIRST, stream_id, _LARGE + 1)),
        )
    )
    return one * draw(st.sampled_from([2, 10, 100, 1000, 5000]))


@st.composite
def stream_churn(draw: st.DrawFn) -> bytes:
    """Many short-lived streams, as a busy peer opens them: each gets a message or an EOF (or
    both), and is then reset, stopped or left open."""
    start = draw(st.sampled_from([3, 5, 7, 101])) + 2 * draw(st.integers(0, 3))
    count = draw(st.integers(1, 40))
    ends = draw(st.lists(st.sampled_from([RESET, RESET, STOP, None]), min_size=1, max_size=3))
    out = bytearray()
    for i in range(count):
        sid = start + 2 * i
        opening = ends[i % len(ends)]
        if i % 3 != 2:
            out += record(DATA, FIRST | LAST, sid, 3, b"abc")
        if i % 3 != 0:
            out += record(EOF, 0, sid)
        if opening is not None:
            out += record(opening, 0, sid)
    return bytes(out)


pieces_of_streams = st.one_of(
    messages(),
    messages(),
    control_records(),
    hostile_records(),
    floods(),
    stream_churn(),
    st.binary(min_size=1, max_size=64),  # garbage
)


@st.composite
def record_streams(draw: st.DrawFn) -> bytes:
    """A plaintext record stream, possibly truncated or with a byte changed."""
    data = b"".join(draw(st.lists(pieces_of_streams, max_size=8)))
    edit = draw(st.sampled_from(["none", "none", "truncate", "flip"]))
    if edit == "truncate" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif edit == "flip" and data:
        pos = draw(st.integers(0, len(data) - 1))
        data = data[:pos] + bytes([data[pos] ^ (1 << draw(st.integers(0, 7)))]) + data[pos + 1 :]
    return data


def chunked(data: bytes, how: str, cuts: list[int]) -> list[bytes]:
    """Cut ``data``: whole, at ``cuts``, or its first 64 bytes one by one, or in pieces of 7."""
    if how == "whole" or not data:
        return [data] if data else []
    if how == "bytewise":
        head = data[:64]
        return [head[i : i + 1] for i in range(len(head))] + ([data[64:]] if data[64:] else [])
    if how == "sevens":
        head = data[: 7 * 64]
        rest = [data[7 * 64 :]] if data[7 * 64 :] else []
        return [head[i : i + 7] for i in range(0, len(head), 7)] + rest
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True) if b > a]


@st.composite
def _scenarios(draw: st.DrawFn) -> Scenario:
    data = draw(record_streams())
    how = draw(st.sampled_from(["whole", "whole", "cuts", "cuts", "bytewise", "sevens"]))
    cuts = draw(st.lists(st.integers(0, 1 << 20), max_size=6))
    return Scenario(encrypted=draw(st.booleans()), chunks=chunked(data, how, cuts))


def scenarios() -> st.SearchStrategy[Scenario]:
    """Hostile record streams: valid messages and control records, hostile headers, garbage,
    floods, truncations, bit flips, cut into chunks in various ways; encrypted or not."""
    return _scenarios()


# -- cheap mutations (hypothesis generates slowly; these multiply its inputs) ---------------------

MARKERS = bytes([0x00, 0x01, 0x02, 0x03, 0x07, 0x08, 0x40, 0x7F, 0x80, 0xFF])


def mutate(rng: random.Random, data: bytes) -> bytes:
    """A record-aware byte-level mutation of a plaintext record stream."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        spans = record_spans(bytes(out))
        op = rng.randrange(9)
        pos = rng.randrange(len(out) + 1)
        if op <= 3 and spans:  # a header field of a record
            start, _ = rng.choice(spans)
            offset, size = rng.choice([(0, 4), (4, 1), (5, 1), (6, 2), (8, 4), (12, 4)])
            value = rng.choice([0, 1, 2, 3, 4, 7, 8, 255, 1 << 16, 1 << 31, (1 << 32) - 1])
            if op == 0:
                value = rng.choice(LENGTHS + ARGS + STREAM_IDS)
            out[start + offset : start + offset + size] = (value % (1 << (8 * size))).to_bytes(
                size, "big"
            )
        elif op == 4 and len(spans) >= 1:  # a record repeated, dropped or moved
            start, end = rng.choice(spans)
            piece = bytes(out[start:end])
            action = rng.randrange(3)
            if action == 0:
                out[end:end] = piece * rng.choice([1, 2, 10])
            elif action == 1:
                del out[start:end]
            else:
                del out[start:end]
                dest, _ = rng.choice(spans) if spans else (0, 0)
                dest = min(dest, len(out))
                out[dest:dest] = piece
        elif op == 5 and pos < len(out):
            out[pos] ^= 1 << rng.randrange(8)
        elif op == 6 and pos < len(out):
            out[pos] = rng.choice(MARKERS)
        elif op == 7:
            out[pos:pos] = rng.randbytes(rng.randint(1, 20))
        else:
            del out[pos:]
    return bytes(out)


def mutate_scenario(rng: random.Random, scenario: Scenario) -> Scenario:
    data = mutate(rng, scenario.stream)
    how = rng.choice(["whole", "cuts", "cuts", "bytewise", "sevens"])
    cuts = [rng.randrange(len(data) + 1) for _ in range(rng.randint(1, 6))]
    return Scenario(rng.random() < 0.5, chunked(data, how, cuts))


# -- the sans-IO decoders ------------------------------------------------------------------------


def _header_ok(length: int, ftype: int, flags: int, reserved: int, max_record: int) -> bool:
    """The record-header rules of the _frames docstring, written independently."""
    if ftype > fr.MAX_TYPE or reserved:
        return False
    if ftype == DATA:
        return (
            length <= max_record
            and not flags & ~(FIRST | LAST | fr.FIN)
            and (not flags & fr.FIN or bool(flags & LAST))
        )
    allowed_flags = fr.LARGE_DONE if ftype == fr.WINDOW else 0
    if flags & ~allowed_flags:
        return False
    if ftype == AUTH:
        return length <= 1024
    return length == 0


class _Decoders:
    """A genuine handshake, whose HELLO and AUTH the decoder checks mutate."""

    def __init__(self) -> None:
        self.identity = Identity.generate()
        initiator = Handshake(
            Identity.generate(), is_initiator=True, encryption=True, settings=Settings()
        )
        self.responder = Handshake(
            self.identity, is_initiator=False, encryption=True, settings=STRICT
        )
        initiator.receive_hello(self.responder.hello)
        self.responder.receive_hello(initiator.hello)
        self.hello = initiator.hello
        self.auth = initiator.auth_payload()
        self.peer_id = initiator.identity.peer_id
        self.verify_auth(self.auth, must_accept=True)

    def verify_auth(self, payload: bytes, *, must_accept: bool = False) -> None:
        try:
            peer_id, _ = self.responder.verify_auth(payload, self.peer_id)
        except (RemoteProtocolError, PeerIdentityMismatch):
            if must_accept:
                raise InvariantBroken("a genuine AUTH was refused") from None
            return
        if peer_id != self.peer_id or payload != self.auth:
            raise InvariantBroken(f"a forged AUTH was accepted: {payload.hex()}")


_DECODERS: _Decoders | None = None


def _patched(base: bytes, data: bytes) -> bytes:
    """``base`` with a piece of ``data`` written over it at an offset ``data`` chooses."""
    if not data:
        return base
    offset = data[0] % len(base)
    patch = data[1 : 1 + len(base) - offset]
    return base[:offset] + patch + base[offset + len(patch) :]


def check_decoders(data: bytes) -> None:
    """The sans-IO decoders on ``data``: only RemoteProtocolError (or PeerIdentityMismatch) may
    escape, and what they accept is what the protocol allows."""
    global _DECODERS
    if _DECODERS is None:
        _DECODERS = _Decoders()
    dec = _DECODERS
    # record headers: check_header agrees with the documented rules
    for pos in range(0, max(0, min(len(data), 96) - HEADER_SIZE) + 1):
        if pos + HEADER_SIZE > len(data):
            break
        length, ftype, flags, reserved, _, _ = HEADER.unpack_from(data, pos)
        for max_record in (STRICT.max_record_size, Settings().max_record_size):
            try:
                fr.check_header(length, ftype, flags, reserved, max_record)
                accepted = True
            except RemoteProtocolError:
                accepted = False
            if accepted != _header_ok(length, ftype, flags, reserved, max_record):
                raise InvariantBroken(
                    f"check_header accepted={accepted} for {data[pos : pos + 16]!r}"
                )
    # settings: accepted ones are in range and round-trip
    for piece in (data[: fr.SETTINGS_SIZE], data[-fr.SETTINGS_SIZE :], data[:24]):
        try:
            parsed = Settings.from_bytes(piece)
        except RemoteProtocolError:
            continue
        if parsed.to_bytes() != bytes(piece):
            raise InvariantBroken(f"Settings.from_bytes({piece!r}) does not round-trip")
    # HELLO: garbage and the genuine one patched
    for hello in (data[:HELLO_SIZE], _patched(dec.hello, data)):
        hs = Handshake(dec.identity, is_initiator=False, encryption=False, settings=STRICT)
        try:
            hs.receive_hello(hello)
        except RemoteProtocolError:
            continue
        if hello[:4] != b"SWAV" or hello[4] != 1 or hello[5] & ~1 or hello[6:8] != b"\0\0":
            raise InvariantBroken(f"receive_hello accepted {hello!r}")
        if hs.encrypted != (not hello[5] & 1):
            raise InvariantBroken(f"receive_hello negotiated encryption wrongly for {hello!r}")
    # AUTH: garbage and the genuine one patched
    dec.verify_auth(data[:AUTH_SIZE])
    patched = _patched(dec.auth, data)
    if patched != dec.auth:
        dec.verify_auth(patched)
    # AEAD: a forged record never opens
    if len(data) >= TAG_SIZE:
        opener = Sealer(bytes(16))
        length = len(data) - TAG_SIZE
        header = HEADER.pack(length, DATA, FIRST | LAST, 0, 1, length)
        out = bytearray(length)
        with contextlib.suppress(RemoteProtocolError):
            opener.open_into(header, memoryview(data), memoryview(out))
            raise InvariantBroken(f"a forged record opened: {data!r}")


# -- a hand-driven peer (after RawPeer in tests/transports/test_tcp.py) --------------------------


class RawPeer:
    """A swarmavg-tcp client over a raw socket: a valid handshake, then any bytes."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)
        self.identity = Identity.generate()
        self.sealer: Sealer | None = None
        self.opener: Sealer | None = None
        self.encrypted = False

    async def send_raw(self, data: bytes) -> None:
        """Write ``data``; the server hanging up first is not an error (it is often the point)."""
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await self.stream.send(data)

    async def handshake(self, *, encryption: bool) -> None:
        hs = Handshake(self.identity, is_initiator=True, encryption=encryption, settings=Settings())
        await self.send_raw(hs.hello)
        hs.receive_hello(bytes(await self.reader.receive_exactly(HELLO_SIZE)))
        self.sealer, self.opener, self.encrypted = hs.send_sealer, hs.recv_opener, hs.encrypted
        await self.send_raw(self.seal([record(AUTH, payload=hs.auth_payload())])[0])
        header = bytes(await self.reader.receive_exactly(HEADER_SIZE))
        length, ftype, *_ = HEADER.unpack(header)
        body = bytes(await self.reader.receive_exactly(length + (TAG_SIZE if self.opener else 0)))
        if ftype != AUTH:
            raise InvariantBroken(f"the server answered the handshake with a type {ftype} record")
        hs.verify_auth(self.open(header, body), None)

    def seal(self, chunks: list[bytes]) -> list[bytes]:
        return chunks if self.sealer is None else seal_chunks(self.sealer, chunks)

    def open(self, header: bytes, body: bytes) -> bytes:
        if self.opener is None:
            return body
        plain = bytearray(len(body) - TAG_SIZE)
        self.opener.open_into(header, memoryview(body), memoryview(plain))
        return bytes(plain)

    async def read_records(self, problems: list[str]) -> None:
        """Read what the server writes until it hangs up; each record must be valid."""
        limit = Settings().max_record_size
        with contextlib.suppress(
            anyio.EndOfStream,
            anyio.IncompleteRead,  # the server may drop the connection in the middle of a write
            anyio.BrokenResourceError,
            anyio.ClosedResourceError,
        ):
            while True:
                header = bytes(await self.reader.receive_exactly(HEADER_SIZE))
                length, ftype, flags, reserved, _, _ = HEADER.unpack(header)
                if not _header_ok(length, ftype, flags, reserved, limit):
                    problems.append(f"the server wrote an invalid record header {header.hex()}")
                    return
                tag = TAG_SIZE if self.opener is not None else 0
                body = bytes(await self.reader.receive_exactly(length + tag))
                try:
                    self.open(header, body)
                except RemoteProtocolError:
                    # a protocol error on a plaintext connection ends with an unsealed GOAWAY;
                    # on an encrypted one the server sends nothing unsealed
                    problems.append(f"a record of the server failed authentication: {header.hex()}")
                    return


# -- the server under attack ---------------------------------------------------------------------


@dataclass
class _Run:
    """What one scenario observed on the server side."""

    problems: list[str] = field(default_factory=list)
    app_streams: list[TcpStream] = field(default_factory=list)
    peak_held: int = 0


class Harness:
    """Two TcpTransports (encrypted, plaintext) serving on 127.0.0.1, and an honest client each.

    :meth:`run` plays one scenario against the matching server and returns what went wrong.
    """

    def __init__(self) -> None:
        self.servers: dict[bool, tuple[TcpTransport, TcpListener]] = {}
        self.clients: dict[bool, TcpTransport] = {}
        self.loop_errors: list[str] = []
        self.log_errors: list[str] = []
        self.scenarios = 0

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Harness]:
        loop = asyncio_loop()
        previous = loop.get_exception_handler()
        loop.set_exception_handler(self._on_loop_error)
        handler = _ListHandler(self.log_errors)
        logger = logging.getLogger("swarmavg_tcp")
        logger.addHandler(handler)
        stack = contextlib.AsyncExitStack()
        try:
            for encryption in (True, False):
                server = await stack.enter_async_context(
                    TcpTransport(
                        Identity.generate(),
                        encryption=encryption,
                        handshake_timeout=BOUND,
                        **_options(STRICT),
                    )
                )
                listener = await server.listen("tcp://127.0.0.1:0")  # type: ignore[arg-type]
                self.servers[encryption] = (server, listener)
                self.clients[encryption] = await stack.enter_async_context(
                    TcpTransport(Identity.generate(), encryption=encryption)
                )
            yield self
        finally:
            try:
                await stack.aclose()
            except Exception as exc:  # the transports' task groups must end cleanly
                self.loop_errors.append(f"closing the transports raised {exc!r}")
            logger.removeHandler(handler)
            loop.set_exception_handler(previous)

    def _on_loop_error(self, loop: Any, context: dict[str, Any]) -> None:
        self.loop_errors.append(f"{context.get('message')}: {context.get('exception')!r}")

    def errors(self) -> list[str]:
        return [*self.loop_errors, *(f"logged: {m}" for m in self.log_errors)]

    async def run(self, scenario: Scenario) -> list[str]:
        """Play ``scenario``; the violations of the invariant it caused (none: it held)."""
        self.scenarios += 1
        run = _Run()
        transport, listener = self.servers[scenario.encrypted]
        phase = "handshake"
        conn: TcpConnection | None = None
        with anyio.move_on_after(4 * BOUND) as timer:
            stream = await anyio.connect_tcp("127.0.0.1", listener.address.port)
            raw = RawPeer(stream)
            try:
                await raw.handshake(encryption=scenario.encrypted)
                phase = "accept"
                conn = await listener.accept()
                if conn.extra(ConnectionAttribute.encrypted) is not scenario.encrypted:
                    run.problems.append("the connection's encryption is not the negotiated one")
                _watch_reader(conn, run)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_application, conn, run)
                    tg.start_soon(raw.read_records, run.problems)
                    phase = "sending"
                    for chunk in raw.seal([record(DATA, FIRST | LAST, 1, 5, b"hello")]):
                        await raw.send_raw(chunk)
                    for chunk in raw.seal(scenario.chunks):
                        await raw.send_raw(chunk)
                        await anyio.lowlevel.checkpoint()  # the server reads it
                    phase = "closing (the server did not drop the connection after our EOF)"
                    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                        await stream.send_eof()
                    await conn.wait_closed()
                    phase = "waiting for the application's streams and the server's hang-up"
            finally:
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
        if timer.cancelled_caught:
            run.problems.append(f"hang: no progress for {4 * BOUND} s while {phase}")
            if conn is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(BOUND):
                    await conn.aclose()
        if conn is not None and conn in transport._connections:
            run.problems.append("the closed connection is still in the transport's set")
        if transport._incoming_limits.total != 0:
            run.problems.append(
                f"{transport._incoming_limits.total} incoming connections still counted"
            )
        run.problems += await self._honest(scenario.encrypted)
        run.problems += self.errors()
        self.loop_errors.clear()
        self.log_errors.clear()
        return run.problems

    async def _honest(self, encryption: bool) -> list[str]:
        """A fresh honest client still gets served: a round trip both ways."""
        _, listener = self.servers[encryption]
        client = self.clients[encryption]
        try:
            with anyio.fail_after(BOUND):
                dialed = await client.connect(listener.address)
                accepted = await listener.accept()
                sa = await dialed.open_stream()
                await sa.send(b"ping")
                sb = await accepted.accept_stream()
                if bytes(await sb.receive()) != b"ping":
                    return ["an honest message was garbled"]
                await sb.send(b"pong")
                if bytes(await sa.receive()) != b"pong":
                    return ["an honest reply was garbled"]
                await dialed.aclose()
                await accepted.wait_closed()
        except Exception as exc:
            return [f"an honest client is no longer served: {exc!r}"]
        return []


def asyncio_loop() -> Any:
    import asyncio

    return asyncio.get_running_loop()


class _ListHandler(logging.Handler):
    """Collects the transport's log records of level ERROR and above (logger.exception: bugs)."""

    def __init__(self, out: list[str]) -> None:
        super().__init__(logging.ERROR)
        self.out = out

    def emit(self, rec: logging.LogRecord) -> None:
        self.out.append(rec.getMessage())


def _options(s: Settings) -> dict[str, int]:
    return {
        "max_message_size": s.max_message_size,
        "stream_window": s.stream_window,
        "connection_window": s.connection_window,
        "max_streams": s.max_streams,
        "max_record_size": s.max_record_size,
    }


def _watch_reader(conn: TcpConnection, run: _Run) -> None:
    """Run the connection's reader callback through a wrapper that catches what escapes it and
    checks the memory bounds right after each call (before anything else could free memory)."""
    if conn.is_closed:
        return
    loop = asyncio_loop()
    fd = conn._sock.fileno()

    def reader() -> None:
        try:
            conn._on_readable()
        except BaseException as exc:
            run.problems.append(f"the reader callback raised {exc!r}")
            conn._fail(ConnectionLost("stopped by the fuzz harness"))
            return
        _check_bounds(conn, run)

    loop.remove_reader(fd)
    loop.add_reader(fd, reader)


def _check_bounds(conn: TcpConnection, run: _Run) -> None:
    s = STRICT
    held_streams = {id(x): x for x in (*conn._streams.values(), *conn._accept_queue)}
    everything = {**held_streams, **{id(x): x for x in run.app_streams}}
    held = 0
    for stream in everything.values():
        held += sum(len(m) for m, _, _ in stream._inbox)
        if stream._partial_view is not None:
            held += len(stream._partial_view)
    run.peak_held = max(run.peak_held, held)
    if held > s.connection_window + s.max_message_size:
        run.problems.append(f"the connection holds {held} bytes of messages, above its windows")
    if len(held_streams) > MAX_HELD_STREAMS:
        run.problems.append(
            f"the connection holds {len(held_streams)} streams ({len(conn._accept_queue)} "
            f"waiting to be accepted), above max_streams={s.max_streams}"
        )
    if len(conn._control) > MAX_QUEUED_CONTROL:
        run.problems.append(f"{len(conn._control)} control records queued")
    if run.problems:  # report once, then stop looking at this connection
        conn._fail(ConnectionLost("stopped by the fuzz harness"))


async def _application(conn: TcpConnection, run: _Run) -> None:
    """The server's application: opens stream 2, accepts the peer's streams and treats them in
    turn: echo every message, read one then close, abort at once, read only once it is dead."""
    policies = [_echo, _read_one_then_close, _abort, _read_late]

    async def guarded(func: Callable[..., Any], *a: Any) -> None:
        try:
            await func(*a)
        except USER_ERRORS:
            pass
        except Exception as exc:
            run.problems.append(f"{func.__name__} got {exc!r} from the transport")

    async def serve() -> None:
        ours = await conn.open_stream()
        await ours.send(b"hi")
        tg.start_soon(guarded, _echo, conn, ours)
        for index in range(1 << 30):
            stream = await conn.accept_stream()
            run.app_streams.append(stream)
            tg.start_soon(guarded, policies[index % len(policies)], conn, stream)

    async with anyio.create_task_group() as tg:
        tg.start_soon(guarded, serve)


async def _echo(conn: TcpConnection, stream: TcpStream) -> None:
    while True:
        try:
            message = await stream.receive()
        except anyio.EndOfStream:
            await stream.send_eof()
            return
        await stream.send(b"ok %d" % len(message))


async def _read_one_then_close(conn: TcpConnection, stream: TcpStream) -> None:
    await stream.receive()
    await stream.aclose()


async def _abort(conn: TcpConnection, stream: TcpStream) -> None:
    await stream.abort()


async def _read_late(conn: TcpConnection, stream: TcpStream) -> None:
    await conn.wait_closed()
    while True:
        await stream.receive()


async def _check_alone(scenario: Scenario) -> list[str]:
    harness = Harness()
    problems: list[str] = []
    with anyio.move_on_after(8 * BOUND) as timer:  # run() bounds itself; this bounds shutdown
        async with harness.running():
            problems = await harness.run(scenario)
    if timer.cancelled_caught:
        problems.append("hang: the transports did not shut down")
    return problems + harness.errors()


def check_record_stream(scenario: Scenario) -> None:
    """The whole invariant for one scenario, on fresh servers in a fresh event loop."""
    check_decoders(scenario.stream)
    problems = anyio.run(_check_alone, scenario)
    if problems:
        raise InvariantBroken("; ".join(dict.fromkeys(problems)))


# -- the engines ---------------------------------------------------------------------------------


def save_crash(scenario: Scenario) -> Path:
    text = scenario.to_json()
    path = crash_dir() / f"tcp-{zlib.crc32(text.encode()):08x}.json"
    path.write_text(text)
    return path


def _describe(scenario: Scenario) -> str:
    data = scenario.stream
    shown = data[:200].hex() + ("..." if len(data) > 200 else "")
    return (
        f"Scenario(encrypted={scenario.encrypted}, {len(scenario.chunks)} chunks, "
        f"{len(data)} bytes: {shown})"
    )


async def _run_batch(batch: list[Scenario], progress: Callable[[], None]) -> Scenario | None:
    """Play ``batch`` against one pair of servers; the first scenario that broke the invariant."""
    harness = Harness()
    with anyio.move_on_after(len(batch) * 4 * BOUND + 4 * BOUND) as timer:
        async with harness.running():
            for scenario in batch:
                problems = await harness.run(scenario)
                progress()
                if problems:
                    print("; ".join(dict.fromkeys(problems)), file=sys.stderr)
                    return scenario
    problems = harness.errors()
    if timer.cancelled_caught:
        problems.append("hang: the transports did not shut down")
    if problems:  # at shutdown
        print("; ".join(problems), file=sys.stderr)
        return batch[-1]
    return None


def run_hypothesis(seconds: float, first_seed: int | None, mutations: int = 4) -> int:
    deadline = time.monotonic() + seconds
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    batch_no = 0
    examples = 0

    def count() -> None:
        nonlocal examples
        examples += 1

    generated: list[Scenario] = []

    def collect(scenario: Scenario) -> None:
        generated.append(scenario)

    while time.monotonic() < deadline:
        generated.clear()

        test: Any = settings(
            max_examples=25,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, Phase.generate],
        )(given(scenarios())(collect))
        if first_seed is not None:
            test = seed(first_seed + batch_no)(test)
        test()
        batch: list[Scenario] = []
        for scenario in generated:
            key = zlib.crc32(scenario.to_json().encode()) ^ (first_seed or 0)
            rng = random.Random(key)
            batch += [scenario, *(mutate_scenario(rng, scenario) for _ in range(mutations))]
        failed: Scenario | None = None
        for scenario in batch:  # the sans-IO decoders: cheap, on every input's bytes
            try:
                check_decoders(scenario.stream)
            except Exception as exc:
                print(f"decoders: {exc!r}", file=sys.stderr)
                failed = scenario
                break
        if failed is None:
            failed = anyio.run(_run_batch, batch, count)
        if failed is not None:
            path = save_crash(failed)
            print(
                f"FAILED after {examples} scenarios (batch {batch_no}): {_describe(failed)}\n"
                f"saved to {path}; re-check it alone with --reproduce {path}",
                file=sys.stderr,
            )
            return 1
        batch_no += 1
    growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - rss_before
    if growth > MAX_RSS_GROWTH:
        print(f"FAILED: peak RSS grew by {growth >> 20} MiB during the run", file=sys.stderr)
        return 1
    elapsed = seconds + max(0.0, time.monotonic() - deadline)
    print(
        f"ok: {examples} scenarios in {elapsed:.0f} s ({examples / elapsed:.0f}/s), "
        f"invariant held (hypothesis engine; peak RSS grew {growth >> 20} MiB)"
    )
    return 0


def seed_corpus(directory: Path, count: int = 200) -> None:
    """Scenarios from the hypothesis strategy, in the atheris input format."""
    samples: list[Scenario] = []

    @settings(max_examples=count, database=None, suppress_health_check=list(HealthCheck))
    @given(scenarios())
    def collect(scenario: Scenario) -> None:
        samples.append(scenario)

    collect()
    for i, scenario in enumerate(samples):
        selector = (i % len(_ATHERIS_CHUNKS)) << 1 | int(scenario.encrypted)
        (directory / f"scenario-{i}").write_bytes(bytes([selector]) + scenario.stream)


def run_atheris(seconds: float, corpus: Path | None, extra: list[str]) -> int:
    import atheris

    atheris.instrument_all()
    with anyio.from_thread.start_blocking_portal() as portal, tempfile.TemporaryDirectory() as tmp:
        harness = Harness()
        ready = threading.Event()

        async def serve() -> None:  # the servers live in the portal's event loop
            async with harness.running():
                ready.set()
                await anyio.sleep_forever()

        portal.start_task_soon(serve)
        if not ready.wait(60):
            raise RuntimeError("the servers did not start")

        def test_one(data: bytes) -> None:
            scenario = scenario_from_bytes(data)
            check_decoders(scenario.stream)
            problems = portal.call(harness.run, scenario)
            if problems:
                raise InvariantBroken("; ".join(dict.fromkeys(problems)))

        corpus_dir = corpus or Path(tmp)
        if corpus is None:
            seed_corpus(corpus_dir)
        args = libfuzzer_args(sys.argv[0], seconds, extra, corpus_dir)
        atheris.Setup(args, test_one)
        atheris.Fuzz()  # exits the process: 0 when time is up, non-zero on a crash
    return 0


def _digest(scenario: Scenario) -> str:
    return hashlib.sha256(scenario.to_json().encode()).hexdigest()[:12]


def main() -> int:
    parser = arg_parser((__doc__ or "").split("\n", 1)[0], "re-check one saved scenario file")
    args, extra = parser.parse_known_args()
    if args.reproduce is not None:
        scenario = load_scenario(args.reproduce)
        print(f"checking {_describe(scenario)} [{_digest(scenario)}]")
        try:
            check_record_stream(scenario)
        except InvariantBroken as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            return 1
        print("ok: the invariant holds for this input")
        return 0
    if args.engine == "atheris":
        return run_atheris(args.seconds, args.corpus, extra)
    if extra:
        parser.error(f"unknown arguments: {extra}")
    return run_hypothesis(args.seconds, args.seed)


if __name__ == "__main__":
    sys.exit(main())
