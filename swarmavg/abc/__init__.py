"""The pluggable protocols of swarmavg. Each has a conformance suite in :mod:`swarmavg.testing`."""

from swarmavg.abc._transport import (
    AbandonCallbacks,
    Buffer,
    Connection,
    ConnectionAttribute,
    IncomingLimits,
    Listener,
    QueueListener,
    Signal,
    Stream,
    StreamAttribute,
    TaskGroupTransport,
    Transport,
)

__all__ = [
    "AbandonCallbacks",
    "Buffer",
    "Connection",
    "ConnectionAttribute",
    "IncomingLimits",
    "Listener",
    "QueueListener",
    "Signal",
    "Stream",
    "StreamAttribute",
    "TaskGroupTransport",
    "Transport",
]
