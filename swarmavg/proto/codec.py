"""The message codec: typed, versioned msgpack headers plus raw array buffers (sans-IO).

Layout of one encoded message (the body of one frame, see :mod:`swarmavg.proto.wire`)::

    +--------------+------------------+-----+---------+-----+---------+
    | hlen (u32be) | header (msgpack) | pad | array 0 | pad | array 1 | ...
    +--------------+------------------+-----+---------+-----+---------+

    header = {"v": PROTOCOL_VERSION, "t": tag, "f": [field values...],
              "a": [[dtype, shape, nbytes], ...]}          # "a" only when there are arrays

* ``"f"`` holds the dataclass fields in declaration order. Trailing fields that have a default
  may be left out by the sender (so a field can be added without a version bump); extra ones
  are an error.
* A field annotated as a numpy array holds an index into ``"a"``; every descriptor is used
  exactly once. ``dtype`` is a name from :data:`WIRE_DTYPES` (always little-endian on the
  wire), ``shape`` a list of non-negative ints and ``nbytes`` its exact size.
* Each array starts at the next offset (from the start of the message) that is a multiple of
  :data:`ARRAY_ALIGNMENT`; the padding is zero bytes. The last array ends the message: the
  layout leaves no byte unaccounted for, so any truncation or trailing garbage is detected.
* Other field types map to msgpack natively: ``None``, ``bool``, ``int`` (64-bit),
  ``float`` (float64), ``str``, ``bytes``, ``list[T]``, ``tuple[T, ...]``, ``tuple[A, B]``,
  ``dict[str | bytes, V]`` (other key types are refused: their hashes are not randomised, so a
  peer could send colliding keys), ``A | B`` (members must differ in wire type),
  :class:`~swarmavg.identity.PeerID` (its 38 bytes) and nested registered messages (a list of
  their fields).

Decoding is bounded and total: every size is checked before it is used, msgpack runs with
explicit length limits (and its own hard stack limit: 1,024 levels), and the decoded value is
validated against a schema compiled once per message class, whose depth is bounded at
registration. The schema, not the input, drives every recursion, so garbage can neither recurse
deeply nor reach a handler with a field of the wrong type. Any bad input raises
:class:`~swarmavg.errors.RemoteProtocolError`, nothing else.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Final, TypeVar

import msgpack
import numpy as np
from numpy.typing import NDArray

from swarmavg.errors import LocalProtocolError, MessageTooLarge, RemoteProtocolError
from swarmavg.identity import PeerID
from swarmavg.proto.wire import DEFAULT_MAX_FRAME_SIZE, Buffer, buffers_size

__all__ = [
    "ARRAY_ALIGNMENT",
    "DEFAULT_MAX_HEADER_SIZE",
    "DEFAULT_MAX_MESSAGE_SIZE",
    "MAX_NDIM",
    "MAX_NESTING_DEPTH",
    "PROTOCOL_VERSION",
    "WIRE_DTYPES",
    "Message",
    "decode_message",
    "encode_message",
    "encode_message_bytes",
    "encoded_size",
    "message",
    "registered_messages",
    "wire_dtype_name",
]

#: The version every header carries in ``"v"``; a peer speaking another one is refused.
PROTOCOL_VERSION: Final = 1
#: Default cap on a whole encoded message, in bytes (the default frame cap: 64 MiB).
DEFAULT_MAX_MESSAGE_SIZE: Final = DEFAULT_MAX_FRAME_SIZE
#: Default cap on the msgpack header, in bytes (1 MiB). Decoding a header creates Python
#: objects (up to ~64 bytes each per header byte), so it is kept far smaller than the message:
#: bulk data belongs in arrays, which are never copied.
DEFAULT_MAX_HEADER_SIZE: Final = 1024 * 1024
#: Arrays start at offsets (from the message start) that are multiples of this.
ARRAY_ALIGNMENT: Final = 8
#: The most dimensions an array may have.
MAX_NDIM: Final = 32
#: The deepest a message schema may nest (each list, tuple, dict or nested message is a level).
MAX_NESTING_DEPTH: Final = 16

#: The array dtypes the wire carries, by wire name. All are little-endian.
WIRE_DTYPES: Final[Mapping[str, np.dtype[Any]]] = types.MappingProxyType(
    {
        "bool": np.dtype("?"),
        "int8": np.dtype("i1"),
        "int16": np.dtype("<i2"),
        "int32": np.dtype("<i4"),
        "int64": np.dtype("<i8"),
        "uint8": np.dtype("u1"),
        "uint16": np.dtype("<u2"),
        "uint32": np.dtype("<u4"),
        "uint64": np.dtype("<u8"),
        "float16": np.dtype("<f2"),
        "float32": np.dtype("<f4"),
        "float64": np.dtype("<f8"),
        "complex64": np.dtype("<c8"),
        "complex128": np.dtype("<c16"),
    }
)
_DTYPE_BY_KIND: Final = {(dt.kind, dt.itemsize): name for name, dt in WIRE_DTYPES.items()}

_U32: Final = struct.Struct(">I")
_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**64 - 1  # msgpack carries int64 and uint64
_MAX_TAG_LEN: Final = 64
_HEADER_KEYS: Final = frozenset({"v", "t", "f", "a"})
_BRIEF_LEN: Final = 40


class Message:
    """Base class of every wire message.

    Subclasses are frozen, slotted dataclasses registered with :func:`message`, which sets
    :attr:`TAG`. Instances are validated when encoded; decoded instances have been validated
    against the field annotations, so handlers can trust every field's type.
    """

    __slots__ = ()

    #: The type tag this class is registered under (set by :func:`message`).
    TAG: ClassVar[str]


_M = TypeVar("_M", bound=Message)


def wire_dtype_name(dtype: np.dtype[Any] | type[Any] | str) -> str:
    """The wire name (a key of :data:`WIRE_DTYPES`) of a numpy dtype, whatever its byte order.

    :raises LocalProtocolError: if the wire cannot carry this dtype (object, strings, records,
        datetimes, long double...).
    :raises TypeError: if ``dtype`` is not understood by numpy.
    """
    dt = np.dtype(dtype)
    name = _DTYPE_BY_KIND.get((dt.kind, dt.itemsize)) if dt.fields is None else None
    if name is None:
        raise LocalProtocolError(f"dtype {dt} cannot be sent; supported: {', '.join(WIRE_DTYPES)}")
    return name


# --------------------------------------------------------------------------------------------
# Field specs: compiled once per message class from its annotations.
#
# A spec is an encoder (Python value -> msgpack-ready value, collecting arrays), a decoder
# (msgpack value -> validated Python value, taking arrays) and the msgpack "kind" its encoding
# has, which lets a union pick its member from the wire type alone.
# --------------------------------------------------------------------------------------------

_Encoder = Callable[[Any, list[NDArray[Any]]], Any]
_Decoder = Callable[[Any, "_ArrayPool"], Any]

# msgpack-decoded Python type -> wire kind
_KIND_OF_TYPE: Final[Mapping[type, str]] = {
    type(None): "nil",
    bool: "bool",
    int: "int",
    float: "float",
    str: "str",
    bytes: "bin",
    list: "array",
    dict: "map",
}


@dataclasses.dataclass(frozen=True, slots=True)
class _Spec:
    name: str  # for error messages: "list[int]"
    kind: str  # wire kind of the encoding, "union" for unions
    encode: _Encoder
    decode: _Decoder
    depth: int  # container levels (0 for scalars)
    leaf_type: type | None = None  # decoded value is the msgpack value itself, of this type


class _ArrayPool:
    """The arrays of the message being decoded; each must be taken exactly once."""

    __slots__ = ("arrays", "taken")

    def __init__(self, arrays: list[NDArray[Any]]) -> None:
        self.arrays = arrays
        self.taken = [False] * len(arrays)

    def take(self, index: int) -> NDArray[Any]:
        if not 0 <= index < len(self.arrays):
            raise RemoteProtocolError(f"array index {index} out of range")
        if self.taken[index]:
            raise RemoteProtocolError(f"array {index} is referenced twice")
        self.taken[index] = True
        return self.arrays[index]


def _brief(value: object) -> str:
    """A short, bounded description of a (possibly hostile) value for error messages."""
    if isinstance(value, str | bytes):
        text = repr(value[:_BRIEF_LEN])
        return text + "..." if len(value) > _BRIEF_LEN else text
    if value is None or type(value) in (bool, int, float):
        return repr(value)
    return f"a {type(value).__name__}"


def _local_type_error(expected: str, value: object) -> LocalProtocolError:
    return LocalProtocolError(f"expected {expected}, got {type(value).__name__}")


def _remote_type_error(expected: str, value: object) -> RemoteProtocolError:
    got = _KIND_OF_TYPE.get(type(value), type(value).__name__)
    return RemoteProtocolError(f"expected {expected}, got msgpack {got}")


def _leaf_spec(pytype: type, kind: str) -> _Spec:
    name = "None" if pytype is type(None) else pytype.__name__

    def encode(value: Any, arrays: list[NDArray[Any]]) -> Any:
        if type(value) is not pytype:
            raise _local_type_error(name, value)
        return value

    def decode(value: Any, pool: _ArrayPool) -> Any:
        if type(value) is not pytype:
            raise _remote_type_error(name, value)
        return value

    return _Spec(name, kind, encode, decode, 0, pytype)


def _int_spec() -> _Spec:
    def encode(value: Any, arrays: list[NDArray[Any]]) -> Any:
        if type(value) is not int:
            raise _local_type_error("int", value)
        if not _INT_MIN <= value <= _INT_MAX:
            raise LocalProtocolError(f"int {value} does not fit in 64 bits")
        return value

    def decode(value: Any, pool: _ArrayPool) -> Any:
        if type(value) is not int:  # msgpack only produces ints within 64 bits
            raise _remote_type_error("int", value)
        return value

    return _Spec("int", "int", encode, decode, 0, int)


def _float_spec() -> _Spec:
    def encode(value: Any, arrays: list[NDArray[Any]]) -> Any:
        if type(value) is float:
            return value
        if type(value) is int:  # PEP 484: an int is acceptable where a float is expected
            try:
                return float(value)
            except OverflowError as exc:
                raise LocalProtocolError(f"int {value} does not fit in a float") from exc
        raise _local_type_error("float", value)

    def decode(value: Any, pool: _ArrayPool) -> Any:
        if type(value) is not float:
            raise _remote_type_error("float", value)
        return value

    return _Spec("float", "float", encode, decode, 0, float)


def _peer_id_spec() -> _Spec:
    def encode(value: Any, arrays: list[NDArray[Any]]) -> Any:
        if type(value) is not PeerID:
            raise _local_type_error("PeerID", value)
        return value.to_bytes()

    def decode(value: Any, pool: _ArrayPool) -> Any:
        if type(value) is not bytes:
            raise _remote_type_error("PeerID", value)
        peer = _DECODED_PEER_IDS.get(value)
        if peer is None:
            try:
                peer = PeerID(value)
            except ValueError as exc:
                raise RemoteProtocolError(f"invalid PeerID: {exc}") from exc
            if len(_DECODED_PEER_IDS) >= _MAX_DECODED_PEER_IDS:
                _DECODED_PEER_IDS.clear()
            _DECODED_PEER_IDS[value] = peer
        return peer

    return _Spec("PeerID", "bin", encode, decode, 0)


#: PeerIDs decoded lately, by their bytes: messages name the same peers over and over, and the
#: same (immutable) object each time makes every dict lookup by it an identity match.
_DECODED_PEER_IDS: dict[bytes, PeerID] = {}
_MAX_DECODED_PEER_IDS: Final = 4096


def _prepare_array(value: Any, dtype_name: str | None) -> NDArray[Any]:
    """``value`` as a C-contiguous, little-endian, plain ndarray (copied only if needed)."""
    if not isinstance(value, np.ndarray):
        raise _local_type_error("numpy.ndarray", value)
    if isinstance(value, np.ma.MaskedArray):
        raise LocalProtocolError("masked arrays cannot be sent (the mask would be lost)")
    arr: NDArray[Any] = value if type(value) is np.ndarray else value.view(np.ndarray)
    name = wire_dtype_name(arr.dtype)
    if dtype_name is not None and name != dtype_name:
        raise LocalProtocolError(f"expected an array of {dtype_name}, got {name}")
    wire = WIRE_DTYPES[name]
    if arr.dtype != wire:  # big-endian (or a dtype with metadata): convert for the wire
        arr = arr.astype(wire)
    if arr.ndim > MAX_NDIM:
        raise LocalProtocolError(f"arrays may have at most {MAX_NDIM} dimensions")
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr


def _array_spec(dtype_name: str | None) -> _Spec:
    label = "ndarray" if dtype_name is None else f"ndarray[{dtype_name}]"

    def encode(value: Any, arrays: list[NDArray[Any]]) -> Any:
        arrays.append(_prepare_array(value, dtype_name))
        return len(arrays) - 1

    def decode(value: Any, pool: _ArrayPool) -> Any:
        if type(value) is not int:
            raise _remote_type_error(f"{label} (an array index)", value)
        arr = pool.take(value)
        if dtype_name is not None and arr.dtype != WIRE_DTYPES[dtype_name]:
            raise RemoteProtocolError(f"expected an array of {dtype_name}, got {arr.dtype}")
        return arr

    return _Spec(label, "int", encode, decode, 0)


def _sequence_spec(item: _Spec, container: type[list[Any]] | type[tuple[Any, ...]]) -> _Spec:
    label = f"{container.__name__}[{item.name}{', ...' if container is tuple else ''}]"
    item_encode, item_decode, leaf = item.encode, item.decode, item.leaf_type

    def encode(value: Any, arrays: list[NDArray[Any]]) -> Any:
        if type(value) is not container:
            raise _local_type_error(label, value)
        return [item_encode(v, arrays) for v in value]

    def decode(value: Any, pool: _ArrayPool) -> Any:
        if type(value) is not list:
            raise _remote_type_error(label, value)
        if leaf is not None:  # scalars: check types, keep msgpack's list
            for v in value:
                if type(v) is not leaf:
                    raise _remote_type_error(f"{item.name} in {label}", v)
            out = value
        else:
            out = [item_decode(v, pool) for v in value]
        return out if container is list else tuple(out)

    return _Spec(label, "array", encode, decode, item.depth + 1)


def _fixed_tuple_spec(items: tuple[_Spec, ...]) -> _Spec:
    label = f"tuple[{', '.join(s.name for s in items)}]" if items else "tuple[()]"
    count = len(items)

    def encode(value: Any, arrays: list[NDArray[Any]]) -> Any:
        if type(value) is not tuple or len(value) != count:
            raise _local_type_error(label, value)
        return [s.encode(v, arrays) for s, v in zip(items, value, strict=True)]

    def decode(value: Any, pool: _ArrayPool) -> Any:
        if type(value) is not list or len(value) != count:
            raise _remote_type_error(label, value)
        return tuple(s.decode(v, pool) for s, v in zip(items, value, strict=True))

    return _Spec(label, "array", encode, decode, 1 + max((s.depth for s in items), default=0))


def _dict_spec(key: _Spec, item: _Spec) -> _Spec:
    label = f"dict[{key.name}, {item.name}]"
    key_type = key.leaf_type
    item_encode, item_decode = item.encode, item.decode

    def encode(value: Any, arrays: list[NDArray[Any]]) -> Any:
        if type(value) is not dict:
            raise _local_type_error(label, value)
        out = {}
        for k, v in value.items():
            if type(k) is not key_type:
                raise _local_type_error(f"{key.name} key in {label}", k)
            out[k] = item_encode(v, arrays)
        return out

    def decode(value: Any, pool: _ArrayPool) -> Any:
        if type(value) is not dict:
            raise _remote_type_error(label, value)
        out = {}
        for k, v in value.items():
            if type(k) is not key_type:
                raise _remote_type_error(f"{key.name} key in {label}", k)
            out[k] = item_decode(v, pool)
        return out

    return _Spec(label, "map", encode, decode, item.depth + 1)


def _union_spec(members: tuple[_Spec, ...], where: str) -> _Spec:
    by_kind: dict[str, _Spec] = {}
    for m in members:
        if m.kind in by_kind:
            raise TypeError(
                f"{where}: union members {by_kind[m.kind].name} and {m.name} have the same "
                f"wire type ({m.kind}); a decoder could not tell them apart"
            )
        by_kind[m.kind] = m
    label = " | ".join(m.name for m in members)

    def encode(value: Any, arrays: list[NDArray[Any]]) -> Any:
        count = len(arrays)
        for m in members:
            try:
                return m.encode(value, arrays)
            except LocalProtocolError:
                del arrays[count:]  # forget arrays a failed member collected
        raise _local_type_error(label, value)

    def decode(value: Any, pool: _ArrayPool) -> Any:
        member = by_kind.get(_KIND_OF_TYPE.get(type(value), ""))
        if member is None:
            raise _remote_type_error(label, value)
        return member.decode(value, pool)

    return _Spec(label, "union", encode, decode, max(m.depth for m in members))


def _nested_spec(cls: type[Message]) -> _Spec:
    spec = _SPECS[cls]

    def encode(value: Any, arrays: list[NDArray[Any]]) -> Any:
        if type(value) is not cls:
            raise _local_type_error(cls.__name__, value)
        return _encode_fields(spec, value, arrays)

    def decode(value: Any, pool: _ArrayPool) -> Any:
        if type(value) is not list:
            raise _remote_type_error(cls.__name__, value)
        return _decode_fields(spec, value, pool)

    return _Spec(cls.__name__, "array", encode, decode, spec.depth)


_LEAF_SPECS: Final[Mapping[object, _Spec]] = {
    None: _leaf_spec(type(None), "nil"),
    type(None): _leaf_spec(type(None), "nil"),
    bool: _leaf_spec(bool, "bool"),
    int: _int_spec(),
    float: _float_spec(),
    str: _leaf_spec(str, "str"),
    bytes: _leaf_spec(bytes, "bin"),
    PeerID: _peer_id_spec(),
    np.ndarray: _array_spec(None),
}


def _alias_types() -> tuple[type, ...]:
    found: list[type] = []
    kind = getattr(typing, "TypeAliasType", None)  # (Python >= 3.12)
    if isinstance(kind, type):
        found.append(kind)
    try:
        import typing_extensions
    except ImportError:  # pragma: no cover (anyio needs it below Python 3.13)
        return tuple(found)
    kind = getattr(typing_extensions, "TypeAliasType", None)
    if isinstance(kind, type) and kind not in found:
        found.append(kind)
    return tuple(found)


#: the classes of PEP 695 type aliases (``type X[T] = ...``); numpy >= 2.5 defines ``NDArray``
#: as one on Python >= 3.12, where ``NDArray[Any]`` no longer has ``np.ndarray`` as its origin
_ALIAS_TYPES: Final = _alias_types()


def _resolve_alias(tp: Any) -> Any:
    """What a (subscripted) PEP 695 type alias stands for; ``tp`` itself if it is none."""
    for _ in range(MAX_NESTING_DEPTH):  # (an alias of an alias; bounded)
        origin = typing.get_origin(tp)
        if isinstance(origin, _ALIAS_TYPES):
            alias: Any = origin
            value, args = alias.__value__, typing.get_args(tp)
            tp = value[args] if alias.__type_params__ and args else value
        elif isinstance(tp, _ALIAS_TYPES):
            tp = typing.cast(Any, tp).__value__
        else:
            return tp
    return tp


def _compile(tp: Any, where: str) -> _Spec:
    """The spec of annotation ``tp`` (of field ``where``).

    :raises TypeError: if the wire cannot carry ``tp``.
    """
    if _ALIAS_TYPES:
        tp = _resolve_alias(tp)
    leaf = _LEAF_SPECS.get(tp) if isinstance(tp, typing.Hashable) else None
    if leaf is not None:
        return leaf
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is np.ndarray:  # NDArray[...] / np.ndarray[shape, np.dtype[...]]
        scalar = typing.get_args(args[1])[0] if len(args) == 2 else Any
        if scalar is Any or isinstance(scalar, TypeVar):  # (any dtype)
            return _LEAF_SPECS[np.ndarray]
        try:
            return _array_spec(wire_dtype_name(scalar))
        except (LocalProtocolError, TypeError) as exc:
            raise TypeError(f"{where}: {exc}") from None
    if origin is list and len(args) == 1:
        return _sequence_spec(_compile(args[0], where), list)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _sequence_spec(_compile(args[0], where), tuple)
        if args == ((),):  # tuple[()] on older typing versions
            args = ()
        return _fixed_tuple_spec(tuple(_compile(a, where) for a in args))
    if origin is dict and len(args) == 2:
        if args[0] not in (str, bytes):
            raise TypeError(f"{where}: dict keys must be str or bytes, not {args[0]!r}")
        return _dict_spec(_LEAF_SPECS[args[0]], _compile(args[1], where))
    if origin in (typing.Union, types.UnionType):
        return _union_spec(tuple(_compile(a, where) for a in args), where)
    if isinstance(tp, type) and issubclass(tp, Message):
        if tp not in _SPECS:
            raise TypeError(f"{where}: nested message {tp.__name__} is not registered")
        return _nested_spec(tp)
    raise TypeError(f"{where}: the wire cannot carry fields of type {tp!r}")


# --------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _MessageSpec:
    cls: type[Message]
    tag: str
    fields: tuple[tuple[str, _Spec], ...]
    required: int  # how many leading fields have no default
    depth: int
    #: the fields' decoders, in order (the hot loop of decoding)
    decoders: tuple[Callable[[Any, _ArrayPool], Any], ...] = ()


_REGISTRY: dict[str, type[Message]] = {}
_SPECS: dict[type[Message], _MessageSpec] = {}


def registered_messages() -> Mapping[str, type[Message]]:
    """A read-only live view of the registry: tag -> message class."""
    return types.MappingProxyType(_REGISTRY)


def message(tag: str) -> Callable[[type[_M]], type[_M]]:
    """Class decorator: register a frozen, slotted dataclass as the wire message ``tag``.

    ::

        @message("ping")
        @dataclass(frozen=True, slots=True)
        class Ping(Message):
            nonce: int

    Field annotations are resolved when the decorator runs, so the types they name must be
    importable at runtime (not only under ``TYPE_CHECKING``). Supported types are listed in the
    module docstring; fields must be ordinary ``__init__`` parameters (not ``kw_only`` nor
    ``init=False``). ``__post_init__`` may validate: a ``ValueError`` or ``TypeError`` it raises
    while decoding becomes :class:`RemoteProtocolError`.

    :raises TypeError: if the class is not a frozen, slotted dataclass deriving from
        :class:`Message`, or a field's type cannot travel on the wire, or the schema nests
        deeper than :data:`MAX_NESTING_DEPTH`.
    :raises ValueError: if ``tag`` is not 1-64 printable ASCII characters or already in use.
    """
    if not isinstance(tag, str):
        raise TypeError(f"a message tag must be a str, not {type(tag).__name__}")
    if not 0 < len(tag) <= _MAX_TAG_LEN or not (tag.isascii() and tag.isprintable()):
        raise ValueError(f"a message tag must be 1-{_MAX_TAG_LEN} printable ASCII characters")

    def register(cls: type[_M]) -> type[_M]:
        if not (isinstance(cls, type) and issubclass(cls, Message)):
            raise TypeError(f"@message({tag!r}) needs a subclass of Message, not {cls!r}")
        params = getattr(cls, "__dataclass_params__", None)
        if (
            "__dataclass_fields__" not in cls.__dict__
            or params is None
            or not params.frozen
            or "__slots__" not in cls.__dict__
        ):
            raise TypeError(f"{cls.__name__} must be a @dataclass(frozen=True, slots=True)")
        if tag in _REGISTRY:
            raise ValueError(f"message tag {tag!r} is already used by {_REGISTRY[tag].__name__}")
        if cls in _SPECS:
            raise ValueError(f"{cls.__name__} is already registered as {cls.TAG!r}")
        try:
            hints = typing.get_type_hints(cls)
        except (NameError, AttributeError, TypeError, SyntaxError) as exc:  # bad annotations
            raise TypeError(f"cannot resolve the annotations of {cls.__name__}: {exc}") from exc
        fields: list[tuple[str, _Spec]] = []
        required = 0
        for f in dataclasses.fields(typing.cast(Any, cls)):
            where = f"{cls.__name__}.{f.name}"
            if not f.init or f.kw_only:
                raise TypeError(f"{where}: message fields must be positional __init__ arguments")
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                required = len(fields) + 1
            fields.append((f.name, _compile(hints[f.name], where)))
        depth = 1 + max((s.depth for _, s in fields), default=0)
        if depth > MAX_NESTING_DEPTH:
            raise TypeError(
                f"{cls.__name__} nests {depth} levels deep; the limit is {MAX_NESTING_DEPTH}"
            )
        cls.TAG = tag
        decoders = tuple(spec.decode for _, spec in fields)
        _SPECS[cls] = _MessageSpec(cls, tag, tuple(fields), required, depth, decoders)
        _REGISTRY[tag] = cls
        return cls

    return register


def _encode_fields(spec: _MessageSpec, msg: Message, arrays: list[NDArray[Any]]) -> list[Any]:
    out = []
    for name, field in spec.fields:
        try:
            out.append(field.encode(getattr(msg, name), arrays))
        except LocalProtocolError as exc:
            raise LocalProtocolError(f"{spec.cls.__name__}.{name}: {exc}") from None
    return out


def _decode_fields(spec: _MessageSpec, values: list[Any], pool: _ArrayPool) -> Message:
    if not spec.required <= len(values) <= len(spec.fields):
        raise RemoteProtocolError(
            f"{spec.tag!r} message has {len(values)} fields, expected "
            + (
                f"{len(spec.fields)}"
                if spec.required == len(spec.fields)
                else f"{spec.required} to {len(spec.fields)}"
            )
        )
    args: list[Any] = []
    append = args.append
    taken = pool.taken[:] if pool.arrays else None  # (for a second pass)
    try:
        for decode, value in zip(spec.decoders, values, strict=False):
            append(decode(value, pool))
    except RemoteProtocolError:  # (rare) say which field: decode them again one by one
        if taken is not None:
            pool.taken = taken
        for (name, field), value in zip(spec.fields, values, strict=False):
            try:
                field.decode(value, pool)
            except RemoteProtocolError as field_exc:
                raise RemoteProtocolError(
                    f"{spec.tag!r} field {name!r}: {field_exc}"
                ) from field_exc
        raise  # (not reached: one of them fails again)
    try:
        return spec.cls(*args)
    except (TypeError, ValueError) as exc:  # raised by a __post_init__ check
        raise RemoteProtocolError(f"invalid {spec.tag!r} message: {exc}") from exc


# --------------------------------------------------------------------------------------------
# Encoding and decoding
# --------------------------------------------------------------------------------------------


def _padding(offset: int) -> int:
    return -offset % ARRAY_ALIGNMENT


def encode_message(
    msg: Message,
    *,
    max_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
) -> list[Buffer]:
    """Encode ``msg`` as a list of buffers to be sent, concatenated, as one unit (a frame body).

    The first buffer holds the header; each array follows as a ``memoryview`` of its own memory
    (no copy, unless it had to be made C-contiguous or little-endian first), with small zero
    padding buffers between them for alignment. The arrays must not be modified until the
    buffers have been written.

    :raises LocalProtocolError: if a field does not match its annotation (the message names
        the field), or an array's dtype cannot be sent.
    :raises MessageTooLarge: if the message exceeds ``max_size`` bytes or its header exceeds
        ``max_header_size`` bytes.
    :raises TypeError: if ``msg`` is not an instance of a registered message class.
    """
    spec = _SPECS.get(type(msg))
    if spec is None:
        raise TypeError(f"{type(msg).__name__} is not a registered message class")
    arrays: list[NDArray[Any]] = []
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": spec.tag}
    header["f"] = _encode_fields(spec, msg, arrays)
    if arrays:
        header["a"] = [[wire_dtype_name(a.dtype), list(a.shape), a.nbytes] for a in arrays]
    try:
        packed = msgpack.packb(header, use_bin_type=True, datetime=False)
    except (UnicodeEncodeError, ValueError, TypeError, OverflowError) as exc:
        raise LocalProtocolError(f"cannot encode {spec.tag!r} message: {exc}") from exc
    if len(packed) > max_header_size:
        raise MessageTooLarge(
            f"{spec.tag!r} header is {len(packed)} bytes; the limit is {max_header_size} bytes "
            "(send bulk data as arrays)"
        )
    if not arrays:
        head = _U32.pack(len(packed)) + packed
        if len(head) > max_size:
            raise MessageTooLarge(
                f"{spec.tag!r} message is {len(head)} bytes; the limit is {max_size} bytes"
            )
        return [head]
    size = _U32.size + len(packed)
    head = b"".join((_U32.pack(len(packed)), packed, bytes(_padding(size))))
    parts: list[Buffer] = [head]
    size = len(head)
    for i, arr in enumerate(arrays):
        if i:
            pad = _padding(size)
            if pad:
                parts.append(bytes(pad))
                size += pad
        if arr.nbytes:
            parts.append(arr.reshape(-1).view(np.uint8).data)  # a 1-d byte memoryview
            size += arr.nbytes
    if size > max_size:
        raise MessageTooLarge(
            f"{spec.tag!r} message is {size} bytes; the limit is {max_size} bytes"
        )
    return parts


def encode_message_bytes(
    msg: Message,
    *,
    max_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
) -> bytes:
    """:func:`encode_message` joined into one ``bytes`` (copies the arrays; for small messages).

    :raises: the same exceptions as :func:`encode_message`.
    """
    return b"".join(encode_message(msg, max_size=max_size, max_header_size=max_header_size))


def encoded_size(parts: list[Buffer]) -> int:
    """The total size in bytes of the buffers returned by :func:`encode_message`."""
    return buffers_size(parts)


def _unpack_header(view: memoryview) -> Any:
    limit = view.nbytes
    try:
        return msgpack.unpackb(
            view,
            raw=False,
            use_list=True,
            strict_map_key=True,
            object_pairs_hook=_map_without_duplicates,
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=limit,
            max_map_len=limit,
            max_ext_len=0,
            timestamp=0,
        )
    except (ValueError, TypeError, OverflowError, MemoryError, msgpack.UnpackException) as exc:
        # UnicodeDecodeError, msgpack's ExtraData/FormatError/StackError/OutOfData, ...
        raise RemoteProtocolError(f"malformed message header: {exc}") from exc


def _map_without_duplicates(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key in map")
    return out


def _decode_arrays(
    descriptors: object, view: memoryview, offset: int
) -> tuple[list[NDArray[Any]], int]:
    """Check the array descriptors against the payload; views of the payload and the end offset."""
    if type(descriptors) is not list:
        raise _remote_type_error("a list of array descriptors", descriptors)
    end = view.nbytes
    arrays: list[NDArray[Any]] = []
    for i, desc in enumerate(descriptors):
        if type(desc) is not list or len(desc) != 3:
            raise RemoteProtocolError(f"array descriptor {i} is not [dtype, shape, nbytes]")
        name, shape, nbytes = desc
        dtype = WIRE_DTYPES.get(name) if type(name) is str else None
        if dtype is None:
            raise RemoteProtocolError(f"array {i} has unsupported dtype {_brief(name)}")
        if type(shape) is not list or len(shape) > MAX_NDIM:
            raise RemoteProtocolError(f"array {i} shape is not a list of at most {MAX_NDIM} ints")
        for dim in shape:
            if type(dim) is not int or dim < 0:
                raise RemoteProtocolError(f"array {i} shape has a bad dimension {_brief(dim)}")
        count = math.prod(shape)  # Python ints: no overflow
        if type(nbytes) is not int or nbytes != count * dtype.itemsize:
            raise RemoteProtocolError(
                f"array {i} nbytes {_brief(nbytes)} does not match its dtype {name} and shape"
            )
        pad = _padding(offset)
        if nbytes + pad > end - offset:
            raise RemoteProtocolError(
                f"message truncated: array {i} needs {nbytes} bytes at offset {offset + pad}, "
                f"only {max(0, end - offset - pad)} remain"
            )
        if pad and view[offset : offset + pad] != bytes(pad):
            raise RemoteProtocolError("non-zero padding before an array")
        offset += pad
        try:
            arr = np.frombuffer(view, dtype=dtype, count=count, offset=offset).reshape(shape)
        except (ValueError, TypeError, MemoryError) as exc:  # e.g. shape (0, 2**62, 2**62)
            raise RemoteProtocolError(f"array {i} has an impossible shape: {exc}") from exc
        arrays.append(arr)
        offset += nbytes
    return arrays, offset


def decode_message(
    data: Buffer,
    *,
    max_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
) -> Message:
    """Decode one message produced by :func:`encode_message` (the whole frame body).

    Arrays come back as ``numpy.frombuffer`` views **aliasing** ``data`` (zero-copy): they keep
    ``data`` alive, change if it changes, and are read-only when ``data`` is (``bytes``) and
    writable when it is writable (``bytearray``). They are aligned to their item size when
    ``data`` starts at an 8-byte-aligned address (buffers from
    :class:`~swarmavg.proto.wire.FrameDecoder` do, in CPython). Copy them to keep them beyond
    the buffer's lifetime or to write without affecting it.

    :raises RemoteProtocolError: if ``data`` is not a well-formed message of a registered type
        whose fields match their annotations: a size above ``max_size`` / ``max_header_size``,
        an unknown protocol version or tag, malformed msgpack, a type mismatch, a bad array
        descriptor, a truncation or trailing bytes... Nothing else is raised for any input.
    :raises TypeError: if ``data`` is not a C-contiguous bytes-like object (a caller bug).
    """
    view = memoryview(data)
    if not view.c_contiguous:
        raise TypeError("decode_message needs a C-contiguous buffer")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    size = view.nbytes
    if size > max_size:
        raise RemoteProtocolError(f"message of {size} bytes exceeds the limit of {max_size}")
    if size < _U32.size:
        raise RemoteProtocolError(f"message of {size} bytes is too short for a header")
    (header_len,) = _U32.unpack_from(view)
    if header_len > max_header_size:
        raise RemoteProtocolError(
            f"message header of {header_len} bytes exceeds the limit of {max_header_size}"
        )
    offset = _U32.size + header_len
    if offset > size:
        raise RemoteProtocolError(
            f"message header of {header_len} bytes is longer than the message ({size} bytes)"
        )
    header = _unpack_header(view[_U32.size : offset])
    if type(header) is not dict:
        raise RemoteProtocolError(f"message header is {_brief(header)}, not a map")
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise RemoteProtocolError(
            f"unsupported protocol version {_brief(version)} (this peer speaks version "
            f"{PROTOCOL_VERSION})"
        )
    tag = header.get("t")
    spec = _SPECS.get(_REGISTRY[tag]) if type(tag) is str and tag in _REGISTRY else None
    if spec is None:
        raise RemoteProtocolError(f"unknown message type {_brief(tag)}")
    if not header.keys() <= _HEADER_KEYS or "f" not in header:
        raise RemoteProtocolError(f"{tag!r} header keys must be v, t, f and optionally a")
    values = header["f"]
    if type(values) is not list:
        raise RemoteProtocolError(f"{tag!r} fields are {_brief(values)}, not a list")
    if "a" in header:
        arrays, offset = _decode_arrays(header["a"], view, offset)
    else:
        arrays = []
    if offset != size:
        raise RemoteProtocolError(f"{size - offset} unexpected bytes after the {tag!r} message")
    pool = _ArrayPool(arrays)
    msg = _decode_fields(spec, values, pool)
    if not all(pool.taken):
        raise RemoteProtocolError(f"{tag!r} message carries arrays that no field references")
    return msg
