"""Capture, on a GPU, what XLA's FP8 Triton GEMMs at a 32 x 32 output compute, slice by slice.

Not a test: a GPU session runs it (``python THIS.py OUT_DIR``) with ``XLA_FLAGS=--xla_dump_to=...``
set, and copies what the tests need into tests/data/. The three GEMMs ``xla_P4_fp8_{512,2048,8192}``
of h100_gemm.npz (32 x K x 32, E4M3, float32 output) were not reproduced from their outputs alone:
their HLO fixes the split-K slices (16 x 32, 32 x 64, 64 x 128) but not the arithmetic inside a
slice. This script runs the same shapes (so XLA picks the same kernels) on inputs that isolate it:

- ``full_{K}``: the captured inputs again (the run is repeatable if these equal the old capture);
- ``slice_{K}_{j}``: the captured inputs with every k outside slice j zeroed (the split-K
  reduction then adds exact zeros, so the output is the slice's own result, rounded to float32);
- ``first_{K}_{n}``: only the first n k of slice 0 nonzero, n = 1, 2, 4, 8, 16, 32 (the step
  width: where the result stops being one correctly rounded sum);
- ``rand_{K}_{r}``: fresh random inputs in slice 0 only (more data for a search).

Each ``*_a`` / ``*_b`` is the uint8 view of the E4M3 inputs, the result is float32. ``hlo_{K}``
is the compiled HLO text. Written to OUT_DIR/xla_fp8_slices.npz and .json (copied to
tests/data/h100_xla_fp8_slices.*).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

E4 = ml_dtypes.float8_e4m3fn
SLICE = {512: 32, 2048: 64, 8192: 128}
DIMS = (((1,), (0,)), ((), ()))


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = np.load(Path(__file__).with_name("h100_gemm.npz"))
    save: dict[str, np.ndarray] = {}
    info: dict[str, object] = {"jax": jax.__version__, "devices": str(jax.devices())}
    f = jax.jit(lambda x, y: jax.lax.dot_general(x, y, DIMS, preferred_element_type=jnp.float32))

    def only(keep: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.where(keep, a, 0).astype(E4), np.where(keep[:, None], b, 0).astype(E4)

    def run(tag: str, a: np.ndarray, b: np.ndarray) -> None:
        save[f"{tag}_a"], save[f"{tag}_b"] = a.view(np.uint8), b.view(np.uint8)
        save[tag] = np.asarray(f(jnp.asarray(a), jnp.asarray(b)))

    for K, s in SLICE.items():
        a = src[f"a_P4_fp8_{K}"].view(E4)
        b = src[f"b_P4_fp8_{K}"].view(E4)
        info[f"hlo_{K}"] = f.lower(a, b).compile().as_text()
        run(f"full_{K}", a, b)
        info[f"full_{K}_equals_capture"] = bool(
            np.array_equal(save[f"full_{K}"], src[f"xla_P4_fp8_{K}"])
        )
        for j in (0, 1, K // s - 1):
            keep = np.zeros(K, bool)
            keep[j * s : (j + 1) * s] = True
            run(f"slice_{K}_{j}", *only(keep, a, b))
        for n in (1, 2, 4, 8, 16, 32):
            keep = np.zeros(K, bool)
            keep[:n] = True
            run(f"first_{K}_{n}", *only(keep, a, b))
        rng = np.random.default_rng(K + 7)
        for r in range(4):
            ra = np.zeros((32, K))
            rb = np.zeros((K, 32))
            ra[:, :s] = np.exp2(rng.uniform(-8, 8, (32, s))) * rng.choice([-1, 1], (32, s))
            rb[:s] = np.exp2(rng.uniform(-8, 8, (s, 32))) * rng.choice([-1, 1], (s, 32))
            run(f"rand_{K}_{r}", ra.astype(E4), rb.astype(E4))
    np.savez_compressed(out / "xla_fp8_slices.npz", **save)
    (out / "xla_fp8_slices.json").write_text(json.dumps(info, indent=1))
    print({k: v for k, v in info.items() if not k.startswith("hlo")})


if __name__ == "__main__":
    main(sys.argv[1])
