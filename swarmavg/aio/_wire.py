"""What crossed the network during a round (:class:`WireSampler`), for the averager's
bandwidth measurement. Private to :mod:`swarmavg.aio.allreduce`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import anyio

if TYPE_CHECKING:
    from swarmavg.abc import AllReduceResult, Connection
    from swarmavg.aio.node import Node
    from swarmavg.identity import PeerID

__all__ = ["WireSampler"]

#: How often a round samples what crossed the network to its members (seconds; see
#: ``WireSampler``).
_WIRE_SAMPLE: Final = 0.05


class WireSampler:
    """Samples, every ``_WIRE_SAMPLE`` seconds of a round, what crossed the network on the
    connections to the group's members (:meth:`~swarmavg.abc.Connection.traffic`) into the
    result's ``wire_sent_log`` / ``wire_received_log``: bytes that reached the members and
    bytes that arrived from them, per sample. Every open connection to a member counts (two
    members that dialed each other at once hold two, and each sends on its own pooled one: what
    this node receives comes over the other); one opened during the round counts from 0; one
    whose transport does not tell makes the logs say nothing (they are cleared)."""

    def __init__(self, node: Node, peers: Sequence[PeerID], result: AllReduceResult) -> None:
        self.node = node
        self.peers = list(peers)
        self.result = result
        #: per connection: its last (sent, received)
        self.last: dict[Connection, tuple[int, int]] = {}
        self.blind = False
        for peer in self.peers:
            for conn in node.connections_to(peer):
                traffic = conn.traffic()
                if traffic is None:
                    self.blind = True
                else:
                    self.last[conn] = traffic

    def tells(self) -> bool:
        """Whether the connections count their traffic (as far as is known: none open yet
        that does not)."""
        return not self.blind

    async def run(self) -> None:
        while not self.blind:
            await anyio.sleep(_WIRE_SAMPLE)
            self.sample()

    def sample(self) -> None:
        if self.blind:
            return
        sent = received = 0
        seen: dict[Connection, tuple[int, int]] = {}
        for peer in self.peers:
            for conn in self.node.connections_to(peer):
                traffic = conn.traffic()
                if traffic is None:
                    self.blind = True
                    self.result.wire_sent_log.clear()
                    self.result.wire_received_log.clear()
                    return
                then_sent, then_received = self.last.get(conn, (0, 0))
                sent += max(traffic[0] - then_sent, 0)
                received += max(traffic[1] - then_received, 0)
                seen[conn] = traffic
        self.last = seen
        now = anyio.current_time()
        if sent:
            self.result.wire_sent_log.append((now, sent))
        if received:
            self.result.wire_received_log.append((now, received))
