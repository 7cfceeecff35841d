"""``precisionlab run``: run an experiment file into a run directory, or resume one."""

from __future__ import annotations

import argparse
import sys

from precisionlab.cli._common import UsageError

HELP = "run an experiment (TOML) into a run directory; --resume DIR continues a killed run"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="experiment file (TOML)")
    parser.add_argument("--resume", metavar="DIR", help="continue the run in DIR")
    parser.add_argument("--out", metavar="DIR", help="run directory (default runs/NAME-TIME)")
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY.PATH=VALUE",
        action="append",
        default=[],
        help="override a key of the file, e.g. train.steps=50 or variant.fp16-static.lr=0.01",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument("--no-report", action="store_true", help="skip report.md and plots")


def run(args: argparse.Namespace) -> int:
    from precisionlab.experiments import report, runner
    from precisionlab.experiments.summary import failed_units

    if args.resume and args.config:
        raise UsageError("give either CONFIG or --resume DIR, not both")
    if args.resume:
        if args.overrides or args.out:
            raise UsageError("--set and --out apply to a new run, not to --resume")
        run_dir = runner.resume(args.resume, quiet=args.quiet)
    elif args.config:
        run_dir = runner.run_file(
            args.config, out=args.out, overrides=args.overrides, quiet=args.quiet
        )
    else:
        raise UsageError("give an experiment file (CONFIG) or --resume DIR")
    failed = failed_units(run_dir)
    if args.no_report:
        print(run_dir)
    else:
        path, table = report.write_report(run_dir)
        print(table)
        print(f"\nrun directory: {run_dir}\nreport: {path}")
    if failed:
        sys.stderr.write(f"{failed} variant(s) failed: see their error.log\n")
        return 1
    return 0
