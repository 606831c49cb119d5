"""Test kit: the in-process :class:`MemoryTransport` and the conformance suites.

Shipped with the library (like ``trio.testing``) so that third-party transports can prove they
behave like ours: ``await check_transport(lambda identity: MyTransport(identity), "my://…:0")``,
and so that many peers can be simulated in one process on virtual time
(:class:`VirtualClockLoop`, :func:`run_on_virtual_time`), one of them dishonest where a test
says so (:class:`Adversary`: a peer whose outgoing messages the test rewrites).
"""

from swarmavg.testing._adversary import Adversary
from swarmavg.testing._clock import VirtualClockLoop, run_on_virtual_time
from swarmavg.testing._conformance import (
    TRANSPORT_CHECKS,
    TransportFactory,
    check_transport,
    run_transport_check,
)
from swarmavg.testing._memory import MemoryNetwork, MemoryTransport

__all__ = [
    "TRANSPORT_CHECKS",
    "Adversary",
    "MemoryNetwork",
    "MemoryTransport",
    "TransportFactory",
    "VirtualClockLoop",
    "check_transport",
    "run_on_virtual_time",
    "run_transport_check",
]
