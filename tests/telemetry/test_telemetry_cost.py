"""The cheaper telemetry (issue 33, item 6) changes no result.

- The batched statistics (``observe``'s and ``tree_stats``'s :class:`StatsTable`, computed
  together by :func:`stacked_stats`) equal a float64 numpy recount of the same tensors
  (counts and extremes exactly, moments and SQNR to float32 tolerance) and the unbatched
  :func:`tensor_stats` of each tensor (counts and extremes exactly).
- A step that ``telemetry.every(N)`` skips trains bitwise as the same step without telemetry
  (both with ``every`` around ``observe`` and with the training loop's ``Telemetry``), and
  the steps it does not skip return statistics (the feature has an effect).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from precisionlab import telemetry as T

TARGETS = ("fp16", "bf16")
CASTS = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}
COUNTS = ("n", "n_nan", "n_inf", "n_zero", "n_nonzero")


def _params(seed: int = 0) -> dict:
    """A plain-pytree MLP whose activations span fp16's range: some overflow, some underflow."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((16, 32)) * np.exp2(rng.uniform(-30, 18, (16, 32)))
    return {
        "w1": jnp.asarray(w1, jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((32, 24)) * 0.3, jnp.float32),
        "w3": jnp.asarray(rng.standard_normal((24, 8)) * 0.1, jnp.float32),
    }


def _batch(seed: int = 1) -> jax.Array:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((8, 16)) * np.exp2(rng.uniform(-4, 4, (8, 16))))


def loss(p: dict, x: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ p["w1"] * 1e-3) * 300.0
    h = jax.nn.relu(h @ p["w2"])
    return jnp.mean(jnp.square(h @ p["w3"]))


@np.errstate(over="ignore", divide="ignore", invalid="ignore")
def _recount(x: np.ndarray) -> dict:
    """float64 statistics of ``x`` and its plain casts to ``TARGETS`` (numpy, ml_dtypes)."""
    fin = np.isfinite(x)
    xf = x[fin].astype(np.float64)
    nz = fin & (x != 0)
    a = np.abs(xf)
    out = {
        "n": x.size, "n_nan": int(np.isnan(x).sum()), "n_inf": int(np.isinf(x).sum()),
        "n_zero": int((x == 0).sum()), "n_nonzero": int(nz.sum()), "amax": a.max(),
        "amin_nonzero": a[a > 0].min() if (a > 0).any() else None,
        "mean": xf.mean(), "std": xf.std(), "targets": {},
    }  # fmt: skip
    for name, dt in CASTS.items():
        info = ml_dtypes.finfo(dt)
        c = x.astype(dt).astype(np.float64)
        over = nz & ~np.isfinite(c)
        elems = np.where(over, np.sign(x) * float(info.max), c)  # an overflow saturates
        ae = np.abs(elems)
        err = ((x.astype(np.float64) - elems)[fin]) ** 2
        out["targets"][name] = {
            "overflow": int(over.sum()),
            "underflow": int((nz & (elems == 0)).sum()),
            "subnormal": int((nz & (ae > 0) & (ae < float(info.smallest_normal))).sum()),
            "sqnr_db": 10 * np.log10((xf**2).sum() / err.sum()) if err.sum() else np.inf,
        }
    return out


def _assert_matches(got: dict, want: dict, where) -> None:
    for k in (*COUNTS, "amax"):
        assert got[k] == want[k], (where, k, got[k], want[k])
    if want["amin_nonzero"] is not None:
        assert got["amin_nonzero"] == want["amin_nonzero"], where
    assert got["mean"] == pytest.approx(want["mean"], rel=1e-5, abs=1e-6 * want["amax"]), where
    assert got["std"] == pytest.approx(want["std"], rel=1e-5), where
    for name in TARGETS:
        g, w = got["targets"][name], want["targets"][name]
        for k in ("overflow", "underflow", "subnormal"):
            assert round(g[k] * want["n_nonzero"]) == w[k], (where, name, k)
        assert g["sqnr_db"] == pytest.approx(w["sqnr_db"], abs=1e-3), (where, name)


@pytest.fixture(scope="module")
def observed_step():
    """One program: the batched statistics and the raw tensors they are of (the same
    values, so that counts can be compared exactly), and the gradients' tree_stats."""
    vg_stats = T.observe(loss, TARGETS).value_and_grad()
    vg_raw = T.observe(loss, TARGETS).value_and_grad(tensors=True)

    @jax.jit
    def both(p, x):
        _, grads, table = vg_stats(p, x)
        _, _, raw = vg_raw(p, x)
        return table, raw, grads, T.tree_stats(grads, TARGETS)

    return jax.device_get(both(_params(), _batch()))


def test_batched_observe_statistics_equal_a_float64_recount(observed_step):
    table, raw, _, _ = observed_step
    assert isinstance(table, T.StatsTable) and sorted(table) == sorted(raw) and len(raw) == 3
    totals = np.zeros(3, int)
    for site, roles in raw.items():
        assert set(table[site]) == {"lhs", "rhs", "out", "grad"}, site
        for role, x in roles.items():
            x = np.asarray(x)
            want = _recount(x)
            got = T.to_dict(table[site][role], TARGETS)
            _assert_matches(got, want, (site, role))
            # the unbatched statistics of the same tensor: counts and extremes the same
            one = T.to_dict(T.tensor_stats(x, TARGETS), TARGETS)
            for k in (*COUNTS, "amax", "amin_nonzero"):
                assert one[k] == got[k] or (one[k] is None and got[k] is None), (site, role, k)
            t = want["targets"]["fp16"]
            totals += [t["overflow"], t["underflow"], t["subnormal"]]
    # the tensors reach fp16's overflow, underflow and subnormal ranges: the counts are tested
    assert (totals > 0).all(), totals


def test_batched_tree_stats_equal_a_float64_recount(observed_step):
    _, _, grads, table = observed_step
    assert sorted(table) == ["['w1']", "['w2']", "['w3']"]
    for key, g in zip(sorted(table), (grads["w1"], grads["w2"], grads["w3"]), strict=True):
        _assert_matches(T.to_dict(table[key], TARGETS), _recount(np.asarray(g)), key)


def _train(step_fn, steps) -> tuple:
    """adamw on ``loss`` from the same start, one jitted step per counter in ``steps``."""
    opt = optax.adamw(1e-3)
    p = _params()
    s = opt.init(p)
    x = _batch()
    outs = []
    for i in steps:
        p, s, out = step_fn(opt, p, s, x, jnp.int32(i))
        outs.append(out)
    return p, s, outs


def test_skipped_steps_train_bitwise_as_without_telemetry():
    observed = T.observe(loss, TARGETS).value_and_grad()
    vg = jax.value_and_grad(loss)

    def plain(opt, p, s, x, i):
        value, g = vg(p, x)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    def with_every(opt, p, s, x, i):
        value, g = vg(p, x)
        stats = T.every(10, i, lambda p, x: observed(p, x)[2], p, x)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, (value, stats)

    plain, with_every = (jax.jit(f, static_argnums=0) for f in (plain, with_every))
    steps = (1, 2, 3, 10)
    p0, s0, v0 = _train(plain, steps)
    p1, s1, v1 = _train(with_every, steps)
    for a, b in zip(jax.tree.leaves((p0, s0)), jax.tree.leaves((p1, s1)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [float(v) for v in v0] == [float(v) for v, _ in v1]
    # skipped steps return empty statistics; step 10 counts every element
    for i, (_, stats) in zip(steps, v1, strict=True):
        n = [int(stats[site]["out"].n) for site in stats]
        assert all(k > 0 for k in n) if i % 10 == 0 else all(k == 0 for k in n), (i, n)


def test_training_loop_telemetry_leaves_training_bitwise_unchanged():
    """``build_step`` with ``Telemetry(interval=10)`` against the same step without it, from
    step 0 (computed) through steps 1-2 (skipped): the same params, optimizer state, loss."""
    from precisionlab.train import StepOptions, build_step
    from precisionlab.train._telemetry import Telemetry

    runs = []
    for tel in (None, Telemetry(interval=10, targets=TARGETS)):
        step, state, _ = build_step(
            lambda p, b: (loss(p, b), {}), _params(), optax.adamw(1e-3), StepOptions(telemetry=tel)
        )
        step = jax.jit(step)
        metrics = []
        for _ in range(3):
            state, m = step(state, _batch())
            metrics.append(jax.device_get(m))
        runs.append((jax.device_get((state.params, state.opt_state)), metrics))
    (a, ma), (b, mb) = runs
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    assert [float(m["loss"]) for m in ma] == [float(m["loss"]) for m in mb]
    n = [int(np.asarray(m["telemetry"]["matmul"].n).sum()) for m in mb]
    assert n[0] > 0 and n[1:] == [0, 0], n  # step 0 observed, steps 1 and 2 skipped


def test_a_tensors_statistics_do_not_depend_on_what_is_stacked_with_it():
    """Every field of a tensor's stacked statistics, float sums included, is bitwise the same
    alone and among others of other shapes (the batching changes no number)."""
    rng = np.random.default_rng(5)
    x, y = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((37, 300), (5, 1000)))
    stats = jax.jit(lambda xs: T.stacked_stats(xs, ("fp16",)))
    alone, among = stats([x]), stats([y, x])
    for f in alone._fields:
        np.testing.assert_array_equal(getattr(alone, f)[0], getattr(among, f)[1], err_msg=f)
