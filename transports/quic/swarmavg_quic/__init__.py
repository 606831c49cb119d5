"""swarmavg-quic: the QUIC transport for swarmavg (in progress; see README.md).

For now it holds the TLS identity layer (:mod:`swarmavg_quic._tls`), which the transport will use.
"""

from __future__ import annotations

__all__: list[str] = []
__version__ = "0.1.0.dev0"
