"""Validators for DHT records (sans-IO): owner signatures, typed schemas, and their composition.

A DHT record is ``(key, subkey, value, expiration_time)``; keys, subkeys and values are the bytes
they travel as (msgpack with tuples kept, see :mod:`swarmavg.proto.dht_values`). Before a node
stores a record, and after it gets one from the network, it runs its validator: a record that
does not validate is refused on store and ignored on get, so a peer cannot poison what others
read. A signature covers the value's bytes as its writer packed them; readers check those same
bytes (nothing is re-packed), so how a value is packed never breaks a signature.

Owner records. A key or subkey that contains ``[owner:<peer-id>]`` names an owner: only that
peer may write the record. Its value then travels signed: the msgpack array
``[value, signature]``, where the signature is the owner's Ed25519 signature over the msgpack
array ``["swarmavg/dht-record/1", key, subkey, value, expiration_time]`` (so a signature cannot
be moved to another key, subkey or expiration, and an old value cannot be replayed with a new
expiration). The PeerID embeds the public key, so anyone can check the signature, also after the
owner left. A record may name at most one owner.

Validators compose (:class:`CompositeValidator`): a record is valid if every validator accepts
it; writing applies the validators' ``sign_value`` in order of ``priority`` (highest first), and
reading undoes them with ``strip_value`` in the reverse order, so a signature covers what the
lower-priority validators produced.
"""

from __future__ import annotations

import hashlib
import re
import types
import typing
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Union

import msgpack

from swarmavg.errors import RemoteProtocolError
from swarmavg.identity import Identity, PeerID
from swarmavg.proto.dht_values import pack, unpack

__all__ = [
    "CompositeValidator",
    "DHTRecord",
    "RecordValidator",
    "SchemaValidator",
    "SignatureValidator",
    "owner_marker",
    "owner_of",
]

_OWNER: Final = re.compile(rb"\[owner:([1-9A-HJ-NP-Za-km-z]{1,128})\]")
_CONTEXT: Final = "swarmavg/dht-record/1"
#: Records (and owners) a :class:`SignatureValidator` remembers as checked.
_VERIFIED_CACHE: Final = 4096
_MAX_SCHEMA_DEPTH: Final = 32


@dataclass(frozen=True, slots=True)
class DHTRecord:
    """One record as stored: ``subkey`` is ``None`` for a plain value."""

    key: bytes
    subkey: bytes | None
    value: bytes
    expiration_time: float


def owner_marker(peer: PeerID) -> bytes:
    """The bytes to put in a key or subkey to make ``peer`` its only writer."""
    return b"[owner:" + str(peer).encode() + b"]"


def owner_of(subkey: object) -> PeerID | None:
    """The peer that ``subkey`` (as a get returns it) makes its only writer: an exact
    :func:`owner_marker`, so the DHT checked that peer's signature on the record; ``None`` for
    anything else, which anyone could have written."""
    if not isinstance(subkey, bytes) or not subkey.startswith(b"[owner:"):
        return None
    try:
        peer = PeerID.from_string(subkey[len(b"[owner:") : -1].decode())
    except (ValueError, UnicodeDecodeError):
        return None
    return peer if owner_marker(peer) == subkey else None


class RecordValidator(ABC):
    """Checks records before they are stored and after they are read; may sign on write."""

    #: Validators with a higher priority sign last (their ``sign_value`` sees the others'
    #: output) and strip first.
    priority: int = 0

    @abstractmethod
    def validate(self, record: DHTRecord) -> bool:
        """Whether ``record`` (its value as it travels) is acceptable. Must not raise on any
        input from the network."""

    def sign_value(self, record: DHTRecord) -> bytes:
        """The value to send for ``record`` (default: unchanged)."""
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        """The value as the application wrote it, from a valid ``record`` (default: as is)."""
        return record.value

    def merge_with(self, other: RecordValidator) -> bool:
        """Absorb ``other`` if it is the same kind (so composing twice does not run a check
        twice); whether it did."""
        return False


def _record_owners(record: DHTRecord) -> list[bytes]:
    found = _OWNER.findall(record.key)
    if record.subkey is not None:
        found += _OWNER.findall(record.subkey)
    return found


def _signed_payload(record: DHTRecord, value: bytes) -> bytes:
    subkey = record.subkey if record.subkey is not None else b""
    packed: bytes = msgpack.packb(
        [_CONTEXT, record.key, subkey, value, float(record.expiration_time)], use_bin_type=True
    )
    return packed


def _unpack_signed(value: bytes) -> tuple[bytes, bytes] | None:
    try:
        item = msgpack.unpackb(value, raw=False, max_bin_len=len(value), max_array_len=2)
    except Exception:  # any garbage: not a signed value
        return None
    if (
        isinstance(item, list)
        and len(item) == 2
        and isinstance(item[0], bytes)
        and isinstance(item[1], bytes)
    ):
        return item[0], item[1]
    return None


class SignatureValidator(RecordValidator):
    """Owner records (``[owner:<peer-id>]`` in the key or subkey) must be signed by that owner.

    :param identity: our identity: records naming our PeerID are signed with it on write.
    """

    priority = 10  # sign last: the signature covers what the other validators produced

    def __init__(self, identity: Identity) -> None:
        self.identity = identity
        self._marker = owner_marker(identity.peer_id)
        #: digests of records whose signature checked out, exactly as they came (the same
        #: declarations and progress records are read again and again: a check is ~100 us of
        #: Ed25519), and the owners parsed from their markers (with their public keys loaded);
        #: both bounded
        self._verified: OrderedDict[bytes, None] = OrderedDict()
        self._owners: OrderedDict[bytes, PeerID] = OrderedDict()

    def validate(self, record: DHTRecord) -> bool:
        owners = _record_owners(record)
        if not owners:
            return True
        if len(set(owners)) != 1:
            return False  # two different owners named: nobody can write it
        seen = hashlib.sha256(_signed_payload(record, bytes(record.value))).digest()
        if seen in self._verified:
            self._verified.move_to_end(seen)
            return True
        owner = self._owner(owners[0])
        if owner is None:
            return False
        signed = _unpack_signed(record.value)
        if signed is None:
            return False
        value, signature = signed
        if not owner.verify(signature, _signed_payload(record, value)):
            return False
        self._verified[seen] = None
        if len(self._verified) > _VERIFIED_CACHE:
            self._verified.popitem(last=False)
        return True

    def _owner(self, text: bytes) -> PeerID | None:
        owner = self._owners.get(text)
        if owner is None:
            try:
                owner = PeerID.from_string(text.decode())
            except (ValueError, UnicodeDecodeError):
                return None
            self._owners[text] = owner
            if len(self._owners) > _VERIFIED_CACHE:
                self._owners.popitem(last=False)
        return owner

    def sign_value(self, record: DHTRecord) -> bytes:
        owners = set(_record_owners(record))
        if not owners:
            return record.value
        if owners != {self._marker[len(b"[owner:") : -1]}:
            raise ValueError(
                "this record names another peer as its owner; only that peer can write it"
            )
        signature = self.identity.sign(_signed_payload(record, record.value))
        packed: bytes = msgpack.packb([record.value, signature], use_bin_type=True)
        return packed

    def strip_value(self, record: DHTRecord) -> bytes:
        if not _record_owners(record):
            return record.value
        signed = _unpack_signed(record.value)
        if signed is None:
            raise ValueError("an owner record without a signature")
        return signed[0]

    def merge_with(self, other: RecordValidator) -> bool:
        return isinstance(other, SignatureValidator)


def _check_spec(spec: Any, depth: int = 0) -> None:
    """:raises TypeError: if ``spec`` is not built of types msgpack carries."""
    if depth > _MAX_SCHEMA_DEPTH:
        raise TypeError("a DHT schema type is nested too deeply")
    if spec is Any or spec is None or spec in (type(None), bool, int, float, str, bytes):
        return
    origin = typing.get_origin(spec)
    if origin in (Union, types.UnionType, list, tuple, dict):
        for arg in typing.get_args(spec):
            if arg is not Ellipsis:
                _check_spec(arg, depth + 1)
        return
    raise TypeError(f"a DHT schema type must be built of msgpack types, not {spec!r}")


def _conforms(value: Any, spec: Any, depth: int = 0) -> bool:
    """Whether the msgpack-decoded ``value`` has the type ``spec`` (a type annotation)."""
    if depth > _MAX_SCHEMA_DEPTH:
        return False
    if spec is Any:
        return True
    if spec is None or spec is type(None):
        return value is None
    origin = typing.get_origin(spec)
    args = typing.get_args(spec)
    if origin is Union or origin is types.UnionType:
        return any(_conforms(value, arg, depth + 1) for arg in args)
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0], depth + 1) for v in value)
    if origin is tuple:  # (a plain msgpack array too: what writers that drop tuples send)
        if not isinstance(value, list | tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_conforms(v, args[0], depth + 1) for v in value)
        return len(value) == len(args) and all(
            _conforms(v, a, depth + 1) for v, a in zip(value, args, strict=True)
        )
    if origin is dict:
        return isinstance(value, dict) and all(
            _conforms(k, args[0], depth + 1) and _conforms(v, args[1], depth + 1)
            for k, v in value.items()
        )
    if spec is float:
        return isinstance(value, float | int) and not isinstance(value, bool)
    if spec is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if spec in (bool, str, bytes):
        return isinstance(value, spec)
    return False  # (specs are checked by _check_spec when the validator is made)


class SchemaValidator(RecordValidator):
    """Restricts the values (and subkeys) of the keys it knows to types.

    :param schema: key -> the type of its values, as an annotation over msgpack types
        (``int``, ``float``, ``str``, ``bytes``, ``bool``, ``None``, ``list[...]``,
        ``tuple[...]``, ``dict[...]``, unions, ``Any``); for a dictionary key, the type of
        each subkey's value. ``list[...]`` takes lists; ``tuple[...]`` tuples, and lists too
        (a plain msgpack array: what a writer that does not keep tuples sends).
    :param subkeys: key -> the type of its subkeys (decoded), for dictionary keys.
    :param allow_extra_keys: whether keys the schema does not name are allowed.

    Keys are given as ``str`` (the msgpack-encoded key is compared) or ``bytes`` (as is).
    """

    def __init__(
        self,
        schema: Mapping[str | bytes, Any],
        *,
        subkeys: Mapping[str | bytes, Any] | None = None,
        allow_extra_keys: bool = True,
    ) -> None:
        def encoded(key: str | bytes) -> bytes:
            if isinstance(key, bytes):
                return key
            if isinstance(key, str):
                return pack(key, "key")
            raise TypeError(f"schema keys must be str or bytes, not {key!r}")

        self._values: dict[bytes, list[Any]] = {}
        self._subkeys: dict[bytes, list[Any]] = {}
        for target, source in ((self._values, schema), (self._subkeys, subkeys or {})):
            for key, spec in source.items():
                _check_spec(spec)
                target.setdefault(encoded(key), []).append(spec)
        self.allow_extra_keys = allow_extra_keys

    def validate(self, record: DHTRecord) -> bool:
        specs = self._values.get(record.key)
        if specs is None:
            return self.allow_extra_keys
        try:
            value = unpack(record.value)
            subkey = unpack(record.subkey) if record.subkey is not None else None
        except RemoteProtocolError:  # garbage from the network
            return False
        if not all(_conforms(value, spec) for spec in specs):
            return False
        subkey_specs = self._subkeys.get(record.key)
        if subkey_specs is not None:
            return record.subkey is not None and all(_conforms(subkey, s) for s in subkey_specs)
        return True

    def merge_with(self, other: RecordValidator) -> bool:
        if not isinstance(other, SchemaValidator):
            return False
        for mine, theirs in ((self._values, other._values), (self._subkeys, other._subkeys)):
            for key, specs in theirs.items():
                mine.setdefault(key, []).extend(specs)
        self.allow_extra_keys = self.allow_extra_keys and other.allow_extra_keys
        return True


class CompositeValidator(RecordValidator):
    """Several validators as one: valid if all accept; signing in order of priority."""

    def __init__(self, validators: Iterable[RecordValidator] = ()) -> None:
        self._validators: list[RecordValidator] = []
        self.extend(validators)

    def extend(self, validators: Iterable[RecordValidator]) -> None:
        for validator in validators:
            if isinstance(validator, CompositeValidator):
                self.extend(validator._validators)
                continue
            if not any(mine.merge_with(validator) for mine in self._validators):
                self._validators.append(validator)
        self._validators.sort(key=lambda v: v.priority)

    @property
    def validators(self) -> tuple[RecordValidator, ...]:
        return tuple(self._validators)

    def validate(self, record: DHTRecord) -> bool:
        """Each validator checks the value as it produced it (the higher-priority ones'
        wrapping stripped first)."""
        value = record.value
        for validator in reversed(self._validators):
            current = DHTRecord(record.key, record.subkey, value, record.expiration_time)
            if not validator.validate(current):
                return False
            try:
                value = validator.strip_value(current)
            except ValueError:
                return False
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        value = record.value
        for validator in self._validators:
            value = validator.sign_value(
                DHTRecord(record.key, record.subkey, value, record.expiration_time)
            )
        return value

    def strip_value(self, record: DHTRecord) -> bytes:
        value = record.value
        for validator in reversed(self._validators):
            value = validator.strip_value(
                DHTRecord(record.key, record.subkey, value, record.expiration_time)
            )
        return value
