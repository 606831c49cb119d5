"""The message codec: round trips, arrays, validation and hostile input."""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
import struct
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from numpy.typing import NDArray
from proto_sample_messages import Everything, Leaf, Validated
from proto_strategies import (
    any_array,
    encoded_messages,
    import_all_message_modules,
    message_strategy,
    mutated_encodings,
    wire_equal,
)

import swarmavg.proto
from swarmavg.errors import LocalProtocolError, MessageTooLarge, RemoteProtocolError
from swarmavg.identity import Identity, PeerID
from swarmavg.proto import (
    ARRAY_ALIGNMENT,
    MAX_NESTING_DEPTH,
    PROTOCOL_VERSION,
    WIRE_DTYPES,
    ErrorMessage,
    Message,
    Ping,
    Pong,
    TensorChunk,
    decode_message,
    encode_message,
    encode_message_bytes,
    encoded_size,
    message,
    registered_messages,
)

import_all_message_modules()
ALL_MESSAGES = sorted(registered_messages().values(), key=lambda cls: cls.TAG)
PEER = Identity.from_private_bytes(bytes(range(32))).peer_id


def raw(header: Any, payload: bytes = b"", *, header_len: int | None = None) -> bytes:
    """A hand-made message: [u32 header length][msgpack header][payload]."""
    packed = msgpack.packb(header, use_bin_type=True)
    length = len(packed) if header_len is None else header_len
    return struct.pack(">I", length) + packed + payload


def hdr(tag: str, fields: list[Any], arrays: list[Any] | None = None, **extra: Any) -> Any:
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": tag, "f": fields}
    if arrays is not None:
        header["a"] = arrays
    header.update(extra)
    return header


def split(data: bytes) -> tuple[Any, bytes]:
    """A valid encoding as (decoded header, array payload starting at the first array)."""
    (length,) = struct.unpack_from(">I", data)
    header = msgpack.unpackb(data[4 : 4 + length])
    payload = data[4 + length :]
    if "a" in header:
        payload = payload[-(4 + length) % ARRAY_ALIGNMENT :]
    return header, payload


def join(header: Any, payload: bytes = b"") -> bytes:
    """The inverse of :func:`split`, with the padding recomputed for the new header."""
    packed = msgpack.packb(header, use_bin_type=True)
    head = struct.pack(">I", len(packed)) + packed
    if isinstance(header, dict) and "a" in header:
        head += bytes(-len(head) % ARRAY_ALIGNMENT)
    return head + payload


def sample(**changes: Any) -> Everything:
    """A fixed Everything message, with ``changes`` applied."""
    msg = Everything(
        none=None,
        flag=True,
        count=-5,
        ratio=0.25,
        text="text",
        blob=b"blob",
        peer=PEER,
        ints=[1, 2, 3],
        names=("a", "b"),
        pair=(1, "one"),
        empty=(),
        table={"x": [1.5, -0.0]},
        by_bytes={b"k": 1},
        maybe=None,
        either=[4, 5],
        leaf=Leaf(1, b"one"),
        leaves=[Leaf(None, b""), Leaf(2, b"two")],
        array=np.arange(3, dtype=np.int8),
        f32=np.ones(5, dtype=np.float32),
        arrays=[np.ones(1, dtype=np.float64), np.ones(3, dtype=np.complex128)],
        named_arrays={"x": np.ones(7, dtype=np.int16)},
        opt_array=np.ones(2, dtype=np.uint64),
        tail=8,
    )
    return dataclasses.replace(msg, **changes)


def round_trip(msg: Message) -> Message:
    data = encode_message_bytes(msg)
    decoded = decode_message(data)
    assert wire_equal(msg, decoded)
    assert encode_message_bytes(decoded) == data  # re-encoding is a fixed point
    return decoded


# ----------------------------------------------------------------------------- round trips


def test_registry_holds_the_core_and_sample_messages() -> None:
    tags = registered_messages()
    for cls in (Ping, Pong, ErrorMessage, TensorChunk, Everything, Leaf, Validated):
        assert tags[cls.TAG] is cls
    with pytest.raises(TypeError):
        tags["x"] = Ping  # type: ignore[index]
    assert round_trip(sample())


@pytest.mark.slow
@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda cls: cls.TAG)
@given(data=st.data())
def test_round_trip_every_registered_message(cls: type[Message], data: st.DataObject) -> None:
    msg = data.draw(message_strategy(cls))
    parts = encode_message(msg)
    joined = b"".join(parts)
    assert encoded_size(parts) == len(joined)
    for buffer in (joined, bytearray(joined), memoryview(joined)):
        decoded = decode_message(buffer)
        assert type(decoded) is cls
        assert wire_equal(msg, decoded)
    assert encode_message_bytes(decode_message(joined)) == joined


def test_core_messages() -> None:
    assert round_trip(Ping(-(2**63))) == Ping(-(2**63))
    assert round_trip(Pong(2**64 - 1)) == Pong(2**64 - 1)
    assert round_trip(ErrorMessage("internal", "ünïcode ✓")) == ErrorMessage(
        "internal", "ünïcode ✓"
    )
    chunk = round_trip(TensorChunk("layer.0.weight", 3, np.arange(6, dtype=np.float32)))
    assert isinstance(chunk, TensorChunk)
    assert chunk.name == "layer.0.weight"
    assert chunk.index == 3


def test_header_layout() -> None:
    data = encode_message_bytes(Ping(5))
    (length,) = struct.unpack_from(">I", data)
    assert len(data) == 4 + length
    assert msgpack.unpackb(data[4:]) == {"v": PROTOCOL_VERSION, "t": "ping", "f": [5]}


def test_missing_trailing_defaults_are_filled_in() -> None:
    header, payload = split(encode_message_bytes(sample()))
    header["f"].pop()  # drop `tail`, which has a default
    decoded = decode_message(join(header, payload))
    assert isinstance(decoded, Everything)
    assert wire_equal(sample(tail=7), decoded)


def test_float_fields_accept_ints_when_encoding() -> None:
    decoded = decode_message(encode_message_bytes(sample(ratio=3)))
    assert isinstance(decoded, Everything)
    assert decoded.ratio == 3.0
    assert type(decoded.ratio) is float


# ----------------------------------------------------------------------------- arrays

DTYPE_NAMES = list(WIRE_DTYPES)
SHAPES = [(), (0,), (5,), (2, 3), (3, 0, 2), (2, 1, 2, 1)]


def chunk_of(arr: NDArray[Any]) -> TensorChunk:
    return TensorChunk("t", 0, arr)


def decoded_array(data: bytes | bytearray) -> NDArray[Any]:
    msg = decode_message(data)
    assert isinstance(msg, TensorChunk)
    return msg.array


@pytest.mark.parametrize("name", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_dtype_and_shape(name: str, shape: tuple[int, ...]) -> None:
    dtype = WIRE_DTYPES[name]
    arr = (np.arange(int(np.prod(shape)), dtype=np.int64) % 7).astype(dtype).reshape(shape)
    back = decoded_array(encode_message_bytes(chunk_of(arr)))
    assert back.dtype == dtype
    assert back.shape == shape
    assert back.tobytes() == arr.tobytes()


@pytest.mark.parametrize("name", [n for n in DTYPE_NAMES if WIRE_DTYPES[n].itemsize > 1])
def test_big_endian_input_goes_little_endian_on_the_wire(name: str) -> None:
    little = np.arange(1, 7).astype(WIRE_DTYPES[name]).reshape(2, 3)
    big = little.astype(little.dtype.newbyteorder(">"))
    parts = encode_message(chunk_of(big))
    assert b"".join(parts[1:]) == little.tobytes()
    back = decoded_array(b"".join(parts))
    assert back.dtype.byteorder in "<|="
    assert np.array_equal(back, little)


@given(arr=any_array())
def test_any_array_any_layout(arr: NDArray[Any]) -> None:
    back = decoded_array(encode_message_bytes(chunk_of(arr)))
    assert wire_equal(arr, back)


def test_non_contiguous_input() -> None:
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    for arr in (base[:, ::2], base.T, base[::-1], np.broadcast_to(base[0], (3, 6))):
        assert not arr.flags.c_contiguous
        assert np.array_equal(decoded_array(encode_message_bytes(chunk_of(arr))), arr)


def test_encoding_is_zero_copy_for_contiguous_arrays() -> None:
    arr = np.arange(1000, dtype=np.float32)
    parts = encode_message(chunk_of(arr))
    assert len(parts) == 2
    view = parts[1]
    assert isinstance(view, memoryview)
    assert np.shares_memory(np.frombuffer(view, dtype=np.uint8), arr)


def test_decoding_is_zero_copy_and_follows_the_buffer() -> None:
    arr = np.arange(16, dtype=np.int32)
    data = encode_message_bytes(chunk_of(arr))

    readonly = decoded_array(data)
    assert not readonly.flags.writeable

    buffer = bytearray(data)
    writable = decoded_array(buffer)
    assert writable.flags.writeable
    buffer[-4:] = (1234).to_bytes(4, "little")
    assert writable[-1] == 1234  # a view of the received bytes, not a copy


def test_arrays_are_aligned() -> None:
    data = bytearray(encode_message_bytes(sample()))  # bytearray storage is 8-byte aligned
    decoded = decode_message(data)
    assert isinstance(decoded, Everything)
    arrays = [decoded.array, decoded.f32, *decoded.arrays, *decoded.named_arrays.values()]
    for arr in [*arrays, decoded.opt_array]:
        assert arr is not None
        assert arr.flags.aligned


@pytest.mark.parametrize(
    "arr",
    [
        np.array(["a", "b"]),
        np.array([b"a"]),
        np.array([object()], dtype=object),
        np.array(["2020-01-01"], dtype="datetime64[D]"),
        np.zeros(2, dtype=[("a", "<i4"), ("b", "<f4")]),
        np.zeros(2, dtype=np.longdouble) if np.dtype(np.longdouble).itemsize > 8 else None,
        np.ma.masked_array([1, 2], mask=[0, 1]),
    ],
    ids=["unicode", "bytes", "object", "datetime", "record", "longdouble", "masked"],
)
def test_unsupported_arrays_are_refused_locally(arr: NDArray[Any] | None) -> None:
    if arr is None:
        pytest.skip("long double is float64 here")
    with pytest.raises(LocalProtocolError):
        encode_message(chunk_of(arr))


def test_typed_array_field_checks_dtype() -> None:
    with pytest.raises(LocalProtocolError, match="f32"):
        encode_message(sample(f32=np.zeros(2, dtype=np.float64)))
    header, payload = split(encode_message_bytes(sample()))
    index = header["f"][18]
    assert header["a"][index] == ["float32", [5], 20]
    header["a"][index] = ["int32", [5], 20]  # same size, wrong dtype
    with pytest.raises(RemoteProtocolError, match="float32"):
        decode_message(join(header, payload))


def test_subclass_of_ndarray_is_sent_as_plain_array() -> None:
    class Sub(np.ndarray):  # type: ignore[type-arg]
        pass

    arr = np.arange(4, dtype=np.int16).view(Sub)
    back = decoded_array(encode_message_bytes(chunk_of(arr)))
    assert type(back) is np.ndarray
    assert np.array_equal(back, np.arange(4))


# ----------------------------------------------------------------------------- local errors


@pytest.mark.parametrize(
    "msg",
    [
        Ping("1"),  # type: ignore[arg-type]
        Ping(True),
        Ping(1.0),  # type: ignore[arg-type]
        Ping(2**64),
        Ping(-(2**63) - 1),
        ErrorMessage("code", b"bytes"),  # type: ignore[arg-type]
        ErrorMessage("code", "\ud800"),  # a lone surrogate cannot be UTF-8
        TensorChunk("t", 0, [1.0, 2.0]),  # type: ignore[arg-type]
        Leaf(1, bytearray(b"x")),  # type: ignore[arg-type]
        Leaf("1", b""),  # type: ignore[arg-type]
    ],
    ids=repr,
)
def test_wrong_field_values_are_refused_locally(msg: Message) -> None:
    with pytest.raises(LocalProtocolError):
        encode_message(msg)


def test_local_error_names_the_field() -> None:
    with pytest.raises(LocalProtocolError, match=r"Ping\.nonce"):
        encode_message(Ping("x"))  # type: ignore[arg-type]


def test_unregistered_message_is_a_type_error() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class Loose(Message):
        x: int

    with pytest.raises(TypeError):
        encode_message(Loose(1))
    with pytest.raises(TypeError):
        encode_message("ping")  # type: ignore[arg-type]


def test_encoding_past_the_cap_raises_message_too_large() -> None:
    chunk = chunk_of(np.zeros(1000, dtype=np.float32))
    assert len(encode_message_bytes(chunk)) > 4000
    with pytest.raises(MessageTooLarge):
        encode_message(chunk, max_size=4000)
    with pytest.raises(MessageTooLarge):
        encode_message(ErrorMessage("x", "y" * 100), max_size=50)
    with pytest.raises(MessageTooLarge):
        encode_message(ErrorMessage("x", "y" * 100), max_header_size=50)
    assert issubclass(MessageTooLarge, LocalProtocolError)


# ----------------------------------------------------------------------------- registration


def test_registration_rules() -> None:
    with pytest.raises(TypeError):

        @message("test.reg.plain")
        class NotDataclass(Message):
            pass

    with pytest.raises(TypeError):

        @message("test.reg.mutable")
        @dataclasses.dataclass(slots=True)
        class Mutable(Message):
            x: int

    with pytest.raises(TypeError):

        @message("test.reg.noslots")
        @dataclasses.dataclass(frozen=True)
        class NoSlots(Message):
            x: int

    with pytest.raises(TypeError):

        @message("test.reg.notmessage")  # type: ignore[type-var]
        @dataclasses.dataclass(frozen=True, slots=True)
        class NotMessage:
            x: int

    with pytest.raises(ValueError, match="already"):

        @message("ping")
        @dataclasses.dataclass(frozen=True, slots=True)
        class Duplicate(Message):
            x: int

    for bad_tag in ("", "x" * 65, "tab\t", "ünï"):
        with pytest.raises(ValueError):
            message(bad_tag)
    with pytest.raises(TypeError):
        message(1)  # type: ignore[arg-type]
    assert "test.reg.mutable" not in registered_messages()


@pytest.mark.parametrize(
    "annotation",
    [
        Any,
        object,
        set[int],
        list,
        dict[int, int],
        dict[str, Any],
        int | bool | float | str | bytes | PeerID,  # bytes and PeerID are both msgpack bin
        NDArray[np.object_],
        functools.reduce(lambda tp, _: list[tp], range(MAX_NESTING_DEPTH), int),  # too deep
    ],
    ids=str,
)
def test_unsupported_field_types(annotation: Any) -> None:
    namespace: dict[str, Any] = {"__annotations__": {"x": annotation}, "__module__": __name__}
    cls = dataclasses.dataclass(frozen=True, slots=True)(type("Bad", (Message,), namespace))
    with pytest.raises(TypeError):
        message(f"test.unsupported.{annotation}"[:64])(cls)


def test_array_fields_annotated_through_a_type_alias() -> None:
    """numpy >= 2.5 on Python >= 3.12 defines ``NDArray`` as a PEP 695 alias (``type NDArray[T]
    = ndarray[...]``): ``NDArray[Any]`` then has the alias, not ``np.ndarray``, as its origin,
    and every message with an array field failed to register (``import swarmavg`` failed).
    Here the alias is made as numpy makes it (``typing_extensions`` makes one on 3.11 too)."""
    from typing_extensions import TypeAliasType

    scalar = TypeVar("scalar", bound=np.generic)
    alias = TypeAliasType(  # type: ignore[misc]
        "NDArrayAlias", np.ndarray[tuple[Any, ...], np.dtype[scalar]], type_params=(scalar,)
    )
    annotations = {
        "any": alias[Any],
        "floats": alias[np.float32],
        "bare": alias,
        "many": list[alias[np.int16]],
        "maybe": alias[np.float64] | None,
    }
    namespace: dict[str, Any] = {"__annotations__": annotations, "__module__": __name__}
    cls = message("test.alias.arrays")(
        dataclasses.dataclass(frozen=True, slots=True)(type("Aliased", (Message,), namespace))
    )
    sent = cls(
        np.arange(3, dtype=np.uint8),
        np.ones(4, np.float32),
        np.zeros(2),
        [np.arange(5, dtype=np.int16)],
        None,
    )
    got = decode_message(b"".join(bytes(b) for b in encode_message(sent)))
    assert type(got) is cls
    assert wire_equal(got, sent)
    with pytest.raises(LocalProtocolError):  # the declared dtype is still enforced
        encode_message(cls(np.zeros(1), np.zeros(1), np.zeros(1), [], None))


def test_kw_only_fields_are_refused() -> None:
    with pytest.raises(TypeError):

        @message("test.reg.kwonly")
        @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
        class KwOnly(Message):
            x: int


# ----------------------------------------------------------------------------- remote errors


def test_unknown_version() -> None:
    with pytest.raises(RemoteProtocolError, match=r"version 2\b"):
        decode_message(raw({"v": 2, "t": "ping", "f": [1]}))
    for version in (None, "1", True, 1.0, [1]):
        with pytest.raises(RemoteProtocolError, match="version"):
            decode_message(raw({"v": version, "t": "ping", "f": [1]}))


def test_unknown_tag() -> None:
    with pytest.raises(RemoteProtocolError, match=r"'no\.such\.message'"):
        decode_message(raw(hdr("no.such.message", [])))
    with pytest.raises(RemoteProtocolError, match="unknown message type"):
        decode_message(raw({"v": 1, "t": b"ping", "f": [1]}))
    long_tag = "x" * 10_000
    with pytest.raises(RemoteProtocolError) as info:
        decode_message(raw(hdr(long_tag, [])))
    assert len(str(info.value)) < 200  # hostile values are not echoed whole


@pytest.mark.parametrize(
    "header",
    [
        [1, "ping", [1]],
        "ping",
        None,
        {"v": 1, "t": "ping"},
        {"v": 1, "t": "ping", "f": {"nonce": 1}},
        {"v": 1, "t": "ping", "f": [1], "x": 0},
        {"v": 1, "t": "ping", "f": []},
        {"v": 1, "t": "ping", "f": [1, 2]},
        {"v": 1, "t": "ping", "f": [1], "a": "nope"},
        {"v": 1, "t": "ping", "f": [1], "a": [["float32", [1], 4]]},  # unreferenced array
    ],
    ids=repr,
)
def test_bad_header_structure(header: Any) -> None:
    payload = bytes(8) if isinstance(header, dict) and "a" in header else b""
    with pytest.raises(RemoteProtocolError):
        decode_message(raw(header, payload))


@pytest.mark.parametrize(
    ("tag", "fields"),
    [
        ("ping", ["1"]),
        ("ping", [True]),
        ("ping", [1.0]),
        ("ping", [None]),
        ("ping", [[1]]),
        ("error", ["code", b"bytes"]),
        ("error", [1, "message"]),
        ("test.leaf", ["1", b""]),
        ("test.leaf", [None, "text"]),
        ("test.validated", [-1]),  # refused by __post_init__
        ("tensor_chunk", ["t", 0, "not an index"]),
        ("tensor_chunk", ["t", 0, 0]),  # index into a missing array list
    ],
    ids=repr,
)
def test_field_type_mismatch(tag: str, fields: list[Any]) -> None:
    with pytest.raises(RemoteProtocolError, match=re.escape(repr(tag))):
        decode_message(raw(hdr(tag, fields)))


def test_invalid_peer_id() -> None:
    data = encode_message_bytes(sample())
    evil = data.replace(PEER.to_bytes(), b"\x01" + PEER.to_bytes()[1:])
    with pytest.raises(RemoteProtocolError, match="PeerID"):
        decode_message(evil)


def test_decoded_peer_ids_are_shared_and_still_checked() -> None:
    """A PeerID decoded twice is the same (immutable) object; a bad one is still refused."""
    data = encode_message_bytes(sample())
    first, second = decode_message(data), decode_message(data)
    peers = [getattr(m, f.name) for m in (first, second) for f in dataclasses.fields(m)]
    found = [p for p in peers if isinstance(p, PeerID)]
    assert len(found) == 2
    assert found[0] == PEER
    assert found[0] is found[1]
    evil = data.replace(PEER.to_bytes(), b"\x01" + PEER.to_bytes()[1:])
    for _ in range(2):
        with pytest.raises(RemoteProtocolError, match="PeerID"):
            decode_message(evil)


def test_invalid_utf8_and_duplicate_keys() -> None:
    header = msgpack.packb(hdr("error", ["code", "MARK"]))
    bad_utf8 = header.replace(b"MARK", b"\xff\xfe\xfd\xfc")
    with pytest.raises(RemoteProtocolError):
        decode_message(struct.pack(">I", len(bad_utf8)) + bad_utf8)
    # {"v": 1, "v": 1, "t": "ping", "f": [1]}
    dup = b"\x84\xa1v\x01\xa1v\x01\xa1t\xa4ping\xa1f\x91\x01"
    with pytest.raises(RemoteProtocolError, match="duplicate"):
        decode_message(struct.pack(">I", len(dup)) + dup)


@pytest.mark.parametrize("depth", [MAX_NESTING_DEPTH + 1, 1000, 1024, 1025, 100_000])
def test_deep_nesting(depth: int) -> None:
    nested = b"\x91" * depth + b"\x01"  # [[[...[1]...]]] built without recursion
    for tag, field in (("ping", nested), ("test.everything", nested)):
        prefix = msgpack.packb({"v": 1, "t": tag})[1:]  # strip the 2-key map marker
        header = b"\x83" + prefix + b"\xa1f\x91" + field
        with pytest.raises(RemoteProtocolError):
            decode_message(struct.pack(">I", len(header)) + header)


def test_nested_lists_deeper_than_the_schema() -> None:
    header, payload = split(encode_message_bytes(sample()))
    header["f"][7] = [[1]]  # ints: list[int]
    with pytest.raises(RemoteProtocolError, match="'ints'"):
        decode_message(join(header, payload))


def array_message(desc: Any, payload: bytes) -> bytes:
    return join(hdr("tensor_chunk", ["t", 0, 0], [desc]), payload)


def test_array_message_helper_is_valid() -> None:
    arr = decoded_array(array_message(["int32", [2], 8], b"\1\0\0\0\2\0\0\0"))
    assert arr.tolist() == [1, 2]


@pytest.mark.parametrize(
    ("desc", "payload"),
    [
        (["object", [1], 8], bytes(8)),
        (["<f4", [2], 8], bytes(8)),
        (["O", [1], 8], bytes(8)),
        ([b"float32", [2], 8], bytes(8)),
        (["float32", [2], 8, 0], bytes(8)),
        (["float32", [2]], bytes(8)),
        ("float32", bytes(8)),
        (["float32", [-2], -8], b""),
        (["float32", [True, 2], 8], bytes(8)),
        (["float32", 2, 8], bytes(8)),
        (["float32", [2], 7], bytes(8)),
        (["float32", [2], 8.0], bytes(8)),
        (["float32", [3], 12], bytes(8)),  # truncated
        (["float32", [2], 8], bytes(9)),  # trailing byte
        (["float32", [2**62, 2**62], 0], b""),  # product overflows int64
        (["float32", [0, 2**62, 2**62], 0], b""),  # empty, but numpy cannot shape it
        (["float32", [0, 2**63], 0], b""),
        (["float32", [1] * 33, 4], bytes(4)),  # too many dimensions
        (["uint8", [2**32, 2**31], 2**63], b""),  # consistent, but far beyond the data
    ],
    ids=repr,
)
def test_bad_array_descriptors(desc: Any, payload: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_message(array_message(desc, payload))


def test_nonzero_padding_is_refused() -> None:
    data = bytearray(array_message(["int8", [1], 1], b"\x05"))
    assert (len(data) - 1) % ARRAY_ALIGNMENT == 0
    decode_message(bytes(data))
    (length,) = struct.unpack_from(">I", data)
    if len(data) - 1 > 4 + length:  # there is padding
        data[4 + length] = 1
        with pytest.raises(RemoteProtocolError, match="padding"):
            decode_message(bytes(data))


def test_array_references_must_be_one_to_one() -> None:
    arrays = [["int8", [1], 1], ["int8", [1], 1]]
    unreferenced = join(hdr("test.leaf", [None, b""], arrays), b"\x01" + bytes(7) + b"\x02")
    with pytest.raises(RemoteProtocolError, match="no field"):
        decode_message(unreferenced)

    header, payload = split(encode_message_bytes(sample(opt_array=None)))
    decode_message(join(header, payload))
    first, _ = header["f"][19]  # arrays: list[NDArray]
    for refs in ([first, first], [first, 99], [first, -1], [first, True], [first, None]):
        header["f"][19] = refs
        with pytest.raises(RemoteProtocolError):
            decode_message(join(header, payload))


def test_size_limits() -> None:
    data = encode_message_bytes(ErrorMessage("code", "x" * 1000))
    decode_message(data, max_size=len(data))
    with pytest.raises(RemoteProtocolError):
        decode_message(data, max_size=len(data) - 1)
    with pytest.raises(RemoteProtocolError):
        decode_message(data, max_header_size=100)
    for short in (b"", b"\0", b"\0\0\0"):
        with pytest.raises(RemoteProtocolError):
            decode_message(short)
    with pytest.raises(RemoteProtocolError):
        decode_message(b"\xff\xff\xff\xff" + data[4:])  # header longer than the message
    with pytest.raises(RemoteProtocolError):
        decode_message(b"\0\0\0\0")  # an empty header is not msgpack


def test_every_truncation_is_refused() -> None:
    data = encode_message_bytes(sample())
    for cut in range(len(data)):
        with pytest.raises(RemoteProtocolError):
            decode_message(data[:cut])


def test_non_buffer_input_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        decode_message("text")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        decode_message(memoryview(encode_message_bytes(Ping(1)) * 2)[::2])


# ----------------------------------------------------------------------------- garbage


def decodes_or_refuses(data: bytes) -> Message | None:
    """The invariant: a message or RemoteProtocolError, nothing else."""
    try:
        msg = decode_message(data)
    except RemoteProtocolError:
        return None
    encode_message(msg)  # whatever the decoder accepts, the encoder accepts back
    return msg


@given(st.binary(max_size=300))
@example(b"\0\0\0\x01\xc1")  # never-used msgpack byte
@example(b"\0\0\0\x03\xc7\x00\x05")  # empty ext
@example(b"\0\0\0\x06\xd6\xff\0\0\0\x01")  # timestamp ext
def test_random_bytes(data: bytes) -> None:
    decodes_or_refuses(data)


@given(st.binary(max_size=300))
def test_random_bytes_behind_a_valid_prefix(data: bytes) -> None:
    decodes_or_refuses(struct.pack(">I", len(data)) + data)
    decodes_or_refuses(b"\0\0\0\x10\x84\xa1v\x01\xa1t\xa4ping\xa1f" + data)


@pytest.mark.slow
@given(mutated_encodings())
def test_mutated_valid_encodings(data: bytes) -> None:
    decodes_or_refuses(data)


@given(data=encoded_messages(), cut=st.integers(min_value=0))
def test_truncated_valid_encodings(data: bytes, cut: int) -> None:
    cut %= len(data)
    with pytest.raises(RemoteProtocolError):
        decode_message(data[:cut])


# ----------------------------------------------------------------------------- hygiene


def test_public_api() -> None:
    exported = swarmavg.proto.__all__
    assert sorted(exported) == sorted(set(exported))
    for name in exported:
        assert hasattr(swarmavg.proto, name), name


FORBIDDEN_MODULES = {"anyio", "socket", "time", "torch", "pickle", "marshal", "asyncio", "shelve"}


@pytest.mark.parametrize(
    "path", sorted(Path(swarmavg.proto.__file__).parent.glob("*.py")), ids=lambda p: p.name
)
def test_proto_stays_sans_io(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in {"eval", "exec", "compile", "__import__"}, path
            continue
        else:
            continue
        for name in names:
            assert name.split(".")[0] not in FORBIDDEN_MODULES, (path, name)


def test_a_bad_field_is_named_even_after_arrays_were_taken() -> None:
    """Decoding reports the bad field by name; the arrays taken before it (decoding goes on
    until a field fails, then names it in a second pass) do not make an array field look bad."""
    good = encode_message_bytes(sample())
    (size,) = struct.unpack_from(">I", good)
    header = msgpack.unpackb(good[4 : 4 + size])
    header["f"][-1] = "not an int"  # ``tail``, after every array field
    packed = msgpack.packb(header)
    arrays = good[4 + size + (-(4 + size) % ARRAY_ALIGNMENT) :]  # (after the old padding)
    padding = bytes(-(4 + len(packed)) % ARRAY_ALIGNMENT)
    data = struct.pack(">I", len(packed)) + packed + padding + arrays
    with pytest.raises(RemoteProtocolError, match="field 'tail'"):
        decode_message(data)
