from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmavg.compression import (
    MAX_COMPRESSED_ELEMENTS,
    BlockwiseQuantization,
    CompressedTensor,
    CompressionBase,
    ErrorFeedback,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    RoleAdaptiveCompression,
    ScaledFloat16Compression,
    SizeAdaptiveCompression,
    TensorInfo,
    Uniform8BitQuantization,
    codec_names,
    decompress,
)

FP16_CODECS: list[CompressionBase] = [Float16Compression(), ScaledFloat16Compression()]
BIT8_CODECS: list[CompressionBase] = [
    Uniform8BitQuantization(),
    Quantile8BitQuantization(),
    BlockwiseQuantization(),
]
ALL_CODECS: list[CompressionBase] = [NoCompression(), *FP16_CODECS, *BIT8_CODECS]


def _ids(codecs: list[CompressionBase]) -> list[str]:
    return [type(c).__name__ for c in codecs]


@pytest.fixture(scope="module")
def randn() -> np.ndarray:
    torch.manual_seed(0)
    return torch.randn(128, 128, 64).numpy().astype(np.float32)


def _mse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))


def _roundtrip_wire(ct: CompressedTensor) -> CompressedTensor:
    return CompressedTensor.from_parts(ct.to_parts())


# --- accuracy ---------------------------------------------------------------------------------


def test_registry_names() -> None:
    assert codec_names() == sorted(
        ["none", "float16", "meanstd_16bit", "uniform_8bit", "quantile_8bit", "blockwise_8bit"]
    )
    assert {c.name for c in ALL_CODECS} == set(codec_names())


def test_no_compression_is_exact(randn: np.ndarray) -> None:
    ct = NoCompression().compress(randn)
    out = decompress(_roundtrip_wire(ct))
    assert out.dtype == np.float32
    assert out.shape == randn.shape
    assert np.array_equal(out, randn)


@pytest.mark.parametrize("codec", FP16_CODECS, ids=_ids(FP16_CODECS))
def test_fp16_codecs_mse(codec: CompressionBase, randn: np.ndarray) -> None:
    ct = codec.compress(randn)
    out = codec.decompress(_roundtrip_wire(ct))
    assert out.shape == randn.shape
    assert out.dtype == np.float32
    mse = _mse(out, randn)
    # fp16 keeps 11 significant bits: rounding error ≈ ulp²/12, ~4.3e-8 on N(0, 1) values
    assert mse < 5e-8, mse
    assert ct.nbytes <= randn.size * 2 + 8


@pytest.mark.parametrize("codec", BIT8_CODECS, ids=_ids(BIT8_CODECS))
def test_8bit_codecs_mse(codec: CompressionBase, randn: np.ndarray) -> None:
    ct = codec.compress(randn)
    out = codec.decompress(_roundtrip_wire(ct))
    assert out.shape == randn.shape
    assert out.dtype == np.float32
    mse = _mse(out, randn)
    assert mse < 8e-4, mse
    assert ct.data.dtype == np.uint8
    assert ct.nbytes < randn.size * 1.01
    assert codec.estimate_compression_ratio(TensorInfo(size=randn.size)) < 0.26


def test_quantile_codebook_beats_uniform_levels(randn: np.ndarray) -> None:
    quantile = _mse(decompress(Quantile8BitQuantization().compress(randn)), randn)
    uniform = _mse(decompress(Uniform8BitQuantization().compress(randn)), randn)
    assert quantile < uniform


@pytest.mark.parametrize("codec", ALL_CODECS, ids=_ids(ALL_CODECS))
def test_deterministic(codec: CompressionBase, randn: np.ndarray) -> None:
    a, b = codec.compress(randn), codec.compress(randn)
    assert a.to_parts() == b.to_parts()


def test_speed_sanity(randn: np.ndarray, capsys: pytest.CaptureFixture[str]) -> None:
    lines = []
    for codec in ALL_CODECS:
        start = time.perf_counter()
        ct = codec.compress(randn)
        mid = time.perf_counter()
        out = decompress(ct)
        end = time.perf_counter()
        lines.append(
            f"{codec.name:>15}: compress {1e3 * (mid - start):6.1f} ms, "
            f"decompress {1e3 * (end - mid):6.1f} ms, {ct.nbytes} B, mse {_mse(out, randn):.2e}"
        )
    with capsys.disabled():
        print("\n" + "\n".join(lines))


# --- dtypes and edge cases -------------------------------------------------------------------


@pytest.mark.parametrize("codec", ALL_CODECS, ids=_ids(ALL_CODECS))
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_original_dtype_comes_back(codec: CompressionBase, dtype: Any) -> None:
    values = np.random.default_rng(1).standard_normal((33, 7)).astype(dtype)
    ct = _roundtrip_wire(codec.compress(values))
    assert ct.dtype == np.dtype(dtype).name
    out = decompress(ct)
    assert out.dtype == dtype
    assert out.shape == values.shape
    tolerance = 0.0 if codec.name == "none" else (1e-3 if "16" in codec.name else 0.05)
    assert np.max(np.abs(out.astype(np.float64) - values)) <= tolerance


def test_float64_through_fp16_comes_back_as_float64() -> None:
    values = np.linspace(-3, 3, 1001)
    out = decompress(Float16Compression().compress(values))
    assert out.dtype == np.float64
    assert np.allclose(out, values, atol=2e-3)
    assert not np.array_equal(out, values)  # float16 precision, float64 container


@pytest.mark.parametrize("codec", ALL_CODECS, ids=_ids(ALL_CODECS))
@pytest.mark.parametrize("shape", [(0,), (3, 0, 5), ()])
def test_empty_and_scalar(codec: CompressionBase, shape: tuple[int, ...]) -> None:
    values = np.full(shape, 1.5, dtype=np.float32)
    out = decompress(_roundtrip_wire(codec.compress(values)))
    assert out.shape == shape
    assert np.array_equal(out, values)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=_ids(ALL_CODECS))
@pytest.mark.parametrize("value", [0.0, 0.1, -7.25, 1e-30, 3e38])
def test_constant_tensors_decode_exactly(codec: CompressionBase, value: float) -> None:
    values = np.full((5000,), value, dtype=np.float32)
    with np.errstate(all="raise"):
        out = decompress(_roundtrip_wire(codec.compress(values)))
    if codec.name == "float16":  # exact only where float16 can hold the value
        expected = np.float32(np.float16(np.clip(value, -65504, 65504)))
        assert np.all(out == expected)
    else:
        assert np.array_equal(out, values)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=_ids(ALL_CODECS))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused(codec: CompressionBase, bad: float) -> None:
    values = np.ones(100, dtype=np.float32)
    values[17] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        codec.compress(values)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=_ids(ALL_CODECS))
def test_non_float_inputs_are_refused(codec: CompressionBase) -> None:
    with pytest.raises(TypeError):
        codec.compress(np.arange(10))
    with pytest.raises(TypeError):
        codec.compress([1.0, 2.0])  # type: ignore[arg-type]


def test_float16_clamps_to_its_range() -> None:
    values = np.array([1e6, -1e6, 1.0], dtype=np.float32)
    out = decompress(Float16Compression().compress(values))
    assert list(out) == [65504.0, -65504.0, 1.0]


def test_float64_beyond_float32_range_refused_by_scaled_codecs() -> None:
    values = np.array([1e300, 0.0])
    assert np.array_equal(decompress(NoCompression().compress(values)), values)
    with pytest.raises(ValueError, match="beyond float32"):
        Uniform8BitQuantization().compress(values)


def test_non_contiguous_and_big_endian_inputs() -> None:
    base = np.random.default_rng(2).standard_normal((40, 50)).astype(np.float32)
    for values in (base.T, base[::3, ::2], base.astype(">f4")):
        out = decompress(_roundtrip_wire(ScaledFloat16Compression().compress(values)))
        assert out.shape == values.shape
        assert np.allclose(out, values, atol=1e-3)


def test_blockwise_partial_last_block_and_outliers() -> None:
    rng = np.random.default_rng(3)
    values = rng.standard_normal(10_000).astype(np.float32)
    values[5] = 1000.0  # only the first block gets coarse
    codec = BlockwiseQuantization(block_size=4096)
    ct = codec.compress(values)
    assert ct.scales.shape == (3,)
    assert ct.block_size == 4096
    out = decompress(ct)
    assert out[5] == 1000.0
    assert np.max(np.abs(out[4096:] - values[4096:])) < 0.03
    with pytest.raises(ValueError, match="block_size"):
        BlockwiseQuantization(block_size=0)


def test_uniform_clamps_far_outliers() -> None:
    values = np.random.default_rng(4).standard_normal(100_000).astype(np.float32)
    values[0] = 50.0
    out = decompress(Uniform8BitQuantization(range_in_sigmas=6).compress(values))
    # levels over [min, max] would be 0.21 apart (MSE ~4e-3); mean ± 6σ keeps them ~0.04 apart
    assert _mse(out[1:], values[1:]) < 5e-4
    assert out[0] < 10


# --- error feedback ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "codec", [Uniform8BitQuantization(), BlockwiseQuantization()], ids=["uniform", "blockwise"]
)
def test_error_feedback_keeps_the_sum_on_track(codec: CompressionBase) -> None:
    rounds = 20
    values = np.random.default_rng(5).standard_normal((64, 64)).astype(np.float32)
    plain_sum = np.zeros(values.shape, dtype=np.float64)
    feedback_sum = np.zeros(values.shape, dtype=np.float64)
    feedback = ErrorFeedback()
    for _ in range(rounds):
        plain_sum += decompress(codec.compress(values))
        feedback_sum += decompress(feedback.compress(codec, values, key="w"))
    target = rounds * values.astype(np.float64)
    plain_error = float(np.abs(plain_sum - target).mean())
    feedback_error = float(np.abs(feedback_sum - target).mean())
    # without feedback the same rounding error adds up 20 times; with it, it stays one round's
    assert feedback_error < 0.2 * plain_error, (feedback_error, plain_error)
    residual = feedback.residual("w")
    assert residual is not None
    assert np.allclose(feedback_sum + residual, target, atol=1e-3)


def test_error_feedback_state_per_key_and_reset() -> None:
    codec = Uniform8BitQuantization()
    feedback = ErrorFeedback()
    a = np.random.default_rng(6).standard_normal(100).astype(np.float32)
    b = np.random.default_rng(7).standard_normal((3, 3)).astype(np.float64)
    feedback.compress(codec, a, key=0)
    feedback.compress(codec, b, key=1)
    res_b = feedback.residual(1)
    assert res_b is not None
    assert res_b.dtype == np.float64
    assert feedback.residual(0) is not None
    with pytest.raises(ValueError, match="changed shape"):
        feedback.compress(codec, a[:50], key=0)
    feedback.reset(0)
    assert feedback.residual(0) is None
    assert feedback.residual(1) is not None
    feedback.compress(codec, a[:50], key=0)
    feedback.reset()
    assert feedback.residual(0) is None
    assert feedback.residual(1) is None
    # a refused tensor leaves the stored residual alone
    feedback.compress(codec, a, key=0)
    before = feedback.residual(0)
    with pytest.raises(ValueError):
        feedback.compress(codec, np.full(100, np.nan, dtype=np.float32), key=0)
    assert feedback.residual(0) is before


def test_error_feedback_with_lossless_codec_has_zero_residual() -> None:
    feedback = ErrorFeedback()
    values = np.arange(10, dtype=np.float32)
    ct = feedback.compress(NoCompression(), values)
    assert np.array_equal(decompress(ct), values)
    residual = feedback.residual()
    assert residual is not None
    assert not residual.any()


# --- adaptive choice ---------------------------------------------------------------------------


def test_size_adaptive() -> None:
    small, big = NoCompression(), BlockwiseQuantization()
    chooser = SizeAdaptiveCompression(1000, less=small, greater_equal=big)
    assert chooser.choose(TensorInfo(size=999)) is small
    assert chooser.choose(TensorInfo(size=1000)) is big
    assert chooser.compress(np.zeros(10, dtype=np.float32)).codec == "none"
    ct = chooser.compress(np.ones(2000, dtype=np.float32))
    assert ct.codec == "blockwise_8bit"
    assert np.array_equal(chooser.decompress(ct), np.ones(2000, dtype=np.float32))
    with pytest.raises(TypeError):
        SizeAdaptiveCompression(10, less="fp16", greater_equal=big)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SizeAdaptiveCompression(-1, less=small, greater_equal=big)


def test_role_adaptive_and_nesting() -> None:
    param, opt, default = Float16Compression(), ScaledFloat16Compression(), NoCompression()
    grad_small, grad_big = Float16Compression(), Uniform8BitQuantization()
    chooser = RoleAdaptiveCompression(
        parameter=param,
        gradient=SizeAdaptiveCompression(2**16, less=grad_small, greater_equal=grad_big),
        optimizer=opt,
        default=default,
    )
    assert chooser.choose(TensorInfo("parameter", 10)) is param
    assert chooser.choose(TensorInfo("optimizer", 10**9)) is opt
    assert chooser.choose(TensorInfo("gradient", 100)) is grad_small
    assert chooser.choose(TensorInfo("gradient", 2**16)) is grad_big
    assert chooser.choose(TensorInfo("activation", 10)) is default
    assert chooser.choose(TensorInfo()) is default
    values = np.ones((300, 300), dtype=np.float32)
    assert chooser.compress(values, TensorInfo.of(values, "gradient")).codec == "uniform_8bit"
    assert isinstance(RoleAdaptiveCompression().choose(TensorInfo("gradient", 5)), NoCompression)
    with pytest.raises(ValueError, match="role"):
        TensorInfo("weights", 5)
    with pytest.raises(ValueError, match="size"):
        TensorInfo("gradient", -1)


# --- untrusted decoding --------------------------------------------------------------------------


def _parts(codec: CompressionBase | None = None, n: int = 1000) -> dict[str, Any]:
    values = np.random.default_rng(8).standard_normal(n).astype(np.float32)
    return dict((codec or Uniform8BitQuantization()).compress(values).to_parts())


def test_parts_are_plain_types() -> None:
    for codec in ALL_CODECS:
        parts = _parts(codec)
        assert set(parts) == {
            "codec",
            "shape",
            "dtype",
            "data",
            "scales",
            "codebook",
            "block_size",
        }
        assert all(type(v) in (str, int, list, bytes) for v in parts.values())
        assert all(type(d) is int for d in parts["shape"])
        # the parts survive msgpack as they are
        again = msgpack.unpackb(msgpack.packb(parts), strict_map_key=True)
        assert decompress(CompressedTensor.from_parts(again)).shape == (1000,)


def test_from_parts_accepts_memoryview_and_makes_no_copy() -> None:
    parts = _parts()
    buffer = bytearray(parts["data"])
    parts["data"] = memoryview(buffer)
    ct = CompressedTensor.from_parts(parts)
    assert np.shares_memory(ct.data, np.frombuffer(buffer, "u1"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"codec": "zstd"}, "unknown codec"),
        ({"codec": 3}, "codec must be a str"),
        ({"shape": [10**12]}, "exceeds"),
        ({"shape": [10**6, 10**6]}, "declares"),
        ({"shape": [-1000]}, "negative dimension"),
        ({"shape": [1001]}, "holds 1000 bytes"),
        ({"shape": [999]}, "holds 1000 bytes"),
        ({"shape": [10, 100.0]}, "ints"),
        ({"shape": [True, 1000]}, "ints"),
        ({"shape": [1] * 33}, "dimensions"),
        ({"shape": "1000"}, "list of ints"),
        ({"dtype": "int8"}, "dtype must be"),
        ({"dtype": "float128"}, "dtype must be"),
        ({"data": "x" * 1000}, "must be bytes"),
        ({"data": b"\0" * 999}, "holds 999 bytes"),
        ({"scales": np.array([np.nan, 1], "<f4").tobytes()}, "NaN or infinite"),
        ({"scales": np.array([0, np.inf], "<f4").tobytes()}, "NaN or infinite"),
        ({"scales": np.array([0, -1], "<f4").tobytes()}, "negative step"),
        ({"scales": b"\0" * 12}, "scales holds 12 bytes"),
        ({"codebook": b"\0" * 4}, "codebook holds 4 bytes"),
        ({"block_size": 4096}, "block_size must be 0"),
        ({"block_size": "0"}, "block_size must be an int"),
    ],
)
def test_from_parts_refuses(change: dict[str, Any], message: str) -> None:
    parts = _parts()
    parts.update(change)
    with pytest.raises(ValueError, match=message):
        CompressedTensor.from_parts(parts)


def test_from_parts_refuses_bad_fields_per_codec() -> None:
    parts = _parts(Quantile8BitQuantization())
    parts["codebook"] = np.zeros(255, "<f4").tobytes()
    with pytest.raises(ValueError, match="codebook holds 1020 bytes"):
        CompressedTensor.from_parts(parts)
    parts["codebook"] = np.full(256, np.nan, "<f4").tobytes()
    with pytest.raises(ValueError, match="codebook holds NaN"):
        CompressedTensor.from_parts(parts)

    parts = _parts(BlockwiseQuantization(block_size=256))
    for block_size, message in [(0, "outside"), (2**40, "outside"), (512, "scales holds")]:
        with pytest.raises(ValueError, match=message):
            CompressedTensor.from_parts({**parts, "block_size": block_size})
    scales = np.frombuffer(parts["scales"], "<f4").copy()
    scales[1] = -scales[1]
    with pytest.raises(ValueError, match="negative block scale"):
        CompressedTensor.from_parts({**parts, "scales": scales.tobytes()})

    for codec in (Float16Compression(), ScaledFloat16Compression(), NoCompression()):
        parts = _parts(codec)
        data = bytearray(parts["data"])
        data[-2:] = np.array([np.inf], "<f2").tobytes() if codec.name != "none" else data[-2:]
        if codec.name == "none":
            data[-4:] = np.array([np.nan], "<f4").tobytes()
        with pytest.raises(ValueError, match="data holds NaN"):
            CompressedTensor.from_parts({**parts, "data": bytes(data)})
    parts = _parts(ScaledFloat16Compression())
    with pytest.raises(ValueError, match="negative std"):
        CompressedTensor.from_parts({**parts, "scales": np.array([0, -1], "<f4").tobytes()})


def test_from_parts_refuses_missing_and_extra_fields() -> None:
    parts = _parts()
    with pytest.raises(ValueError, match="missing"):
        CompressedTensor.from_parts({k: v for k, v in parts.items() if k != "scales"})
    with pytest.raises(ValueError, match="unexpected"):
        CompressedTensor.from_parts({**parts, "pickle": b""})
    with pytest.raises(ValueError, match="mapping"):
        CompressedTensor.from_parts([1, 2])  # type: ignore[arg-type]


def test_huge_declared_shape_is_refused_before_allocating() -> None:
    import tracemalloc

    parts = _parts()
    tracemalloc.start()
    try:
        for shape in ([10**12], [2**31 + 1], [2**16, 2**16]):
            with pytest.raises(ValueError):
                CompressedTensor.from_parts({**parts, "shape": shape})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    # the cap itself holds for a consistent (but unsent) declaration too
    with pytest.raises(ValueError, match="exceeds"):
        CompressedTensor(
            "uniform_8bit", (MAX_COMPRESSED_ELEMENTS + 1,), "float32", np.zeros(0, np.uint8)
        )


def test_extreme_but_finite_scales_decode_without_inf() -> None:
    n = 100
    huge = np.float32(3e38)
    cases = [
        CompressedTensor(
            "uniform_8bit",
            (n,),
            "float32",
            np.full(n, 255, np.uint8),
            np.array([huge, huge], np.float32),
        ),
        CompressedTensor(
            "meanstd_16bit",
            (n,),
            "float16",
            np.full(n, 60000, np.float16),
            np.array([1, 1e30], np.float32),
        ),
        CompressedTensor(
            "blockwise_8bit",
            (n,),
            "float32",
            np.full(n, 255, np.uint8),
            np.array([huge], np.float32),
            block_size=4096,
        ),
    ]
    for ct in cases:
        ct.validate()
        with np.errstate(all="raise"):
            out = decompress(_roundtrip_wire(ct))
        assert np.isfinite(out).all()
        assert out.dtype == np.dtype(ct.dtype)


_garbage = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=64),
    st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=40),
    st.lists(st.one_of(st.integers(), st.floats(), st.text(max_size=3)), max_size=4),
)


@st.composite
def _mutated_parts(draw: st.DrawFn) -> dict[Any, Any]:
    codec = draw(st.sampled_from(ALL_CODECS))
    n = draw(st.integers(min_value=0, max_value=300))
    values = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    parts: dict[Any, Any] = dict(codec.compress(values).to_parts())
    for key in draw(st.lists(st.sampled_from(sorted(parts)), max_size=3, unique=True)):
        action = draw(st.sampled_from(["garbage", "delete", "bitflip", "resize"]))
        if action == "garbage":
            parts[key] = draw(_garbage)
        elif action == "delete":
            del parts[key]
        elif isinstance(parts[key], bytes):
            raw = bytearray(parts[key])
            if action == "bitflip" and raw:
                i = draw(st.integers(min_value=0, max_value=len(raw) - 1))
                raw[i] ^= 1 << draw(st.integers(min_value=0, max_value=7))
            else:
                raw = raw[: draw(st.integers(min_value=0, max_value=len(raw) + 8))]
                raw += b"\xff" * draw(st.integers(min_value=0, max_value=8))
            parts[key] = bytes(raw)
        else:
            parts[key] = draw(_garbage)
    if draw(st.booleans()):
        parts[draw(st.text(max_size=5))] = draw(_garbage)
    return parts


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutated_parts())
def test_fuzz_from_parts(parts: dict[Any, Any]) -> None:
    try:
        ct = CompressedTensor.from_parts(parts)
    except (ValueError, TypeError):
        return
    with np.errstate(all="raise"):  # whatever was accepted decodes cleanly, finite
        out = decompress(ct)
    assert out.shape == ct.shape
    assert np.isfinite(out).all()


@pytest.mark.process
def test_module_imports_without_torch() -> None:
    code = "import sys, swarmavg.compression; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("kind", ["normal", "cauchy", "steps", "tiny", "on_bounds"])
def test_quantile_codes_equal_a_binary_search(kind: str) -> None:
    """The grid that assigns Quantile8BitQuantization's codes gives exactly what a binary
    search over the bounds gives (heavy tails, repeated values, a tiny range, values equal
    to bounds)."""
    from swarmavg.compression import _buckets

    rng = np.random.default_rng(len(kind))
    for _ in range(20):
        n = int(rng.integers(1 << 15, 1 << 17))
        if kind == "cauchy":
            values = rng.standard_cauchy(n)
        elif kind == "steps":
            values = np.round(rng.standard_normal(n) * 3) / 3
        elif kind == "tiny":
            values = rng.uniform(-1e-30, 1e-30, n)
        else:
            values = rng.standard_normal(n)
        x = values.astype(np.float32)
        bounds = np.sort(rng.choice(x, 255)).astype(np.float32)
        if kind == "on_bounds":
            x[:255] = bounds
        lo, hi = float(x.min()), float(x.max())
        got = _buckets(bounds, x, lo, hi)
        np.testing.assert_array_equal(got, np.searchsorted(bounds, x).astype(np.uint8))


@pytest.mark.parametrize("source", ["writable", "read-only", "strided"])
def test_float16_casts_through_torch_equal_numpy_casts(source: str) -> None:
    """Big float16 payloads are cast by torch where it is imported: exactly numpy's values
    (round to nearest even, subnormals, halfway cases, signed zeros), whatever the array."""
    rng = np.random.default_rng(7)
    n = 1 << 16  # above the size where torch takes over
    halfway = (np.arange(1024, dtype=np.float32) + 0.5) * np.float32(2**-24)  # subnormal ties
    special = np.array([0.0, -0.0, 6.1e-5, 6.09e-5, 5.96e-8, 2.98e-8, 65504.0, -65504.0], "<f4")
    x = np.concatenate([rng.standard_normal(n).astype("<f4") * 100, halfway, -halfway, special])
    x = np.concatenate([x, rng.uniform(-1e-7, 1e-7, n).astype("<f4")])
    if source == "read-only":
        x = np.frombuffer(x.tobytes(), "<f4")
    elif source == "strided":
        x = np.repeat(x, 2)[::2]
    assert "torch" in sys.modules
    ct = Float16Compression().compress(x)
    np.testing.assert_array_equal(ct.data.view("<u2"), x.astype("<f2").view("<u2"))
    back = CompressedTensor.from_parts(ct.to_parts())  # read-only float16 data
    assert not back.data.flags.writeable
    decoded = decompress(back)
    np.testing.assert_array_equal(decoded.view("<u4"), ct.data.astype("<f4").view("<u4"))
    scaled = ScaledFloat16Compression().compress(x)
    mean, std = scaled.scales
    centred = np.clip((x - mean) * (np.float32(1.0) / std), -65504, 65504)
    np.testing.assert_array_equal(scaled.data.view("<u2"), centred.astype("<f2").view("<u2"))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_big_float16_payloads_with_non_finite_values_are_refused(bad: float) -> None:
    parts = Float16Compression().compress(np.ones(1 << 16, "<f4")).to_parts()
    data = np.frombuffer(parts["data"], "<f2").copy()  # type: ignore[arg-type]
    data[12345] = bad
    with pytest.raises(ValueError, match="data holds NaN"):
        CompressedTensor.from_parts({**parts, "data": data.tobytes()})
