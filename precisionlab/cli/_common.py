"""Shared pieces of the command-line interface."""

from __future__ import annotations

import argparse
import sys


class UsageError(Exception):
    """Bad command-line input: printed as one line on stderr, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def split_list(text: str) -> list[str]:
    """Split ``"a,b, c"`` into ``["a", "b", "c"]`` (empty items dropped)."""
    return [item.strip() for item in text.split(",") if item.strip()]


def stdout_is_tty() -> bool:
    return sys.stdout.isatty()
