"""Text that came from another peer, made safe to print.

A peer's words (a reducer's reason for leaving a sender out, a failed call's message) end up in
our log lines and exceptions. Taken as they came, a newline forges a log line of its own, an
ANSI escape rewrites the terminal, a bidirectional override reorders what a reader sees, and a
megabyte of text floods the log. :func:`printable` is applied where such text enters (the
round's machine, the RPC layer): control and format characters are shown as escapes, and the
text is cut to a bound.
"""

from __future__ import annotations

import unicodedata
from typing import Final

__all__ = ["MAX_PEER_TEXT", "printable"]

#: The most characters of a peer's text that are kept (an ellipsis marks a cut).
MAX_PEER_TEXT: Final = 300


def printable(text: str, limit: int = MAX_PEER_TEXT) -> str:
    """``text`` with every control, format, surrogate, private-use or unassigned character
    (Unicode category ``C*``: newlines, tabs, ESC, bidirectional overrides, ...) written as a
    Python escape (``\\n``, ``\\x1b``, ``\\u202e``), cut to ``limit`` characters (``…`` at the
    end when cut). Printable text, any script, is kept as it is."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, not {limit}")
    out: list[str] = []
    size = 0
    for char in text:
        # (repr escapes every category-C character: none of them is printable to Python)
        piece = repr(char)[1:-1] if unicodedata.category(char)[0] == "C" else char
        if size + len(piece) > limit:
            out.append("…")
            break
        out.append(piece)
        size += len(piece)
    return "".join(out)
