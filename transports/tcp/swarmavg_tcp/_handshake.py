"""The swarmavg-tcp handshake (sans-IO): ephemeral X25519, Ed25519 signatures over the transcript.

Both sides, without waiting for each other::

    -> HELLO   "SWAV" | version u8 | flags u8 | 0 u16 | X25519 ephemeral public key (32)   40 bytes

then, having read the other HELLO, both derive the session keys and send::

    -> AUTH record (see _frames): Ed25519 public key (32) | signature (64) | settings (20)

* ``transcript = SHA-256("swarmavg-tcp/1" | initiator HELLO | responder HELLO)``.
* ``k_i2r | k_r2i = HKDF-SHA256(X25519 secret, salt=transcript, info="swarmavg-tcp/1 keys")``,
  one AES-128-GCM key per direction; the AUTH record is the first record sealed with it.
* The signature covers ``"swarmavg-tcp/1 auth" | role | transcript | settings``: it proves the key
  behind the PeerID, binds it to these ephemeral keys (so it cannot be replayed into another
  connection, nor reflected, the role being signed) and to the settings.
* Data is encrypted unless *both* sides set the plaintext flag. The flags are part of the signed
  transcript, so nobody in the middle can turn encryption off.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Final

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from swarmavg.errors import PeerIdentityMismatch, RemoteProtocolError
from swarmavg.identity import Identity, PeerID
from swarmavg_tcp._frames import SETTINGS_SIZE, Sealer, Settings

MAGIC: Final = b"SWAV"
VERSION: Final = 1
HELLO: Final = struct.Struct("!4sBBH32s")
HELLO_SIZE: Final = HELLO.size  # 40
FLAG_PLAINTEXT: Final = 1
AUTH_SIZE: Final = 32 + 64 + SETTINGS_SIZE
#: AES-128-GCM, as TLS 1.3's mandatory suite: a third faster than AES-256 here, and 128-bit
#: keys fresh for every connection are far beyond reach.
KEY_SIZE: Final = 16

_PROTOCOL: Final = b"swarmavg-tcp/1"


class Handshake:
    """One side's handshake state.

    Use: send :attr:`hello`; feed the peer's 40 bytes to :meth:`receive_hello`; send
    :meth:`auth_payload` as the AUTH record (sealed with :attr:`send_sealer` when
    :attr:`encrypted`); check the peer's AUTH payload with :meth:`verify_auth`.
    """

    def __init__(
        self,
        identity: Identity,
        *,
        is_initiator: bool,
        encryption: bool,
        settings: Settings,
    ) -> None:
        self.identity = identity
        self.is_initiator = is_initiator
        self.settings = settings
        self._ephemeral = X25519PrivateKey.generate()
        public = self._ephemeral.public_key().public_bytes_raw()
        self.hello = HELLO.pack(MAGIC, VERSION, 0 if encryption else FLAG_PLAINTEXT, 0, public)
        self.encrypted = encryption
        self._transcript = b""
        self.send_sealer: Sealer | None = None
        self.recv_opener: Sealer | None = None

    def receive_hello(self, data: bytes) -> None:
        """Take the peer's HELLO and derive the session keys.

        :raises RemoteProtocolError: if it is not a swarmavg-tcp/1 HELLO.
        """
        if len(data) != HELLO_SIZE:
            raise RemoteProtocolError("truncated HELLO")
        magic, version, flags, reserved, peer_public = HELLO.unpack(data)
        if magic != MAGIC:
            raise RemoteProtocolError("not a swarmavg-tcp peer")
        if version != VERSION:
            raise RemoteProtocolError(f"unsupported swarmavg-tcp version {version}")
        if flags & ~FLAG_PLAINTEXT or reserved:
            raise RemoteProtocolError("unknown HELLO flags")
        self.encrypted = self.encrypted or not flags & FLAG_PLAINTEXT
        ours, theirs = self.hello, bytes(data)
        first, second = (ours, theirs) if self.is_initiator else (theirs, ours)
        self._transcript = hashlib.sha256(_PROTOCOL + first + second).digest()
        try:
            shared = self._ephemeral.exchange(X25519PublicKey.from_public_bytes(peer_public))
        except ValueError:  # a low-order point gives an all-zero secret
            raise RemoteProtocolError("invalid ephemeral key") from None
        keys = HKDF(
            algorithm=hashes.SHA256(),
            length=2 * KEY_SIZE,
            salt=self._transcript,
            info=_PROTOCOL + b" keys",
        ).derive(shared)
        i2r, r2i = keys[:KEY_SIZE], keys[KEY_SIZE:]
        send_key, recv_key = (i2r, r2i) if self.is_initiator else (r2i, i2r)
        if self.encrypted:
            self.send_sealer = Sealer(send_key)
            self.recv_opener = Sealer(recv_key)

    def _signed_data(self, initiator: bool, settings: bytes) -> bytes:
        role = b"I" if initiator else b"R"
        return _PROTOCOL + b" auth" + role + self._transcript + settings

    def auth_payload(self) -> bytes:
        """Our AUTH record payload: public key, signature, settings."""
        if not self._transcript:
            raise RuntimeError("receive_hello() first")
        settings = self.settings.to_bytes()
        signature = self.identity.sign(self._signed_data(self.is_initiator, settings))
        return self.identity.peer_id.public_key_bytes + signature + settings

    def verify_auth(self, payload: bytes, expected: PeerID | None) -> tuple[PeerID, Settings]:
        """Check the peer's AUTH payload; return its PeerID and settings.

        :raises PeerIdentityMismatch: if ``expected`` is given and another key answered.
        :raises RemoteProtocolError: if the payload is malformed or the signature is wrong.
        """
        if len(payload) != AUTH_SIZE:
            raise RemoteProtocolError("malformed AUTH record")
        try:
            peer_id = PeerID.from_public_key(bytes(payload[:32]))
        except ValueError:
            raise RemoteProtocolError("invalid public key in AUTH") from None
        signature, settings_bytes = bytes(payload[32:96]), bytes(payload[96:])
        if not peer_id.verify(signature, self._signed_data(not self.is_initiator, settings_bytes)):
            raise RemoteProtocolError("the peer's handshake signature is invalid")
        if expected is not None and peer_id != expected:
            raise PeerIdentityMismatch(expected, peer_id)
        return peer_id, Settings.from_bytes(settings_bytes)
