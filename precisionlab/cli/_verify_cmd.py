"""``precisionlab verify DIR``: recompute a recorded step (or every dump below a run directory)
and say whether it matches; exit 0 when every checked tensor matches, 1 when something
differs, 2 for a damaged or unreadable dump (one line)."""

from __future__ import annotations

import argparse

from precisionlab.cli._common import UsageError, check_path_shape, shorten

HELP = "recompute a recorded step bit for bit and name the first difference (exit 0, 1, 2)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dir", help="a dump (a directory with manifest.json), or a directory holding dumps"
    )
    parser.add_argument("--all", action="store_true", help="list every checked tensor")
    parser.add_argument(
        "--json", metavar="FILE", help="also write the reports as JSON to FILE ('-': stdout)"
    )
    parser.add_argument(
        "--no-diagnose", action="store_true", help="compare only: no mechanism label (faster)"
    )


def run(args: argparse.Namespace) -> int:
    from precisionlab import _io, verify

    check_path_shape(args.dir, "DIR")
    if args.json is not None:
        if not args.json.strip():
            raise UsageError("--json: empty; name a file or - for stdout")
        if args.json != _io.STDIO:
            check_path_shape(args.json, "--json")
            _io.check_target(args.json)
    dumps = verify.find_dumps(args.dir)
    if not dumps:
        raise UsageError(f"{shorten(args.dir)}: holds no dump (no manifest.json below it)")
    reports = [verify.check(d, diagnose=not args.no_diagnose) for d in dumps]
    texts = [r.text(every=args.all) for r in reports]
    if args.json == _io.STDIO:
        print(_io.dumps([r.to_dict() for r in reports], indent=1))
    else:
        print("\n\n".join(texts))
        if len(reports) > 1:
            bad = [r for r in reports if not r.ok]
            print(f"\n{len(reports)} dumps, {len(reports) - len(bad)} match, {len(bad)} differ")
        if args.json is not None:
            _io.write_json(args.json, [r.to_dict() for r in reports])
    return 0 if all(r.ok for r in reports) else 1
