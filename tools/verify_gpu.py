"""Record a few low-precision steps on a GPU and verify them: ``precisionlab verify`` on real
hardware.

Run on a machine with an NVIDIA GPU (JAX with CUDA; torch optional), from the repository root:

    python tools/verify_gpu.py --out gpu-dumps        # records, verifies, prints a summary
    precisionlab verify gpu-dumps                      # the same check, anywhere, later

It records one step of a small MLP:

- ``delayed-native`` and ``current-native``: per-tensor FP8 recipes whose GEMMs run on the
  backend's own FP8 ``dot_general`` (XLA's FP8 path on the tensor cores, ``gemm="native"``),
  checked against the hardware model of the device (``h100-xla`` on an H100);
- ``mxfp8``, ``nvfp4``, ``blockwise``: the recipes' quantization on the GPU with their GEMMs
  emulated (checked bit for bit: the quantizers must compute on the GPU what they do on a CPU);
- ``current-h100-model``: current scaling with the H100 cuBLASLt model as its accumulator
  (the integer emulation of the tensor cores, run on the GPU: it must compute there what it
  computes on a CPU);
- ``plain-bf16``: a bfloat16 step with no recipe: XLA's own 16-bit GEMMs, checked against
  ``h100-xla``;
- with torch and CUDA: ``torch-scaled-mm``: the recorded FP8 codes of ``current-native``'s
  forward GEMMs through ``torch._scaled_mm`` (cuBLASLt) with and without fast
  accumulation, checked against ``h100-cublaslt`` and ``h100-cublaslt-fast``.

Everything is written under ``--out`` with ``summary.json`` (per dump: matched or not, the
first difference and its label). ``--cpu`` runs the same on the CPU (the project's tests do:
every dump must then match, with the ``xla-cpu`` model). Not run on a GPU yet: the result
goes into docs/guides/verify.md when it is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

RECIPES = ("delayed-native", "current-native", "current-h100-model", "mxfp8", "nvfp4",
           "blockwise", "plain-bf16")  # fmt: skip


def _mlp(width: int, batch: int):
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width), jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(batch, width)), jnp.float32)

    def loss(p, x):
        h = jax.nn.gelu(x @ p["w1"])
        return jnp.mean((h @ p["w2"]) ** 2)

    return loss, params, x


def record_all(out: Path, width: int, batch: int, names) -> list[Path]:
    """Record each named case under ``out`` (one dump directory each)."""
    import jax
    import jax.numpy as jnp

    from precisionlab import recipes, verify

    loss, params, x = _mlp(width, batch)
    paths = []
    for name in names:
        path = out / name
        kw: dict = {}
        if name == "delayed-native":
            kw = dict(recipe="delayed", gemm="native",
                      state=recipes.apply(loss, "delayed").init_state(params, x))  # fmt: skip
        elif name == "current-native":
            kw = dict(recipe="current", gemm="native")
        elif name == "current-h100-model":
            kw = dict(recipe=recipes.get_recipe("current", accumulate="h100-cublaslt"))
        elif name == "nvfp4":
            kw = dict(recipe="nvfp4", key=jax.random.PRNGKey(0))
        elif name == "plain-bf16":
            p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
            verify.record(loss, p16, x.astype(jnp.bfloat16), out=path, note=name)
            paths.append(path)
            continue
        else:
            kw = dict(recipe=name)
        verify.record(loss, params, x, out=path, note=name, **kw)
        paths.append(path)
    return paths


def torch_scaled_mm(src: Path, out: Path) -> Path | None:
    """The forward GEMMs of a per-tensor FP8 dump through torch._scaled_mm (cuBLASLt) with
    and without fast accumulation, written as a GEMM dump; None without torch and CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    import numpy as np

    from precisionlab import verify

    d = verify.read_dump(src)
    gemms = []
    for g in d.manifest["gemms"]:
        if g["pass"] != "fprop":
            continue
        gid = g["id"]
        a = np.asarray(d.arrays[f"{gid}/lhs/codes"])[0]  # (M, K) float8_e4m3fn
        b = np.asarray(d.arrays[f"{gid}/rhs/codes"])[0]  # (N, K)
        sa = float(np.asarray(d.arrays[f"{gid}/lhs/row_scale"]).reshape(()))
        sb = float(np.asarray(d.arrays[f"{gid}/rhs/row_scale"]).reshape(()))
        ta = torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn).cuda()
        tb = torch.from_numpy(b.view(np.uint8).copy()).view(torch.float8_e4m3fn).cuda()
        scale_a = torch.tensor(sa, device="cuda")
        scale_b = torch.tensor(sb, device="cuda")
        for fast, hw in ((False, "h100-cublaslt"), (True, "h100-cublaslt-fast")):
            y = torch._scaled_mm(ta, tb.t(), scale_a=scale_a, scale_b=scale_b,
                                 out_dtype=torch.float32, use_fast_accum=fast)  # fmt: skip
            gemms.append({"id": f"{gid}-fast{int(fast)}", "a": a, "b": b.T, "hardware": hw,
                          "out": y.cpu().numpy(), "scale_a": sa, "scale_b": sb})  # fmt: skip
    env = {"device_kind": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "backend": "gpu"}  # fmt: skip
    return verify.gemm_dump(out, gemms, environment=env, note="torch._scaled_mm")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="new directory for the dumps")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (the tests' path)")
    parser.add_argument("--width", type=int, default=256, help="MLP width (default 256)")
    parser.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    parser.add_argument("--only", default=",".join(RECIPES), help="cases, comma separated")
    args = parser.parse_args(argv)
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    from precisionlab import verify

    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(RECIPES))
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(RECIPES)}")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        parser.error(f"{out}: not empty; name a new directory")
    print(f"backend {jax.default_backend()}, device {jax.devices()[0].device_kind}",
          file=sys.stderr)  # fmt: skip
    paths = record_all(out, args.width, args.batch, names)
    if "current-native" in names and not args.cpu:
        extra = torch_scaled_mm(out / "current-native", out / "torch-scaled-mm")
        if extra is not None:
            paths.append(extra)
    summary = []
    for p in paths:
        rep = verify.check(p)
        print(rep.text(), "\n")
        summary.append({"dump": p.name, "ok": rep.ok, "share": rep.share(), "label": rep.label,
                        "first": None if rep.first is None else rep.first.name,
                        "detail": None if rep.first is None else rep.first.detail,
                        "not_checked": sum(t.status == "not checked" for t in rep.tensors),
                        "environment": rep.environment})  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    bad = [s["dump"] for s in summary if not s["ok"]]
    print(f"{len(summary)} dumps, {len(summary) - len(bad)} match" + (f"; differ: {bad}" if bad
          else ""))  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
