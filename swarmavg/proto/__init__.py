"""Sans-IO protocol code: framing, the message codec and the core messages.

Nothing in this package does I/O or reads a clock; it takes bytes and returns bytes, messages
or :class:`~swarmavg.errors.RemoteProtocolError`.
"""

from __future__ import annotations

from swarmavg.proto.codec import (
    ARRAY_ALIGNMENT,
    DEFAULT_MAX_HEADER_SIZE,
    DEFAULT_MAX_MESSAGE_SIZE,
    MAX_NDIM,
    MAX_NESTING_DEPTH,
    PROTOCOL_VERSION,
    WIRE_DTYPES,
    Message,
    decode_message,
    encode_message,
    encode_message_bytes,
    encoded_size,
    message,
    registered_messages,
    wire_dtype_name,
)
from swarmavg.proto.messages import ErrorMessage, Ping, Pong, TensorChunk
from swarmavg.proto.wire import (
    DEFAULT_MAX_FRAME_SIZE,
    FRAME_HEADER_SIZE,
    MAX_FRAME_SIZE_LIMIT,
    Buffer,
    FrameDecoder,
    buffers_size,
    encode_frame,
    encode_frame_header,
)

__all__ = [
    "ARRAY_ALIGNMENT",
    "DEFAULT_MAX_FRAME_SIZE",
    "DEFAULT_MAX_HEADER_SIZE",
    "DEFAULT_MAX_MESSAGE_SIZE",
    "FRAME_HEADER_SIZE",
    "MAX_FRAME_SIZE_LIMIT",
    "MAX_NDIM",
    "MAX_NESTING_DEPTH",
    "PROTOCOL_VERSION",
    "WIRE_DTYPES",
    "Buffer",
    "ErrorMessage",
    "FrameDecoder",
    "Message",
    "Ping",
    "Pong",
    "TensorChunk",
    "buffers_size",
    "decode_message",
    "encode_frame",
    "encode_frame_header",
    "encode_message",
    "encode_message_bytes",
    "encoded_size",
    "message",
    "registered_messages",
    "wire_dtype_name",
]
