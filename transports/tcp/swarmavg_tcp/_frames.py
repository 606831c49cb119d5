"""The record layer of swarmavg-tcp (sans-IO): frame headers, settings and AEAD sealing.

After the handshake (see :mod:`swarmavg_tcp._handshake`) both directions of the TCP connection
carry a sequence of records::

    +----------------------------------------------------+-----------------------+-----------+
    | header, 16 bytes                                   | payload               | tag       |
    | length u32 | type u8 | flags u8 | 0 u16 |          | (length bytes)        | 16 bytes, |
    | stream u32 | arg u32                               |                       | encrypted |
    +----------------------------------------------------+-----------------------+-----------+

With encryption (the default) the payload is sealed with AES-128-GCM under the key of that
direction; the nonce is a per-direction record counter and the header is the associated data, so
a record cannot be altered, dropped, replayed or reordered without the next ``open`` failing.
Control records carry an empty payload and still a tag. Without encryption there is no tag: the
peers authenticated each other in the handshake, but the data itself is not protected.

Record types:

``DATA``      a piece of one message on ``stream``. ``FIRST`` starts a message, ``arg`` = its total
              size; ``LAST`` ends it. A message of up to one record is one ``FIRST|LAST`` record.
``WINDOW``    ``arg`` bytes of credit back to the sender: for ``stream``, or for the whole
              connection when ``stream`` is 0. Flag ``LARGE_DONE``: the one large message in
              flight on the connection was consumed.
``EOF``       the sender will send nothing more on ``stream``.
``RESET``     the sender abandons ``stream`` in both directions; ``arg`` is a reason code.
``STOP``      the sender closed ``stream`` and will read nothing more from it.
``GOAWAY``    the sender closes the connection; ``arg`` is a reason code (0: normal).
``PING``      keep-alive; nothing answers it.
``AUTH``      the handshake's authentication record, only as the first record of a direction.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from swarmavg.errors import RemoteProtocolError

HEADER: Final = struct.Struct("!IBBHII")
HEADER_SIZE: Final = HEADER.size  # 16
TAG_SIZE: Final = 16

DATA: Final = 0
WINDOW: Final = 1
EOF: Final = 2
RESET: Final = 3
STOP: Final = 4
GOAWAY: Final = 5
PING: Final = 6
AUTH: Final = 7
MAX_TYPE: Final = AUTH

# DATA flags
FIRST: Final = 1
LAST: Final = 2
#: The message this record ends is the stream's last: the EOF rides with it (only with LAST).
FIN: Final = 4
# WINDOW flags
LARGE_DONE: Final = 1

# RESET / GOAWAY reason codes
NO_ERROR: Final = 0
PROTOCOL_ERROR: Final = 1
INTERNAL_ERROR: Final = 2
CANCELLED: Final = 3
IDLE: Final = 4
#: RESET of a stream we did not take: too many of the peer's streams wait to be accepted.
REFUSED: Final = 5

#: Credit a message costs beyond its size, so that floods of empty messages are bounded too.
MESSAGE_OVERHEAD: Final = 64

_SETTINGS: Final = struct.Struct("!IIIII")
SETTINGS_SIZE: Final = _SETTINGS.size


@dataclass(frozen=True, slots=True)
class Settings:
    """What one side accepts; sent in its AUTH record, obeyed by the other side's sender.

    :param max_message_size: the largest message it receives, in bytes.
    :param stream_window: bytes of messages one stream may have in flight to it, unread.
    :param connection_window: the same for all streams of the connection together
        (at least ``stream_window``).
    :param max_streams: streams the other side may have open towards it at once.
    :param max_record_size: the largest record payload it accepts.
    """

    max_message_size: int = 128 << 20
    stream_window: int = 16 << 20
    connection_window: int = 64 << 20
    max_streams: int = 256
    max_record_size: int = 256 << 10

    def __post_init__(self) -> None:
        checks = {
            "max_message_size": (1 << 20, (1 << 32) - 1),
            "stream_window": (256 << 10, 1 << 30),
            "connection_window": (256 << 10, 1 << 31),
            "max_streams": (1, 1 << 20),
            "max_record_size": (16 << 10, 16 << 20),
        }
        for name, (low, high) in checks.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"{name} must be an int in [{low}, {high}], not {value!r}")
        if self.connection_window < self.stream_window:
            raise ValueError("connection_window must be at least stream_window")

    def to_bytes(self) -> bytes:
        return _SETTINGS.pack(
            self.max_message_size,
            self.stream_window,
            self.connection_window,
            self.max_streams,
            self.max_record_size,
        )

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> Settings:
        """Parse a peer's settings; :class:`RemoteProtocolError` if malformed or out of range."""
        if len(data) != SETTINGS_SIZE:
            raise RemoteProtocolError("malformed settings")
        try:
            return cls(*_SETTINGS.unpack(data))
        except ValueError as exc:
            raise RemoteProtocolError(f"unacceptable settings: {exc}") from None

    def is_large(self, size: int) -> bool:
        """Whether a message of ``size`` bytes takes the one large-message slot (see design)."""
        return size + MESSAGE_OVERHEAD > self.stream_window // 2


class Sealer:
    """Seals the records of one direction: AES-128-GCM, counter nonces, header as AAD."""

    __slots__ = ("_aead", "_nonce", "counter")

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._nonce = bytearray(12)
        self.counter = 0

    def _next_nonce(self) -> bytearray:
        if self.counter >= 1 << 64:
            raise RemoteProtocolError("record counter exhausted; the connection must be renewed")
        struct.pack_into("!4xQ", self._nonce, 0, self.counter)
        self.counter += 1
        return self._nonce

    def seal_into(
        self, header: bytes | bytearray | memoryview, payload: memoryview, out: memoryview
    ) -> None:
        """Write ``ciphertext || tag`` of ``payload`` into ``out`` (``len(payload) + 16``)."""
        self._aead.encrypt_into(self._next_nonce(), payload, header, out)

    def open_into(self, header: bytes | memoryview, sealed: memoryview, out: memoryview) -> None:
        """Check and decrypt ``sealed`` (ciphertext || tag) into ``out``.

        :raises RemoteProtocolError: if the record was forged, altered or is out of order.
        """
        try:
            self._aead.decrypt_into(self._next_nonce(), sealed, header, out)
        except InvalidTag:
            raise RemoteProtocolError("a record failed authentication") from None


def check_header(length: int, ftype: int, flags: int, reserved: int, max_record_size: int) -> None:
    """Validate a record header before its payload is read."""
    if ftype > MAX_TYPE:
        raise RemoteProtocolError(f"unknown record type {ftype}")
    if reserved:
        raise RemoteProtocolError("reserved header bits are set")
    if ftype == DATA:
        if length > max_record_size:
            raise RemoteProtocolError(f"record of {length} bytes exceeds {max_record_size}")
        if flags & ~(FIRST | LAST | FIN):
            raise RemoteProtocolError("unknown DATA flags")
        if flags & FIN and not flags & LAST:
            raise RemoteProtocolError("FIN on a record that does not end its message")
    else:
        if ftype == AUTH:
            if length > 1024:
                raise RemoteProtocolError("oversized AUTH record")
        elif length:
            raise RemoteProtocolError("control records carry no payload")
        if flags & ~(LARGE_DONE if ftype == WINDOW else 0):
            raise RemoteProtocolError(f"unknown flags {flags:#x} on a record of type {ftype}")
