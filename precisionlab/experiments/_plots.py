"""PNG plots of a ``train`` run (matplotlib, Agg backend), one panel per setting.

- ``loss.png``: training loss of every variant overlaid (moving average; log axis when the
  losses span more than a decade); a cross marks where a variant diverged. The first variant of
  a setting (the reference, e.g. fp32) is a wide pale band so that curves matching it stay
  visible on top of it; every variant has its own line style and markers, and a curve equal to
  an earlier one (to 0.1%) says "= NAME" in the legend instead of hiding under it.
- ``loss_scale.png``: the loss scale per step (log2 axis), for variants with loss scaling; a
  scale that underflowed to 0 (no log) is marked with triangles on the bottom edge.
- ``skipped.png``: cumulative skipped steps (non-finite gradients), settings with skips only.
- ``underflow.png``: the underflow meter, % of gradient elements zero or subnormal in the
  compute dtype (inf/NaN elements are counted apart: the summary's ``mean_nonfinite_fraction``).
- ``hist_grad.png`` / ``hist_act.png``: histograms of log2|gradient| and log2|activation| at
  the last histogram step, with the float16 and bfloat16 representable ranges shaded (subnormal
  range light, normal range dark, max as a line), in the manner of Fig. 3 of Micikevicius et al.
  2018, "Mixed Precision Training".
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from precisionlab import _io
from precisionlab._text import fmt_value as _fmt
from precisionlab.experiments._recipe_plots import plot_recipe_groups
from precisionlab.formats import FloatFormat, get_format

__all__ = ["write_plots"]


def _series(rows: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    pairs = [(r["step"], r[key]) for r in rows if key in r and "step" in r]
    if not pairs:
        return np.zeros(0), np.zeros(0)
    steps = np.array([p[0] for p in pairs], dtype=np.float64)
    values = np.array([float(p[1]) if p[1] is not None else np.nan for p in pairs], np.float64)
    return steps, values


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average that ignores non-finite entries (NaN where none in window)."""
    if window <= 1 or values.size == 0:
        return values
    finite = np.isfinite(values)
    v = np.where(finite, values, 0.0)
    csum = np.concatenate([[0.0], np.cumsum(v)])
    ccount = np.concatenate([[0.0], np.cumsum(finite)])
    idx = np.arange(1, values.size + 1)
    lo = np.maximum(idx - window, 0)
    count = ccount[idx] - ccount[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        out = (csum[idx] - csum[lo]) / count
    out[count == 0] = np.nan
    # Once a run has gone non-finite for good, do not draw a line through the gap.
    return out


def _by_setting(units: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for u in units:
        out.setdefault(u["summary"].get("setting") or "", []).append(u)
    return out


#: Width of every figure (inches; drawn at 110 dpi: 825 pixels): the documentation's content
#: width, so a figure copied onto a page is shown at its size and its text stays readable.
_PAGE_WIDTH_IN = 7.5


def _panels(n: int, *, height: float = 3.4, max_cols: int = 1) -> tuple[Any, Any]:
    """A page-wide figure of ``n`` panels, ``max_cols`` a row (stacked by default), each
    ``height`` inches tall."""
    import matplotlib.pyplot as plt

    cols = min(n, max_cols)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(_PAGE_WIDTH_IN, height * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def _colors(units: list[dict[str, Any]]) -> dict[str, Any]:
    import matplotlib.pyplot as plt

    names = []
    for u in units:
        v = u["summary"]["variant"]
        if v not in names:
            names.append(v)
    cmap = plt.get_cmap("tab10")
    return {n: cmap(i % 10) for i, n in enumerate(names)}


def _label(u: dict[str, Any]) -> str:
    s = u["summary"]
    label = s["variant"] + (f" s{s['seed']}" if s["name"].endswith(f" s{s['seed']}") else "")
    if s.get("status") == "failed":
        label += " (failed)"
    return label


_STYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _style(i: int) -> dict[str, Any]:
    """Line style and marker of the i-th variant of a panel: overlapping curves stay visible."""
    return {"ls": _STYLES[i % len(_STYLES)], "marker": _MARKERS[i % len(_MARKERS)], "ms": 5}


def _same_curve(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.size == 0:
        return False
    fa, fb = np.isfinite(a), np.isfinite(b)
    if not np.array_equal(fa, fb):
        return False
    return bool(np.allclose(a[fa], b[fb], rtol=1e-3, atol=0))


def _title(setting: str, what: str) -> str:
    return f"{what}: {setting}" if setting else what


def _plot_curves(
    units: list[dict[str, Any]],
    key: str,
    path: Path,
    *,
    what: str,
    ylabel: str,
    transform: Any = None,
    log: str = "auto",
    cumulative: bool = False,
    smooth: bool = True,
    keep: Any = None,
    mark_divergence: bool = False,
    mark_zero: bool = False,
) -> bool:
    import matplotlib.pyplot as plt

    groups = _by_setting(units)
    chosen = {s: [u for u in us if keep is None or keep(u)] for s, us in groups.items()}
    chosen = {
        s: us for s, us in chosen.items() if any(_series(u["metrics"], key)[0].size for u in us)
    }
    if cumulative:  # a panel where nothing ever happened says nothing
        chosen = {
            s: us
            for s, us in chosen.items()
            if any(np.nansum(_series(u["metrics"], key)[1]) > 0 for u in us)
        }
    if not chosen:
        return False
    colors = _colors(units)
    # more variants than a legend inside the panel can hold without hiding the curves: the
    # legend goes under the panel, three columns, and the panel grows to hold it
    crowded = max(len(us) for us in chosen.values()) > 8
    below = 0.2 * math.ceil(max(len(us) for us in chosen.values()) / 3) + 0.5 if crowded else 0
    fig, axes = _panels(len(chosen), height=3.4 + below)
    for ax, (setting, us) in zip(axes, chosen.items(), strict=True):
        lo, hi = np.inf, -np.inf
        drawn: list[tuple[str, np.ndarray, np.ndarray]] = []
        zero_steps: list[tuple[np.ndarray, Any, str]] = []
        for i, u in enumerate(us):
            steps, values = _series(u["metrics"], key)
            if steps.size == 0:
                continue
            if cumulative:
                values = np.cumsum(np.nan_to_num(values))
            zero = values == 0
            if mark_zero:  # a zero (collapsed) value has no log: marked apart, not drawn
                values = np.where(zero, np.nan, values)
            if transform is not None:
                with np.errstate(divide="ignore", invalid="ignore"):
                    values = transform(values)
            window = max(1, steps.size // 50) if smooth else 1
            shown = _smooth(values, window)
            color = colors[u["summary"]["variant"]]
            label = _label(u)
            if cumulative and values.size:
                label += f" ({values[-1]:.0f})"
            twin = next(
                (n for n, s, v in drawn if np.array_equal(s, steps) and _same_curve(v, shown)),
                None,
            )
            if twin is not None:
                label += f" (= {twin})"
            drawn.append((_label(u), steps, shown))
            if mark_zero and zero.any():
                zero_steps.append((steps[zero], color, _label(u)))
            style = _style(i)
            style["markevery"] = (i % 7 * max(1, steps.size // 70), max(1, steps.size // 10))
            if u is us[0] and len(us) > 1:
                # The first variant is the reference: a wide pale band under the others, so
                # curves that match it stay visible on top of it.
                ax.plot(steps, shown, color=color, label=label, lw=5, alpha=0.35, ls="-")
            else:
                ax.plot(steps, shown, color=color, label=label, lw=1.5, alpha=0.95, **style)
            good = shown[np.isfinite(shown)]
            if good.size:
                lo, hi = min(lo, good.min()), max(hi, good.max())
            div = u["summary"].get("divergence_step")
            if mark_divergence and u["summary"].get("diverged") and div is not None:
                finite_before = shown[(steps <= div) & np.isfinite(shown)]
                y = finite_before[-1] if finite_before.size else (hi if np.isfinite(hi) else 1.0)
                ax.plot([div], [y], "x", color=color, ms=11, mew=2.5)
        if zero_steps:
            bottom = (lo if np.isfinite(lo) else 0.0) - 2
            for z_steps, color, name in zero_steps:
                label = f"{name}: loss scale 0 ({z_steps.size} steps)"
                ax.plot(
                    z_steps, np.full(z_steps.shape, bottom), "v", color=color, ms=7, label=label
                )
        use_log = log == "yes" or (log == "auto" and lo > 0 and np.isfinite(hi) and hi / lo > 10)
        if use_log:
            ax.set_yscale("log")
        elif cumulative:
            ax.set_ylim(bottom=0)
        elif key == "underflow_fraction":  # percent: keep a few points of scale, not noise
            ax.set_ylim(0, max(ax.get_ylim()[1], 5.0))
        ax.set_title(_title(setting, what))
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3, which="both" if use_log else "major")
        if crowded:
            ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=3,
                      frameon=False)  # fmt: skip
        else:
            ax.legend(fontsize=9, loc="best")
    if mark_divergence and any(u["summary"].get("diverged") for u in units):
        fig.text(0.01, 0.005, "x: divergence detected (non-finite or exploding loss)", fontsize=9)
    fig.tight_layout()
    _io.save_figure(fig, path, dpi=110)
    plt.close(fig)
    return True


def _shade_formats(ax: Any, lo: float, hi: float) -> None:
    """Shade each 16-bit format's representable magnitudes over the log2 axis [lo, hi]."""
    specs = (("float16", "tab:red"), ("bfloat16", "tab:blue"))
    y0, y1 = ax.get_ylim()
    for i, (name, color) in enumerate(specs):
        f = get_format(name)
        assert isinstance(f, FloatFormat)
        sub, norm, top = (
            math.log2(f.smallest_subnormal),
            math.log2(f.smallest_normal),
            math.log2(f.max),
        )
        # Bands at the top of the plot, one per format, so the histograms stay visible.
        band = (y1 - y0) * 0.06
        b0 = y1 - band * (i + 1)
        ax.fill_between(
            [max(sub, lo), min(norm, hi)], b0, b0 + band * 0.9, color=color, alpha=0.25, lw=0
        )
        ax.fill_between(
            [max(norm, lo), min(top, hi)], b0, b0 + band * 0.9, color=color, alpha=0.55, lw=0
        )
        ax.axvspan(max(sub, lo), min(top, hi), color=color, alpha=0.05, lw=0)
        label = (
            f"{name} range: subnormal 2^{sub:.0f}..2^{norm:.0f} (light),\n"
            f"  normal 2^{norm:.0f}..max {f.max:.4g} (dark)"
        )
        for x, ls in ((sub, ":"), (norm, "--"), (top, "-")):
            if lo <= x <= hi:
                ax.axvline(x, color=color, ls=ls, lw=1.2, alpha=0.8)
        ax.plot([], [], color=color, lw=6, alpha=0.5, label=label)
    ax.set_ylim(y0, y1)


def _plot_hist(units: list[dict[str, Any]], key: str, path: Path, *, what: str) -> bool:
    import matplotlib.pyplot as plt

    from precisionlab.train._meters import HIST_LO  # noqa: PLC0415  JAX-free: precisionlab.train imports JAX; the report draws without it

    groups = _by_setting(units)
    chosen: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for setting, us in groups.items():
        for u in us:
            hists = [h for h in u["hist"] if key in h]
            if hists:
                chosen.setdefault(setting, []).append((u, hists[-1]))
    if not chosen:
        return False
    colors = _colors(units)
    fig, axes = _panels(len(chosen), height=5.4)
    for ax, (setting, pairs) in zip(axes, chosen.items(), strict=True):
        lo_bin, hi_bin = np.inf, -np.inf
        step = None
        for u, h in pairs:
            hist = h[key]
            counts = np.asarray(hist["counts"], dtype=np.float64)
            edges = np.asarray(hist.get("edges", HIST_LO + np.arange(counts.size + 1)), np.float64)
            total = counts.sum() + float(hist.get("zeros", 0)) + float(hist.get("nonfinite", 0))
            if total == 0:
                continue
            frac = counts / total
            nz = np.nonzero(counts)[0]
            if nz.size:
                lo_bin, hi_bin = min(lo_bin, edges[nz[0]]), max(hi_bin, edges[nz[-1] + 1])
            zeros = float(hist.get("zeros", 0)) / total
            nonfinite = float(hist.get("nonfinite", 0)) / total
            label = f"{_label(u)}: zero {100 * zeros:.1f}%"
            scale = next(
                (r.get("loss_scale") for r in u["metrics"] if r.get("step") == h.get("step")), None
            )
            if key == "grad_hist" and scale not in (None, 1.0):
                label += f" (x loss scale {_fmt(scale, 'pow2', {})})"
            if nonfinite:
                label += f", inf/nan {100 * nonfinite:.1f}%"
            if key == "act_hist":  # what float16 cannot hold (GELU's cubic term included)
                over = counts[edges[:-1] >= 16].sum() / total
                if over:
                    label += f", >= 2^16 (fp16 overflow) {100 * over:.2f}%"
            first = u is pairs[0][0] and len(pairs) > 1
            ax.stairs(
                100 * frac,
                edges,
                color=colors[u["summary"]["variant"]],
                lw=4 if first else 1.5,
                alpha=0.4 if first else 0.95,
                ls="-" if first else _STYLES[len(ax.patches) % len(_STYLES)],
                label=label,
            )
            step = h.get("step")
        if not np.isfinite(lo_bin):
            lo_bin, hi_bin = -30.0, 20.0
        lo, hi = min(lo_bin - 4, -26), max(hi_bin + 4, 17)
        ax.set_xlim(lo, hi)
        top = ax.get_ylim()[1]
        ax.set_ylim(0, top * 1.25)
        _shade_formats(ax, lo, hi)
        ax.set_title(_title(setting, what) + (f" (step {step})" if step else ""))
        ax.set_xlabel(f"log2 |{'gradient' if key == 'grad_hist' else 'activation'}| (binade)")
        ax.set_ylabel("% of elements")
        ax.grid(True, alpha=0.3)
        # under the panel, so that the panel keeps the page's width
        # (two columns where the labels fit the width, else one)
        longest = max(len(h.get_label()) for h in ax.get_legend_handles_labels()[0])
        ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.2),
                  ncols=2 if longest <= 48 else 1, borderaxespad=0,
                  frameon=False)  # fmt: skip
    fig.tight_layout()
    _io.save_figure(fig, path, dpi=110)
    plt.close(fig)
    return True


def write_plots(data: dict[str, Any], plot_dir: Path) -> list[tuple[str, Path]]:
    """Write the PNGs of a ``train`` run; returns (caption, path) of each plot written."""
    import matplotlib

    matplotlib.use("Agg")
    units = data["units"]
    _io.makedirs(plot_dir)
    log = data["config"].get("resolved", {}).get("report", {}).get("log_loss", "auto")
    written = []

    def add(caption: str, name: str, ok: bool) -> None:
        if ok:
            written.append((caption, plot_dir / name))

    add(
        "Training loss (moving average) of every variant; x marks divergence.",
        "loss.png",
        _plot_curves(
            units,
            "loss",
            plot_dir / "loss.png",
            what="training loss",
            ylabel="training loss (cross-entropy, nats)",
            log=log,
            mark_divergence=True,
        ),
    )
    add(
        "Loss scale per step (log2 axis) of the variants that scale the loss; triangles on the "
        "bottom edge mark steps where the scale had underflowed to 0.",
        "loss_scale.png",
        _plot_curves(
            units,
            "loss_scale",
            plot_dir / "loss_scale.png",
            what="loss scale",
            ylabel="log2(loss scale)",
            transform=np.log2,
            log="no",
            smooth=False,
            keep=lambda u: (u["summary"].get("loss_scale") or "none") != "none",
            mark_zero=True,
        ),
    )
    add(
        "Cumulative steps skipped because a gradient was inf/NaN.",
        "skipped.png",
        _plot_curves(
            units,
            "skipped",
            plot_dir / "skipped.png",
            what="skipped steps",
            ylabel="skipped steps (cumulative)",
            cumulative=True,
            log="no",
            smooth=False,
        ),
    )
    add(
        "Underflow meter: % of gradient elements zero or subnormal in the compute dtype "
        "(inf/NaN elements are counted apart, in the table's inf/nan column).",
        "underflow.png",
        _plot_curves(
            units,
            "underflow_fraction",
            plot_dir / "underflow.png",
            what="underflow meter",
            ylabel="% of gradient elements lost\n(zero or subnormal)",
            transform=lambda v: 100 * v,
            log="no",
        ),
    )
    add(
        "Histogram of log2|gradient| with the float16 and bfloat16 ranges shaded "
        "(as Fig. 3 of Micikevicius et al. 2018).",
        "hist_grad.png",
        _plot_hist(units, "grad_hist", plot_dir / "hist_grad.png", what="log2|gradient|"),
    )
    add(
        "Histogram of log2|activation| with the float16 and bfloat16 ranges shaded; with GELU "
        "it includes the cubic term x^3 of the tanh approximation, the intermediate that overflows "
        "float16 first (counted as inf/nan there).",
        "hist_act.png",
        _plot_hist(units, "act_hist", plot_dir / "hist_act.png", what="log2|activation|"),
    )

    add(
        "Matmul recipes: % of elements saturated and % of nonzero elements flushed to zero "
        "after quantization, per tensor group (x activations, w weights, g output gradients), "
        "at the histogram steps (symmetric-log axis, linear below 0.01%).",
        "recipe_groups.png",
        plot_recipe_groups(units, plot_dir / "recipe_groups.png"),
    )
    return written
