"""emulate(fn, policy): exact per-op numerics for any JAX model.

Oracles: the built-in models' forced-numerics path (precisionlab.mixed.ops, an independent
implementation of the same rounding), float64 numpy rounded per op with ml_dtypes, and plain
arithmetic (x * 1000 / 1000 in float16 overflows to inf).
"""

from __future__ import annotations

import functools
import itertools

import equinox as eqx
import flax.linen as linen
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from precisionlab.emulate import emulate
from precisionlab.mixed import ops
from precisionlab.mixed._policy import Policy, get_policy
from precisionlab.train._models import MLP

POLICIES = [
    "p=f32,c=bf16,o=f32",
    # float16's built-in reference runs op by op (see _builtin): slow
    pytest.param("p=f32,c=f16,o=f32", marks=pytest.mark.slow),
]
MODEL = MLP(in_dim=12, num_classes=5, width=16, depth=1, activation="relu")


def _bits(x) -> np.ndarray:
    """float32 bit patterns (a bf16/f16 value widens exactly)."""
    return np.asarray(jnp.asarray(x).astype(jnp.float32)).view(np.uint32)


def _same(a, b) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(_bits(x), _bits(y))


def _batch(scale: float = 1.0):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 12), dtype=np.float32) * scale)
    y = jnp.asarray(rng.integers(0, 5, 16), jnp.int32)
    return x, y


@functools.cache
def _builtin(policy: str, seed: int = 1):
    """Forward logits and the gradients w.r.t. the compute-dtype params (as the train step).

    float16 runs op by op: XLA reorders a float16 reduction fused into other work (the bias
    gradient), measured neither sequential nor rounded once, so a jitted built-in run is no
    fixed reference there; alone, each partial sum is rounded in order (bfloat16 reductions are
    rewritten to that form in either case)."""
    pol = get_policy(policy)

    def run(params, x, y):
        pc = pol.cast_to_compute(params)
        grads = jax.grad(lambda p: MODEL.loss_fn(pol)(p, {"x": x, "y": y})[0])(pc)
        return MODEL.apply(pc, x, pol), grads

    params = MODEL.init(jax.random.key(seed))
    x, y = _batch()
    logits, grads = (run if pol.compute_dtype == np.float16 else jax.jit(run))(params, x, y)
    return params, x, y, logits, grads


def _loss(logits, y):
    # float32 cross-entropy outside the emulation, as the built-in policy keeps it in float32
    return ops.cross_entropy(logits, y, policy=Policy())


class _Linen(linen.Module):
    @linen.compact
    def __call__(self, x):
        for _ in range(MODEL.depth):
            x = linen.relu(linen.Dense(MODEL.width)(x))
        return linen.Dense(MODEL.num_classes)(x)


def _linen_params(params):
    names = [f"Dense_{i}" for i in range(MODEL.depth + 1)]
    layers = [*params["hidden"], params["out"]]
    pairs = zip(names, layers, strict=True)
    return {"params": {n: {"kernel": l["w"], "bias": l["b"]} for n, l in pairs}}


class _Eqx(eqx.Module):
    layers: list

    def __call__(self, x):
        for lin in self.layers[:-1]:
            x = jax.nn.relu(jax.vmap(lin)(x))
        return jax.vmap(self.layers[-1])(x)


def _eqx_model(params):
    layers = []
    for l in [*params["hidden"], params["out"]]:
        lin = eqx.nn.Linear(l["w"].shape[0], l["w"].shape[1], key=jax.random.key(0))
        lin = eqx.tree_at(lambda m: (m.weight, m.bias), lin, (l["w"].T, l["b"]))
        layers.append(lin)
    return _Eqx(layers)


@pytest.mark.parametrize("policy", POLICIES)
def test_flax_linen_model_matches_the_builtin_forced_numerics(policy):
    params, x, y, logits, grads = _builtin(policy)
    lp = _linen_params(params)
    fwd = jax.jit(emulate(_Linen().apply, policy))
    _same(fwd(lp, x), logits)
    g = jax.jit(jax.grad(lambda p: _loss(emulate(_Linen().apply, policy)(p, x), y)))(lp)
    want = _linen_params(grads)
    _same(g, want)
    # the control: without emulation the float32 run differs from the 16-bit one
    assert not np.array_equal(_bits(_Linen().apply(lp, x)), _bits(logits))


def test_equinox_model_matches_the_builtin_forced_numerics():
    policy = POLICIES[0]
    params, x, y, logits, grads = _builtin(policy)
    model = _eqx_model(params)
    _same(jax.jit(emulate(lambda m, x: m(x), policy))(model, x), logits)

    @eqx.filter_jit
    @eqx.filter_grad
    def g(m):
        return _loss(emulate(lambda m, x: m(x), policy)(m, x), y)

    got = g(model)
    want = _eqx_model(grads)
    _same([(lin.weight, lin.bias) for lin in got.layers], [(l.weight, l.bias) for l in want.layers])


def test_flax_nnx_model_matches_the_builtin_forward():
    params = MODEL.init(jax.random.key(3))
    x, _ = _batch()

    class Net(nnx.Module):
        def __init__(self, rngs):
            dims = [MODEL.in_dim] + [MODEL.width] * MODEL.depth + [MODEL.num_classes]
            # nnx.List since flax 0.12 (jax >= 0.7); a plain list of modules before
            self.layers = getattr(nnx, "List", list)(
                [nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(dims)]
            )

        def __call__(self, x):
            for lin in self.layers[:-1]:
                x = nnx.relu(lin(x))
            return self.layers[-1](x)

    net = Net(nnx.Rngs(0))
    for lin, l in zip(net.layers, [*params["hidden"], params["out"]], strict=True):
        lin.kernel[...], lin.bias[...] = l["w"], l["b"]
    graphdef, state = nnx.split(net)
    out = jax.jit(emulate(lambda s, x: nnx.merge(graphdef, s)(x), "c=f16"))(state, x)
    pol = get_policy("c=f16")
    _same(out, jax.jit(lambda p, x: MODEL.apply(pol.cast_to_compute(p), x, pol))(params, x))


def test_a_fused_float16_chain_overflows_under_emulation():
    # 300 * 300 = 90000 > 65504: a float16 GPU kernel stores inf; float32 returns 300.
    # (x * 1000 / 1000 is no such example: XLA's simplifier folds it to x on the GPU, and
    # emulate does too; see test_emulate_h100.)
    def f(x):
        return x * x / x

    x = jnp.full((8,), 300.0, jnp.float16)
    # what a float32 program hides
    assert np.all(np.asarray(jax.jit(f)(x.astype(jnp.float32))) == 300.0)
    assert np.all(np.isinf(np.asarray(jax.jit(emulate(f, "f16"))(x))))
    # a float32 program emulated under c=f16 overflows the same way
    assert np.all(np.isinf(np.asarray(jax.jit(emulate(f, "c=f16"))(x.astype(jnp.float32)))))


ORACLE_DTYPES = {
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
}


@pytest.mark.parametrize("fmt", list(ORACLE_DTYPES))
def test_per_op_rounding_matches_a_float64_oracle(fmt):
    """A chain of correctly rounded ops (+, -, *, /, sqrt): float64 per op, rounded to the
    format with ml_dtypes after each op, must give the same values, including float16
    subnormals (XLA's reduce_precision alone would flush them), overflow to inf (IEEE) or NaN
    (float8_e4m3fn, through the project's codec)."""
    dt = ORACLE_DTYPES[fmt]
    rng = np.random.default_rng(7)
    n = 4096
    # exponents reaching each format's overflow (and, but for bf16, its subnormals)
    lo, hi = (-40, 70) if fmt == "bfloat16" else (-30, 20)
    a = (rng.standard_normal(n) * np.exp2(rng.integers(lo, hi, n))).astype(np.float32)
    b = (rng.standard_normal(n) * np.exp2(rng.integers(lo, hi, n))).astype(np.float32)

    def f(a, b):
        s = a + b
        p = a * b
        q = s / (jnp.abs(b) + 1e-3)
        r = jnp.sqrt(jnp.abs(p))
        return s - p, q, r * a

    def r(v):
        return np.asarray(np.asarray(v, np.float64).astype(dt), np.float64)

    with np.errstate(all="ignore"):  # overflow and inf - inf are part of the test
        a64, b64, eps = r(a), r(b), r(np.float32(1e-3))
        s, p = r(a64 + b64), r(a64 * b64)
        want = (
            r(s - p),
            r(s / r(r(np.abs(b64)) + eps)),
            r(r(np.sqrt(r(np.abs(p)))) * a64),
        )
    got = jax.jit(emulate(f, f"c={fmt}"))(a, b)
    for g, w in zip(got, want, strict=True):
        w = np.asarray(w, np.float32)
        if fmt == "float8_e4m3fn":  # NaN payloads differ between codecs: compare values
            np.testing.assert_array_equal(np.asarray(g), w)
        else:
            np.testing.assert_array_equal(_bits(g), _bits(w))
    allv = np.concatenate([np.abs(np.asarray(w)) for w in want])
    tiny = float(ml_dtypes.finfo(dt).smallest_normal)
    if fmt != "bfloat16":  # bf16 subnormals are float32's, which XLA on CPU flushes
        assert np.any((allv > 0) & (allv < tiny))  # the test reaches the corners it claims
    assert np.any(np.isnan(allv) if fmt == "float8_e4m3fn" else np.isinf(allv))


def test_control_flow_and_remat_are_emulated():
    # scan over layers, cond and checkpoint: the overflow inside each is seen
    def f(x):
        def body(c, _):
            return jax.checkpoint(lambda c: c * 300.0 / 300.0)(c), None

        y, _ = jax.lax.scan(body, x, None, length=2)
        return jax.lax.cond(x[0] > 0, lambda v: v * v / v, lambda v: v, y)

    x = jnp.full((4,), 300.0, jnp.float32)
    assert np.all(np.asarray(jax.jit(f)(x)) == 300.0)
    assert np.all(np.isinf(np.asarray(jax.jit(emulate(f, "c=f16"))(x))))
    # 100 * 300 = 30000 fits float16 (and 30000 / 300 is exact): the scan alone is harmless
    g = emulate(lambda x: jax.lax.scan(lambda c, _: (c * 300.0 / 300.0, None), x, None, 2)[0],
                "c=f16")  # fmt: skip
    np.testing.assert_array_equal(np.asarray(g(x)), np.asarray(x))


def test_keep_leaves_chosen_operations_in_float32_and_reports_them():
    def f(x):
        return x * x / x

    x = jnp.full((2,), 300.0, jnp.float32)
    # keeping only the product is not enough: the divide casts its operand to float16 (inf)
    assert np.all(np.isinf(np.asarray(emulate(f, "c=f16", keep="mul[0]")(x))))
    em = emulate(f, "c=f16", keep=("mul[0]", "div[1]"))
    np.testing.assert_array_equal(np.asarray(em(x)), np.asarray(f(x)))  # the chain stays f32
    text = emulate(f, "c=f16", keep="mul[0]").report(x)
    assert "mul[0]" in text and "kept" in text and "div[1]" in text and "replaced" in text


def test_matmul_accumulates_in_float32_and_rounds_once():
    # 1 + 2**-9 * 256 terms: float32 accumulation gets 1.5 exactly; a bf16 accumulator would
    # stall at 1 (each 2**-9 is below half an ulp of 1 in bf16: 2**-8).
    k = 257
    a = np.full((1, k), 2.0**-9, np.float32)
    a[0, 0] = 1.0
    b = np.ones((k, 1), np.float32)
    out = emulate(jnp.matmul, "c=bf16")(a, b)
    assert float(out[0, 0]) == 1.5
    narrow = emulate(jnp.matmul, "c=bf16", accumulate_bits=7)(a, b)
    assert float(narrow[0, 0]) == 1.0


def test_bad_arguments_are_refused_with_the_allowed_values():
    with pytest.raises(TypeError, match="callable"):
        emulate(3, "bf16")
    with pytest.raises(ValueError, match="accumulate_bits"):
        emulate(jnp.sin, "bf16", accumulate_bits=40)
    with pytest.raises(ValueError, match="unknown dtype"):
        emulate(jnp.sin, "c=bf17")


def test_static_arguments_vmap_and_abstract_sites():
    def f(x, n, mode="scale"):
        return x * n / x if mode == "scale" else x

    x = jnp.full((2, 3), 100.0, jnp.float32)
    em = emulate(f, "c=f16")
    assert np.all(np.isinf(np.asarray(em(x, 1000.0, mode="scale"))))  # floats, strings: static
    np.testing.assert_array_equal(np.asarray(em(x, 1000.0, mode="off")), np.asarray(x))
    batched = jax.jit(jax.vmap(lambda r: em(r, 1000.0)))(x)
    assert np.all(np.isinf(np.asarray(batched)))
    sites = em.sites(jax.ShapeDtypeStruct((2, 3), jnp.float32), 1000.0)
    assert [s.name for s in sites] == ["mul[0]", "div[1]"]


def test_embedding_gradients_and_unsupported_higher_order_primitives():
    # an embedding lookup's gradient is a scatter-add (a primitive holding a combiner program)
    table = jnp.ones((5, 3), jnp.float32)
    idx = jnp.asarray([0, 2, 2, 4])
    g = jax.grad(emulate(lambda t: jnp.sum(t[idx] * 3.0), "c=f16"))(table)
    want = np.zeros((5, 3), np.float32)
    np.add.at(want, np.asarray(idx), 3.0)
    np.testing.assert_array_equal(np.asarray(g), want)

    def solve(b):  # custom_linear_solve holds sub-programs emulate cannot enter
        return jax.lax.custom_linear_solve(lambda x: 2.0 * x, b, lambda _, y: y / 2.0)

    with pytest.raises(NotImplementedError, match="custom_linear_solve"):
        emulate(solve, "c=f16")(jnp.ones(3))


def test_casts_inside_the_program_keep_both_roundings():
    def f(x):
        return x.astype(jnp.bfloat16).astype(jnp.float32) * 2

    x = jnp.asarray([70000.0, 1000.3, 3.0], jnp.float32)
    got = np.asarray(emulate(f, "c=f16")(x))
    # bf16(1000.3) = 1000 (8 bits), then float16 holds it; 70000 overflows float16
    np.testing.assert_array_equal(got, [np.inf, 2000.0, 6.0])
