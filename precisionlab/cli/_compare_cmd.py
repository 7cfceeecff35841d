"""``precisionlab compare``: the variants of several runs side by side."""

from __future__ import annotations

import argparse

HELP = "compare the variants of one or more run directories side by side"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", metavar="DIR", nargs="+", help="run directories")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")


def run(args: argparse.Namespace) -> int:
    from precisionlab.experiments import _compare as compare

    _, _, text = compare.compare_runs(args.run_dirs, markdown=args.markdown)
    print(text)
    return 0
