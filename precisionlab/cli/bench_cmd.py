"""``precisionlab bench NAME``: benchmarks that compare precisionlab with its peers in one run."""

from __future__ import annotations

import argparse
import importlib

from precisionlab.cli._common import UsageError

HELP = "benchmarks against peers (ml_dtypes, gfloat, jmp), printed as ratios"

# Benchmark name -> module under precisionlab.bench; each defines add_arguments and run.
BENCHES = {"codecs": "codecs", "quant": "quant", "train": "train", "recipes": "recipes"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", parser_class=type(parser))
    for name, module_name in BENCHES.items():
        try:
            module = importlib.import_module(f"precisionlab.bench.{module_name}")
        except ModuleNotFoundError as err:
            if err.name == f"precisionlab.bench.{module_name}":
                continue
            raise
        bench = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(bench)
        bench.set_defaults(bench_module=module)


def run(args: argparse.Namespace) -> int:
    module = getattr(args, "bench_module", None)
    if module is None:
        raise UsageError(f"name a benchmark: one of {', '.join(BENCHES)}")
    return module.run(args)
