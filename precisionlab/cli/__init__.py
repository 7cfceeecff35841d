"""The ``precisionlab`` command: one module per subcommand under ``precisionlab.cli``.

Each subcommand module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Bad input raises :class:`UsageError` (or ``ValueError``, the library's
error for a bad value, e.g. a config error), which ``main`` prints as one line on stderr with
exit status 2; set ``PRECISIONLAB_DEBUG=1`` to see the traceback instead. Any other exception,
``TypeError`` included, is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from types import ModuleType

from precisionlab.cli import (
    bench_cmd,
    bits_cmd,
    compare_cmd,
    conformance_cmd,
    diagnose_cmd,
    emulate_check_cmd,
    env_cmd,
    formats_cmd,
    memory_cmd,
    report_cmd,
    run_cmd,
    survey_cmd,
    values_cmd,
    verify_cmd,
)
from precisionlab.cli._common import Parser, UsageError, one_line, shorten

__all__ = ["COMMANDS", "UsageError", "main"]

#: Subcommand name -> its module.
COMMANDS: dict[str, ModuleType] = {
    "bits": bits_cmd,
    "formats": formats_cmd,
    "values": values_cmd,
    "env": env_cmd,
    "survey": survey_cmd,
    "memory": memory_cmd,
    "run": run_cmd,
    "report": report_cmd,
    "compare": compare_cmd,
    "bench": bench_cmd,
    "conformance": conformance_cmd,
    "diagnose": diagnose_cmd,
    "emulate-check": emulate_check_cmd,
    "verify": verify_cmd,
}


def _build_parser() -> tuple[Parser, dict[str, ModuleType]]:
    from precisionlab import __version__

    parser = Parser(prog="precisionlab", description="A JAX lab for numerical precision.")
    parser.add_argument(
        "--version", action="version", version=f"precisionlab {__version__}",
        help="print the version and exit",
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, module in COMMANDS.items():
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
    return parser, COMMANDS


def _innermost(parser: Parser, args) -> Parser:
    """The (sub)parser of the command given, so its errors name it (``precisionlab bits``)."""
    import argparse

    while True:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(args, action.dest, None) or "")
                if chosen is not None:
                    parser = chosen
                    break
        else:
            return parser


def _quiet_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so the exit flush is silent too."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is not a file (tests capture it)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``precisionlab`` console script; returns the exit status."""
    parser, modules = _build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        _innermost(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        status = int(modules[args.command].run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the handlers below
        return status
    except BrokenPipeError:  # `precisionlab ... | head`: stop quietly, as Unix tools do
        _quiet_stdout()
        return 0
    except (UsageError, ValueError) as err:
        if os.environ.get("PRECISIONLAB_DEBUG"):  # show the traceback of a suspected bug
            raise
        message = one_line(str(err)) if str(err) else type(err).__name__
        sys.stderr.write(f"precisionlab {args.command}: error: {message}\n")
        return 2
    except OSError as err:  # a file or directory named on the command line
        if os.environ.get("PRECISIONLAB_DEBUG"):
            raise
        where = f"{shorten(str(err.filename))}: " if getattr(err, "filename", None) else ""
        text = one_line(f"{where}{err.strerror or err}")
        sys.stderr.write(f"precisionlab {args.command}: error: {text}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(f"precisionlab {args.command}: interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
