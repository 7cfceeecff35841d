"""Side-by-side comparison of the variants of several run directories."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from precisionlab._text import fmt_value as _fmt
from precisionlab.experiments import store
from precisionlab.experiments.report import markdown_table, text_table

__all__ = ["COLUMNS", "compare_runs"]

#: (column suffix, summary key, formatter) shown for each run.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("loss", "final_loss", "g4"),
    ("acc", "eval_metric", "pct"),
    ("skip", "skipped_steps", "d"),
    ("div@", "divergence_step", "div"),
)


def _summary(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / "summary.json"
    if not path.exists():
        raise ValueError(f"{run_dir}: not a finished run directory (no summary.json)")
    data = store.read_json(path)
    if data.get("kind") != "train":
        raise ValueError(
            f"{run_dir}: compare needs train runs; this one is of kind {data.get('kind')!r}"
        )
    return data


def compare_runs(
    run_dirs: Sequence[str | Path], *, markdown: bool = False
) -> tuple[list[str], list[list[str]], str]:
    """Rows are variants (the union, in order of first appearance), columns the runs.

    Returns (headers, rows, rendered table). Raises ValueError for a directory that is not a
    run of kind ``train``."""
    if not run_dirs:
        raise ValueError("give at least one run directory")
    summaries = [(Path(d), _summary(Path(d))) for d in run_dirs]
    labels = []
    for d, _ in summaries:
        label = d.name or str(d)
        while label in labels:
            label = f"{label}'"
        labels.append(label)
    names: list[str] = []
    for _, s in summaries:
        for u in s["variants"]:
            if u["name"] not in names:
                names.append(u["name"])
    if len(summaries) == 1:
        headers = ["variant"] + [c for c, _, _ in COLUMNS]
    else:
        headers = ["variant"] + [f"{lab}:{c}" for lab in labels for c, _, _ in COLUMNS]
    rows = []
    for name in names:
        row = [name]
        for _, s in summaries:
            unit = next((u for u in s["variants"] if u["name"] == name), None)
            for _, key, how in COLUMNS:
                row.append("n/a" if unit is None else _fmt(unit.get(key), how, unit))
        rows.append(row)
    render = markdown_table if markdown else text_table
    return headers, rows, render(rows, headers)
