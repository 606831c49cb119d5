"""The all-reduce's arithmetic: load balancing, the flat layout, parts, weighted means."""

from __future__ import annotations

import gc
import math
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmavg.proto.allreduce import (
    _CHUNK,
    MAX_SHARE,
    MAX_WEIGHT,
    SAME_BANDWIDTH,
    AccumulatorPool,
    FlatLayout,
    NonFiniteValues,
    OverflowingValues,
    PartReducer,
    TensorSpec,
    _all_finite,
    load_balance,
    plan_parts,
    schema_digest,
)


def _time(vector_size: int, shares: list[int], bandwidths: list[float]) -> float:
    """The slowest member's transfer time under the model of the module docstring."""
    n = len(shares)
    return max(
        2 * ((n - 2) * a + vector_size) / b if b > 0 else (0 if a == 0 else np.inf)
        for a, b in zip(shares, bandwidths, strict=True)
    )


def test_equal_bandwidths_split_evenly() -> None:
    assert load_balance(1000, [1.0] * 4) == [250] * 4
    assert load_balance(10, [None, None, None]) in ([4, 3, 3], [3, 4, 3], [3, 3, 4])


def test_zero_bandwidth_members_reduce_nothing() -> None:
    shares = load_balance(1000, [0.0, 5.0, 5.0, 0.0])
    assert shares[0] == shares[3] == 0
    assert shares[1] + shares[2] == 1000
    with pytest.raises(ValueError, match="every bandwidth is 0"):
        load_balance(1000, [0.0, 0.0])


def test_a_slow_member_gets_less_and_a_very_slow_one_nothing() -> None:
    shares = load_balance(1_000_000, [1.0, 1.0, 1.0, 0.4])
    assert shares[3] < shares[0]
    shares = load_balance(1_000_000, [1.0, 1.0, 1.0, 0.05])
    assert shares[3] == 0


def test_min_vector_size_leaves_small_shares_to_others() -> None:
    assert load_balance(100, [1.0] * 4, min_vector_size=30) == [34, 33, 33, 0]
    assert load_balance(100, [1.0, 5.0], min_vector_size=1000) == [0, 100]


def test_bandwidths_within_measurement_noise_split_evenly() -> None:
    """Measured bandwidths of 8 peers with the same links (``wan``, MB/s) are a few percent
    apart: the split is even, not amplified noise (see ``SAME_BANDWIDTH``)."""
    measured = [13.2, 13.6, 13.6, 13.3, 13.2, 13.3, 13.0, 12.9]
    assert load_balance(8000, measured) == [1000] * 8
    assert load_balance(8000, [12.1, 13.9, 12.6, 13.3, 12.6, 12.1, 12.7, 12.6]) == [1000] * 8
    assert load_balance(4000, [1.0, 1.0, 1.0, SAME_BANDWIDTH * 0.99]) == [1000] * 4
    # CPU-bound peers (loopback, MB/s): their measurements of one round, and the runaway
    # that a split by them started (see the module docstring)
    assert load_balance(4000, [246, 379, 373, 177]) == [1000] * 4
    assert load_balance(4000, [440, 514, 1047, 447]) != [1000] * 4
    # beyond it, a difference is real and followed; far beyond, exactly as given
    shares = load_balance(4000, [1.0, 1.0, 1.0, SAME_BANDWIDTH * 1.01])
    assert shares[3] > 1000 > max(shares[:3])
    assert max(shares[:3]) - min(shares[:3]) <= 1
    assert load_balance(10**6, [1e9, 1e9, 5e7, 5e7]) == load_balance(10**6, [20.0, 20.0, 1.0, 1.0])
    assert load_balance(10**6, [20.0, 20.0, 1.0, 1.0]) != [250_000] * 4


def test_no_member_reduces_more_than_max_share_whatever_bandwidth_it_claims() -> None:
    """Trust I's F4: a member that announces ``bandwidth=1e30`` made every other member too
    slow to help, so it reduced the whole vector and set every mean (the others' ``clip_norm``
    never applied). It now reduces at most ``MAX_SHARE`` even shares, and the members it made
    look too slow take the rest, by their bandwidths."""
    assert MAX_SHARE == 2.0
    assert load_balance(1000, [1e30, 1.0, 1.0, 1.0], max_share=None) == [1000, 0, 0, 0]
    assert load_balance(1000, [1e30, 1.0, 1.0, 1.0]) == [500, 167, 167, 166]
    shares = load_balance(1200, [1e30, 8.0, 1.0, 1.0])  # (8 counts as 4.5: SAME_BANDWIDTH)
    assert shares[0] == 600
    assert abs(shares[1] - 4.5 * shares[2]) <= 5
    assert abs(shares[2] - shares[3]) <= 1
    capped = load_balance(1000, [1e30] * 2 + [1.0] * 8, max_share=1.5)
    assert capped[:2] == [150, 150]
    assert sorted(set(capped[2:])) == [87, 88]
    # a cap under an even share of those that can reduce would leave the vector uncovered
    assert load_balance(1000, [1e30, 0.0, 0.0, 1.0]) == [500, 0, 0, 500]
    assert load_balance(1000, [1e30, 0.0, 0.0, 0.0]) == [1000, 0, 0, 0]
    for bad in (0.5, math.inf, math.nan, True, "2"):
        with pytest.raises(ValueError, match="max_share must be None or a number >= 1"):
            load_balance(1000, [1.0] * 4, max_share=bad)  # type: ignore[arg-type]


def _nobody_can_reduce(vector_size: int, bandwidths: list[float | None]) -> bool:
    """Whether there is something to reduce and every bandwidth is 0 (a ValueError)."""
    return (
        vector_size > 0
        and all(b == 0 for b in bandwidths if b is not None)
        and None not in bandwidths
    )


@settings(deadline=None)
@given(
    st.integers(0, 10**7),
    st.lists(st.just(0.0) | st.floats(1e-3, 1e30) | st.none(), min_size=1, max_size=16),
    st.floats(1, 8),
)
def test_capped_shares_cover_the_vector_and_stay_under_the_cap(
    vector_size: int, bandwidths: list[float | None], max_share: float
) -> None:
    if _nobody_can_reduce(vector_size, bandwidths):
        return
    shares = load_balance(vector_size, bandwidths, max_share=max_share)
    assert sum(shares) == vector_size
    able = sum(1 for b in bandwidths if b is None or b > 0) or len(bandwidths)
    cap = max(max_share * vector_size / len(bandwidths), vector_size / able)
    assert max(shares) <= cap + 1
    assert all(s == 0 for s, b in zip(shares, bandwidths, strict=True) if b == 0)


def test_none_means_the_mean_of_the_others() -> None:
    assert load_balance(900, [2.0, None, 4.0]) == load_balance(900, [2.0, 3.0, 4.0])


@settings(deadline=None)
@given(
    st.integers(0, 10**7),
    st.lists(st.floats(0, 1e4) | st.none(), min_size=1, max_size=16),
    st.integers(0, 10**5),
)
def test_shares_cover_the_vector_and_beat_an_even_split(
    vector_size: int, bandwidths: list[float | None], min_vector_size: int
) -> None:
    if _nobody_can_reduce(vector_size, bandwidths):
        with pytest.raises(ValueError):
            load_balance(vector_size, bandwidths, min_vector_size, max_share=None)
        return
    # (uncapped: the split that the cap of test_capped_shares_... may then cut)
    shares = load_balance(vector_size, bandwidths, min_vector_size, max_share=None)
    assert sum(shares) == vector_size
    assert all(s >= 0 for s in shares)
    known = [b for b in bandwidths if b is not None]
    default = sum(known) / len(known) if known and sum(known) > 0 else 1.0
    bw = [default if b is None else b for b in bandwidths]
    assert all(s == 0 for s, b in zip(shares, bw, strict=True) if b == 0)
    nonzero = [s for s in shares if s]
    if len(nonzero) > 1:
        assert min(nonzero) >= min(min_vector_size, vector_size) - 1
    # no worse than splitting evenly among the members that can reduce
    able = [i for i, b in enumerate(bw) if b > 0]
    even = [0] * len(bw)
    for k, i in enumerate(able):
        even[i] = vector_size // len(able) + (k < vector_size % len(able))
    if min_vector_size == 0:
        assert _time(vector_size, shares, bw) <= _time(vector_size, even, bw) * (1 + 1e-6) + 1e-9


def test_the_layout_groups_tensors_by_dtype() -> None:
    specs = (
        TensorSpec((2, 3), "float32"),
        TensorSpec((4,), "float64"),
        TensorSpec((5,), "float32"),
        TensorSpec((), "float16"),
    )
    layout = FlatLayout(specs)
    assert layout.buffers == (("float32", 11), ("float64", 4), ("float16", 1))
    assert layout.places == ((0, 0), (1, 0), (0, 6), (2, 0))
    assert layout.numel == 16
    assert layout.buffer_start(2) == 15


def test_parts_cover_every_span_within_buffers() -> None:
    layout = FlatLayout((TensorSpec((10,), "float32"), TensorSpec((7,), "float64")))
    plans = plan_parts(layout, [6, 0, 11], part_size=4)
    assert [(p.buffer, p.start, p.stop) for p in plans[0]] == [(0, 0, 4), (0, 4, 6)]
    assert plans[1] == []
    assert [(p.buffer, p.start, p.stop) for p in plans[2]] == [
        (0, 6, 10),
        (1, 0, 4),
        (1, 4, 7),
    ]
    assert [p.index for p in plans[2]] == [0, 1, 2]
    with pytest.raises(ValueError, match="cover"):
        plan_parts(layout, [6, 6], part_size=4)


@settings(deadline=None)
@given(
    st.lists(st.integers(0, 50), min_size=1, max_size=5),
    st.lists(st.integers(0, 60), min_size=1, max_size=6),
    st.integers(1, 17),
)
def test_parts_tile_the_vector_exactly(sizes: list[int], cuts: list[int], part_size: int) -> None:
    dtypes = ["float32", "float64", "float16"]
    specs = tuple(TensorSpec((s,), dtypes[i % 3]) for i, s in enumerate(sizes))
    layout = FlatLayout(specs)
    total = layout.numel
    spans = [
        min(c, total - sum(cuts[:i])) if sum(cuts[:i]) < total else 0 for i, c in enumerate(cuts)
    ]
    spans[-1] += total - sum(spans)
    plans = plan_parts(layout, spans, part_size)
    covered = [0] * total
    for member, parts in enumerate(plans):
        assert sum(p.size for p in parts) == spans[member]
        for p in parts:
            assert 0 < p.size <= part_size
            start = layout.buffer_start(p.buffer)
            assert p.stop <= layout.buffers[p.buffer][1]
            for k in range(start + p.start, start + p.stop):
                covered[k] += 1
    assert covered == [1] * total


def test_weighted_mean_of_a_part() -> None:
    reducer = PartReducer(3, "float32", senders=[0, 1, 2])
    reducer.add(0, np.array([1, 2, 3], dtype=np.float32), 1.0)
    reducer.add(2, np.array([3, 6, 9], dtype=np.float32), 3.0)
    assert not reducer.done
    reducer.add(1, np.array([100, 100, 100], dtype=np.float32), 0.0)  # joins, adds nothing
    assert reducer.done
    np.testing.assert_allclose(reducer.result(), [2.5, 5.0, 7.5])


def test_float16_and_float64_accumulate_wider() -> None:
    half = PartReducer(1, "float16", senders=[0, 1])
    half.add(0, np.array([60000], dtype=np.float16), 1.0)
    half.add(1, np.array([60000], dtype=np.float16), 1.0)  # the sum would overflow float16
    result = half.result()
    assert result is not None
    assert result.dtype == np.float32
    assert result[0] == 60000
    double = PartReducer(1, "float64", senders=[0, 1])
    double.add(0, np.array([1.0 + 1e-12]), 1.0)
    double.add(1, np.array([1.0 - 1e-12]), 1.0)
    result = double.result()
    assert result is not None
    assert result.dtype == np.float64


def test_zero_total_weight_keeps_local_values() -> None:
    reducer = PartReducer(2, "float32", senders=[0, 1])
    reducer.add(0, np.zeros(2, dtype=np.float32), 0.0)
    reducer.add(1, np.ones(2, dtype=np.float32), 0.0)
    assert reducer.result() is None


def test_bad_contributions_are_refused_and_change_nothing() -> None:
    reducer = PartReducer(2, "float32", senders=[0, 1])
    with pytest.raises(ValueError, match="does not send"):
        reducer.add(5, np.zeros(2, dtype=np.float32), 1.0)
    with pytest.raises(ValueError, match="shape"):
        reducer.add(0, np.zeros(3, dtype=np.float32), 1.0)
    with pytest.raises(ValueError, match="non-finite"):
        reducer.add(0, np.array([1.0, np.nan], dtype=np.float32), 1.0)
    with pytest.raises(ValueError, match="weight"):
        reducer.add(0, np.zeros(2, dtype=np.float32), -1.0)
    reducer.add(0, np.array([2.0, 4.0], dtype=np.float32), 2.0)
    with pytest.raises(ValueError, match="already"):
        reducer.add(0, np.zeros(2, dtype=np.float32), 1.0)
    np.testing.assert_allclose(reducer.result(), [2.0, 4.0])


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_a_non_finite_value_is_refused(dtype: str) -> None:
    values = np.full(1000, 0.5, dtype=dtype)
    for bad in (np.inf, -np.inf, np.nan):
        poisoned = values.copy()
        poisoned[517] = bad
        reducer = PartReducer(1000, dtype, senders=[0])
        with pytest.raises(NonFiniteValues, match="non-finite"):
            reducer.add(0, poisoned, 1.0)
        assert reducer.received == set()


def test_float16_values_up_to_the_largest_are_averaged_at_any_weight() -> None:
    """float16 sums in float32, where no float16 value times any allowed weight overflows."""
    big = float(np.finfo(np.float16).max)
    values = np.full(1000, big, dtype=np.float16)
    reducer = PartReducer(1000, "float16", senders=[0, 1, 2])
    reducer.add(0, values, MAX_WEIGHT)
    reducer.add(1, values, MAX_WEIGHT)
    reducer.add(2, -values, 1.0)
    mean = reducer.result()
    assert mean is not None
    assert np.isfinite(mean).all()
    assert mean.astype(np.float16)[0] == np.float16(
        (2 * MAX_WEIGHT - 1) * big / (2 * MAX_WEIGHT + 1)
    )


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_values_that_could_overflow_the_sum_are_refused_blaming_their_sender(dtype: str) -> None:
    """Trust I's F1: finite values near the dtype's largest, or times a large weight, would
    overflow the sum into an infinite mean that every member then blames on the honest
    reducer. Each sender's ``w·max|x|`` is held to half the range over the senders (here 3:
    1/6), and each value to half the range: the others' mean comes out exact."""
    top = float(np.finfo(dtype).max)
    reducer = PartReducer(1000, dtype, senders=[0, 1, 2])
    reducer.add(0, np.full(1000, top / 8, dtype=dtype), 1.0)  # (1/8 < 1/6: taken)
    for values, weight in (
        (np.full(1000, top / 8, dtype=dtype), 2.0),  # (1/4 with its weight)
        (np.full(1000, top / 1.5, dtype=dtype), 1e-3),  # (a value past half the range)
        (np.full(1000, 3e38 if dtype == "float32" else 1e300, dtype=dtype), 1e9),
    ):
        with pytest.raises(OverflowingValues, match="member 1 sent values too large"):
            reducer.add(1, values, weight)
    assert reducer.received == {0}
    reducer.add(1, np.full(1000, -top / 8, dtype=dtype), 1.0)
    reducer.add(2, np.full(1000, top, dtype=dtype), 0.0)  # (weight 0: not added at all)
    mean = reducer.result()
    assert mean is not None
    np.testing.assert_array_equal(mean, 0.0)


@pytest.mark.parametrize("weight", [1.0, 0.25])
def test_a_contribution_refused_mid_way_takes_back_what_it_added(weight: float) -> None:
    """The check runs chunk by chunk with the sum (the values are read once): a non-finite
    value in the third chunk comes after two chunks were added, which are taken back; the
    others' mean is as if the contribution never came (exactly here, up to rounding in
    general)."""
    size = 3 * _CHUNK
    rng = np.random.default_rng(0)
    first = rng.standard_normal(size).astype(np.float32)
    poisoned = rng.standard_normal(size).astype(np.float32)
    poisoned[2 * _CHUNK + 5] = np.nan
    for bad in (poisoned, np.where(np.arange(size) < 2 * _CHUNK, 1.0, 3e38).astype(np.float32)):
        reducer = PartReducer(size, "float32", senders=[0, 1, 2])
        reducer.add(0, first, 2.0)
        with pytest.raises(NonFiniteValues, match="member 1 sent"):
            reducer.add(1, bad, weight)
        assert reducer.received == {0}
        reducer.add_nothing(1)
        reducer.add(2, first, 2.0)
        mean = reducer.result()
        assert mean is not None
        np.testing.assert_allclose(mean, first, rtol=1e-6, atol=1e-6)


def test_a_weight_past_max_weight_is_refused() -> None:
    reducer = PartReducer(2, "float32", senders=[0])
    for weight in (MAX_WEIGHT * 1.5, 1e39, math.inf, math.nan, -1.0):
        with pytest.raises(ValueError, match="a weight is a number from 0 to 1e"):
            reducer.add(0, np.ones(2, np.float32), weight)


def test_the_schema_digest_tells_schemas_apart() -> None:
    a = [TensorSpec((2, 3), "float32")]
    assert schema_digest(a) == schema_digest([TensorSpec((2, 3), "float32")])
    assert schema_digest(a) != schema_digest([TensorSpec((3, 2), "float32")])
    assert schema_digest(a) != schema_digest([TensorSpec((2, 3), "float64")])
    with pytest.raises(TypeError, match="int64"):
        TensorSpec((1,), "int64")


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_a_contribution_longer_than_max_norm_is_scaled_down(dtype: str) -> None:
    reducer = PartReducer(4, dtype, senders=[0, 1])
    honest = np.array([0.6, 0.8, 0.0, 0.0], dtype=dtype)  # norm 1
    loud = np.array([300.0, 0.0, 0.0, 400.0], dtype=dtype)  # norm 500
    assert not reducer.add(0, honest, 1.0, max_norm=2.0)
    assert reducer.add(1, loud, 1.0, max_norm=2.0)  # scaled to norm 2
    mean = reducer.result()
    assert mean is not None
    np.testing.assert_allclose(mean, [(0.6 + 1.2) / 2, 0.4, 0.0, 1.6 / 2], atol=2e-3)
    with pytest.raises(ValueError, match="max_norm"):
        PartReducer(1, dtype, senders=[0]).add(0, np.ones(1, dtype=dtype), 1.0, max_norm=-1)


def test_clipping_survives_a_sum_of_squares_that_overflows_float32() -> None:
    reducer = PartReducer(2, "float32", senders=[0])
    assert reducer.add(0, np.array([3e38, 3e38], dtype=np.float32), 1.0, max_norm=1.0)
    mean = reducer.result()
    assert mean is not None
    np.testing.assert_allclose(mean, [2**-0.5, 2**-0.5], rtol=1e-6)


def test_every_float16_bit_pattern_is_judged_as_numpy_judges_it() -> None:
    # (float16 is checked on its exponent bits: every one of the 65536 values, alone and in
    # a part of finite values, is taken exactly when it is finite)
    patterns = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    finite = np.isfinite(patterns)
    for value, expected in zip(patterns[::257].tolist(), finite[::257].tolist(), strict=True):
        part = np.full(300, 1.5, dtype=np.float16)
        part[123] = value
        assert _all_finite(part) is expected, value
    assert all(_all_finite(patterns[i : i + 1]) is bool(finite[i]) for i in range(1 << 16))
    assert _all_finite(np.empty(0, dtype=np.float16))
    assert not _all_finite(patterns[::-1])  # strided views too
    assert _all_finite(patterns[finite][::3])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_finiteness_check_agrees_with_numpy_on_random_bits(dtype: str) -> None:
    rng = np.random.default_rng(7)
    itemsize = np.dtype(dtype).itemsize
    for _ in range(200):
        raw = rng.integers(0, 256, size=itemsize * 64, dtype=np.uint8)
        values = raw.view(dtype)
        assert _all_finite(values) == bool(np.isfinite(values).all())
        finite = values[np.isfinite(values)]
        assert _all_finite(finite)  # huge finite ones included (their sum overflows)


def test_the_accumulator_pool_reuses_memory_only_once_nothing_refers_to_it() -> None:
    pool = AccumulatorPool()
    first = pool.take(1000, np.float32)
    assert first.shape == (1000,)
    assert first.dtype == np.float32
    assert first.flags.writeable
    first[:] = 7.0
    kept = first[10:20]  # a view outlives the array it came from
    del first
    second = pool.take(1000, np.float32)  # the first one's memory is still in use
    assert (pool.made, pool.reused) == (2, 0)
    second[:] = -1.0
    np.testing.assert_array_equal(kept, 7.0)
    address = kept.__array_interface__["data"][0] - 10 * 4
    del kept
    assert pool.cached_bytes == 4000
    third = pool.take(500, np.float64)  # same bytes, another dtype: the same memory
    assert (pool.made, pool.reused) == (2, 1)
    assert pool.cached_bytes == 0
    assert third.__array_interface__["data"][0] == address
    assert third.dtype == np.float64
    assert third.shape == (500,)
    assert pool.take(999, np.float32).size == 999
    assert pool.made == 3  # other sizes: fresh memory
    assert pool.take(0, np.float32).size == 0


def test_the_accumulator_pool_keeps_at_most_max_cached_bytes() -> None:
    pool = AccumulatorPool(max_cached=6000)
    arrays = [pool.take(1000, np.float32) for _ in range(3)]
    del arrays
    gc.collect()
    assert pool.cached_bytes == 4000  # the third did not fit
    pool.clear()
    assert pool.cached_bytes == 0
    with pytest.raises(ValueError, match="max_cached"):
        AccumulatorPool(max_cached=-1)


def test_an_accumulator_released_in_another_thread_returns_to_the_pool() -> None:
    pool = AccumulatorPool()
    box = [pool.take(256, np.float64)]
    thread = threading.Thread(target=box.clear)
    thread.start()
    thread.join()
    assert pool.cached_bytes == 2048
    reducer = PartReducer(256, "float64", [0], out=pool.take(256, np.float64))
    reducer.add(0, np.arange(256, dtype=np.float64), 2.0)  # recycled memory holds garbage:
    mean = reducer.result()  # the first contribution overwrites it
    assert mean is not None
    np.testing.assert_array_equal(mean, np.arange(256))
