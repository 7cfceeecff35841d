"""Shared pieces of the command-line interface."""

from __future__ import annotations

import argparse
import re
import sys

from precisionlab._text import UsageError, split_list

# Echoed values are cut to this many characters: a 100 KB argument must not give a 100 KB line.
MAX_ECHO = 60
MAX_LINE = 400
_QUOTED = re.compile(rf"'[^']{{{MAX_ECHO},}}'|\"[^\"]{{{MAX_ECHO},}}\"")


__all__ = ["MAX_ECHO", "Parser", "UsageError", "one_line", "shorten", "split_list", "stdout_is_tty"]


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {one_line(message)}\n")
        raise SystemExit(2)


def shorten(text: str, limit: int = MAX_ECHO) -> str:
    """``text`` cut to ``limit`` characters with an ellipsis (for echoing user input)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def one_line(message: str) -> str:
    """An error message as one bounded line: the first line, quoted values longer than
    :data:`MAX_ECHO` shortened, the whole cut at :data:`MAX_LINE` characters."""
    first = message.splitlines()[0] if message else ""
    first = _QUOTED.sub(lambda m: m.group(0)[0] + shorten(m.group(0)[1:-1]) + m.group(0)[0], first)
    return shorten(first, MAX_LINE)


def stdout_is_tty() -> bool:
    return sys.stdout.isatty()
