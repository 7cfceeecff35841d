"""Reports people read (issue 10): a generated interpretation, curves that stay visible when
they coincide, explicit marks for a loss scale that collapsed to 0, the GELU cubic term in the
activation histograms, and readable output of the other kinds."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precisionlab.experiments import _plots as plots
from precisionlab.experiments import _report as report
from precisionlab.mixed import get_policy
from precisionlab.train import make_model


def _unit(setting, variant, **kw):
    base = {
        "id": f"{setting}-{variant}", "name": f"{setting}/{variant}", "setting": setting,
        "variant": variant, "seed": 0, "status": "finished", "steps": 300, "eval_loss": 0.88,
        "skipped_steps": 0, "diverged": False, "divergence_step": None, "min_loss_scale": 1.0,
        "mean_underflow_fraction": 0.0,
    }  # fmt: skip
    base.update(kw)
    return base


def test_interpretation_names_what_diverged_when_and_the_evidence():
    summary = {
        "variants": [
            _unit("range", "fp32", eval_loss=1.321),
            _unit("range", "bf16", eval_loss=1.326),
            _unit("range", "fp16-noscale", diverged=True, divergence_step=2, eval_loss=None),
            _unit("range", "fp16-dynamic", skipped_steps=300, min_loss_scale=0.0,
                  eval_loss=70.82, mean_underflow_fraction=0.969),
            _unit("underflow", "fp32"),
            _unit("underflow", "fp16-noscale", eval_loss=1.806, mean_underflow_fraction=1.0),
        ]
    }  # fmt: skip
    lines = report.interpret(summary)
    text = "\n".join(lines)
    assert lines[0].startswith("- **range**: bf16 matches fp32")
    assert "fp16-noscale: diverged at step 2" in text
    assert "fp16-dynamic: skipped 300 of 300 steps" in text
    assert "loss scale collapsed to 0" in text
    assert "eval loss 70.82 against fp32's 1.321" in text
    assert "underflow meter 100% (reference 0%); eval loss 1.806 against fp32's 0.88" in text


def _curve_unit(variant, values, key="loss", scale="none"):
    rows = [{"step": i + 1, key: v} for i, v in enumerate(values)]
    summary = _unit("", variant, loss_scale=scale)
    return {"summary": summary, "metrics": rows, "hist": []}


def _labels_of(monkeypatch, tmp_path, units, key, **kw):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert plots._plot_curves(units, key, tmp_path / "p.png", what="w", ylabel="y", **kw)
    (fig,) = figures
    return [t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()], fig


def test_identical_curves_are_named_and_styled_apart(monkeypatch, tmp_path):
    a = list(np.linspace(2.0, 1.0, 40))
    units = [_curve_unit("fp32", a), _curve_unit("fp16-static", [x + 1 for x in a]),
             _curve_unit("fp16-dynamic", [x + 1 for x in a]), _curve_unit("bf16", a)]  # fmt: skip
    labels, fig = _labels_of(monkeypatch, tmp_path, units, "loss", log="no")
    assert labels == ["fp32", "fp16-static", "fp16-dynamic (= fp16-static)", "bf16 (= fp32)"]
    lines = fig.axes[0].get_lines()
    styles = {(ln.get_linestyle(), ln.get_marker()) for ln in lines[1:]}
    assert len(styles) == 3  # each non-reference variant drawn its own way


def test_a_zero_loss_scale_is_marked_not_drawn_at_2_to_the_minus_150(monkeypatch, tmp_path):
    scales = [2.0**16 / 2**i for i in range(20)] + [0.0] * 10
    units = [_curve_unit("fp16-dynamic", scales, key="loss_scale", scale="dynamic")]
    labels, fig = _labels_of(
        monkeypatch, tmp_path, units, "loss_scale", transform=np.log2, log="no", smooth=False,
        mark_zero=True,
    )  # fmt: skip
    assert "fp16-dynamic: loss scale 0 (10 steps)" in labels
    ys = np.concatenate([ln.get_ydata() for ln in fig.axes[0].get_lines()])
    assert np.nanmin(ys) > -10  # nothing drawn near log2(1e-45) = -149.5


def test_gelu_cubic_term_is_captured_and_overflows_in_fp16():
    model = make_model("mlp", in_dim=4, num_classes=3, width=8, depth=1, activation="gelu")
    params = model.init(jax.random.PRNGKey(0))
    x = jnp.full((2, 4), 100.0)
    for policy, finite in (("f32", True), ("p=f32,c=f16,o=f32", False)):
        pol = get_policy(policy)
        _, acts = model.apply(pol.cast_to_compute(params), x, pol, capture=True)
        pre, cubic = acts["layer0/pre"], acts["layer0/gelu_cubic"]
        assert cubic.dtype == pol.compute_dtype
        big = np.abs(np.asarray(pre, np.float64)) > 41  # 41**3 > 65504
        assert big.any()
        assert bool(np.isfinite(np.asarray(cubic))[big].all()) == finite


def test_memory_report_is_readable(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"resolved": {}}))
    (run / "summary.json").write_text(json.dumps({
        "kind": "memory", "name": "memory", "status": "finished",
        "result": {"sqrt_n_layers": 9.797958971132712, "best_k_full": 4},
    }))  # fmt: skip
    (run / "memory").mkdir()
    (run / "memory" / "checkpoint_interval.png").write_bytes(b"")
    path, table = report.write_report(run)
    text = path.read_text()
    assert text.startswith("# memory\n")
    assert "9.798" in table and "9.79795" not in table
    assert "Estimated activation memory against the checkpoint interval K" in text


@pytest.mark.parametrize(("value", "shown"), [(9.797958971132712, "9.798"), (4, "4"), ("a", "a")])
def test_short_values(value, shown):
    assert report._short(value) == shown
