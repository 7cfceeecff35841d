"""The one way precisionlab writes and reads its files (ground floor: imports nothing of it).

Writes (every command's):

- Only a new name or an existing regular file is written: a device, FIFO, socket, directory
  or symbolic link at the name is :class:`UnsafePathError` (``os.replace`` over ``/dev/null``
  replaced the device). :data:`STDIO` (``-``) is the only name for a standard stream; the
  commands handle it before calling here.
- :func:`atomic_open`: a temporary file created exclusively, with no-follow, through a handle on
  the target's directory; flushed, fsynced and renamed onto the target in that directory
  (then the directory is fsynced); on an exception the temporary file is removed and the
  target is untouched. :func:`save_figure` puts matplotlib's output through it.
- :class:`JsonlWriter` and :func:`open_existing_or_new` (appends, the run lock): no link, no
  FIFO or device, and no regular file with several hard links (a write in place would change
  the other name's file too).
- :func:`confined`: below an output directory, every directory is opened from its parent's
  handle with no-follow (:func:`makedirs` too), so a link planted inside after a check is an
  error, never followed.

Reads: :func:`read_bytes` (regular files only, no-follow, a size limit, FIFOs never block),
:func:`read_head` (the first bytes of such a file),
:func:`read_json` and :func:`read_jsonl` on top (bad JSON, deep nesting and huge integers are
one :class:`DamagedFileError` line naming the file).

JSON is strict (no ``NaN``/``Infinity`` literals, which are not JSON): :func:`to_jsonable`
encodes a non-finite float as the string ``"nan"``, ``"inf"`` or ``"-inf"`` and numpy/JAX
scalars and arrays as plain Python; :func:`from_json_float` decodes one such value.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import json
import math
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "MAX_JSONL_BYTES",
    "MAX_JSON_BYTES",
    "STDIO",
    "DamagedFileError",
    "JsonlWriter",
    "UnsafePathError",
    "atomic_open",
    "check_target",
    "confined",
    "dumps",
    "from_json_float",
    "fsync_dir",
    "makedirs",
    "open_existing_or_new",
    "read_bytes",
    "read_head",
    "read_json",
    "read_jsonl",
    "save_figure",
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


class UnsafePathError(ValueError):
    """A path precisionlab refuses to write or read: a link, a device, a FIFO, a socket, a
    directory where a file goes, a file with several hard links (appends), or too big a file."""


#: The only path that means a standard stream (stdout for a write): nothing else is a device.
STDIO = "-"
#: Largest JSON file read back (summary.json, status.json, ...): a run writes kilobytes.
MAX_JSON_BYTES = 64 << 20
#: Largest JSONL file read back (metrics.jsonl of a long run is tens of megabytes).
MAX_JSONL_BYTES = 512 << 20

_ROOTS: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("_ROOTS", default=())
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _refuse(path: str | os.PathLike, mode: int, doing: str = "writes") -> UnsafePathError:
    what = " (a new path or an existing file) or - for stdout" if doing == "writes" else ""
    return UnsafePathError(
        f"{os.fspath(path)}: is {_kind(mode)}; precisionlab {doing} only regular files{what}"
    )


@contextlib.contextmanager
def confined(root: str | os.PathLike) -> Iterator[None]:
    """Within the block, every write and read of this module below ``root`` (an output
    directory) opens each directory under ``root`` with no-follow, from a handle on ``root``:
    a link planted inside (``variants/x -> /etc``) is an error, never followed."""
    token = _ROOTS.set((*_ROOTS.get(), os.path.abspath(root)))
    try:
        yield
    finally:
        _ROOTS.reset(token)


def _root_of(path: str) -> str | None:
    best = None
    for root in _ROOTS.get():
        if (path == root or path.startswith(root.rstrip(os.sep) + os.sep)) and (
            best is None or len(root) > len(best)
        ):
            best = root
    return best


def _walk(dir_fd: int, parts: Iterable[str], where: str, create: bool) -> int:
    """Open ``parts`` one by one below ``dir_fd`` (closed here) with no-follow."""
    for part in parts:
        if part in ("", "."):
            continue
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o777, dir_fd=dir_fd)
        try:
            fd = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW, dir_fd=dir_fd)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENOTDIR):
                try:
                    mode = os.stat(part, dir_fd=dir_fd, follow_symlinks=False).st_mode
                except OSError:
                    mode = 0
                os.close(dir_fd)
                raise UnsafePathError(
                    f"{os.path.join(where, part)}: is {_kind(mode)} where a directory goes; "
                    "precisionlab never follows links inside an output directory"
                ) from None
            os.close(dir_fd)
            raise
        os.close(dir_fd)
        dir_fd, where = fd, os.path.join(where, part)
    return dir_fd


def _mkdirs(directory: str) -> None:
    """``os.makedirs(directory, exist_ok=True)`` without recursion (2,000 components made
    RecursionError there)."""
    missing = []
    head = directory
    while head and not os.path.isdir(head):
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(path)


def _dir_fd(directory: str, *, create: bool = False) -> int:
    """A handle on ``directory``; below a :func:`confined` root every step is no-follow."""
    directory = os.path.abspath(directory)
    root = _root_of(directory)
    if root is None:
        if create:
            _mkdirs(directory)
        return os.open(directory, os.O_RDONLY | _DIRECTORY)
    if create:
        _mkdirs(root)
    fd = os.open(root, os.O_RDONLY | _DIRECTORY)
    return _walk(fd, os.path.relpath(directory, root).split(os.sep), root, create)


def makedirs(path: str | os.PathLike) -> Path:
    """``mkdir -p path``, with no link followed below a :func:`confined` root."""
    os.close(_dir_fd(os.fspath(path), create=True))
    return Path(path)


def check_target(path: str | os.PathLike) -> None:
    """UnsafePathError unless ``path`` is a new name or an existing regular file (no link,
    device, FIFO, socket or directory); its directory must exist."""
    path = os.fspath(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise _refuse(path, mode)


def _check_at(dir_fd: int, name: str, path: str | os.PathLike) -> None:
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise _refuse(path, mode)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temporary file to be moved onto ``path`` when the block ends without error.

    ``mode`` is "w" (text, UTF-8) or "wb". The parent directory must exist. ``path`` must be
    a new name or a regular file (:class:`UnsafePathError` for a link, device, FIFO, socket or
    directory: ``os.replace`` over ``/dev/null`` would replace the device). The temporary file
    is created exclusively, with no-follow, in the same directory (through a handle on it) and
    renamed there; it gets mode 0666 less the umask, like any file made with ``open``.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    name = path.name
    if not name or name in (".", ".."):
        raise UnsafePathError(f"{os.fspath(path)!r}: not a file name")
    dir_fd = _dir_fd(os.fspath(path.parent))
    try:
        _check_at(dir_fd, name, path)
        tmp = f".{name[:200]}.{secrets.token_hex(6)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW
        fd = os.open(tmp, flags, 0o666, dir_fd=dir_fd)  # 0666 less the umask
        try:
            with os.fdopen(fd, mode, encoding="utf-8" if mode == "w" else None) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            _check_at(dir_fd, name, path)  # planted meanwhile: still never replaced
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        with contextlib.suppress(OSError):
            os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def open_existing_or_new(path: str | os.PathLike, *, append: bool, truncate: bool = False) -> int:
    """A descriptor open for writing (read too, without ``append``) on ``path``, created if
    new; refused (:class:`UnsafePathError`) unless a regular file with one link: a write in
    place through a hard link would change the other name's file too. No link is followed,
    and a FIFO never blocks the open."""
    path = Path(path)
    dir_fd = _dir_fd(os.fspath(path.parent))
    try:
        _check_at(dir_fd, path.name, path)  # a device is refused before it is ever opened
        flags = os.O_CREAT | _NOFOLLOW | os.O_NONBLOCK
        flags |= (os.O_WRONLY | os.O_APPEND) if append else os.O_RDWR
        try:
            fd = os.open(path.name, flags, 0o666, dir_fd=dir_fd)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EOPNOTSUPP):
                mode = os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False).st_mode
                raise _refuse(path, mode) from None
            raise
    finally:
        os.close(dir_fd)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        if stat.S_ISREG(info.st_mode):
            raise UnsafePathError(
                f"{os.fspath(path)}: has {info.st_nlink} hard links; precisionlab does not "
                "write in place through a hard link (remove it or choose another path)"
            )
        raise _refuse(path, info.st_mode)
    os.set_blocking(fd, True)
    if truncate:
        os.ftruncate(fd, 0)
    return fd


def _open_regular(path: Path) -> int:
    """A read descriptor on the regular file ``path`` (no link followed for its last
    component; below a :func:`confined` root none at all); :class:`UnsafePathError` for
    anything else, refused before it is opened (opening a device can act; a FIFO blocks)."""
    dir_fd = _dir_fd(os.fspath(path.parent))
    try:
        try:
            mode = os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False).st_mode
            if not stat.S_ISREG(mode):
                raise _refuse(path, mode, "reads")
            fd = os.open(path.name, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW, dir_fd=dir_fd)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise _refuse(path, stat.S_IFLNK, "reads") from None
            raise
    finally:
        os.close(dir_fd)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refuse(path, mode, "reads")
    return fd


def _read_up_to(fd: int, limit: int) -> bytes:
    chunks, size = [], 0
    while size < limit:
        chunk = os.read(fd, min(1 << 20, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def read_bytes(path: str | os.PathLike, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path`` (no link followed for its last component; below
    a :func:`confined` root none at all); :class:`UnsafePathError` for anything else or a
    file over ``max_bytes`` (a FIFO never blocks)."""
    fd = _open_regular(Path(path))
    try:
        data = _read_up_to(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise UnsafePathError(
            f"{os.fspath(path)}: larger than {max_bytes} bytes; not a file precisionlab wrote"
        )
    return data


def read_head(path: str | os.PathLike, limit: int) -> tuple[bytes, bool]:
    """At most ``limit`` bytes of the regular file ``path`` and whether it holds more (as
    :func:`read_bytes`: no link followed, never a FIFO or device)."""
    fd = _open_regular(Path(path))
    try:
        data = _read_up_to(fd, limit + 1)
    finally:
        os.close(fd)
    return data[:limit], len(data) > limit


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_open(path) as f:
        f.write(text)


def save_figure(fig: Any, path: str | os.PathLike, **kwargs: Any) -> None:
    """``fig.savefig`` (a matplotlib figure) through :func:`atomic_open`, so a plot obeys the
    same rules as every other file; the format is the path's extension (png by default)."""
    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format=fmt, **kwargs)


def write_json(path: str | os.PathLike, data: Any, *, indent: int | None = 2) -> None:
    """Write ``data`` as strict JSON (plus a newline) atomically."""
    write_text(path, dumps(data, indent=indent) + "\n")


class DamagedFileError(ValueError):
    """A file precisionlab wrote that does not parse or does not have the expected fields."""


def _loads(text: str, path: str | os.PathLike, where: str = "") -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise DamagedFileError(
            f"{os.fspath(path)}{where}: not valid JSON ({err.msg}, line "
            f"{err.lineno} column {err.colno})"
        ) from None
    except RecursionError:
        raise DamagedFileError(f"{os.fspath(path)}{where}: JSON nested too deeply") from None
    except ValueError as err:  # an int past Python's 4300-digit str -> int limit
        raise DamagedFileError(f"{os.fspath(path)}{where}: {str(err).split(';')[0]}") from None


def _text(path: str | os.PathLike, max_bytes: int) -> str:
    data = read_bytes(path, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DamagedFileError(f"{os.fspath(path)}: not UTF-8 text (byte {err.start})") from None


def read_json(path: str | os.PathLike, *, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parse a JSON file (non-finite floats stay the strings :func:`to_jsonable` wrote): a
    regular file of at most ``max_bytes``, else :class:`UnsafePathError`; bad JSON (deep
    nesting, a huge integer included) is one :class:`DamagedFileError` line naming the file."""
    return _loads(_text(path, max_bytes), path)


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict[str, Any]]) -> None:
    """Write ``rows`` as a JSONL file atomically (one strict JSON object per line)."""
    with atomic_open(path) as f:
        for row in rows:
            f.write(dumps(row) + "\n")


def read_jsonl(
    path: str | os.PathLike, *, max_bytes: int = MAX_JSONL_BYTES
) -> list[dict[str, Any]]:
    """The rows of a JSONL file (none if it does not exist); a torn last line (a run killed
    mid-write) is ignored; a line that is not a JSON object is a :class:`DamagedFileError`
    naming the file and line."""
    path = Path(path)
    if not os.path.lexists(path):
        return []
    rows = []
    lines = _text(path, max_bytes).split("\n")
    for number, line in enumerate(lines[:-1], 1):  # the last piece has no newline: torn or ""
        line = line.strip()
        if line:
            row = _loads(line, path, f" line {number}")
            if not isinstance(row, dict):
                raise DamagedFileError(
                    f"{path} line {number}: expected a JSON object, got {type(row).__name__}"
                )
            rows.append(row)
    return rows


class JsonlWriter:
    """Appends one strict JSON object per line and flushes it, so readers see every finished
    line (``mode="w"`` starts the file afresh)."""

    def __init__(self, path: str | os.PathLike, mode: str = "a") -> None:
        self.path = Path(path)
        if mode not in ("a", "w"):
            raise ValueError(f"mode must be 'a' or 'w', got {mode!r}")
        makedirs(self.path.parent)
        # a link, device, FIFO or hard-linked file at this name is an error, never written
        fd = open_existing_or_new(self.path, append=True, truncate=mode == "w")
        self._file: IO[str] | None = os.fdopen(fd, "a", encoding="utf-8")

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
