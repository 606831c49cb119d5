"""DHT record validators (sans-IO): owner signatures, schemas, composition."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmavg.identity import Identity
from swarmavg.proto.dht_validation import (
    CompositeValidator,
    DHTRecord,
    RecordValidator,
    SchemaValidator,
    SignatureValidator,
    owner_marker,
)
from swarmavg.proto.dht_values import pack, unpack

T = 2_000_000_000.0
_OWNER = Identity.generate()  # (module-wide key pairs: hypothesis runs hundreds of examples)
_READER = Identity.generate()


def _pack(value: Any) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def _signed(identity: Identity, key: bytes, value: bytes, subkey: bytes | None = None) -> DHTRecord:
    plain = DHTRecord(key, subkey, value, T)
    return DHTRecord(key, subkey, SignatureValidator(identity).sign_value(plain), T)


def test_records_without_an_owner_pass_unchanged() -> None:
    validator = SignatureValidator(Identity.generate())
    record = DHTRecord(b"key", None, b"value", T)
    assert validator.validate(record)
    assert validator.sign_value(record) == b"value"
    assert validator.strip_value(record) == b"value"


@pytest.mark.parametrize("where", ["key", "subkey"])
def test_the_owner_signs_and_everyone_can_check(where: str) -> None:
    owner = Identity.generate()
    marker = owner_marker(owner.peer_id)
    key, subkey = (b"progress" + marker, b"s") if where == "key" else (b"progress", b"s" + marker)
    record = _signed(owner, key, _pack({"step": 7}), subkey)
    reader = SignatureValidator(Identity.generate())  # anybody, without the owner online
    assert reader.validate(record)
    assert msgpack.unpackb(reader.strip_value(record)) == {"step": 7}
    # the signature is bound to the key, the subkey, the value and the expiration
    for changed in (
        DHTRecord(key + b"x", subkey, record.value, T),
        DHTRecord(key, (subkey or b"") + b"x", record.value, T),
        DHTRecord(key, subkey, record.value, T + 1),
    ):
        assert not reader.validate(changed)
    _, signature = msgpack.unpackb(record.value)
    forged = _pack([_pack({"step": 8}), signature])
    assert not reader.validate(DHTRecord(key, subkey, forged, T))


def test_a_record_checked_once_is_not_checked_again_but_any_change_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Declarations and progress records are read again and again (every poll of a group
    key): a record whose signature checked out is remembered, by a digest of exactly what
    came, so the next read costs no Ed25519 check; a record that differs in any byte is
    checked (and refused), and the memory is bounded."""
    owner = Identity.generate()
    key, subkey = b"run.0b", owner_marker(owner.peer_id)
    record = _signed(owner, key, _pack({"looking": True}), subkey)
    reader = SignatureValidator(Identity.generate())
    checks: list[bytes] = []
    verify = type(owner.peer_id).verify

    def counting(self: Any, signature: bytes, data: bytes) -> bool:
        checks.append(data)
        return verify(self, signature, data)

    monkeypatch.setattr(type(owner.peer_id), "verify", counting)
    for _ in range(5):
        assert reader.validate(DHTRecord(key, subkey, bytes(record.value), T))
    assert len(checks) == 1
    _, signature = msgpack.unpackb(record.value)
    forged = _pack([_pack({"looking": False}), signature])
    assert not reader.validate(DHTRecord(key, subkey, forged, T))
    assert not reader.validate(DHTRecord(key, subkey, record.value, T + 1))
    assert len(checks) == 3
    monkeypatch.setattr("swarmavg.proto.dht_validation._VERIFIED_CACHE", 4)
    for step in range(10):
        assert reader.validate(_signed(owner, key, _pack({"step": step}), subkey))
    assert len(reader._verified) == 4


def test_an_owner_record_with_tuples_in_its_key_and_value_round_trips() -> None:
    owner = Identity.generate()
    key = pack(("progress", owner_marker(owner.peer_id).decode()), "key")
    value = pack({"step": (7, ("a", [1, (2,)]))})
    record = _signed(owner, key, value, pack(("peer", 1), "subkey"))
    reader = CompositeValidator([SignatureValidator(Identity.generate())])
    assert reader.validate(record)  # the marker is found inside the packed tuple
    assert reader.strip_value(record) == value  # the bytes the owner signed, as it packed them
    assert unpack(reader.strip_value(record)) == {"step": (7, ("a", [1, (2,)]))}
    # the same items in lists are other bytes: the signature does not cover them
    _, signature = msgpack.unpackb(record.value)
    as_lists = _pack([pack({"step": [7, ["a", [1, [2]]]]}), signature])
    assert not reader.validate(DHTRecord(key, record.subkey, as_lists, T))
    assert not reader.validate(DHTRecord(key, pack(("peer", 2), "subkey"), record.value, T))


def test_a_schema_types_tuples_and_lists() -> None:
    schema = SchemaValidator(
        {"pair": tuple[str, int], "names": list[str], "pairs": list[tuple[str, int]]},
        allow_extra_keys=False,
    )

    def valid(key: str, value: Any) -> bool:
        return schema.validate(DHTRecord(pack(key, "key"), None, pack(value), T))

    assert valid("pair", ("a", 1))
    assert valid("pair", ["a", 1])  # a msgpack array, from a writer that does not keep tuples
    assert not valid("pair", ("a", 1, 2))
    assert not valid("pair", (1, "a"))
    assert valid("names", ["a", "b"])
    assert not valid("names", ("a", "b"))  # a tuple is not a list
    assert valid("pairs", [("a", 1), ["b", 2]])
    assert not valid("pairs", [("a", "b")])
    # an extension type the DHT does not know, or tuples nested too deep: refused, not raised
    assert not schema.validate(DHTRecord(pack("pair", "key"), None, b"\xd4\x05\x00", T))


def test_a_third_party_cannot_write_an_owner_record() -> None:
    owner, intruder = Identity.generate(), Identity.generate()
    key = b"state" + owner_marker(owner.peer_id)
    with pytest.raises(ValueError, match="another peer"):
        SignatureValidator(intruder).sign_value(DHTRecord(key, None, b"x", T))
    # signing with its own key does not help; sending no signature does not either
    fake = SignatureValidator(intruder).sign_value(
        DHTRecord(b"state" + owner_marker(intruder.peer_id), None, b"x", T)
    )
    reader = SignatureValidator(Identity.generate())
    assert not reader.validate(DHTRecord(key, None, fake, T))
    assert not reader.validate(DHTRecord(key, None, b"x", T))
    with pytest.raises(ValueError, match="without a signature"):
        reader.strip_value(DHTRecord(key, None, b"x", T))


def test_two_owners_or_a_bad_owner_id_make_a_record_nobody_can_write() -> None:
    a, b = Identity.generate(), Identity.generate()
    key = owner_marker(a.peer_id) + owner_marker(b.peer_id)
    with pytest.raises(ValueError, match="another peer"):
        SignatureValidator(a).sign_value(DHTRecord(key, None, b"x", T))
    signed_by_a = _pack([b"x", a.sign(b"anything")])
    assert not SignatureValidator(a).validate(DHTRecord(key, None, signed_by_a, T))
    assert not SignatureValidator(a).validate(DHTRecord(b"[owner:1111]", None, signed_by_a, T))


@settings(deadline=None)
@given(st.binary(max_size=200), st.binary(max_size=64), st.booleans())
def test_garbage_values_are_invalid_never_an_exception(
    value: bytes, suffix: bytes, subkey: bool
) -> None:
    owner = _OWNER
    key = b"k" + owner_marker(owner.peer_id) + suffix
    record = DHTRecord(key, b"s" if subkey else None, value, T)
    assert SignatureValidator(_READER).validate(record) is False
    schema = SchemaValidator({b"k": int}, allow_extra_keys=False)
    assert schema.validate(DHTRecord(b"k", None, value, T)) in (True, False)


def test_schema_restricts_keys_to_typed_values() -> None:
    schema = SchemaValidator(
        {"loss": float, "peers": list[str], "progress": dict[str, tuple[int, float]]},
        subkeys={"progress": str},
        allow_extra_keys=False,
    )
    ok = [
        ("loss", None, 0.5),
        ("loss", None, 3),  # an int is a fine float
        ("peers", None, ["a", "b"]),
        ("progress", "peer1", {"x": [1, 2.5]}),
    ]
    bad = [
        ("loss", None, "high"),
        ("loss", None, True),
        ("peers", None, ["a", 1]),
        ("progress", "peer1", {"x": [1]}),
        ("progress", None, {"x": [1, 2.5]}),  # a dictionary key needs a subkey
        ("progress", 7, {"x": [1, 2.5]}),  # a subkey of the wrong type
        ("unknown", None, 1),
    ]
    for key, subkey, value in ok:
        record = DHTRecord(_pack(key), None if subkey is None else _pack(subkey), _pack(value), T)
        assert schema.validate(record), (key, value)
    for key, subkey, value in bad:
        record = DHTRecord(_pack(key), None if subkey is None else _pack(subkey), _pack(value), T)
        assert not schema.validate(record), (key, value)
    assert SchemaValidator({"loss": float}).validate(DHTRecord(_pack("other"), None, b"\xc1", T))
    with pytest.raises(TypeError, match="msgpack types"):
        SchemaValidator({"x": set[int]})
    with pytest.raises(TypeError, match="msgpack types"):
        SchemaValidator({"x": list[complex]})


def test_validators_compose() -> None:
    owner = Identity.generate()
    key = _pack("loss") + owner_marker(owner.peer_id)  # (a bytes key: the schema names it so)
    schema = SchemaValidator({key: float})
    writer = CompositeValidator([schema, SignatureValidator(owner)])
    reader = CompositeValidator([SignatureValidator(Identity.generate()), schema])
    assert [type(v) for v in reader.validators] == [SchemaValidator, SignatureValidator]
    signed = writer.sign_value(DHTRecord(key, None, _pack(0.25), T))
    record = DHTRecord(key, None, signed, T)
    assert reader.validate(record)  # the signature, then the schema on the stripped value
    assert msgpack.unpackb(reader.strip_value(record)) == 0.25
    wrong_type = writer.sign_value(DHTRecord(key, None, _pack("x"), T))
    assert not reader.validate(DHTRecord(key, None, wrong_type, T))
    # composing the same kinds again merges them instead of running them twice
    more = CompositeValidator([reader, SchemaValidator({"other": int}), SignatureValidator(owner)])
    assert len(more.validators) == 2
    assert not more.validate(DHTRecord(_pack("other"), None, _pack("no"), T))


def test_a_custom_validator() -> None:
    class EvenLength(RecordValidator):
        def validate(self, record: DHTRecord) -> bool:
            return len(record.value) % 2 == 0

    both = CompositeValidator([EvenLength(), SignatureValidator(Identity.generate())])
    assert both.validate(DHTRecord(b"k", None, b"ab", T))
    assert not both.validate(DHTRecord(b"k", None, b"abc", T))
