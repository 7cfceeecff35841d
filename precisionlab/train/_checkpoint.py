"""Checkpoints: atomic, bitwise, resumable.

A checkpoint is a directory ``step_<N>/`` holding ``arrays.npz`` (every leaf of the state pytree as
its raw bytes, viewed as unsigned integers so bfloat16/float8 survive) and ``meta.json`` (step,
leaf dtypes and shapes, and a caller's JSON-able ``extra``: the data position, divergence tracking,
aggregates). It is written to a temporary directory and renamed into place, so a killed process
leaves either the whole checkpoint or none. Loading needs a template state of the same structure
(the static parts of the pytree, e.g. the loss-scale config, come from the template).
"""

from __future__ import annotations

import io
import os
import pathlib
import secrets
import shutil
import zipfile
from typing import Any

import jax
import numpy as np

from precisionlab import _io

__all__ = [
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "remove_partial",
    "save_checkpoint",
]

_PREFIX = "step_"
_TMP = ".tmp_ckpt_"


def _raw(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize]
    return x.view(width)


def save_checkpoint(
    directory: str | os.PathLike,
    state: Any,
    *,
    step: int,
    extra: dict[str, Any] | None = None,
    keep: int | None = 2,
) -> pathlib.Path:
    """Write ``state`` (any pytree of arrays) as checkpoint ``step`` under ``directory``.

    Atomic (temp dir + rename; every file through :mod:`precisionlab._io`). Keeps the newest
    ``keep`` checkpoints (None: all) and removes the temporary directories a killed write left
    behind (``directory`` has one writer: a run holds its lock). Returns the checkpoint's path.
    """
    root = _io.makedirs(directory)  # no link followed below a confined run directory
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(state))]
    meta = {
        "step": int(step),
        "dtypes": [x.dtype.name for x in leaves],
        "shapes": [list(x.shape) for x in leaves],
        "extra": extra or {},
    }
    remove_partial(root)
    tmp = _io.makedirs(root / f"{_TMP}{secrets.token_hex(6)}")
    try:
        with _io.atomic_open(tmp / "arrays.npz", "wb") as f:
            np.savez(f, *[_raw(x) for x in leaves])
        _io.write_json(tmp / "meta.json", meta, indent=None)
        _io.fsync_dir(tmp)
        final = root / f"{_PREFIX}{int(step):08d}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _io.fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep is not None:
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def remove_partial(directory: str | os.PathLike) -> list[str]:
    """Remove the temporary directories (``.tmp_ckpt_*``) that writes killed midway left in
    ``directory``; returns their names. Only for a directory this process alone writes."""
    root = pathlib.Path(directory)
    if not root.is_dir():
        return []
    gone = []
    for p in root.iterdir():
        if p.name.startswith(_TMP) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p.name)
    return gone


def list_checkpoints(directory: str | os.PathLike) -> list[pathlib.Path]:
    """Complete checkpoints under ``directory``, oldest first."""
    root = pathlib.Path(directory)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir()
        and p.name.startswith(_PREFIX)
        and p.name[len(_PREFIX) :].isdigit()
        and (p / "meta.json").exists()
        and (p / "arrays.npz").exists()
    ]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def latest_checkpoint(directory: str | os.PathLike) -> pathlib.Path | None:
    """The newest complete checkpoint under ``directory``, or None."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


#: Bytes an ``.npz`` may hold beyond its arrays' data (zip entries and ``.npy`` headers).
_NPZ_SLACK = 4096


def _check_meta(meta: Any, where: str) -> None:
    ok = (
        isinstance(meta, dict)
        and isinstance(meta.get("step"), int)
        and isinstance(meta.get("dtypes"), list)
        and isinstance(meta.get("shapes"), list)
        and len(meta["dtypes"]) == len(meta["shapes"])
        and all(isinstance(d, str) for d in meta["dtypes"])
        and all(
            isinstance(sh, list) and all(isinstance(n, int) and 0 <= n < 2**48 for n in sh)
            for sh in meta["shapes"]
        )
        and isinstance(meta.get("extra", {}), dict)
    )
    if not ok:
        raise _io.DamagedFileError(
            f"{where}: not a checkpoint's meta.json (step, dtypes, shapes, extra)"
        )


def load_checkpoint(path: str | os.PathLike, template: Any) -> tuple[Any, int, dict[str, Any]]:
    """Load a checkpoint into the structure of ``template``.

    ``path`` is a checkpoint directory or a directory of checkpoints (the newest is taken).
    Returns ``(state, step, extra)``. Raises ValueError if the structure, dtypes or shapes differ;
    the files are read through :mod:`precisionlab._io` (regular files only, never a FIFO or
    device, and ``arrays.npz`` no larger than the template's arrays need).
    """
    path = pathlib.Path(path)
    if not (path / "meta.json").exists():
        latest = latest_checkpoint(path)
        if latest is None:
            raise ValueError(f"no checkpoint in {str(path)!r}")
        path = latest
    meta = _io.read_json(path / "meta.json")
    _check_meta(meta, os.fspath(path / "meta.json"))
    leaves, treedef = jax.tree_util.tree_flatten(template)
    if len(leaves) != len(meta["dtypes"]):
        raise ValueError(
            f"checkpoint {str(path)!r} has {len(meta['dtypes'])} arrays, the template {len(leaves)}"
        )
    wants = [np.asarray(t) if not hasattr(t, "dtype") else t for t in leaves]
    for i, (want, dtype, shape) in enumerate(
        zip(wants, meta["dtypes"], meta["shapes"], strict=True)
    ):
        if np.dtype(want.dtype).name != dtype or list(want.shape) != shape:
            raise ValueError(
                f"checkpoint leaf {i}: {dtype}{shape} does not match the template's "
                f"{np.dtype(want.dtype).name}{list(want.shape)}"
            )
    need = sum(int(np.prod(w.shape, dtype=np.int64)) * np.dtype(w.dtype).itemsize for w in wants)
    blob = _io.read_bytes(path / "arrays.npz", need + _NPZ_SLACK * (len(wants) + 1))
    out = []
    try:
        with np.load(io.BytesIO(blob), allow_pickle=False) as data:
            for i, (want, shape) in enumerate(zip(wants, meta["shapes"], strict=True)):
                raw = data[f"arr_{i}"]
                if (
                    raw.nbytes
                    != int(np.prod(shape, dtype=np.int64)) * np.dtype(want.dtype).itemsize
                ):
                    raise ValueError(f"arr_{i} holds {raw.nbytes} bytes")
                out.append(raw.view(np.dtype(want.dtype)).reshape(shape))
    except (ValueError, KeyError, OSError, EOFError, zipfile.BadZipFile) as err:
        raise _io.DamagedFileError(
            f"{path / 'arrays.npz'}: damaged checkpoint ({str(err).splitlines()[0][:120]})"
        ) from None
    return jax.tree_util.tree_unflatten(treedef, out), int(meta["step"]), meta["extra"]
