"""The interception layer's output channel (Emit -> Aux) and PerIteration state through scan,
while_loop, cond and checkpoint, against the same programs written unrolled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from precisionlab.intercept import Emit, PerIteration, intercept


class Tap:
    """Leaves dot_general as it is (plus ctx.state), emits its output and its lhs."""

    primitives = ("dot_general",)

    def apply(self, ctx, lhs, rhs, **params):
        out = ctx.original(lhs, rhs)[0]
        if ctx.state is not None:
            out = out + ctx.state
        return Emit([out], {"out": out, "lhs": lhs})


W = jax.random.normal(jax.random.PRNGKey(0), (4, 3, 3)) * 0.7
X = jax.random.normal(jax.random.PRNGKey(1), (2, 3))


def _scanned(ws, x, reverse=False):
    return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws, reverse=reverse)[0]


def test_scan_stacks_aux_per_iteration_in_xs_order():
    for reverse in (False, True):
        out, aux = jax.jit(
            lambda w, x, r=reverse: intercept(_scanned, Tap()).call_with_aux(None, w, x, r)
        )(W, X)
        h, outs = np.asarray(X), []
        order = range(3, -1, -1) if reverse else range(4)
        for i in order:
            z = h @ np.asarray(W[i])
            outs.append((i, z))
            h = np.tanh(z)
        (a,) = aux.values()
        assert a.value["out"].shape == (4, 2, 3) and a.valid.tolist() == [True] * 4
        for i, z in outs:
            np.testing.assert_allclose(a.value["out"][i], z, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(out, _scanned(W, X, reverse))


def test_nested_scan_checkpoint_cond_while():
    def f(ws, x):
        def group(h, wg):  # a checkpointed scan over groups of 2 (as remat_every=2)
            return jax.checkpoint(lambda h, wg: lax.scan(lambda h, w: (h @ w, None), h, wg))(h, wg)

        h, _ = lax.scan(group, x, ws.reshape(2, 2, 3, 3))
        h = lax.cond(h.sum() > 0, lambda h: h @ ws[0], lambda h: h @ ws[1] * 2.0, h)
        _, h = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] @ ws[2]), (0, h))
        return h

    inter = intercept(f, Tap(), while_capacity=2)
    sites = inter.sites(W, X)
    assert [s.within for s in sites] == [
        ("scan", "checkpoint", "scan"), ("cond",), ("cond",), ("while",),
    ]  # fmt: skip
    assert [s.lengths for s in sites] == [(2, 2), (), (), (None,)]
    out, aux = jax.jit(lambda w, x: inter.call_with_aux(None, w, x))(W, X)
    np.testing.assert_array_equal(out, f(W, X))
    # reference, unrolled in float64
    w64, h = np.asarray(W, np.float64), np.asarray(X, np.float64)
    zs = []
    for i in range(4):
        h = h @ w64[i]
        zs.append(h)
    a = aux["dot_general[0]"]
    assert a.value["out"].shape == (2, 2, 2, 3) and a.valid.all()
    np.testing.assert_allclose(a.value["out"].reshape(4, 2, 3), np.stack(zs), rtol=1e-5)
    # lax.cond's branches are (false, true): dot_general[1] is the false one
    taken = 2 if h.sum() > 0 else 1
    h = h @ w64[0] if taken == 2 else h @ w64[1] * 2.0
    for k in (1, 2):  # the untaken branch: zeros, valid False
        b = aux[f"dot_general[{k}]"]
        assert bool(b.valid) == (k == taken)
        if k != taken:
            assert not np.any(np.asarray(b.value["out"]))
    w = aux["dot_general[3]"]  # 3 iterations, capacity 2: the first two kept
    assert w.value["out"].shape == (2, 2, 3) and w.valid.tolist() == [True, True]
    for i in range(2):
        np.testing.assert_allclose(w.value["lhs"][i], h, rtol=1e-5)
        h = h @ w64[2]
    inter5 = intercept(f, Tap(), while_capacity=5)
    w5 = inter5.call_with_aux(None, W, X)[1]["dot_general[3]"]
    assert w5.valid.tolist() == [True, True, True, False, False]
    assert not np.any(np.asarray(w5.value["out"][3:]))


def test_per_iteration_state_gradient_is_stacked_not_max():
    inter = intercept(_scanned, Tap())

    def stacked(pr):
        return jnp.sum(inter.call_with_state({"dot_general[0]": PerIteration(pr)}, W, X))

    def unrolled(pr):
        h = X
        for i in range(4):
            h = jnp.tanh(h @ W[i] + pr[i])
        return jnp.sum(h)

    zero = jnp.zeros((4, 2, 3))
    g, want = jax.jit(jax.grad(stacked))(zero), jax.jit(jax.grad(unrolled))(zero)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)
    # a plain entry is broadcast: its gradient is the max over the iterations
    plain = jax.jit(jax.grad(lambda s: jnp.sum(inter.call_with_state({"dot_general[0]": s}, W, X))))
    np.testing.assert_allclose(plain(jnp.zeros((2, 3))), want.max(0), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="leading axis"):
        inter.call_with_state({"dot_general[0]": PerIteration(jnp.zeros((3, 2, 3)))}, W, X)


def test_rules_without_emit_give_no_aux_and_the_same_result():
    class Keep:
        primitives = ("dot_general",)

        def apply(self, ctx, lhs, rhs, **params):
            return ctx.original(lhs, rhs)

    inter = intercept(_scanned, Keep())
    out, aux = inter.call_with_aux(None, W, X)
    assert aux == {}
    np.testing.assert_array_equal(out, _scanned(W, X))
    with pytest.raises(ValueError, match="while_capacity"):
        intercept(_scanned, Keep(), while_capacity=0)
