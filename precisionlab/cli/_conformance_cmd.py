"""``precisionlab conformance``: which libraries and backends convert numbers correctly,
measured against the exact reference."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from precisionlab.cli._common import UsageError, check_out_dir, shorten, split_list

HELP = "check ml_dtypes, XLA, numpy, gfloat, torch conversions against the exact reference"

_EPILOG = """\
Each library that is installed converts edge-case inputs (every value and midpoint of the
format, +-1 ulp around them, range ends, specials, random bits; for formats of 8 bits or fewer
every float16 and bfloat16 value) from each source type into each format it supports, with
each rounding mode it claims. Disagreements with the exact reference are classified as
V (spec violation), C (documented convention) or U (undefined case) with three examples each.
report.md, conformance.json and environment.json go to --out (default runs/conformance-TIME).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from precisionlab.conformance import DEFAULT_LIBS, DEFAULT_SOURCES, SOURCES

    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--libs",
        help=f"comma-separated (default {','.join(DEFAULT_LIBS)}); also precisionlab, this "
        "package's own codec in every mode (compiles one program per cell: slow)",
    )
    parser.add_argument("--formats", help="comma-separated target formats (default: all floats)")
    parser.add_argument(
        "--sources",
        help=f"source types among {','.join(SOURCES)} (default {','.join(DEFAULT_SOURCES)})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (0)")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    parser.add_argument("--out", metavar="DIR", help="directory for report.md and the JSON")
    parser.add_argument(
        "--gemm",
        action="store_true",
        help="instead: the GEMMs on this machine (XLA per backend, numpy, torch) beside the "
        "tensor-core models of precisionlab.hardware (share of bit-identical outputs)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace the results already in --out DIR"
    )


def _list(text: str | None, flag: str) -> list[str] | None:
    if text is None:
        return None
    items = split_list(text)
    if not items:
        raise UsageError(f"{flag} needs at least one name, got {text!r}")
    return list(dict.fromkeys(items))  # a name given twice counts once


def _run_gemm(args: argparse.Namespace) -> int:
    from precisionlab.conformance._gemm import gemm_tables, run_gemm_conformance

    res = run_gemm_conformance(seed=args.seed)
    if args.json:
        rows = [
            {"gemm": i, "case": c, "model": m, "bit_identical": v}
            for (i, c, m), v in res.share.items()
        ]
        print(json.dumps(rows, indent=1))
        return 0
    for title, table in gemm_tables(res):
        print(f"{title}\n{table}\n")
    return 0


def run(args: argparse.Namespace) -> int:
    from precisionlab.conformance import matrix_tables, run_conformance, to_json, write_report
    from precisionlab.conformance._report import existing_results
    from precisionlab.experiments import _store as store

    if getattr(args, "gemm", False):
        if args.libs or args.formats or args.sources or args.out:
            raise UsageError("--gemm takes only --seed and --json")
        return _run_gemm(args)

    libs = _list(args.libs, "--libs")
    formats = _list(args.formats, "--formats")
    sources = _list(args.sources, "--sources")
    check_out_dir(args.out)
    if args.out is not None and not args.force:
        found = existing_results(Path(args.out))
        if found:  # refused before the minutes of conversions, not after
            raise UsageError(
                f"--out {shorten(args.out)} already holds {', '.join(found)}; choose a new "
                "directory or pass --force to replace them"
            )
    result = run_conformance(libs, formats, sources, seed=args.seed, require=libs is not None)
    out_dir = Path(args.out) if args.out else store.new_run_dir(Path("runs"), "conformance")
    path = write_report(result, out_dir, force=args.force)
    if args.json:
        data = store.to_jsonable(to_json(result))
        data["report"] = str(path)
        print(json.dumps(data, indent=1, allow_nan=False))
        return 0
    for title, table in matrix_tables(result):
        print(f"{title}\n{table}\n")
    for lib, why in result.skipped.items():
        print(f"skipped {lib}: {why}")
    total = sum(c.mismatches for c in result.cells)
    print(f"{len(result.cells)} conversions, {total} disagreements; report: {path}")
    return 0
