"""The command-line reference page (docs/reference/cli.rst, written by the docs extension at
every build from the argparse parsers, so it cannot go stale): every subcommand has its
section, shown as plain text (not highlighted as Python), and its text is what
``precisionlab COMMAND --help`` prints."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sphinx")  # the extension imports it (the docs extra)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ext():
    path = ROOT / "docs" / "_ext" / "precisionlab_docs.py"
    spec = importlib.util.spec_from_file_location("precisionlab_docs_ext", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def page(ext) -> str:
    return ext._cli_page()


def _blocks(page: str) -> dict[str, str]:
    """``{section title: the help text of the block under it}``."""
    blocks, title, body, inside = {}, "", [], False
    lines = [*page.splitlines(), "end"]
    for i, line in enumerate(lines):
        if inside and line and not line.startswith("   "):
            inside = False
            blocks[title] = "\n".join(body).strip("\n")
        if i + 1 < len(lines) and re.fullmatch(r"([-~=])\1+", lines[i + 1]):
            title = line.strip("`")
        elif line.startswith(".. code-block::"):
            inside, body = True, []
        elif inside and not line.startswith("   :"):
            body.append(line[3:])
    return blocks


def test_every_block_is_plain_text_and_every_subcommand_has_one(page):
    assert "\n::\n" not in page and ".. code-block:: text\n   :class: cli-help\n" in page
    assert page.count(".. code-block::") == page.count(".. code-block:: text")
    from precisionlab.cli import _build_parser

    parser, _ = _build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    titles = set(_blocks(page))
    missing = [name for name in sub.choices if f"precisionlab {name}" not in titles]
    assert not missing, missing
    assert len(sub.choices) >= 10  # the walk found the subcommands, not an empty parser


def test_a_block_is_what_the_command_prints(ext, page):
    env = {**os.environ, "COLUMNS": str(ext.CLI_WIDTH), "PYTHONPATH": str(ROOT)}
    for command in ("bits", "survey"):
        printed = subprocess.run(
            [sys.executable, "-m", "precisionlab", command, "--help"],
            capture_output=True, text=True, env=env, check=True, cwd=ROOT,
        ).stdout  # fmt: skip
        assert _blocks(page)[f"precisionlab {command}"] == printed.strip("\n"), command
