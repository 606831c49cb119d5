"""Peer identity: Ed25519 key pairs and the PeerIDs that embed their public keys.

A :class:`PeerID` is the libp2p encoding of an Ed25519 public key: an *identity multihash* of the
protobuf-encoded key, printed in base58btc (``12D3KooW…``). Because the key itself is inside the
ID, anyone can check a signature from the PeerID alone, also long after that peer left the swarm,
and the text form is the one hivemind users already see in multiaddrs.

An :class:`Identity` holds the private key. It can be persisted to a file created with mode 0600;
loading refuses a key file that other users can read.
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat
from pathlib import Path
from typing import Final

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

__all__ = ["Identity", "PeerID"]

# identity multihash (code 0x00, length 36) of the protobuf message
# PublicKey{Type: Ed25519 (1), Data: <32 bytes>} = 08 01 12 20 <key>
_PREFIX: Final = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])
_KEY_LEN: Final = 32
_ID_LEN: Final = len(_PREFIX) + _KEY_LEN
_B58_ALPHABET: Final = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX: Final = {c: i for i, c in enumerate(_B58_ALPHABET)}
_MAX_TEXT_LEN: Final = 64  # 38 bytes encode to 52 base58 characters


@functools.lru_cache(maxsize=8192)  # the peers a node talks to repeat
def _b58encode(data: bytes) -> str:
    zeros = len(data) - len(data.lstrip(b"\0"))
    number = int.from_bytes(data, "big")
    out = []
    while number:
        number, rem = divmod(number, 58)
        out.append(_B58_ALPHABET[rem])
    return "1" * zeros + "".join(reversed(out))


def _b58decode(text: str) -> bytes:
    number = 0
    for char in text:
        try:
            number = number * 58 + _B58_INDEX[char]
        except KeyError:
            raise ValueError(f"invalid base58 character {char!r}") from None
    zeros = len(text) - len(text.lstrip("1"))
    body = number.to_bytes((number.bit_length() + 7) // 8, "big") if number else b""
    return b"\0" * zeros + body


class PeerID:
    """The public identity of a peer: an Ed25519 public key in libp2p's PeerID encoding.

    Immutable, hashable and ordered (by its bytes), so it can be a dict key and break ties.
    ``str(peer_id)`` gives the base58 text; :meth:`from_string` parses it back.
    """

    __slots__ = ("_bytes", "_digest", "_key")

    def __init__(self, raw: bytes) -> None:
        """Wrap the binary PeerID ``raw`` (38 bytes).

        :raises ValueError: if ``raw`` is not an Ed25519 identity-multihash PeerID.
        """
        if not isinstance(raw, bytes | bytearray | memoryview):
            raise TypeError(f"raw must be bytes, not {type(raw).__name__}")
        raw = bytes(raw)
        if len(raw) != _ID_LEN or not raw.startswith(_PREFIX):
            raise ValueError("not an Ed25519 PeerID (expected a 38-byte identity multihash)")
        self._bytes = raw
        self._key: Ed25519PublicKey | None = None
        self._digest: bytes | None = None

    @classmethod
    def from_public_key(cls, key: Ed25519PublicKey | bytes) -> PeerID:
        """The PeerID of an Ed25519 public key (an object or its 32 raw bytes)."""
        if isinstance(key, Ed25519PublicKey):
            key = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        if len(key) != _KEY_LEN:
            raise ValueError("an Ed25519 public key has 32 bytes")
        return cls(_PREFIX + bytes(key))

    @classmethod
    def from_string(cls, text: str) -> PeerID:
        """Parse the base58 text form (``12D3KooW…``).

        :raises ValueError: if ``text`` is not a valid Ed25519 PeerID.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, not {type(text).__name__}")
        if not 0 < len(text) <= _MAX_TEXT_LEN:
            raise ValueError(f"not a PeerID: {text[:80]!r}")
        try:
            return cls(_b58decode(text))
        except ValueError as exc:
            raise ValueError(f"not a PeerID: {text!r} ({exc})") from None

    def to_bytes(self) -> bytes:
        """The 38-byte binary form (what goes on the wire)."""
        return self._bytes

    def to_string(self) -> str:
        """The base58 text form."""
        return _b58encode(self._bytes)

    @property
    def public_key_bytes(self) -> bytes:
        """The raw 32-byte Ed25519 public key embedded in this ID."""
        return self._bytes[len(_PREFIX) :]

    @property
    def public_key(self) -> Ed25519PublicKey:
        """The embedded public key as a ``cryptography`` object."""
        if self._key is None:
            self._key = Ed25519PublicKey.from_public_bytes(self.public_key_bytes)
        return self._key

    def verify(self, signature: bytes, data: bytes) -> bool:
        """Whether ``signature`` is this peer's Ed25519 signature of ``data``.

        Never raises on a bad signature: it returns ``False``, so that a forged or garbled
        signature from the network cannot escape as an unexpected exception.
        """
        if len(signature) != 64:
            return False
        try:
            self.public_key.verify(bytes(signature), bytes(data))
        except (InvalidSignature, ValueError):
            return False
        return True

    def digest(self) -> bytes:
        """A SHA-256 hash of the binary ID (used as the Kademlia node id); computed once."""
        if self._digest is None:
            self._digest = hashlib.sha256(self._bytes).digest()
        return self._digest

    def __str__(self) -> str:
        return self.to_string()

    def __repr__(self) -> str:
        return f"PeerID({self.to_string()!r})"

    def short(self) -> str:
        """A short form for logs: the last 8 characters of the text form."""
        return "…" + self.to_string()[-8:]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PeerID):
            return NotImplemented
        return self._bytes == other._bytes

    def __lt__(self, other: PeerID) -> bool:
        if not isinstance(other, PeerID):
            return NotImplemented
        return self._bytes < other._bytes

    def __hash__(self) -> int:
        return hash(self._bytes)

    def __reduce__(self) -> tuple[type[PeerID], tuple[bytes]]:
        # Lets PeerIDs cross into worker processes through multiprocessing; never used on the wire.
        return (PeerID, (self._bytes,))


class Identity:
    """A peer's Ed25519 key pair. Keep it secret: whoever holds it can act as this peer."""

    __slots__ = ("_key", "peer_id")

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        if not isinstance(private_key, Ed25519PrivateKey):
            raise TypeError("private_key must be an Ed25519PrivateKey")
        self._key = private_key
        self.peer_id = PeerID.from_public_key(private_key.public_key())

    @classmethod
    def generate(cls) -> Identity:
        """A fresh random identity."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> Identity:
        """An identity from the 32-byte raw Ed25519 private key (seed)."""
        if len(raw) != 32:
            raise ValueError("an Ed25519 private key has 32 bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(bytes(raw)))

    @property
    def private_key(self) -> Ed25519PrivateKey:
        return self._key

    def private_bytes(self) -> bytes:
        """The 32-byte raw private key. Handle with care."""
        return self._key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    def sign(self, data: bytes) -> bytes:
        """A 64-byte Ed25519 signature of ``data``."""
        return self._key.sign(bytes(data))

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """Write the key to ``path`` as unencrypted PKCS#8 PEM, created with mode 0600.

        :raises FileExistsError: if the file exists and ``overwrite`` is false.
        """
        pem = self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        path = Path(path)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
        fd = os.open(path, flags, 0o600)
        try:
            if hasattr(os, "fchmod"):
                os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to an existing file
            os.write(fd, pem)
        finally:
            os.close(fd)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        """Read a key written by :meth:`save`.

        :raises PermissionError: if group or other users may read the file (POSIX only).
        :raises ValueError: if the file does not hold an Ed25519 private key.
        """
        path = Path(path)
        with path.open("rb") as f:
            if os.name == "posix":
                mode = os.fstat(f.fileno()).st_mode
                if mode & (stat.S_IRWXG | stat.S_IRWXO):
                    raise PermissionError(
                        f"key file {path} is readable by other users (mode {stat.filemode(mode)}); "
                        f"run `chmod 600 {path}` if it was not leaked, or make a new identity"
                    )
            data = f.read(64 * 1024)
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path} does not hold an unencrypted PEM private key") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """Load the identity at ``path``, or make one and save it there if the file is missing."""
        try:
            return cls.load(path)
        except FileNotFoundError:
            identity = cls.generate()
            try:
                identity.save(path)
            except FileExistsError:  # another process created it first: use theirs
                return cls.load(path)
            return identity

    def __repr__(self) -> str:
        return f"Identity({self.peer_id})"
