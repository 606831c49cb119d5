"""The pluggable protocols of swarmavg: transports (each checked by the conformance suite in
:mod:`swarmavg.testing`) and the two halves of averaging (matchmaking, all-reduce)."""

from swarmavg.abc._averaging import (
    AllReduceResult,
    AllReduceRunner,
    Group,
    GroupInfo,
    GroupMember,
    Matchmaker,
    MemberMode,
)
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
from swarmavg.proto.butterfly import RoundConfig

__all__ = [
    "AbandonCallbacks",
    "AllReduceResult",
    "AllReduceRunner",
    "Buffer",
    "Connection",
    "ConnectionAttribute",
    "Group",
    "GroupInfo",
    "GroupMember",
    "IncomingLimits",
    "Listener",
    "Matchmaker",
    "MemberMode",
    "QueueListener",
    "RoundConfig",
    "Signal",
    "Stream",
    "StreamAttribute",
    "TaskGroupTransport",
    "Transport",
]
