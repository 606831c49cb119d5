"""swarmavg: decentralized averaging of tensors in small, changing groups of untrusted peers.

The public API is what ``__all__`` lists; everything else is internal. Subpackages with their own
public API: :mod:`swarmavg.abc` (protocols), :mod:`swarmavg.proto` (sans-IO wire codec),
:mod:`swarmavg.sync` (thread-facing runtime), :mod:`swarmavg.testing` (memory transport and
conformance suites).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from swarmavg._step import AveragingStage, StepResult
from swarmavg._time import get_dht_time
from swarmavg.accumulator import Accumulator, Group
from swarmavg.address import Address
from swarmavg.aio.node import Node
from swarmavg.averager import DecentralizedAverager, StepHandle
from swarmavg.dht import DHT
from swarmavg.errors import (
    AddressInUse,
    AllReduceFailed,
    AveragingError,
    ConnectError,
    ConnectionLost,
    LoadStateFailed,
    LocalProtocolError,
    MatchmakingFailed,
    MessageTooLarge,
    NonFiniteTensors,
    PeerIdentityMismatch,
    ProtocolError,
    RemoteProtocolError,
    StreamReset,
    SwarmError,
    TransportError,
    TransportNotFound,
)
from swarmavg.identity import Identity, PeerID
from swarmavg.proto.dht_storage import ValueWithExpiration
from swarmavg.transport import available_transports, resolve_transport

__version__ = "0.1.0.dev0"

if TYPE_CHECKING:
    from swarmavg.optim.decentralized import (
        DecentralizedAdam,
        DecentralizedOptimizer,
        DecentralizedSGD,
    )
    from swarmavg.optim.optimizer import Optimizer
    from swarmavg.optim.training_averager import TrainingAverager

#: The training classes: they subclass torch classes, so they are resolved on first use
#: (``import swarmavg`` does not import torch).
_FROM_OPTIM = frozenset(
    {
        "DecentralizedAdam",
        "DecentralizedOptimizer",
        "DecentralizedSGD",
        "Optimizer",
        "TrainingAverager",
    }
)


def __getattr__(name: str) -> Any:
    if name in _FROM_OPTIM:
        import swarmavg.optim

        value = getattr(swarmavg.optim, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'swarmavg' has no attribute {name!r}")


__all__ = [
    "DHT",
    "Accumulator",
    "Address",
    "AddressInUse",
    "AllReduceFailed",
    "AveragingError",
    "AveragingStage",
    "ConnectError",
    "ConnectionLost",
    "DecentralizedAdam",
    "DecentralizedAverager",
    "DecentralizedOptimizer",
    "DecentralizedSGD",
    "Group",
    "Identity",
    "LoadStateFailed",
    "LocalProtocolError",
    "MatchmakingFailed",
    "MessageTooLarge",
    "Node",
    "NonFiniteTensors",
    "Optimizer",
    "PeerID",
    "PeerIdentityMismatch",
    "ProtocolError",
    "RemoteProtocolError",
    "StepHandle",
    "StepResult",
    "StreamReset",
    "SwarmError",
    "TrainingAverager",
    "TransportError",
    "TransportNotFound",
    "ValueWithExpiration",
    "__version__",
    "available_transports",
    "get_dht_time",
    "resolve_transport",
]
