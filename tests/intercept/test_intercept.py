"""The interception layer on models written three ways and on control flow.

Oracle: a rule that scales each replaced matmul's output by a known factor gives, by
linearity, a result computed independently with the factor written into the model by hand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from precisionlab.intercept import Context, Site, intercept


class Scale:
    """Replace dot_general by itself times ``factor`` (times ctx.state when given)."""

    primitives = ("dot_general",)

    def __init__(self, factor=2.0):
        self.factor = factor
        self.seen = []

    def apply(self, ctx, a, b, *, dimension_numbers, precision=None, preferred_element_type=None,
              **_):  # fmt: skip
        self.seen.append(ctx.site.name)
        out = lax.dot_general(a, b, dimension_numbers, precision, preferred_element_type)
        f = self.factor if ctx.state is None else ctx.state
        return [out * f]


def mlp(params, x):
    for w in params[:-1]:
        x = jax.nn.relu(x @ w)
    return x @ params[-1]


def mlp_scaled(params, x, factors):
    for w, f in zip(params[:-1], factors, strict=False):
        x = jax.nn.relu((x @ w) * f)
    return (x @ params[-1]) * factors[-1]


def _params(seed=0, sizes=(8, 16, 16, 4)):
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    return [
        jax.random.normal(k, (a, b)) / np.sqrt(a)
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


X = jax.random.normal(jax.random.key(9), (5, 8))


def test_plain_pytree_model_jit_grad_vmap():
    p = _params()
    f = intercept(mlp, Scale(2.0))
    want = mlp_scaled(p, X, [2.0, 2.0, 2.0])
    np.testing.assert_allclose(f(p, X), want, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(f)(p, X), want, rtol=1e-6)
    g = jax.grad(lambda p: f(p, X).sum())(p)
    gw = jax.grad(lambda p: mlp_scaled(p, X, [2.0, 2.0, 2.0]).sum())(p)
    for a, b in zip(g, gw, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    v = jax.vmap(f, in_axes=(None, 0))(p, X)
    np.testing.assert_allclose(v, want, rtol=1e-6)


def test_sites_names_and_include_exclude():
    p = _params()
    f = intercept(mlp, Scale(2.0), exclude=(0, -1))
    sites = f.sites(p, X)
    assert [s.name for s in sites] == ["dot_general[0]", "dot_general[1]", "dot_general[2]"]
    assert [s.selected for s in sites] == [False, True, False]
    assert sites[0].in_shapes == ((5, 8), (8, 16))
    assert "test_intercept.py" in sites[0].where
    np.testing.assert_allclose(f(p, X), mlp_scaled(p, X, [1.0, 2.0, 1.0]), rtol=1e-6)
    g = intercept(mlp, Scale(2.0), include=["dot_general[2]"])
    np.testing.assert_allclose(g(p, X), mlp_scaled(p, X, [1.0, 1.0, 2.0]), rtol=1e-6)
    report = f.report(p, X)
    assert report.splitlines()[0] == "3 matched (3 dot_general), 1 replaced"
    sites = [line for line in report.splitlines() if line.startswith("dot_general")]
    assert "kept" in sites[0] and "replaced" in sites[1] and "kept" in sites[2]
    assert max(len(line) for line in report.splitlines()) <= 100  # the site's code blocks


def test_scopes_from_named_scope_and_jit_and_glob():
    @jax.jit
    def head(x, w):
        return x @ w

    def model(p, x):
        with jax.named_scope("body"):
            x = jnp.tanh(x @ p[0])
        return head(x, p[1])

    p = _params(sizes=(8, 16, 4))
    f = intercept(model, Scale(3.0), include=["body"])
    sites = f.sites(p, X)
    assert [s.scope for s in sites] == ["body", "head"]
    assert [s.selected for s in sites] == [True, False]
    want = jnp.tanh((X @ p[0]) * 3.0) @ p[1]
    np.testing.assert_allclose(f(p, X), want, rtol=1e-6)
    assert intercept(model, Scale(), exclude="head*").sites(p, X)[1].selected is False


def test_bad_selection_is_a_clear_error():
    p = _params()
    with pytest.raises(ValueError, match="position 7 is out of range: the program has 3"):
        intercept(mlp, Scale(), include=[7]).sites(p, X)
    with pytest.raises(ValueError, match="pattern 'nope' matches no operation"):
        intercept(mlp, Scale(), exclude=["nope"]).sites(p, X)
    with pytest.raises(TypeError, match="callable"):
        intercept(3, Scale())
    with pytest.raises(ValueError, match="state for unknown operations"):
        intercept(mlp, Scale()).call_with_state({"dot_general[9]": 1.0}, p, X)


def test_control_flow_scan_cond_remat_while():
    ws = jnp.stack(_params(sizes=(8, 8, 8, 8)))

    def model(ws, x, factor=1.0):
        def layer(h, w):
            return jnp.tanh((h @ w) * factor), None

        h, _ = lax.scan(layer, x, ws)  # scan over layers
        h = jax.checkpoint(lambda h: jnp.sin((h @ ws[0]) * factor))(h)  # remat
        h = lax.cond(h.sum() > -1e9, lambda h: (h @ ws[1]) * factor, lambda h: h, h)
        return h

    f = intercept(lambda ws, x: model(ws, x), Scale(2.0))
    sites = f.sites(ws, X)
    assert [s.loops for s in sites] == [("scan",), (), ()]
    want = model(ws, X, 2.0)
    np.testing.assert_allclose(f(ws, X), want, rtol=1e-5)
    np.testing.assert_allclose(jax.jit(f)(ws, X), want, rtol=1e-5)
    g = jax.grad(lambda ws: f(ws, X).sum())(ws)
    gw = jax.grad(lambda ws: model(ws, X, 2.0).sum())(ws)
    np.testing.assert_allclose(g, gw, rtol=1e-4, atol=1e-6)

    def loop(ws, x):
        return lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ ws[i]), x)

    def loop_scaled(ws, x):
        return lax.fori_loop(0, 3, lambda i, h: jnp.tanh((h @ ws[i]) * 2.0), x)

    np.testing.assert_allclose(intercept(loop, Scale(2.0))(ws, X), loop_scaled(ws, X), rtol=1e-5)


def test_state_inside_scan_gets_max_not_sum_of_cotangents():
    ws = jnp.stack(_params(sizes=(8, 8, 8, 8)))

    class Probe:
        """Output unchanged; the state's cotangent reports each call's |output| max."""

        primitives = ("dot_general",)

        def apply(self, ctx, a, b, **params):
            out = lax.dot_general(a, b, params["dimension_numbers"])

            @jax.custom_vjp
            def tap(y, probe):
                return y

            tap.defvjp(lambda y, p: (y, jnp.max(jnp.abs(y))), lambda m, g: (g, m))
            return [tap(out, ctx.state)]

    def model(ws, x):
        h, hs = lax.scan(lambda h, w: (jnp.tanh(h @ w), h @ w), x, ws)
        return h.sum(), hs

    f = intercept(lambda ws, x: model(ws, x)[0], Probe())
    grad = jax.grad(lambda s: f.call_with_state({"dot_general[0]": s}, ws, X))(jnp.float32(0))
    _, hs = model(ws, X)
    assert float(grad) == float(jnp.max(jnp.abs(hs)))  # max over the 3 iterations


def test_equinox_model():
    eqx = pytest.importorskip("equinox")

    class Net(eqx.Module):
        layers: list

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.layers = [eqx.nn.Linear(8, 16, key=k1), eqx.nn.Linear(16, 4, key=k2)]

        def __call__(self, x):
            x = jax.nn.relu(self.layers[0](x))
            return self.layers[1](x)

    net = Net(jax.random.key(0))

    def run(net, x):
        return jax.vmap(net)(x)

    def by_hand(net, x, f):
        l0, l1 = net.layers
        h = jax.nn.relu((x @ l0.weight.T) * f + l0.bias)
        return (h @ l1.weight.T) * f + l1.bias

    f = intercept(run, Scale(2.0))
    assert len(f.sites(net, X)) == 2
    np.testing.assert_allclose(f(net, X), by_hand(net, X, 2.0), rtol=1e-5, atol=1e-6)
    g = eqx.filter_grad(lambda n: f(n, X).sum())(net)
    gw = eqx.filter_grad(lambda n: by_hand(n, X, 2.0).sum())(net)
    np.testing.assert_allclose(g.layers[0].weight, gw.layers[0].weight, rtol=1e-5, atol=1e-6)


def test_a_rule_rounding_every_float_op_to_bfloat16():
    """The shape of the next client: every op's result rounded to a format."""

    class RoundBF16:
        primitives = ("dot_general", "add", "mul", "tanh")

        def apply(self, ctx, *operands, **params):
            return [o.astype(jnp.bfloat16).astype(o.dtype) for o in ctx.original(*operands)]

    def model(w, x):
        return jnp.tanh(x @ w * 3.0 + 1.0)

    def by_hand(w, x):
        r = lambda v: v.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
        return r(jnp.tanh(r(r(r(x @ w) * 3.0) + 1.0)))

    w = _params(sizes=(8, 16))[0]
    f = intercept(model, RoundBF16())
    assert [s.primitive for s in f.sites(w, X)] == ["dot_general", "mul", "add", "tanh"]
    np.testing.assert_array_equal(np.asarray(f(w, X)), np.asarray(by_hand(w, X)))


def test_a_context_without_an_equation_says_so_when_asked_for_the_original():
    """A Context a rule's own test builds (no traced equation) has nothing to re-apply: a
    ValueError naming the site, not an AttributeError from inside the interpreter."""
    site = Site(
        index=0,
        primitive="dot_general",
        scope="",
        where="",
        loops=(),
        dtype="float32",
        in_shapes=((2, 2), (2, 2)),
        out_shapes=((2, 2),),
        path=(0,),
    )
    ctx = Context(site, None, (), None)
    with pytest.raises(ValueError, match=r"dot_general\[0\].*no equation"):
        ctx.original(jnp.ones((2, 2)), jnp.ones((2, 2)))
