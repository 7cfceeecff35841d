"""Side-by-side comparison of the variants of several run directories."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from precisionlab._text import fmt_value as _fmt
from precisionlab.experiments import _store as store
from precisionlab.experiments._report import markdown_table, text_table

__all__ = ["COLUMNS", "WIDTH", "compare_runs"]

#: The widest plain-text table printed (characters): wider ones get short run labels and
#: are split into several tables, each repeating the variant column.
WIDTH = 100

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
    if markdown:
        return headers, rows, markdown_table(rows, headers)
    return headers, rows, _fitted(rows, headers, labels, [str(d) for d, _ in summaries])


def _fitted(rows: list[list[str]], headers: list[str], labels: list[str], dirs: list[str]) -> str:
    """The plain table, or where wider than :data:`WIDTH`: runs labelled A, B, ... (a legend
    above) and as many runs per table as fit (each table repeats the variant column)."""
    text = text_table(rows, headers)
    if max(len(line) for line in text.splitlines()) <= WIDTH or len(labels) == 1:
        return text
    short = [_letter(i) for i in range(len(labels))]
    legend = [f"{k}: {d}" for k, d in zip(short, labels, strict=True)]
    n = len(COLUMNS)
    blocks: list[str] = []
    start = 0
    while start < len(labels):
        stop = start + 1
        while stop < len(labels) and _width(rows, short, start, stop + 1) <= WIDTH:
            stop += 1
        heads = ["variant"] + [f"{k}:{c}" for k in short[start:stop] for c, _, _ in COLUMNS]
        cells = [[r[0], *r[1 + start * n : 1 + stop * n]] for r in rows]
        blocks.append(text_table(cells, heads))
        start = stop
    return "\n".join(legend) + "\n\n" + "\n\n".join(blocks)


def _letter(i: int) -> str:
    return chr(ord("A") + i) if i < 26 else f"R{i + 1}"


def _width(rows: list[list[str]], short: list[str], start: int, stop: int) -> int:
    n = len(COLUMNS)
    heads = ["variant"] + [f"{k}:{c}" for k in short[start:stop] for c, _, _ in COLUMNS]
    cells = [[r[0], *r[1 + start * n : 1 + stop * n]] for r in rows]
    return max(len(line) for line in text_table(cells, heads).splitlines())
