"""The accumulator's user state (``set_state(obj)``) as msgpack plus tensors, never pickle.

A state is a nesting of ``dict`` (keys ``str``, ``int``, ``float``, ``bool``, ``None`` or
``bytes``), ``list``, ``tuple``, ``str``, ``int`` (64-bit), ``float``, ``bool``, ``None``,
``bytes``, tensors and ``numpy.ndarray``. :func:`split_state` checks it all before anything is
sent (anything else raises :class:`TypeError` naming where it is, e.g.
``state['optimizer']['state'][0]['step']``) and splits it into a *skeleton* (msgpack bytes, each
tensor or array replaced by its index in a list) and that list; :func:`join_state` puts them
back together (tuples come back as tuples, arrays as arrays, tensors as whatever the caller
makes of them).

The tensor type is the caller's (``torch`` stays at the edge): it passes ``tensor_dtype``, which
says whether an object is one of its tensors and of which dtype. Sans-IO.

Skeleton encoding: msgpack where a tensor is the extension ``1`` (its index, 4 bytes
big-endian), an array the extension ``2`` (likewise), and a tuple a one-entry map from the
extension ``3`` (empty) to the list of its items. :func:`join_state` reads a skeleton from the
network: every index must be in range and used exactly once, nesting is bounded, and anything
else raises :class:`~swarmavg.proto.state_messages.StateDownloadFailed`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

import msgpack
import numpy as np

from swarmavg.proto.state_messages import DTYPE_SIZES, StateDownloadFailed

__all__ = ["MAX_STATE_DEPTH", "join_state", "split_state"]

#: How deep a state may nest (each dict, list or tuple is a level).
MAX_STATE_DEPTH: Final = 64
#: The largest skeleton :func:`join_state` accepts, in bytes.
MAX_SKELETON_SIZE: Final = 64 << 20
_TENSOR: Final = 1
_ARRAY: Final = 2
_TUPLE: Final = 3
_TUPLE_KEY: Final = msgpack.ExtType(_TUPLE, b"")
_INT_MIN: Final = -(1 << 63)
_INT_MAX: Final = (1 << 64) - 1
_KEY_TYPES: Final = (str, int, float, bool, type(None), bytes)

#: ``tensor_dtype(obj)``: ``None`` if ``obj`` is not one of the caller's tensors, else its
#: dtype's name as :data:`~swarmavg.proto.state_messages.DTYPE_SIZES` spells it (any other
#: string says why it cannot travel, e.g. ``"a sparse tensor"``).
TensorDtype = Callable[[object], str | None]


def _path(root: str, keys: Sequence[object]) -> str:
    return root + "".join(f"[{k!r}]" for k in keys)


def split_state(
    state: object, tensor_dtype: TensorDtype, *, root: str = "state"
) -> tuple[bytes, list[Any]]:
    """The skeleton (msgpack bytes) and the tensors and arrays of ``state``, in the order the
    skeleton indexes them (the objects themselves, not copies).

    :raises TypeError: something in ``state`` cannot travel (another type, a key of another
        type, an array or tensor of a dtype a state cannot hold, nesting deeper than
        :data:`MAX_STATE_DEPTH` or a cycle); the message names where, from ``root``.
    :raises ValueError: an ``int`` outside ``[-2**63, 2**64)``, named likewise.
    """
    tensors: list[Any] = []
    keys: list[object] = []

    def where() -> str:
        return _path(root, keys)

    def walk(value: Any, depth: int) -> object:
        # (exact types: a subclass, e.g. an IntEnum or a namedtuple, would not come back as
        # itself)
        kind = type(value)
        if value is None or kind in (bool, str, bytes, float):
            return value
        if kind is int:
            if not _INT_MIN <= value <= _INT_MAX:
                raise ValueError(f"{where()} is an int out of the 64-bit range: {value}")
            return value
        if kind in (dict, list, tuple):
            if depth >= MAX_STATE_DEPTH:
                raise TypeError(
                    f"{where()} nests deeper than {MAX_STATE_DEPTH} levels (or holds itself)"
                )
            if kind is dict:
                out: dict[object, object] = {}
                for key, item in value.items():
                    if type(key) not in _KEY_TYPES:
                        raise TypeError(
                            f"{where()} has a key of type {type(key).__name__} ({key!r}): "
                            "keys must be str, int, float, bool, None or bytes"
                        )
                    if type(key) is int and not _INT_MIN <= key <= _INT_MAX:
                        raise ValueError(f"{where()} has an int key out of the 64-bit range")
                    keys.append(key)
                    out[key] = walk(item, depth + 1)
                    keys.pop()
                return out
            items = []
            for i, item in enumerate(value):
                keys.append(i)
                items.append(walk(item, depth + 1))
                keys.pop()
            return items if kind is list else {_TUPLE_KEY: items}
        if kind is np.ndarray:
            array: np.ndarray[Any, Any] = value
            if array.dtype.name not in DTYPE_SIZES:
                raise TypeError(f"{where()} is an array of {array.dtype}, which cannot travel")
            tensors.append(array)
            return msgpack.ExtType(_ARRAY, (len(tensors) - 1).to_bytes(4, "big"))
        dtype = tensor_dtype(value)
        if dtype is None:
            raise TypeError(
                f"{where()} is a {kind.__module__}.{kind.__qualname__}, which a state cannot "
                "hold (only dict, list, tuple, str, int, float, bool, None, bytes, tensors and "
                "numpy arrays: no pickle)"
            )
        if dtype not in DTYPE_SIZES:
            raise TypeError(f"{where()} is {dtype}, which cannot travel")
        tensors.append(value)
        return msgpack.ExtType(_TENSOR, (len(tensors) - 1).to_bytes(4, "big"))

    skeleton = walk(state, 0)
    try:
        packed = msgpack.packb(skeleton, use_bin_type=True, strict_types=True)
    except (TypeError, ValueError, OverflowError) as exc:  # (checked above: a bug if reached)
        raise TypeError(f"{root} cannot be packed: {exc}") from exc
    return packed, tensors


def join_state(
    skeleton: bytes,
    tensors: Sequence[Any],
    *,
    to_array: Callable[[Any], Any] = np.asarray,
) -> object:
    """The state that :func:`split_state` split into ``skeleton`` and ``tensors`` (a
    network's answer): tensors are ``tensors``' items, arrays ``to_array`` of them.

    :raises StateDownloadFailed: the skeleton does not decode, nests too deep, or its indexes
        are out of range or do not use every tensor exactly once.
    """
    if not isinstance(skeleton, bytes) or len(skeleton) > MAX_SKELETON_SIZE:
        raise StateDownloadFailed("the state's skeleton is not bytes or is too large")
    try:
        raw = msgpack.unpackb(skeleton, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        raise StateDownloadFailed(f"the state's skeleton does not decode: {exc}") from None
    used = [False] * len(tensors)

    def take(ext: msgpack.ExtType) -> Any:
        if ext.code not in (_TENSOR, _ARRAY) or len(ext.data) != 4:
            raise StateDownloadFailed(f"the state's skeleton holds an unknown extension {ext!r}")
        index = int.from_bytes(ext.data, "big")
        if index >= len(tensors) or used[index]:
            raise StateDownloadFailed(f"the state's skeleton uses tensor {index} wrongly")
        used[index] = True
        return tensors[index] if ext.code == _TENSOR else to_array(tensors[index])

    def build(value: Any, depth: int) -> Any:
        if isinstance(value, msgpack.ExtType):
            return take(value)
        if not isinstance(value, dict | list):
            return value
        if depth >= MAX_STATE_DEPTH:
            raise StateDownloadFailed(f"the state nests deeper than {MAX_STATE_DEPTH} levels")
        if isinstance(value, list):
            return [build(item, depth + 1) for item in value]
        if len(value) == 1 and _TUPLE_KEY in value:
            items = value[_TUPLE_KEY]
            if not isinstance(items, list):
                raise StateDownloadFailed("the state's skeleton holds a malformed tuple")
            return tuple(build(item, depth + 1) for item in items)
        out = {}
        for key, item in value.items():
            if type(key) not in _KEY_TYPES:
                raise StateDownloadFailed(f"the state's skeleton holds a key {key!r}")
            out[key] = build(item, depth + 1)
        return out

    state = build(raw, 0)
    if not all(used):
        raise StateDownloadFailed("the state's skeleton does not use every tensor")
    return state
