"""The main job's report agrees with its results table (experiments/fp16_vs_bf16.toml, its own
settings, a few steps): fp16 without loss scaling loses its gradients to underflow, and the
range setting's fp16 variants overflow in GELU's cubic term, which the report names.

Oracles: the losses and skipped steps of the run itself (what the results table shows), and
float16's range: tanh-GELU computes x**3, and |x| ~ 2^8 pre-activations give 2^24 > 65504; the
loss-weighted (2^-16) gradients of the underflow setting are below 2^-24, float16's smallest
subnormal.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precisionlab.experiments import _report as report
from precisionlab.experiments import _runner as runner
from precisionlab.experiments import _store as store
from precisionlab.experiments import _telemetry_views as telemetry_views
from precisionlab.experiments._config import experiment_from_document
from precisionlab.telemetry import OPS, observe

MAIN = Path(__file__).parents[2] / "experiments" / "fp16_vs_bf16.toml"


def _main_job(variants: dict[str, list[str]], steps: int) -> dict:
    """The main job's document with only ``variants`` (name -> settings), ``steps`` steps
    and telemetry every step; everything else (model, data, settings) as the file has it."""
    doc = tomllib.loads(MAIN.read_text())
    doc["train"].update(steps=steps, eval_batches=1, hist_interval=0, checkpoint_interval=0)
    doc["train"]["telemetry"] = {"interval": 1, "targets": ["fp16"]}
    doc["variant"] = [
        {**v, "settings": variants[v["name"]]} for v in doc["variant"] if v["name"] in variants
    ]
    return doc


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):  # about 25 s of CPU: the tests using it are slow
    variants = {"fp16-noscale": ["underflow"], "fp16-static": ["range"], "fp16-dynamic": ["range"]}
    doc = _main_job(variants, steps=2)
    experiment = experiment_from_document(doc, str(MAIN))
    out = tmp_path_factory.mktemp("main") / "run"
    with store.locked_run(out) as previous:
        runner.run_locked(experiment, out, previous=previous, quiet=True)
    report.write_report(out)
    return out


def _unit(run_dir: Path, name: str) -> dict:
    units = store.read_json(run_dir / "summary.json")["variants"]
    return next(u for u in units if u["name"] == name)


@pytest.mark.slow
def test_fp16_noscale_report_shows_the_underflow(run_dir):
    unit = _unit(run_dir, "underflow/fp16-noscale")
    tel = unit["telemetry"]
    # the results table's underflow meter (zero, subnormal or inf/NaN in float16) reads 100%
    assert unit["mean_underflow_fraction"] == 1.0
    # telemetry agrees: every gradient the optimizer gets is zero or below float16's normal
    # range (2^-14), and most of some leaf is exactly zero
    rows = store.read_jsonl(run_dir / "variants" / unit["id"] / "telemetry.jsonl")
    grads = [r for r in rows if r["kind"] == "grad"]
    assert grads and all(r["amax"] is None or r["amax"] < 2.0**-14 for r in grads)
    zeros = tel["most_zeros"]
    assert zeros and zeros[0]["fraction"] >= 0.5 and zeros[0]["kind"] == "grad"
    text = (run_dir / "report.md").read_text()
    section = text.split("### underflow/fp16-noscale", 1)[1].split("### ", 1)[0]
    assert "Parameter gradients that are mostly zero" in section
    assert f"| {telemetry_views._label(zeros[0])} |" in section
    assert "telemetry_heatmap_" in section
    # the heatmap's first panel (zeros as computed) shows it: the gradient leaves at 100%
    heat_rows = [r for r in rows if r["kind"] in ("matmul", "op", "grad")]
    (title, zero_grid), *_ = telemetry_views._panels(heat_rows, tel["targets"])
    labels = list(dict.fromkeys(telemetry_views._label(r) for r in heat_rows))
    leaf = labels.index(telemetry_views._label(zeros[0]))
    assert "zero" in title and zero_grid[leaf].max() == zeros[0]["fraction"]
    # and some activation gradient is lost entirely (every element exactly zero)
    assert np.nanmax(zero_grid) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["range/fp16-static", "range/fp16-dynamic"])
def test_range_fp16_report_names_the_overflowing_operation(run_dir, name):
    unit = _unit(run_dir, name)
    assert unit["skipped_steps"] == 2  # every step skipped on inf/NaN gradients
    first = unit["telemetry"]["first_nonfinite"]
    # GELU's x**3 in the first hidden layer, in the forward pass, at step 1
    assert first["site"].startswith("integer_pow[") and first["layer"] == "layer0"
    assert first["tensor"] == "out" and not first["backward"] and first["step"] == 1
    assert first["n_inf"] > 0
    text = (run_dir / "report.md").read_text()
    section = text.split(f"### {name}", 1)[1].split("### ", 1)[0]
    assert f"First inf/NaN: step 1, forward pass, in `layer0:{first['site']}.out`" in section


def test_every_operation_that_can_overflow_is_observed_against_float16():
    """observe(ops=OPS) hands out the float16 x**3 of tanh-GELU as computed (numpy oracle:
    the same cube rounded to float16, inf where it overflows) and its cotangent, and the
    matmuls keep their names (numbered per primitive)."""

    def f(w, x):
        with jax.named_scope("layer0"):
            h = jax.nn.gelu(x @ w, approximate=True)
        return jnp.mean(jax.nn.log_softmax(h))

    w = jnp.asarray(np.linspace(-3, 3, 16).reshape(4, 4), jnp.float16) * 32  # |x @ w| to 77
    x = jnp.ones((2, 4), jnp.float16)
    obs = observe(f, (), ops=OPS)
    sites = obs.sites(w, x)
    names = [s.name for s in sites]
    assert names.count("dot_general[0]") == 1 and "integer_pow[0]" in names
    assert "exp[0]" in names and "reduce_sum[0]" in names
    cube_site = sites[names.index("integer_pow[0]")]
    assert cube_site.scope == "layer0"
    # the tensors themselves (one compiled program), not their statistics
    _, _, got = jax.jit(obs.value_and_grad(tensors=True))(w, x)
    z = np.asarray(x, np.float32) @ np.asarray(w, np.float32)  # exact: small integers x 2^k
    with np.errstate(over="ignore"):  # the overflow is the point
        cube = (z.astype(np.float16).astype(np.float64) ** 3).astype(np.float16)
    np.testing.assert_array_equal(np.asarray(got["integer_pow[0]"]["out"]), cube)
    assert np.isinf(cube).sum() == 4  # the two columns at |z| = 76.8: 4.5e5 > 65504
    assert set(got["dot_general[0]"]) == {"lhs", "rhs", "out", "grad"}
    assert set(got["integer_pow[0]"]) == {"out", "grad"}


def test_range_setting_names_gelus_cube_in_one_telemetry_step():
    """The default suite's cheap check of the range setting: one telemetry step of the main
    job's range/fp16-static unit (no training run), the first inf/NaN found in program order
    is GELU's x**3 output in layer0 (numpy oracle: its float16 pre-activations cubed)."""
    from precisionlab.train._compose import build
    from precisionlab.train._step import normalize_loss_fn, weighted_loss
    from precisionlab.train._telemetry import make_telemetry_fn, telemetry_rows

    doc = _main_job({"fp16-static": ["range"]}, steps=1)
    doc["train"]["batch_size"] = 16
    doc["train"]["telemetry"]["state"] = False  # the operations are what this test is about
    cfg = experiment_from_document(doc, str(MAIN)).units[0].config
    setup = build(cfg)
    tel = setup.options.telemetry
    loss_fn = weighted_loss(setup.loss_fn, {"loss_weight": cfg.loss_weight})
    fn = make_telemetry_fn(normalize_loss_fn(loss_fn), setup.policy, tel, dump=True)
    batch = next(iter(setup.data.batches(cfg.batch_size, seed=cfg.seed, start=0)))
    params = jax.tree.map(lambda p: p.astype(jnp.float32), setup.params)
    g32 = jax.tree.map(jnp.zeros_like, params)
    out = jax.device_get(
        jax.jit(fn)(
            params, setup.optimizer.init(params), setup.options.loss_scale, g32, batch,
            jnp.int32(0),
        )
    )  # fmt: skip
    rows = telemetry_rows(out, fn.names, 1, tel.targets)
    first = telemetry_views._first_nonfinite(rows)
    assert first["layer"] == "layer0" and first["site"].startswith("integer_pow[")
    assert first["tensor"] == "out" and not first["backward"] and "gelu" in first["where"]
    # oracle: the dumped pre-activation of layer 0 (the first matmul's output, float16),
    # cubed in float16 by numpy, overflows exactly where telemetry counted inf
    names = fn.names["matmul"]
    pre = next(
        x for (site, t, _), x in zip(names, out["tensors"]["matmul"], strict=True)
        if site == "dot_general[0]" and t == "out"
    )  # fmt: skip
    b = np.asarray(params["hidden"][0]["b"], np.float16)
    z = (np.asarray(pre, np.float16) + b).astype(np.float16)
    with np.errstate(over="ignore"):
        cube = (z.astype(np.float32) ** 3).astype(np.float16)
    assert first["n_inf"] == int(np.isinf(cube).sum()) > 0
