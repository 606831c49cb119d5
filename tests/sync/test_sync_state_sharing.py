"""State sharing through the sync facade (``swarmavg.DecentralizedAverager``), over TCP."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any, ClassVar

import pytest
import torch

from swarmavg import DHT, DecentralizedAverager
from swarmavg.proto.dht_validation import owner_marker
from swarmavg.sync import TaskHandle

pytestmark = pytest.mark.timeout(60)


class Donor(DecentralizedAverager):
    """Shares metadata and an extra tensor besides the averaged ones (a sync override, run in a
    worker thread)."""

    calls_from: ClassVar[list[str]] = []

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor]]:
        self.calls_from.append(threading.current_thread().name)
        metadata, tensors = super().get_current_state()
        assert metadata is None
        return {"step": 42}, [*tensors, torch.arange(3)]


def _wait_declared(dht: DHT, *peers: Any) -> None:
    deadline = time.monotonic() + 20
    while True:
        found = dht.get("sync-state.state", latest=True)
        if found is not None and all(
            isinstance(found.value.get(owner_marker(p), (None,))[0], dict) for p in peers
        ):
            return
        assert time.monotonic() < deadline, found
        time.sleep(0.05)


def test_a_late_peer_loads_the_state_of_a_sync_subclass_donor() -> None:
    own = [torch.randn(1000), torch.randn(4, 4, dtype=torch.float64)]
    with ExitStack() as stack:
        first = stack.enter_context(DHT())
        second = stack.enter_context(DHT(first.get_visible_maddrs()))
        options: dict[str, Any] = {"prefix": "sync-state", "target_group_size": 2}
        donor = stack.enter_context(Donor(own, first, allow_state_sharing=True, **options))
        taker = stack.enter_context(
            DecentralizedAverager(
                [torch.zeros(1000), torch.zeros(4, 4)], second, allow_state_sharing=False, **options
            )
        )
        assert donor.allow_state_sharing
        assert not taker.allow_state_sharing
        _wait_declared(second, first.peer_id)
        loaded = taker.load_state_from_peers(timeout=20)
        assert loaded is not None
        metadata, tensors = loaded
        assert metadata == {"step": 42}
        assert torch.equal(tensors[0], own[0])
        assert torch.equal(tensors[1], own[1])
        assert torch.equal(tensors[2], torch.arange(3))
        assert Donor.calls_from
        assert not any(n == "MainThread" for n in Donor.calls_from)

        handle = taker.load_state_from_peers(wait=False, timeout=20)
        assert isinstance(handle, TaskHandle)
        result = handle.result(timeout=30)
        assert result is not None
        assert result[0] == {"step": 42}

        donor.state_sharing_priority = 3
        assert donor.state_sharing_priority == 3.0
        donor.allow_state_sharing = False
        assert not donor.allow_state_sharing
        deadline = time.monotonic() + 20
        while taker.load_state_from_peers(timeout=20) is not None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(ValueError, match="finite"):
            donor.state_sharing_priority = float("inf")
        donor.shutdown()
        with pytest.raises(RuntimeError, match="not running"):
            donor.load_state_from_peers()
