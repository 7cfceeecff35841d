"""Built-in models and datasets: shapes, dtype flow, causality, determinism, errors."""

import re
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precisionlab import _schema
from precisionlab.mixed import get_policy
from precisionlab.train import DATASETS, MODELS, make_data, make_model


def test_names():
    assert set(MODELS) == {"mlp", "transformer", "conv"}
    assert set(DATASETS) == {"teacher", "markov", "text", "digits"}


@pytest.mark.parametrize("name", DATASETS)
def test_data_deterministic(name):
    d = make_data(name)
    a, b = d.batch(5, 16, seed=3), d.batch(5, 16, seed=3)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    c = d.batch(6, 16, seed=3)
    assert any(not np.array_equal(a[k], c[k]) for k in a)
    e = d.batch(5, 16, seed=3, split="eval")
    assert any(not np.array_equal(a[k], e[k]) for k in a)
    it = d.batches(16, seed=3, start=5)
    np.testing.assert_array_equal(next(it)[next(iter(a))], a[next(iter(a))])


def test_teacher_labels_balanced_and_markov_structured():
    d = make_data("teacher", num_classes=4)
    y = d.batch(0, 4000)["y"]
    freq = np.bincount(y, minlength=4) / y.size
    assert freq.min() > 0.1  # every class present
    m = make_data("markov", vocab_size=16, branching=2)
    tok = m.batch(0, 64)["tokens"]
    assert tok.shape == (64, m.seq_len + 1) and tok.min() >= 0 and tok.max() < 16
    # Order-2 structure: each (a, b) context is followed by at most `branching` tokens.
    succ = {}
    for row in tok:
        for a, b, c in zip(row[:-2], row[1:-1], row[2:], strict=True):
            succ.setdefault((a, b), set()).add(c)
    assert max(len(s) for s in succ.values()) <= 2
    assert m.bayes_accuracy() > 4 * m.chance


@pytest.mark.parametrize(
    ("name", "policy"),
    [("mlp", "p=f32,c=bf16,o=f32"), ("mlp", "p=f16,c=f16,o=f16"), ("transformer", "c=f16")],
)
def test_model_dtype_flow(name, policy):
    data = make_data(
        "teacher" if name == "mlp" else "markov", **({} if name == "mlp" else {"seq_len": 8})
    )
    model = make_model(
        name,
        **data.model_kwargs(),
        **({"width": 16} if name == "mlp" else {"d_model": 16, "heads": 2}),
    )
    pol = get_policy(policy)
    params = model.init(jax.random.PRNGKey(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
    batch = data.batch(0, 4)
    inputs = batch["x"] if name == "mlp" else batch["tokens"][:, :-1]
    logits, acts = jax.jit(lambda p, x: model.apply(p, x, pol, capture=True))(
        pol.cast_to_compute(params), inputs
    )
    assert logits.dtype == pol.output_dtype
    assert all(a.dtype == pol.compute_dtype for a in acts.values())
    shapes = model.activation_shapes(4, pol)
    assert set(shapes) == set(acts)
    for k, s in shapes.items():
        assert s.shape == acts[k].shape and s.dtype == acts[k].dtype
    loss, aux = jax.jit(model.loss_fn(pol))(params, batch)
    assert np.isfinite(float(loss)) and 0.0 <= float(aux["metric"]) <= 1.0


def test_transformer_is_causal():
    model = make_model("transformer", vocab_size=11, seq_len=6, d_model=16, heads=2)
    params = model.init(jax.random.PRNGKey(1))
    a = jnp.asarray([[1, 2, 3, 4, 5, 6]])
    b = a.at[0, 4].set(9)
    apply = jax.jit(model.apply)
    la, lb = apply(params, a), apply(params, b)
    np.testing.assert_array_equal(la[:, :4], lb[:, :4])
    assert not np.allclose(la[:, 4:], lb[:, 4:])


@pytest.mark.slow
def test_remat_same_gradients():
    kw = {"vocab_size": 11, "seq_len": 6, "d_model": 16, "heads": 2}
    m, r = make_model("transformer", **kw), make_model("transformer", remat=True, **kw)
    params = m.init(jax.random.PRNGKey(2))
    batch = {"tokens": jnp.asarray(np.random.default_rng(0).integers(0, 11, (3, 7)))}
    g1 = jax.jit(jax.grad(lambda p: m.loss_fn()(p, batch)[0]))(params)
    g2 = jax.jit(jax.grad(lambda p: r.loss_fn()(p, batch)[0]))(params)
    for x, y in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: make_model("cnn"), "unknown model 'cnn'"),
        (lambda: make_model("mlp", widht=3), "unknown option"),
        (lambda: make_model("mlp", depth=0), "depth"),
        (lambda: make_model("mlp", activation="swish"), "unknown activation"),
        (lambda: make_model("transformer", d_model=10, heads=3), "divisible"),
        (lambda: make_model("transformer", init_scale=-1.0), "init_scale"),
        (lambda: make_data("mnist"), "unknown dataset 'mnist'"),
        (lambda: make_data("markov", branching=100), "branching"),
        (lambda: make_data("teacher", label_noise=2.0), "label_noise"),
        (lambda: make_data("teacher").batch(0, 2, split="test"), "unknown split"),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    ("name", "kw"),
    [
        ("mlp", {"width": 3000, "depth": 3}),
        ("mlp", {"width": 3000, "depth": 3, "scan_layers": True, "use_layernorm": True}),
        ("transformer", {"d_model": 1024, "depth": 2, "heads": 4, "mlp": "swiglu"}),
        ("conv", {"width": 256, "depth": 3}),
    ],
)
def test_a_model_whose_params_exceed_the_machine_is_refused_when_made(name, kw, monkeypatch):
    """Oracle: the parameter count of the arrays ``init`` draws (float32, 4 bytes each)."""
    small = make_model(name, **{**kw, **({"width": 8} if "width" in kw else {"d_model": 16})})
    n_small = sum(a.size for a in jax.tree.leaves(small.init(jax.random.PRNGKey(0))))
    assert n_small == sum(int(np.prod(s.shape)) for s in jax.tree.leaves(small.param_shapes()))
    # the full size: counted from its shapes (nothing allocated), then refused on a machine
    # 1 byte short of holding them, accepted on one that just holds them
    n = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(make_model(name, **kw).param_shapes()))
    monkeypatch.setattr(_schema, "host_memory", lambda: 4 * n - 1)
    want = re.escape(
        f"model '{name}' ({n:,.4g} parameters) needs {4 * n / 2**30:,.4g} GiB in float32"
    )
    with pytest.raises(
        ValueError, match=want + ", more than the .* GiB of memory this machine has"
    ):
        make_model(name, **kw)
    monkeypatch.setattr(_schema, "host_memory", lambda: 4 * n)
    make_model(name, **kw)


def test_param_shapes_allocate_nothing(monkeypatch):
    """A width of 10^12 is described (10^24 parameters), not allocated; the machine check
    (off here) is what refuses it."""
    monkeypatch.setattr(_schema, "host_memory", lambda: None)
    shapes = make_model("mlp", width=10**12, depth=2).param_shapes()
    assert shapes["hidden"][1]["w"].shape == (10**12, 10**12)
    assert shapes["hidden"][1]["b"].shape == (10**12,)
    models = [
        ("mlp", {"scan_layers": True, "depth": 3, "use_layernorm": True}),
        ("transformer", {"scan_layers": True, "mlp": "swiglu"}),
        ("conv", {}),
    ]
    for name, kw in models:
        leaves = jax.tree.leaves(make_model(name, **kw).param_shapes())
        assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves), name


def test_data_sizes_no_machine_holds_or_no_run_waits_for_are_refused(monkeypatch):
    """The teacher's weights and probe (float64) against the machine's memory; the Markov
    table (one row per pair of tokens, drawn one by one) bounded by its vocabulary."""
    from precisionlab.train._data.synthetic import MAX_MARKOV_VOCAB, PROBE

    d, w, c = 100, 64, 10
    need = 8 * (d * w + w * c + PROBE * (d + w + c))
    monkeypatch.setattr(_schema, "host_memory", lambda: need - 1)
    with pytest.raises(ValueError, match=r"teacher data \(in_dim 100, teacher_width 64\) needs"):
        make_data("teacher", in_dim=d, teacher_width=w, num_classes=c)
    monkeypatch.setattr(_schema, "host_memory", lambda: need)
    make_data("teacher", in_dim=d, teacher_width=w, num_classes=c)
    monkeypatch.undo()
    # the bound never exceeds what making the data really holds at its peak (numpy's
    # allocations, traced), so no machine that could make it is told it cannot
    for d, w, c in [(100, 64, 10), (2000, 512, 10), (32, 2048, 100)]:
        tracemalloc.start()
        make_data("teacher", in_dim=d, teacher_width=w, num_classes=c)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert 8 * (d * w + w * c + PROBE * (d + w + c)) <= peak, (d, w, c)
    why = r"\(the order-2 table has a row for each pair of tokens, drawn one by one\)"
    with pytest.raises(ValueError, match=f"vocab_size must be an int <= {MAX_MARKOV_VOCAB} {why}"):
        make_data("markov", vocab_size=MAX_MARKOV_VOCAB + 1)
