"""``precisionlab bench NAME``: benchmarks that compare precisionlab with its peers in one run."""

from __future__ import annotations

import argparse
import pathlib

from precisionlab.bench import codecs, hardware, quant, recipes, telemetry, train
from precisionlab.cli._common import UsageError

HELP = "benchmarks against peers (ml_dtypes, gfloat, jmp), printed as ratios"

# Benchmark name -> its module; each defines HELP, add_arguments and run.
BENCHES = {
    "codecs": codecs,
    "quant": quant,
    "train": train,
    "recipes": recipes,
    "telemetry": telemetry,
    "hardware": hardware,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", parser_class=type(parser))
    for name, module in BENCHES.items():
        # argparse %-formats help strings: a literal % must be doubled.
        bench = sub.add_parser(name, help=module.HELP.replace("%", "%%"), description=module.HELP)
        module.add_arguments(bench)
        bench.set_defaults(bench_module=module)


def run(args: argparse.Namespace) -> int:
    module = getattr(args, "bench_module", None)
    if module is None:
        raise UsageError(f"name a benchmark: one of {', '.join(BENCHES)}")
    out = getattr(args, "out", None)
    if out is not None and not pathlib.Path(out).parent.is_dir():
        # Never create directories the user did not ask for (/nonexistent/x.json).
        raise UsageError(f"--out {str(out)!r}: its directory does not exist")
    return module.run(args)
