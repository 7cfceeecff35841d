"""Telemetry of a ``train`` run: its summary, its TensorBoard scalars and its report views.

Reads each unit's ``telemetry.jsonl`` (rows of :func:`precisionlab.train._telemetry.
telemetry_rows`: one per step, layer and tensor) and writes:

- :func:`summarize_telemetry`: the ``telemetry`` entry of a unit's summary (the worst layers);
- :func:`telemetry_scalars`: TensorBoard scalars ``telemetry/<kind>/<layer>/<tensor>/...``;
- :func:`telemetry_report`: report.md lines and plots: per unit a layer x step heatmap of the
  underflow and of the overflow fraction for every target, the dynamic range of every layer
  against each target format's representable range, and the worst layers with their numbers.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import math
import multiprocessing
import os
import re
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from precisionlab import _io
from precisionlab.experiments import _store as store

__all__ = ["WORST", "summarize_telemetry", "telemetry_report", "telemetry_scalars"]

#: Number of worst (layer, tensor, target) entries kept in the summary.
WORST = 5


def _label(row: dict[str, Any]) -> str:
    """``"layer3:dot_general[2].grad"`` for a matmul's or another operation's tensor (model
    layer and interception site, as ``precisionlab diagnose`` names it; ``"dot_general[2].grad"``
    in rows written before rows named the layer), ``"grad:['w']"`` for a state leaf."""
    if row["kind"] in ("matmul", "op"):
        site = row.get("site")
        head = f"{row['layer']}:{site}" if site and site != row["layer"] else row["layer"]
        return f"{head}.{row['tensor']}"
    return f"{row['kind']}:{row['layer']}"


def _where(row: dict[str, Any]) -> dict[str, Any]:
    """The naming fields of a row: kind, layer, site (matmul rows that have one), tensor."""
    out = {"kind": row["kind"], "layer": row["layer"]}
    if row.get("site"):
        out["site"] = row["site"]
    out["tensor"] = row["tensor"]
    return out


def _tag(name: str) -> str:
    """A TensorBoard-safe name: ``"['hidden'][0]['w']"`` -> ``"hidden.0.w"``,
    ``"dot_general[3]"`` -> ``"dot_general.3"`` (TensorBoard replaces other characters)."""
    return re.sub(r"\['?([^'\]]*)'?\]", r".\1", name).strip(".")


def telemetry_scalars(board: Any, rows: list[dict[str, Any]]) -> None:
    """Write a step's rows to a TensorBoard writer: amax, dynamic range and, per target, the
    underflow and overflow fractions, as ``telemetry/KIND/LAYER[/TENSOR]/[TARGET/]STAT``
    (``telemetry/matmul/layer0/dot_general.0/grad/fp16/underflow``: a matmul's LAYER is its
    model layer and interception site)."""
    for row in rows:
        tag = f"telemetry/{row['kind']}/{_tag(row['layer'])}"
        if row.get("site") and row["site"] != row["layer"]:
            tag += f"/{_tag(row['site'])}"
        tag += f"/{row['tensor']}" if row["tensor"] else ""
        step = int(row["step"])
        for key in ("amax", "dynamic_range"):
            if row.get(key) is not None:
                board.add_scalar(f"{tag}/{key}", float(row[key]), step)
        for target, st in row.get("targets", {}).items():
            for key in ("underflow", "overflow"):
                board.add_scalar(f"{tag}/{target}/{key}", float(st[key]), step)


#: The kinds the worst lists rank: the tensors of the computation (matmul operands, outputs,
#: other operations' outputs, their output gradients and the parameter gradients), not the
#: stored state.
_RANKED = ("matmul", "op", "grad")


def _is_backward(row: dict[str, Any]) -> bool:
    return row["kind"] == "grad" or row["tensor"] == "grad"


def _first_nonfinite(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The tensor where inf/NaN first appears: the first step with any, then the forward pass
    in program order (rows are written in program order), then the backward pass, which runs
    in reverse program order, then the parameter gradients. None if every value is finite."""
    bad = [
        (i, r) for i, r in enumerate(rows)
        if r["kind"] in _RANKED and (r.get("n_nan", 0) or r.get("n_inf", 0))
    ]  # fmt: skip
    if not bad:
        return None
    step = min(int(r["step"]) for _, r in bad)
    at = [(i, r) for i, r in bad if int(r["step"]) == step]

    def order(item: tuple[int, dict[str, Any]]) -> tuple[bool, bool, int]:
        i, r = item
        return (r["kind"] == "grad", _is_backward(r), -i if _is_backward(r) else i)

    _, r = min(at, key=order)
    out = {**_where(r), "step": step, "n_inf": r.get("n_inf", 0), "n_nan": r.get("n_nan", 0)}
    out.update(n=r["n"], backward=_is_backward(r))
    if r.get("where"):
        out["where"] = r["where"]
    return out


def _most(
    rows: list[dict[str, Any]], key: str, keep: Callable[[dict[str, Any]], bool]
) -> list[dict[str, Any]]:
    """The :data:`WORST` tensors (of ``keep`` rows) with the largest ``key`` over the steps."""
    best: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        v = r.get(key)
        if not v or not keep(r):
            continue
        k = (r["kind"], r["layer"], r.get("site"), r["tensor"])
        if k not in best or v > best[k]["fraction"]:
            best[k] = {**_where(r), "fraction": v, "step": r["step"]}
    return sorted(best.values(), key=lambda e: -e["fraction"])[:WORST]


def _worst(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    best: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        if row["kind"] not in _RANKED:
            continue
        for target, st in row.get("targets", {}).items():
            v = st.get(key)
            if not v:
                continue
            k = (row["kind"], row["layer"], row.get("site"), row["tensor"], target)
            if k not in best or v > best[k]["fraction"]:
                best[k] = {**_where(row), "target": target, "fraction": v, "step": row["step"]}
    return sorted(best.values(), key=lambda e: -e["fraction"])[:WORST]


def summarize_telemetry(unit_dir: Path) -> dict[str, Any] | None:
    """The ``telemetry`` entry of a unit's summary, None without telemetry:

    ``first_nonfinite`` (None, or where inf/NaN first appears: ``{kind, layer, [site,]
    tensor, [where,] step, n_inf, n_nan, n, backward}``, see :func:`_first_nonfinite`),
    ``most_nonfinite`` / ``most_zeros`` (at most :data:`WORST` entries ``{kind, layer,
    [site,] tensor, fraction, step}``: the tensors with the largest fraction of inf/NaN
    elements / the parameter gradients with the largest fraction of zeros, over the steps: what
    the computation actually did, where the targets below say what a format would do),
    ``steps`` (the steps with statistics), ``targets`` (their names), ``worst_underflow`` /
    ``worst_overflow`` (at most :data:`WORST` entries ``{kind, layer, [site,] tensor,
    target, fraction, step}``: the largest fraction of a tensor's finite nonzero elements
    that the target would flush to zero / overflow, over the steps, largest first; matmul
    tensors and gradient leaves, not the stored params and optimizer state; ``site``: a
    matmul's interception site), ``widest_dynamic_range`` (``{kind, layer, [site,] tensor,
    binades, step}``: log2 amax - log2 of the smallest nonzero magnitude, widest first)."""
    rows = store.read_jsonl(Path(unit_dir) / "telemetry.jsonl")
    if not rows:
        return None
    widest: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        dr = row.get("dynamic_range")
        k = (row["kind"], row["layer"], row.get("site"), row["tensor"])
        if dr is not None and (k not in widest or dr > widest[k]["binades"]):
            widest[k] = {**_where(row), "binades": dr, "step": row["step"]}
    return {
        "first_nonfinite": _first_nonfinite(rows),
        "most_nonfinite": _most(rows, "frac_nonfinite", lambda r: r["kind"] in _RANKED),
        "most_zeros": _most(rows, "frac_zero", lambda r: r["kind"] == "grad"),
        "steps": sorted({int(r["step"]) for r in rows}),
        "targets": list(rows[0].get("targets", {})),
        "worst_underflow": _worst(rows, "underflow"),
        "worst_overflow": _worst(rows, "overflow"),
        "widest_dynamic_range": sorted(widest.values(), key=lambda e: -e["binades"])[:WORST],
    }


# --- report ----------------------------------------------------------------------------------
#: The heatmap panels: (row key, what it shows). ``None`` target: the row's own fraction of
#: all elements (what the computation did); a target: the fraction of the finite nonzero
#: elements that format would flush to zero / overflow (what it would do).
_ACTUAL = (("frac_zero", "% zero (as computed)"), ("frac_nonfinite", "% inf/NaN (as computed)"))
_WHAT_IF = (("underflow", "what-if: % underflow in {}"), ("overflow", "what-if: % overflow in {}"))
#: The colour scale's floor (%): fractions from it to 100% on a log scale.
_FLOOR_PCT = 1e-3


#: Figures sized for a page: width (inches) and resolution (dots per inch): 7.5 in at 110 dpi is
#: 825 pixels, about the documentation's content width and a report's in a browser, so labels
#: keep their size on the page; tick labels, titles and the colour bar's text in points.
_WIDTH_IN, _DPI, _LABEL_PT = 7.5, 110, 9
#: At most this many layers in one panel and figures at most this tall (inches): a longer
#: heatmap or range plot is drawn in parts (``NAME.png``, ``NAME_2.png``, ...), each labelled.
_MAX_LAYERS, _MAX_HEIGHT_IN = 40, 13.0
#: Height of one layer's row (inches): a 9-point label and its spacing.
_ROW_IN = 0.15
#: The left margin (a fraction of the width) at most; longer layer labels are shortened in the
#: middle (the report's tables name every tensor in full).
_MAX_LEFT = 0.42


def _figure(width: float, height: float, labels: list[str]) -> tuple[Any, float]:
    """A pyplot-free Figure (nothing to close, no global figure registry) and the left margin,
    as a fraction of ``width``, that fits the longest layer label: a fixed layout, because
    matplotlib's automatic ones (constrained, tight) measure every tick label's text extent
    several times and were most of these plots' drawing time."""
    from matplotlib.figure import Figure

    longest = max((len(lab) for lab in labels), default=0)
    left_in = 0.35 + longest * _CHAR_IN
    return Figure(figsize=(width, height)), min(_MAX_LEFT, left_in / width)


#: Width of one character of a tick label (inches): ~0.62 em.
_CHAR_IN = 0.62 * _LABEL_PT / 72


def _short(label: str, width_in: float) -> str:
    """``label`` shortened in the middle (``…``) to fit ``width_in`` inches of tick label."""
    n = max(8, int((width_in - 0.35) / _CHAR_IN))
    if len(label) <= n:
        return label
    head = (n - 1) // 2
    return f"{label[:head]}…{label[len(label) - (n - 1 - head) :]}"


def _chunks(n: int, size: int) -> list[range]:
    """``range(n)`` in as few consecutive pieces of at most ``size`` as possible, of equal
    length give or take one (at least one piece)."""
    pieces = max(1, -(-n // size))
    bounds = [round(i * n / pieces) for i in range(pieces + 1)]
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def _part_paths(path: Path, n: int) -> list[Path]:
    """The files of a figure drawn in ``n`` parts: ``path``, then ``STEM_2.png``, ..."""
    return [path, *(path.with_name(f"{path.stem}_{k}{path.suffix}") for k in range(2, n + 1))]


def _part_title(title: str, rows: range, n_layers: int, k: int, n_parts: int) -> str:
    if n_parts == 1:
        return title
    return f"{title}\n(part {k} of {n_parts}: rows {rows.start + 1}-{rows.stop} of {n_layers})"


def _step_ticks(steps: list[int], panel_in: float) -> tuple[list[int], list[str], int]:
    """Tick positions and labels for ``steps`` on a panel ``panel_in`` inches wide: every
    step while they fit, else every k-th (and the rotation)."""
    rotate = 90 if len(steps) > 6 else 0
    fits = max(1, int(panel_in / (1.5 * _LABEL_PT / 72))) if rotate else max(1, len(steps))
    stride = -(-len(steps) // fits)
    idx = list(range(0, len(steps), stride))
    return idx, [str(steps[i]) for i in idx], rotate


def _panels(rows: list[dict[str, Any]], targets: Sequence[str]) -> list[tuple[str, np.ndarray]]:
    """(title, layer x step grid of fractions, NaN where a row has no value) per panel."""
    labels = list(dict.fromkeys(_label(r) for r in rows))
    steps = sorted({int(r["step"]) for r in rows})
    li, si = {lab: i for i, lab in enumerate(labels)}, {s: j for j, s in enumerate(steps)}
    out = []
    specs: list[tuple[str | None, str, str]] = [(None, k, t) for k, t in _ACTUAL]
    specs += [(tg, k, t.format(tg)) for tg in targets for k, t in _WHAT_IF]
    for target, key, title in specs:
        grid = np.full((len(labels), len(steps)), np.nan)
        for r in rows:
            src = r if target is None else r.get("targets", {}).get(target)
            if src is not None and src.get(key) is not None:
                grid[li[_label(r)], si[int(r["step"])]] = src[key]
        out.append((title, grid))
    return out


def _heatmap(rows: list[dict[str, Any]], targets: Sequence[str], path: Path, title: str) -> int:
    """Layer x step heatmaps in pairs: the zeros and inf/NaN as computed, then for every target
    its underflow and overflow (what-if). One log colour scale from :data:`_FLOOR_PCT` to 100%
    for every panel (grey: exactly 0); the layers that are 0 in every panel are left out;
    every layer and every step (or every k-th where they do not fit) is labelled. Page-width
    figures of at most :data:`_MAX_LAYERS` layers and :data:`_MAX_HEIGHT_IN` inches each
    (:func:`_part_paths`); the number of figures written (0: no rows)."""
    if not rows:
        return 0
    labels = list(dict.fromkeys(_label(r) for r in rows))
    steps = sorted({int(r["step"]) for r in rows})
    panels = _panels(rows, targets)
    shown = np.zeros(len(labels), bool)
    for _, grid in panels:
        shown |= (np.nan_to_num(grid) > 0).any(axis=1)
    if not shown.any():
        shown[:] = True
    labels = [lab for lab, k in zip(labels, shown, strict=True) if k]
    grids = [(name, 100 * grid[shown]) for name, grid in panels]
    pairs = [grids[i : i + 2] for i in range(0, len(grids), 2)]
    top_in, title_in, bottom_in = 0.45, 0.55, 0.75  # figure title; panel titles; step ticks
    parts = []
    for layer_rows in _chunks(len(labels), _MAX_LAYERS):
        row_in = max(0.8, _ROW_IN * len(layer_rows)) + title_in
        per_fig = max(1, int((_MAX_HEIGHT_IN - top_in - bottom_in) // row_in))
        parts += [(layer_rows, pairs[i : i + per_fig]) for i in range(0, len(pairs), per_fig)]
    for k, (layer_rows, fig_pairs) in enumerate(parts, 1):
        names = [labels[i] for i in layer_rows]
        head = _part_title(title, layer_rows, len(labels), k, len(parts))
        _heatmap_figure(names, steps, [(n, g[layer_rows.start : layer_rows.stop])
                                       for pair in fig_pairs for n, g in pair],
                        _part_paths(path, len(parts))[k - 1], head,
                        (top_in, title_in, bottom_in))  # fmt: skip
    return len(parts)


def _heatmap_figure(
    labels: list[str],
    steps: list[int],
    panels: list[tuple[str, Any]],
    path: Path,
    title: str,
    margins: tuple[float, float, float],
) -> None:
    """One figure of :func:`_heatmap`: ``panels`` (title, layer x step grid in %) two a row."""
    from matplotlib.colors import LogNorm

    top_in, title_in, bottom_in = margins
    n_rows = -(-len(panels) // 2)
    row_in = max(0.8, _ROW_IN * len(labels)) + title_in
    height = top_in + n_rows * row_in + bottom_in
    shown = [_short(lab, _MAX_LEFT * _WIDTH_IN) for lab in labels]
    fig, left = _figure(_WIDTH_IN, height, shown)
    right = 0.86
    fig.subplots_adjust(left=left, right=right, wspace=0.06, hspace=title_in / (row_in - title_in),
                        top=1 - (top_in + title_in) / height,
                        bottom=bottom_in / height)  # fmt: skip
    fig.suptitle(title, fontsize=_LABEL_PT + 1, y=1 - 0.05 / height, va="top")
    # No shared axes: a shared locator gives every panel a Tick (line and label artists) for
    # every layer and step, drawn or not, which was most of the report's time. Layer names on
    # the left column, steps on the bottom row; no tick artists anywhere else.
    axes = fig.subplots(n_rows, 2, squeeze=False)
    cmap = _cmap()
    norm = LogNorm(vmin=_FLOOR_PCT, vmax=100.0)
    panel_in = (right - left) * _WIDTH_IN / 2
    ticks, tick_labels, rotate = _step_ticks(steps, panel_in)
    im = None
    for i, ax in enumerate(axes.flat):
        if i >= len(panels):
            ax.set_visible(False)  # an odd panel count: the last row's right half stays empty
            continue
        name, pct = panels[i]
        # exactly 0 -> below the floor (the "under" colour); no value -> NaN (white)
        pct = np.where(pct == 0, _FLOOR_PCT / 10, pct)
        im = ax.imshow(np.ma.masked_invalid(pct), aspect="auto", cmap=cmap, norm=norm,
                       interpolation="nearest")  # fmt: skip
        # a fixed title position (the automatic one measures every tick label of the panel),
        # wrapped after "what-if:" so that it fits half the page
        ax.set_title(name.replace("what-if: ", "what-if:\n"), fontsize=_LABEL_PT, y=1.0)
        row, col = divmod(i, 2)
        if col == 0:
            ax.set_yticks(range(len(shown)), shown, fontsize=_LABEL_PT)
        else:
            ax.set_yticks([])
        if row == n_rows - 1 or i + 2 >= len(panels):
            ax.set_xticks(ticks, tick_labels, rotation=rotate, fontsize=_LABEL_PT)
            ax.set_xlabel("step", fontsize=_LABEL_PT)
        else:
            ax.set_xticks([])
    # the colour bar beside the panels: at most 3 inches, never above the top panel
    span = 1 - (top_in + title_in + bottom_in) / height
    cax = fig.add_axes((0.89, bottom_in / height, 0.02, min(span, 3.0 / height)))
    bar = fig.colorbar(im, cax=cax, extend="min")
    bar.set_label("% (log scale)", fontsize=_LABEL_PT)
    bar.ax.tick_params(labelsize=_LABEL_PT)
    store.save_figure(fig, path, dpi=_DPI)


def _cmap() -> Any:
    import matplotlib

    # exactly 0: light grey, apart from the darkest colour (small); no value: white
    return matplotlib.colormaps["magma"].with_extremes(under="0.82", bad="white")


def _ranges(rows: list[dict[str, Any]], targets: Sequence[str], path: Path, title: str) -> int:
    """Per layer: the span log2(smallest nonzero)..log2(amax) over the run, against each
    target format's subnormal and normal ranges; page-width figures of at most
    :data:`_MAX_LAYERS` layers each (:func:`_part_paths`); the number written."""
    from precisionlab.telemetry import parse_targets  # noqa: PLC0415  JAX-free: the figures are drawn in worker processes

    spans: dict[str, list[float]] = {}
    for r in rows:
        if r.get("amax") and r.get("amin_nonzero"):
            lo, hi = math.log2(r["amin_nonzero"]), math.log2(r["amax"])
            cur = spans.setdefault(_label(r), [lo, hi])
            cur[0], cur[1] = min(cur[0], lo), max(cur[1], hi)
    if not spans:
        return 0
    labels = list(spans)
    lo = min(s[0] for s in spans.values())
    hi = max(s[1] for s in spans.values())
    bands = []
    shown_fmt: set[str] = set()
    for t in parse_targets(targets):
        f = t.fmt
        if t.scaling != "none" or f.name in shown_fmt:
            continue  # scaled targets move the tensor into the range: no fixed band
        shown_fmt.add(f.name)
        bands.append((t.name, math.log2(f.smallest_subnormal), math.log2(f.smallest_normal),
                      math.log2(f.max)))  # fmt: skip
    chunks = _chunks(len(labels), _MAX_LAYERS)
    for k, part in enumerate(chunks, 1):
        names = [labels[i] for i in part]
        shown = [_short(lab, _MAX_LEFT * _WIDTH_IN) for lab in names]
        legend_in = 0.2 * len(bands) + 0.2 if bands else 0.0
        h = max(2.5, _ROW_IN * len(names) + 1.3 + legend_in)
        fig, left = _figure(_WIDTH_IN, h, shown)
        fig.subplots_adjust(left=left, right=0.97, top=1 - 0.6 / h,
                            bottom=(0.6 + legend_in) / h)  # fmt: skip
        ax = fig.subplots()
        for i, lab in enumerate(names):
            ax.plot(spans[lab], [i, i], color="k", lw=3, solid_capstyle="butt")
        colors = ("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange")
        for (name, sub, norm, top), c in zip(bands, colors, strict=False):
            ax.axvspan(sub, norm, color=c, alpha=0.08, lw=0)
            label = f"{name}: subnormal 2^{sub:.0f}.., normal 2^{norm:.0f}..2^{top:.1f}"
            ax.axvspan(norm, top, color=c, alpha=0.15, lw=0, label=label)
            ax.axvline(sub, color=c, ls=":", lw=1)
            ax.axvline(top, color=c, ls="-", lw=1)
        ax.set_xlim(min(lo, *(b[1] for b in bands)) - 2 if bands else lo - 2,
                    max(hi, *(b[3] for b in bands)) + 2 if bands else hi + 2)  # fmt: skip
        ax.set_ylim(len(names) - 0.5, -0.5)
        ax.set_yticks(range(len(names)), shown, fontsize=_LABEL_PT)
        ax.tick_params(axis="x", labelsize=_LABEL_PT)
        ax.set_xlabel("log2 |value| (bar: smallest nonzero .. amax over the telemetry steps)",
                      fontsize=_LABEL_PT)  # fmt: skip
        head = _part_title(f"{title}: dynamic range against the target formats", part,
                           len(labels), k, len(chunks))  # fmt: skip
        fig.suptitle(head, fontsize=_LABEL_PT + 1, y=1 - 0.05 / h, va="top")
        if bands:
            fig.legend(fontsize=_LABEL_PT, loc="lower left", ncols=1, frameon=False,
                       bbox_to_anchor=(0.0, 0.0))  # fmt: skip
        store.save_figure(fig, _part_paths(path, len(chunks))[k - 1], dpi=_DPI)
    return len(chunks)


def _fmt_pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def _nonfinite_line(e: dict[str, Any] | None) -> str:
    if e is None:
        return "Every observed value is finite."
    where = f" at {e['where']}" if e.get("where") else ""
    pass_ = "backward pass" if e["backward"] else "forward pass"
    bad = e["n_inf"] + e["n_nan"]
    return (
        f"First inf/NaN: step {e['step']}, {pass_}, in `{_label(e)}`{where}: {bad} of {e['n']} "
        f"elements ({e['n_inf']} inf, {e['n_nan']} NaN)."
    )


def _table(entries: list[dict[str, Any]], extra: str | None = None) -> list[str]:
    head = "| tensor | " + (f"{extra} | " if extra else "") + "fraction | step |"
    lines = [head, "|---|" + ("---|" if extra else "") + "--:|--:|"]
    for e in entries:
        cell = f"{e[extra]} | " if extra else ""
        lines.append(f"| {_label(e)} | {cell}{_fmt_pct(e['fraction'])} | {e['step']} |")
    return [*lines, ""]


#: Environment variable: how many worker processes draw the report's telemetry figures
#: (a positive integer; default one per CPU, at most one per unit; 1 draws them in this
#: process).
_WORKERS_ENV = "PRECISIONLAB_REPORT_WORKERS"

_HEAT_CAPTION = (
    "layer x step heatmaps: zeros and inf/NaN as computed, and each target's "
    f"underflow and overflow; log colour scale {_FLOOR_PCT:g}%..100% in every "
    "panel, grey: exactly 0; tensors that are 0 in every panel left out"
)
_FIGURES = (
    ("heatmap", _HEAT_CAPTION),
    ("range", "dynamic range of every tensor against the formats' ranges"),
)


def _draw_unit(run_dir: str, rows_path: str, targets: list[str], paths: list[str],
               title: str) -> list[int]:  # fmt: skip
    """Draw one unit's heatmap and range figures (paths in :data:`_FIGURES` order) from its
    telemetry.jsonl; how many parts of each were written (:func:`_part_paths`; 0: none). Runs
    in a worker process: takes plain strings, and confines its reads and writes to
    ``run_dir`` as :func:`write_report` does."""
    with store.confined(run_dir):
        rows = [r for r in store.read_jsonl(Path(rows_path)) if r["kind"] in _RANKED]
        return [
            fn(rows, targets, Path(path), title)
            for fn, path in zip((_heatmap, _ranges), paths, strict=True)
        ]


def _report_workers() -> int | None:
    """The worker count :data:`_WORKERS_ENV` asks for, None when unset (one per CPU)."""
    raw = os.environ.get(_WORKERS_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{_WORKERS_ENV} must be a positive integer (1: no worker processes), "
                         f"got {raw!r}")  # fmt: skip
    return int(raw)


def _draw_all(jobs: list[tuple]) -> list[list[int]]:
    """:func:`_draw_unit` for every job, in order: in worker processes when there are several
    jobs and CPUs (the units' figures are independent), else here. Workers start fresh
    interpreters ("spawn": never fork a process whose JAX runtime has threads); an error in
    one is raised here, as the serial path raises it."""
    workers = min(len(jobs), _report_workers() or os.cpu_count() or 1)
    if workers <= 1:
        return [_draw_unit(*job) for job in jobs]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = [pool.submit(_draw_unit, *job) for job in jobs]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def _figure_key(job: tuple) -> str:
    """What a unit's telemetry figures are drawn from: its rows file, targets and title, this
    module's code and matplotlib's version (sha256)."""
    import matplotlib

    _, rows_path, targets, _, title = job
    digest = hashlib.sha256()
    for part in (inspect.getsource(sys.modules[_draw_unit.__module__]),
                 matplotlib.__version__, json.dumps(targets), title):  # fmt: skip
        digest.update(part.encode())
        digest.update(b"\0")
    digest.update(_io.read_bytes(rows_path, _io.MAX_JSONL_BYTES) if os.path.exists(rows_path)
                  else b"")  # fmt: skip
    return digest.hexdigest()


def _from_cache(cache: Path, key: str, paths: list[str]) -> list[int] | None:
    """The figures of ``key`` copied from ``cache`` to ``paths`` (and their parts); how many
    parts of each were drawn (None: not cached)."""
    marker = cache / f"{key}.json"
    if not marker.is_file():
        return None
    try:
        flags = json.loads(_io.read_bytes(marker, 1 << 10))
        if not isinstance(flags, list) or len(flags) != len(paths):
            return None
        blobs = [[_io.read_bytes(cache / f"{key}-{i}-{k}.png", 64 << 20) for k in range(int(n))]
                 for i, n in enumerate(flags)]  # fmt: skip
    except (OSError, ValueError, TypeError):
        return None  # a damaged entry: drawn again
    for parts, path in zip(blobs, paths, strict=True):
        for blob, part in zip(parts, _part_paths(Path(path), len(parts)), strict=True):
            with _io.atomic_open(part, "wb") as f:
                f.write(blob)
    return [int(x) for x in flags]


def _to_cache(cache: Path, key: str, paths: list[str], flags: list[int]) -> None:
    try:
        _io.makedirs(cache)
        for i, (path, n) in enumerate(zip(paths, flags, strict=True)):
            for k, part in enumerate(_part_paths(Path(path), int(n))):
                with _io.atomic_open(cache / f"{key}-{i}-{k}.png", "wb") as f:
                    f.write(_io.read_bytes(part, 64 << 20))
        _io.write_json(cache / f"{key}.json", [int(x) for x in flags], indent=None)  # last
    except (OSError, ValueError):
        pass  # a cache that cannot be written only costs the next run the drawing


def telemetry_report(
    run_dir: Path, units: list[dict[str, Any]], plot_dir: Path | None, *,
    figure_cache: str | Path | None = None,
) -> list[str]:  # fmt: skip
    """report.md lines for the units with telemetry (and, with ``plot_dir``, their plots,
    drawn in parallel: :data:`_WORKERS_ENV`; with ``figure_cache``, figures drawn before from
    the same rows, targets and code are copied from there instead)."""
    units = [u for u in units if u.get("telemetry")]
    drawn: dict[int, list[int]] = {}
    if plot_dir is not None and units:
        store.makedirs(plot_dir)
        jobs = []
        for u in units:
            uid, name = u.get("id", u.get("name")), store.safe_name(str(u.get("id", u.get("name"))))
            rows_path = Path(run_dir) / "variants" / str(uid) / "telemetry.jsonl"
            paths = [str(plot_dir / f"telemetry_{kind}_{name}.png") for kind, _ in _FIGURES]
            jobs.append((str(run_dir), str(rows_path), list(u["telemetry"]["targets"]), paths,
                         str(u.get("name"))))  # fmt: skip
        cache = None if figure_cache is None else Path(figure_cache)
        keys = [_figure_key(job) if cache is not None else "" for job in jobs]
        for i, job in enumerate(jobs):
            if cache is not None:
                got = _from_cache(cache, keys[i], job[3])
                if got is not None:
                    drawn[i] = got
        todo = [i for i in range(len(jobs)) if i not in drawn]
        for i, flags in zip(todo, _draw_all([jobs[i] for i in todo]), strict=True):
            drawn[i] = flags
            if cache is not None:
                _to_cache(cache, keys[i], jobs[i][3], flags)
    lines: list[str] = []
    for i, u in enumerate(units):
        summ = u["telemetry"]
        uid = u.get("id", u.get("name"))
        lines += [f"### {u.get('name')}", ""]
        lines.append(
            f"Statistics at steps {', '.join(map(str, summ['steps'][:12]))}"
            f"{' ...' if len(summ['steps']) > 12 else ''}; targets {', '.join(summ['targets'])}."
        )
        lines.append("")
        if "first_nonfinite" in summ:  # summaries written before it had it: left out
            lines += [_nonfinite_line(summ["first_nonfinite"]), ""]
        zeros = [e for e in summ.get("most_zeros") or [] if e["fraction"] >= 0.5]
        if zeros:
            lines += ["Parameter gradients that are mostly zero (fraction of all elements, as "
                      "computed, in the gradients the optimizer received):"]  # fmt: skip
            lines += ["", *_table(zeros)]
        for key, what in (("worst_underflow", "underflow"), ("worst_overflow", "overflow")):
            worst = summ.get(key) or []
            if not worst:
                lines += [f"What-if: no finite nonzero value would {what} in any target format.",
                          ""]  # fmt: skip
                continue
            lines += [f"What-if {what}: had the tensor been stored in the target format, the "
                      "fraction of its finite nonzero elements that format would "
                      f"{'flush to zero' if what == 'underflow' else 'overflow'} (at its worst "
                      "step). The run itself computed in its own dtypes: what it did is the "
                      "inf/NaN above and the skipped steps in the table.", ""]  # fmt: skip
            lines += _table(worst, "target")
        if plot_dir is not None:
            name = store.safe_name(str(uid))
            for (kind, caption), n in zip(_FIGURES, drawn[i], strict=True):
                parts = _part_paths(plot_dir / f"telemetry_{kind}_{name}.png", n)
                for k, path in enumerate(parts, 1):
                    rel = path.relative_to(run_dir).as_posix()
                    part = f" (part {k} of {n})" if n > 1 else ""
                    lines += [f"![{caption}{part}]({rel})", "",
                              f"{u.get('name')}: {caption}{part}.", ""]  # fmt: skip
    if lines:
        lines = ["## Numerics telemetry", "",
                 "Matmul operands (lhs, rhs), outputs (out) and output gradients (grad), and the "
                 "output (out) and output gradient (grad) of every other operation that can "
                 "overflow or underflow, by model layer and interception site (LAYER:SITE), and "
                 "gradient leaves (grad:PATH). Zeros and inf/NaN are fractions of all elements; "
                 "a target's underflow and overflow are fractions of the finite nonzero "
                 "elements.", "", *lines]  # fmt: skip
    return lines
