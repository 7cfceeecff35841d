"""``precisionlab survey``: the error of every format on every input, side by side."""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib

from precisionlab import survey
from precisionlab._schema import read_toml
from precisionlab.cli._common import UsageError, split_list

HELP = "error of each format (int8, fp8, MX, ...) on synthetic or your own tensors, side by side"

_EPILOG = """\
distributions: normal, laplace, uniform, student_t:DF, loguniform:LO:HI (|x| = 10**U(LO,HI)).
granularity:   tensor | channel:AXIS | block:B (MX formats always use blocks of 32).
scale:         auto (amax; none for 16-bit and wider floats) | amax | mse | percentile:P | none.
Floats of 16 bits or more are surveyed as plain casts. --config FILE reads an experiment TOML
(kind = "survey" with a [survey] table); other flags then only choose the output.
"""
_TOP_KEYS = ("kind", "name", "description", "survey")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    d = survey.DEFAULTS
    parser.add_argument("--formats", help=f"comma-separated (default {','.join(d['formats'])})")
    parser.add_argument(
        "--dist", "--dists", dest="dists", help=f"comma-separated (default {','.join(d['dists'])})"
    )
    parser.add_argument("--granularity", help="tensor | channel:AXIS | block:B (default tensor)")
    parser.add_argument("--scale", help="auto | amax | mse | percentile:P | none (default auto)")
    parser.add_argument("--rounding", help="rounding mode (default nearest_even)")
    parser.add_argument("--size", type=int, help=f"elements per synthetic input ({d['size']})")
    parser.add_argument("--seed", type=int, help="random seed (default 0)")
    parser.add_argument("--input", metavar="FILE", help="a .npy or .npz tensor file to survey")
    parser.add_argument("--config", metavar="FILE", help="an experiment TOML of kind survey")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--plot", metavar="OUT.png", help="write error histograms and SQNR")


def _from_config(path: str) -> dict:
    p = pathlib.Path(path)
    try:
        doc = read_toml(p)
    except FileNotFoundError:
        raise UsageError(f"--config {path}: no such file") from None
    except ValueError as err:
        raise UsageError(f"--config {err}") from None
    unknown = [k for k in doc if k not in _TOP_KEYS]
    if unknown:
        raise UsageError(f"{path}: unknown key {unknown[0]!r}; allowed: {', '.join(_TOP_KEYS)}")
    if doc.get("kind") != survey.KIND:
        raise UsageError(f"{path}: kind must be {survey.KIND!r}, got {doc.get('kind')!r}")
    section = doc.get("survey", {})
    cfg = survey.validate(section, f"{p.name}: survey")
    if cfg["input"] is not None and not pathlib.Path(cfg["input"]).is_absolute():
        cfg["input"] = str(p.parent / cfg["input"])
    return cfg


def _from_flags(args: argparse.Namespace) -> dict:
    section: dict = {}
    if args.formats is not None:
        section["formats"] = split_list(args.formats)
    if args.dists is not None:
        section["dists"] = split_list(args.dists)
    for k in ("granularity", "scale", "rounding", "size", "seed", "input"):
        v = getattr(args, k)
        if v is not None:
            section[k] = v
    return survey.validate(section, "survey")


def _json_safe(row: dict) -> dict:
    return {
        k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()
    }


def run(args: argparse.Namespace) -> int:
    if args.config is not None:
        flags = ("formats", "dists", "granularity", "scale", "rounding", "size", "seed", "input")
        given = [f"--{f}" for f in flags if getattr(args, f) is not None]
        if given:
            raise UsageError(f"--config sets the survey; drop {', '.join(given)}")
        cfg = _from_config(args.config)
    else:
        cfg = _from_flags(args)
    if args.plot is not None and not args.plot.endswith(".png"):
        raise UsageError(f"--plot writes a PNG: give a path ending in .png, got {args.plot!r}")
    if args.plot is not None and not os.path.isdir(os.path.dirname(args.plot) or "."):
        raise UsageError(f"--plot {args.plot!r}: its directory does not exist")
    if args.plot is not None:
        from precisionlab import _io

        try:  # before the survey: a device or link is refused, never replaced
            _io.check_target(args.plot)
        except _io.UnsafePathError as err:
            raise UsageError(f"--plot {err}") from None
    hists: dict = {}
    rows = survey.execute(cfg, hists=hists if args.plot else None)
    if args.json:
        print(json.dumps([_json_safe(r) for r in rows], indent=1))
    else:
        print(survey.summary_table(rows))
    if args.plot:
        survey.plot_survey(rows, hists, args.plot)
        if not args.json:
            print(f"\nwrote {args.plot}")
    return 0
