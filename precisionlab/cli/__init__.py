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
from collections.abc import Iterator, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

from precisionlab.cli._common import Parser, UsageError, exit_now, one_line, shorten

if TYPE_CHECKING:
    import argparse

__all__ = ["COMMANDS", "UsageError", "main"]

#: The subcommands, in the order ``--help`` lists them.
_NAMES = ("bits", "formats", "values", "env", "survey", "memory", "run", "report", "compare",
          "bench", "conformance", "diagnose", "emulate-check", "invariance", "order",
          "verify")  # fmt: skip


def _module(name: str) -> ModuleType:
    """The module of subcommand ``name``, imported now (a command imports only its own module,
    and ``--version`` none)."""
    module: ModuleType
    if name == "bits":
        from precisionlab.cli import _bits_cmd as module
    elif name == "formats":
        from precisionlab.cli import _formats_cmd as module
    elif name == "values":
        from precisionlab.cli import _values_cmd as module
    elif name == "env":
        from precisionlab.cli import _env_cmd as module
    elif name == "survey":
        from precisionlab.cli import _survey_cmd as module
    elif name == "memory":
        from precisionlab.cli import _memory_cmd as module
    elif name == "run":
        from precisionlab.cli import _run_cmd as module
    elif name == "report":
        from precisionlab.cli import _report_cmd as module
    elif name == "compare":
        from precisionlab.cli import _compare_cmd as module
    elif name == "bench":
        from precisionlab.cli import _bench_cmd as module
    elif name == "conformance":
        from precisionlab.cli import _conformance_cmd as module
    elif name == "diagnose":
        from precisionlab.cli import _diagnose_cmd as module
    elif name == "emulate-check":
        from precisionlab.cli import _emulate_check_cmd as module
    elif name == "invariance":
        from precisionlab.cli import _invariance_cmd as module
    elif name == "order":
        from precisionlab.cli import _order_cmd as module
    elif name == "verify":
        from precisionlab.cli import _verify_cmd as module
    else:
        raise KeyError(name)
    return module


class _Commands(Mapping[str, ModuleType]):
    """Subcommand name -> its module, imported on first access."""

    def __getitem__(self, name: str) -> ModuleType:
        return _module(name)

    def __iter__(self) -> Iterator[str]:
        return iter(_NAMES)

    def __len__(self) -> int:
        return len(_NAMES)


#: Subcommand name -> its module (a read-only mapping that imports the module when asked).
COMMANDS: Mapping[str, ModuleType] = _Commands()


def _build_parser(only: str | None = None) -> tuple[Parser, Mapping[str, ModuleType]]:
    """The parser of every subcommand, or (``only``) of that one alone: its module is the
    only one imported."""
    from precisionlab import __version__

    parser = Parser(prog="precisionlab", description="A JAX lab for numerical precision.")
    parser.add_argument(
        "--version", action="version", version=f"precisionlab {__version__}",
        help="print the version and exit",
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in COMMANDS if only is None else (only,):
        module = COMMANDS[name]
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
    return parser, COMMANDS


def _innermost(parser: Parser, args: argparse.Namespace) -> Parser:
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
    """Entry point of the ``precisionlab`` console script; returns the exit status. Called
    without ``argv`` (the console script, ``python -m precisionlab``) it ends the process
    itself once the command is done (:func:`_leave`); with ``argv`` it returns."""
    if argv is not None:
        return _main(list(argv))
    try:
        status: object = _main(sys.argv[1:])
    except SystemExit as stop:
        status = stop.code
    _leave(status)
    return 1  # not reached


def _leave(status: object) -> None:
    """End the process with ``status`` as ``sys.exit`` would, but without the interpreter's
    final teardown: its streams flushed and its ``atexit`` handlers run, then ``os._exit``.
    Tearing down a process that used JAX (freeing every compiled program and buffer, module
    by module) took about 2 s of a run, after its last output."""
    if status is None:
        code = 0
    elif isinstance(status, int):
        code = status
    else:  # sys.exit("message"): the message on stderr, status 1
        sys.stderr.write(f"{status}\n")
        code = 1
    import atexit

    atexit._run_exitfuncs()
    exit_now(code)


def _main(argv: list[str]) -> int:
    if argv[:1] == ["--version"]:  # at once: no subcommand module, no JAX
        from precisionlab import __version__

        print(f"precisionlab {__version__}")
        raise SystemExit(0)  # as argparse's version action does
    given = argv[0] if argv and argv[0] in _NAMES else None
    parser, modules = _build_parser(given)
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
    except KeyboardInterrupt as err:
        signum = getattr(err, "signum", 2)  # Terminated: SIGTERM or SIGHUP, ended like Ctrl-C
        word = "interrupted" if signum == 2 else f"terminated ({err})"
        sys.stderr.write(f"precisionlab {args.command}: {word}\n")
        return 128 + signum


if __name__ == "__main__":
    raise SystemExit(main())
