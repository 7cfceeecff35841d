"""Smoke test of ``precisionlab bench overhead`` on a tiny transformer (numbers not checked:
performance is measured by the bench, never by timed tests)."""

import json
import subprocess
import sys

import pytest


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "precisionlab", "bench", "overhead", *args],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.slow  # ~12 CPU s: a fresh process compiles the plain and the every(10) step
def test_bench_overhead_tiny_json():
    out = _run(
        "--variants", "every10-skip", "--layers", "1", "--d-model", "16", "--seq", "8",
        "--batch", "2", "--vocab", "16", "--heads", "2", "--steps", "2", "--repeats", "1",
        "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert set(res["ms_per_step"]) == {"fp32", "every10-skip"}  # the reference is added
    assert set(res["ratios"]) == {"every10-skip"} and res["ratios"]["every10-skip"] > 0
    assert res["targets"]["every10-skip"] == {"vs": "fp32", "max": 1.1}


def test_bench_overhead_bad_variant_is_one_line_error():
    out = _run("--variants", "fp9")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("precisionlab bench: error: --variants: unknown 'fp9'"), last


def test_bench_overhead_bad_target_is_one_line_error():
    out = _run("--targets", "fp16,fp9")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("precisionlab bench: error: --targets: telemetry target 'fp9'"), last
