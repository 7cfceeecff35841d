"""``report.md`` and the plots of a ``mismatch`` run (see
:mod:`precisionlab.experiments.mismatch_kind`)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import numpy as np

from precisionlab import _io

__all__ = ["attribution_table", "gap_tables", "markdown", "plots", "rl_table"]

_COLORS = {"fp32": "tab:gray", "bf16": "tab:red", "fp16": "tab:blue"}


def _g(x: Any, fmt: str = ".3g") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, fmt)


def _pct(x: Any) -> str:
    return "-" if x is None else f"{x:.2%}"


def _md_table(rows: list[list[Any]], head: list[str]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def markdown(summary: dict[str, Any], target: float) -> str:
    """The run's report: what was compared, the gaps, the bf16/fp16 ratios against Qi et
    al.'s direction, the control pair, the attribution."""
    tr, model = summary["train"], summary["model"]
    out = [
        "# Trainer vs sampler: the log-probability mismatch",
        "",
        f"The built-in transformer (d_model {model.get('d_model')}, {model.get('depth')} "
        f"blocks, {model.get('heads')} heads, vocabulary {model.get('vocab_size')}, "
        f"{tr['param_count']:,} params) trained {tr['steps']} steps in float32 on the Python "
        f"standard library's source (final loss {_g(tr['final_loss'])}, eval loss "
        f"{_g(tr['eval_loss'])} nats/byte). Each pair scores the same "
        f"{summary['eval_rows']} held-out windows ({summary['tokens_scored']} tokens) with "
        "the trainer's stack and the sampler's; delta = log p_trainer - log p_sampler of each "
        "next token, in nats (log-probabilities from each stack's logits in float64).",
        "",
        "## Setups",
        "",
    ]
    for name, s in summary["setups"].items():
        out.append(f"- **{name}**: trainer {_fields(s['trainer'])}; sampler "
                   f"{_fields(s['sampler'])}")  # fmt: skip
    c = summary["control"]
    zero = c["rms_nats"] == 0 and c["max_nats"] == 0 and c["kl"] == 0
    out += [
        "",
        "## The gaps",
        "",
        gap_tables(summary, target),
        "",
        f"The control pair ({c['a']} against itself, two runs) gives "
        + ("exactly 0: every program is deterministic, so the gaps above are the stacks'."
           if zero else f"a nonzero gap ({_g(c['rms_nats'])} nats RMS): NOT deterministic."),
        "",
        "## bf16 against fp16 (Qi et al.)",
        "",
        "Qi et al., *Defeating the Training-Inference Mismatch via FP16* (arXiv 2510.26788), "
        "find bf16's rounding the cause of the trainer/sampler mismatch in RL fine-tuning of "
        "LLMs and fp16 its cure (their abstract and RQ1, the token-level mismatch of BF16 vs "
        f"FP16). Checked here as the direction: bf16's RMS gap at least {target:g}x fp16's "
        "(the second table above).",
    ]  # fmt: skip
    for att in summary["attribution"]:
        out += ["", f"## Where the gap comes from: {att['key']}", "",
                f"{att['a']} vs {att['b']}: RMS gap {_g(att['base_rms_nats'])} nats. Each "
                "layer's output in the sampler's run is replaced by the trainer's; "
                "*removed* is the share of the RMS gap that disappears, *injected* what the "
                "layer adds to it over the layer before (its own computation).", ""]  # fmt: skip
        by = {x["layer"]: x for x in att["layers"]}
        rows = [[i + 1, name, f"{by[name]['injected']:+.1%}", f"{by[name]['removed']:.1%}",
                 _g(by[name]["rms_nats"])] for i, name in enumerate(att["ranked"])]  # fmt: skip
        out.append(_md_table(rows, ["rank", "layer", "injected", "removed when patched",
                                    "RMS after (nats)"]))  # fmt: skip
    if summary.get("rl"):
        rc = summary["rl"]["config"]
        out += [
            "",
            "## The consequence: REINFORCE with a mismatched sampler",
            "",
            f"A {rc['depth']}-block transformer policy (d_model {rc['d_model']}) writes "
            f"{rc['length']} tokens from a vocabulary of {rc['vocab']}, rewarded by the share "
            f"equal to a fixed target; {rc['steps']} on-policy REINFORCE steps of {rc['batch']} "
            "sequences (Adam), the same seeds, initial weights and sampling noise in every run. "
            "*matched*: the sampler is the trainer's own program (exactly on-policy); *decode*: "
            "KV-cache decoding with the split-KV kernel; *decode+tis*: the same with truncated "
            f"importance sampling (cap {rc['tis_cap']:g}). Per step: the mismatch of the sampled "
            "tokens, how much the importance weights change the update on the same batch "
            "(||g_tis - g|| / ||g||), and the batch's own sampling noise (||g_1 - g_2|| / ||g|| "
            "of its halves).",
            "",
            rl_table(summary),
        ]
    if summary.get("files"):
        out += ["", "## Files", "", ", ".join(f"`{f}`" for f in summary["files"])]
    return "\n".join(out) + "\n"


def gap_tables(summary: dict[str, Any], target: float) -> str:
    """Two Markdown tables: every pair's gap (the control pair last), then per setup bf16's
    RMS gap over fp16's against ``target``."""
    rows = [
        [r["setup"], r["format"], r["a"], r["b"], _g(r["mean_nats"]), _g(r["rms_nats"]),
         _g(r["max_nats"]), _pct(r["clip_share"]), _g(r["kl"]), _pct(r["flip_rate"])]
        for r in [*summary["pairs"], summary["control"]]
    ]  # fmt: skip
    head = ["setup", "format", "trainer (a)", "sampler (b)", "mean", "RMS", "max",
            "ratio outside [0.8, 1.2]", "KL", "greedy flips"]  # fmt: skip
    ratios = []
    for name, r in summary["ratios"].items():
        verdict = "reproduced" if r["reproduced"] else "NOT reproduced at this scale"
        ratios.append([name, _g(r["bf16_rms_nats"]), _g(r["fp16_rms_nats"]),
                       _g(r["ratio"], ".2f"), verdict])  # fmt: skip
    rhead = ["setup", "bf16 RMS (nats)", "fp16 RMS (nats)", "bf16 / fp16",
             f"ratio >= {target:g}"]  # fmt: skip
    return _md_table(rows, head) + "\n\n" + _md_table(ratios, rhead)


def attribution_table(summary: dict[str, Any]) -> str:
    """A Markdown table: each layer (program order) and the share of the RMS gap it injects
    in each attributed pair."""
    atts = summary["attribution"]
    if not atts:
        return ""
    names = [x["layer"] for x in atts[0]["layers"]]
    cols = [{x["layer"]: x["injected"] for x in a["layers"]} for a in atts]
    rows = [[n, *(f"{c[n]:+.1%}" if n in c else "-" for c in cols)] for n in names]
    head = ["layer", *(f"injected, {a['key']} (RMS {_g(a['base_rms_nats'])})" for a in atts)]
    return _md_table(rows, head)


def rl_table(summary: dict[str, Any]) -> str:
    """A Markdown table of the REINFORCE study: per format and sampler, the final reward of
    each seed and the per-step means."""
    rows = [
        [g["format"], g["sampler"], ", ".join(f"{x:.3f}" for x in g["final_reward"]),
         _g(g["mismatch_rms"]), _g(g["mismatch_max"]), _pct(g["clip_share"]),
         _pct(g["tis_change"]), _pct(g["noise"])]
        for g in summary["rl"]["groups"]
    ]  # fmt: skip
    head = ["format", "sampler", "final reward (per seed)", "mismatch RMS (nats)",
            "mismatch max", "ratio outside [0.8, 1.2]", "update change by TIS",
            "batch noise"]  # fmt: skip
    return _md_table(rows, head)


def _fields(fields: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in fields.items()) or "defaults"


def _deltas(out_dir: Path, key: str) -> np.ndarray:
    data = _io.read_bytes(out_dir / "deltas" / f"{key.replace('/', '_')}.npy", 1 << 30)
    return np.load(io.BytesIO(data))[0]


def _label(ax: Any, xlabel: str, ylabel: str, title: str, *, log: bool = False) -> None:
    """Name the axes of ``ax`` and its title, show its legend; ``log``: a log y-axis."""
    if log:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)


def _save(fig: Any, out_dir: Path, files: list[str], name: str) -> None:
    """Lay out ``fig``, write it to ``out_dir / name`` (110 dpi), close it and list ``name``
    in ``files``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    files.append(name)
    _io.save_figure(fig, out_dir / name, dpi=110)
    plt.close(fig)


def plots(summary: dict[str, Any], out_dir: Path) -> list[str]:
    """Write the plots; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    setups = list(summary["setups"])
    files: list[str] = []

    fig, axes = plt.subplots(1, len(setups), figsize=(5.5 * len(setups), 4), squeeze=False)
    for ax, setup in zip(axes[0], setups, strict=True):
        pairs = [r for r in summary["pairs"] if r["setup"] == setup]
        spread = max([abs(np.nanmax(np.abs(_deltas(out_dir, r["key"])))) for r in pairs]
                     + [1e-6])  # fmt: skip
        lim = max(0.25, min(1.0, 1.2 * spread))
        bins = np.linspace(math.exp(-lim), math.exp(lim), 81)
        for r in pairs:
            d = _deltas(out_dir, r["key"])
            ratio = np.exp(d[np.isfinite(d)])
            ax.hist(np.clip(ratio, bins[0], bins[-1]), bins=bins, histtype="step",
                    color=_COLORS.get(r["format"]), label=f"{r['format']} (RMS "
                    f"{_g(r['rms_nats'])})")  # fmt: skip
        for x in (0.8, 1.2):
            ax.axvline(x, color="k", ls="--", lw=0.8)
        _label(
            ax,
            "importance ratio p_trainer / p_sampler (PPO clip dashed)",
            "tokens",
            f"{setup}: per-token ratio",
            log=True,
        )
    _save(fig, out_dir, files, "ratio_hist.png")

    fig, axes = plt.subplots(1, len(setups), figsize=(5.5 * len(setups), 4), squeeze=False)
    for ax, setup in zip(axes[0], setups, strict=True):
        for r in [p for p in summary["pairs"] if p["setup"] == setup]:
            y = np.array([np.nan if v is None else v for v in r["by_position"]], float)
            y = np.where(y > 0, y, np.nan)
            ax.plot(np.arange(1, len(y) + 1), y, color=_COLORS.get(r["format"]),
                    label=r["format"])  # fmt: skip
        _label(
            ax,
            "position of the predicted token",
            "RMS delta over rows (nats)",
            f"{setup}: gap by position",
            log=True,
        )
    _save(fig, out_dir, files, "gap_by_position.png")

    if summary["attribution"]:
        atts = summary["attribution"]
        fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(atts[0]["layers"]) * len(atts)), 4))
        names = [x["layer"] for x in atts[0]["layers"]]
        width = 0.8 / len(atts)
        for i, att in enumerate(atts):
            by = {x["layer"]: x["injected"] for x in att["layers"]}
            fmt = att["key"].partition("/")[2]
            ax.bar(np.arange(len(names)) + i * width, [by.get(n, 0.0) for n in names], width,
                   color=_COLORS.get(fmt), label=att["key"])  # fmt: skip
        ax.set_xticks(np.arange(len(names)) + width * (len(atts) - 1) / 2, names,
                      rotation=45, ha="right")  # fmt: skip
        ax.axhline(0, color="k", lw=0.6)
        ax.set_ylabel("share of the RMS gap injected")
        ax.set_title("gap by layer (activation patching)")
        ax.legend(fontsize=8)
        _save(fig, out_dir, files, "gap_by_layer.png")
    if summary.get("rl"):
        groups = summary["rl"]["groups"]
        fmts = list(dict.fromkeys(g["format"] for g in groups))
        fig, axes = plt.subplots(1, len(fmts), figsize=(5.5 * len(fmts), 4), squeeze=False)
        colors = {"matched": "tab:green", "decode": "tab:red", "decode+tis": "tab:purple"}
        for ax, fmt in zip(axes[0], fmts, strict=True):
            for g in (g for g in groups if g["format"] == fmt):
                for i, curve in enumerate(g["reward"]):
                    ax.plot(np.arange(1, len(curve) + 1), curve, lw=1, alpha=0.8,
                            color=colors.get(g["sampler"]),
                            label=g["sampler"] if i == 0 else None)  # fmt: skip
            _label(
                ax,
                "REINFORCE step",
                "mean reward",
                f"{fmt} policy: reward by sampler (one line a seed)",
            )
        _save(fig, out_dir, files, "rl_reward.png")
    return files
