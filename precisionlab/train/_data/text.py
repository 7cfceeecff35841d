"""``text``: byte-level next-token prediction over real text files (no download).

The corpus is the Python standard library's own source (``*.py`` under
``sysconfig.get_paths()["stdlib"]``, without ``site-packages``/``dist-packages``/``__pycache__``),
found at run time, or any file or directory named by ``path``. Files are taken in sorted order of
their relative path (deterministic) and concatenated until ``max_bytes`` (default 1 MiB, at most
256 MiB): the load is bounded, so a run reads at most ``max_bytes`` bytes and holds them as one
``uint8`` array. The file that crosses the cap is cut there.

Split by file: every ``round(1 / eval_fraction)``-th file (the last of each group, in sorted order)
is held out for ``eval``; with one file, its last ``eval_fraction`` of bytes is. Each split's
files are concatenated into one stream (windows may cross file boundaries).

Batches: ``{"tokens": int32[B, seq_len + 1]}``, byte values 0..255 (``vocab_size`` 256), windows
starting at seeded random offsets of the split's stream: a pure function of ``(seed, split, step,
batch_size)``, so a run resumes from its step count. :meth:`TextData.describe` gives what a run
store should record to make runs comparable (file list or its hash, byte counts, a content hash).

Bad input raises ValueError naming the value: a path that does not exist, no matching files,
a binary file (a NUL byte or invalid UTF-8) in a user-named corpus (the default corpus skips and
counts them), a split smaller than one window.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import hashlib
import os
import pathlib
import sysconfig
from typing import Any

import numpy as np

from precisionlab import _io
from precisionlab._schema import check_float, check_int
from precisionlab.train._data.base import Dataset, split_rng

__all__ = ["MAX_BYTES_LIMIT", "TextData", "stdlib_dir"]

MAX_BYTES_LIMIT = 1 << 28  # 256 MiB: the most a run may load
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_dir() -> pathlib.Path:
    """The running Python's standard-library directory (the default corpus)."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _list_files(root: pathlib.Path, pattern: str) -> list[pathlib.Path]:
    """Regular files under ``root`` matching ``pattern``, sorted by relative POSIX path; hidden
    entries and the _SKIP_DIRS are left out (and not descended into)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        base = pathlib.Path(dirpath)
        for name in filenames:
            p = base / name
            if not name.startswith(".") and p.match(pattern) and p.is_file():
                found.append(p)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _is_text(data: bytes, *, cut: bool = False) -> bool:
    """No NUL byte and valid UTF-8 (with ``cut``, the end may stop inside a character: the
    file was read only up to ``max_bytes``)."""
    if b"\x00" in data:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=not cut)
    except UnicodeDecodeError:
        return False
    return True


def _read_head(path: pathlib.Path, limit: int) -> tuple[bytes, bool]:
    """At most ``limit`` bytes of ``path`` and whether there were more: ``max_bytes`` bounds
    what is read, not only what is kept (a 3 GB file with a 1 MiB limit read 3 GB)."""
    return _io.read_head(path, limit)  # a regular file only: a FIFO never blocks


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextData(Dataset):
    """Byte-level language modelling on real text (see module docstring).

    path: a file or directory (None = the standard library's source); pattern: file-name glob
    within a directory (None = ``*.py`` for the standard library, ``*`` for a user directory);
    seq_len: window length (model inputs); eval_fraction: share of files held out, in (0, 0.5];
    max_bytes: cap on the bytes read (>= 2 windows, <= 256 MiB).
    """

    path: str | None = None
    pattern: str | None = None
    seq_len: int = 64
    eval_fraction: float = 0.1
    max_bytes: int = 1 << 20

    name = "text"
    kind = "lm"
    vocab_size = 256

    def __post_init__(self) -> None:
        check_int("seq_len", self.seq_len, 2)
        check_float("eval_fraction", self.eval_fraction, 1e-6, 0.5)
        check_int("max_bytes", self.max_bytes, 2 * (self.seq_len + 1))
        if self.max_bytes > MAX_BYTES_LIMIT:
            raise ValueError(
                f"max_bytes must be <= {MAX_BYTES_LIMIT} (256 MiB), got {self.max_bytes}"
            )
        if self.path is not None and not isinstance(self.path, str | os.PathLike):
            raise TypeError(f"path must be a string or None, got {type(self.path).__name__}")
        if self.path is not None and not os.fspath(self.path).strip():
            # "" silently meant the current directory
            raise ValueError("path is empty; name a text file or directory (or leave it out)")
        if self.pattern is not None and (not isinstance(self.pattern, str) or not self.pattern):
            raise ValueError(
                f"pattern must be a non-empty glob string or None, got {self.pattern!r}"
            )
        _ = self._corpus  # read now: a missing or unreadable corpus fails here

    @functools.cached_property
    def _corpus(self) -> dict[str, Any]:
        return self._load()

    def _load(self) -> dict[str, Any]:
        default = self.path is None
        root = (
            stdlib_dir() if self.path is None else pathlib.Path(os.fspath(self.path)).expanduser()
        )
        if not root.exists():
            raise ValueError(f"text path {str(root)!r} does not exist; give a file or a directory")
        if root.is_file():
            files, rel = [root], [root.name]
        else:
            pattern = self.pattern or ("*.py" if default else "*")
            files = _list_files(root, pattern)
            rel = [f.relative_to(root).as_posix() for f in files]
            if not files:
                raise ValueError(
                    f"no files matching {pattern!r} under text path {str(root)!r}; name a "
                    "directory holding text files, or a file"
                )
        names, chunks, skipped, total = [], [], 0, 0
        for f, r in zip(files, rel, strict=True):
            if total >= self.max_bytes:
                break
            data, cut = _read_head(f, self.max_bytes - total)
            if not data:
                continue
            if not _is_text(data, cut=cut):
                if default:
                    skipped += 1
                    continue
                raise ValueError(
                    f"text file {str(f)!r} is binary (a NUL byte or invalid UTF-8); the text "
                    "dataset reads UTF-8 text files only (use pattern to select them)"
                )
            data = data[: self.max_bytes - total]
            names.append(r)
            chunks.append(data)
            total += len(data)
        if not chunks:
            raise ValueError(f"text path {str(root)!r} holds no non-empty text files")
        h = hashlib.sha256()
        for r, data in zip(names, chunks, strict=True):
            h.update(r.encode() + b"\0" + len(data).to_bytes(8, "little"))
            h.update(data)
        if len(chunks) >= 2:
            k = max(2, round(1.0 / self.eval_fraction))
            held = [i for i in range(len(chunks)) if i % k == k - 1] or [len(chunks) - 1]
            train_c = [c for i, c in enumerate(chunks) if i not in held]
            eval_c = [chunks[i] for i in held]
        else:
            n_train = len(chunks[0]) - max(1, round(len(chunks[0]) * self.eval_fraction))
            train_c, eval_c, held = [chunks[0][:n_train]], [chunks[0][n_train:]], []
        streams = {
            "train": np.frombuffer(b"".join(train_c), np.uint8),
            "eval": np.frombuffer(b"".join(eval_c), np.uint8),
        }
        for split, s in streams.items():
            if s.size < self.seq_len + 1:
                raise ValueError(
                    f"text corpus at {str(root)!r}: the {split} split has {s.size} bytes, fewer "
                    f"than one window (seq_len + 1 = {self.seq_len + 1}); give more text or a "
                    "smaller seq_len"
                )
        info = {
            "name": self.name,
            "source": "python-stdlib" if default else "path",
            "root": str(root),
            "pattern": None if root.is_file() else (self.pattern or ("*.py" if default else "*")),
            "files": len(names),
            "file_list_sha256": hashlib.sha256("\n".join(names).encode()).hexdigest(),
            "eval_files": [names[i] for i in held],
            "bytes": total,
            "bytes_train": int(streams["train"].size),
            "bytes_eval": int(streams["eval"].size),
            "max_bytes": self.max_bytes,
            "truncated": total >= self.max_bytes,
            "skipped_binary_files": skipped,
            "sha256": h.hexdigest(),
        }
        if len(names) <= 2000:
            info["file_list"] = names
        return {"streams": streams, "info": info}

    @property
    def chance(self) -> float:  # type: ignore[override]
        return 1.0 / self.vocab_size

    def describe(self) -> dict[str, Any]:
        """JSON-able record of the options and the corpus: ``source``, ``root``, ``pattern``,
        ``files`` (count), ``file_list`` (relative paths, when <= 2000), ``file_list_sha256``,
        ``eval_files``, ``bytes`` / ``bytes_train`` / ``bytes_eval``, ``max_bytes``,
        ``truncated``, ``skipped_binary_files``, ``sha256`` (of every file's relative path,
        length and bytes)."""
        info = {**super().describe(), **self._corpus["info"]}
        for key in ("file_list", "eval_files"):
            if key in info:
                info[key] = list(info[key])
        return info

    def batch(
        self, step: int, batch_size: int, *, seed: int = 0, split: str = "train"
    ) -> dict[str, np.ndarray]:
        g = split_rng(seed, split, step)
        stream = self._corpus["streams"][split]
        n = self.seq_len + 1
        starts = g.integers(0, stream.size - n + 1, size=batch_size)
        return {"tokens": stream[starts[:, None] + np.arange(n)].astype(np.int32)}

    def model_kwargs(self) -> dict[str, Any]:
        return {"vocab_size": self.vocab_size, "seq_len": self.seq_len}
