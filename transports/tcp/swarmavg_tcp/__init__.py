"""swarmavg-tcp: the authenticated, encrypted, multiplexed TCP transport of swarmavg.

Registered under the entry-point group ``swarmavg.transports`` as ``tcp``; swarmavg resolves it
by name (``Node(listen=["tcp://0.0.0.0:31337"])``). See the package README for the protocol.
"""

from swarmavg_tcp._connection import TcpConnection, TcpStream
from swarmavg_tcp._frames import Settings
from swarmavg_tcp._transport import TcpListener, TcpTransport

__all__ = ["Settings", "TcpConnection", "TcpListener", "TcpStream", "TcpTransport"]
__version__ = "0.1.0.dev0"
