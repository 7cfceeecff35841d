"""``recipe_groups.png``: what each matmul recipe does to its tensor groups over training.

One row per (setting, statistic) and one column per tensor group (``x`` activations, ``w``
weights, ``g`` output gradients): the % of elements that saturate and the % of nonzero
elements that underflow to zero after quantization, at the histogram steps
(``recipe_<group>_saturated`` / ``recipe_<group>_underflow`` of ``metrics.jsonl``), one line
per recipe variant. The y axis is symmetric-log (linear below 0.01%) so that a recipe that
never saturates sits on 0 and one that saturates 0.8% or 20% is visible on the same axis.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from precisionlab import _io

__all__ = ["GROUP_NAMES", "plot_recipe_groups"]

#: Column titles of the tensor groups.
GROUP_NAMES = {"x": "x (activations)", "w": "w (weights)", "g": "g (output gradients)"}
_STATS = {"saturated": "% saturated", "underflow": "% of nonzero flushed to 0"}
_STYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _points(rows: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    pairs = [(r["step"], r[key]) for r in rows if r.get(key) is not None and "step" in r]
    steps = np.array([p[0] for p in pairs], np.float64)
    return steps, 100 * np.array([p[1] for p in pairs], np.float64)


def _tick(value: float, _pos: object) -> str:
    return f"{value:.2g}"


def plot_recipe_groups(units: list[dict[str, Any]], path: Path) -> bool:
    """Write the figure for the variants of ``units`` that ran a recipe (with metrics); False
    (nothing written) when none did."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    keep = [u for u in units if any("recipe_g_saturated" in r for r in u["metrics"])]
    if not keep:
        return False
    settings: dict[str, list[dict[str, Any]]] = {}
    for u in keep:
        settings.setdefault(u["summary"].get("setting") or "", []).append(u)
    names = list(dict.fromkeys(u["summary"]["variant"] for u in keep))
    cmap = plt.get_cmap("tab20")
    color = {n: cmap(i % 20) for i, n in enumerate(names)}
    n_rows = len(settings) * len(_STATS)
    # page-wide (7.5 in at 110 dpi: 825 px), one legend for every panel under the figure
    legend_in = 0.25 * math.ceil(len(names) / 3) + 0.2
    height = 2.6 * n_rows + legend_in
    fig, axes = plt.subplots(n_rows, len(GROUP_NAMES), figsize=(7.5, height), squeeze=False)
    handles: dict[str, Any] = {}
    row = 0
    for setting, group_units in settings.items():
        for stat, ylabel in _STATS.items():
            for col, (group, title) in enumerate(GROUP_NAMES.items()):
                ax = axes[row, col]
                for i, u in enumerate(group_units):
                    steps, values = _points(u["metrics"], f"recipe_{group}_{stat}")
                    variant = u["summary"]["variant"]
                    ax.plot(steps, values, color=color[variant], ls=_STYLES[i % len(_STYLES)],
                            marker=_MARKERS[i % len(_MARKERS)], ms=4, label=variant)  # fmt: skip
                ax.set_yscale("symlog", linthresh=0.01)
                ax.set_ylim(bottom=0)
                # the setting beside the row, not in each title: three titles fit the width
                ax.set_title(title, fontsize=9)
                ax.set_xlabel("step", fontsize=9)
                if col == 0:
                    ax.set_ylabel(f"{setting + ': ' if setting else ''}{ylabel}", fontsize=9)
                ax.grid(alpha=0.3)
                ax.tick_params(labelsize=9)
                # plain short tick labels (symlog's default writes 2.46488 x 10^-3)
                ax.yaxis.set_major_formatter(FuncFormatter(_tick))
                for line in ax.get_lines():
                    handles.setdefault(line.get_label(), line)
            row += 1
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncols=3, fontsize=9,
               frameon=False)  # fmt: skip
    fig.tight_layout(rect=(0, legend_in / height, 1, 1))
    _io.save_figure(fig, path, dpi=110)
    plt.close(fig)
    return True
