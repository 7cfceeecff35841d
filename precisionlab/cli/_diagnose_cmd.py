"""``precisionlab diagnose``: find where a variant's precision breaks (compare, bisect,
autoswitch; each writes report.md, result.json and plots into a run directory), or forecast
it (``--forecast RUN_DIR``: forecast.json and forecast.md)."""

from __future__ import annotations

import argparse
import sys

from precisionlab.cli._common import Flag, UsageError, add_flags, check_out_dir, switch

HELP = (
    "find the layer and step where precision breaks: --compare, --bisect or --autoswitch; "
    "or forecast it: --forecast RUN_DIR"
)

#: diagnose's modes, one at a time (a mutually exclusive group).
_MODES = (
    Flag(
        "--compare",
        "run two variants in lockstep; report the first tensor that differs",
        metavar=("REF", "OTHER"),
        nargs=2,
    ),
    Flag(
        "--bisect",
        "smallest set of layers whose return to high precision makes FAIL pass",
        metavar=("FAIL", "PASS"),
        nargs=2,
    ),
    Flag(
        "--autoswitch",
        "train a recipe variant, switching each matmul to high precision when it goes bad",
        metavar="VARIANT",
    ),
    Flag(
        "--forecast",
        "forecast divergence from a run's predictors (a run directory; an experiment "
        "file is run first): alarms per unit and, on a suite, precision/recall/lead",
        metavar="RUN_DIR",
    ),
)
#: The options of every mode.
_COMMON = (
    Flag(
        "--set",
        "override a key of the file, as for `precisionlab run`",
        metavar="KEY.PATH=VALUE",
        default=[],
        action="append",
        dest="overrides",
    ),
    Flag("--steps", "steps per run (default: the variants')", type=int),
    Flag("--out", "run directory (default runs/NAME-diagnose-TIME)", metavar="DIR"),
    switch("--quiet", "no progress on stderr"),
    switch("--no-plots", "report.md without plots"),
)
#: The options of one mode each, by mode (their --help group), in --help's order.
_OF_MODE = {
    "compare": (
        Flag("--threshold", "relative difference that breaks (default 0.1)", type=float),
        Flag("--every", "compare every N steps (default 1)", type=int),
    ),
    "bisect": (
        Flag("--tolerance", "pass: final loss <= PASS's + tolerance (default 0.05)", type=float),
        Flag("--tail", "steps averaged into the final loss (default 10)", type=int),
        Flag("--layers", "candidate layers (default all), e.g. 'layer*'", metavar="GLOB[,GLOB...]"),
    ),
    "forecast": (
        switch(
            "--fit",
            "refit the rules' thresholds on the suite's fitting settings first (writes "
            "forecast_model.json beside the report)",
        ),
        Flag("--model", "a forecaster model (default: the frozen one)", metavar="JSON"),
        switch("--no-bisect", "skip the bisect runs that check the alarms' layers"),
        switch(
            "--quick",
            "with an experiment file: run its [diagnose] forecast_quick subset (no bisect)",
        ),
    ),
    "autoswitch": (
        Flag("--underflow", "switch above this underflow (default 0.05)", type=float),
        Flag("--mse", "switch above this quantization MSE (default 1e-4)", type=float),
    ),
}


def _dest(flag: Flag) -> str:
    return flag.name.removeprefix("--").replace("-", "_")


#: The options of --compare, --bisect and --autoswitch -> the mode each applies to.
_ONLY = {
    _dest(flag): mode for mode, flags in _OF_MODE.items() if mode != "forecast" for flag in flags
}
#: The flags of --forecast only.
_FORECAST_ONLY = tuple(_dest(flag) for flag in _OF_MODE["forecast"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", nargs="?", help="experiment file (TOML, kind = 'train'); not with --forecast"
    )
    add_flags(parser.add_mutually_exclusive_group(), _MODES)
    add_flags(parser, _COMMON)
    for mode, flags in _OF_MODE.items():
        add_flags(parser.add_argument_group(mode), flags)


def _options(args: argparse.Namespace, mode: str, defaults: dict) -> object:
    """The typed options of ``mode`` from the file's ``[diagnose]`` table (``defaults``)
    overridden by the flags (ValueError for bad values)."""
    from precisionlab import diagnose as d
    from precisionlab._schema import coerce
    from precisionlab.experiments._config import DIAGNOSE_SCHEMA

    given = {k: v for k, v in defaults.items() if _ONLY.get(k) == mode}
    for flag, owner in _ONLY.items():
        if getattr(args, flag) is not None and owner != mode:
            raise UsageError(f"--{flag} applies to --{owner}, not --{mode}")
    # The counting flags in the range of the file's [diagnose] tail (--tail 1e18 passed); the
    # options check the thresholds.
    count = DIAGNOSE_SCHEMA["tail"]
    for key in ("tail", "every", "steps"):
        if getattr(args, key, None) is not None:
            coerce(getattr(args, key), count, f"--{key}")
    given.update({k: getattr(args, k) for k in _ONLY if getattr(args, k) is not None})
    given["steps"] = args.steps
    if mode == "compare":
        return d.CompareOptions(**given)
    if mode == "bisect":
        if "layers" in given:
            given["layers"] = tuple(p.strip() for p in given["layers"].split(",") if p.strip())
            if not given["layers"]:  # an empty value (an unset shell variable) is not "all"
                raise UsageError(
                    "--layers names no layer; give layer names or globs (e.g. 'layer*'), or "
                    "leave the flag out for every layer"
                )
        return d.BisectOptions(**given)
    return d.SwitchOptions(**given)


def _forecast(args: argparse.Namespace) -> int:
    from pathlib import Path

    from precisionlab.diagnose import ForecastOptions, forecast_command

    if args.config:
        raise UsageError("--forecast takes the run directory (or experiment file) itself")
    for flag, owner in _ONLY.items():
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag} applies to --{owner}, not --forecast")
    target = Path(args.forecast)
    if not target.exists():
        raise UsageError(f"--forecast {args.forecast}: no such run directory or experiment file")
    if target.is_dir() and (args.quick or args.overrides):
        raise UsageError("--quick and --set apply to an experiment file, not a run directory")
    if args.steps is not None:
        raise UsageError("--steps does not apply to --forecast (use --set train.steps=N)")

    def say(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    options = ForecastOptions(
        quick=args.quick, fit=args.fit, model=args.model, bisect=not args.no_bisect
    )
    path, _result, text = forecast_command(
        target, options, out=args.out, overrides=args.overrides, quiet=args.quiet, say=say
    )
    print(text)
    print(f"\nreport: {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    from precisionlab import diagnose as d

    if args.forecast:
        return _forecast(args)
    for flag in _FORECAST_ONLY:
        if getattr(args, flag, None):
            raise UsageError(f"--{flag.replace('_', '-')} applies to --forecast")
    mode = next((m for m in ("compare", "bisect", "autoswitch") if getattr(args, m)), None)
    if mode is None:
        raise UsageError(
            "give one of --compare REF OTHER, --bisect FAIL PASS, --autoswitch VARIANT, "
            "--forecast RUN_DIR"
        )
    if not args.config:
        raise UsageError(f"--{mode} needs the experiment file (CONFIG)")
    check_out_dir(args.out, new=True)
    names = [args.autoswitch] if mode == "autoswitch" else list(getattr(args, mode))
    experiment, units = d.load_units(args.config, names, args.overrides)
    options = _options(args, mode, experiment.resolved.get("diagnose", {}))

    def say(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    record = {
        "source": experiment.source,
        "overrides": list(args.overrides),
        "mode": mode,
        "variants": [u.name for u in units],
        "options": vars(options) if hasattr(options, "__dict__") else {},
        "document": experiment.document,
    }
    d.check(mode, units, options)  # bad layers or a variant without a recipe: before any work
    run_dir = d.open_run(args.out, f"{experiment.name}-diagnose", record)
    plots = not args.no_plots
    if mode == "compare":
        result = d.compare(*units, options, say=say, dump=run_dir / "tensors.npz")
        path, text = d.write_compare(run_dir, result, plots=plots)
    elif mode == "bisect":
        result = d.bisect(*units, options, say=say)
        path, text = d.write_bisect(run_dir, result, plots=plots)
    else:
        result = d.autoswitch(units[0], options, say=say)
        path, text = d.write_autoswitch(run_dir, result, plots=plots)
    print(text)
    print(f"\nrun directory: {run_dir}\nreport: {path}")
    return 0
