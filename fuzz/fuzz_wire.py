"""Fuzz the wire codec: FrameDecoder and decode_message (see fuzz/README.md for the invariant).

    python fuzz/fuzz_wire.py --seconds 20                   # CI: hypothesis, no native deps
    python fuzz/fuzz_wire.py --seconds 3600 --seed 7         # a long, reproducible run
    python fuzz/fuzz_wire.py --engine atheris --seconds 600  # coverage-guided (needs atheris)
    python fuzz/fuzz_wire.py --reproduce fuzz/crashes/crash-1234abcd

Exit status 0: no input broke the invariant; 1: a counterexample was found (it is printed, and
written to ``fuzz/crashes/`` by the atheris engine).
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "proto"))  # the message strategies live with the tests
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "fuzz"))

import numpy as np  # noqa: E402
import proto_sample_messages  # noqa: E402  (registers the test.* messages)
from _engine import arg_parser, crash_dir, libfuzzer_args  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from proto_strategies import (  # noqa: E402
    encoded_messages,
    import_all_message_modules,
    mutated_encodings,
    wire_equal,
)

from swarmavg.errors import RemoteProtocolError  # noqa: E402
from swarmavg.proto import (  # noqa: E402
    FrameDecoder,
    Message,
    decode_message,
    encode_frame,
    encode_message,
    encode_message_bytes,
)

MAX_FRAME = 1 << 16


class InvariantBroken(AssertionError):
    """The codec did something other than parse or raise RemoteProtocolError."""


def check_message(data: bytes | memoryview) -> Message | None:
    """decode_message gives a message or RemoteProtocolError; accepted messages re-encode, and
    re-encoding is a fixed point."""
    try:
        msg = decode_message(data)
    except RemoteProtocolError:
        return None
    again = encode_message_bytes(msg)  # the decoder must accept only what the encoder accepts
    twice = decode_message(again)
    if not wire_equal(msg, twice) or encode_message_bytes(twice) != again:
        raise InvariantBroken(f"re-encoding {msg!r} is not stable")
    return msg


def frames_of(data: bytes, cuts: list[int]) -> tuple[list[bytes], bool]:
    """Feed ``data`` cut at ``cuts``; the frames and whether a RemoteProtocolError was raised."""
    decoder = FrameDecoder(MAX_FRAME)
    frames: list[bytes] = []
    failed = False
    start = 0
    try:
        for stop in [*sorted(cuts), len(data)]:
            decoder.feed(data[start:stop])
            frames += [bytes(f) for f in decoder.frames()]
            start = stop
        decoder.feed_eof()
    except RemoteProtocolError:
        failed = True
    frames += [bytes(f) for f in decoder.frames()]
    return frames, failed


def check(data: bytes) -> None:
    """The whole invariant for one input (also used as atheris' TestOneInput)."""
    check_message(data)
    whole = frames_of(data, [])
    n = len(data)
    for cuts in ([n // 2], [n // 3, 2 * n // 3], list(range(0, min(n, 64)))):
        if frames_of(data, cuts) != whole:
            raise InvariantBroken("FrameDecoder output depends on how the input is chunked")
    for frame in whole[0]:
        if len(frame) > MAX_FRAME:
            raise InvariantBroken("FrameDecoder returned a frame above its cap")
        check_message(frame)


def framed(bodies: list[bytes]) -> bytes:
    return b"".join(b"".join(encode_frame([b], MAX_FRAME)) for b in bodies if len(b) <= MAX_FRAME)


INPUTS = st.one_of(
    st.binary(max_size=512),
    mutated_encodings(),
    st.lists(st.one_of(encoded_messages(), mutated_encodings()), max_size=4).map(framed),
    st.tuples(st.lists(encoded_messages(), max_size=3).map(framed), st.binary(max_size=64)).map(
        lambda t: t[0] + t[1]
    ),
)


MARKERS = bytes([0x00, 0x01, 0x7F, 0x80, 0x90, 0x91, 0xC0, 0xC1, 0xC4, 0xD9, 0xDC, 0xDE, 0xFF])


def mutate(rng: random.Random, data: bytes) -> bytes:
    """A cheap byte-level mutation (hypothesis generates slowly; this multiplies its inputs)."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(len(out) + 1)
        op = rng.randrange(6)
        if op == 0 and pos < len(out):
            out[pos] ^= 1 << rng.randrange(8)
        elif op == 1 and pos < len(out):
            out[pos] = rng.choice(MARKERS)
        elif op == 2:
            out[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 3:
            del out[pos : pos + rng.randint(1, 8)]
        elif op == 4 and pos + 4 <= len(out):  # a plausible or hostile length field
            out[pos : pos + 4] = rng.choice([0, 1, len(out) - pos, 2**31, 2**32 - 1]).to_bytes(
                4, "big"
            )
        else:
            del out[pos:]
    return bytes(out)


def save_crash(data: bytes) -> Path:
    path = crash_dir() / f"crash-{zlib.crc32(data):08x}"
    path.write_bytes(data)
    return path


def run_hypothesis(seconds: float, first_seed: int | None, mutations: int = 50) -> int:
    deadline = time.monotonic() + seconds
    batch = 0
    examples = 0

    def one(data: bytes) -> None:
        nonlocal examples
        rng = random.Random(zlib.crc32(data) ^ (first_seed or 0))
        for candidate in [data, *(mutate(rng, data) for _ in range(mutations))]:
            examples += 1
            try:
                check(candidate)
            except Exception as exc:
                path = save_crash(candidate)
                raise InvariantBroken(f"{exc!r} on input {candidate!r} (saved to {path})") from exc

    while time.monotonic() < deadline:
        test: Any = settings(
            max_examples=50,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, Phase.generate],  # the failing input is a mutant: no shrinking
        )(given(INPUTS)(one))
        if first_seed is not None:
            test = seed(first_seed + batch)(test)
        try:
            test()
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            print(f"FAILED after {examples} inputs (batch {batch}): {exc!r}", file=sys.stderr)
            return 1
        batch += 1
    print(f"ok: {examples} inputs in {seconds:g} s, invariant held (hypothesis engine)")
    return 0


def seed_corpus(directory: Path, count: int = 200) -> None:
    """Valid encodings (bare and framed) of every registered message, for atheris to mutate."""
    samples: list[bytes] = []

    @settings(max_examples=count, database=None, suppress_health_check=list(HealthCheck))
    @given(encoded_messages())
    def collect(data: bytes) -> None:
        samples.append(data)

    collect()
    samples.append(encode_message_bytes(proto_sample_messages.Validated(1)))
    samples.append(b"".join(encode_message(proto_sample_messages.Leaf(1, b"x"))))
    for i, data in enumerate(samples):
        (directory / f"msg-{i}").write_bytes(data)
        (directory / f"frame-{i}").write_bytes(framed([data, data[: len(data) // 2]]))


def run_atheris(seconds: float, corpus: Path | None, extra: list[str]) -> int:
    import atheris

    atheris.instrument_all()
    with tempfile.TemporaryDirectory() as tmp:
        corpus_dir = corpus or Path(tmp)
        if corpus is None:
            seed_corpus(corpus_dir)
        args = libfuzzer_args(sys.argv[0], seconds, extra, corpus_dir)
        atheris.Setup(args, check)
        atheris.Fuzz()  # exits the process: 0 when time is up, non-zero on a crash
    return 0


def main() -> int:
    parser = arg_parser(__doc__.split("\n", 1)[0], "run the invariant on one saved input file")
    args, extra = parser.parse_known_args()
    np.seterr(all="ignore")
    import_all_message_modules()  # fuzz every message any swarmavg module registers
    if args.reproduce is not None:
        check(args.reproduce.read_bytes())
        print("ok: the invariant holds for this input")
        return 0
    if args.engine == "atheris":
        return run_atheris(args.seconds, args.corpus, extra)
    if extra:
        parser.error(f"unknown arguments: {extra}")
    return run_hypothesis(args.seconds, args.seed)


if __name__ == "__main__":
    sys.exit(main())
