"""The notebooks execute top to bottom (their cells assert against oracles), and are committed
without outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, path.name


#: Notebooks that train models (40-80 s each on 2 cores): run by ``-m slow`` (``.ci/run`` runs
#: it after the default suite), which keeps the default suite within its time budget.
TRAINING = {"03_fp16_vs_bf16_training", "04_fp8_recipes", "05_where_precision_breaks",
            "06_your_own_model"}  # fmt: skip


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=pytest.mark.slow) if p.stem in TRAINING else p for p in NOTEBOOKS],
    ids=lambda p: p.stem,
)
def test_notebook_executes(path, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    # Run from notebooks/, as a user would; the notebooks write only to temporary directories.
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
