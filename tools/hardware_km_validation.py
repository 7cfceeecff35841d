"""Run Khattak and Mikaitis' published GPU outputs through ``hardware.mma`` (a tool, not a
test: the data are not in this project).

    PYTHONPATH=$PWD python tools/hardware_km_validation.py REPO [GPU ...]

REPO: a clone (or bare git directory) of github.com/north-numerical-computing/MATLAB-tensor-core
(BSD-2-Clause), whose ``model_validation/<GPU>/<format>/`` holds, per GPU and input format,
5000 single-instruction samples ``d = a . b + c`` as the GPU computed them: ``a_*``/``b_*``
(K inputs a line, float32 hex), ``c_*_fp32`` and ``d_*_fp32`` (float32 bit strings). K is
one instruction's: V100 4, A100/Ada/L40S 8 (16-bit) or 32 (FP8), H100/H200/B200 16 or 32.
Their validation script reads C as zero for H100/H200 FP8; so does this one. Every sample
is computed by ``mma`` with the profile of the GPU's architecture (Ada and L40S: l40s;
H200: h100) and compared bit for bit; float16-output files and TF32 are not modelled. For
B200 FP8 a second row runs the same step with ``accumulator_in_alignment=False`` (the 32
products aligned and cut without C, C added after in float32 to nearest), which is also
what the profile gives for C = 0 followed by a float32 addition of C.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np

from precisionlab import hardware as hw

FORMATS = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "E4M3": ml_dtypes.float8_e4m3fn,
           "E5M2": ml_dtypes.float8_e5m2}  # fmt: skip
DEVICES = {"V100": "v100", "A100": "a100", "A2": "a100", "Ada": "l40s", "L40S": "l40s",
           "H100": "h100", "H200": "h100", "B200": "b200"}  # fmt: skip


def _read(repo: pathlib.Path, path: str) -> str | None:
    if (repo / path).is_file():
        return (repo / path).read_text()
    out = subprocess.run(["git", "-C", str(repo), "show", f"HEAD:{path}"],
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout if out.returncode == 0 else None


def _hex(text: str) -> np.ndarray:
    rows = [[int(t, 16) for t in line.split()] for line in text.splitlines() if line.strip()]
    return np.array(rows, np.uint32).view(np.float32)


def _bits(text: str) -> np.ndarray:
    return np.array([int(t, 2) for t in text.split()], np.uint32).view(np.float32)


def _one(device: str, **overrides):
    def f(a, b, c):
        return hw.mma(a[None], b[:, None], c[None, None], device, **overrides)[0, 0]

    return jax.jit(jax.vmap(f))


def check(repo: pathlib.Path, gpu: str, fmt: str, **overrides) -> tuple[int, int, int] | None:
    """(K, samples, bit-exact samples) of one GPU and format, or None without data;
    ``overrides``: Step fields for ``mma``."""
    base = f"model_validation/{gpu}/{fmt}"
    texts = [_read(repo, f"{base}/{x}_{gpu}_{fmt}.txt") for x in "ab"]
    d_text = _read(repo, f"{base}/d_{gpu}_fp32.txt")
    if None in texts or d_text is None:
        return None
    a, b, d = _hex(texts[0]), _hex(texts[1]), _bits(d_text)
    if gpu in ("H100", "H200") and fmt in ("E4M3", "E5M2"):
        c = np.zeros_like(d)  # as their Validate_TC_models.m (wgmma: D = A B + 0)
    else:
        c = _bits(_read(repo, f"{base}/c_{gpu}_fp32.txt"))
    dt = FORMATS[fmt]
    ad, bd = a.astype(dt), b.astype(dt)
    if not (np.array_equal(ad.astype(np.float32), a) and np.array_equal(bd.astype(np.float32), b)):
        raise ValueError(f"{gpu} {fmt}: inputs not exact in {np.dtype(dt).name}")
    y = np.asarray(_one(DEVICES[gpu], **overrides)(ad, bd, c))
    return a.shape[1], len(d), int(np.sum(y.view(np.uint32) == d.view(np.uint32)))


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    repo = pathlib.Path(argv[0])
    gpus = argv[1:] or list(DEVICES)
    print("| GPU | inputs | K | profile | bit-exact |\n|---|---|---:|---|---:|")
    for gpu in gpus:
        for fmt in FORMATS:
            r = check(repo, gpu, fmt)
            if r is not None:
                k, n, same = r
                print(f"| {gpu} | {fmt} | {k} | {DEVICES[gpu]} | {same} / {n} |")
            if r is not None and gpu == "B200" and fmt in ("E4M3", "E5M2"):
                k, n, same = check(repo, gpu, fmt, accumulator_in_alignment=False)
                print(f"| {gpu} | {fmt} | {k} | {DEVICES[gpu]}, C added after the products "
                      f"(accumulator_in_alignment=False) | {same} / {n} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
