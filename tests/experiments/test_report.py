"""Reports and comparisons of run directories (built with a stand-in trainer: no training)."""

from __future__ import annotations

import math

import matplotlib.image
import pytest

from precisionlab.cli import main
from precisionlab.experiments import _compare as compare
from precisionlab.experiments import _report as report
from precisionlab.experiments import _runner as runner
from precisionlab.experiments import _store as store
from precisionlab.experiments import _train_kind as train_kind

EXP = """
kind = "train"
name = "rep"
description = "A report test."
seeds = [0, 1]
[train]
model = "mlp"
steps = 40
[settings.one]
[settings.two]
lr = 0.1
[[variant]]
name = "fp32"
[[variant]]
name = "fp16-dynamic"
policy = "p=f32,c=f16,o=f32"
loss_scale = "dynamic"
[[variant]]
name = "broken"
settings = ["two"]
"""

EDGES = list(range(-64, 33))


def fake_run_unit(
    cfg, unit_dir, *, on_step, on_hist, resume, quiet, label, hooks=(), on_telemetry=None
):
    if "broken" in label:
        raise ValueError("broken on purpose")
    params = cfg.to_dict()
    scaled = params["loss_scale"] != "none"
    for step in range(1, params["steps"] + 1):
        scale = 2.0**16 / 2 ** (step // 10) if scaled else 1.0
        on_step(
            {
                "step": step,
                "loss": 2.5 * math.exp(-step / (10 + params["seed"])),
                "loss_scale": scale,
                "skipped": scaled and step % 10 == 0,
                "underflow_fraction": 0.3 if scaled else 0.01,
            }
        )
        if step % 20 == 0:
            counts = [0] * 96
            counts[64 - 20] = 100
            counts[64 - 10] = 50
            hist = {"edges": EDGES, "counts": counts, "zeros": 5, "nonfinite": 0}
            on_hist({"step": step, "grad_hist": hist, "act_hist": hist})
    return {"eval_loss": 0.5, "eval_metric": 0.9 - 0.1 * params["seed"], "diverged": False}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr(train_kind, "run_unit", fake_run_unit)
    mp.setattr(train_kind, "precompile", lambda cfg: None)  # nothing to compile
    try:
        tmp = tmp_path_factory.mktemp("rep")
        path = tmp / "rep.toml"
        path.write_text(EXP)
        yield runner.run_file(path, out=tmp / "run", quiet=True)
    finally:
        mp.undo()


def test_summary_has_groups_with_mean_and_std(run_dir):
    summary = store.read_json(run_dir / "summary.json")
    assert len(summary["variants"]) == 10  # 2 settings x 2 variants x 2 seeds + broken x 2
    groups = {g["group"]: g for g in summary["groups"]}
    g = groups["one/fp32"]
    assert g["n"] == 2 and g["seeds"] == [0, 1]
    assert math.isclose(g["eval_metric_mean"], 0.85)
    assert math.isclose(g["eval_metric_std"], math.sqrt(2) * 0.05)  # sample std of 0.9, 0.8
    assert groups["two/broken"]["failed"] == 2


def test_report_md_table_and_plots(run_dir):
    path, table = report.write_report(run_dir)
    text = path.read_text()
    assert text.startswith("# rep") and "A report test." in text
    for header in report.headers():
        assert header in table and header in text
    assert "one/fp32 s0" in table and "one/fp32 (mean+-std, n=2)" in table
    assert "85.0%+-7.1%" in table  # eval accuracy of the group
    assert "broken on purpose" in text and "error.log" in text
    assert "2^16" in table and "2^12" in table  # loss-scale extremes as powers of two
    for name in ("loss", "loss_scale", "skipped", "underflow", "hist_grad", "hist_act"):
        png = run_dir / "plots" / f"{name}.png"
        assert f"plots/{name}.png" in text
        image = matplotlib.image.imread(png)
        assert image.shape[0] > 300 and image.shape[1] > 600
    assert "## Environment" in text and "jaxlib" in text


def test_text_table_aligns_columns():
    rows = [["a", "1.5", "x"], ["long name", "10", "yy"]]
    lines = report.text_table(rows, ["name", "v", "w"]).splitlines()
    assert len({len(line) for line in lines}) == 1
    assert lines[2].startswith("a         ") and lines[3].endswith("yy")


@pytest.mark.parametrize(
    ("value", "how", "text"),
    [
        (65536.0, "pow2", "2^16"),
        (1.0, "pow2", "2^0"),
        (3.0, "pow2", "3"),
        (0.0, "pow2", "0"),
        (0.25, "pct", "25.0%"),
        (float("nan"), "g4", "nan"),
        (None, "g4", "-"),
        (1.23456, "g4", "1.235"),
    ],
)
def test_cell_formats(value, how, text):
    assert report._fmt(value, how, {}) == text


def test_compare_side_by_side(run_dir, tmp_path):
    headers, rows, _ = compare.compare_runs([run_dir, run_dir])
    assert headers[0] == "variant" and len(headers) == 1 + 2 * len(compare.COLUMNS)
    assert len(rows) == 10 and rows[0][0] == "one/fp32 s0"
    assert rows[0][1:5] == rows[0][5:9]  # the same run twice reads the same
    # ... and each cell is that variant's summary value, in its column.
    units = {u["name"]: u for u in store.read_json(run_dir / "summary.json")["variants"]}
    for row in rows:
        unit = units[row[0]]
        for cell, (_, key, how) in zip(row[1:5], compare.COLUMNS, strict=True):
            assert cell == report._fmt(unit.get(key), how, unit), (row[0], key)
    assert rows[0][1] == f"{units[rows[0][0]]['final_loss']:.4g}"
    _, _, md = compare.compare_runs([run_dir], markdown=True)
    assert md.startswith("| variant |")
    with pytest.raises(ValueError, match=r"no summary\.json"):
        compare.compare_runs([tmp_path])


def test_cli_report_and_compare(run_dir, tmp_path, capsys):
    # The run has failed ("broken") variants: report exits 1 like run (issue 10).
    assert main(["report", str(run_dir), "--no-plots"]) == 1
    out, err = capsys.readouterr()
    assert "one/fp32 s0" in out and "report.md" in out and "2 variant(s) failed" in err
    assert main(["compare", str(run_dir), str(run_dir)]) == 0
    out = capsys.readouterr().out  # wider than 100 columns as run:loss ...: labelled A, B
    assert "A:loss" in out and "A: run\nB: run'" in out
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a run directory" in err
    assert main(["compare", str(tmp_path)]) == 2
    assert "no summary.json" in capsys.readouterr().err
