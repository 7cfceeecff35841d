"""``precisionlab report``: the summary table and report.md (with plots) of a run directory."""

from __future__ import annotations

import argparse
import sys

HELP = "print a run's summary table and write its report.md with PNG plots"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="DIR", help="run directory")
    parser.add_argument("--no-plots", action="store_true", help="write report.md without plots")


def run(args: argparse.Namespace) -> int:
    """Exit status 0, or 1 when variants of the run failed (as ``run`` exits)."""
    from precisionlab.experiments import _report as report
    from precisionlab.experiments._summary import failed_units

    path, table = report.write_report(args.run_dir, plots=not args.no_plots)
    print(table)
    print(f"\nreport: {path}")
    failed = failed_units(args.run_dir)
    if failed:
        sys.stderr.write(f"{failed} variant(s) failed: see their error.log\n")
        return 1
    return 0
