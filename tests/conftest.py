"""Test configuration: every test runs on CPU with float32 defaults unless it says otherwise."""

import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# `precisionlab run` turns JAX's persistent compilation cache on (in ~/.cache by default); tests
# that run it in-process must not write there or change what later tests compile.
os.environ.setdefault("PRECISIONLAB_CACHE_DIR", "off")
# Reports draw telemetry figures in worker processes; each starts an interpreter that imports
# JAX (seconds of CPU), more than the small figures of a test cost: in-process unless a test
# asks (tests/test_report_workers.py).
os.environ.setdefault("PRECISIONLAB_REPORT_WORKERS", "1")

import hypothesis
import pytest

hypothesis.settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True)
hypothesis.settings.register_profile("dev", max_examples=100, deadline=None)
hypothesis.settings.load_profile("ci" if os.environ.get("CI") else "dev")


def _run_on_host_devices(script: str, devices: int = 4, timeout: int = 600) -> str:
    env = dict(os.environ)
    flag = f" --xla_force_host_platform_device_count={devices}"
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + flag
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("OK"), proc.stdout[-3000:]
    return proc.stdout


@pytest.fixture
def run_on_host_devices():
    """``run(script, devices=4, timeout=600) -> stdout``: runs the Python ``script`` in a
    subprocess on ``devices`` CPU host devices (the count must be set before jax is imported)
    and fails unless it exits 0 with ``OK`` as its last output."""
    return _run_on_host_devices
