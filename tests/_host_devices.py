"""Run a script on several CPU host devices: the one implementation the multi-device tests use
(the device count must be set before JAX starts its backend, hence a subprocess)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_on_host_devices(script: str, devices: int = 4, timeout: int = 600) -> str:
    """Runs the Python ``script`` in a subprocess on ``devices`` CPU host devices and returns
    its stdout; fails unless it exits 0 with ``OK`` as its last output."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    )
    env["JAX_PLATFORMS"] = "cpu"
    # the checkout first, as in the parent (a clone run without installing the package)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("OK"), proc.stdout[-3000:]
    return proc.stdout
