"""The ``--codecs`` helpers of ``benchmarks/_averaging_peer.py``: codec names, the exact mean."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest
import torch

from swarmavg import compression


def test_make_codec_by_class_and_wire_name(load_benchmark: Callable[[str], ModuleType]) -> None:
    peer = load_benchmark("_averaging_peer.py")
    for class_name in peer.CODEC_CLASSES:
        cls = getattr(compression, class_name)
        assert type(peer.make_codec(class_name)) is cls
        assert type(peer.make_codec(cls.name)) is cls
    # every plain codec of the module is compared
    assert {getattr(compression, c).name for c in peer.CODEC_CLASSES} == set(
        compression.codec_names()
    )
    with pytest.raises(ValueError, match="unknown codec"):
        peer.make_codec("CompressionBase")


def test_error_stats_against_the_exact_mean(load_benchmark: Callable[[str], ModuleType]) -> None:
    peer = load_benchmark("_averaging_peer.py")
    seeds = [11, 12, 13]
    assert torch.equal(peer.random_tensor(1000, 11), peer.random_tensor(1000, 11))
    into = torch.zeros(1000)
    peer.random_tensor(1000, 11, out=into)  # as a peer sets its averaged tensor
    assert torch.equal(into, peer.random_tensor(1000, 11))
    mean = sum(peer.random_tensor(1000, s).double() for s in seeds) / len(seeds)
    exact = peer.error_stats(mean.float(), seeds)
    assert exact["rel_rms"] < 1e-6
    assert exact["max_abs"] < 1e-6
    buffers = (torch.empty(1000), np.empty(1000))
    off = peer.error_stats((mean + 0.01).float(), seeds, *buffers)
    assert off == peer.error_stats((mean + 0.01).float(), seeds)
    assert off["rms"] == pytest.approx(0.01, rel=1e-4)
    assert off["max_abs"] == pytest.approx(0.01, rel=1e-4)
    rms_mean = float(mean.square().mean().sqrt())
    assert math.isclose(off["rel_rms"], off["rms"] / rms_mean, rel_tol=1e-9)
