"""The asynchronous API (anyio, asyncio or trio code): the same operations as the synchronous
facades, as coroutines, with ``async with``."""

from swarmavg.aio.accumulator import Accumulator, Group
from swarmavg.aio.averager import AveragingStage, DecentralizedAverager, StepControl, StepResult
from swarmavg.aio.dht_facade import DHT
from swarmavg.aio.node import Node
from swarmavg.errors import AllReduceFailed, MatchmakingFailed

__all__ = [
    "DHT",
    "Accumulator",
    "AllReduceFailed",
    "AveragingStage",
    "DecentralizedAverager",
    "Group",
    "MatchmakingFailed",
    "Node",
    "StepControl",
    "StepResult",
]
