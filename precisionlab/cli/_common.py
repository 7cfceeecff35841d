"""Shared pieces of the command-line interface."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from precisionlab._text import UsageError, split_list

# Echoed values are cut to this many characters: a 100 KB argument must not give a 100 KB line.
MAX_ECHO = 60
MAX_LINE = 400
_QUOTED = re.compile(rf"'[^']{{{MAX_ECHO},}}'|\"[^\"]{{{MAX_ECHO},}}\"")


__all__ = [
    "MAX_ECHO",
    "Flag",
    "Parser",
    "Terminated",
    "UsageError",
    "add_flags",
    "check_out_dir",
    "check_path_shape",
    "exit_now",
    "one_line",
    "shorten",
    "split_list",
    "stdout_is_tty",
    "switch",
    "terminating_like_ctrl_c",
]


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr and exit status 2, and which reads
    ``-inf``, ``-nan``, ``-1e3`` and ``-1GiB`` as values (argparse takes only ``-1`` and ``-1.5``
    so, and said "expected one argument" for ``--threshold -inf``, hiding what is wrong)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        # argparse's own hook (no precisionlab flag looks like a negative number)
        self._negative_number_matcher = re.compile(r"^-(\d|\.\d|inf|nan)", re.IGNORECASE)

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {one_line(_suggest(message))}\n")
        raise SystemExit(2)


@dataclasses.dataclass(frozen=True)
class Flag:
    """One option of a command as a row of a table (see :func:`add_flags`): its ``name``
    (``--out``, or a positional argument's name), its ``help``, and the keywords of
    ``argparse``'s ``add_argument`` it takes (None: argparse's default)."""

    name: str
    help: str
    metavar: str | tuple[str, ...] | None = None
    type: Callable[[str], Any] | None = None
    default: Any = None
    nargs: int | str | None = None
    action: str | None = None
    dest: str | None = None


def switch(name: str, help: str) -> Flag:
    """A flag that takes no value (``action="store_true"``)."""
    return Flag(name, help, action="store_true")


def add_flags(parser: argparse._ActionsContainer, flags: Iterable[Flag]) -> None:
    """Add each of ``flags`` to ``parser`` (a parser or an argument group), in order."""
    for flag in flags:
        given = {
            field.name: getattr(flag, field.name)
            for field in dataclasses.fields(flag)
            if field.name != "name" and getattr(flag, field.name) is not None
        }
        parser.add_argument(flag.name, **given)


_INVALID = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


def _suggest(message: str) -> str:
    """argparse's "invalid choice: 'rnu' (choose from 'bits', ...)" with "did you mean
    'run'?" put before the choices, when one is close."""
    from precisionlab._schema import did_you_mean

    found = _INVALID.search(message)
    if not found:
        return message
    choices = re.findall(r"'([^']*)'", found.group(2))
    hint = did_you_mean(found.group(1), choices).strip()
    if not hint:
        return message
    return message.replace(" (choose from", f"; {hint} (choose from", 1)


def shorten(text: str, limit: int = MAX_ECHO) -> str:
    """``text`` cut to ``limit`` characters with an ellipsis (for echoing user input)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def one_line(message: str) -> str:
    """An error message as one bounded line: the first line, quoted values longer than
    :data:`MAX_ECHO` shortened, the whole cut at :data:`MAX_LINE` characters."""
    first = message.splitlines()[0] if message else ""
    first = _QUOTED.sub(lambda m: m.group(0)[0] + shorten(m.group(0)[1:-1]) + m.group(0)[0], first)
    return shorten(first, MAX_LINE)


def exit_now(status: int) -> None:
    """Flush stdout and stderr (a closed or broken stream is passed over) and end the process
    with ``status`` at once, without the interpreter's shutdown (``os._exit``)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def stdout_is_tty() -> bool:
    return sys.stdout.isatty()


#: Most components and characters of an output path (Linux's PATH_MAX is 4096 bytes; deep
#: paths made recursion errors in mkdir).
MAX_PATH_PARTS = 64
MAX_PATH_CHARS = 4096


def check_path_shape(path: str, flag: str) -> None:
    """UsageError for an output path of more than :data:`MAX_PATH_PARTS` components or
    :data:`MAX_PATH_CHARS` characters, or one holding a NUL byte."""
    parts = [p for p in str(path).split(os.sep) if p]
    if "\0" in str(path):
        raise UsageError(f"{flag} {shorten(repr(path))}: holds a NUL byte")
    if len(parts) > MAX_PATH_PARTS or len(str(path)) > MAX_PATH_CHARS:
        raise UsageError(
            f"{flag} {shorten(str(path))}: {len(parts)} components, {len(str(path))} "
            f"characters; at most {MAX_PATH_PARTS} and {MAX_PATH_CHARS}"
        )


def check_out_dir(out: str | None, *, new: bool = False, force_hint: bool = False) -> None:
    """UsageError unless ``out`` (a ``--out DIR`` flag; None: not given) can name a run
    directory: not empty text (it would mean the current directory), not an existing file, and
    with ``new`` not an existing directory that holds anything (a run directory is checked
    file by file, so ``--out /`` would walk the whole disk)."""
    if out is None:
        return
    if not out.strip():
        raise UsageError(f"--out {out!r}: empty; name a run directory")
    check_path_shape(out, "--out")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {shorten(out)}: exists and is not a directory")
    if new and os.path.isdir(out) and os.listdir(out):
        raise UsageError(
            f"--out {shorten(out)}: the directory is not empty; name a new one"
            + (" or pass --force" if force_hint else "")
        )


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl-C's KeyboardInterrupt so that a run ends the same
    way (state written, ``run.json`` interrupted, lock released); ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum: int, _frame: object) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def terminating_like_ctrl_c() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise :class:`Terminated` (a KeyboardInterrupt)
    in the main thread; the previous handlers come back after it. Nothing outside the main
    thread (signals go to it only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    wanted = [s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None]
    previous = {}
    for sig in wanted:
        if signal.getsignal(sig) is signal.SIG_IGN:  # nohup: the user asked to ignore it
            continue
        previous[sig] = signal.signal(sig, _raise_terminated)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
