"""GEMMs computed elsewhere, written as a dump: each one's operands, output and the hardware
model (a preset of :data:`precisionlab.hardware.PRESETS`) that should reproduce it."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from precisionlab import hardware
from precisionlab.verify._format import DumpWriter, storage_dtype

__all__ = ["gemm_dump"]


def _dtype_name(x: np.ndarray, given: str | None, which: str) -> str:
    name = given or np.asarray(x).dtype.name
    try:
        storage_dtype(name)
    except ValueError:
        raise ValueError(f"{which}: unknown dtype {name!r}") from None
    return name


def gemm_dump(
    out: str | os.PathLike,
    gemms: Sequence[Mapping[str, Any]],
    *,
    environment: Mapping[str, Any] | None = None,
    note: str | None = None,
) -> Path:
    """Write GEMMs computed elsewhere as a dump that :func:`precisionlab.verify.check`
    recomputes.

    Each item of ``gemms`` is a mapping with ``id`` (a name), ``a`` (M, K) and ``b`` (K, N)
    (typed arrays: ml_dtypes FP8 or 16-bit, or raw codes with ``a_format``/``b_format``),
    ``out`` (M, N: what the device returned; float32, float16 or bfloat16), ``hardware`` (the
    preset that should reproduce it) and optionally ``scale_a``, ``scale_b`` (float32
    scalars, ``torch._scaled_mm``'s) and ``overrides`` (:func:`precisionlab.hardware.gemm`'s
    step and schedule fields). ``environment``: where they were computed (device, driver,
    library versions), kept in the manifest.
    """
    writer = DumpWriter(out)
    entries = []
    ids: set[str] = set()
    for i, g in enumerate(gemms):
        gid = g.get("id")
        if not isinstance(gid, str) or not gid or gid in ids:
            raise ValueError(f"gemms[{i}]: 'id' must be a new non-empty string, got {gid!r}")
        ids.add(gid)
        hw = hardware.canonical_preset(g.get("hardware"))
        a, b, o = (np.asarray(g[k]) for k in ("a", "b", "out"))
        if (
            a.ndim != 2
            or b.ndim != 2
            or a.shape[1] != b.shape[0]
            or o.shape != (a.shape[0], b.shape[1])
        ):
            raise ValueError(f"gemms[{i}] ({gid}): shapes {a.shape} x {b.shape} -> {o.shape}")
        entry: dict[str, Any] = {"id": gid, "model": "hardware", "hardware": hw}
        for k in ("scale_a", "scale_b"):
            if g.get(k) is not None:
                entry[k] = float(np.float32(g[k]))
        ov = dict(g.get("overrides") or {})
        entry["overrides"] = {k: list(v) if isinstance(v, tuple) else v for k, v in ov.items()}
        entries.append(entry)
        meta = dict(gemm=gid)
        writer.add(f"{gid}/a", a, _dtype_name(a, g.get("a_format"), f"{gid}/a"), "input",
                   operand="lhs", producer="capture", **meta)  # fmt: skip
        writer.add(f"{gid}/b", b, _dtype_name(b, g.get("b_format"), f"{gid}/b"), "input",
                   operand="rhs", producer="capture", **meta)  # fmt: skip
        writer.add(f"{gid}/out", o, _dtype_name(o, None, f"{gid}/out"), "output",
                   producer="device GEMM", **meta)  # fmt: skip
    header: dict[str, Any] = {
        "kind": "gemm",
        "environment": dict(environment or {}),
        "step": {"mode": "gemm", "recipe": None, "hardware": None},
        "gemms": entries,
    }
    if note is not None:
        header["note"] = str(note)
    return writer.write(header)
