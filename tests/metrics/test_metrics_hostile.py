"""Non-finite inputs: error metrics are NaN, never perfect; survey of an all-NaN input."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from _tiny_runs import workdir


@pytest.fixture
def work(tmp_path, monkeypatch):
    return workdir(tmp_path, monkeypatch, {})


# --- numerics (W1, W6, W8) --------------------------------------------------------------------
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_w1_metrics_of_non_finite_input_are_nan_not_perfect(value):
    from precisionlab.metrics import error_report

    x = jnp.full((64,), value, jnp.float32)
    d = error_report(x, x, "bf16").to_dict()
    assert d["n_nonfinite"] == 64
    for key in ("sqnr_db", "rmse", "max_abs_error", "mean_abs_error", "bias", "mean_ulp_error"):
        assert np.isnan(d[key]), (key, d[key])
    mixed = jnp.arange(64, dtype=jnp.float32).at[5].set(value)  # one compile for the file
    m = error_report(mixed, mixed, "bf16").to_dict()
    assert m["n_nonfinite"] == 1 and m["sqnr_db"] == np.inf and m["rmse"] == 0.0


def test_w1_survey_of_an_all_nan_input(work, cli):
    np.save(work / "bad.npy", np.full((256,), np.nan, np.float32))
    out, _ = cli(["survey", "--input", "bad.npy", "--formats", "int8"], status=0)
    assert "input bad (256; 256 not finite, left out of the errors)" in out
    for line in out.splitlines()[3:4]:  # no SQNR (was inf), no rmse (was 0)
        assert line.split()[3:5] == ["-", "-"], line
