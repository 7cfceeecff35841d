"""The opt-in glibc malloc settings (precisionlab._alloc)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
SHOW = "from precisionlab._alloc import malloc_tuning; print(malloc_tuning())"


def _tuning(env_value: str | None) -> str:
    env = dict(os.environ)
    env.pop("PRECISIONLAB_MALLOC_TUNING", None)
    if env_value is not None:
        env["PRECISIONLAB_MALLOC_TUNING"] = env_value
    out = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(not GLIBC, reason="the settings are glibc's")
def test_opt_in_at_import_and_off_by_default():
    assert _tuning("1") == str({"M_ARENA_MAX": 1, "M_MMAP_MAX": 0, "M_TRIM_THRESHOLD": 1 << 30})
    assert _tuning(None) == "None"  # a library does not change malloc unasked
    assert _tuning("0") == "None"


@pytest.mark.skipif(not GLIBC, reason="the settings are glibc's")
def test_large_outputs_can_reuse_resident_memory():
    """Without the settings every whole-array call on 2^24 float32 elements faults in its
    64 MiB output; with them, calls can reuse freed heap memory (glibc 2.36 does not always:
    an aligned request cannot reuse a freed block of its own size until it merges with a
    neighbour, so some calls still fault)."""
    code = (
        "import jax.numpy as jnp, numpy as np\n"
        "from precisionlab.bits import decode\n"
        "from precisionlab.bench._timing import minor_faults\n"
        "c = jnp.asarray(np.zeros(1 << 24, np.uint8))\n"
        "print(min(minor_faults(lambda: decode(c, 'e4m3fn')) for _ in range(10)))\n"
    )

    def least_faults(value: str) -> int:
        env = dict(os.environ, PRECISIONLAB_MALLOC_TUNING=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])

    # Whether glibc reuses a freed block depends on what else the process freed (and, with the
    # suite's other workers, on the machine): up to three processes are given the chance.
    tuned = least_faults("1")
    for _ in range(2):
        if tuned < 1024:
            break
        tuned = min(tuned, least_faults("1"))
    untuned = least_faults("0")
    assert tuned < 1024
    # Without the settings each call's fresh mmap faults in: a fault per 4 KiB page of 64 MiB,
    # or fewer where transparent huge pages map it, but never none.
    assert untuned > tuned and untuned >= 32
