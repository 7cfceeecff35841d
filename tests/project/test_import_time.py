"""Importing precisionlab starts no JAX backend: a multi-process run must call
``jax.distributed.initialize`` before anything touches one, and the command line imports much of
the package first (an array made at import time once broke every multi-process run)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import importlib, pathlib, sys
    from jax._src import xla_bridge  # the test may read JAX internals; the package may not
    root = pathlib.Path(sys.argv[1]) / "precisionlab"
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts[-1] == "__main__":
            continue
        importlib.import_module(".".join(parts))
        if xla_bridge.backends_are_initialized():
            sys.exit("importing " + ".".join(parts) + " started a JAX backend")
    print("OK")
    """
)


def test_importing_every_module_starts_no_backend():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-3000:]
