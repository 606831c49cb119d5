"""The QUIC TLS identity layer, on a pair of aioquic sans-IO connections (no sockets)."""

from __future__ import annotations

import pytest
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from swarmavg.errors import PeerIdentityMismatch, RemoteProtocolError
from swarmavg.identity import Identity
from swarmavg_quic._tls import (
    ALPN,
    AuthenticatingConnection,
    authenticated_peer,
    certificate_for,
    check_aioquic,
    configuration,
)

CLIENT_ADDR = ("127.0.0.1", 40001)
SERVER_ADDR = ("127.0.0.1", 40002)


def _handshake(
    client: QuicConnection, server_config: QuicConfiguration
) -> tuple[QuicConnection, list[events.QuicEvent], list[events.QuicEvent]]:
    """Pump datagrams between ``client`` and a server made on its first datagram, until both
    are quiet; return the server and each side's events."""
    now = 1000.0
    client.connect(SERVER_ADDR, now=now)
    server: QuicConnection | None = None
    client_events: list[events.QuicEvent] = []
    server_events: list[events.QuicEvent] = []
    for _ in range(50):
        moved = False
        for data, _ in client.datagrams_to_send(now=now):
            if server is None:
                server = AuthenticatingConnection(
                    configuration=server_config,
                    original_destination_connection_id=client.original_destination_connection_id,
                )
            server.receive_datagram(data, CLIENT_ADDR, now=now)
            moved = True
        if server is not None:
            for data, _ in server.datagrams_to_send(now=now):
                client.receive_datagram(data, SERVER_ADDR, now=now)
                moved = True
        while (event := client.next_event()) is not None:
            client_events.append(event)
        while server is not None and (event := server.next_event()) is not None:
            server_events.append(event)
        if not moved:
            break
        now += 0.001
    assert server is not None
    return server, client_events, server_events


def _completed(evs: list[events.QuicEvent]) -> bool:
    return any(isinstance(e, events.HandshakeCompleted) for e in evs)


def test_both_sides_prove_their_identity() -> None:
    alice, bob = Identity.generate(), Identity.generate()
    client = AuthenticatingConnection(configuration=configuration(alice, is_client=True))
    server, c_events, s_events = _handshake(client, configuration(bob, is_client=False))
    assert _completed(c_events)
    assert _completed(s_events)
    assert next(e for e in c_events if isinstance(e, events.HandshakeCompleted)).alpn_protocol == (
        ALPN
    )
    assert authenticated_peer(client, bob.peer_id) == bob.peer_id
    assert authenticated_peer(server) == alice.peer_id
    assert authenticated_peer(server, alice.peer_id) == alice.peer_id


def test_dialing_a_peer_id_another_key_answers_is_refused() -> None:
    alice, bob, carol = Identity.generate(), Identity.generate(), Identity.generate()
    client = AuthenticatingConnection(configuration=configuration(alice, is_client=True))
    _handshake(client, configuration(bob, is_client=False))
    with pytest.raises(PeerIdentityMismatch, match=str(bob.peer_id)):
        authenticated_peer(client, carol.peer_id)


def test_a_certificate_for_a_key_the_peer_does_not_hold_fails_the_handshake() -> None:
    """Presenting someone else's certificate: the CertificateVerify signature cannot match."""
    alice, bob, mallory = Identity.generate(), Identity.generate(), Identity.generate()
    stolen = certificate_for(bob)  # bob's certificate, mallory's private key
    client = AuthenticatingConnection(configuration=configuration(alice, is_client=True))
    _, c_events, s_events = _handshake(
        client, configuration(mallory, is_client=False, certificate=stolen)
    )
    assert not _completed(c_events)  # the client rejected the signature and closed
    assert not _completed(s_events)


def test_a_client_without_a_certificate_is_not_authenticated() -> None:
    """TLS lets a client answer the certificate request with nothing; we refuse that."""
    bob = Identity.generate()
    anonymous = QuicConfiguration(is_client=True, alpn_protocols=[ALPN])
    anonymous.verify_mode = configuration(bob, is_client=True).verify_mode
    client = AuthenticatingConnection(configuration=anonymous)
    server, _, s_events = _handshake(client, configuration(bob, is_client=False))
    assert _completed(s_events)
    with pytest.raises(RemoteProtocolError, match="no certificate"):
        authenticated_peer(server)


def test_a_plain_server_would_not_ask_for_the_client_certificate() -> None:
    """Why AuthenticatingConnection exists: without its hook the server never learns who the
    client is (if this starts failing, aioquic gained an API for it: use that)."""
    alice, bob = Identity.generate(), Identity.generate()
    client = AuthenticatingConnection(configuration=configuration(alice, is_client=True))
    now = 1000.0
    client.connect(SERVER_ADDR, now=now)
    server = QuicConnection(
        configuration=configuration(bob, is_client=False),
        original_destination_connection_id=client.original_destination_connection_id,
    )
    for _ in range(20):
        for data, _ in client.datagrams_to_send(now=now):
            server.receive_datagram(data, CLIENT_ADDR, now=now)
        for data, _ in server.datagrams_to_send(now=now):
            client.receive_datagram(data, SERVER_ADDR, now=now)
        now += 0.001
    with pytest.raises(RemoteProtocolError, match="no certificate"):
        authenticated_peer(server)


def test_the_certificate_carries_the_identity_key() -> None:
    alice = Identity.generate()
    cert = certificate_for(alice)
    key = cert.public_key()
    assert isinstance(key, Ed25519PublicKey)
    assert key.public_bytes_raw() == alice.peer_id.public_key_bytes
    assert str(alice.peer_id) in cert.subject.rfc4514_string()


def test_the_private_aioquic_hooks_are_there() -> None:
    check_aioquic()
