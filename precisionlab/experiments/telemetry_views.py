"""Telemetry of a ``train`` run: its summary, its TensorBoard scalars and its report views.

Reads each unit's ``telemetry.jsonl`` (rows of :func:`precisionlab.train.telemetry.
telemetry_rows`: one per step, layer and tensor) and writes:

- :func:`summarize_telemetry`: the ``telemetry`` entry of a unit's summary (the worst layers);
- :func:`telemetry_scalars`: TensorBoard scalars ``telemetry/<kind>/<layer>/<tensor>/...``;
- :func:`telemetry_report`: report.md lines and plots: per unit a layer x step heatmap of the
  underflow and of the overflow fraction for every target, the dynamic range of every layer
  against each target format's representable range, and the worst layers with their numbers.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from precisionlab.experiments import store

__all__ = ["WORST", "summarize_telemetry", "telemetry_report", "telemetry_scalars"]

#: Number of worst (layer, tensor, target) entries kept in the summary.
WORST = 5


def _label(row: dict[str, Any]) -> str:
    """``"layer3:dot_general[2].grad"`` for a matmul tensor (model layer and interception
    site, as ``precisionlab diagnose`` names it; ``"dot_general[2].grad"`` in rows written
    before rows named the layer), ``"grad:['w']"`` for a state leaf."""
    if row["kind"] == "matmul":
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
#: output gradients and the parameter gradients), not the stored state.
_RANKED = ("matmul", "grad")


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
        "steps": sorted({int(r["step"]) for r in rows}),
        "targets": list(rows[0].get("targets", {})),
        "worst_underflow": _worst(rows, "underflow"),
        "worst_overflow": _worst(rows, "overflow"),
        "widest_dynamic_range": sorted(widest.values(), key=lambda e: -e["binades"])[:WORST],
    }


# --- report ----------------------------------------------------------------------------------
def _grid(rows: list[dict[str, Any]], target: str, key: str):
    labels = list(dict.fromkeys(_label(r) for r in rows))
    steps = sorted({int(r["step"]) for r in rows})
    grid = np.full((len(labels), len(steps)), np.nan)
    li, si = {lab: i for i, lab in enumerate(labels)}, {s: j for j, s in enumerate(steps)}
    for r in rows:
        st = r.get("targets", {}).get(target)
        if st is not None:
            grid[li[_label(r)], si[int(r["step"])]] = st[key]
    return labels, steps, grid


#: Tick label size (points) of the layer names, and the figure resolution (dots per inch).
_LABEL_PT, _DPI = 7, 90


def _figure(width: float, height: float, labels: list[str]):
    """A pyplot-free Figure (nothing to close, no global figure registry) and the left margin,
    as a fraction of ``width``, that fits the longest layer label: a fixed layout, because
    matplotlib's automatic ones (constrained, tight) measure every tick label's text extent
    several times and were most of these plots' drawing time."""
    from matplotlib.figure import Figure

    longest = max((len(lab) for lab in labels), default=0)
    left_in = 0.35 + longest * 0.62 * _LABEL_PT / 72  # ~0.62 em per character, plus padding
    return Figure(figsize=(width, height)), min(0.6, left_in / width)


def _heatmap(rows, targets, path: Path, title: str) -> bool:
    """One figure per unit: for every target a row of two layer x step heatmaps (underflow,
    overflow %), the layer names on the left column only, one colour scale for all."""
    if not targets or not rows:
        return False
    labels = list(dict.fromkeys(_label(r) for r in rows))
    h = max(3.0, 0.22 * len(labels) + 1.5)
    fig, left = _figure(12.0, h * len(targets), labels)
    top_in, bottom_in = 0.35, 0.55  # title; step ticks and label (bottom row)
    fig.subplots_adjust(left=left, right=0.9, wspace=0.05, hspace=top_in / h,
                        top=1 - top_in / (h * len(targets)),
                        bottom=bottom_in / (h * len(targets)))  # fmt: skip
    # every panel has the same layers and steps: shared axes, labelled on the outer panels
    axes = fig.subplots(len(targets), 2, squeeze=False, sharex=True, sharey=True)
    im = None
    for i, target in enumerate(targets):
        for j, key in enumerate(("underflow", "overflow")):
            ax = axes[i][j]
            labels, steps, grid = _grid(rows, target, key)
            im = ax.imshow(100 * grid, aspect="auto", cmap="magma", vmin=0, vmax=100,
                           interpolation="nearest")  # fmt: skip
            ax.set_title(f"{title}: % {key} under {target}", fontsize=9)
    axes[0][0].set_yticks(range(len(labels)), labels)
    ticks = np.linspace(0, len(steps) - 1, min(len(steps), 8)).round().astype(int)
    axes[0][0].set_xticks(ticks, [str(steps[t]) for t in ticks])
    for ax in axes.flat:
        ax.tick_params(labelsize=_LABEL_PT)
    for ax in axes[-1]:
        ax.set_xlabel("step", fontsize=8)
    cax = fig.add_axes((0.92, bottom_in / (h * len(targets)), 0.015, 0.8 / len(targets)))
    fig.colorbar(im, cax=cax, label="% of finite nonzero elements (every panel)")
    store.save_figure(fig, path, dpi=_DPI)
    return True


def _ranges(rows, targets, path: Path, title: str) -> bool:
    """Per layer: the span log2(smallest nonzero)..log2(amax) over the run, against each
    target format's subnormal and normal ranges."""
    from precisionlab.telemetry import parse_targets

    spans: dict[str, list[float]] = {}
    for r in rows:
        if r.get("amax") and r.get("amin_nonzero"):
            lo, hi = math.log2(r["amin_nonzero"]), math.log2(r["amax"])
            cur = spans.setdefault(_label(r), [lo, hi])
            cur[0], cur[1] = min(cur[0], lo), max(cur[1], hi)
    if not spans:
        return False
    labels = list(spans)
    h = max(3.0, 0.22 * len(labels) + 1.5)
    fig, left = _figure(10.0, h, labels)
    fig.subplots_adjust(left=left, right=0.98, top=1 - 0.35 / h, bottom=0.6 / h)
    ax = fig.subplots()
    for i, lab in enumerate(labels):
        ax.plot(spans[lab], [i, i], color="k", lw=3, solid_capstyle="butt")
    colors = ("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange")
    shown = set()
    for t, c in zip(parse_targets(targets), colors, strict=False):
        f = t.fmt
        if t.scaling != "none" or f.name in shown:
            continue  # scaled targets move the tensor into the range: no fixed band
        shown.add(f.name)
        sub, norm, top = (
            math.log2(f.smallest_subnormal),
            math.log2(f.smallest_normal),
            math.log2(f.max),
        )
        ax.axvspan(sub, norm, color=c, alpha=0.08, lw=0)
        label = f"{t.name}: subnormal 2^{sub:.0f}.., normal 2^{norm:.0f}..2^{top:.1f}"
        ax.axvspan(norm, top, color=c, alpha=0.15, lw=0, label=label)
        ax.axvline(sub, color=c, ls=":", lw=1)
        ax.axvline(top, color=c, ls="-", lw=1)
    ax.set_yticks(range(len(labels)), labels, fontsize=_LABEL_PT)
    ax.set_xlabel("log2 |value| (bar: smallest nonzero .. amax over the telemetry steps)")
    ax.set_title(f"{title}: dynamic range of every tensor against the target formats", fontsize=9)
    if shown:
        ax.legend(fontsize=7, loc="lower right")
    store.save_figure(fig, path, dpi=_DPI)
    return True


def _fmt_pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def telemetry_report(
    run_dir: Path, units: list[dict[str, Any]], plot_dir: Path | None
) -> list[str]:
    """report.md lines for the units with telemetry (and, with ``plot_dir``, their plots)."""
    lines: list[str] = []
    for u in units:
        summ = u.get("telemetry")
        if not summ:
            continue
        uid = u.get("id", u.get("name"))
        lines += [f"### {u.get('name')}", ""]
        lines.append(
            f"Statistics at steps {', '.join(map(str, summ['steps'][:12]))}"
            f"{' ...' if len(summ['steps']) > 12 else ''}; targets {', '.join(summ['targets'])}."
        )
        lines.append("")
        for key, what in (("worst_underflow", "underflow"), ("worst_overflow", "overflow")):
            worst = summ.get(key) or []
            if not worst:
                lines += [f"No tensor would {what} under any target.", ""]
                continue
            lines += [f"Worst {what} (fraction of nonzero elements, at its worst step):", ""]
            lines += ["| tensor | target | fraction | step |", "|---|---|---|---|"]
            for e in worst:
                name = _label(e)
                lines.append(
                    f"| {name} | {e['target']} | {_fmt_pct(e['fraction'])} | {e['step']} |"
                )
            lines.append("")
        if plot_dir is not None:
            rows = store.read_jsonl(Path(run_dir) / "variants" / str(uid) / "telemetry.jsonl")
            rows = [r for r in rows if r["kind"] in ("matmul", "grad")]
            store.makedirs(plot_dir)
            name = store.safe_name(str(uid))
            for kind, fn, caption in (
                ("heatmap", _heatmap, "layer x step heatmap of the underflow and overflow %"),
                ("range", _ranges, "dynamic range of every tensor against the formats' ranges"),
            ):
                path = plot_dir / f"telemetry_{kind}_{name}.png"
                if fn(rows, summ["targets"], path, str(u.get("name"))):
                    rel = path.relative_to(run_dir).as_posix()
                    lines += [f"![{caption}]({rel})", "", f"{u.get('name')}: {caption}.", ""]
    if lines:
        lines = ["## Numerics telemetry", "",
                 "Matmul operands (lhs, rhs), outputs (out) and output gradients (grad) by "
                 "model layer and interception site (LAYER:SITE), and gradient leaves "
                 "(grad:PATH); fractions are of the "
                 "finite nonzero elements.", "", *lines]  # fmt: skip
    return lines
