"""Measure on a GPU what the consistency lab predicts from a laptop (not run yet: no GPU was
available when it was written; its results go into docs/guides/consistency.md when run).

    python tools/consistency_gpu.py --out DIR [--params runs/.../mismatch/params.npz]
    python tools/consistency_gpu.py --cpu-check --out DIR     # the same code, tiny, on CPU

It writes ``DIR/consistency_gpu.json`` and ``DIR/consistency_gpu.md``:

1. batch invariance measured on the device: rows of ``A[:M] @ B`` (jax.jit, XLA's GEMMs)
   for M in 1..256 at several (N, K) and dtypes, and the built-in transformer's logits in
   batches of M rows; beside them, what ``precisionlab.consistency.predict`` says ("unknown");
2. the summation order of XLA's reduce and dot on the device (FPRev's probes), compared with
   the h100-xla model's schedule;
3. the real trainer vs sampler gap on the device (the mismatch experiment's model and
   stacks, natively), and how many of the trainer's logits the h100-xla model (emulate, run
   on the same device) reproduces bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's precisionlab


def _env() -> dict:
    import jax

    dev = jax.devices()[0]
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "devices": jax.device_count(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _model(args):
    """The mismatch experiment's model: its trained params if given, else trained here."""
    import jax

    from precisionlab.experiments import _mismatch_kind as mismatch_kind
    from precisionlab.train import TrainConfig, make_model, train

    table = dict(mismatch_kind.DEFAULT_TRAIN)
    if args.cpu_check:
        table.update(model_kwargs={"d_model": 8, "depth": 1, "heads": 2}, steps=1,
                     warmup_steps=0, batch_size=2, eval_batches=1, checkpoint_interval=0,
                     data_kwargs={"seq_len": 4, "max_bytes": 8192})  # fmt: skip
    cfg = TrainConfig.from_dict(table, "train")
    sizes = mismatch_kind._model_sizes(cfg)
    model = make_model(cfg.model, **cfg.model_kwargs, **sizes)
    if args.params:
        params = mismatch_kind._load_params(Path(args.params), model.param_shapes())
        source = args.params
    else:
        params = jax.device_get(train(cfg, quiet=True).state.params)
        source = f"trained here, {cfg.steps} steps"
    tokens = mismatch_kind._eval_tokens(cfg, 4 if args.cpu_check else 8, 0)
    return model, params, tokens, source


def invariance(args, model, params, tokens) -> dict:
    from precisionlab.consistency import measure_gemm, measure_model, predict

    ms = [1, 2, 3] if args.cpu_check else [1, 2, 3, 4, 8, 16, 32, 64, 128, 256]
    shapes = [(8, 32)] if args.cpu_check else [(256, 512), (1024, 4096), (4096, 4096)]
    out = {"gemm": [], "model": [], "predicted": []}
    for dtype in ("float32", "bfloat16", "float16"):
        for n, k in shapes:
            r = measure_gemm(ms, n, k, dtype)
            out["gemm"].append({**r.__dict__, "verdict": r.verdict})
            if dtype != "float32":
                p = predict("h100-xla", ms, n, k, dtype, stake=False)
                out["predicted"].append({"dtype": dtype, "n": n, "k": k, "verdict": p.verdict})
        mm = [m for m in ms if m <= tokens.shape[0]]
        if len(mm) >= 2 and (dtype == "float32" or not args.cpu_check):
            r = measure_model(model, params, tokens, mm, dtype)
            out["model"].append(r.__dict__)
    return out


def orders(args) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from precisionlab.consistency import masking_values, reveal, schedule_tree

    cases = [("sum", "float32", 256, 1), ("sum", "bfloat16", 256, 1),
             ("dot", "float16", 64, 64), ("dot", "float16", 256, 64),
             ("dot", "bfloat16", 512, 64), ("dot", "float16", 4096, 64),
             ("dot", "float16", 256, 1)]  # fmt: skip
    if args.cpu_check:
        cases = [("sum", "float32", 16, 1), ("dot", "float16", 32, 2)]
    out = []
    for op, dtype, k, mn in cases:
        large, small = masking_values(dtype)
        if op == "sum":
            f = jax.jit(jnp.sum)

            def fn(x, f=f, dtype=dtype):
                return float(f(jnp.asarray(x, dtype)))
        else:
            g = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
            b = jnp.ones((k, mn), dtype)
            zeros = np.zeros((mn, k))

            def fn(x, g=g, b=b, zeros=zeros, dtype=dtype):
                a = zeros.copy()
                a[0] = x
                return float(g(jnp.asarray(a, dtype), b)[0, 0])

        start = time.perf_counter()
        try:
            tree = reveal(fn, k, large=large, small=small)
        except ValueError as err:
            out.append({"op": op, "dtype": dtype, "k": k, "m_n": mn, "error": str(err)})
            continue
        row = {
            "op": op, "dtype": dtype, "k": k, "m_n": mn, "probes": tree.probes,
            "tree": tree.to_json(), "text": tree.text(),
            "seconds": time.perf_counter() - start,
        }  # fmt: skip
        if op == "dot" and dtype != "float32":
            diff = schedule_tree("h100-xla", k, dtype).diff(tree)
            row["h100_xla_model"] = "matches" if diff is None else f"differs: {diff}"
        out.append(row)
    return out


def gaps(args, model, params, tokens) -> dict:
    import numpy as np

    from precisionlab.consistency import Runner, Stack, gap_from_logits

    runner = Runner(model, params)
    out = {"pairs": [], "emulated_vs_device": []}
    for fmt in ("bf16",) if args.cpu_check else ("fp32", "bf16", "fp16"):
        a = Stack(policy=fmt)
        b = Stack(policy=fmt, mode="decode", batch_size=2 if args.cpu_check else 4)
        ra, rb = runner.run(a, tokens), runner.run(b, tokens)
        g = gap_from_logits(tokens, ra.logits, rb.logits, a, b)
        out["pairs"].append(g.summary())
        # the h100-xla model of the trainer's run, emulated on this device, against the device
        e = runner.run(Stack(policy=fmt, hardware="h100-xla"), tokens)
        x, y = np.asarray(ra.logits), np.asarray(e.logits)
        same = np.mean(x.view(f"u{x.dtype.itemsize}") == y.view(f"u{y.dtype.itemsize}"))
        out["emulated_vs_device"].append({"format": fmt, "logits_bitwise_equal": float(same)})
    return out


def markdown(res: dict) -> str:
    env = res["environment"]
    lines = [
        f"# consistency_gpu on {env['device']} ({env['backend']}, jax {env['jax']}, {env['time']})",
        "",
        "## Batch invariance (rows of A[:M] @ B, vs M = 1)",
        "",
    ]
    for r in res["invariance"]["gemm"]:
        lines.append(f"- {r['dtype']} N={r['n']} K={r['k']}: {r['verdict']}")
    for r in res["invariance"]["model"]:
        lines.append(f"- model {r['stack']}: differ {r['differ']}")
    lines += ["", "## Summation orders", ""]
    for r in res["orders"]:
        what = r.get("error") or f"{r['probes']} probes: {r['text'][:300]}"
        extra = f" (h100-xla model: {r['h100_xla_model']})" if "h100_xla_model" in r else ""
        lines.append(f"- {r['op']} {r['dtype']} K={r['k']} M=N={r['m_n']}: {what}{extra}")
    lines += ["", "## Trainer vs sampler on the device", ""]
    for p in res["gaps"]["pairs"]:
        lines.append(f"- {p['a']} vs {p['b']}: RMS {p['rms_nats']:.3g} nats, max "
                     f"{p['max_nats']:.3g}, flips {p['flip_rate']:.2%}")  # fmt: skip
    for e in res["gaps"]["emulated_vs_device"]:
        lines.append(f"- h100-xla model vs the device, {e['format']} trainer logits: "
                     f"{e['logits_bitwise_equal']:.2%} bitwise equal")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "consistency_gpu_out"))
    parser.add_argument("--params", default=None, help="params.npz of an rl_mismatch run")
    parser.add_argument("--cpu-check", action="store_true", help="tiny sizes, any backend")
    args = parser.parse_args(argv)
    import jax

    if not args.cpu_check and jax.default_backend() != "gpu":
        parser.error(f"no GPU (backend {jax.default_backend()!r}); use --cpu-check to test")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model, params, tokens, source = _model(args)
    res = {"environment": _env(), "params": source}
    res["invariance"] = invariance(args, model, params, tokens)
    res["orders"] = orders(args)
    res["gaps"] = gaps(args, model, params, tokens)
    res["seconds"] = time.perf_counter() - start
    (out / "consistency_gpu.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "consistency_gpu.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
