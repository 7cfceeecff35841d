"""What the command line says: its version, no internal issue numbers in user-facing strings,
result tables within 100 columns."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from precisionlab import __version__
from precisionlab.cli import main
from precisionlab.experiments import _compare as compare
from precisionlab.experiments import _store as store

PACKAGE = Path(__file__).parents[2] / "precisionlab"


# --- --version, missing libraries ----------------------------------------------------------
def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"precisionlab {__version__}"


# --- compare fits 100 columns --------------------------------------------------------------
def _fake_run(path: Path, names: list[str], loss: float) -> Path:
    units = [
        {"id": f"{i:02d}-v{i}", "name": n, "status": "finished", "final_loss": loss + i,
         "eval_metric": 0.5, "skipped_steps": 3, "diverged": False, "divergence_step": None}
        for i, n in enumerate(names)
    ]  # fmt: skip
    path.mkdir(parents=True)
    store.write_json(path / "summary.json", {"kind": "train", "variants": units})
    return path


def test_compare_table_fits_100_columns(tmp_path, capsys):
    names = ["underflow/fp16-noscale s0", "range/fp16-dynamic s0", "swamping/bf16-pure-nearest s0"]
    dirs = [
        _fake_run(tmp_path / f"fp16_vs_bf16-20261126-2015{i:02d}-quick-check", names, float(i))
        for i in range(4)
    ]
    headers, _, text = compare.compare_runs(dirs)
    assert len(headers) == 1 + 4 * len(compare.COLUMNS)  # the data is all there
    assert max(map(len, text.splitlines())) <= compare.WIDTH
    for i, d in enumerate(dirs):  # each run is labelled in a legend, and its losses shown
        letter = "ABCD"[i]
        assert f"{letter}: {d.name}" in text and f"{letter}:loss" in text
        for k in range(len(names)):
            assert re.search(rf"\b{float(i + k):.4g}\b", text)
    assert main(["compare", *map(str, dirs)]) == 0
    assert max(map(len, capsys.readouterr().out.splitlines())) <= compare.WIDTH


# --- no internal issue numbers in user-facing text -----------------------------------------
def test_no_internal_issue_numbers_in_user_facing_strings():
    """String literals (messages, docstrings, printed text) of the package never say "issue N"
    (an internal tracker number means nothing to a user); references to other projects'
    trackers ("ml_dtypes issue #298") are fine."""
    pattern = re.compile(r"\bissues? \d", re.IGNORECASE)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if pattern.search(node.value):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, found


def test_results_table_fits_100_columns():
    """The summary table `run` and `report` print: split into column groups that fit, each
    repeating the variant column, every header and cell kept."""
    from precisionlab.experiments._report import WIDTH, fitted_table, headers

    heads = headers()
    cols = range(len(heads) - 2)
    rows = [
        [f"swamping/bf16-pure-stochastic s{i}", "finished", *(f"{i}.{k:04d}" for k in cols)]
        for i in range(3)
    ]
    text = fitted_table(rows, heads)
    assert max(map(len, text.splitlines())) <= WIDTH
    blocks = text.split("\n\n")
    assert len(blocks) >= 2 and all(b.startswith("variant") for b in blocks)
    for h in heads:
        assert h in text
    for row in rows:
        for cell in row:
            assert cell in text


def test_bench_telemetry_table_fits_100_columns():
    from precisionlab.bench._telemetry import render

    ms = {"a-plain": 128.4, "b-telemetry": 216.8, "c-no-targets": 170.4, "d-matmuls-only": 180.0}
    model = {"model": "transformer", "params": 107776, "ms_per_step": ms,
             "ratios": {"b/a": 1.69, "c/a": 1.33, "d/a": 1.40}}  # fmt: skip
    result = {"interval": 10, "targets": ["fp16", "bf16", "e4m3:tensor"], "batch": 128,
              "backend": "cpu", "repeats": 7, "steps_per_round": 40, "models": [model],
              "target_met": {"transformer": False}}  # fmt: skip
    text = render(result)
    assert max(map(len, text.splitlines())) <= 100
    assert "transformer (108k)" in text and "216.800" in text and "NOT met" in text
