"""Blackwell's block-scaled steps and the two-limb (wider than int32) kernel, against the
scalar references of precisionlab.hardware._reference (Python integers and fractions).

The b200 profiles follow MMA-Sim's published model; nothing here was run on a Blackwell GPU.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from precisionlab import hardware as hw
from precisionlab.hardware._reference import (
    block_step_reference,
    chain_reference,
    step_reference,
)

F4, E8M0, E4, E5 = (ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e8m0fnu,
                    ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)  # fmt: skip
FP4_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
STEP = hw.get_profile("b200", "fp4").step
K = 3 * STEP.products  # three chained instructions


def _bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def _fp4(rng, shape, zero_share):
    v = FP4_VALUES[rng.integers(1, 8, shape)] * rng.choice([-1, 1], shape)
    return np.where(rng.random(shape) < zero_share, 0, v).astype(F4)


def _scales(rng, fmt, shape, lo, hi):
    if fmt == "float8_e8m0fnu":
        return (2.0 ** rng.integers(lo, hi + 1, shape)).astype(E8M0)
    # UE4M3: every code but NaN, zeros and subnormals included, sign bit random (ignored)
    codes = rng.integers(0, 0x7F, shape).astype(np.uint8) | (rng.integers(0, 2, shape) << 7)
    return codes.astype(np.uint8).view(E4)


def _random_values(rng, dt, n):
    """Random codes of ``dt`` (subnormals and zeros included, no inf/NaN); bfloat16 exponents
    kept where products stay inside float32's range."""
    bits = 8 if np.dtype(dt).itemsize == 1 else 16
    codes = rng.integers(0, 2**bits, n).astype(np.uint8 if bits == 8 else np.uint16)
    if dt is ml_dtypes.bfloat16:
        exp = (codes >> 7) & 0xFF
        codes = (codes & ~np.uint16(0xFF << 7)) | ((exp % 64 + 96).astype(np.uint16) << 7)
    v = codes.view(dt)
    return np.where(np.isfinite(v.astype(np.float32)), v, dt(0)).astype(dt)


def _block_reference(a, b, sa, sb, fmt, block):
    """Chained block_step_reference over the rows of a (n, K) and b (n, K)."""
    out = []
    for i in range(a.shape[0]):
        c = 0.0
        for s in range(K // STEP.products):
            ks = range(s * STEP.products, (s + 1) * STEP.products)
            groups = [(s * STEP.products + j * STEP.exact_group) // block for j in range(4)]
            c = block_step_reference(
                [float(a[i, k]) for k in ks], [float(b[i, k]) for k in ks], c,
                [float(sa[i, g]) for g in groups], [float(sb[i, g]) for g in groups],
                STEP, fmt,
            )  # fmt: skip
        out.append(c)
    return np.array(out, np.float32)


def _block_gemm_rows(a, b, sa, sb):
    """One output per row: a (n, K) . b (n, K) with block scales (n, K / block)."""

    def f(x, y, p, q):
        return hw.gemm(x[None], y[:, None], "b200", block_scale_a=p[None],
                       block_scale_b=q[:, None])[0, 0]  # fmt: skip

    return np.asarray(jax.vmap(f)(a, b, sa, sb))


@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    fmt_block=st.sampled_from([("float8_e8m0fnu", 32), ("float8_e8m0fnu", 16),
                               ("float8_e4m3fn", 16)]),
    lo=st.integers(-127, 0), span=st.integers(0, 60), zero_share=st.sampled_from([0, 0.3, 0.9]),
    seed=st.integers(0, 2**31),
)  # fmt: skip
def test_fp4_block_step_matches_reference(fmt_block, lo, span, zero_share, seed):
    """MXFP4 (E8M0, blocks of 32 and 16) and NVFP4 (UE4M3, 16): three chained 64-product
    steps per output, 32 outputs, scale exponents over a random window (the 35-bit grid cuts
    groups more than 27 exponents below the largest; tiny scales reach float32's subnormals)."""
    fmt, block = fmt_block
    rng = np.random.default_rng(seed)
    hi = min(lo + span, 50)  # keep every sum inside float32's range
    a, b = _fp4(rng, (32, K), zero_share), _fp4(rng, (32, K), zero_share)
    sa = _scales(rng, fmt, (32, K // block), lo, hi)
    sb = _scales(rng, fmt, (32, K // block), lo, hi)
    got = _block_gemm_rows(a, b, sa, sb)
    ref = _block_reference(a.astype(np.float32), b.astype(np.float32),
                           sa.astype(np.float32), sb.astype(np.float32), fmt, block)  # fmt: skip
    assert np.array_equal(_bits(got), _bits(ref)), (got, ref)


def test_fp4_block_step_exhaustive_pairs():
    """Every pair of FP4 values (256, signs included) at the first product of the first group,
    the other products fixed, with the first group's scales 2**d below the second's for d in
    0, 27, 28, 29, 33, 40 (where the 35-bit grid starts to cut): one step each, bit for bit."""
    codes = np.arange(16, dtype=np.uint8)
    vals = np.concatenate([FP4_VALUES, -FP4_VALUES])[codes]
    x, y = np.meshgrid(vals, vals, indexing="ij")
    n = x.size
    rng = np.random.default_rng(5)
    rest_a, rest_b = _fp4(rng, (1, 64), 0.2)[0], _fp4(rng, (1, 64), 0.2)[0]
    a = np.tile(rest_a.astype(np.float32), (n, 1))
    b = np.tile(rest_b.astype(np.float32), (n, 1))
    a[:, 0], b[:, 0] = x.ravel(), y.ravel()
    for d in (0, 27, 28, 29, 33, 40):
        sa = np.tile(2.0 ** np.array([-d, 0, 0, -3], np.float32), (n, 1)).astype(E8M0)
        sb = np.ones((n, 4), np.float32).astype(E8M0)
        got = np.asarray(jax.vmap(lambda p, q, r, s: hw.gemm(
            p[None], q[:, None], "b200", block_scale_a=r[None], block_scale_b=s[:, None]
        )[0, 0])(a.astype(F4), b.astype(F4), sa, sb))  # fmt: skip
        scales = sa.astype(np.float32).tolist()
        ref = [block_step_reference(a[i].tolist(), b[i].tolist(), 0.0, scales[i], [1.0] * 4,
                                    STEP, "float8_e8m0fnu") for i in range(n)]  # fmt: skip
        assert np.array_equal(_bits(got), _bits(np.array(ref, np.float32))), d


@pytest.mark.slow
@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    fraction_bits=st.sampled_from([29, 35, 44]),
    fmts=st.sampled_from([(E4, E5), (E5, E5), (np.float16, np.float16),
                          (ml_dtypes.bfloat16, ml_dtypes.bfloat16)]),
    seed=st.integers(0, 2**31),
)  # fmt: skip
def test_wide_kernel_matches_reference(fraction_bits, fmts, seed):
    _check_wide(fraction_bits, fmts, seed)


def test_wide_kernel_fp8_35_bits():
    _check_wide(35, (E4, E5), 3)


def _check_wide(fraction_bits, fmts, seed):
    """Any step wider than the int32 kernel's 28 fraction bits runs in two limbs: random
    codes (subnormals, zeros) through three chained steps equal the scalar reference."""
    dt, bdt = fmts
    kind = "fp8" if np.dtype(dt).itemsize == 1 else "16bit"
    step = hw.get_profile("h100", kind).step
    w = step.products
    rng = np.random.default_rng(seed)
    a = np.stack([_random_values(rng, dt, 3 * w) for _ in range(16)])
    b = np.stack([_random_values(rng, bdt, 3 * w) for _ in range(16)])

    def f(x, y):
        return hw.gemm(x[None], y[:, None], "h100", split_k=None, restart_every=None,
                       fraction_bits=fraction_bits)[0, 0]  # fmt: skip

    got = np.asarray(jax.vmap(f)(a, b))
    wide = dataclasses.replace(step, fraction_bits=fraction_bits)
    na, nb = np.dtype(dt).name, np.dtype(bdt).name
    for i in range(16):
        c = 0.0
        for s in range(3):
            xs = [float(v) for v in a[i, s * w : (s + 1) * w].astype(np.float64)]
            ys = [float(v) for v in b[i, s * w : (s + 1) * w].astype(np.float64)]
            c = step_reference(xs, ys, c, wide, na, nb)
        assert _bits(got[i]) == _bits(np.float32(c)), (i, got[i], c)


def test_mxfp8_scales_add_to_exponents():
    """MXFP8 on Blackwell's f8f6f4 step (25 bits): E8M0 scales per 32 raise each product's
    alignment exponent; against the scalar reference with those exponents, one chain."""
    rng = np.random.default_rng(11)
    n, kk = 16, 96
    a = rng.standard_normal((n, kk)).astype(E4)
    b = rng.standard_normal((n, kk)).astype(E4)
    ta = rng.integers(-40, 40, (n, kk // 32))
    tb = rng.integers(-40, 40, (n, kk // 32))
    sa, sb = (2.0**ta).astype(E8M0), (2.0**tb).astype(E8M0)

    def f(x, y, p, q):
        return hw.gemm(x[None], y[:, None], "b200", restart_every=None, block_scale_a=p[None],
                       block_scale_b=q[:, None])[0, 0]  # fmt: skip

    got = np.asarray(jax.vmap(f)(a, b, sa, sb))
    step = hw.get_profile("b200", "fp8").step
    for i in range(n):
        c = 0.0
        for s in range(kk // 32):
            ks = range(s * 32, (s + 1) * 32)
            c = step_reference([float(a[i, k]) for k in ks], [float(b[i, k]) for k in ks], c,
                               step, "float8_e4m3fn", "float8_e4m3fn",
                               scale_exps=[int(ta[i, s] + tb[i, s])] * 32)  # fmt: skip
        assert _bits(got[i]) == _bits(np.float32(c)), (i, got[i], c)


def test_block_scaled_specials_and_profile():
    """NaN scales give NaN in their rows/columns; the profile says it is MMA-Sim's model,
    not checked on hardware."""
    rng = np.random.default_rng(2)
    a, b = _fp4(rng, (4, 64), 0.1), _fp4(rng, (64, 3), 0.1)
    sa = np.ones((4, 2), np.float32).astype(E8M0)
    sb = np.ones((2, 3), np.float32).astype(E8M0)
    sa[1, 1] = np.float32(np.nan).astype(E8M0)
    y = np.asarray(hw.gemm(a, b, "b200", block_scale_a=sa, block_scale_b=sb))
    assert np.isnan(y[1]).all() and np.isfinite(np.delete(y, 1, axis=0)).all()
    # unit scales: the exact product (FP4 sums of 64 are exact at 35 bits)
    ok = np.ones((4, 2), np.float32).astype(E8M0)
    y = np.asarray(hw.gemm(a, b, "b200", block_scale_a=ok, block_scale_b=sb))
    assert np.array_equal(y, a.astype(np.float32) @ b.astype(np.float32))
    p = hw.PROFILES["b200/fp4"]
    assert p.hardware_checked is False and "MMA-Sim" in p.source and p.step.fraction_bits == 35


def test_block_scaled_errors():
    a, b = jnp.zeros((2, 64), F4), jnp.zeros((64, 2), F4)
    s32a = jnp.ones((2, 2), E8M0)
    s32b = jnp.ones((2, 2), E8M0)
    with pytest.raises(ValueError, match="need block_scale_a and block_scale_b"):
        hw.gemm(a, b, "b200")
    with pytest.raises(ValueError, match="h100 has no fp4"):
        hw.gemm(a, b, "h100", block_scale_a=s32a, block_scale_b=s32b)
    with pytest.raises(ValueError, match="block size 32 is not supported"):
        hw.gemm(a, b, "b200", block_scale_a=s32a.astype(E4), block_scale_b=s32b.astype(E4))
    with pytest.raises(ValueError, match="K a multiple of the instruction's 64"):
        hw.gemm(a[:, :32], b[:32], "b200", block_scale_a=s32a[:, :1],
                block_scale_b=s32b[:1])  # fmt: skip
    with pytest.raises(ValueError, match="must be \\(2, 2\\) and \\(2, 2\\)"):
        hw.gemm(a, b, "b200", block_scale_a=s32a, block_scale_b=jnp.ones((2, 3), E8M0))
    with pytest.raises(ValueError, match="not 16-bit"):
        hw.gemm(jnp.zeros((2, 64), jnp.float16), jnp.zeros((64, 2), jnp.float16), "b200",
                block_scale_a=s32a, block_scale_b=s32b)  # fmt: skip
    with pytest.raises(ValueError, match="one chain"):
        hw.gemm(a, b, "b200", block_scale_a=s32a, block_scale_b=s32b, restart_every=64)


# --- FP6 and mixed operands on Blackwell's kind::f8f6f4 (an extrapolation of MMA-Sim) -----

F8F6F4 = hw.get_profile("b200", "f8f6f4").step
_WIDTH = {"float6_e2m3fn": 6, "float6_e3m2fn": 6, "float4_e2m1fn": 4,
          "float8_e4m3fn": 8, "float8_e5m2": 8}  # fmt: skip


def _codes_and_values(rng, fmt, shape):
    """Random codes of ``fmt`` (uint8; every value incl. subnormals and zeros, no inf/NaN)
    and their float64 values decoded by ml_dtypes (the oracle's view of them)."""
    codes = rng.integers(0, 2 ** _WIDTH[fmt], shape).astype(np.uint8)
    if fmt == "float4_e2m1fn":  # ml_dtypes' FP4 is not a uint8 view: decode by its table
        vals = np.concatenate([FP4_VALUES, -FP4_VALUES])[codes].astype(np.float64)
    else:
        vals = codes.view(getattr(ml_dtypes, fmt)).astype(np.float64)
    bad = ~np.isfinite(vals)
    codes[bad], vals[bad] = 0, 0
    return codes, vals


def _chain_reference(va, vb, fa, fb, step, scale_exps=None, block=32):
    """chain_reference for every (row of va, column of vb); ``scale_exps``: the E8M0
    exponents (M, K / block) and (K / block, N), added per product."""
    out = np.zeros((va.shape[0], vb.shape[1]), np.float32)
    for i, j in np.ndindex(out.shape):
        t = None if scale_exps is None else [
            int(scale_exps[0][i, k // block] + scale_exps[1][k // block, j])
            for k in range(va.shape[1])]  # fmt: skip
        out[i, j] = chain_reference(va[i].tolist(), vb[:, j].tolist(), 0.0, step, fa, fb, t)
    return out


@pytest.mark.parametrize("fa, fb", [
    ("float6_e2m3fn", "float6_e2m3fn"), ("float4_e2m1fn", "float8_e5m2"),
    pytest.param("float6_e3m2fn", "float8_e4m3fn", marks=pytest.mark.slow),
    pytest.param("float6_e2m3fn", "float4_e2m1fn", marks=pytest.mark.slow),
    pytest.param("float6_e3m2fn", "float6_e3m2fn", marks=pytest.mark.slow),
    pytest.param("float8_e5m2", "float6_e2m3fn", marks=pytest.mark.slow),
])  # fmt: skip
def test_f8f6f4_step_matches_reference(fa, fb):
    """FP6 (uint8 codes with a_format/b_format) and FP4 mixed with FP8/FP6 on the b200
    f8f6f4 step: random codes of every value through three chained 32-product steps equal
    the scalar reference (values from ml_dtypes), with and without E8M0 scales per 32."""
    rng = np.random.default_rng(sum(map(ord, fa + fb)))
    kk = 3 * F8F6F4.products
    ca, va = _codes_and_values(rng, fa, (6, kk))
    cb, vb = _codes_and_values(rng, fb, (kk, 5))
    got = hw.gemm(ca, cb, "b200", restart_every=None, a_format=fa, b_format=fb)
    assert np.array_equal(_bits(got), _bits(_chain_reference(va, vb, fa, fb, F8F6F4)))
    ta, tb = rng.integers(-30, 30, (6, kk // 32)), rng.integers(-30, 30, (kk // 32, 5))
    sa, sb = (2.0**ta).astype(E8M0), (2.0**tb).astype(E8M0)
    got = hw.gemm(ca, cb, "b200", restart_every=None, a_format=fa, b_format=fb,
                  block_scale_a=sa, block_scale_b=sb)  # fmt: skip
    ref = _chain_reference(va, vb, fa, fb, F8F6F4, scale_exps=(ta, tb))
    assert np.array_equal(_bits(got), _bits(ref))


@pytest.mark.slow
def test_fp6_every_pair_of_values():
    """Every E2M3 x E3M2 value pair (4,096, signs included) as the first product of one
    step whose other 31 products are fixed random FP6 values: bit for bit the reference."""
    rng = np.random.default_rng(8)
    x, y = np.meshgrid(np.arange(64, dtype=np.uint8), np.arange(64, dtype=np.uint8),
                       indexing="ij")  # fmt: skip
    n = x.size
    ra, _ = _codes_and_values(rng, "float6_e2m3fn", (32,))
    rb, _ = _codes_and_values(rng, "float6_e3m2fn", (32,))
    a, b = np.tile(ra, (n, 1)), np.tile(rb, (n, 1))
    a[:, 0], b[:, 0] = x.ravel(), y.ravel()
    f = lambda p, q: hw.gemm(p[None], q[:, None], "b200", a_format="float6_e2m3fn",  # noqa: E731
                             b_format="float6_e3m2fn")[0, 0]  # fmt: skip
    got = np.asarray(jax.vmap(f)(a, b))
    va = a.view(ml_dtypes.float6_e2m3fn).astype(np.float64)
    vb = b.view(ml_dtypes.float6_e3m2fn).astype(np.float64)
    ref = [step_reference(va[i].tolist(), vb[i].tolist(), 0.0, F8F6F4, "float6_e2m3fn",
                          "float6_e3m2fn") for i in range(n)]  # fmt: skip
    assert np.array_equal(_bits(got), _bits(np.array(ref, np.float32)))


def test_fp6_numpy_arrays_are_their_codes():
    """numpy arrays of ml_dtypes' FP6 dtypes (JAX has none) go in as they are: the same
    result as their uint8 codes with a_format/b_format."""
    rng = np.random.default_rng(4)
    a = rng.standard_normal((4, 64)).astype(ml_dtypes.float6_e2m3fn)
    b = rng.standard_normal((64, 3)).astype(ml_dtypes.float6_e3m2fn)
    y = hw.gemm(a, b, "b200")
    yc = hw.gemm(a.view(np.uint8), b.view(np.uint8), "b200", a_format="float6_e2m3fn",
                 b_format="float6_e3m2fn")  # fmt: skip
    assert np.array_equal(_bits(y), _bits(yc))
    assert np.array_equal(np.asarray(y), a.astype(np.float32) @ b.astype(np.float32))


def test_fp6_subnormal_alignment_is_the_open_question():
    """The one choice the FP6 profile makes without a source: a subnormal FP6 element aligns
    with its own format's minimum exponent (MMA-Sim's rule for every format it models), not
    with its exponent once normalised (as it would be in an FP8 container). This vector tells
    the two apart (hand-computed): an accumulator 2**-7 + 2**-29 (blocks 0 and 1, scaled)
    meets the product 0.125 * 0.125 = 2**-6 of two E2M3 subnormals. Aligned at E2M3's
    emin (0 + 0), the grid is 2**-25 and the accumulator's 2**-29 is cut; normalised (-3 - 3),
    the grid is 2**-31 and it stays. A Blackwell run of this GEMM would settle the question."""
    e2m3 = ml_dtypes.float6_e2m3fn
    a = np.zeros((1, 96), np.float32)
    b = np.zeros((96, 1), np.float32)
    a[0, 0], a[0, 32], a[0, 64] = 1, 1, 0.125  # blocks scaled by 2**-7, 2**-29 and 1
    b[0, 0], b[32, 0], b[64, 0] = 1, 1, 0.125
    sa = (2.0 ** np.array([[-7, -29, 0]])).astype(E8M0)
    sb = np.ones((3, 1), np.float32).astype(E8M0)
    kw = dict(restart_every=None, block_scale_a=sa, block_scale_b=sb)
    fp6 = float(hw.gemm(a.astype(e2m3), b.astype(e2m3), "b200", **kw)[0, 0])
    assert fp6 == 2.0**-6 + 2.0**-7  # the model: E2M3's emin, the 2**-29 cut
    # the same values in an E4M3 container (FP8 step, same arithmetic): normalised exponents
    fp8 = float(hw.gemm(a.astype(E4), b.astype(E4), "b200", **kw)[0, 0])
    assert fp8 == 2.0**-6 + 2.0**-7 + 2.0**-29
    assert "extrapolated" in hw.PROFILES["b200/f8f6f4"].note
    assert hw.PROFILES["b200/f8f6f4"].hardware_checked is False


def test_chain_reference_needs_whole_steps():
    with pytest.raises(ValueError, match="len\\(a\\) == len\\(b\\), a multiple of 32"):
        chain_reference([1.0] * 31, [1.0] * 31, 0.0, F8F6F4, "float6_e2m3fn", "float6_e2m3fn")


def test_f8f6f4_errors():
    c6 = jnp.zeros((2, 32), jnp.uint8)
    with pytest.raises(ValueError, match=r"h100 has no f8f6f4 tensor-core GEMM.*b200"):
        hw.gemm(c6, c6.T, "h100", a_format="float6_e2m3fn", b_format="float6_e2m3fn")
    with pytest.raises(ValueError, match=r"a holds integers .*pass a_format"):
        hw.gemm(c6, c6.T, "b200")
    with pytest.raises(ValueError, match="unknown b_format 'float6'; allowed: float8_e4m3fn"):
        hw.gemm(c6, c6.T, "b200", a_format="float6_e2m3fn", b_format="float6")
    with pytest.raises(ValueError, match="takes a as unsigned integer codes"):
        hw.gemm(jnp.zeros((2, 32), E4), c6.T, "b200", a_format="float6_e2m3fn",
                b_format="float6_e2m3fn")  # fmt: skip
    with pytest.raises(ValueError, match="upcast='float16' is not modelled"):
        hw.gemm(c6, c6.T, "b200", a_format="float6_e2m3fn", b_format="float6_e2m3fn",
                upcast="float16")  # fmt: skip
    fp6 = np.zeros((2, 32), ml_dtypes.float6_e2m3fn)
    with pytest.raises(ValueError, match="a_format='float6_e3m2fn' but a holds float6_e2m3fn"):
        hw.gemm(fp6, fp6.T, "b200", a_format="float6_e3m2fn")
    s16 = jnp.ones((2, 2), E8M0)
    with pytest.raises(ValueError, match=r"block size 16 is not supported.*MXFP6 \(E8M0, 32\)"):
        hw.gemm(c6, c6.T, "b200", a_format="float6_e2m3fn", b_format="float6_e2m3fn",
                block_scale_a=s16, block_scale_b=s16)  # fmt: skip
    with pytest.raises(ValueError, match="unsupported operand formats float6_e2m3fn x float16"):
        hw.gemm(c6, jnp.zeros((32, 2), jnp.float16), "b200", a_format="float6_e2m3fn")
