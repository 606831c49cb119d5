"""swarmavg-quic: the QUIC transport for swarmavg, on aioquic.

Install it beside swarmavg (``pip install swarmavg[quic]``) and pick it by name
(``transport="quic"``) or by address (``quic://host:port/p/<peer-id>``); a node can listen on
TCP and QUIC at once. See README.md for what it does and how it is measured.
"""

from __future__ import annotations

from swarmavg_quic._connection import QuicConnection, QuicStream
from swarmavg_quic._transport import QuicListener, QuicTransport

__all__ = ["QuicConnection", "QuicListener", "QuicStream", "QuicTransport"]
__version__ = "0.1.0.dev0"
