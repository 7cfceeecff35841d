"""``precisionlab report``: the summary table and report.md (with plots) of a run directory."""

from __future__ import annotations

import argparse

HELP = "print a run's summary table and write its report.md with PNG plots"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="DIR", help="run directory")
    parser.add_argument("--no-plots", action="store_true", help="write report.md without plots")


def run(args: argparse.Namespace) -> int:
    from precisionlab.experiments import report

    path, table = report.write_report(args.run_dir, plots=not args.no_plots)
    print(table)
    print(f"\nreport: {path}")
    return 0
