"""The blockwise recipe on ``accumulate="h100-deepgemm"``: DeepGEMM's Hopper schedule.

Oracles: ``fractions.Fraction`` for the float32 FFMA of the scale promotion, and the hardware
package's scalar step reference (Python integers) for each 128-k block's chain.
"""

from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from precisionlab import hardware as hw
from precisionlab.hardware import fma_pow2
from precisionlab.hardware._reference import step_reference
from precisionlab.recipes import get_recipe, matmul
from precisionlab.recipes._deepgemm import blockwise_gemm

STEP = hw.get_profile("h100", "fp8").step


def _rn32(v: Fraction) -> float:
    """``v`` rounded to nearest even float32 (subnormals kept, inf beyond the range)."""
    if v == 0:
        return 0.0
    sign, v = (-1 if v < 0 else 1), abs(v)
    e = v.numerator.bit_length() - v.denominator.bit_length()
    while Fraction(2) ** (e + 1) <= v:
        e += 1
    while Fraction(2) ** e > v:
        e -= 1
    q = Fraction(2) ** max(e - 23, -149)
    n = v / q
    fl = math.floor(n)
    if n - fl > Fraction(1, 2) or (n - fl == Fraction(1, 2) and fl % 2):
        fl += 1
    out = fl * q
    return sign * (math.inf if out >= Fraction(2) ** 128 else float(out))


def _fma_ref(s: float, p: float, c: float) -> float:
    """IEEE fma in float32 of float32 values (one rounding), signed zeros as IEEE says."""
    if not (math.isfinite(s) and math.isfinite(p) and math.isfinite(c)):
        with np.errstate(invalid="ignore"):
            return float(np.float32(c) + np.float32(s) * np.float32(p))
    exact = Fraction(s) * Fraction(p) + Fraction(c)
    if exact == 0:
        prod_neg = math.copysign(1, s) * math.copysign(1, p) < 0
        both_neg = (s == 0 or p == 0) and c == 0 and prod_neg and math.copysign(1, c) < 0
        return -0.0 if both_neg else 0.0
    return _rn32(exact)


def _s(k: int) -> float:
    """fl32(2**k): 0 below half the smallest subnormal (ties to even), inf from 2**128."""
    return 0.0 if k <= -150 else math.inf if k >= 128 else math.ldexp(1.0, k)


def _bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def test_fma_pow2_matches_fraction():
    rng = np.random.default_rng(1)
    n = 2000
    raw = rng.integers(0, 2**32, (2, n), dtype=np.uint64).astype(np.uint32).view(np.float32)
    nice = (rng.standard_normal((2, n)) * 2.0 ** rng.integers(-40, 40, (2, n))).astype(np.float32)
    tiny = rng.integers(-9, 9, (2, n)) * 2.0 ** rng.integers(-149, -125, (2, n))
    tiny = tiny.astype(np.float32)
    pick = rng.integers(0, 3, (2, n))
    p, c = np.where(pick == 0, raw, np.where(pick == 1, nice, tiny))
    p, c = (np.where(np.isfinite(v), v, np.float32(1.5)) for v in (p, c))
    k = rng.integers(-165, 140, n).astype(np.int32)
    near = rng.random(n) < 0.4  # near-cancellation: c = -(p * 2**k) rounded, nudged
    k = np.where(near, rng.integers(-12, 12, n), k).astype(np.int32)
    with np.errstate(over="ignore"):
        cc = (-(p.astype(np.float64) * np.exp2(k.astype(np.float64)))).astype(np.float32)
    cc = np.where(rng.random(n) < 0.5, np.nextafter(cc, np.float32(np.inf)), cc)
    c = np.where(near & np.isfinite(cc), cc, c)
    p[:40], c[40:80], p[80:90], c[80:90] = 0.0, -0.0, -0.0, -0.0  # zeros and their signs
    p[90:95], c[95:100] = np.inf, -np.inf
    k[100:110], k[110:120] = -150, 128  # fl32(2**k) = 0 and inf
    got = np.asarray(jax.jit(fma_pow2)(p, k, c))
    want = np.array([_fma_ref(_s(int(kk)), float(pp), float(cc_)) for pp, kk, cc_ in
                     zip(p, k, c, strict=True)], np.float32)  # fmt: skip
    same = (_bits(got) == _bits(want)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), [(p[i], k[i], c[i], got[i], want[i]) for i in np.flatnonzero(~same)[:5]]
    # a NaN scale (the recipe's mark of a block holding inf or NaN) poisons the sum
    nan = np.asarray(fma_pow2(p[:4], k[:4], c[:4], jnp.array([True, False, True, False])))
    assert np.isnan(nan[[0, 2]]).all() and (_bits(nan[[1, 3]]) == _bits(got[[1, 3]])).all()


def _oracle(qa, qb) -> np.ndarray:
    """DeepGEMM's promotion, scalar: per 128-k block the Hopper FP8 chain (4 steps of 32 from
    the scalar reference), then ``acc = fma(fl32(sa * sb), p, acc)`` with Fractions."""
    ea = np.asarray(jnp.broadcast_to(qa.block_exp, qa.elems.shape))
    eb = np.asarray(jnp.broadcast_to(qb.block_exp, qb.elems.shape))
    a, b = np.asarray(qa.elems), np.asarray(qb.elems)
    bsz, m, k = a.shape
    n = b.shape[1]
    out = np.zeros((bsz, m, n), np.float32)
    for z in range(bsz):
        for i in range(m):
            for j in range(n):
                acc = 0.0
                for blk in range(0, k, 128):
                    p = 0.0
                    for st in range(blk, blk + 128, 32):
                        p = step_reference([float(v) for v in a[z, i, st:st + 32]],
                                           [float(v) for v in b[z, j, st:st + 32]], p, STEP,
                                           "float8_e4m3fn", "float8_e4m3fn")  # fmt: skip
                    s = _rn32(Fraction(2) ** int(ea[z, i, blk] + eb[z, j, blk]))
                    acc = _fma_ref(s, p, acc)
                out[z, i, j] = acc
    return out


def _operand(rng, shape, spread):
    """Random float32 with each 128-block along K at its own magnitude (2**-spread..)."""
    x = rng.standard_normal(shape).astype(np.float32)
    mags = 2.0 ** rng.integers(-spread, spread, (*shape[:-1], shape[-1] // 128))
    return (x * np.repeat(mags, 128, axis=-1)).astype(np.float32)


def test_blockwise_gemm_matches_scalar_oracle():
    """1 x 128 scales on both sides (wgrad's 1d1d kernel); the 128 x 128 weight tiles of
    fprop and dgrad are in the slow test below."""
    r = get_recipe("blockwise", accumulate="h100-deepgemm")
    rng = np.random.default_rng(2)
    a = jnp.asarray(_operand(rng, (1, 3, 384), 20))
    b = jnp.asarray(_operand(rng, (1, 4, 384), 20))
    # jitted: the quantizer's many small ops take seconds op by op
    qa, qb = jax.jit(lambda a, b: (r.quantize(a, "g"), r.quantize(b, "x")))(a, b)
    got = np.asarray(jax.jit(blockwise_gemm, static_argnums=2)(qa, qb, "h100-deepgemm"))
    want = _oracle(qa, qb)
    assert (_bits(got) == _bits(want)).all(), (got, want)
    # the model is not float32 arithmetic on the dequantized values
    plain = np.einsum("bmk,bnk->bmn", np.asarray(qa.block_values(), np.float64),
                      np.asarray(qb.block_values(), np.float64)).astype(np.float32)  # fmt: skip
    assert (_bits(got) != _bits(plain)).any()


def test_deepgemm_library_is_cublaslt_promotion_without_scales():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((4, 256)).astype(ml_dtypes.float8_e4m3fn)
    b = rng.standard_normal((256, 5)).astype(ml_dtypes.float8_e4m3fn)
    dg = hw.gemm(a, b, device="h100", library="deepgemm")
    cl = hw.gemm(a, b, device="h100", library="cublaslt", fast_accumulation=False)
    assert (_bits(dg) == _bits(cl)).all()
    assert hw.preset("h100-deepgemm") == {"device": "h100", "library": "deepgemm",
                                          "fast_accumulation": False}  # fmt: skip
    with pytest.raises(ValueError, match=r"'deepgemm' is modelled for FP8 operands on h100.*"
                       "h100-cublaslt"):  # fmt: skip
        hw.gemm(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), library="deepgemm")
    with pytest.raises(ValueError, match=r"'deepgemm' is modelled for FP8.*got fp8 on a100"):
        hw.gemm(a, b, device="a100", library="deepgemm")


def test_presets_that_do_not_apply_say_what_works():
    get_recipe("blockwise", accumulate="h100-deepgemm")
    for acc in ("h100-cublaslt", "h100-fast", "h100-xla", "b200", "a100"):
        with pytest.raises(ValueError, match=r"blockwise.*DeepGEMM.*preset h100-deepgemm"):
            get_recipe("blockwise", accumulate=acc)
    with pytest.raises(ValueError, match=r"DeepGEMM scales blocks of 128.*block=64"):
        get_recipe("blockwise", accumulate="h100-deepgemm", block=64)
    for name in ("current", "rowwise", "delayed", "mxfp8", "nvfp4", "bf16"):
        with pytest.raises(ValueError, match=r"only the blockwise recipe.*not the .*'b200'"):
            get_recipe(name, accumulate="h100-deepgemm")


@pytest.mark.slow
def test_blockwise_recipe_gemms_and_gradients_match_oracle():
    """fprop, dgrad and wgrad of the recipe under jax.vjp, each against the scalar oracle on
    the operands the recipe quantizes (padded to 128 as ``pad=True`` does)."""
    r = get_recipe("blockwise", accumulate="h100-deepgemm", pad=True)
    rng = np.random.default_rng(4)
    x = _operand(rng, (4, 256), 6)
    w = rng.standard_normal((256, 3)).astype(np.float32)
    g = rng.standard_normal((4, 3)).astype(np.float32)
    y, vjp = jax.vjp(lambda x, w: matmul(x, w, recipe=r), x, w)
    dx, dw = vjp(jnp.asarray(g))

    def pad(t, rows=False):
        t = np.pad(t, [(0, 0)] * (t.ndim - 1) + [(0, -t.shape[-1] % 128)])
        return np.pad(t, [(0, 0), (0, -t.shape[1] % 128), (0, 0)]) if rows else t

    def q(t, kind):
        t = jnp.asarray(pad(t[None], rows=kind == "w"))
        return jax.jit(r.quantize, static_argnums=1)(t, kind)

    fprop = _oracle(q(x, "x"), q(w.T, "w"))[0, :4, :3]
    dgrad = _oracle(q(g, "g"), q(w, "w"))[0, :4, :256]
    wgrad = _oracle(q(g.T, "g"), q(x.T, "x"))[0, :3, :256].T
    for got, want in ((y, fprop), (dx, dgrad), (dw, wgrad)):
        assert (_bits(got) == _bits(want)).all()
    assert np.isfinite(np.asarray(dx)).all() and np.isfinite(np.asarray(dw)).all()
