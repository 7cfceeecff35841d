"""tools/consistency_gpu.py (the device script: not run on a GPU yet) imports, refuses to run
without a GPU unless asked for its CPU path, and its CPU path writes its two files."""

import importlib.util
import json
import pathlib

import pytest

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "consistency_gpu.py"


def _tool():
    spec = importlib.util.spec_from_file_location("consistency_gpu", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_tool_refuses_a_cpu_without_its_check_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        _tool().main(["--out", str(tmp_path)])
    assert err.value.code == 2 and "no GPU" in capsys.readouterr().err


def test_its_order_probes_run_here():
    # the cheap part of the CPU path in the default suite; the whole path runs under -m slow
    import argparse

    rows = _tool().orders(argparse.Namespace(cpu_check=True))
    assert rows[0]["text"] and rows[0]["probes"] < 16 * 15 // 2
    assert rows[1]["h100_xla_model"].startswith(("matches", "differs"))


@pytest.mark.slow  # trains a tiny model and compiles ~20 programs (~15 CPU s)
def test_the_cpu_path_writes_its_results(tmp_path):
    assert _tool().main(["--cpu-check", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "consistency_gpu.json").read_text())
    assert res["environment"]["backend"] == "cpu"
    assert {r["dtype"] for r in res["invariance"]["gemm"]} == {"float32", "bfloat16", "float16"}
    assert all(p["verdict"] == "unknown" for p in res["invariance"]["predicted"])
    assert [o["op"] for o in res["orders"]] == ["sum", "dot"] and res["orders"][0]["probes"]
    assert res["gaps"]["pairs"][0]["a"] == "bf16 native full"
    assert 0 <= res["gaps"]["emulated_vs_device"][0]["logits_bitwise_equal"] <= 1
    assert "# consistency_gpu on" in (tmp_path / "consistency_gpu.md").read_text()
