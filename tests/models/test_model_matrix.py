"""The matrix of issue 33: every feature of its items 1-6, checked for effect on all five
model styles (Flax NNX, Flax Linen, Equinox, plain JAX with scan/remat/vmap, inside a user's
``shard_map``).

Each style's module runs the shared table (``test_feature[NAME]`` over
``tests/_model_features.py``'s :data:`FEATURES`) and tests of its own marked with
``@covers(ROW)``. This test fails when a cell of the matrix has no test, and when the page's
matrix (docs/guides/model-features.md) is not the one the tests give:
``python tests/models/test_model_matrix.py --update`` rewrites it.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from _model_features import FEATURES, NOTES, ROWS, STYLES

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "model-features.md"
BEGIN, END = "<!-- model-matrix -->", "<!-- /model-matrix -->"


def _table_run(module) -> dict[str, bool]:
    """The features a style's ``test_feature`` runs: name -> whether in the default suite."""
    test = getattr(module, "test_feature", None)
    out: dict[str, bool] = {}
    for mark in getattr(test, "pytestmark", ()):
        if mark.name == "parametrize" and mark.args[0] == "feature":
            for p in mark.args[1]:
                out[p.values[0].name] = not any(m.name == "slow" for m in p.marks)
    return out


def _slow(test) -> bool:
    return any(m.name == "slow" for m in getattr(test, "pytestmark", ()))


def cells() -> dict[tuple[str, str], list[str]]:
    """(row, style) -> the tests checking it there: ``NAME`` for ``test_feature[NAME]``
    (``NAME (slow)`` under ``-m slow`` only), and the style's own ``test_*`` names."""
    out = {}
    for style, name in STYLES.items():
        module = importlib.import_module(name)
        run = _table_run(module)
        own = {n: f for n, f in vars(module).items() if n.startswith("test_")}
        for row in ROWS:
            tests = [f if run[f] else f"{f} (slow)" for f in row.features if f in run]
            tests += [n if not _slow(f) else f"{n} (slow)" for n, f in own.items()
                      if row.key in getattr(f, "covers", ())]  # fmt: skip
            out[(row.key, style)] = tests
    return out


def table() -> str:
    """The matrix as Markdown: a row per feature (with the shared checks that test it), a
    column per style: where the shared checks run (``slow``: under ``-m slow`` only;
    ``default:`` those in the default suite too) and the style's own tests."""
    found = cells()
    head = ["item", "feature", "shared checks", *STYLES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in ROWS:
        shared = ", ".join(f"`{f}`" for f in row.features)
        row_cells = []
        for style in STYLES:
            tests = found[(row.key, style)]
            ran = [t for t in tests if t.removesuffix(" (slow)") in row.features]
            default = [t for t in ran if not t.endswith(" (slow)")]
            parts = []
            if len(ran) == len(row.features):
                parts.append(
                    "slow" if not default else "default" if len(default) == len(ran)
                    else "slow; default: " + ", ".join(f"`{t}`" for t in default)
                )  # fmt: skip
            parts += [f"`{t}`" for t in tests if t not in ran]
            note = NOTES.get((row.key, style))
            text = "; ".join(parts) or "**none**"
            row_cells.append(f"{text} ({note})" if note else text)
        lines.append(f"| {row.item} | {row.what} | {shared} | " + " | ".join(row_cells) + " |")
    return "\n".join(lines)


def _region(text: str) -> tuple[int, int]:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return start, end


def test_every_feature_is_a_row_and_every_row_names_real_features():
    names = [f.name for f in FEATURES]
    in_rows = [f for row in ROWS for f in row.features]
    assert sorted(in_rows) == sorted(names), set(in_rows) ^ set(names)
    assert len({r.key for r in ROWS}) == len(ROWS)
    keys = {r.key for r in ROWS}
    assert all(row in keys and style in STYLES for row, style in NOTES), NOTES


def test_every_cell_has_a_test():
    """A row with no test on a style (its feature dropped from a module's table, a
    ``@covers`` test removed) fails here, naming the cell."""
    empty = [cell for cell, tests in cells().items() if not tests]
    assert not empty, f"cells without a test: {empty}"
    for style, name in STYLES.items():  # every style runs the whole table (-m slow)
        assert set(_table_run(importlib.import_module(name))) == {f.name for f in FEATURES}, style


def test_the_page_shows_the_matrix_the_tests_give():
    text = PAGE.read_text()
    start, end = _region(text)
    assert text[start:end].strip() == table(), (
        "the matrix on docs/guides/model-features.md is stale: "
        "python tests/models/test_model_matrix.py --update"
    )


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python tests/models/test_model_matrix.py --update")
    text = PAGE.read_text()
    start, end = _region(text)
    PAGE.write_text(text[:start] + "\n" + table() + "\n" + text[end:])
    print(f"wrote {PAGE}")
