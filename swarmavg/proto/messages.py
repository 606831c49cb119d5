"""The core wire messages that every swarmavg peer understands.

Higher layers (RPC, DHT, averaging) define their own messages the same way::

    @message("rpc.request")
    @dataclass(frozen=True, slots=True)
    class Request(Message): ...

Tags are global across the process: pick a dotted prefix per layer (``"rpc."``, ``"dht."``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from numpy.typing import NDArray  # runtime import: the codec resolves the annotations

from swarmavg.proto.codec import Message, message

__all__ = ["ErrorMessage", "Ping", "Pong", "TensorChunk"]


@message("ping")
@dataclass(frozen=True, slots=True)
class Ping(Message):
    """A liveness / round-trip-time probe; the receiver answers ``Pong(nonce)``.

    ``nonce`` is any 64-bit int chosen by the sender to match the answer to the probe.
    """

    nonce: int


@message("pong")
@dataclass(frozen=True, slots=True)
class Pong(Message):
    """The answer to :class:`Ping`, echoing its ``nonce``."""

    nonce: int


@message("error")
@dataclass(frozen=True, slots=True)
class ErrorMessage(Message):
    """A peer reports that it could not serve a request.

    ``code`` is a short machine-readable identifier (``"protocol"``, ``"internal"``,
    ``"unavailable"``, ``"not_found"``...; higher layers define theirs), ``message`` a
    human-readable explanation. Both come from the peer: display them, never interpret them
    beyond comparing ``code``.
    """

    code: str
    message: str


@message("tensor_chunk")
@dataclass(frozen=True, slots=True, eq=False)
class TensorChunk(Message):
    """Part ``index`` (from 0) of the tensor or flattened vector called ``name``.

    ``array`` travels as raw little-endian bytes after the header, without copies; once decoded
    it is a view of the received buffer (see :func:`~swarmavg.proto.decode_message`).
    Equality is identity (``eq=False``): compare arrays with numpy, not ``==``.
    """

    name: str
    index: int
    array: NDArray[Any]
