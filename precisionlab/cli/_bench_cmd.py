"""``precisionlab bench NAME``: benchmarks that compare precisionlab with its peers in one run."""

from __future__ import annotations

import argparse
import pathlib

from precisionlab import _io
from precisionlab.bench import _codecs as codecs
from precisionlab.bench import _hardware as hardware
from precisionlab.bench import _overhead as overhead
from precisionlab.bench import _predictors as predictors
from precisionlab.bench import _quant as quant
from precisionlab.bench import _recipes as recipes
from precisionlab.bench import _telemetry as telemetry
from precisionlab.bench import _train as train
from precisionlab.cli._common import UsageError, check_path_shape

HELP = "benchmarks against peers (ml_dtypes, gfloat, jmp), printed as ratios"

# Benchmark name -> its module; each defines HELP, add_arguments and run.
BENCHES = {
    "codecs": codecs,
    "quant": quant,
    "train": train,
    "recipes": recipes,
    "telemetry": telemetry,
    "predictors": predictors,
    "hardware": hardware,
    "overhead": overhead,
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
    if out is not None and str(out) == _io.STDIO:  # the standard stream the user asked for
        args.out, args.json = None, True
    elif out is not None:
        _check_out_file(pathlib.Path(out), module is codecs)
    return module.run(args)


def _check_out_file(out: pathlib.Path, rows_too: bool) -> None:
    """UsageError before any measuring unless ``out`` (and ``OUT.jsonl`` for codecs) is a new
    name or a regular file in an existing directory: ``--out /dev/null`` must never replace
    the device (write to ``-`` for stdout, or leave --out out)."""
    if not str(out).strip():
        raise UsageError(f"--out {str(out)!r}: empty; name a file, or - for stdout")
    check_path_shape(str(out), "--out")
    if not out.parent.is_dir():
        # Never create directories the user did not ask for (/nonexistent/x.json).
        raise UsageError(f"--out {str(out)!r}: its directory does not exist")
    for path in (out, out.with_suffix(".jsonl")) if rows_too else (out,):
        try:
            _io.check_target(path)
        except _io.UnsafePathError as err:
            raise UsageError(f"--out {err}") from None
