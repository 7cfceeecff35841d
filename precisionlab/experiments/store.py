"""The run store: one directory per run, written so that a killed run leaves valid files.

Layout of a run directory::

    config.json         source, --set overrides, the document and the resolved config
    environment.json    python, jax, jaxlib, ml_dtypes versions; backend, device kind/count
    run.json            status (running / interrupted / finished) and timestamps
    summary.json        per-unit results and per-group mean/std (atomic, rewritten as units end)
    variants/<id>/      per unit: metrics.jsonl (one JSON object per step, appended and
                        flushed), status.json, hist.jsonl, error.log, checkpoints/
    report.md, plots/   written by :mod:`precisionlab.experiments.report`
    variants/<id>/tb/   TensorBoard event files, only if ``tensorboardX`` is installed

JSON files are strict JSON written atomically through :mod:`precisionlab._io` (a temporary
file, fsynced, moved into place with :func:`os.replace`); JSONL files are appended line by line
and flushed, and readers ignore a torn last line.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from precisionlab import _io

__all__ = [
    "JsonlWriter",
    "environment",
    "new_run_dir",
    "read_json",
    "read_jsonl",
    "to_jsonable",
    "write_json",
]


read_json = _io.read_json
read_jsonl = _io.read_jsonl
to_jsonable = _io.to_jsonable
from_json_float = _io.from_json_float
JsonlWriter = _io.JsonlWriter


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as strict JSON atomically (see :mod:`precisionlab._io`)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    _io.write_json(path, data)


def truncate_jsonl(path: Path, keep: Iterable[dict[str, Any]]) -> None:
    """Rewrite ``path`` atomically with only ``keep`` (used when a resumed unit restarts from a
    checkpoint older than its last recorded step)."""
    _io.write_jsonl(path, keep)


def resume_jsonl(path: Path, step: int) -> None:
    """Prepare a resumed unit's JSONL file: keep the whole rows recorded before ``step`` and
    drop the rest, including a line torn by a kill, so appending continues a valid file."""
    path = Path(path)
    if path.exists():
        truncate_jsonl(path, [r for r in read_jsonl(path) if int(r.get("step", -1)) < step])


def tensorboard_writer(log_dir: Path) -> Any | None:
    """A TensorBoard ``SummaryWriter`` for ``log_dir`` when ``tensorboardX`` is installed (it is
    not a dependency), else None."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(log_dir))


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def environment() -> dict[str, Any]:
    """Versions and the device this run used (JAX is imported here)."""
    import jax

    devices = jax.devices()
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "ml_dtypes": _version("ml_dtypes"),
        "optax": _version("optax"),
        "numpy": _version("numpy"),
        "precisionlab": _version("precisionlab"),
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind if devices else None,
        "device_count": len(devices),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def new_run_dir(root: Path, name: str) -> Path:
    """A fresh directory ``root/<name>-<UTC timestamp>`` (suffixed if it exists)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    base = Path(root) / f"{name}-{stamp}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    path.mkdir(parents=True)
    return path
