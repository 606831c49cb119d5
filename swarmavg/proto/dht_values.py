"""How DHT keys, subkeys and values become bytes and back (sans-IO): msgpack, with tuples kept.

A key, subkey or value is anything msgpack carries (``None``, ``bool``, ``int``, ``float``,
``str``, ``bytes``, lists, dicts) and tuples. msgpack has a single array type; so that what was
stored comes back as it was, nested too, a list travels as a msgpack array and a tuple as the
extension type ``0x40`` (:data:`TUPLE_EXT_CODE`) whose payload is the msgpack array of its
items. hivemind's ``MSGPackSerializer`` packs tuples the same way. Subclasses travel as their
base type (a ``NamedTuple`` as a tuple, an ``IntEnum`` as an int, an ``OrderedDict`` as a dict).
msgpack's own timestamp extension (code -1) decodes as :class:`msgpack.Timestamp`, as msgpack
(and hivemind) always does.

The bytes are what travels and what owner records sign (:mod:`swarmavg.proto.dht_validation`
signs the packed value): a value is packed once, by its writer, and every reader decodes the
same bytes; nothing is ever re-packed.

Decoding reads what other peers stored, so it is bounded, and refuses with
:class:`~swarmavg.errors.RemoteProtocolError` (and nothing else) what this packer never
produces: tuples nested more than :data:`MAX_TUPLE_DEPTH` deep (each level is an unpack of its
own, so the bound keeps the recursion shallow, and the copying linear: a byte is copied once
per tuple it is nested in), other extension types, a tuple payload that is not one array,
trailing bytes, invalid UTF-8, map keys that cannot be dict keys. msgpack bounds the rest:
lengths by the input's size, the nesting of arrays and maps by its stack. Packing refuses
tuples nested deeper than the bound too, so whatever we store, every peer can read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import msgpack

from swarmavg.errors import RemoteProtocolError

__all__ = ["MAX_TUPLE_DEPTH", "TUPLE_EXT_CODE", "pack", "unpack", "unpack_subkey"]

#: The msgpack extension type code of a tuple (hivemind's).
TUPLE_EXT_CODE: Final = 0x40
#: How deep tuples may nest in one key, subkey or value (lists and dicts do not count).
MAX_TUPLE_DEPTH: Final = 32

_Default = Callable[[Any], Any]


def pack(obj: Any, what: str = "value") -> bytes:
    """``obj`` as the bytes it travels and is stored as.

    :param what: what ``obj`` is (``"key"``, ``"subkey"``, ``"value"``), for the error.
    :raises TypeError: ``obj`` is not made of the types above (or nests deeper than msgpack or
        :data:`MAX_TUPLE_DEPTH` allow, or holds an int outside 64 bits).
    """
    try:
        return _packb(obj, _DEFAULTS[0])
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"the DHT {what} cannot be serialized: {exc}") from exc


def _packb(obj: Any, default: _Default) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True, strict_types=True, default=default)
    return packed


def _make_default(depth: int) -> _Default:
    """msgpack's fallback for what ``strict_types`` does not pack as is, ``depth`` tuples deep:
    a tuple (a subclass too) becomes the tuple extension; a subclass of a msgpack type, that
    type; anything else is refused."""

    def default(obj: Any) -> Any:
        if isinstance(obj, tuple):
            if depth >= MAX_TUPLE_DEPTH:
                raise ValueError(f"tuples nest more than {MAX_TUPLE_DEPTH} deep")
            return msgpack.ExtType(TUPLE_EXT_CODE, _packb(list(obj), _DEFAULTS[depth + 1]))
        if isinstance(obj, dict):
            return dict(obj)
        if isinstance(obj, list):
            return list(obj)
        if isinstance(obj, str):
            return str.__str__(obj)  # (the text itself, whatever the subclass's __str__ says)
        if isinstance(obj, bytes):
            return bytes(memoryview(obj))
        if isinstance(obj, int):
            return int.__int__(obj)
        if isinstance(obj, float):
            return float.__float__(obj)
        raise TypeError(f"a {type(obj).__name__!r} object is not a msgpack type")

    return default


_DEFAULTS: Final = tuple(_make_default(depth) for depth in range(MAX_TUPLE_DEPTH + 1))


def unpack(data: bytes) -> Any:
    """What :func:`pack` packed into ``data``.

    :raises RemoteProtocolError: ``data`` is not what :func:`pack` makes (see the module
        docstring); never anything else.
    """
    try:
        return _unpackb(data, 0)
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        # UnicodeDecodeError, msgpack's ExtraData/FormatError/StackError, unhashable map keys
        raise RemoteProtocolError(
            f"a DHT value does not decode: {type(exc).__name__}: {exc}"
        ) from None


def unpack_subkey(data: bytes) -> Any:
    """A subkey: what :func:`unpack` gives, which must also be usable as a dict key.

    :raises RemoteProtocolError: it does not decode, or is unhashable (a list, a dict).
    """
    subkey = unpack(data)
    try:
        hash(subkey)
    except TypeError:
        raise RemoteProtocolError(
            f"a DHT subkey decodes to an unhashable {type(subkey).__name__}"
        ) from None
    return subkey


def _unpackb(data: bytes, depth: int) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_EXT_HOOKS[depth])


def _make_ext_hook(depth: int) -> Callable[[int, bytes], Any]:
    def ext_hook(code: int, payload: bytes) -> Any:
        if code != TUPLE_EXT_CODE:
            raise RemoteProtocolError(f"a DHT value holds the unknown extension type {code}")
        if depth >= MAX_TUPLE_DEPTH:
            raise RemoteProtocolError(f"a DHT value nests tuples more than {MAX_TUPLE_DEPTH} deep")
        items = _unpackb(payload, depth + 1)
        if type(items) is not list:
            raise RemoteProtocolError("a tuple's payload in a DHT value is not an array")
        return tuple(items)

    return ext_hook


_EXT_HOOKS: Final = tuple(_make_ext_hook(depth) for depth in range(MAX_TUPLE_DEPTH + 1))
