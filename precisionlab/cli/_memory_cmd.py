"""``precisionlab memory``: where the memory of training goes, estimated and measured."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any

from precisionlab.cli._common import Flag, UsageError, add_flags, switch

HELP = "memory of training a model: weights, gradients, optimizer state, activations; vs XLA"


#: memory's options by --help group, in order.
_GROUPS = {
    "what to account": (
        Flag("--preset", "a model preset, e.g. gpt3-175b (see --list-presets)"),
        switch("--list-presets", "list the model presets"),
        Flag(
            "--measure",
            "estimate vs XLA's allocation for the train steps of an experiment file "
            "(per device with --zero-stage S / --dp N)",
            metavar="CONFIG",
        ),
    ),
    "training setup": (
        Flag("--policy", "precision policy (p=f32,c=f16)", default="p=f32,c=f16"),
        Flag("--optimizer", "adam, adamw, lion, momentum, sgd", default="adam"),
        Flag("--opt-dtype", "dtype of optimizer moments (default: param dtype)"),
        Flag("--grad-dtype", "dtype of gradients (default: compute dtype)"),
        Flag("--batch", "sequences per device per step", type=int, default=1),
        Flag("--seq", "sequence length (default: the model's)", type=int),
        Flag("--checkpoint-every", "checkpoint every K", metavar="K", type=int),
        Flag("--microbatches", "accumulate M", metavar="M", type=int, default=1),
        Flag("--zero-stage", "ZeRO stage 0-3", metavar="S", type=int, default=0),
        Flag("--dp", "data-parallel devices", metavar="N", type=int, default=1),
        switch("--dropout", "count dropout masks"),
        Flag(
            "--recipe",
            "low-precision matmul recipe (mxfp8, nvfp4, delayed, ...): count its FP8/FP4 "
            "copies, scales and amax history; with --measure, applied to every variant",
        ),
    ),
    "output": (
        Flag("--budget", "memory per device, e.g. 80GiB: does it fit?"),
        switch("--json", "print JSON instead of a table"),
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for title, flags in _GROUPS.items():
        add_flags(parser.add_argument_group(title), flags)


def run(args: argparse.Namespace) -> int:
    from precisionlab.memory import _presets as presets

    if args.list_presets:
        _setup(args)  # the other flags are still checked: a bad value is an error, not ignored
        _recipe(args)
        if args.budget:
            from precisionlab.memory._units import parse_size

            parse_size(args.budget)
        return _list_presets(args, presets)
    if args.measure:
        if args.preset:
            raise UsageError("give either --preset or --measure, not both")
        return _measure(args)
    if not args.preset:
        raise UsageError("name a model: --preset NAME (see --list-presets) or --measure CONFIG")
    return _estimate(args, presets.get_preset(args.preset))


def _list_presets(args: argparse.Namespace, presets: Any) -> int:
    specs = [presets.PRESETS[name] for name in presets.preset_names()]
    if args.json:
        print(json.dumps([dataclasses.asdict(s) for s in specs], indent=2))
        return 0
    print("GPT-3 family, Brown et al. 2020, Table 2.1 (n_ctx 2048, vocabulary 50257)")
    header = f"{'preset':<12} {'n_params':>16} {'layers':>6} {'d_model':>7} {'heads':>5} "
    print(header + f"{'d_head':>6} {'batch (tokens)':>14} {'lr':>8}")
    for s in specs:
        print(
            f"{s.name:<12} {s.n_params:>16,} {s.n_layers:>6} {s.d_model:>7} {s.n_heads:>5} "
            f"{s.d_head:>6} {s.batch_tokens:>14,} {s.learning_rate:>8.1e}"
        )
    return 0


def _setup(args: argparse.Namespace) -> Any:
    """The ``TrainSetup`` of the "training setup" flags: each of its fields is the flag of the
    same name (``--opt-dtype`` -> ``opt_dtype``), checked by ``TrainSetup`` itself."""
    from precisionlab.memory._estimate import TrainSetup

    return TrainSetup(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainSetup)})


def _dtype_label(dtype: Any) -> str:
    import numpy as np

    return np.dtype(dtype).name


def _labels(setup: Any) -> dict[str, str]:
    p, c = _dtype_label(setup.param_dtype), _dtype_label(setup.compute_dtype)
    return {
        "weights": f"weights ({c})",
        "master weights": f"master weights ({p})" if p != c else "master weights (none)",
        "gradients": f"gradients ({_dtype_label(setup.gradient_dtype)})",
        "gradient accumulator": f"gradient accumulator ({p})",
        "optimizer state": (
            f"optimizer state ({setup.optimizer}, {_dtype_label(setup.state_dtype)})"
        ),
    }


def _describe(model: Any, setup: Any) -> list[str]:
    seq = setup.seq or model.seq_len
    ckpt = (
        f"checkpoint every {setup.checkpoint_every}"
        if setup.checkpoint_every
        else "no checkpointing"
    )
    return [
        f"{model.name}: {model.n_params:,} params, {model.n_layers} layers, d_model "
        f"{model.d_model}, {model.n_heads} heads x {model.d_head}, vocab {model.vocab}",
        f"policy {setup.policy}, {setup.optimizer}, batch {setup.batch} x seq {seq}, {ckpt}",
        f"{setup.microbatches} micro-batch(es), dp {setup.dp}, ZeRO stage {setup.zero_stage}",
    ]


def _table(breakdown: Any, setup: Any) -> list[str]:
    labels = _labels(setup)
    n = breakdown.n_params
    lines = [
        f"{'':<40} {'bytes':>17} {'GB (1e9)':>11} {'GiB (2^30)':>11} {'bytes/param':>11}",
    ]
    for name, value in breakdown.rows():
        label = labels.get(name, name)
        if name == "total":
            lines.append("-" * len(lines[0]))
        lines.append(
            f"{label:<40} {value:>17,} {value / 1e9:>11.2f} {value / 2**30:>11.2f} "
            f"{value / n:>11.4g}"
        )
    lines.append(
        f"{'model states (weights..optimizer)':<40} {breakdown.model_states:>17,} "
        f"{breakdown.model_states / 1e9:>11.2f} {breakdown.model_states / 2**30:>11.2f} "
        f"{breakdown.bytes_per_param:>11.4g}"
    )
    return lines


def _estimate(args: argparse.Namespace, model: Any) -> int:
    from precisionlab.memory._estimate import estimate
    from precisionlab.memory._fit import fit
    from precisionlab.memory._units import parse_size

    setup = _setup(args)
    recipe = _recipe(args)
    budget = parse_size(args.budget) if args.budget else None
    breakdown = estimate(model, setup)
    extra = None
    if recipe is not None:
        from precisionlab.memory._recipe import model_gemms, recipe_memory

        extra = recipe_memory(recipe, model_gemms(model, setup))
    result = fit(model, setup, budget) if budget is not None else None
    if args.json:
        doc: dict[str, Any] = {
            "model": model.name,
            "setup": {
                "policy": str(setup.policy),
                "optimizer": setup.optimizer,
                "opt_dtype": _dtype_label(setup.state_dtype),
                "grad_dtype": _dtype_label(setup.gradient_dtype),
                "batch": setup.batch,
                "seq": setup.seq or model.seq_len,
                "checkpoint_every": setup.checkpoint_every,
                "microbatches": setup.microbatches,
                "zero_stage": setup.zero_stage,
                "dp": setup.dp,
                "dropout": setup.dropout,
            },
            "bytes": breakdown.to_dict(),
        }
        if result is not None:
            doc["budget"] = result.to_dict()
        if extra is not None:
            doc["recipe"] = {**extra.to_dict(), "total_with_recipe": breakdown.total + extra.total}
        print(json.dumps(doc, indent=2))
        return _budget_status(result)
    lines = [*_describe(model, setup), "", *_table(breakdown, setup)]
    if extra is not None:
        lines += ["", *_recipe_table(extra, breakdown, recipe, model, setup)]
    if result is not None:
        lines.append("")
        lines.extend(_fit_lines(result, args.budget))
    sys.stdout.write("\n".join(lines) + "\n")
    return _budget_status(result)


def _recipe(args: argparse.Namespace) -> Any:
    """The recipe named by ``--recipe`` (parsed once, here), or None."""
    if args.recipe is None:
        return None
    from precisionlab.recipes import get_recipe

    return get_recipe(args.recipe)


def _recipe_table(extra: Any, breakdown: Any, recipe: Any, model: Any, setup: Any) -> list[str]:
    from precisionlab.memory._recipe import bits_per_element

    seq = setup.seq or model.seq_len
    tokens = (setup.batch // setup.microbatches) * seq
    d = model.d_model
    bits = " / ".join(f"{bits_per_element(recipe, k, r, d):.4g}" for k, r in
                      (("x", tokens), ("w", d), ("g", tokens)))  # fmt: skip
    n = breakdown.n_params
    lines = [
        f"recipe {extra.recipe}: bits per element x / w / g {bits}",
        "what it adds on the linear layers (qkv, proj, fc1, fc2), as hardware stores it:",
    ]
    total = breakdown.total + extra.total
    for name, value in [*extra.rows(), ("total with recipe", total)]:
        lines.append(
            f"{name:<46} {value:>17,} {value / 1e9:>9.2f} {value / 2**30:>10.2f} {value / n:>11.4g}"
        )
    return lines


def _measured_recipe_lines(rec: dict[str, Any]) -> list[str]:
    hw = rec["hardware"]
    return [
        f"  recipe {hw['recipe']}: arguments include its state ({rec['state_bytes']:,} bytes, "
        "estimated exactly above)",
        f"    hardware copies, estimated (XLA cannot see them: the emulation keeps the "
        f"high-precision operands): weights {hw['weight_codes'] + hw['weight_scales']:,}, "
        f"saved {hw['saved_codes'] + hw['saved_scales']:,}, transient {hw['transient']:,} bytes",
        f"    emulation, measured: temporaries {rec['temporaries']:,} bytes against "
        f"{rec['temporaries_without']:,} without the recipe "
        f"({rec['temporaries'] - rec['temporaries_without']:+,}: float32 fake-quantized copies)",
    ]


def _budget_status(result: Any) -> int:
    """Exit status: 1 when a budget was given and no change searched makes the run fit."""
    return 0 if result is None or result.fits or result.setup is not None else 1


def _fit_lines(result: Any, budget_text: str) -> list[str]:
    total = result.breakdown.total
    head = (
        f"budget {budget_text} = {result.budget:,} bytes per device: total {total / 2**30:.2f} GiB"
    )
    if result.fits:
        return [f"{head}: fits ({(result.budget - total) / 2**30:.2f} GiB to spare)"]
    if result.setup is None:
        return [f"{head}: does not fit, and no change searched makes it fit"]
    return [
        f"{head}: does not fit",
        f"smallest change that fits: {'; '.join(result.changes)}",
        f"  -> total {result.changed.total / 2**30:.2f} GiB ({result.changed.total / 1e9:.2f} GB)",
    ]


def _zero_devices(dp: int) -> None:
    """Check that the process has ``dp`` devices (host devices are set before JAX starts, by
    the caller: changing them here would change them for everything else in the process)."""
    import jax

    if dp < 1:
        raise UsageError(f"--dp must be >= 1, got {dp}")
    have = len(jax.local_devices())
    if have < dp:
        raise UsageError(
            f"--dp {dp} needs {dp} devices, this process has {have} "
            f"(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={dp})"
        )


def _measure(args: argparse.Namespace) -> int:
    from precisionlab.memory._builtin import measure_train_table

    try:
        from precisionlab.experiments._config import load_experiment
    except ImportError as err:  # pragma: no cover - the runner ships with the package
        raise UsageError(f"--measure needs precisionlab.experiments ({err})") from None
    experiment = load_experiment(args.measure)
    if experiment.kind != "train":
        raise UsageError(
            f"{args.measure}: --measure needs an experiment of kind 'train', "
            f"got {experiment.kind!r}"
        )
    from precisionlab.train import TrainConfig

    # The runner validated the tables; keys it adds beyond TrainConfig's are dropped here.
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    zero = args.zero_stage != 0 or args.dp != 1
    if zero:
        from precisionlab.memory._zero import measure_zero_table

        _zero_devices(args.dp)
    if args.recipe is not None:
        _recipe(args)  # a bad name is one error line before anything compiles
    seen: set[str] = set()
    reports = []
    for unit in experiment.units:
        table = {k: v for k, v in unit.params.items() if k in fields}
        if args.recipe:
            table["recipe"] = args.recipe
        # Variants that differ only in what does not change memory are measured once.
        same = {k: v for k, v in table.items() if k not in ("steps", "seed", "lr", "loss_weight")}
        key = json.dumps(same, sort_keys=True, default=str)
        if key in seen:
            continue
        seen.add(key)
        where = f"{args.measure}: {unit.name}"
        if zero:
            table.update(data_parallel=True, zero_stage=args.zero_stage)
            rep = measure_zero_table(table, where, zero_stage=args.zero_stage, dp=args.dp)
        else:
            rep = measure_train_table(table, where)
        reports.append((unit.name, rep))
    if args.json:
        print(json.dumps([{"unit": name, **rep} for name, rep in reports], indent=2))
        return 0
    for name, rep in reports:
        print(_wrap(f"{name}: {rep['description']}"))
        if zero:
            print(_zero_lines(rep))
            continue
        print(f"  {'':<14} {'estimated':>14} {'XLA':>14} {'XLA/est':>8}")
        for row in rep["rows"]:
            ratio = row["ratio"]
            text = "-" if ratio is None or math.isnan(ratio) else f"{ratio:.3f}"
            print(f"  {row['name']:<14} {row['estimated']:>14,} {row['measured']:>14,} {text:>8}")
        if rep.get("recipe"):
            print(*_measured_recipe_lines(rep["recipe"]), sep="\n")
        print(f"  backend {rep['backend']}, {rep['flops']:.3g} FLOPs per step")
    return 0


def _wrap(text: str, width: int = 100) -> str:
    """``text`` broken after ", " into lines of at most ``width`` columns (where its parts
    allow), the continuation lines indented: a report's heading fits the site's code blocks."""
    lines: list[str] = []
    for part in text.split(", "):
        if lines and len(lines[-1]) + 2 + len(part) < width:  # room for a final ","
            lines[-1] += ", " + part
        elif lines:
            lines[-1] += ","
            lines.append("  " + part)
        else:
            lines.append(part)
    return "\n".join(lines)


def _zero_lines(rep: dict[str, Any]) -> str:
    """The per-device table of :func:`precisionlab.memory._zero.measure_zero_table`."""
    lines = [f"  {'per device':<16} {'estimated':>13} {'XLA':>13} {'XLA/est':>8}"]
    for row in rep["rows"]:
        got = "-" if row["measured"] is None else f"{row['measured']:,}"
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        lines.append(f"  {row['name']:<16} {row['estimated']:>13,} {got:>13} {ratio:>8}")
    lines.append(
        f"  backend {rep['backend']}; XLA params / optimizer state: the compiled step's "
        "per-device argument shapes"
    )
    return "\n".join(lines)
