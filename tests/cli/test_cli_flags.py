"""Options declared as tables (cli/_common.py: Flag, switch, add_flags)."""

import argparse

from precisionlab.cli import _diagnose_cmd
from precisionlab.cli._common import Flag, add_flags, switch


def test_add_flags_passes_only_the_keywords_given():
    parser = argparse.ArgumentParser(prog="p")
    add_flags(
        parser,
        (
            Flag("name", "a positional", nargs="?"),
            Flag("--n", "a count", metavar="N", type=int, default=3),
            Flag("--set", "repeatable", default=[], action="append", dest="items"),
            switch("--on", "a switch"),
        ),
    )
    args = parser.parse_args([])
    assert vars(args) == {"name": None, "n": 3, "items": [], "on": False}
    args = parser.parse_args(["x", "--n", "5", "--set", "a", "--set", "b", "--on"])
    assert vars(args) == {"name": "x", "n": 5, "items": ["a", "b"], "on": True}
    assert parser.parse_args([]).items == []  # the table's default list is not appended to
    assert "--n N" in parser.format_help() and "a switch" in parser.format_help()


def test_diagnose_mode_flags_come_from_its_groups():
    # the lists the command checks flags against, as they were written out by hand
    assert _diagnose_cmd._ONLY == {
        "threshold": "compare",
        "every": "compare",
        "tolerance": "bisect",
        "tail": "bisect",
        "layers": "bisect",
        "underflow": "autoswitch",
        "mse": "autoswitch",
    }
    assert _diagnose_cmd._FORECAST_ONLY == ("fit", "model", "no_bisect", "quick")
