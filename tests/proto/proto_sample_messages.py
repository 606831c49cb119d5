"""Test-only messages that use every kind of field the codec supports (tags ``test.*``).

Imported by the tests and the fuzz harness, always under this one module name (importing it twice
under different names would register the tags twice, which the registry refuses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from swarmavg.identity import PeerID
from swarmavg.proto import Message, message

__all__ = ["Everything", "Leaf", "Validated"]


@message("test.leaf")
@dataclass(frozen=True, slots=True)
class Leaf(Message):
    n: int | None
    data: bytes


@message("test.everything")
@dataclass(frozen=True, slots=True, eq=False)
class Everything(Message):
    none: None
    flag: bool
    count: int
    ratio: float
    text: str
    blob: bytes
    peer: PeerID
    ints: list[int]
    names: tuple[str, ...]
    pair: tuple[int, str]
    empty: tuple[()]
    table: dict[str, list[float]]
    by_bytes: dict[bytes, int]
    maybe: int | None
    either: str | list[int] | None
    leaf: Leaf
    leaves: list[Leaf]
    array: NDArray[Any]
    f32: NDArray[np.float32]
    arrays: list[NDArray[Any]]
    named_arrays: dict[str, NDArray[Any]]
    opt_array: NDArray[Any] | None
    tail: int = 7


@message("test.validated")
@dataclass(frozen=True, slots=True)
class Validated(Message):
    """Its ``__post_init__`` refuses a negative ``size``."""

    size: int

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError("size must be non-negative")
