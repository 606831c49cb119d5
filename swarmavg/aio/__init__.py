"""The asynchronous API (anyio, asyncio or trio code): the same operations as the synchronous
facades, as coroutines, with ``async with``."""

from swarmavg.aio.dht_facade import DHT
from swarmavg.aio.node import Node

__all__ = ["DHT", "Node"]
