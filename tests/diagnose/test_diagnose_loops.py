"""Layers stacked under scan (``scan_layers``, ``remat_every``) in training telemetry and in
``precisionlab diagnose``: per-layer rows and captures equal the unrolled model's."""

import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest

from precisionlab import diagnose as d
from precisionlab.cli import main
from precisionlab.train import TrainConfig, train

ROOT = Path(__file__).resolve().parents[2]
FP16 = str(ROOT / "experiments" / "fp16_vs_bf16.toml")
BROKEN = str(ROOT / "experiments" / "broken_layer.toml")


def _by_layer(rows: list[dict]) -> dict[tuple, dict]:
    """Matmul rows keyed by (layer, k-th site of the layer, tensor): the site names differ
    between scanned and unrolled models (one site serves every stacked layer)."""
    sites: dict[str, list[str]] = {}
    out = {}
    for r in rows:
        if r["kind"] != "matmul":
            continue
        seen = sites.setdefault(r["layer"], [])
        if r["site"] not in seen:
            seen.append(r["site"])
        out[(r["layer"], seen.index(r["site"]), r["tensor"])] = r
    return out


@pytest.mark.slow  # three training runs' compiles
def test_scan_layers_telemetry_rows_equal_the_unrolled_rows():
    base = dict(
        model="mlp", model_kwargs={"width": 16, "depth": 5, "activation": "tanh"},
        loss_weight=2.0**-16, batch_size=16, steps=1, progress=False,
        telemetry={"interval": 1, "targets": ["fp16", "e4m3:tensor"], "state": False},
    )  # fmt: skip
    runs = {}
    for name, kw in (
        ("unrolled", {}),
        ("scan", {"scan_layers": True}),
        ("remat", {"scan_layers": True, "remat_every": 3}),  # groups of 3 + a rest of 1
    ):
        rows = train(TrainConfig(**base, **kw), quiet=True).metrics[0]["telemetry"]
        runs[name] = _by_layer(rows)
    ref = runs["unrolled"]
    layers = sorted({k[0] for k in ref})
    assert layers == ["layer0", "layer1", "layer2", "layer3", "layer4", "out"]
    for name in ("scan", "remat"):
        got = runs[name]
        assert sorted(got) == sorted(ref), name
        for k, a in ref.items():
            b = got[k]
            # XLA may order a reduction differently inside a loop body: counts must agree,
            # floating sums to float32 rounding (they are exact here on CPU in practice)
            for key in ("n", "n_zero", "n_nonzero", "n_nan", "n_inf"):
                assert a[key] == b[key], (name, k, key)
            for key in ("amax", "amin_nonzero", "mean", "std"):
                np.testing.assert_allclose(b[key], a[key], rtol=1e-5, err_msg=f"{name} {k}")
            for t, st in a["targets"].items():
                for key in ("overflow", "underflow", "subnormal"):
                    assert abs(st[key] - b["targets"][t][key]) <= 1 / a["n"], (name, k, t, key)
    assert any(r["targets"]["fp16"]["underflow"] > 0.1 for r in ref.values())  # not vacuous


@pytest.mark.slow  # two compares of two variants
def test_compare_on_scan_layers_finds_the_same_break_as_unrolled():
    results = {}
    for scan in ([], ["train.scan_layers=true", "train.remat_every=2"]):
        sets = ["train.steps=2", "train.model_kwargs.depth=5", *scan]
        _, (a, b) = d.load_units(FP16, ["underflow/fp32", "underflow/fp16-noscale"], sets)
        results[bool(scan)] = d.compare(a, b, d.CompareOptions(steps=1))
    u, s = results[False], results[True]
    assert u.first is not None and s.first is not None
    assert (s.first.step, s.first.layer, s.first.kind) == (u.first.step, u.first.layer, "grad")
    assert s.first.rel == pytest.approx(u.first.rel, rel=1e-5)
    assert sorted(s.grad_underflow) == sorted(u.grad_underflow)
    assert len(u.grad_underflow) == 6  # layer0..layer4, out: every stacked layer is seen
    for layer, frac in u.grad_underflow.items():
        assert s.grad_underflow[layer] == pytest.approx(frac, abs=1e-6)


def test_bisect_refuses_stacked_layers_in_one_line(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = main(
            ["diagnose", FP16, "--bisect", "underflow/fp16-noscale", "underflow/fp32",
             "--set", "train.scan_layers=true", "--out", str(tmp_path / "r")]
        )  # fmt: skip
    lines = err.getvalue().strip().splitlines()
    assert status == 2 and len(lines) == 1
    assert "scan_layers" in lines[0] and "--set train.scan_layers=false" in lines[0]
