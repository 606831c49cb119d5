"""The asynchronous API (anyio, asyncio or trio code): the same operations as the synchronous
facades, as coroutines, with ``async with``."""

from swarmavg.aio.allreduce import AllReduceFailed
from swarmavg.aio.averager import DecentralizedAverager, StepResult
from swarmavg.aio.dht_facade import DHT
from swarmavg.aio.matchmaking import MatchmakingFailed
from swarmavg.aio.node import Node

__all__ = [
    "DHT",
    "AllReduceFailed",
    "DecentralizedAverager",
    "MatchmakingFailed",
    "Node",
    "StepResult",
]
