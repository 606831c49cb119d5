"""A peer's text made printable (swarmavg.proto.text)."""

from __future__ import annotations

import pytest

from swarmavg.proto.text import MAX_PEER_TEXT, printable


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("plain words, café, 中文", "plain words, café, 中文"),  # (any printable script)
        ("a\nb\r\tc", "a\\nb\\r\\tc"),
        ("\x1b[31mred\x1b[0m", "\\x1b[31mred\\x1b[0m"),
        ("right-to-left \u202eevil\u200b", "right-to-left \\u202eevil\\u200b"),
        ("\x00\x7f\ud800", "\\x00\\x7f\\ud800"),
    ],
)
def test_control_and_format_characters_are_escaped(text: str, shown: str) -> None:
    assert printable(text) == shown
    assert printable(text).isprintable()


def test_long_text_is_cut_with_a_mark() -> None:
    assert printable("x" * 10_000) == "x" * MAX_PEER_TEXT + "…"
    assert printable("abc", 3) == "abc"
    assert printable("ab\ncd", 3) == "ab…"  # (an escape is not cut in two)
    with pytest.raises(ValueError, match="limit"):
        printable("abc", 0)
