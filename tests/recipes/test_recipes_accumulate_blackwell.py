"""The block-scaled recipes (mxfp8, mxfp4, nvfp4) with accumulate= a Blackwell preset: each
quantized GEMM is Blackwell's block-scaled MMA on the recipe's own elements and scales.

Oracles: ``hw.gemm`` called on operands and scales built here from the recipe's quantizer
(ml_dtypes casts), and the scalar references of ``precisionlab.hardware._reference`` (Python
fractions). The b200 profiles are MMA-Sim's published model, not checked on hardware.
"""

from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from precisionlab import hardware as hw
from precisionlab.hardware._reference import block_step_reference, chain_reference
from precisionlab.recipes import get_recipe, matmul
from precisionlab.recipes._scaling import apply_hadamard

F4, E8M0, E4 = ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e8m0fnu, ml_dtypes.float8_e4m3fn
FP4_STEP = hw.get_profile("b200", "fp4").step
FP8_STEP = hw.get_profile("b200", "fp8").step
TINY = np.float32(2.0**-30)


def _bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def _hw_operand(recipe, q):
    """(R, K) elements and (R, K / block) scales, as ml_dtypes arrays, from a quantized
    (1, R, K) operand: E8M0 ``2**e`` (MX) or the E4M3 block scale (NVFP4)."""
    elems = np.asarray(q.elems[0], np.float32)
    blk = recipe.block
    if recipe.name == "nvfp4":
        s = np.broadcast_to(np.asarray(q.block_inv), q.elems.shape)[0][:, ::blk]
        return elems.astype(F4), s.astype(E4)
    e = np.broadcast_to(np.asarray(q.block_exp), q.elems.shape)[0][:, ::blk]
    return elems.astype(np.dtype(recipe.element)), (2.0 ** e.astype(np.float64)).astype(E8M0)


def _factor(qa, qb):
    """The per-tensor factor applied after the MMA (NVFP4's 1/s_enc of each operand)."""
    if qa.row_inv is None:
        return None
    return np.float32(np.asarray(qa.row_inv).ravel()[0] * np.asarray(qb.row_inv).ravel()[0])


@partial(jax.jit, static_argnums=(0, 1))
def _quantize(recipe, kind, t, key):  # jitted: eager dispatch of the quantizer takes seconds
    return recipe.quantize(t, kind, key=key)


def _expected(recipe, lhs, rhs, kinds, keys=(None, None)):
    """The recipe's GEMM lhs (M, K) . rhs (N, K)^T through hw.gemm on its own quantization."""
    qa = _quantize(recipe, kinds[0], jnp.asarray(lhs)[None], keys[0])
    qb = _quantize(recipe, kinds[1], jnp.asarray(rhs)[None], keys[1])
    (a, sa), (b, sb) = _hw_operand(recipe, qa), _hw_operand(recipe, qb)
    pa, psa, pb, psb = a, sa, b, sb
    if a.dtype == F4 and a.shape[1] % FP4_STEP.products:  # zeros to the instruction's 64
        pad = -a.shape[1] % FP4_STEP.products
        pa, pb = (np.pad(t, ((0, 0), (0, pad))) for t in (a, b))
        psa, psb = (np.pad(t.view(np.uint8), ((0, 0), (0, pad // recipe.block))).view(t.dtype)
                    for t in (sa, sb))  # fmt: skip
    acc = np.asarray(hw.gemm(pa, pb.T, "b200", block_scale_a=psa, block_scale_b=psb.T))
    f = _factor(qa, qb)
    return (acc if f is None else acc * f), (a, sa, b, sb, f)


def _oracle(recipe, a, sa, b, sb, f):
    """Scalar Fraction reference: one chain of b200 steps per output, then the factor."""
    a32, b32 = a.astype(np.float64), b.astype(np.float64)
    fa, fb = sa.astype(np.float64), sb.astype(np.float64)
    if a.dtype == F4 and a.shape[1] % FP4_STEP.products:
        # K padded to the instruction's 64: zero elements, zero scale bytes (E8M0: 2**-127)
        pad = -a.shape[1] % FP4_STEP.products
        zero = np.zeros((), np.uint8).view(sa.dtype).astype(np.float64)
        a32, b32 = (np.pad(t, ((0, 0), (0, pad))) for t in (a32, b32))
        fa, fb = (np.pad(t, ((0, 0), (0, pad // recipe.block)), constant_values=zero)
                  for t in (fa, fb))  # fmt: skip
    m, kk = a32.shape
    out = np.zeros((m, b.shape[0]), np.float32)
    blk = recipe.block
    for i in range(m):
        for j in range(b.shape[0]):
            c = 0.0
            if a.dtype == F4:
                w, g = FP4_STEP.products, FP4_STEP.exact_group
                for s in range(kk // w):
                    grp = [(s * w + t * g) // blk for t in range(w // g)]
                    c = block_step_reference(
                        a32[i, s * w:(s + 1) * w].tolist(), b32[j, s * w:(s + 1) * w].tolist(),
                        c, [fa[i, q] for q in grp], [fb[j, q] for q in grp], FP4_STEP,
                        np.dtype(sa.dtype).name,
                    )  # fmt: skip
            else:  # MXFP8, MXFP6 (K <= 128: cuBLASLt's restart every 128 leaves one chain)
                t = [int(np.log2(fa[i, k // blk]) + np.log2(fb[j, k // blk])) for k in range(kk)]
                c = chain_reference(a32[i].tolist(), b32[j].tolist(), c, FP8_STEP,
                                    a.dtype.name, b.dtype.name, t)  # fmt: skip
            out[i, j] = c
    return out if f is None else out * f


def _inputs(seed, m, k, n):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    # row 0 . column 0: 1 - 2**-30 exactly (blocks 0 and 1 of the row): the MMA's 35-bit sum
    # holds it and cuts it to float32 toward zero, 1 - 2**-24; float32 sums round it to 1
    x[0] = 0
    x[0, 0], x[0, 32] = 1, -TINY
    w[:, 0] = 0
    w[0, 0] = w[32, 0] = 1
    return x, w


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_forward_is_the_block_scaled_mma(name):
    """y = matmul(x, w) with accumulate="b200" equals hw.gemm on the recipe's own elements
    and block scales (times NVFP4's per-tensor factor) bit for bit, and the scalar Fraction
    reference; where the exact sum needs more than float32 it differs from the float path.
    K = 96 is padded to two 64-product instructions."""
    x, w = _inputs(1, 4, 96, 16)
    r = get_recipe(name, accumulate="b200")
    y = np.asarray(matmul(x, w, recipe=r))
    exp, ops = _expected(r, x, w.T, ("x", "w"))
    assert np.array_equal(_bits(y), _bits(exp))
    assert np.array_equal(_bits(y), _bits(_oracle(r, *ops)))
    if name == "mxfp4":  # NVFP4's per-tensor scale moves the pair off powers of two
        assert y[0, 0] == np.float32(1 - 2.0**-24)
        assert np.float32(1 - 2.0**-30) == 1  # float32 sums (accumulate=None) round to 1


@pytest.mark.slow
def test_forward_mxfp8_is_the_block_scaled_mma():
    x, w = _inputs(2, 4, 128, 8)
    r = get_recipe("mxfp8", accumulate="b200-cublaslt")
    y = np.asarray(matmul(x, w, recipe=r))
    exp, ops = _expected(r, x, w.T, ("x", "w"))
    assert np.array_equal(_bits(y), _bits(exp))
    assert np.array_equal(_bits(y), _bits(_oracle(r, *ops)))
    # the f8f6f4 step keeps 25 fraction bits: -2**-30 beside the accumulator's 1 is cut to 0
    assert y[0, 0] == 1


@pytest.mark.slow
@pytest.mark.parametrize("element", ["float6_e2m3fn", "float6_e3m2fn"])
def test_forward_mxfp6_is_the_f8f6f4_mma(element):
    """mxfp6 with accumulate="b200": the forward GEMM equals hw.gemm on the recipe's FP6
    elements (numpy ml_dtypes arrays, given to hw.gemm as they are) and E8M0 scales, and the
    scalar reference. Row 0 . column 0 is 1 + 3 * 2**-24 exactly (block 1 holds three
    2**-24 products): the f8f6f4 step's 25 fraction bits keep it and cut it toward zero to
    1 + 2**-23, where float32 arithmetic cannot (nearest: 1 or 1 + 2**-22)."""
    x, w = _inputs(6, 4, 64, 8)
    x[0] = 0
    x[0, 0] = 1
    x[0, 32:35] = 2.0**-24
    w[:35, 0] = 1
    w[1:32, 0] = 0
    r = get_recipe("mxfp6", accumulate="b200", element=element)
    y = np.asarray(matmul(x, w, recipe=r))
    exp, ops = _expected(r, x, w.T, ("x", "w"))
    assert ops[0].dtype == np.dtype(element)
    assert np.array_equal(_bits(y), _bits(exp))
    assert np.array_equal(_bits(y), _bits(_oracle(r, *ops)))
    assert y[0, 0] == np.float32(1 + 2.0**-23)


def _grad_inputs(seed):
    """x (64, 64), w (64, 64) and a cotangent c whose row 0 and column 0 put 1 - 2**-30 into
    dgrad's da[0, :] and wgrad's dw[:, 0] (as in _inputs)."""
    rng = np.random.default_rng(seed)
    x, w, c = (rng.standard_normal((64, 64)).astype(np.float32) for _ in range(3))
    c[0], c[:, 0] = 0, 0
    c[0, 0], c[0, 32], c[32, 0] = 1, -TINY, -TINY
    w[:, 0] = w[:, 32] = 1
    x[0] = x[32] = 1
    return x, w, c


def _check_grads(r, key=None):
    x, w, c = _grad_inputs(3)

    def loss(x, w):
        return jnp.sum(matmul(x, w, recipe=r, key=key) * c)

    dx, dw = (np.asarray(v) for v in jax.grad(loss, argnums=(0, 1))(x, w))
    k1 = k2 = None
    if r.name == "nvfp4" and r.stochastic_gradients:
        k1, k2 = jax.random.split(key)
    # dgrad: dx (M, K) = Q(c) (M, N) . Q(w) (K, N)^T, both quantized along N
    exp_dx, _ = _expected(r, c, w, ("g", "w"), keys=(k1, None))
    # wgrad: dw^T (N, K) = Q(c^T) (N, M) . Q(x^T) (K, M)^T, both quantized along M
    gt, xt = c.T, x.T
    if r.name == "nvfp4" and r.hadamard:  # the recipe's transform of wgrad's operands
        h = r.hadamard_matrix()
        gt, xt = (np.asarray(apply_hadamard(jnp.asarray(t), h)) for t in (gt, xt))
    exp_dw, _ = _expected(r, gt, xt, ("g", "x"), keys=(k2, None))
    assert np.array_equal(_bits(dx), _bits(exp_dx))
    assert np.array_equal(_bits(dw), _bits(exp_dw.T))
    return dx, dw


def test_gradients_are_the_block_scaled_mma():
    """jax.grad through matmul with mxfp4 on b200: dgrad and wgrad equal hw.gemm on the
    recipe's quantization of the cotangent and the transposed operands (along N and M), and
    the hardware's cut toward zero shows where float32 sums would round up."""
    r = get_recipe("mxfp4", accumulate="b200")
    dx, dw = _check_grads(r)
    assert (dx[0] == np.float32(1 - 2.0**-24)).all() and (dw[:, 0] == dx[0]).all()


@pytest.mark.slow
def test_gradients_float_path_rounds():
    """The same gradients without the hardware model (float32 sums) round to 1 there."""
    x, w, c = _grad_inputs(3)
    plain = get_recipe("mxfp4")
    dx0, dw0 = jax.grad(lambda x, w: jnp.sum(matmul(x, w, recipe=plain) * c), (0, 1))(x, w)
    assert (np.asarray(dx0)[0] == 1).all() and (np.asarray(dw0)[:, 0] == 1).all()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nvfp4", "mxfp8"])
def test_gradients_slow(name):
    """NVFP4 (stochastic gradients, Hadamard wgrad) and MXFP8: the backward GEMMs are the
    hardware model's on the recipe's own quantization."""
    r = get_recipe(name, accumulate="b200")
    _check_grads(r, key=jax.random.key(7) if name == "nvfp4" else None)


def test_nan_block_poisons_its_row():
    """A NaN input gives a NaN block scale (E8M0 0xFF): NaN in its output row, as without
    the hardware model; other rows are finite."""
    x, w = _inputs(4, 4, 96, 16)
    x[2, 70] = np.nan
    y = np.asarray(matmul(x, w, recipe=get_recipe("mxfp4", accumulate="b200")))
    assert np.isnan(y[2]).all() and np.isfinite(np.delete(y, 2, axis=0)).all()


def test_errors_name_what_works():
    with pytest.raises(ValueError, match=r"mxfp4 recipe scales blocks of 32 \(E8M0\).*h100 has "
                       r"none.*Presets that work: b200-cublaslt, b200"):  # fmt: skip
        get_recipe("mxfp4", accumulate="h100-fast")
    with pytest.raises(ValueError, match=r"nvfp4 recipe.*a100 has none.*b200-cublaslt, b200"):
        get_recipe("nvfp4", accumulate="a100")
    with pytest.raises(ValueError, match=r"UE4M3 scales per 32; Blackwell's block-scaled MMA"):
        get_recipe("nvfp4", accumulate="b200", block=32)
    with pytest.raises(ValueError, match=r"mxfp6 recipe's forward GEMM \(x, w\) multiplies "
                       r"float6_e2m3fn x float6_e2m3fn elements with E8M0 scales per 16.*MXFP6 "
                       r"\(float6_e2m3fn/float6_e3m2fn, E8M0 per 32"):  # fmt: skip
        get_recipe("mxfp6", accumulate="b200", block=16)
    with pytest.raises(ValueError, match=r"gradient GEMMs \(g with x or w\) multiplies "
                       "float8_e5m2 x float4_e2m1fn elements with E8M0 scales per 16"):  # fmt: skip
        get_recipe("mxfp4", accumulate="b200", grad_element="float8_e5m2", block=16)
    with pytest.raises(ValueError, match="E8M0 scales per 16"):
        get_recipe("mxfp8", accumulate="b200", block=16)
    with pytest.raises(ValueError, match=r"blockwise recipe's 1 x 128.*DeepGEMM.*h100-deepgemm"):
        get_recipe("blockwise", accumulate="b200")
    # what works: MXFP4 per 16, MXFP8 with E5M2 gradients, MXFP6, FP4 with FP8 gradients
    get_recipe("mxfp4", accumulate="b200", block=16)
    get_recipe("mxfp8", accumulate="b200", grad_element="float8_e5m2")
    get_recipe("mxfp6", accumulate="b200")
    get_recipe("mxfp4", accumulate="b200", grad_element="float8_e5m2")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_small_model_grad_through_apply(name):
    """jax.grad through a two-layer model under recipes.apply with accumulate="b200": finite,
    and within the quantization noise of the same recipe summed in float32 (the two differ
    only in how the block-scaled MMA cuts its sums)."""
    from precisionlab.recipes import apply

    def mlp(p, x):
        return jnp.tanh(x @ p["w1"]) @ p["w2"]

    rng = np.random.default_rng(5)
    p = {"w1": jnp.asarray(rng.standard_normal((64, 64)) / 8, jnp.float32),
         "w2": jnp.asarray(rng.standard_normal((64, 32)) / 8, jnp.float32)}  # fmt: skip
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    t = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
    key = jax.random.key(0)

    def grads(acc):
        f = apply(mlp, get_recipe(name, accumulate=acc))
        return jax.grad(lambda p: jnp.mean((f(p, x, key=key) - t) ** 2))(p)

    g, g0 = grads("b200"), grads(None)
    for k in p:
        assert np.isfinite(np.asarray(g[k])).all()
        np.testing.assert_allclose(g[k], g0[k], rtol=1e-3, atol=1e-6)
