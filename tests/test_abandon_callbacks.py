from __future__ import annotations

import logging

import pytest

from swarmavg.abc import AbandonCallbacks


@pytest.mark.allow_error_log  # (a callback that raises is a bug: logged at ERROR)
def test_callbacks_fire_once_and_late_ones_at_once(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []
    watchers = AbandonCallbacks()
    assert watchers.add(lambda: calls.append("a"))
    assert watchers.add(lambda: calls.append("b"))
    assert calls == []
    assert watchers.add(lambda: calls.append("now"), abandoned=True)  # already abandoned
    assert calls == ["now"]

    def broken() -> None:
        raise RuntimeError("bug in a callback")

    watchers.add(broken)
    watchers.add(lambda: calls.append("after the broken one"))
    with caplog.at_level(logging.ERROR):
        watchers.fire()
    assert calls == ["now", "a", "b", "after the broken one"]
    assert "on_abandoned callback failed" in caplog.text
    watchers.fire()  # once only
    assert calls == ["now", "a", "b", "after the broken one"]
    watchers.add(lambda: calls.append("late"))
    assert calls[-1] == "late"
