"""Telemetry of matmuls inside scan / cond / checkpoint / while_loop: a scanned layer stack
gives per-layer statistics equal to the same model written unrolled, and per-iteration output
cotangents equal to a numpy recount of jax.grad of the unrolled model."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from precisionlab import telemetry as T

TARGETS = ("fp16",)
L = 3
# weights spread so the output cotangents of the deep layers underflow fp16 somewhat
WS = jax.random.normal(jax.random.PRNGKey(0), (L, 8, 8)) * jnp.float32(0.05)
X = jax.random.normal(jax.random.PRNGKey(1), (6, 8))


def _unrolled(ws, x, probes=None):
    h = x
    for i in range(L):
        z = h @ ws[i]
        if probes is not None:
            z = z + probes[i]
        h = jnp.maximum(z, 0.0) + 1e-3 * z
    return jnp.sum(h) * jnp.float32(1e-3)


def _scanned(ws, x, remat=False):
    def body(h, w):
        z = h @ w
        return jnp.maximum(z, 0.0) + 1e-3 * z, None

    body = jax.checkpoint(body) if remat else body
    return jnp.sum(lax.scan(body, x, ws)[0]) * jnp.float32(1e-3)


def _at(stats, i):
    return jax.tree.map(lambda a: a[i], stats)


def _same(a, b):
    """Counts, amax and amin exactly; sums (mean, std, SQNR) to float32 rounding: XLA may
    reduce in another order inside a loop body than outside."""
    da, db = T.to_dict(a, TARGETS), T.to_dict(b, TARGETS)
    for k in ("n", "n_zero", "n_nonzero", "n_nan", "n_inf", "amax", "amin_nonzero"):
        assert da[k] == db[k], k
    for k in ("mean", "std"):
        np.testing.assert_allclose(da[k], db[k], rtol=1e-5, atol=1e-12)
    for name in TARGETS:
        ta, tb = da["targets"][name], db["targets"][name]
        for k in ("overflow", "saturate", "underflow", "subnormal", "poisoned"):
            assert ta[k] == tb[k], (name, k)
        np.testing.assert_allclose(ta["sqnr_db"], tb["sqnr_db"], rtol=1e-5)


def _recount(x: np.ndarray) -> dict:
    x = np.asarray(x, np.float32)
    nz = x != 0
    out = {"n_zero": int((~nz).sum()), "amax": float(np.abs(x).max())}
    out["fp16"] = int((nz & (x.astype(np.float16) == 0)).sum())  # numpy rounds to nearest even
    return out


def test_scanned_stack_equals_unrolled_per_layer_with_grads():
    vg_s = jax.jit(T.observe(_scanned, TARGETS).value_and_grad(0))
    vg_u = jax.jit(T.observe(_unrolled, TARGETS).value_and_grad(0, tensors=True))
    v_s, _, st_s = vg_s(WS, X)
    v_u, _, tensors = vg_u(WS, X)
    assert set(st_s) == {"dot_general[0]"} and len(tensors) == L
    np.testing.assert_allclose(v_s, v_u, rtol=1e-6)
    s = st_s["dot_general[0]"]
    assert s["grad"].n.shape == (L,)
    # the unrolled model's tensors, their statistics in one program (cheap to compile)
    roles = ("lhs", "rhs", "out", "grad")
    ref = T.stacked_stats(
        [tensors[f"dot_general[{i}]"][r] for i in range(L) for r in roles], TARGETS
    )
    for i in range(L):  # the same arithmetic per layer: the same statistics
        for k, role in enumerate(roles):
            _same(_at(s[role], i), _at(ref, i * len(roles) + k))
    # the cotangents per layer against a numpy recount of jax.grad of the unrolled model
    probes = jnp.zeros((L, 6, 8))
    cts = np.asarray(jax.jit(jax.grad(lambda p: _unrolled(WS, X, p)))(probes))
    under = 0
    for i in range(L):
        got, want = T.to_dict(_at(s["grad"], i), TARGETS), _recount(cts[i])
        assert got["n_zero"] == want["n_zero"] and got["amax"] == want["amax"]
        n = round(got["targets"]["fp16"]["underflow"] * got["n_nonzero"])
        assert n == want["fp16"], i
        under += want["fp16"]
    assert under > 0  # the comparison above was not vacuous


@pytest.mark.slow  # ~8 statistics programs to compile (the interception-level checks of these
# constructs, without statistics, run by default in test_intercept_loops.py)
def test_remat_scan_and_cond_and_while():
    # a checkpointed scan body: the same statistics as without checkpoint
    _, st = jax.jit(T.observe(_scanned, TARGETS))(WS, X)
    _, st_r = jax.jit(T.observe(lambda w, x: _scanned(w, x, remat=True), TARGETS))(WS, X)
    jax.tree.map(np.testing.assert_array_equal, st_r, st)

    def branchy(ws, x):
        return lax.cond(jnp.sum(x) > 0, lambda x: x @ ws[0], lambda x: x @ ws[1], x).sum()

    obs = jax.jit(T.observe(branchy, TARGETS))
    for sign in (1.0, -1.0):
        x = jnp.abs(X) * sign
        _, st = obs(WS, x)
        taken, other = ("dot_general[1]", "dot_general[0]")[:: int(sign)]
        assert bool(st[taken]["valid"]) and not bool(st[other]["valid"])
        _same(st[taken]["out"], T.tensor_stats(x @ WS[0 if sign > 0 else 1], TARGETS))

    def loop(ws, x):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] @ ws[0]), (0, x))[1]

    _, st = jax.jit(T.observe(loop, TARGETS, while_capacity=4))(WS, X)
    w = st["dot_general[0]"]
    assert w["valid"].tolist() == [True, True, True, False]
    h = X
    for i in range(3):
        h = h @ WS[0]
        _same(_at(w["out"], i), T.tensor_stats(h, TARGETS))
    # while loops are not differentiated in reverse mode: statistics without "grad"
    fn = T.observe(lambda w, x, v: jnp.sum(loop(w, x)) + jnp.sum(v), TARGETS)
    assert "grad" not in fn.value_and_grad(2)(WS, X, jnp.ones(2))[2]["dot_general[0]"]


def test_views_name_layer_and_site_and_still_read_rows_without_a_site(tmp_path):
    from precisionlab.experiments import _telemetry_views as views

    def row(step, layer, site, tensor, under):
        r = {"step": step, "kind": "matmul", "layer": layer, "tensor": tensor, "n": 64,
             "dynamic_range": 3.0 * under, "targets": {"fp16": {"underflow": under,
                                                                "overflow": 0.0}}}  # fmt: skip
        return {**r, "site": site} if site else r

    rows = [
        row(1, "dot_general[0]", None, "grad", 0.25),  # written before rows named the layer
        row(3, "layer1", "dot_general[1]", "grad", 0.5),
        row(3, "layer2", "dot_general[1]", "grad", 0.75),  # the same site, a stacked layer
    ]
    (tmp_path / "telemetry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summ = views.summarize_telemetry(tmp_path)
    worst = summ["worst_underflow"]
    assert [(e["layer"], e.get("site"), e["fraction"]) for e in worst] == [
        ("layer2", "dot_general[1]", 0.75), ("layer1", "dot_general[1]", 0.5),
        ("dot_general[0]", None, 0.25),
    ]  # fmt: skip
    assert [views._label(r) for r in rows] == [
        "dot_general[0].grad", "layer1:dot_general[1].grad", "layer2:dot_general[1].grad",
    ]  # fmt: skip
