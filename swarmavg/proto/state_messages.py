"""State sharing's wire messages (``avg.state``, a server-stream call).

A peer that joins late asks a donor for its state with :class:`StateRequest` (naming the
averager's prefix). The donor answers with one :class:`StateHeader` (metadata as msgpack, every
tensor's dtype and shape, the total size and a SHA-256 checksum of the bytes that follow), then
the tensors' bytes, in order and concatenated, as :class:`StateChunk` messages of at most a few
MiB each. The taker checks the header against its limits before it allocates anything, and the
checksum once every byte arrived.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from numpy.typing import NDArray  # runtime import: the codec resolves the annotations

from swarmavg.proto.codec import Message, message

__all__ = ["StateChunk", "StateHeader", "StateRequest"]


@message("avg.state_request")
@dataclass(frozen=True, slots=True)
class StateRequest(Message):
    """Send me the state of the averager under ``prefix``."""

    prefix: str


@message("avg.state_header")
@dataclass(frozen=True, slots=True)
class StateHeader(Message):
    """The first answer: ``metadata`` (msgpack), each tensor's ``dtypes`` name and ``shapes``,
    ``total_bytes`` (the sum of the tensors' sizes: what the chunks carry) and the SHA-256
    ``checksum`` of those bytes."""

    metadata: bytes
    dtypes: list[str]
    shapes: list[list[int]]
    total_bytes: int
    checksum: bytes


@message("avg.state_chunk")
@dataclass(frozen=True, slots=True, eq=False)
class StateChunk(Message):
    """The tensors' bytes from ``offset`` (in their concatenation) on: a 1-D ``uint8`` array."""

    offset: int
    data: NDArray[Any]
