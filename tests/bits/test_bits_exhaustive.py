"""The codec against ml_dtypes, exhaustively where the space is small.

ml_dtypes is the oracle (never used by the codec). Documented deviations from it:
- E8M0: ml_dtypes rounds float32-subnormal inputs in (2**-127, 1.5 * 2**-127) up to 2**-126;
  the codec rounds them to nearest (checked against the exact scalar reference instead).
- NaN into formats without NaN (FP4, FP6): ml_dtypes gives a zero of flipped sign; the codec
  gives +0.
"""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from precisionlab.bits import Class, classify, decode, encode, fields
from precisionlab.bits._codec import _encode
from precisionlab.bits._rounding import Rounding
from precisionlab.bits.reference import encode_scalar
from precisionlab.formats import FORMATS, FloatFormat, IntFormat, get_format

SMALL_FLOATS = [f for f in FORMATS.values() if isinstance(f, FloatFormat) and f.bits <= 16]
ORACLE = {f.name: np.dtype(getattr(ml_dtypes, f.name, f.name)) for f in SMALL_FLOATS}
NARROW = [f for f in SMALL_FLOATS if f.bits <= 8]
SOURCES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def _all_codes(fmt) -> np.ndarray:
    return np.arange(1 << fmt.bits, dtype=np.uint32).astype(fmt.code_dtype)


def _same_floats(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal values, NaN as NaN, -0 as -0."""
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    return bool(
        np.array_equal(nan_a, nan_b)
        and np.array_equal(a[~nan_a], b[~nan_b])
        and np.array_equal(np.signbit(a[~nan_a]), np.signbit(b[~nan_b]))
    )


@pytest.mark.parametrize("fmt", SMALL_FLOATS, ids=str)
def test_decode_every_code_matches_ml_dtypes(fmt):
    codes = _all_codes(fmt)
    expected = codes.view(ORACLE[fmt.name]).astype(np.float32)
    got = np.asarray(decode(codes, fmt))
    assert got.dtype == np.float32
    assert _same_floats(got, expected)


@pytest.mark.parametrize("fmt", SMALL_FLOATS, ids=str)
def test_decode_every_code_matches_scalar_reference(fmt):
    codes = _all_codes(fmt)
    expected = np.array([fmt.value_of(int(c)) for c in codes], dtype=np.float64)
    got = np.asarray(decode(codes, fmt)).astype(np.float64)
    assert _same_floats(got, expected)


@pytest.mark.parametrize("fmt", SMALL_FLOATS, ids=str)
def test_classify_and_fields_every_code(fmt):
    codes = _all_codes(fmt)
    values = codes.view(ORACLE[fmt.name]).astype(np.float64)
    cls = np.asarray(classify(codes, fmt))
    expected = np.full(codes.shape, Class.NORMAL)
    expected[values == 0] = Class.ZERO
    tiny = (values != 0) & (np.abs(values) < fmt.smallest_normal)
    expected[tiny] = Class.SUBNORMAL
    expected[np.isinf(values)] = Class.INF
    expected[np.isnan(values)] = Class.NAN
    np.testing.assert_array_equal(cls, expected)
    sign, exponent, mantissa = (np.asarray(a).astype(np.int64) for a in fields(codes, fmt))
    rebuilt = (
        (sign << (fmt.bits - 1) if fmt.signed else 0) | (exponent << fmt.mantissa_bits) | mantissa
    )
    np.testing.assert_array_equal(rebuilt, codes.astype(np.int64))


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("fmt", SMALL_FLOATS, ids=str)
def test_encode_every_16bit_value_matches_ml_dtypes(fmt, source):
    """Every float16 / bfloat16 value, nearest-even, default overflow, against ml_dtypes."""
    x = np.arange(1 << 16, dtype=np.uint16).view(SOURCES[source])
    got = np.asarray(encode(jnp.asarray(x), fmt))
    assert got.dtype == fmt.code_dtype
    with np.errstate(invalid="ignore", over="ignore"):
        expected = x.astype(ORACLE[fmt.name]).view(fmt.code_dtype)
    x32 = x.astype(np.float32)
    nan_in = np.isnan(x32)
    check = ~nan_in
    if fmt.name == "float8_e8m0fnu":  # ml_dtypes rounds f32-subnormal inputs up: see module doc
        check &= ~((np.abs(x32) < np.finfo(np.float32).tiny) & (x32 != 0))
    mismatch = np.flatnonzero(check & (got != expected))
    assert mismatch.size == 0, [
        (float(x32[i]), hex(got[i]), hex(expected[i])) for i in mismatch[:5]
    ]
    # NaN inputs: NaN out where the format has NaN (same sign unless fnuz), else +0.
    got_nan = np.asarray(decode(got[nan_in], fmt))
    if fmt.has_nan:
        assert np.isnan(got_nan).all()
        if fmt.signed and fmt.specials != "fnuz":
            assert np.array_equal(got[nan_in] >> (fmt.bits - 1), np.signbit(x32[nan_in]))
    else:
        assert (got[nan_in] == 0).all()


def test_e8m0_subnormal_inputs_round_to_nearest():
    """Where ml_dtypes deviates (see module doc), the codec equals the exact reference."""
    fmt = get_format("e8m0")
    bits = np.arange(1, 1 << 23, 997, dtype=np.uint32)  # positive float32 subnormals
    x = bits.view(np.float32)
    got = np.asarray(jax.jit(lambda v: encode(v, fmt))(x))
    expected = np.array([encode_scalar(float(v), fmt) for v in x])
    np.testing.assert_array_equal(got, expected)
    assert np.asarray(encode(np.float32(1.4 * 2.0**-127), fmt)) == 0x00  # 2**-127


def _sweep_float32(
    fmt_name: str, chunk_log2: int = 22, stride: int = 1, chunks: list[int] | None = None
) -> None:
    """Every float32 bit pattern into fmt, streamed in chunks, against ml_dtypes (or every
    ``stride``-th chunk, or the chunks numbered in ``chunks``)."""
    fmt = get_format(fmt_name)
    oracle = ORACLE[fmt.name]
    n = 1 << chunk_log2

    @jax.jit
    def chunk(start):
        x = jax.lax.bitcast_convert_type(start + jnp.arange(n, dtype=jnp.uint32), jnp.float32)
        return _encode(
            x,
            None,
            fmt=fmt,
            mode=Rounding.NEAREST_EVEN,
            saturate=False,
            subnormals=True,
            random_bits=32,
        )

    base = np.arange(n, dtype=np.uint32)
    starts = list(range(0, 1 << (32 - chunk_log2), stride)) if chunks is None else chunks
    pending = chunk(jnp.uint32(starts[0] * n))
    for k, i in enumerate(starts):
        got = np.asarray(pending)
        if k + 1 < len(starts):
            pending = chunk(jnp.uint32(starts[k + 1] * n))  # overlap the next chunk and check
        x = (base + np.uint32(i * n)).view(np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            expected = x.astype(oracle).view(fmt.code_dtype)
        bad = got != expected
        if bad.any():
            bad &= ~np.isnan(x)  # NaN payloads: checked separately below
            if fmt.name == "float8_e8m0fnu":
                bad &= ~((np.abs(x) < np.finfo(np.float32).tiny) & (x != 0))
        idx = np.flatnonzero(bad)
        assert idx.size == 0, [(float(x[j]), hex(got[j]), hex(expected[j])) for j in idx[:5]]


def test_every_float32_into_bfloat16():
    _sweep_float32("bfloat16")


def test_every_float32_into_float16():
    """All 2**32 patterns against XLA's native float32 -> float16 convert (the hardware
    conversion, an implementation independent of the codec), compared on the device; numpy's
    cast (~20 M/s, 4 minutes for the whole space) checks the chunks that hold float16's range
    boundaries here (below), and the whole space under ``-m slow``."""
    fmt = get_format("float16")
    n = 1 << 22

    @jax.jit
    def mismatches(start):
        x = jax.lax.bitcast_convert_type(start + jnp.arange(n, dtype=jnp.uint32), jnp.float32)
        ours = _encode(
            x, None, fmt=fmt, mode=Rounding.NEAREST_EVEN, saturate=False, subnormals=True,
            random_bits=32,
        )  # fmt: skip
        native = jax.lax.bitcast_convert_type(x.astype(jnp.float16), jnp.uint16)
        return jnp.sum((ours != native) & ~jnp.isnan(x))

    counts = [mismatches(jnp.uint32(i * n)) for i in range(1 << 10)]
    assert sum(int(c) for c in counts) == 0
    # Chunk 2e + h holds the float32s of biased exponent e, lower (h = 0) or upper half of the
    # mantissas; + 512: negative. e = 102: around half float16's smallest subnormal (2^-25, the
    # flush-or-round tie); 113: its smallest normal (2^-14); 142, upper half: its largest
    # finite (65504) and the overflow threshold (65520); 255: inf and NaN.
    edges = [2 * 102, 2 * 113, 2 * 142 + 1, 2 * 255]
    _sweep_float32("float16", chunks=edges + [512 + c for c in edges])


@pytest.mark.slow
def test_every_float32_into_float16_against_numpy():
    _sweep_float32("float16")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [f.name for f in NARROW], ids=str)
def test_every_float32_into_8bit_and_narrower(fmt):
    _sweep_float32(fmt)


def test_nan_payloads_keep_sign_and_stay_nan():
    x = np.array([np.nan, -np.nan], dtype=np.float32)
    x = np.concatenate(
        [x, (np.uint32(0x7F800001) + np.arange(0, 1 << 22, 4099, dtype=np.uint32)).view(np.float32)]
    )
    for fmt in ("bfloat16", "float16", "e5m2", "e4m3"):
        out = np.asarray(decode(encode(x, fmt), fmt))
        assert np.isnan(out).all()
        np.testing.assert_array_equal(np.signbit(out), np.signbit(x))


@pytest.mark.parametrize("name", ["int8", "uint8", "int4", "uint4", "int2"])
def test_int_formats_round_and_saturate_like_numpy(name):
    """Oracle: numpy rint (nearest-even) + clip; ml_dtypes int casts wrap, so not them."""
    fmt: IntFormat = get_format(name)
    rng = np.random.default_rng(0)
    x = np.concatenate([
        rng.normal(0, fmt.max, 20000), np.arange(-300, 300, 0.25),
        [np.inf, -np.inf, 1e30, -1e30, 0.5, 1.5, 2.5, -0.5, -2.5, 1e-40, -0.0],
    ]).astype(np.float32)  # fmt: skip
    codes = np.asarray(encode(x, fmt))
    assert codes.dtype == fmt.code_dtype
    expected = np.clip(np.rint(x.astype(np.float64)), fmt.min, fmt.max).astype(np.int64)
    got = np.array([fmt.value_of(int(c)) for c in codes])
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.asarray(decode(codes, fmt)), expected.astype(np.float32))
    assert np.asarray(encode(np.float32(np.nan), fmt)) == 0  # documented: NaN -> 0


def test_int4_two_complement_codes():
    codes = np.asarray(encode(np.arange(-8, 8, dtype=np.float32), "int4"))
    np.testing.assert_array_equal(codes, np.r_[8:16, 0:8])
    assert int(encode(np.float32(-1), "int4")) == 0xF


def test_subnormal_inputs_under_jit_are_exact():
    """XLA on CPU flushes f32 subnormals in float ops; the codec must not."""
    bits = np.array([1, 2, 3, 0x7FFFFF, 0x400000, 0x80000001, 0x807FFFFF], dtype=np.uint32)
    x = bits.view(np.float32)
    # Flushed to 0 on XLA's CPU backend, 2**-148 where subnormals are kept: either way the
    # codec below must not depend on it.
    assert float(jax.jit(lambda v: v * 2)(x)[0]) in (0.0, float(np.float32(2.0**-148)))
    for fmt in ("bfloat16", "float16", "e8m0", "float32"):
        got = np.asarray(jax.jit(lambda v, f=fmt: encode(v, f))(x))
        expected = np.array([encode_scalar(float(v), fmt) for v in x])
        np.testing.assert_array_equal(got, expected)
    # float32 -> float32 is the identity on every subnormal bit pattern.
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: encode(v, "float32"))(x)), bits)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda c: decode(c, "float32"))(bits)).view(np.uint32), bits
    )


def test_ocp_examples():
    assert int(encode(np.float32(448), "e4m3")) == 0x7E
    assert int(encode(np.float32(57344), "e5m2")) == 0x7B
    assert float(decode(np.uint8(0x01), "e4m3")) == 2.0**-9
    assert float(decode(np.uint8(0x01), "e5m2")) == 2.0**-16
    assert int(encode(np.float32(1000.0), "e4m3")) == 0x7F  # overflow: NaN (no inf)
    assert float(decode(encode(np.float32(1000.0), "e5m2"), "e5m2")) == 1024.0  # 896 < 1000
    assert math.isinf(float(decode(encode(np.float32(1e6), "e5m2"), "e5m2")))
