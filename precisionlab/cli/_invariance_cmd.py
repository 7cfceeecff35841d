"""``precisionlab invariance``: is a row's output bitwise the same when the batch size M
changes? Measured on the running backend for a sweep of GEMM shapes (and, with
``--model``, the built-in transformer's logits); predicted for named GPUs from the hardware
models, "unknown" wherever a library's kernel choice per M is not modelled."""

from __future__ import annotations

import argparse
import json
import textwrap

from precisionlab.cli._common import UsageError, shorten, split_list

HELP = "measure batch invariance of GEMMs (and a model) here; predict it for named GPUs"

_DTYPES = ("float32", "bfloat16", "float16")
_PREDICTABLE = ("bfloat16", "float16")
MAX_DIM = 16384
MAX_CASES = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--m", default="1,2,3,4,8,16,32,64",
                        help="batch sizes M, comma-separated (the smallest is the reference; "
                        "default 1,2,3,4,8,16,32,64)")  # fmt: skip
    parser.add_argument("--n", default="256", help="output columns N, comma-separated")
    parser.add_argument("--k", default="64,512,4096", help="contraction lengths K")
    parser.add_argument("--dtype", default="float32,bfloat16,float16",
                        help=f"operand dtypes ({', '.join(_DTYPES)})")  # fmt: skip
    parser.add_argument(
        "--predict", default="h100-xla,h100-cublaslt",
        help="hardware presets to predict for (16-bit dtypes), or 'none'",
    )  # fmt: skip
    parser.add_argument("--model", action="store_true",
                        help="also measure the built-in transformer's logits (random weights, "
                        "d_model 64, 2 blocks, 32 tokens) natively for each dtype")  # fmt: skip
    parser.add_argument("--predict-only", action="store_true",
                        help="skip the measurement on this backend")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object per line")


def _ints(text: str, flag: str, high: int) -> list[int]:
    out = []
    for item in split_list(text):
        try:
            v = int(item)
        except ValueError:
            raise UsageError(f"{flag}: {shorten(item)!r} is not an integer") from None
        if not 1 <= v <= high:
            raise UsageError(f"{flag}: {v} is out of range; allowed 1..{high}")
        out.append(v)
    if not out:
        raise UsageError(f"{flag}: give at least one value")
    return out


def _parse(args: argparse.Namespace) -> tuple:
    from precisionlab import hardware

    ms = sorted(set(_ints(args.m, "--m", 4096)))
    if len(ms) < 2:
        raise UsageError("--m: give at least two batch sizes to compare")
    ns = _ints(args.n, "--n", MAX_DIM)
    ks = _ints(args.k, "--k", MAX_DIM)
    dtypes = split_list(args.dtype)
    bad = [d for d in dtypes if d not in _DTYPES]
    if bad or not dtypes:
        raise UsageError(f"--dtype: unknown {shorten(bad[0] if bad else '')!r}; allowed: "
                         f"{', '.join(_DTYPES)}")  # fmt: skip
    presets = [] if args.predict.strip() == "none" else split_list(args.predict)
    for p in presets:
        try:
            hardware.canonical_preset(p)
        except ValueError as err:
            raise UsageError(f"--predict: {err}") from None
    if len(ns) * len(ks) * len(dtypes) > MAX_CASES:
        raise UsageError(f"--n x --k x --dtype gives {len(ns) * len(ks) * len(dtypes)} shapes; "
                         f"at most {MAX_CASES}")  # fmt: skip
    return ms, ns, ks, dtypes, presets


def _pct(x: float) -> str:
    return f"{x:.1%}" if x else "0"


def run(args: argparse.Namespace) -> int:
    ms, ns, ks, dtypes, presets = _parse(args)
    import jax

    from precisionlab._text import table
    from precisionlab.consistency import _invariance as invariance

    if args.predict_only and (args.model or not presets):
        raise UsageError("--predict-only: nothing to do with --model or --predict none")
    measured = [] if args.predict_only else [
        invariance.measure_gemm(ms, n, k, d) for d in dtypes for n in ns for k in ks
    ]  # fmt: skip
    models = []
    if args.model:
        import jax.numpy as jnp
        import numpy as np

        from precisionlab.train import make_model

        model = make_model("transformer", vocab_size=256, seq_len=32, d_model=64, depth=2,
                           heads=4)  # fmt: skip
        params = model.init(jax.random.PRNGKey(0))
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (max(ms), 32)), jnp.int32)
        for d in dtypes:
            models.append(invariance.measure_model(model, params, tokens, ms, d))
    predicted = [
        invariance.predict(p, ms, n, k, d)
        for p in presets for d in dtypes if d in _PREDICTABLE for n in ns for k in ks
    ]  # fmt: skip
    if args.json:
        import dataclasses

        for r in measured:
            print(json.dumps({"kind": "measured", **dataclasses.asdict(r),
                              "verdict": r.verdict}))  # fmt: skip
        for mr in models:
            print(json.dumps({"kind": "model", **dataclasses.asdict(mr),
                              "invariant": mr.invariant}))  # fmt: skip
        for pr in predicted:
            print(json.dumps({"kind": "predicted", **pr.to_dict()}))
        return 0
    ref = ms[0]
    rest = ms[1:]
    if measured:
        print(
            f"Measured on {invariance.backend_name()}, jax {jax.__version__}:\nthe rows of "
            f"M = {ref} against the same rows of A[:M] @ B, bit for bit (outputs that differ)"
        )
        rows = [[r.dtype, r.n, r.k, *r.differ[1:], r.verdict] for r in measured]
        print(table(rows, ["dtype", "N", "K", *(f"M={m}" for m in rest), "verdict"]))
    if models:
        print(f"\nThe built-in transformer's logits (rows of M = {ref}, 32 tokens, vocabulary "
              "256), evaluated in batches of M rows")  # fmt: skip
        rows = [[r.stack, *r.differ[1:], "invariant" if r.invariant else "varies"]
                for r in models]  # fmt: skip
        print(table(rows, ["stack", *(f"M={m}" for m in rest), "verdict"]))
    if predicted:
        print(("\n" if measured else "") + "Predicted for named GPUs (the hardware models; "
              "16-bit inputs)")  # fmt: skip
        # two tables (the schedule, then what is at stake), each within 100 columns
        rows, stakes = [], []
        for p in predicted:
            key = [p.preset, p.dtype, p.n, p.k]
            rows.append([*key, p.verdict, p.schedule or "-", p.with_one_kernel or "-"])
            worst = max(p.at_stake, key=lambda s: p.at_stake[s]) if p.at_stake else None
            if worst is None:
                stakes.append([*key, "-", "-", "-"])
            else:
                stakes.append([*key, _pct(p.at_stake[worst]), _pct(p.at_stake_out[worst]),
                               worst])  # fmt: skip
        print(table(rows, ["preset", "dtype", "N", "K", "verdict", "schedule at K",
                           "one kernel for all M"]))  # fmt: skip
        print(
            "\nAt stake if the schedule changes: the share of outputs that differ, in float32 "
            "and in\nthe output dtype, from the other schedule that changes the most"
        )
        print(table(stakes, ["preset", "dtype", "N", "K", "f32 changed", "output changed",
                             "other schedule"]))  # fmt: skip
        seen: dict[tuple[str, str], list[str]] = {}
        for p in predicted:
            names = seen.setdefault((p.verdict, p.why), [])
            if p.preset not in names:
                names.append(p.preset)
        for (verdict, why), names in seen.items():
            print(textwrap.fill(f"{', '.join(names)}: {verdict}: {why}", width=100,
                                subsequent_indent="  ", break_on_hyphens=False))  # fmt: skip
    return 0
