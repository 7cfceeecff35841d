"""Smoke test of `precisionlab bench quant`: structure only, no timing assertions."""

import json

from precisionlab.bench import _quant as bench_quant
from precisionlab.cli import main


def test_measure_structure():
    rows = bench_quant.measure(8, 256, 1, ["int8 per-channel", "mxfp4"])
    assert [r["case"] for r in rows] == ["int8 per-channel", "mxfp4"]
    for r in rows:
        assert r["elements"] == 2048 and r["fake_quant_ms"] > 0 and r["ratio"] > 0
        assert {"cpu_ratio", "amax_cpu_ms", "amax_ratio"} <= set(r)  # NaN if a CPU time is 0


def test_cli_json_and_bad_case(capsys):
    argv = ["bench", "quant", "--rows", "8", "--cols", "128", "--repeats", "1"]
    assert main([*argv, "--cases", "e4m3fn per-tensor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["case"] == "e4m3fn per-tensor"
    assert main([*argv, "--cases", "int3"]) == 2
    assert "unknown case 'int3'" in capsys.readouterr().err


def test_malloc_tuning_flag_applies_the_settings_first(capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(bench_quant, "apply_malloc_tuning", lambda: calls.append(1))
    argv = ["bench", "quant", "--rows", "8", "--cols", "64", "--repeats", "1"]
    assert main([*argv, "--cases", "int8 per-channel", "--malloc-tuning"]) == 0
    assert calls == [1] and "malloc tuning:" in capsys.readouterr().out
