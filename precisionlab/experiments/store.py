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
Every file gets the same mode (0666 less the umask, 0644 usually); symbolic links are never
followed inside a run directory (a run or resume refuses a directory that holds one), and the
process writing a run directory holds an advisory lock on ``.lock`` in it (:func:`run_lock`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import platform
import re
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
    "run_lock",
    "safe_name",
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
        os.fchmod(fd, file_mode())  # mkstemp makes 0600; every file of a run has one mode
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
        # O_NOFOLLOW: a symbolic link planted at this name is an error, never followed.
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(self.path, flags, file_mode())
        self._file: TextIO | None = os.fdopen(fd, "a", encoding="utf-8")

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
        os.fchmod(fd, file_mode())
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


@functools.cache
def file_mode() -> int:
    """0o666 less the process umask: the mode ``open()`` gives new files (read once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


_UNSAFE = re.compile(r"[^A-Za-z0-9_.+=^-]+")


def safe_name(name: str) -> str:
    """``name`` as one safe path component: runs of other characters than letters, digits and
    ``_ . + = ^ -`` become ``-``, leading dots and dashes are dropped, at most 100 characters
    (``"../../x"`` -> ``"x"``, ``"/tmp/a b"`` -> ``"tmp-a-b"``); ``"run"`` if nothing is left."""
    cleaned = _UNSAFE.sub("-", str(name)).lstrip(".-")[:100].rstrip(".-")
    return cleaned or "run"


def new_run_dir(root: Path, name: str) -> Path:
    """A fresh directory ``root/<name>-<UTC timestamp>`` (suffixed if it exists); ``name`` is
    made one path component (:func:`safe_name`) and the result checked to stay under ``root``."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    root = Path(root)
    base = root / f"{safe_name(name)}-{stamp}"
    if not base.resolve().is_relative_to(root.resolve()):
        raise ValueError(f"run name {name!r} leads outside {str(root)!r}")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    path.mkdir(parents=True)
    return path


def check_no_symlinks(run_dir: Path) -> None:
    """Refuse a run directory holding a symbolic link (writes would follow it elsewhere)."""
    for top, dirs, files in os.walk(run_dir, followlinks=False):
        for entry in dirs + files:
            if os.path.islink(os.path.join(top, entry)):
                link = os.path.join(top, entry)
                raise ValueError(
                    f"{link} is a symbolic link; precisionlab does not follow links inside a run "
                    "directory: remove it"
                )


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``run_dir/.lock`` (with this process's pid in it)
    while writing the run; a second writer gets a ValueError naming the holder's pid."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - no advisory locks on this platform
        yield
        return
    run_dir = Path(run_dir)
    path = run_dir / ".lock"
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, file_mode())
    except OSError as err:
        raise ValueError(f"{path}: cannot open the run's lock file ({err.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise ValueError(
                f"{run_dir} is being written by another precisionlab process (pid {holder}); "
                "wait for it to finish or stop it"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def holding_run_lock(func):
    """Decorator: run ``func(experiment, run_dir, ...)`` holding :func:`run_lock` on
    ``run_dir`` after checking it holds no symbolic link."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        run_dir = Path(kwargs["run_dir"] if "run_dir" in kwargs else args[1])
        run_dir.mkdir(parents=True, exist_ok=True)
        check_no_symlinks(run_dir)
        with run_lock(run_dir):
            return func(*args, **kwargs)

    return wrapper
