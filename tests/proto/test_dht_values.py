"""How DHT keys and values are packed (sans-IO): tuples stay tuples, decoding is bounded."""

from __future__ import annotations

import collections
import contextlib
import enum
from typing import Any, NamedTuple

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmavg.errors import RemoteProtocolError
from swarmavg.proto.dht_values import (
    MAX_TUPLE_DEPTH,
    TUPLE_EXT_CODE,
    pack,
    unpack,
    unpack_subkey,
)

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
#: what can be a dict key or a subkey: scalars and tuples of them
_hashables = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=3).map(tuple), max_leaves=10
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(_hashables, inner, max_size=4)
    ),
    max_leaves=24,
)


def _same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (``1 == 1.0 == True``, but a tuple and a
    list with the same items differ only in type)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            _same(ka, kb) and _same(va, vb)
            for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
        )
    return bool(a == b)


def _ext(code: int, payload: bytes) -> bytes:
    """A msgpack extension object, however ``code`` (-128..127) and ``payload`` look (msgpack's
    ``ExtType`` takes codes 0..127 only)."""
    size = len(payload)
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
    if size in fixed:
        head = bytes([fixed[size]])
    elif size < 1 << 8:
        head = b"\xc7" + size.to_bytes(1, "big")
    elif size < 1 << 16:
        head = b"\xc8" + size.to_bytes(2, "big")
    else:
        head = b"\xc9" + size.to_bytes(4, "big")
    return head + code.to_bytes(1, "big", signed=True) + payload


def _nested_tuples(count: int) -> bytes:
    """``count`` tuples nested, ``((((),),),)``, as a hostile peer would encode them (past
    :data:`MAX_TUPLE_DEPTH`, our packer refuses to)."""
    data = b"\x90"  # the innermost tuple's items: an empty array
    for _ in range(count):
        data = b"\x91" + _ext(TUPLE_EXT_CODE, data)
    return data[1:]  # (the outermost: the extension itself, not an array around it)


@pytest.mark.slow
@given(_values)
def test_values_round_trip_with_tuples_and_lists_kept_apart(value: Any) -> None:
    assert _same(unpack(pack(value)), value)


@given(_hashables)
def test_subkeys_round_trip_and_stay_hashable(subkey: Any) -> None:
    back = unpack_subkey(pack(subkey, "subkey"))
    assert _same(back, subkey)
    assert hash(back) == hash(subkey)


def test_a_tuple_is_packed_as_hivemind_packs_it() -> None:
    # MSGPackSerializer: ExtType(0x40, packb(list(items))), nested tuples likewise
    assert pack(("a", 1)) == b"\xd6\x40\x92\xa1a\x01"
    assert pack([("a",)]) == b"\x91\xc7\x03\x40\x91\xa1a"
    assert pack(["a", 1]) == msgpack.packb(["a", 1])  # lists: plain arrays, as before
    assert pack("key") == msgpack.packb("key")  # (so keys that are not tuples kept their ids)


def test_subclasses_travel_as_their_base_type() -> None:
    class Color(enum.IntEnum):
        RED = 3

    class Point(NamedTuple):
        x: int
        y: tuple[int, ...]

    class Name(str):
        def __str__(self) -> str:
            return "something else"

    value = [Color.RED, Point(1, (2,)), collections.OrderedDict(a=1), Name("n"), bytearray(b"b")]
    assert _same(unpack(pack(value)), [3, (1, (2,)), {"a": 1}, "n", b"b"])


def test_what_cannot_be_packed_is_a_type_error_naming_the_argument() -> None:
    with pytest.raises(TypeError, match="DHT subkey"):
        pack(object(), "subkey")
    with pytest.raises(TypeError, match="DHT value"):
        pack({1, 2})
    with pytest.raises(TypeError, match="DHT value"):
        pack(2**64)
    deepest = _tuples(MAX_TUPLE_DEPTH)
    assert unpack(pack(deepest)) == deepest  # (the bound is the same both ways)
    with pytest.raises(TypeError, match="tuples nest more than"):
        pack((deepest,))
    with pytest.raises(TypeError, match="tuples nest more than"):
        pack([_tuples(10_000)])


def test_deeply_nested_input_is_refused_cleanly() -> None:
    assert unpack(_nested_tuples(MAX_TUPLE_DEPTH)) == _tuples(MAX_TUPLE_DEPTH)
    for depth in (MAX_TUPLE_DEPTH + 1, 10_000):
        with pytest.raises(RemoteProtocolError, match="more than"):
            unpack(_nested_tuples(depth))
    with pytest.raises(RemoteProtocolError):
        unpack(b"\x91" * 10_000 + b"\xc0")  # arrays 10,000 deep: msgpack's stack says no
    with pytest.raises(RemoteProtocolError):  # lists within tuples within lists...
        unpack(_ext(TUPLE_EXT_CODE, b"\x91" * 2_000 + b"\xc0"))


def _tuples(count: int) -> Any:
    """``count`` tuples nested: ``()``, ``((),)``, ..."""
    value: Any = ()
    for _ in range(count - 1):
        value = (value,)
    return value


@pytest.mark.parametrize(
    "data",
    [
        _ext(5, b"x"),  # an extension type nobody defined
        _ext(-2, b""),  # a reserved one
        b"\x92\x01" + _ext(0x50, b"\x90"),  # hivemind's DictionaryDHTValue: not a value
        _ext(TUPLE_EXT_CODE, b"\x01"),  # a tuple whose items are not an array
        _ext(TUPLE_EXT_CODE, b"\x90\x90"),  # ... or more than one
        _ext(TUPLE_EXT_CODE, b""),  # ... or nothing
        _ext(TUPLE_EXT_CODE, b"\x91\xc1"),  # ... or garbage
        b"\x81" + _ext(TUPLE_EXT_CODE, b"\x91\x90") + b"\x01",  # a map key (([],)) unhashable
        b"\x81\x90\x01",  # a map key that is a list
        b"\xd5\xff\x00\x01",  # a timestamp of the wrong length
        b"\xa1\xff",  # invalid UTF-8
        b"\xc0\xc0",  # trailing bytes
        b"\xdd\xff\xff\xff\xff",  # an array of 4G items in 5 bytes
        b"",
    ],
)
def test_garbage_is_refused_with_a_remote_protocol_error(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        unpack(data)


def test_a_subkey_must_decode_to_something_hashable() -> None:
    for unhashable in ([1], {"a": 1}, (1, [2])):
        with pytest.raises(RemoteProtocolError, match="unhashable"):
            unpack_subkey(pack(unhashable))
    assert unpack_subkey(pack(("alice", 1))) == ("alice", 1)


def test_msgpack_timestamps_decode_as_msgpack_does() -> None:
    stamp = msgpack.Timestamp(1_700_000_000, 5)
    assert unpack(pack(stamp)) == stamp


_WRAPS = ["bare", "in a list", "a map key", "a map value", "in a tuple"]


@settings(deadline=None)
@given(code=st.integers(-128, 127), payload=st.binary(max_size=40), wrap=st.sampled_from(_WRAPS))
def test_any_extension_payload_decodes_or_is_refused(code: int, payload: bytes, wrap: str) -> None:
    ext = _ext(code, payload)
    data = {
        "bare": ext,
        "in a list": b"\x92\x01" + ext,
        "a map key": b"\x81" + ext + b"\x01",
        "a map value": b"\x81\xa1k" + ext,
        "in a tuple": _ext(TUPLE_EXT_CODE, b"\x91" + ext),
    }[wrap]
    try:
        value = unpack(data)
    except RemoteProtocolError:
        return
    # only tuples (from array payloads) and msgpack's own timestamps get through
    assert code in (TUPLE_EXT_CODE, -1), (code, value)
    if code == TUPLE_EXT_CODE:
        assert isinstance(unpack(ext), tuple)
        assert ext == msgpack.packb(msgpack.ExtType(code, payload))  # (the helper is right)


@settings(deadline=None)
@given(value=_values, data=st.data())
def test_a_corrupted_value_decodes_or_is_refused(value: Any, data: st.DataObject) -> None:
    packed = bytearray(pack(value))
    for _ in range(data.draw(st.integers(1, 3))):
        packed[data.draw(st.integers(0, len(packed) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(packed)))
    for candidate in (bytes(packed), bytes(packed[:cut])):
        with contextlib.suppress(RemoteProtocolError):
            unpack(candidate)


@given(st.binary(max_size=200))
def test_random_bytes_decode_or_are_refused(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        unpack(data)
