"""The report's reading of a run: the divergence step beside the first inf/NaN, inf/NaN apart from
underflow, what-if figures labelled as such."""

from __future__ import annotations


def _summary_with(**unit) -> dict:
    ref = {"id": "00-fp32", "name": "range/fp32", "setting": "range", "variant": "fp32",
           "status": "finished", "eval_loss": 1.3, "steps": 300}  # fmt: skip
    return {"kind": "train", "variants": [ref, {**ref, "id": "01-x", "name": "range/x",
                                                "variant": "x", **unit}]}  # fmt: skip


def test_the_divergence_step_and_the_first_inf_nan_are_explained_side_by_side():
    """Why: telemetry's first inf/NaN at step 1 sat beside "diverged@ 2" in the table with
    nothing explaining why they differ."""
    from precisionlab.experiments._report import interpret

    first = {"kind": "op", "layer": "layer0", "site": "integer_pow[0]", "tensor": "out",
             "step": 1, "n_inf": 5, "n_nan": 0, "n": 8, "backward": False}  # fmt: skip
    text = "\n".join(interpret(_summary_with(
        diverged=True, divergence_step=2, eval_loss=float("nan"),
        telemetry={"steps": [1], "targets": [], "first_nonfinite": first},
    )))  # fmt: skip
    assert "diverged at step 2; inf/NaN first appeared inside step 1 (forward pass, " in text
    assert "`layer0:integer_pow[0].out`) while that step's loss stayed finite" in text


def test_the_meters_separate_inf_nan_from_underflow():
    """Why: an "underflow meter 83%" that was mostly NaNs. The train step's meters count zeros
    and subnormals (underflow_fraction) apart from inf/NaN (nonfinite_fraction), and the
    report says each."""
    import jax.numpy as jnp

    from precisionlab.experiments._report import interpret
    from precisionlab.train import nonfinite_fraction, underflow_fraction

    g = {"w": jnp.array([jnp.nan, jnp.inf, 0.0, 1e-6, 1.0, 2.0, jnp.nan, 3.0])}
    assert float(underflow_fraction(g, jnp.float16, nonfinite=False)) == 2 / 8  # 0 and 1e-6
    assert float(nonfinite_fraction(g)) == 3 / 8
    assert float(underflow_fraction(g, jnp.float16)) == 5 / 8  # the combined count, as before
    text = "\n".join(interpret(_summary_with(
        mean_underflow_fraction=0.1, mean_nonfinite_fraction=0.75, eval_loss=9.0,
    )))  # fmt: skip
    assert "inf/NaN in 75% of gradient elements" in text and "underflow meter" not in text


def test_what_if_figures_say_they_are_what_ifs(tmp_path):
    """Why: fp16-dynamic listed a what-if fp16 overflow of 100% with no step skipped, without
    saying the figure is what the target format would do, not what the run did."""
    from precisionlab.experiments._telemetry_views import telemetry_report

    entry = {"kind": "op", "layer": "mul[3]", "tensor": "grad", "target": "fp16",
             "fraction": 1.0, "step": 1}  # fmt: skip
    unit = {"id": "00-x", "name": "x", "telemetry": {
        "steps": [1], "targets": ["fp16"], "worst_underflow": [], "worst_overflow": [entry],
    }}  # fmt: skip
    text = "\n".join(telemetry_report(tmp_path, [unit], None))
    assert "What-if overflow: had the tensor been stored in the target format" in text
    assert "What-if: no finite nonzero value would underflow" in text
