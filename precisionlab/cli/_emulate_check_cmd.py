"""``precisionlab emulate-check MODULE.py[:FUNC]``: run a function natively (jit on this
machine) and under ``emulate``, and list the operations whose results differ."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Any

from precisionlab.cli._common import UsageError, shorten

HELP = "run a function natively and under emulate; list the operations that differ"

DEFAULT_FUNC = "model"
INPUTS = "inputs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "target", metavar="MODULE.py[:FUNC]",
        help=f"a Python file and the function in it to check (default {DEFAULT_FUNC!r}); the "
        f"file's {INPUTS}() returns the arguments, a tuple",
    )  # fmt: skip
    parser.add_argument("--policy", default="c=f16", help="the emulated policy (default c=f16)")
    parser.add_argument(
        "--hardware", default="h100-xla",
        help="emulate's matmul model: h100-xla (default: the H100's tensor cores as XLA runs "
        "them), float32, or another precisionlab.hardware preset (h100-cublaslt, "
        "h100-cublaslt-fast, a100, ...)",
    )  # fmt: skip
    parser.add_argument("--all", action="store_true", help="list every operation")
    parser.add_argument("--json", action="store_true", help="print one JSON object per operation")


def _load(target: str) -> tuple[Any, tuple]:
    path, _, func = target.partition(":")
    func = func or DEFAULT_FUNC
    if not path.endswith(".py"):
        raise UsageError(f"{shorten(target)}: name a Python file, MODULE.py[:FUNC]")
    if not os.path.isfile(path):
        raise UsageError(f"{shorten(path)}: no such file")
    spec = importlib.util.spec_from_file_location("_precisionlab_emulate_check", path)
    if spec is None or spec.loader is None:
        raise UsageError(f"{shorten(path)}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # the user's file: say what failed, in one line
        why = f"{type(err).__name__}: {err}"
        raise UsageError(f"{shorten(path)}: importing it failed: {why}") from err
    finally:
        sys.path.pop(0)
    fn = getattr(module, func, None)
    if not callable(fn):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise UsageError(
            f"{shorten(path)}: no function {func!r}; functions: {', '.join(names) or 'none'}"
        )
    make = getattr(module, INPUTS, None)
    if not callable(make):
        raise UsageError(f"{shorten(path)}: define {INPUTS}() returning the arguments of {func}")
    try:
        args = make()
    except Exception as err:
        why = f"{type(err).__name__}: {err}"
        raise UsageError(f"{shorten(path)}: {INPUTS}() failed: {why}") from err
    return fn, args if isinstance(args, tuple) else (args,)


def _trace_natively(fn: Any, inputs: tuple, target: str) -> None:
    """Trace the user's function on its inputs (shapes only, no compilation): an exception
    there is the function's, said in one line (UsageError) rather than a traceback from
    inside ``emulate``."""
    import jax

    try:
        jax.eval_shape(fn, *inputs)
    except Exception as err:  # the user's code: one line naming it
        why = f"{type(err).__name__}: {err}".splitlines()[0] if str(err) else type(err).__name__
        raise UsageError(f"{shorten(target)}: calling it on {INPUTS}() failed: {why}") from err


def run(args: argparse.Namespace) -> int:
    from precisionlab.emulate import check, emulate
    from precisionlab.mixed._policy import get_policy

    get_policy(args.policy)  # a bad policy: one line, before importing the user's file
    try:  # a bad matmul model likewise
        emulate(abs, args.policy, hardware=args.hardware)
    except ValueError as err:
        raise UsageError(str(err)) from None
    fn, inputs = _load(args.target)
    _trace_natively(fn, inputs, args.target)
    try:
        report = check(emulate(fn, args.policy, hardware=args.hardware), args.policy, *inputs)
    except NotImplementedError as err:  # an operation emulate cannot enter, named
        raise UsageError(str(err)) from None
    if args.json:
        from dataclasses import asdict

        for op in report.ops if args.all else report.differing:
            print(json.dumps(asdict(op)))
    else:
        print(report.text(every=args.all))
    return 0
