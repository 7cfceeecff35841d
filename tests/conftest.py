"""Test configuration: every test runs on CPU with float32 defaults unless it says otherwise."""

import os
import signal
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# `precisionlab run` turns JAX's persistent compilation cache on (in ~/.cache by default); tests
# that run it in-process must not write there or change what later tests compile.
os.environ.setdefault("PRECISIONLAB_CACHE_DIR", "off")

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


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang


def _run_cli(
    capsys, argv: list[str], status: int | tuple[int, ...] = 2, limit_s: int = 30
) -> tuple[str, str]:
    from precisionlab.cli import main

    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit_s)
    try:
        got = main(argv)
    except SystemExit as exit_:  # argparse's errors (a flag's type)
        got = exit_.code
    except _Hang:
        pytest.fail(f"no answer within {limit_s} s: precisionlab {' '.join(argv)[:300]}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    out, err = capsys.readouterr()
    allowed = status if isinstance(status, tuple) else (status,)
    assert got in allowed, (got, out[-2000:], err[-2000:])
    assert "Traceback" not in out + err
    if got == 2:
        head = err.split(": error: ")[0]  # argparse names the subcommand: bench recipes
        assert head in (f"precisionlab {argv[0]}", f"precisionlab {' '.join(argv[:2])}"), err
        assert err.count("\n") == 1, err
    return out, err


@pytest.fixture
def cli(capsys):
    """``cli(argv, status=2, limit_s=30) -> (stdout, stderr)``: runs ``precisionlab argv``
    in-process and fails unless it exits ``status`` (or one of a tuple of them) within
    ``limit_s`` seconds without a traceback; an error (status 2) must be the one line
    ``precisionlab CMD: error: ...``. The hostile-input tests' shared checker."""
    return lambda argv, status=2, limit_s=30: _run_cli(capsys, argv, status, limit_s)
