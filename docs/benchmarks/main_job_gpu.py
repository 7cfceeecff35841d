"""Time the main job on a GPU: a cold run (empty compilation cache), then a warm rerun.

Run on the GPU machine from the repository's root, with precisionlab importable::

    python docs/benchmarks/main_job_gpu.py OUT_DIR [--limit SECONDS]

Each run is ``precisionlab run experiments/fp16_vs_bf16.toml --timings --quiet`` in a
subprocess with its own run directory under OUT_DIR and one compilation cache (empty for the
first run), stopped after ``--limit`` seconds (default 280, so both fit a 10-minute device
command). For each run it prints the wall time the caller measured, the CPU seconds of the
process and its children, and the process's phases from ``timings.json`` (startup, imports,
plan, environment, units, compile waits, summaries, report), and it writes them all to
``OUT_DIR/main_job_gpu.json`` with the device, the versions and the date. The issue's target:
under 30 s on a GPU. Not run yet: no GPU was available when it was written (issue 39).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

CONFIG = "experiments/fp16_vs_bf16.toml"


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one_run(out: Path, cache: Path, label: str, limit: float) -> dict:
    run_dir = out / f"run-{label}"
    argv = [sys.executable, "-m", "precisionlab", "run", CONFIG, "--out", str(run_dir),
            "--cache-dir", str(cache), "--timings", "--quiet"]  # fmt: skip
    cpu0, t0 = _children_cpu(), time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=limit)
        status, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired as err:
        status, tail = "timeout", str(err)[-2000:]
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    timings = run_dir / "timings.json"
    process = json.loads(timings.read_text()).get("process") if timings.is_file() else None
    return {"label": label, "status": status, "wall_s": wall, "cpu_s": cpu,
            "process": process, "output_tail": tail}  # fmt: skip


def describe() -> dict:
    import jax

    dev = jax.devices()[0]
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": dev.device_kind,
            "backend": jax.default_backend(), "jax": jax.__version__,
            "cpu_count": os.cpu_count(), "python": sys.version.split()[0]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--limit", type=float, default=280.0, help="seconds per run")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.out / "cache"
    result = {"machine": describe(), "runs": []}
    for label in ("cold", "warm"):
        run = one_run(args.out, cache, label, args.limit)
        result["runs"].append(run)
        print(f"{label}: status {run['status']}, {run['wall_s']:.1f} s wall, "
              f"{run['cpu_s']:.1f} CPU s", flush=True)  # fmt: skip
        for name, p in ((run["process"] or {}).get("phases") or {}).items():
            print(f"  {name:<24} {p['wall_s']:8.2f} s wall {p['cpu_s']:8.2f} CPU s")
    (args.out / "main_job_gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {args.out / 'main_job_gpu.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
