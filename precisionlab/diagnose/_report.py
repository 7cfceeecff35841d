"""The run store of a diagnosis: ``config.json``, ``run.json``, ``result.json``,
``report.md`` and ``plots/*.png`` in one directory, as ``precisionlab run`` writes its runs."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from precisionlab.experiments import _store as store
from precisionlab.experiments._report import markdown_table, text_table

__all__ = ["open_run", "write_autoswitch", "write_bisect", "write_compare"]


def open_run(out: str | Path | None, name: str, record: dict[str, Any]) -> Path:
    """A new run directory (``out``, or ``runs/NAME-TIME``) holding ``config.json``."""
    if out is None:
        run_dir = store.new_run_dir(Path("runs"), name)
    else:
        run_dir = Path(out)
        if (run_dir / "config.json").exists():
            raise ValueError(f"{run_dir} already holds a run; choose another --out")
        run_dir.mkdir(parents=True, exist_ok=True)
    store.check_no_symlinks(run_dir)
    store.write_json(run_dir / "config.json", record)
    store.write_json(run_dir / "environment.json", store.environment())
    return run_dir


def _finish(run_dir: Path, mode: str, result: Any, lines: Sequence[str], plots: list) -> Path:
    store.write_json(run_dir / "result.json", dataclasses.asdict(result))
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    store.write_json(
        run_dir / "run.json",
        {"kind": "diagnose", "mode": mode, "status": "finished", "updated": now},
    )
    body = list(lines)
    for caption, path in plots:
        body += ["", f"![{caption}](plots/{path.name})"]
    path = run_dir / "report.md"
    store.write_text(path, "\n".join(body) + "\n")
    return path


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _num(x: float, fmt: str = ".3g") -> str:
    return "inf" if x == math.inf else "nan" if math.isnan(x) else format(x, fmt)


def _save(fig: Any, run_dir: Path, name: str) -> Path:
    """Write ``fig`` to ``run_dir/plots/name`` (90 dpi) and close it; the path written."""
    fig.tight_layout()
    path = store.makedirs(run_dir / "plots") / name
    store.save_figure(fig, path, dpi=90)
    _plt().close(fig)
    return path


def write_compare(run_dir: Path, result: Any, *, plots: bool = True) -> tuple[Path, str]:
    """report.md and a layer x step heatmap of the largest relative difference."""
    r = result
    head = (
        f"compare {r.ref} (reference) with {r.other}: threshold {r.threshold:g}, "
        f"{r.steps_run} step(s) run"
    )
    if r.first is None:
        answer = [f"no tensor differs by more than {r.threshold:g} in {r.steps_run} steps"]
    else:
        c = r.first
        answer = [
            f"first break: step {c.step}, layer {c.layer}, tensor {c.tensor} "
            f"(relative difference {_num(c.rel)})",
            f"why: {c.explain}",
        ]
    rows = [[str(c.step), c.layer, c.tensor, _num(c.rel), c.explain] for c in r.at_step[:12]]
    hdr = ["step", "layer", "tensor", "rel. diff", "statistics"]
    uf = [[k, f"{v:.1%}"] for k, v in r.grad_underflow.items()]
    missing = []
    unmatched = getattr(r, "unmatched", [])
    if unmatched:
        missing.append(
            f"not compared: {len(unmatched)} tensor(s) without a counterpart in the other "
            f"variant: {', '.join(unmatched)}"
        )
    if getattr(r, "uncaptured", []):
        missing.append(f"not captured (inside a while_loop): {', '.join(r.uncaptured)}")
    text = "\n".join([head, *answer, *missing])
    lines = [f"# diagnose --compare: {r.ref} vs {r.other}", "", head, "", *answer, ""]
    if missing:
        lines += [*missing, ""]
    if rows:
        lines += [
            f"Tensors over the threshold at step {r.at_step[0].step} (largest first, 12 at most):",
            "",
        ]
        lines += [markdown_table(rows, hdr), ""]
    if uf:
        lines += [
            f"Activation-gradient underflow per layer (reference cotangents at {r.other}'s "
            f"scale, in {r.dtype}):",
            "",
            markdown_table(uf, ["layer", "underflow"]),
        ]
    pics = []
    if plots and r.heat:
        plt = _plt()

        layers = list(r.heat)
        data = np.array([[min(v, 1e6) for v in r.heat[k]] for k in layers], float)
        fig, ax = plt.subplots(figsize=(6.4, 0.4 * len(layers) + 1.5))
        im = ax.imshow(np.log10(np.maximum(data, 1e-12)), aspect="auto", cmap="magma")
        ax.set_yticks(range(len(layers)), layers)
        ax.set_xticks(range(len(r.compared_steps)), r.compared_steps)
        ax.set_xlabel("step")
        ax.set_title(f"log10 largest relative difference, {r.other} vs {r.ref}")
        fig.colorbar(im, ax=ax)
        pics.append(
            (
                "largest relative difference per layer and step",
                _save(fig, run_dir, "compare_heatmap.png"),
            )
        )
    return _finish(run_dir, "compare", r, lines, pics), text


def write_bisect(run_dir: Path, result: Any, *, plots: bool = True) -> tuple[Path, str]:
    """report.md and a bar chart of each run's final loss against the pass threshold."""
    r = result
    rows = [
        [
            r_.label,
            r_.variant,
            ", ".join(r_.layers) or "-",
            _num(r_.loss, ".4g"),
            "pass" if r_.passed else "fail",
        ]
        for r_ in r.runs
    ]
    hdr = ["run", "variant", "layers in high precision", "final loss", "result"]
    if r.answer is None:
        answer = f"answer: no set of the candidate layers makes {r.fail} pass"
    elif not r.answer:
        answer = f"answer: {r.fail} passes as it is"
    else:
        answer = f"answer: return {', '.join(r.answer)} to high precision"
    budget = (
        f"{r.search_runs} search run(s) for {len(r.candidates)} candidate layers "
        f"(one culprit needs at most ceil(log2 {len(r.candidates)}) + 1 = {r.budget}), "
        "plus 2 reference runs"
    )
    crit = (
        f"pass: final loss <= {_num(r.reference_loss, '.4g')} ({r.passing}) + tolerance = "
        f"{_num(r.threshold, '.4g')}"
    )
    text = "\n".join([crit, text_table(rows, hdr), answer, budget])
    lines = [
        f"# diagnose --bisect: {r.fail} against {r.passing}",
        "",
        crit,
        "",
        markdown_table(rows, hdr),
        "",
        answer,
        "",
        budget,
    ]
    pics = []
    if plots:
        plt = _plt()
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        labels = [", ".join(x.layers) or x.variant for x in r.runs]
        vals = [x.loss if math.isfinite(x.loss) else 0.0 for x in r.runs]
        colors = ["tab:green" if x.passed else "tab:red" for x in r.runs]
        ax.barh(range(len(vals)), vals, color=colors)
        for i, x in enumerate(r.runs):
            if not math.isfinite(x.loss):
                ax.text(0, i, " diverged", va="center")
        ax.axvline(r.threshold, color="k", ls="--", label="pass threshold")
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("final loss")
        ax.legend(fontsize=7)
        pics.append(
            ("final loss of every run (green: pass)", _save(fig, run_dir, "bisect_runs.png"))
        )
    return _finish(run_dir, "bisect", r, lines, pics), text


def write_autoswitch(run_dir: Path, result: Any, *, plots: bool = True) -> tuple[Path, str]:
    """report.md and a plot of the loss with the switch steps marked."""
    r = result
    hdr = ["matmul", "layer", "switched after step", "why"]
    hdr += ["x underflow", "x mse", "w mse", "g underflow", "g mse"]

    def why(s: dict) -> str:
        if not s["switched"]:
            return "-"
        t = s["trip"]
        over = [k for k in t if t[k] > (r.underflow if k.endswith("underflow") else r.mse)]
        return ", ".join(f"{k} {t[k]:.3g}" for k in over)

    def stats(st: dict) -> list[str]:
        keys = ("x_underflow", "x_mse", "w_mse", "g_underflow", "g_mse")
        return [f"{st[k]:.1%}" if k.endswith("underflow") else f"{st[k]:.2e}" for k in keys]

    rows = [
        [
            s["site"],
            s["layer"],
            "-" if s["step"] is None else str(s["step"]),
            why(s),
            *stats(s["stats"]),
        ]
        for s in r.sites
    ]
    n = sum(s["switched"] for s in r.sites)
    head = (
        f"autoswitch {r.variant} (recipe {r.recipe}): switch when underflow > {r.underflow:g} "
        f"or mse > {r.mse:g}; {n} of {len(r.sites)} matmuls switched; {r.steps_done} steps, "
        f"final loss {_num(r.final_loss, '.4g')}"
    )
    text = "\n".join([head, text_table([row[:4] for row in rows], hdr[:4])])
    lines = [
        f"# diagnose --autoswitch: {r.variant}",
        "",
        head,
        "",
        "why: the statistics over their threshold when it switched; then the last step's:",
        "",
        markdown_table(rows, hdr),
    ]
    pics = []
    if plots and r.losses:
        plt = _plt()
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        ax.plot(range(1, len(r.losses) + 1), r.losses, label="loss")
        for s in r.sites:
            if s["switched"]:
                ax.axvline(s["step"], color="tab:red", alpha=0.3)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title("loss; red lines: a matmul switched to high precision")
        pics.append(("training loss and switch steps", _save(fig, run_dir, "autoswitch_loss.png")))
    return _finish(run_dir, "autoswitch", r, lines, pics), text
