"""Blackwell's block-scaled steps and the two-limb (wider than int32) kernel, against the
scalar references of precisionlab.hardware.reference (Python integers and fractions).

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
from precisionlab.hardware.reference import block_step_reference, step_reference

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
    f = lambda x, y, p, q: hw.gemm(x[None], y[:, None], "b200",  # noqa: E731
                                   block_scale_a=p[None], block_scale_b=q[:, None])[0, 0]
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
    f = lambda x, y: hw.gemm(x[None], y[:, None], "h100", split_k=None,  # noqa: E731
                             restart_every=None, fraction_bits=fraction_bits)[0, 0]
    got = np.asarray(jax.vmap(f)(a, b))
    wide = dataclasses.replace(step, fraction_bits=fraction_bits)
    na, nb = np.dtype(dt).name, np.dtype(bdt).name
    for i in range(16):
        c = 0.0
        for s in range(3):
            xs = [float(v) for v in a[i, s * w:(s + 1) * w].astype(np.float64)]
            ys = [float(v) for v in b[i, s * w:(s + 1) * w].astype(np.float64)]
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
    f = lambda x, y, p, q: hw.gemm(x[None], y[:, None], "b200", restart_every=None,  # noqa: E731
                                   block_scale_a=p[None], block_scale_b=q[:, None])[0, 0]
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
