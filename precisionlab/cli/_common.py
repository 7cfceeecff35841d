"""Shared pieces of the command-line interface."""

from __future__ import annotations

import argparse
import sys

from precisionlab._text import UsageError, split_list

__all__ = ["Parser", "UsageError", "split_list", "stdout_is_tty"]


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def stdout_is_tty() -> bool:
    return sys.stdout.isatty()
