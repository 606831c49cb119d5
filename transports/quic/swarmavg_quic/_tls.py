"""Peer authentication for QUIC: TLS 1.3 with certificates made from the peers' identity keys.

Each peer presents a self-signed X.509 certificate whose key is its Ed25519 identity key, so
the certificate proves nothing by its issuer (there is none) and everything by its key: TLS
makes each side prove it holds the private key of the certificate it presents (the
CertificateVerify signature, checked by aioquic on both sides), and we check that this key is
the PeerID the connection is for. No CA, no files.

aioquic 1.7 has no public API for two things this needs, so this module is the one place that
uses private parts of it (``check_aioquic`` fails loudly if they change):

* a server asks for the client's certificate only if ``tls.Context._request_client_certificate``
  is set, and the TLS context is made inside ``QuicConnection._initialize``, hence
  :class:`AuthenticatingConnection` overriding it;
* the peer's certificate is ``tls.Context._peer_certificate``.

The server accepts a client that sends no certificate (TLS allows it), and a client learns that
the server rejected its certificate only after its own handshake completed: so both sides call
:func:`authenticated_peer` at ``HandshakeCompleted`` and close the connection when it raises,
before any stream data of that connection is handed on. Session resumption (0-RTT) is never
enabled: a resumed handshake carries no certificates.
"""

from __future__ import annotations

import datetime
import ssl
from typing import Any

from aioquic import tls
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.x509.oid import NameOID

from swarmavg.errors import PeerIdentityMismatch, RemoteProtocolError
from swarmavg.identity import Identity, PeerID

__all__ = [
    "ALPN",
    "AuthenticatingConnection",
    "authenticated_peer",
    "certificate_for",
    "check_aioquic",
    "configuration",
]

#: The ALPN protocol id of swarmavg over QUIC (a peer speaking anything else is refused).
ALPN = "swarmavg/1"
#: CRYPTO_ERROR(bad_certificate): the code we close a connection with whose peer is not who it
#: should be (QUIC carries TLS alerts as 0x100 + alert).
BAD_CERTIFICATE = 0x100 + 42

# Validity is not checked (no CA, no clock agreement between peers): a fixed, wide window.
_NOT_BEFORE = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
_NOT_AFTER = datetime.datetime(9999, 12, 31, tzinfo=datetime.UTC)


def certificate_for(identity: Identity) -> x509.Certificate:
    """A self-signed certificate for ``identity``'s key, named after its PeerID."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(identity.peer_id))])
    key = identity.private_key
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_NOT_BEFORE)
        .not_valid_after(_NOT_AFTER)
        .sign(key, None)  # Ed25519 signs without a separate hash
    )


def configuration(
    identity: Identity,
    *,
    is_client: bool,
    certificate: x509.Certificate | None = None,
    max_datagram_size: int = 1200,
    idle_timeout: float = 60.0,
) -> QuicConfiguration:
    """The aioquic configuration of one side: our certificate and key, no chain verification
    (the peer's key is checked by :func:`authenticated_peer` instead), our ALPN."""
    config = QuicConfiguration(
        is_client=is_client,
        alpn_protocols=[ALPN],
        verify_mode=ssl.CERT_NONE,  # no CA, hostname or date check: the key is what counts
        max_datagram_size=max_datagram_size,
        idle_timeout=idle_timeout,
    )
    # the fields load_cert_chain() fills, without a file
    config.certificate = certificate if certificate is not None else certificate_for(identity)
    config.private_key = identity.private_key
    return config


class AuthenticatingConnection(QuicConnection):
    """A ``QuicConnection`` whose server side asks for the client's certificate."""

    def _initialize(self, peer_cid: bytes) -> None:
        super()._initialize(peer_cid)  # makes self.tls
        if not self._is_client:
            self.tls._request_client_certificate = True


def authenticated_peer(connection: QuicConnection, expected: PeerID | None = None) -> PeerID:
    """The PeerID whose key the peer proved it holds in the handshake (call it at
    ``HandshakeCompleted``).

    :raises PeerIdentityMismatch: if that is not ``expected``.
    :raises RemoteProtocolError: if the peer presented no certificate, or one whose key is not
        an Ed25519 key.
    """
    certificate: x509.Certificate | None = connection.tls._peer_certificate
    if certificate is None:
        raise RemoteProtocolError("the peer presented no certificate")
    key = certificate.public_key()
    if not isinstance(key, Ed25519PublicKey):
        raise RemoteProtocolError(f"the peer's key is a {type(key).__name__}, not Ed25519")
    peer = PeerID.from_public_key(key)
    if expected is not None and peer != expected:
        raise PeerIdentityMismatch(expected, peer)
    return peer


def check_aioquic() -> None:
    """Fail loudly if the private parts of aioquic this module relies on have changed.

    :raises RuntimeError: naming what is missing.
    """
    missing = []
    if not callable(getattr(QuicConnection, "_initialize", None)):
        missing.append("QuicConnection._initialize")
    context: Any = tls.Context(is_client=False)
    for name in ("_request_client_certificate", "_peer_certificate"):
        if not hasattr(context, name):
            missing.append(f"tls.Context.{name}")
    if missing:
        import aioquic

        raise RuntimeError(
            f"aioquic {aioquic.__version__} lacks {', '.join(missing)}, which swarmavg-quic "
            "needs for mutual authentication; install the aioquic version it pins"
        )
