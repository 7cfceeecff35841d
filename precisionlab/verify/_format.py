"""The dump format: a directory with ``manifest.json`` and the arrays in ``.npz`` files.

Written by :class:`DumpWriter` (arrays first, the manifest last and atomically: a recording
killed half way leaves no manifest, so it is never read as a dump) and read by
:func:`read_dump`, which checks every field it uses and turns any damage (a missing file,
bad JSON, a truncated archive, an array whose dtype or shape is not the manifest's) into
one :class:`DumpError` line. The format is documented in
``docs/reference/verify-dump-format.md``; :data:`FORMAT_VERSION` changes when a reader of
the old version could misread the new one.
"""

from __future__ import annotations

import dataclasses
import io
import os
import time
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from precisionlab import _io

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "Dump",
    "DumpError",
    "DumpWriter",
    "Tensor",
    "from_storage",
    "read_dump",
    "storage_dtype",
    "to_storage",
]

#: The ``format`` field of every manifest.
FORMAT = "precisionlab-verify-dump"
#: The version this code writes and reads.
FORMAT_VERSION = 1
#: The manifest's file name inside a dump directory.
MANIFEST = "manifest.json"
#: The arrays' file name (one archive per dump).
ARRAYS = "tensors.npz"
#: The roles a tensor may have (see the format reference).
ROLES = (
    "input",
    "given_scale",
    "key",
    "row_scale",
    "block_scale",
    "block_exp",
    "codes",
    "output",
    "state",
    "state_after",
    "result",
)
_NUMPY = ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint64",
          "uint32", "uint16", "uint8", "bool")  # fmt: skip
_ML = {
    name: np.dtype(getattr(ml_dtypes, name))
    for name in (
        "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
        "float8_e8m0fnu", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn",
    )
}  # fmt: skip


class DumpError(ValueError):
    """A dump that cannot be read: missing, damaged, or of another format or version."""


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype holding a tensor of logical dtype ``name`` in the archive: itself for
    numpy's own dtypes, the unsigned integer of the same width (the raw codes) for the
    ml_dtypes formats (an archive would keep those as opaque bytes)."""
    if name in _NUMPY:
        return np.dtype(name)
    if name in _ML:
        return np.dtype(f"uint{8 * _ML[name].itemsize}")
    raise ValueError(f"unknown tensor dtype {name!r}; known: {', '.join((*_NUMPY, *_ML))}")


def _c(a: np.ndarray) -> np.ndarray:
    """C-contiguous, keeping a 0-d array 0-d (np.ascontiguousarray makes it 1-d)."""
    return np.asarray(a, order="C")


def to_storage(x: Any, name: str) -> np.ndarray:
    """``x`` (an array of logical dtype ``name``, float values of that format, or, for an
    ml_dtypes format, its raw codes as unsigned integers of its width) as stored."""
    a = np.asarray(x)
    if name in _ML:
        if a.dtype == storage_dtype(name):
            return _c(a)  # raw codes
        if a.dtype != _ML[name]:
            a = a.astype(np.float32).astype(_ML[name])  # exact for values of the format
        return _c(a).view(storage_dtype(name))
    return _c(a.astype(np.dtype(name), copy=False))


def from_storage(a: np.ndarray, name: str) -> np.ndarray:
    """A stored array viewed as its logical dtype (ml_dtypes formats from their codes)."""
    return a.view(_ML[name]) if name in _ML else a


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One manifest entry (see the format reference for each field)."""

    name: str
    role: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    key: str
    order: int
    site: str | None = None
    gemm: str | None = None
    operand: str | None = None
    producer: str = ""
    iteration: tuple[int, ...] = ()
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {
            "name": self.name, "role": self.role, "dtype": self.dtype,
            "storage": storage_dtype(self.dtype).name, "shape": list(self.shape),
            "file": self.file, "key": self.key, "order": self.order, "site": self.site,
            "gemm": self.gemm, "operand": self.operand, "producer": self.producer,
            "iteration": list(self.iteration),
        }  # fmt: skip
        out.update(self.extra)
        return out


class DumpWriter:
    """Collects tensors in program order and writes the dump (arrays, then the manifest)."""

    def __init__(self, out: str | os.PathLike) -> None:
        self.out = Path(out)
        self.tensors: list[Tensor] = []
        self.arrays: dict[str, np.ndarray] = {}
        self._names: set[str] = set()

    def add(self, name: str, value: Any, dtype: str, role: str, **meta: Any) -> Tensor:
        """Append a tensor (``value`` of logical ``dtype``); ``meta``: the Tensor's other
        fields (site, gemm, operand, producer, iteration; anything else goes to ``extra``)."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; allowed: {', '.join(ROLES)}")
        if name in self._names:
            raise ValueError(f"tensor {name!r} recorded twice")
        self._names.add(name)
        key = f"t{len(self.tensors):06d}"
        stored = to_storage(value, dtype)
        fields = {f.name for f in dataclasses.fields(Tensor)}
        extra = {k: v for k, v in meta.items() if k not in fields}
        known = {k: v for k, v in meta.items() if k in fields}
        if "iteration" in known:
            known["iteration"] = tuple(int(i) for i in known["iteration"])
        t = Tensor(name=name, role=role, dtype=dtype, shape=tuple(stored.shape), file=ARRAYS,
                   key=key, order=len(self.tensors), extra=extra, **known)  # fmt: skip
        self.tensors.append(t)
        self.arrays[key] = stored
        return t

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays.values()))

    def write(self, header: Mapping[str, Any]) -> Path:
        """Write ``tensors.npz`` and then ``manifest.json`` (``header``: the manifest's other
        fields) into the output directory, which must be new or empty."""
        out = self.out
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(f"{out}: exists and is not an empty directory; name a new one")
        _io.makedirs(out)
        with _io.atomic_open(out / ARRAYS, "wb") as f:
            np.savez(f, **self.arrays)  # type: ignore[arg-type]  # numpy stub: **arrays vs allow_pickle
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **header,
            "bytes": self.nbytes,
            "tensors": [t.to_json() for t in self.tensors],
        }
        _io.write_json(out / MANIFEST, manifest, indent=1)
        return out


# --- reading ---------------------------------------------------------------------------
@dataclasses.dataclass
class Dump:
    """A dump read back: its directory, manifest (a dict), tensors (in program order) and
    arrays (by tensor name, in their logical dtypes)."""

    path: Path
    manifest: dict[str, Any]
    tensors: list[Tensor]
    arrays: dict[str, np.ndarray]

    def get(self, name: str) -> np.ndarray | None:
        return self.arrays.get(name)


def _need(cond: bool, path: Path, what: str) -> None:
    if not cond:
        raise DumpError(f"{path}: {what}")


def _tensor(entry: Any, i: int, path: Path) -> Tensor:
    where = f"tensors[{i}]"
    _need(isinstance(entry, dict), path, f"{where} is not an object")
    for field, kind in (("name", str), ("role", str), ("dtype", str), ("file", str),
                        ("key", str), ("shape", list), ("order", int)):  # fmt: skip
        _need(isinstance(entry.get(field), kind) and not isinstance(entry.get(field), bool),
              path, f"{where}: field {field!r} missing or not a {kind.__name__}")  # fmt: skip
    _need(entry["role"] in ROLES, path, f"{where}: unknown role {entry['role']!r}")
    try:
        storage = storage_dtype(entry["dtype"])
    except ValueError as err:
        raise DumpError(f"{path}: {where}: {err}") from None
    _need(entry.get("storage", storage.name) == storage.name, path,
          f"{where}: storage {entry.get('storage')!r} is not {storage.name} "
          f"(the storage of {entry['dtype']})")  # fmt: skip
    shape = entry["shape"]
    good = all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape)
    _need(good and len(shape) <= 16, path, f"{where}: bad shape {shape!r}")
    name = entry["file"]
    _need(name == os.path.basename(name) and name.endswith(".npz") and not name.startswith("."),
          path, f"{where}: file {name!r} is not an .npz name inside the dump")  # fmt: skip
    it = entry.get("iteration", [])
    _need(isinstance(it, list) and all(isinstance(v, int) for v in it), path,
          f"{where}: bad iteration {it!r}")  # fmt: skip
    for field in ("site", "gemm", "operand"):
        v = entry.get(field)
        _need(v is None or isinstance(v, str), path, f"{where}: {field} is not a string")
    fields = {f.name for f in dataclasses.fields(Tensor)} | {"storage"}
    return Tensor(
        name=entry["name"], role=entry["role"], dtype=entry["dtype"], shape=tuple(shape),
        file=name, key=entry["key"], order=entry["order"], site=entry.get("site"),
        gemm=entry.get("gemm"), operand=entry.get("operand"),
        producer=str(entry.get("producer", "")), iteration=tuple(it),
        extra={k: v for k, v in entry.items() if k not in fields},
    )  # fmt: skip


def _load_npz(path: Path, max_bytes: int) -> Any:
    try:
        data = _io.read_bytes(path, max_bytes)
    except FileNotFoundError:
        raise DumpError(f"{path}: missing (the manifest lists it)") from None
    except OSError as err:
        raise DumpError(f"{path}: cannot be read ({err.strerror or err})") from None
    except _io.UnsafePathError as err:
        raise DumpError(str(err)) from None
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as err:
        raise DumpError(f"{path}: not a readable .npz archive ({type(err).__name__})") from None


def read_dump(path: str | os.PathLike) -> Dump:
    """The dump in directory ``path``; :class:`DumpError` (one line) if it is not one or is
    damaged."""
    path = Path(path)
    _need(path.is_dir(), path, "not a directory (a dump is a directory with manifest.json)")
    mpath = path / MANIFEST
    _need(mpath.exists(), path, "no manifest.json: not a dump, or a recording that did not "
          "finish")  # fmt: skip
    try:
        manifest = _io.read_json(mpath)
    except (_io.DamagedFileError, _io.UnsafePathError) as err:
        raise DumpError(str(err)) from None
    except OSError as err:
        raise DumpError(f"{mpath}: cannot be read ({err.strerror or err})") from None
    _need(isinstance(manifest, dict), mpath, "not a JSON object")
    _need(manifest.get("format") == FORMAT, mpath,
          f"format {manifest.get('format')!r} is not {FORMAT!r}")  # fmt: skip
    version = manifest.get("version")
    _need(isinstance(version, int) and not isinstance(version, bool), mpath,
          f"version {version!r} is not an integer")  # fmt: skip
    _need(version <= FORMAT_VERSION, mpath,
          f"version {version} is newer than this precisionlab reads ({FORMAT_VERSION}); "
          "upgrade precisionlab")  # fmt: skip
    _need(version >= 1, mpath, f"version {version} is not a version of the format (1..)")
    _need(manifest.get("kind") in ("step", "gemm"), mpath,
          f"kind {manifest.get('kind')!r} is not 'step' or 'gemm'")  # fmt: skip
    entries = manifest.get("tensors")
    _need(isinstance(entries, list), mpath, "field 'tensors' missing or not a list")
    _need(isinstance(manifest.get("gemms", []), list), mpath, "field 'gemms' is not a list")
    tensors = [_tensor(e, i, mpath) for i, e in enumerate(entries)]
    names = [t.name for t in tensors]
    _need(len(set(names)) == len(names), mpath, "two tensors share a name")
    declared: dict[str, int] = {}
    for t in tensors:
        size = int(np.prod(t.shape, dtype=np.int64)) * storage_dtype(t.dtype).itemsize
        declared[t.file] = declared.get(t.file, 0) + size
    arrays: dict[str, np.ndarray] = {}
    archives: dict[str, Any] = {}
    try:
        for t in tensors:
            if t.file not in archives:
                limit = declared[t.file] + 4096 * len(tensors) + (1 << 20)
                archives[t.file] = _load_npz(path / t.file, limit)
            z = archives[t.file]
            try:
                a = z[t.key]
            except KeyError:
                raise DumpError(f"{path / t.file}: has no array {t.key!r} ({t.name})") from None
            except (zipfile.BadZipFile, ValueError, OSError, EOFError) as err:
                raise DumpError(
                    f"{path / t.file}: array {t.key!r} ({t.name}) is damaged ({type(err).__name__})"
                ) from None
            want = storage_dtype(t.dtype)
            _need(a.dtype == want and tuple(a.shape) == t.shape, path / t.file,
                  f"array {t.key!r} ({t.name}) is {a.dtype}{list(a.shape)}, the manifest says "
                  f"{want}{list(t.shape)}")  # fmt: skip
            arrays[t.name] = from_storage(a, t.dtype)
    finally:
        for z in archives.values():
            z.close()
    return Dump(path, manifest, tensors, arrays)
