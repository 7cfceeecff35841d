"""The ``memory`` experiment kind: validation, rows, summary, plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from precisionlab.memory import _experiment as experiment

ROOT = Path(__file__).resolve().parents[2]


def test_validate_fills_defaults():
    out = experiment.validate({}, "f.toml: memory")
    assert out == experiment.DEFAULTS
    assert out is not experiment.DEFAULTS


@pytest.mark.parametrize(
    ("section", "match"),
    [
        (
            {"presets": "gpt3-xl"},
            r"memory: unknown key 'presets'; did you mean 'preset'\? allowed keys: preset",
        ),
        ({"preset": "gpt3-9b"}, r"memory.preset: unknown preset 'gpt3-9b'"),
        ({"policies": ["p=f32,c=f12"]}, r"memory.policies\[0\]: .*f12"),
        ({"policies": []}, "at least one"),
        ({"batch": "8"}, r"memory.batch: expected int, got str"),
        ({"batch": True}, r"memory.batch: expected int, got bool"),
        ({"batch": 0}, r"memory.batch: must be an int >= 1 and <= 16777216, got 0"),
        ({"policies": "bf16"}, r"memory.policies: expected list of str"),
        ({"optimizer": "adagrad"}, r"memory.optimizer: unknown optimizer 'adagrad'"),
        ({"preset": "gpt3-small", "checkpoint_intervals": [13]}, r"in 1..12, got 13"),
        ({"seq": -1}, "memory.seq"),
        ({"measure_microbatches": [3]}, r"measure_microbatches\[0\]: .*dividing"),
    ],
)
def test_validate_errors_name_the_key(section, match):
    with pytest.raises(ValueError, match=match):
        experiment.validate(section, "f.toml: memory")


def test_run_writes_rows_summary_and_plots(tmp_path):
    section = {
        "preset": "gpt3-small",
        "policies": ["f32", "p=f32,c=f16", "bf16"],
        "measure_layers": 4,
        "measure_d_model": 16,
        "measure_batch": 32,
    }
    summary = experiment.run(section, tmp_path, quiet=True)
    assert summary["bytes_per_param"] == {"f32": 16.0, "p=f32,c=f16": 16.0, "bf16": 8.0}
    assert summary["best_k_boundary"] in (math.floor(math.sqrt(12)), math.ceil(math.sqrt(12)))
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    sweeps = [r["sweep"] for r in rows]
    assert sweeps.count("policy") == 3
    assert sweeps.count("checkpoint") == 12
    assert sweeps.count("measured_checkpoint") == 4  # no checkpointing, K = 1, 2, 4
    assert sweeps.count("measured_microbatches") == 2  # M = 2, 4
    for r in rows:
        if r["sweep"].startswith("measured"):
            assert r["estimated_arguments"] == r["measured_arguments"]
            assert r["step_s"] > 0 and r["flops"] > 0
    assert json.loads((tmp_path / "memory.json").read_text()) == summary
    for name in ("bytes_per_param.png", "checkpoint_interval.png", "measured_checkpoint.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_without_measure_or_plots(tmp_path):
    summary = experiment.run(
        {"preset": "gpt3-xl", "measure": False, "plots": False, "checkpoint_intervals": [1, 4]},
        tmp_path,
        quiet=True,
    )
    assert summary["measured"] == [] and summary["measured_best_k"] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory.json", "rows.jsonl"]


def test_the_shipped_config_validates():
    from precisionlab.experiments._config import load_experiment

    exp = load_experiment(ROOT / "experiments" / "memory.toml")
    assert exp.kind == "memory"
    assert exp.resolved["memory"]["preset"] == "gpt3-175b"
