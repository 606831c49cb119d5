"""Hypothesis strategies for wire messages, built from the dataclass annotations.

Deliberately independent of the codec's own schema compiler: the annotations are read again with
``typing`` here, so a bug in the compiler is not mirrored by the strategies. Shared by the tests
in this folder and by ``fuzz/fuzz_wire.py``.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import struct
import types
import typing
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import swarmavg
from swarmavg.identity import PeerID
from swarmavg.proto import (
    WIRE_DTYPES,
    Message,
    encode_message_bytes,
    registered_messages,
    wire_dtype_name,
)
from swarmavg.proto.codec import _resolve_alias

__all__ = [
    "any_array",
    "encoded_messages",
    "import_all_message_modules",
    "message_strategy",
    "messages",
    "mutated_encodings",
    "strategy_for",
    "wire_equal",
]

INT64_RANGE = st.integers(min_value=-(2**63), max_value=2**64 - 1)


def import_all_message_modules() -> None:
    """Import every swarmavg module so that every message class is registered.

    Modules whose optional dependencies are missing (ImportError) are skipped.
    """
    for info in pkgutil.walk_packages(swarmavg.__path__, prefix="swarmavg."):
        try:
            importlib.import_module(info.name)
        except ImportError:
            continue


def _layout(arr: np.ndarray[Any, Any], how: str) -> np.ndarray[Any, Any]:
    """The same values in another memory layout or byte order."""
    if how == "big-endian":
        return arr.astype(arr.dtype.newbyteorder(">"))
    if how == "fortran":
        return np.asfortranarray(arr)
    if how == "strided" and arr.ndim >= 1:
        doubled = np.repeat(arr, 2, axis=0)
        return doubled[::2]  # a non-contiguous view equal to arr
    return arr


def any_array(dtype_names: list[str] | None = None) -> st.SearchStrategy[np.ndarray[Any, Any]]:
    """Small arrays of every wire dtype (or of ``dtype_names``): 0-d, empty, and in several
    layouts (C, Fortran, strided views, big-endian)."""
    names = dtype_names or list(WIRE_DTYPES)
    return st.builds(
        _layout,
        hnp.arrays(
            dtype=st.sampled_from([WIRE_DTYPES[n] for n in names]),
            shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
        ),
        st.sampled_from(["c", "big-endian", "fortran", "strided"]),
    )


def strategy_for(tp: Any) -> st.SearchStrategy[Any]:
    """Values of annotation ``tp`` as the codec accepts them."""
    if tp is None or tp is type(None):
        return st.none()
    if tp is bool:
        return st.booleans()
    if tp is int:
        return INT64_RANGE
    if tp is float:
        return st.floats()
    if tp is str:
        return st.text(max_size=20)
    if tp is bytes:
        return st.binary(max_size=20)
    if tp is PeerID:
        return st.binary(min_size=32, max_size=32).map(PeerID.from_public_key)
    tp = _resolve_alias(tp)  # (NDArray is a PEP 695 alias on numpy >= 2.5)
    if tp is np.ndarray:
        return any_array()
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is np.ndarray:
        scalar = typing.get_args(args[1])[0]
        if scalar is Any or isinstance(scalar, typing.TypeVar):
            return any_array()
        name = next(n for n, dt in WIRE_DTYPES.items() if dt == np.dtype(scalar))
        return any_array([name])
    if origin is list:
        return st.lists(strategy_for(args[0]), max_size=4)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(strategy_for(args[0]), max_size=4).map(tuple)
        if args in ((), ((),)):
            return st.just(())
        return st.tuples(*(strategy_for(a) for a in args))
    if origin is dict:
        return st.dictionaries(strategy_for(args[0]), strategy_for(args[1]), max_size=4)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(strategy_for(a) for a in args))
    if isinstance(tp, type) and issubclass(tp, Message):
        return message_strategy(tp)
    raise TypeError(f"no strategy for {tp!r}")


def message_strategy(cls: type[Message]) -> st.SearchStrategy[Message]:
    """Instances of the message class ``cls`` with arbitrary valid field values."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(typing.cast(Any, cls))

    def build(args: tuple[Any, ...]) -> Message | None:
        try:
            return cls(*args)
        except (ValueError, TypeError):  # refused by the class's own __post_init__ checks
            return None

    return (
        st.tuples(*(strategy_for(hints[f.name]) for f in fields))
        .map(build)
        .filter(lambda m: m is not None)
    )


def messages() -> st.SearchStrategy[Message]:
    """Any registered message."""
    classes = sorted(registered_messages().values(), key=lambda c: c.TAG)
    return st.one_of(*(message_strategy(c) for c in classes))


def encoded_messages() -> st.SearchStrategy[bytes]:
    """Valid encodings of any registered message (as one ``bytes``)."""
    return messages().map(encode_message_bytes)


@st.composite
def mutated_encodings(draw: st.DrawFn) -> bytes:
    """Valid encodings with a few bytes flipped, set to msgpack markers, inserted or deleted."""
    data = bytearray(draw(encoded_messages()))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        pos = draw(st.integers(min_value=0, max_value=max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(min_value=0, max_value=7))
        elif op == "set" and data:
            data[pos] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0x90, 0xC0, 0xC1, 0xDC, 0xFF]))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(min_value=1, max_value=8))]
        else:
            del data[pos:]
    return bytes(data)


def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def wire_equal(a: object, b: object) -> bool:
    """Whether ``b`` is what the wire should give back for ``a``.

    Floats compare bit for bit (NaN equals itself, -0.0 differs from 0.0), ints given for float
    fields equal their float, arrays compare by wire dtype, shape and little-endian bytes.
    """
    if isinstance(a, np.ndarray):
        if not isinstance(b, np.ndarray) or a.shape != b.shape:
            return False
        wire = WIRE_DTYPES[wire_dtype_name(a.dtype)]
        return b.dtype == wire and np.ascontiguousarray(a, dtype=wire).tobytes() == b.tobytes()
    if isinstance(a, Message):
        return type(a) is type(b) and all(
            wire_equal(getattr(a, f.name), getattr(b, f.name))
            for f in dataclasses.fields(typing.cast(Any, a))
        )
    if type(a) is float or type(b) is float:
        return (
            type(b) is float
            and isinstance(a, int | float)
            and not isinstance(a, bool)
            and (_float_bits(float(a)) == _float_bits(b))
        )
    if isinstance(a, list | tuple):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(wire_equal(x, y) for x, y in zip(a, b, strict=False))
        )
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(wire_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b
