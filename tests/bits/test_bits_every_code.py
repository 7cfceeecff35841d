"""Every code of every small format decodes as the value computed by hand from its fields; codes
out of range raise or poison."""

from __future__ import annotations

import numpy as np
import pytest

# format -> (exponent bits, mantissa bits, specials): "fn" (E4M3: only S.1111.111 is NaN),
# "ieee" (E5M2: all-ones exponent is inf or NaN), "none" (FP6, FP4: every code is finite)
_FORMATS = {
    "float8_e4m3fn": (4, 3, "fn"),
    "float8_e5m2": (5, 2, "ieee"),
    "float6_e2m3fn": (2, 3, "none"),
    "float6_e3m2fn": (3, 2, "none"),
    "float4_e2m1fn": (2, 1, "none"),
}


def _by_hand(code: int, ebits: int, mbits: int, specials: str) -> float:
    """The value of ``code`` from its sign, exponent and mantissa fields (bias 2^(e-1) - 1),
    independent of ml_dtypes and of the code under test."""
    sign = -1.0 if code >> (ebits + mbits) & 1 else 1.0
    ef, mf = (code >> mbits) & ((1 << ebits) - 1), code & ((1 << mbits) - 1)
    top = (1 << ebits) - 1
    if specials == "ieee" and ef == top:
        return sign * float("inf") if mf == 0 else float("nan")
    if specials == "fn" and ef == top and mf == (1 << mbits) - 1:
        return float("nan")
    bias = (1 << (ebits - 1)) - 1
    if ef == 0:
        return sign * mf * 2.0 ** (1 - bias - mbits)
    return sign * (1 + mf / (1 << mbits)) * 2.0 ** (ef - bias)


def _all_codes(fmt: str) -> tuple[np.ndarray, np.ndarray, str]:
    """(every code of ``fmt`` as a (codes, 32) uint8 matrix with the code in column 0 and
    zeros elsewhere, the hand-decoded values, the device whose GEMM takes the format against
    float8_e4m3fn ones)."""
    ebits, mbits, specials = _FORMATS[fmt]
    n = 1 << (1 + ebits + mbits)
    a = np.zeros((n, 32), np.uint8)
    a[:, 0] = np.arange(n)
    want = np.array([_by_hand(c, ebits, mbits, specials) for c in range(n)], np.float32)
    return a, want, "h100" if fmt.startswith("float8") else "b200"


def _same(got, want) -> bool:
    got, want = np.asarray(got, np.float32).ravel(), np.asarray(want, np.float32).ravel()
    return bool(np.array_equal(np.isnan(got), np.isnan(want)) and
                np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)]))  # fmt: skip


@pytest.mark.parametrize("fmt", list(_FORMATS))
def test_every_code_of_every_format_decodes_as_its_value(fmt):
    """Why: gemm(..., a_format="float8_e4m3fn") on uint8 codes read NaN (0x7F) as 480 and
    E5M2 +inf (0x7C) as 65536. Every code of every format, as a (uint8 and uint16) or b, through
    gemm, jit(gemm), vmap(gemm) (the recipes' path), dot_general and mma (FP8), gives the
    code's value times 1: NaN, inf, zeros and subnormals included."""
    import jax
    import jax.numpy as jnp

    from precisionlab import hardware as hw

    a, want, device = _all_codes(fmt)
    ones = jnp.ones((32, 1), jnp.float8_e4m3fn)
    got = hw.gemm(a, ones, device=device, a_format=fmt)
    assert _same(got[:, 0], want), fmt
    assert _same(hw.gemm(a.astype(np.uint16), ones, device=device, a_format=fmt)[:, 0], want)
    got_b = hw.gemm(ones.T, a.T, device=device, b_format=fmt)  # the codes as b
    assert _same(got_b[0], want)
    jitted = jax.jit(lambda x: hw.gemm(x, ones, device=device, a_format=fmt))(a)
    assert _same(jitted[:, 0], want)
    mapped = jax.vmap(lambda x: hw.gemm(x[None], ones, device=device, a_format=fmt))(a)
    assert _same(mapped[:, 0, 0], want)
    dn = (((1,), (0,)), ((), ()))
    assert _same(hw.dot_general(a, ones, dn, device=device, a_format=fmt)[:, 0], want)
    if fmt.startswith("float8"):
        zero = jnp.zeros((a.shape[0], 1), jnp.float32)
        assert _same(hw.mma(a, ones, zero, a_format=fmt)[:, 0], want)
        # and the float8 arrays of the same codes agree with the codes, bit for bit
        typed = jnp.asarray(a).view(jnp.dtype(fmt))
        assert _same(hw.gemm(typed, ones)[:, 0], want)


@pytest.mark.parametrize("fmt", list(_FORMATS))
def test_out_of_range_codes_raise_or_poison(fmt):
    """Why: out-of-range codes were masked to the format's width (FP6 0x41 computed as 0x01;
    a uint16 code 0x1FF as 0xFF). Now a ValueError; under jit (no value yet) NaN outputs in
    the code's row only."""
    import jax
    import jax.numpy as jnp

    from precisionlab import hardware as hw

    width = 1 + sum(_FORMATS[fmt][:2])
    device = "h100" if fmt.startswith("float8") else "b200"
    ones = jnp.ones((32, 1), jnp.float8_e4m3fn)
    a = np.zeros((2, 32), np.uint16)
    a[0, 0] = 1 << width  # one past the last code (0x100 for FP8: needs uint16)
    a[1, 0] = 1
    dtype = np.uint8 if width < 8 else np.uint16
    calls = [
        lambda: hw.gemm(a.astype(dtype), ones, device=device, a_format=fmt),
        lambda: hw.gemm(ones.T, a.T.astype(dtype), device=device, b_format=fmt),
        lambda: hw.dot_general(a.astype(dtype), ones, (((1,), (0,)), ((), ())), device=device,
                               a_format=fmt),
    ]  # fmt: skip
    if fmt.startswith("float8"):
        calls.append(lambda: hw.mma(a, ones, jnp.zeros((2, 1), jnp.float32), a_format=fmt))
    for call in calls:
        with pytest.raises(ValueError, match=f"out of {fmt}'s range"):
            call()
    traced = jax.jit(lambda x: hw.gemm(x, ones, device=device, a_format=fmt))(a.astype(dtype))
    assert np.isnan(traced[0, 0]) and traced[1, 0] == _by_hand(1, *_FORMATS[fmt])
