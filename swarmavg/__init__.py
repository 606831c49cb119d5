"""swarmavg: decentralized averaging of tensors in small, changing groups of untrusted peers."""

from __future__ import annotations

__version__ = "0.1.0.dev0"
