"""Files written so that a killed process leaves either the old file or the new one.

The one place for atomic writes and JSON (ground floor: imports nothing of precisionlab):

- :func:`atomic_open`: a temporary file in the target's directory, flushed, fsynced and moved
  into place with :func:`os.replace` (then the directory is fsynced, so the rename survives a
  crash); on an exception the temporary file is removed and the target is untouched.
- JSON is strict (no ``NaN``/``Infinity`` literals, which are not JSON): :func:`to_jsonable`
  encodes a non-finite float as the string ``"nan"``, ``"inf"`` or ``"-inf"`` and numpy/JAX
  scalars and arrays as plain Python; :func:`from_json_float` decodes one such value. Run store,
  checkpoints, survey and memory experiment all write through here.
- :class:`JsonlWriter`: one object per line, flushed after each line (a reader sees every
  finished line; a torn last line is ignored by :func:`read_jsonl`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "JsonlWriter",
    "atomic_open",
    "dumps",
    "from_json_float",
    "fsync_dir",
    "read_json",
    "read_jsonl",
    "to_jsonable",
    "write_json",
    "write_jsonl",
    "write_text",
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


def dumps(data: Any, *, indent: int | None = None) -> str:
    """Strict JSON text of ``data`` (through :func:`to_jsonable`)."""
    return json.dumps(to_jsonable(data), indent=indent, allow_nan=False)


def fsync_dir(directory: str | os.PathLike) -> None:
    """fsync a directory, so a rename inside it survives a crash (no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temporary file to be moved onto ``path`` when the block ends without error.

    ``mode`` is "w" (text, UTF-8) or "wb". The parent directory must exist. The new file gets
    mode 0666 less the umask, like any file made with ``open`` (not mkstemp's 0600).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_open(path) as f:
        f.write(text)


def write_json(path: str | os.PathLike, data: Any, *, indent: int | None = 2) -> None:
    """Write ``data`` as strict JSON (plus a newline) atomically."""
    write_text(path, dumps(data, indent=indent) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    """Parse a JSON file (non-finite floats stay the strings :func:`to_jsonable` wrote)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict[str, Any]]) -> None:
    """Write ``rows`` as a JSONL file atomically (one strict JSON object per line)."""
    with atomic_open(path) as f:
        for row in rows:
            f.write(dumps(row) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a JSONL file; a torn last line (a run killed mid-write) is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break  # torn by a kill: the writer never finished it
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


class JsonlWriter:
    """Appends one strict JSON object per line and flushes it, so readers see every finished
    line (``mode="w"`` starts the file afresh)."""

    def __init__(self, path: str | os.PathLike, mode: str = "a") -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if mode not in ("a", "w"):
            raise ValueError(f"mode must be 'a' or 'w', got {mode!r}")
        # O_NOFOLLOW: a symbolic link planted at this name is an error, never followed.
        flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        flags |= os.O_APPEND if mode == "a" else os.O_TRUNC
        fd = os.open(self.path, flags, 0o666)  # 0666 less the umask, like open()
        self._file: IO[str] | None = os.fdopen(fd, mode, encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        if self._file is None:
            raise ValueError(f"JsonlWriter for {self.path} is closed")
        self._file.write(dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
