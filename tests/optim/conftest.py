from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _fresh_loop(fresh_loop: None) -> None:
    """Every test here starts without the sync loop thread and leaves no thread behind."""
