"""One exception tree for the whole library.

```
SwarmError
├─ ProtocolError ─ LocalProtocolError (we were asked to send something invalid)
│               └ RemoteProtocolError (the peer sent something invalid)
│                  └ MessageTooLarge also derives from LocalProtocolError when raised locally
├─ TransportError ─ ConnectError | ConnectionLost | PeerIdentityMismatch | StreamReset
│                └ AddressInUse (a listen address's port is taken by another socket)
├─ TransportNotFound (no plugin for a transport name; says what to install)
├─ RPCError ─ RemoteError (handler failed) ─ MethodNotFound
│          └ RPCTimeout
└─ AveragingError ─ MatchmakingFailed (no group in time; says why)
                  ├ AllReduceFailed (nothing was averaged; names the peers that failed)
                  └ NonFiniteTensors (our own tensors hold NaN or inf; also a ValueError)
```

Library and OS errors are translated at the transport boundary (``raise ... from exc``).
Cancellation and ``AssertionError`` are never swallowed anywhere in swarmavg.
"""

from __future__ import annotations

__all__ = [
    "AddressInUse",
    "AllReduceFailed",
    "AveragingError",
    "ConnectError",
    "ConnectionLost",
    "LocalProtocolError",
    "MatchmakingFailed",
    "MessageTooLarge",
    "MethodNotFound",
    "NonFiniteTensors",
    "PeerIdentityMismatch",
    "ProtocolError",
    "RPCError",
    "RPCTimeout",
    "RemoteError",
    "RemoteProtocolError",
    "StreamReset",
    "SwarmError",
    "TransportError",
    "TransportNotFound",
]


class SwarmError(Exception):
    """Base class of every exception swarmavg raises on purpose."""


class ProtocolError(SwarmError):
    """A message or frame broke the wire protocol."""


class LocalProtocolError(ProtocolError):
    """We were about to send something the protocol does not allow (a bug or bad argument)."""


class RemoteProtocolError(ProtocolError):
    """The remote peer sent bytes that do not parse or break a protocol rule.

    Every decoder in swarmavg raises this, and only this, on bad input. The stream or connection
    that carried it should be closed; the node keeps serving other peers.
    """


class MessageTooLarge(LocalProtocolError):
    """A message exceeds the size limit of the stream or codec it was given to."""


class TransportError(SwarmError):
    """A transport-level failure: dialing, a dropped connection, a failed identity check."""


class AddressInUse(TransportError):
    """A listen address could not be bound: another socket (another process, or another node
    of this one) holds its port. Listen on port 0 for a free port, or on another port; the
    ``OSError`` is the ``__cause__``."""


class ConnectError(TransportError):
    """Could not establish a connection (refused, unreachable, timed out, handshake failed)."""


class ConnectionLost(TransportError):
    """The connection closed or broke while an operation was using it."""


class PeerIdentityMismatch(ConnectError):
    """The peer that answered proved a different key than the PeerID that was dialed."""

    def __init__(self, expected: object, actual: object) -> None:
        super().__init__(f"dialed peer {expected} but {actual} answered")
        self.expected = expected
        self.actual = actual


class StreamReset(TransportError):
    """The remote side aborted the stream; data in flight may be lost."""


class TransportNotFound(SwarmError, LookupError):
    """No transport plugin is registered under the requested name or URL scheme."""


class RPCError(SwarmError):
    """A remote procedure call failed."""


class RemoteError(RPCError):
    """The remote handler raised, or refused the call; only that call failed.

    :ivar code: a short machine-readable reason (``"handler_error"``, ``"unknown_method"``, ...).
    :ivar remote_type: the name of the exception type the remote handler raised, if any.
    """

    def __init__(self, message: str, *, code: str = "handler_error", remote_type: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.remote_type = remote_type


class MethodNotFound(RemoteError):
    """The peer has no handler registered under the method name that was called."""


class RPCTimeout(RPCError, TimeoutError):
    """A call did not finish within its ``timeout``; the remote handler was cancelled."""


class AveragingError(SwarmError):
    """An averaging step did not produce an average; the subclass says at which stage."""


class MatchmakingFailed(AveragingError):
    """No group could be formed in time; the message says why."""


class AllReduceFailed(AveragingError):
    """The all-reduce of a round did not complete; the message says why."""


class NonFiniteTensors(AveragingError, ValueError):
    """Our own averaged tensors hold NaN or an infinity (training diverged): a step refuses to
    look for a group with them, since one NaN would spread to every peer it averages with.

    :ivar indices: which of the averaged tensors (their positions) hold such values.
    """

    def __init__(self, message: str, indices: list[int]) -> None:
        super().__init__(message)
        self.indices = indices


class LoadStateFailed(AveragingError):
    """No peer's training state could be downloaded (no donor shares it, every donor failed or
    refused, or the time allowed ran out); the message says which and how often it was tried."""
