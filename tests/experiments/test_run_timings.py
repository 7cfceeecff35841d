"""``precisionlab run --timings`` and the persistent compilation cache of runs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from precisionlab.cli import main
from precisionlab.train._compile_cache import enable_compilation_cache

TINY = """
kind = "train"
name = "tiny"
[train]
model = "mlp"
data = "teacher"
steps = 6
batch_size = 8
eval_batches = 1
hist_interval = 3
telemetry = { enabled = false }
model_kwargs = { width = 8, depth = 1 }
[[variant]]
name = "fp32"
"""


def test_run_timings_writes_a_table_per_variant(tmp_path, capsys, no_compile_cache):
    exp = tmp_path / "tiny.toml"
    exp.write_text(TINY)
    out = tmp_path / "run"
    assert main(["run", str(exp), "--out", str(out), "--timings", "--no-cache", "--quiet"]) == 0
    doc = json.loads((out / "timings.json").read_text())
    (unit,) = doc["units"].values()
    loop = unit["loop"]
    assert unit["name"] == "fp32" and unit["wall_s"] > 0 and unit["cpu_s"] > 0
    assert loop["chunk_steps"] == 3 and loop["calls"] == 2 and loop["first_call_steps"] == 3
    # one fetch per call, one per histogram probe (steps 0 and 3), one evaluation at the end
    assert loop["host_syncs"] == 2 + 2 + 1
    assert loop["compiles"] >= 3 and loop["compile_cache_hits"] == 0  # step, probe, eval
    assert loop["compile_s"] > 0 and loop["steady_step_s"] > 0
    assert doc["report"]["wall_s"] > 0
    text = capsys.readouterr().out
    assert "timings (" in text and "first call s" in text and "\nreport " in text


def test_cache_flags_are_checked(tmp_path, capsys):
    assert main(["run", "x.toml", "--cache-dir", str(tmp_path), "--no-cache"]) == 2
    assert "--no-cache" in capsys.readouterr().err
    assert enable_compilation_cache("off") is None
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="--no-cache"):
        enable_compilation_cache(blocker / "cache")


def test_a_second_process_loads_its_programs_from_the_cache(tmp_path):
    # Two processes (a rerun): the first compiles and writes, the second only loads.
    script = textwrap.dedent(
        f"""
        import jax, jax.numpy as jnp, numpy as np
        from precisionlab.train._compile_cache import enable_compilation_cache
        from precisionlab.train._timing import CompileMeter
        enable_compilation_cache({str(tmp_path / "cache")!r})
        with CompileMeter() as m:
            jax.jit(lambda x: jnp.tanh(x) * 3 + 1)(np.ones(4, np.float32)).block_until_ready()
        print(m.compiles, m.cache_hits)
        """
    )
    env_runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        env_runs.append(proc.stdout.split())
    assert env_runs[0] == ["1", "0"]
    assert env_runs[1] == ["0", "1"]
    assert any((tmp_path / "cache").iterdir())
