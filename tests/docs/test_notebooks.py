"""The notebooks execute top to bottom (their cells assert against oracles), and are committed
with the outputs of the current code, which the documentation site shows as they are (the
build executes nothing; docs/contributing.md says why).

    python tests/docs/test_notebooks.py --update [NAME ...]   # execute and store the outputs

``--update`` executes each notebook (all of them, or those whose file name contains a NAME) in
a fresh kernel from ``notebooks/`` and writes it back with its outputs, cleaned so that a rerun
of unchanged code rewrites the same bytes: no stderr, no timings, consecutive prints joined,
and the digest of the code cells' sources in the notebook's metadata. The tests:

- the default suite checks every committed notebook cheaply: every code cell executed in
  order, no error, every cell that draws has its image, and the sources are the ones that were
  executed (a cell edited after ``--update`` fails here);
- executing a notebook (the default suite for the quick ones, ``-m slow`` for the four that
  train) compares what every cell prints now with what is committed: the same text, the same
  integers, each other number within one unit of its last printed digit (a result whose last
  bit depends on the CPU's vector unit may round the other way), images where there were
  images. Cells tagged ``timing`` print wall-clock seconds as the last number of a line: that
  number is not compared.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from decimal import Decimal
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))

#: The matplotlib backend of the kernel: the inline one, which records each figure as an
#: image output (Agg would draw nothing into the notebook).
INLINE = "module://matplotlib_inline.backend_inline"

#: Cell tag: the last number of each line the cell prints is a wall-clock time, not compared.
TIMING_TAG = "timing"


def test_the_notebooks_are_there():
    assert [p.name for p in NOTEBOOKS] == [
        "01_bit_layouts.ipynb",
        "02_downcast_and_quantization_error.ipynb",
        "03_fp16_vs_bf16_training.ipynb",
        "04_fp8_recipes.ipynb",
        "05_where_precision_breaks.ipynb",
        "06_your_own_model.ipynb",
        "07_hardware_gemm.ipynb",
    ]


# --- executing and cleaning -----------------------------------------------------------------
def source_digest(nb) -> str:
    """sha256 of the code cells' sources, in order (what ``--update`` executed)."""
    h = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            h.update(cell.source.encode("utf-8") + b"\0")
    return h.hexdigest()


def clean(nb):
    """The notebook as committed: stderr dropped (environment noise), consecutive prints of a
    cell joined (the kernel splits them by timing), no per-cell timings, no interpreter patch
    version, and the sources' digest recorded."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.metadata.pop("execution", None)
        outputs = []
        for out in cell.outputs:
            if out.output_type == "stream":
                if out.name == "stderr":
                    continue
                if outputs and outputs[-1].output_type == "stream":
                    outputs[-1].text += out.text
                    continue
            outputs.append(out)
        cell.outputs = outputs
    nb.metadata.get("language_info", {}).pop("version", None)
    nb.metadata["precisionlab"] = {"source_sha256": source_digest(nb)}
    return nb


def execute(path: Path):
    """Execute the notebook at ``path`` in a fresh kernel, from its folder, on the CPU, with
    the inline matplotlib backend; the executed notebook, cleaned (:func:`clean`)."""
    nb = nbformat.read(path, as_version=4)
    env = {"JAX_PLATFORMS": "cpu", "MPLBACKEND": INLINE}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel process inherits them
    try:
        client = NotebookClient(
            nb, timeout=600, kernel_name="python3", record_timing=False,
            resources={"metadata": {"path": str(path.parent)}},
        )  # fmt: skip
        client.execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return clean(nb)


# --- comparing --------------------------------------------------------------------------------
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _texts(cell) -> list[tuple[str, str]]:
    """(kind, text) of each output of a code cell: printed text, a result's repr, and for an
    image its MIME types and text stand-in (``<Figure size 900x320 with 1 Axes>``)."""
    out = []
    for o in cell.outputs:
        if o.output_type == "stream":
            out.append((o.name, o.text))
        elif o.output_type in ("execute_result", "display_data"):
            data = o.get("data", {})
            images = sorted(k for k in data if k.startswith("image/"))
            kind = o.output_type + (f" {' '.join(images)}" if images else "")
            out.append((kind, data.get("text/plain", "")))
        else:
            out.append((o.output_type, o.get("ename", "") + ": " + o.get("evalue", "")))
    return out


def _close(a: str, b: str) -> bool:
    """Two printed numbers agree: integers exactly (counts, steps, shapes, bit patterns),
    others within one unit of the last digit the coarser one shows."""
    if not any(c in a + b for c in ".eE"):
        return a.lstrip("+") == b.lstrip("+")
    try:
        x, y = Decimal(a), Decimal(b)
    except ArithmeticError:
        return a == b
    unit = max(Decimal(1).scaleb(x.as_tuple().exponent), Decimal(1).scaleb(y.as_tuple().exponent))
    return abs(x - y) <= unit


def _shape(line: str) -> str:
    """The line with each number replaced by ``#`` and runs of blanks by one (a table's
    padding follows its widest number)."""
    return " ".join(_NUMBER.sub("#", line).split())


def same_text(old: str, new: str, *, timing: bool = False) -> bool:
    """``new`` prints what ``old`` does: the same text around the numbers, each integer the
    same, each other number within one unit of its last printed digit. With ``timing``, the
    last number of each line is a wall-clock time (``3 runs in 42 s``, a table's ``time_s``
    column) and may be anything."""
    old_lines, new_lines = old.splitlines(), new.splitlines()
    if len(old_lines) != len(new_lines):
        return False
    for a, b in zip(old_lines, new_lines, strict=True):
        if _shape(a) != _shape(b):
            return False
        numbers = list(zip(_NUMBER.findall(a), _NUMBER.findall(b), strict=True))
        if timing and numbers:
            numbers.pop()
        if not all(_close(x, y) for x, y in numbers):
            return False
    return True


def differences(committed, fresh) -> list[str]:
    """Where the outputs of ``fresh`` (just executed) differ from ``committed``, per cell."""
    problems = []
    old_cells = [c for c in committed.cells if c.cell_type == "code"]
    new_cells = [c for c in fresh.cells if c.cell_type == "code"]
    for i, (old, new) in enumerate(zip(old_cells, new_cells, strict=True)):
        a, b = _texts(old), _texts(new)
        timing = TIMING_TAG in old.metadata.get("tags", [])
        same = len(a) == len(b) and all(
            ka == kb and same_text(ta, tb, timing=timing)
            for (ka, ta), (kb, tb) in zip(a, b, strict=True)
        )
        if not same:
            problems.append(f"code cell {i + 1}:\n--- committed\n{a}\n+++ now\n{b}")
    return problems


# --- the tests --------------------------------------------------------------------------------
_DRAWS = re.compile(r"\bplt\.|\bfig\b|\bax\.")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_with_its_outputs(path):
    """Cheap: what the site shows is an execution of these very sources, top to bottom."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    update = f"run: python tests/docs/test_notebooks.py --update {path.stem}"
    digest = nb.metadata.get("precisionlab", {}).get("source_sha256")
    assert digest == source_digest(nb), f"{path.name}: sources edited since executed; {update}"
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), update
    for i, cell in enumerate(code):
        kinds = [k for k, _ in _texts(cell)]
        assert "error" not in kinds and "stderr" not in kinds, (path.name, i + 1)
        if _DRAWS.search(cell.source):
            assert any("image/png" in k for k in kinds), f"{path.name} cell {i + 1}: no image"
    assert any(_texts(c) for c in code), f"{path.name}: no outputs; {update}"


#: Notebooks that train models (40-80 s each on 2 cores): run by ``-m slow`` (``.ci/run`` runs
#: it after the default suite), which keeps the default suite within its time budget.
TRAINING = {"03_fp16_vs_bf16_training", "04_fp8_recipes", "05_where_precision_breaks",
            "06_your_own_model"}  # fmt: skip


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=pytest.mark.slow) if p.stem in TRAINING else p for p in NOTEBOOKS],
    ids=lambda p: p.stem,
)
def test_notebook_executes_and_shows_what_it_prints_now(path):
    # Run from notebooks/, as a user would; the notebooks write only to temporary directories.
    fresh = execute(path)
    errors = [o for c in fresh.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    problems = differences(nbformat.read(path, as_version=4), fresh)
    assert not problems, (
        f"{path.name}: the committed outputs are stale; run: python tests/docs/test_notebooks.py "
        f"--update {path.stem}\n" + "\n".join(problems)
    )


def test_same_text_allows_a_last_digit_and_nothing_more():
    assert same_text("loss 1.234 at step 80", "loss 1.235 at step 80")
    assert not same_text("loss 1.234 at step 80", "loss 1.236 at step 80")
    assert not same_text("loss 1.234 at step 80", "loss 1.234 at step 81")
    assert not same_text("loss 1.234", "loss 1.2345 (nan)")
    assert same_text("2.5e-03", "2.6e-03") and not same_text("2.5e-03", "2.5e-02")
    assert same_text("3 runs in 41 s", "3 runs in 97 s", timing=True)
    assert not same_text("3 runs in 41 s", "3 runs in 97 s")
    assert not same_text("3 runs in 41 s", "4 runs in 97 s", timing=True)
    assert not same_text("3 runs in 41 s", "3 runs took 97 s", timing=True)
    table = "fp16   1.005   9.9\nbf16   1.393   3.3"
    assert same_text(table, "fp16   1.005  10.2\nbf16   1.393   3.1", timing=True)
    assert not same_text(table, "fp16   1.005  10.2\nbf16   1.395   3.1", timing=True)
    assert not same_text(table, "fp16   1.005   9.9", timing=True)


def update(names: list[str]) -> None:
    """Execute the notebooks named (all, when none is) and write them with their outputs."""
    chosen = [p for p in NOTEBOOKS if not names or any(n in p.name for n in names)]
    if names and not chosen:
        sys.exit(f"no notebook matches {names}; allowed: {', '.join(p.stem for p in NOTEBOOKS)}")
    for path in chosen:
        nbformat.write(execute(path), path)
        print(f"updated {path.relative_to(path.parent.parent)}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--update"]:
        sys.exit("usage: python tests/docs/test_notebooks.py --update [NAME ...]")
    update(sys.argv[2:])
