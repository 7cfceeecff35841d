"""Rounding modes, saturation and flushing: the JAX codec against the exact scalar reference,
plus properties that hold whatever the reference says."""

import math
import os
import subprocess
import sys
import textwrap
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from precisionlab.bits import ROUNDING_MODES, decode, encode, round_to_format
from precisionlab.bits.reference import encode_scalar, next_down, next_up
from precisionlab.formats import FloatFormat, get_format

DETERMINISTIC = [m for m in ROUNDING_MODES if m != "stochastic"]
FORMATS = [
    "bfloat16", "float16", "e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz", "e4m3b11fnuz", "e3m4",
    "e8m0", "e2m3", "e3m2", "fp4", "tf32", "int8", "uint8", "int4", "uint4", "int2",
    FloatFormat(name="e3m2b5", exponent_bits=3, mantissa_bits=2, bias=5),
    FloatFormat(name="e6m9", exponent_bits=6, mantissa_bits=9),
]  # fmt: skip

# Float32 bit patterns; hypothesis shrinks toward small codes (subnormals, zero). A fixed
# batch size keeps the number of compilations down.
float32_batches = st.lists(st.integers(0, 2**32 - 1), min_size=32, max_size=32).map(
    lambda codes: np.array(codes, dtype=np.uint32).view(np.float32)
)


def _reference(x: np.ndarray, fmt, **kw) -> np.ndarray:
    return np.array([encode_scalar(float(v), fmt, **kw) for v in x])


def _assert_codes_equal(got: np.ndarray, expected: np.ndarray, fmt) -> None:
    """Equal codes, except that NaNs compare by sign only (the codec keeps NaN payloads)."""
    fmt = get_format(fmt)
    value = np.vectorize(fmt.value_of, otypes=[float])
    nan_got, nan_exp = np.isnan(value(got)), np.isnan(value(expected))
    np.testing.assert_array_equal(nan_got, nan_exp)
    np.testing.assert_array_equal(got[~nan_got], expected[~nan_exp])
    if fmt.signed and getattr(fmt, "specials", None) != "fnuz":
        sign = fmt.bits - 1
        np.testing.assert_array_equal(got[nan_got] >> sign, expected[nan_exp] >> sign)


@given(x=float32_batches, fmt=st.sampled_from(FORMATS), mode=st.sampled_from(DETERMINISTIC))
def test_encode_equals_exact_reference(x, fmt, mode):
    got = np.asarray(encode(x, fmt, rounding=mode))
    _assert_codes_equal(got, _reference(x, fmt, rounding=mode), fmt)


@given(
    x=float32_batches,
    fmt=st.sampled_from(FORMATS),
    mode=st.sampled_from(DETERMINISTIC),
    saturate=st.booleans(),
    subnormals=st.booleans(),
)
def test_saturate_and_flush_equal_reference(x, fmt, mode, saturate, subnormals):
    kw = dict(rounding=mode, saturate=saturate, subnormals=subnormals)
    got = np.asarray(encode(x, fmt, **kw))
    _assert_codes_equal(got, _reference(x, fmt, **kw), fmt)


def _neighbours(v: float, fmt) -> tuple[float, float]:
    """The representable values just below and just above (or equal to) v, exactly."""
    fmt = get_format(fmt)
    down = fmt.value_of(encode_scalar(v, fmt, rounding="down", saturate=True))
    up = fmt.value_of(encode_scalar(v, fmt, rounding="up", saturate=True))
    return down, up


@given(x=float32_batches, fmt=st.sampled_from(["bfloat16", "float16", "e4m3", "e5m2", "e2m3"]))
def test_directed_modes_bracket_x(x, fmt):
    # Replace (rather than drop) out-of-range values: a fixed shape avoids recompiles.
    x = np.where(np.isfinite(x) & (np.abs(x) <= get_format(fmt).max), x, np.float32(1.5))
    values = {
        m: np.asarray(round_to_format(x, fmt, rounding=m)).astype(np.float64) for m in DETERMINISTIC
    }
    exact = x.astype(np.float64)
    assert (values["up"] >= exact).all()
    assert (values["down"] <= exact).all()
    assert (np.abs(values["toward_zero"]) <= np.abs(exact)).all()
    for mode in DETERMINISTIC:
        for v, got in zip(exact, values[mode], strict=True):
            lo, hi = _neighbours(float(v), fmt)
            assert got in (lo, hi), (mode, v, got, lo, hi)
    # Nearest modes: no other value is closer.
    for mode in ("nearest_even", "nearest_away"):
        err = np.abs(values[mode] - exact)
        assert (err <= np.abs(values["up"] - exact)).all()
        assert (err <= np.abs(values["down"] - exact)).all()


@given(x=float32_batches, fmt=st.sampled_from(["bfloat16", "float16", "e4m3", "e5m2", "e3m4"]))
def test_to_odd_sets_last_bit_when_inexact(x, fmt):
    f = get_format(fmt)
    x = np.where(np.isfinite(x) & (np.abs(x) < f.max) & (x != 0), x, np.float32(0.3))
    codes = np.asarray(encode(x, fmt, rounding="to_odd")).astype(np.int64)
    # Inexact, decided exactly (not with the codec): x is not a value of the format.
    exact = np.array(
        [f.value_of(encode_scalar(float(v), f, rounding="toward_zero")) != v for v in x]
    )
    assert ((codes[exact] & 1) == 1).all()
    # Exact values are untouched by to_odd.
    np.testing.assert_array_equal(codes[~exact], np.asarray(encode(x[~exact], fmt)))


def test_overflow_per_mode_follows_ieee():
    """Nearest/away-from-zero overflow to inf; toward-zero modes give the largest finite."""
    big = np.float32([1e6, -1e6])
    f16 = get_format("float16")
    assert list(np.asarray(round_to_format(big, f16))) == [np.inf, -np.inf]
    assert list(np.asarray(round_to_format(big, f16, rounding="toward_zero"))) == [65504, -65504]
    assert list(np.asarray(round_to_format(big, f16, rounding="up"))) == [np.inf, -65504]
    assert list(np.asarray(round_to_format(big, f16, rounding="down"))) == [65504, -np.inf]
    assert list(np.asarray(round_to_format(big, f16, saturate=True))) == [65504, -65504]
    assert np.isnan(np.asarray(round_to_format(big, "e4m3"))).all()
    assert list(np.asarray(round_to_format(big, "e4m3", saturate=True))) == [448, -448]
    assert list(np.asarray(round_to_format(big, "fp4"))) == [6, -6]  # no inf, no NaN
    inf = np.float32([np.inf, -np.inf])
    assert list(np.asarray(round_to_format(inf, "e5m2", saturate=True))) == [57344, -57344]
    assert list(np.asarray(round_to_format(inf, "fp4"))) == [6, -6]
    nan = np.float32(np.nan)
    assert np.isnan(np.asarray(round_to_format(nan, "e4m3", saturate=True)))
    assert int(encode(nan, "fp4")) == 0  # documented: NaN -> +0 where there is no NaN


def test_flush_subnormals_keeps_sign():
    x = np.float32([2.0**-20, -(2.0**-20), 2.0**-14, -(2.0**-24)])
    codes = np.asarray(encode(x, "float16", subnormals=False))
    np.testing.assert_array_equal(codes, [0x0000, 0x8000, 0x0400, 0x8000])


def test_e8m0_has_no_zero_and_rounds_ties_up():
    e8m0 = get_format("e8m0")
    x = np.float32([0.0, -1.0, 1.5, 1.49, 0.75, 3.0, 2.0**-140])
    codes = np.asarray(encode(x, e8m0))
    np.testing.assert_array_equal(codes, [0xFF, 0xFF, 0x80, 0x7F, 0x7F, 0x81, 0x00])
    np.testing.assert_array_equal(np.asarray(encode(x[:2], e8m0, saturate=True)), [0, 0])


def _sr_stats(x: float, fmt, n: int, random_bits=None, seed=0):
    key = jax.random.key(seed)
    xs = jnp.full((n,), x, jnp.float32)
    out = np.asarray(
        round_to_format(xs, fmt, rounding="stochastic", key=key, random_bits=random_bits)
    )
    return out.astype(np.float64)


@pytest.mark.parametrize("fmt", ["bfloat16", "float16", "e4m3", "e5m2", "fp4", "int8"])
@pytest.mark.parametrize("x", [1.0 + 2.0**-9, -3.3, 0.1, 1e-3, 2.0**-12 * 1.3, 5.25])
def test_stochastic_rounding_is_unbiased(fmt, x):
    """E[SR(x)] = x: the mean of n draws is within 5 standard errors of x."""
    n = 1 << 16
    lo, hi = _neighbours(float(np.float32(x)), fmt)
    out = _sr_stats(x, fmt, n)
    assert set(np.unique(out)) <= {lo, hi}
    x32 = float(np.float32(x))
    if lo == hi:
        assert (out == x32).all()
        return
    p = (x32 - lo) / (hi - lo)
    stderr = (hi - lo) * math.sqrt(p * (1 - p) / n)
    assert abs(out.mean() - x32) <= 5 * stderr + 1e-300


def test_stochastic_rounding_with_few_random_bits_truncates_the_fraction():
    # x sits 0.3 of the way from 1.0 to the next bf16 value; with 2 random bits the
    # fraction is truncated to 0.25, as hardware with a short random word does.
    gap = 2.0**-7
    x = 1.0 + 0.3 * gap
    n = 1 << 16
    out = _sr_stats(x, "bfloat16", n, random_bits=2)
    p_up = (out > 1.0).mean()
    assert abs(p_up - 0.25) < 5 * math.sqrt(0.25 * 0.75 / n)
    out = _sr_stats(x, "bfloat16", n)
    assert abs((out > 1.0).mean() - float(np.float32(x) - 1.0) / gap) < 5 * math.sqrt(0.21 / n)


def test_stochastic_needs_a_key_and_draws_differ_by_key():
    with pytest.raises(ValueError, match="needs a PRNG key"):
        encode(np.float32(0.1), "bf16", rounding="stochastic")
    x = jnp.full((1000,), 0.1, jnp.float32)
    a = encode(x, "bf16", rounding="stochastic", key=jax.random.key(1))
    b = encode(x, "bf16", rounding="stochastic", key=jax.random.key(2))
    c = encode(x, "bf16", rounding="stochastic", key=jax.random.key(1))
    assert (np.asarray(a) != np.asarray(b)).any()
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_bad_arguments_raise_clearly():
    with pytest.raises(ValueError, match=r"unknown rounding mode 'nearest'.*nearest_even"):
        encode(np.float32(1), "bf16", rounding="nearest")
    with pytest.raises(ValueError, match="unknown format"):
        encode(np.float32(1), "bf17")
    with pytest.raises(TypeError, match="float32, float16, bfloat16"):
        encode(np.int32(3), "bf16")
    with pytest.raises(TypeError, match="integer array"):
        decode(np.float32(1.0), "bf16")
    with pytest.raises(ValueError, match="random_bits"):
        encode(np.float32(1), "bf16", rounding="stochastic", key=jax.random.key(0), random_bits=0)
    with pytest.raises(ValueError, match="only used by rounding='stochastic'"):
        encode(np.float32(1), "bf16", key=jax.random.key(0))
    with pytest.raises(ValueError, match="jax_enable_x64"):
        decode(np.uint8(1), "e4m3", dtype=jnp.float64)


def test_half_inputs_are_upcast_exactly():
    x16 = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    x16 = x16[np.isfinite(x16)]
    np.testing.assert_array_equal(
        np.asarray(encode(jnp.asarray(x16), "e5m2")),
        np.asarray(encode(jnp.asarray(x16.astype(np.float32)), "e5m2")),
    )


def test_jit_and_vmap_compose():
    x = jnp.linspace(-3, 3, 64, dtype=jnp.float32).reshape(8, 8)
    f = jax.jit(jax.vmap(lambda row: decode(encode(row, "e4m3"), "e4m3")))
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(round_to_format(x, "e4m3")))


def test_scalar_neighbours_walk_every_value_in_order():
    for name in ("e4m3", "e5m2", "e4m3fnuz", "fp4", "e8m0", "int4"):
        fmt = get_format(name)
        codes = range(1 << fmt.bits)
        finite = sorted({fmt.value_of(c) for c in codes if math.isfinite(fmt.value_of(c))})
        for c in codes:
            v = fmt.value_of(c)
            if not math.isfinite(v):
                continue
            up, down = next_up(c, fmt), next_down(c, fmt)
            i = finite.index(v)
            expect_up = finite[i + 1] if i + 1 < len(finite) else None
            expect_down = finite[i - 1] if i > 0 else None
            got_up = None if up is None else fmt.value_of(up)
            got_down = None if down is None else fmt.value_of(down)
            if expect_up is None and getattr(fmt, "has_inf", False):
                expect_up = math.inf
            if expect_down is None and getattr(fmt, "has_inf", False):
                expect_down = -math.inf
            assert got_up == expect_up and got_down == expect_down, (name, hex(c))


def test_float64_inputs_are_encoded_from_their_own_bits():
    """Under x64 a double is rounded once; via float32 it would be rounded twice."""
    script = textwrap.dedent(
        """
        import jax, numpy as np
        jax.config.update("jax_enable_x64", True)
        from precisionlab.bits import encode, decode
        from precisionlab.bits.reference import encode_scalar
        x = np.array([1 + 2**-8 + 2**-30, -(1 + 2**-8 + 2**-40), 0.1, 1e-310, 1e300, 2**-133],
                     dtype=np.float64)
        rng = np.random.default_rng(0)
        x = np.concatenate([x, rng.normal(size=2000) * 10.0 ** rng.integers(-40, 40, 2000)])
        for fmt in ["bfloat16", "float16", "e4m3", "e5m2", "float32", "fp4", "int8"]:
            for mode in ["nearest_even", "to_odd", "up", "toward_zero"]:
                got = np.asarray(encode(x, fmt, rounding=mode))
                ref = np.array([encode_scalar(float(v), fmt, rounding=mode) for v in x])
                assert (got == ref).all(), (fmt, mode, x[got != ref][:3])
        # Double rounding through float32 would give 1.0 here; once gives 1 + 2**-7.
        once = decode(encode(x[:1], "bfloat16"), "bfloat16", dtype=np.float64)
        assert float(once[0]) == 1 + 2**-7
        codes = np.arange(2**16, dtype=np.uint16)
        v = np.asarray(decode(codes, "float16", dtype=np.float64))
        ref = codes.view(np.float16).astype(np.float64)
        assert np.array_equal(v[np.isfinite(v)], ref[np.isfinite(v)])
        print("ok")
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_exact_fraction_rounding_in_reference():
    # 0.1 (the decimal) rounds once to bf16: no detour through binary64.
    from decimal import Decimal

    code = encode_scalar(Decimal("0.1"), "bf16")
    assert get_format("bf16").value_of(code) == 0.10009765625
    assert encode_scalar(Fraction(1, 3), "fp4") == encode_scalar(1 / 3, "fp4")
