"""Smoke test of ``precisionlab bench recipes`` on a tiny transformer (numbers not checked)."""

import json
import subprocess
import sys


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "precisionlab", "bench", "recipes", *args],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_bench_recipes_tiny_json():
    out = _run(
        "--recipes", "plain,bf16,current", "--layers", "1", "--d-model", "32", "--seq", "16",
        "--batch", "2", "--vocab", "32", "--heads", "2", "--repeats", "1", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    assert [r["recipe"] for r in rows] == ["plain", "bf16", "current"]
    # 7 matmuls, of which the two attention products stay in high precision by default
    assert rows[1]["vs_bf16"] == 1.0 and rows[2]["matmuls"] == 5
    assert all(r["peak_mib"] > 0 for r in rows)


def test_bench_recipes_bad_recipe_is_one_line_error():
    out = _run("--recipes", "fp9")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("precisionlab bench: error: unknown")
    assert "Traceback" not in out.stderr


def test_bench_recipes_cache_flags_are_one_line_errors(tmp_path):
    both = _run("--recipes", "bf16", "--no-cache", "--cache-dir", str(tmp_path))
    assert both.returncode == 2 and "Traceback" not in both.stderr
    assert both.stderr.strip().splitlines()[-1] == (
        "precisionlab bench: error: give either --cache-dir DIR or --no-cache, not both"
    )
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache directory would go
    bad = _run("--recipes", "bf16", "--cache-dir", str(blocked / "cache"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "compilation cache directory" in bad.stderr.strip().splitlines()[-1]
