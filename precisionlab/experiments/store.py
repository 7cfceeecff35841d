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

JSON files are written to a temporary file and moved into place with :func:`os.replace`;
JSONL files are appended line by line and flushed, and readers ignore a torn last line.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "JsonlWriter",
    "environment",
    "new_run_dir",
    "read_json",
    "read_jsonl",
    "to_jsonable",
    "write_json",
]


def to_jsonable(value: Any) -> Any:
    """``value`` with numpy/JAX scalars and arrays turned into plain Python; non-finite floats
    become the strings ``"nan"``, ``"inf"``, ``"-inf"`` (strict JSON has no literal for them)."""
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, bool | str) or value is None:
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Path):
        return str(value)
    tolist = getattr(value, "tolist", None)
    if tolist is not None:
        return to_jsonable(tolist())
    return str(value)


def from_json_float(value: Any) -> float | None:
    """Inverse of :func:`to_jsonable` for one float (``"nan"`` -> nan); None stays None."""
    if value is None:
        return None
    return float(value)


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON atomically (temporary file in the same directory + os.replace)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(to_jsonable(data), f, indent=2, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class JsonlWriter:
    """Appends one JSON object per line and flushes it, so readers see every finished line."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = open(self.path, "a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        assert self._file is not None, "writer is closed"
        self._file.write(json.dumps(to_jsonable(row), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file; a torn last line (a run killed mid-write) is ignored."""
    return list(iter_jsonl(path))


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                return  # torn by a kill: the writer never finished it
            line = line.strip()
            if line:
                yield json.loads(line)


def truncate_jsonl(path: Path, keep: Iterable[dict[str, Any]]) -> None:
    """Rewrite ``path`` atomically with only ``keep`` (used when a resumed unit restarts from a
    checkpoint older than its last recorded step)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in keep:
                f.write(json.dumps(row, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
