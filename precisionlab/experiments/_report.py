"""Reports of a run directory: a terminal table and ``report.md`` with the plots of
:mod:`precisionlab.experiments._plots` (for ``train`` runs), or the files a kind wrote (others).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from precisionlab import _io
from precisionlab._text import fmt_value
from precisionlab.experiments import _store as store
from precisionlab.experiments._plots import write_plots
from precisionlab.experiments._telemetry_views import telemetry_report

__all__ = [
    "TABLE",
    "interpret",
    "load_run",
    "markdown_table",
    "summary_rows",
    "summary_table",
    "text_table",
    "write_report",
]

#: (header, summary key, formatter) of the summary table.
TABLE: tuple[tuple[str, str, str], ...] = (
    ("variant", "name", "s"),
    ("status", "status", "s"),
    ("final_loss", "final_loss", "g4"),
    ("eval_loss", "eval_loss", "g4"),
    ("eval_acc", "eval_metric", "pct"),
    ("skipped", "skipped_steps", "d"),
    ("diverged@", "divergence_step", "div"),
    ("underflow", "mean_underflow_fraction", "pct"),
    ("inf/nan", "mean_nonfinite_fraction", "pct"),
    ("scale_min", "min_loss_scale", "pow2"),
    ("scale_max", "max_loss_scale", "pow2"),
    ("time_s", "wall_time_s", "f1"),
)


_fmt = fmt_value  # the summary-table cell style (shared with plots and compare)


def load_run(run_dir: str | Path) -> dict[str, Any]:
    """Everything a report needs from a run directory, as read from its files: a dict with
    ``dir``, ``config``, ``summary`` (``summary.json``), ``environment``, ``run`` and ``units``
    (for a ``train`` run, one dict per variant: its ``summary``, ``metrics`` (the rows of
    ``metrics.jsonl``, one per logged step) and ``hist``). ValueError for a directory that is
    not a finished run."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").exists():
        raise ValueError(f"{run_dir}: not a run directory (no config.json)")
    if not (run_dir / "summary.json").exists():
        raise ValueError(f"{run_dir}: no summary.json yet (the run has not finished a variant)")
    data = {
        "dir": run_dir,
        "config": store.read_json(run_dir / "config.json"),
        "summary": store.read_json(run_dir / "summary.json"),
        "environment": _maybe(run_dir / "environment.json"),
        "run": _maybe(run_dir / "run.json"),
        "units": [],
    }
    if data["summary"].get("kind") == "train":
        for unit in data["summary"]["variants"]:
            unit_dir = run_dir / "variants" / unit["id"]
            data["units"].append(
                {
                    "summary": unit,
                    "metrics": store.read_jsonl(unit_dir / "metrics.jsonl"),
                    "hist": store.read_jsonl(unit_dir / "hist.jsonl"),
                }
            )
    return data


def run_status(run_dir: Path, run_info: dict[str, Any]) -> str:
    """``run.json``'s status, with the truth about a ``running`` one whose process has ended
    without marking it (killed): it says so and how to continue."""
    status = str(run_info.get("status", "?"))
    if status == "running":
        holder = store.lock_holder(run_dir)
        if holder is not None and not holder[1]:
            return (
                f"running, but its process {holder[0]} has ended without finishing (killed?): "
                f"continue with `precisionlab run --resume {run_dir}`"
            )
    return status


def _maybe(path: Path) -> Any:
    return store.read_json(path) if path.exists() else {}


def summary_rows(summary: dict[str, Any]) -> list[list[str]]:
    """The summary table's rows (strings); groups of several seeds add a ``mean +- std`` row."""
    rows = []
    for unit in summary.get("variants", []):
        rows.append([_fmt(unit.get(key), how, unit) for _, key, how in TABLE])
    for g in summary.get("groups", []):
        row = [f"{g['group']} (mean+-std, n={g['n']})", f"{g['diverged']} diverged"]
        for _, key, how in TABLE[2:]:
            mean, std = g.get(f"{key}_mean"), g.get(f"{key}_std")
            if mean is None:
                row.append("-")
            elif std is None:
                row.append(_fmt(mean, how if how != "d" else "g4", {}))
            else:
                h = "g4" if how in ("d", "div", "pow2") else how
                row.append(f"{_fmt(mean, h, {})}+-{_fmt(std, h, {})}")
        rows.append(row)
    return rows


def text_table(rows: Sequence[Sequence[str]], headers: Sequence[str]) -> str:
    """Aligned plain text: first column left, the others right-aligned."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = [str(cells[0]).ljust(widths[0])]
        out += [str(c).rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *map(line, rows)])


#: The widest plain-text table printed (characters).
WIDTH = 100


def fitted_table(rows: Sequence[Sequence[str]], headers: Sequence[str], width: int = WIDTH) -> str:
    """:func:`text_table`, split where wider than ``width``: consecutive groups of columns
    that fit, one table each (blank line between), each repeating the first column."""
    text = text_table(rows, headers)
    if max(len(line) for line in text.splitlines()) <= width or len(headers) <= 2:
        return text
    cols = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    blocks: list[list[int]] = []
    group: list[int] = []
    used = cols[0]
    for i in range(1, len(headers)):
        if group and used + 2 + cols[i] > width:
            blocks.append(group)
            group, used = [], cols[0]
        group.append(i)
        used += 2 + cols[i]
    blocks.append(group)
    return "\n\n".join(
        text_table(
            [[r[0], *(r[i] for i in g)] for r in rows], [headers[0], *(headers[i] for i in g)]
        )
        for g in blocks
    )


def markdown_table(rows: Sequence[Sequence[str]], headers: Sequence[str]) -> str:
    out = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join(["---"] + ["--:"] * (len(headers) - 1)) + "|",
    ]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(out)


def headers() -> list[str]:
    return [h for h, _, _ in TABLE]


def summary_table(summary: dict[str, Any], columns: Sequence[str] | None = None) -> str:
    """A ``train`` run's summary table (``load_run(d)["summary"]``) as aligned text, the table
    ``precisionlab report`` prints, split into parts of at most :data:`WIDTH` characters.
    ``columns``: the headers to keep, in this order (all of them by default); an unknown one
    raises ValueError naming the headers there are."""
    names = headers()
    keep = list(names if columns is None else columns)
    unknown = [c for c in keep if c not in names]
    if unknown or not keep:
        raise ValueError(f"summary_table: unknown columns {unknown}; there are {names}")
    index = [names.index(c) for c in keep]
    return fitted_table([[row[i] for i in index] for row in summary_rows(summary)], keep)


def write_report(
    run_dir: str | Path, *, plots: bool = True, figure_cache: str | Path | None = None
) -> tuple[Path, str]:
    """Write ``report.md`` (and plots) for ``run_dir``; returns its path and the text table.
    No link inside ``run_dir`` is followed (:func:`precisionlab._io.confined`).
    ``figure_cache``: a directory keeping the telemetry figures by the content they are drawn
    from, so that a rerun with the same results copies them instead of drawing them (``run``
    passes ``figures/`` of its compilation cache directory); None: draw every figure."""
    with store.confined(run_dir):
        return _write_report(run_dir, plots=plots, figure_cache=figure_cache)


def _write_report(
    run_dir: str | Path, *, plots: bool, figure_cache: str | Path | None = None
) -> tuple[Path, str]:
    data = load_run(run_dir)
    store.check_no_symlinks(Path(run_dir))  # report.md and plots/ must not land elsewhere
    run_dir = Path(run_dir)
    summary = data["summary"]
    if summary.get("kind") != "train":
        return _write_other_report(data)
    rows = summary_rows(summary)
    table = fitted_table(rows, headers())
    resolved = data["config"].get("resolved", {})
    lines = [f"# {summary.get('name', run_dir.name)}", ""]
    if summary.get("description"):
        lines += [summary["description"], ""]
    status = run_status(run_dir, data["run"])
    lines += [f"Run directory `{run_dir}` (status: {status}).", ""]
    lines += ["## Results", "", markdown_table(rows, headers()), ""]
    lines += [
        f"final_loss: mean finite training loss over the last {summary.get('final_loss_window')} "
        "steps (nan/inf when the run ended diverged; summary.json's final_loss_finite keeps the "
        "finite mean); eval_acc: accuracy on held-out batches at the end; diverged@: the first "
        "step whose loss was inf/NaN (or exploded), which can come after the first inf/NaN "
        "inside a step (telemetry below); underflow: mean % of gradient elements zero or "
        "subnormal in the compute dtype; inf/nan: mean % of them inf or NaN (apart, so that a "
        "step of NaNs does not read as underflow); scale_min/max: extremes of the loss scale.",
        "",
    ]
    failed = [u for u in summary["variants"] if u.get("status") == "failed"]
    for u in failed:
        lines += [
            f"- **{u['name']} failed**: {u.get('error')} (see `variants/{u['id']}/error.log`)"
        ]
    if failed:
        lines.append("")
    notes = interpret(summary)
    if notes:
        lines += ["## What this run shows", "", *notes, ""]
    if plots and resolved.get("report", {}).get("plots", True):
        written = write_plots(data, run_dir / "plots")
        if written:
            lines += ["## Plots", ""]
        for caption, path in written:
            lines += [f"![{caption}]({path.relative_to(run_dir).as_posix()})", "", caption, ""]

    want_plots = plots and resolved.get("report", {}).get("plots", True)
    plot_dir = run_dir / "plots" if want_plots else None
    lines += telemetry_report(run_dir, summary["variants"], plot_dir, figure_cache=figure_cache)
    lines += ["## Setup", ""]
    if resolved:
        base = resolved.get("train", {})
        keys = (
            "model",
            "model_kwargs",
            "data",
            "data_kwargs",
            "optimizer",
            "lr",
            "steps",
            "batch_size",
            "seed",
        )
        lines += [f"- base `{k}` = `{base.get(k)}`" for k in keys if k in base]
        notes = resolved.get("setting_descriptions", {})
        for name, over in resolved.get("settings", {}).items():
            note = f"{notes[name]}; " if notes.get(name) else ""
            lines.append(f"- setting `{name}`: {note}`{over}`")
        for v in resolved.get("variants", []):
            over = {k: val for k, val in v.items() if k not in ("name", "description")}
            lines.append(f"- variant `{v['name']}`: `{over}`")
        lines.append("")
    env = data["environment"]
    if env:
        lines += ["## Environment", ""]
        keys = (
            "python",
            "jax",
            "jaxlib",
            "ml_dtypes",
            "backend",
            "device_kind",
            "device_count",
            "cpu_count",
            "platform",
        )
        lines += [f"- {k}: {env.get(k)}" for k in keys if k in env]
        lines.append("")
    path = run_dir / "report.md"
    _write_text(path, "\n".join(lines))
    return path, table


#: Captions of the plots other kinds write, by file name.
CAPTIONS = {
    "bytes_per_param.png": "Model-state bytes per parameter of each precision policy, by part "
    "(weights, master weights, gradients, optimizer state).",
    "checkpoint_interval.png": "Estimated activation memory against the checkpoint interval K; "
    "the dashed line is K = sqrt(N layers).",
    "measured_checkpoint.png": "Temporaries XLA allocates (measured) and the estimate, per "
    "checkpoint interval K.",
    "survey.png": "Relative-error histograms and SQNR of every format on every input.",
}


def _write_other_report(data: dict[str, Any]) -> tuple[Path, str]:
    run_dir = data["dir"]
    summary = data["summary"]
    name, kind = summary.get("name", run_dir.name), summary.get("kind")
    lines = [f"# {name}" if name == kind else f"# {name} ({kind} experiment)", ""]
    lines += [
        f"Status: {summary.get('status')}"
        + (f": {summary['error']}" if summary.get("error") else ""),
        "",
    ]
    result = summary.get("result") or {}
    table_rows = [[str(k), _short(v)] for k, v in result.items() if not isinstance(v, dict | list)]
    table = (
        text_table(table_rows, ["key", "value"])
        if table_rows
        else f"status: {summary.get('status')}"
    )
    if table_rows:
        lines += [markdown_table(table_rows, ["key", "value"]), ""]
    # A kind's plain-text tables (e.g. survey/summary.txt) are the most useful terminal output.
    texts = sorted(run_dir.rglob("*.txt"))
    bodies = [_io.read_bytes(t, _io.MAX_JSON_BYTES).decode("utf-8", "replace") for t in texts]
    for txt, body in zip(texts, bodies, strict=True):
        body = body.rstrip()
        lines += [f"## {txt.relative_to(run_dir).as_posix()}", "", "```", body, "```", ""]
    if texts:
        table = "\n\n".join(b.rstrip() for b in bodies)
    pngs = sorted(run_dir.rglob("*.png"))
    for png in pngs:
        caption = CAPTIONS.get(png.name, png.stem.replace("_", " "))
        lines += [f"![{caption}]({png.relative_to(run_dir).as_posix()})", "", caption, ""]
    others = sorted(
        p
        for p in run_dir.rglob("*")
        if p.is_file() and p.suffix in (".jsonl", ".json", ".csv", ".md") and p.name != "report.md"
    )
    if others:
        lines += (
            ["## Files", ""] + [f"- `{p.relative_to(run_dir).as_posix()}`" for p in others] + [""]
        )
    path = run_dir / "report.md"
    _write_text(path, "\n".join(lines))
    return path, table


def _short(value: Any) -> str:
    if isinstance(value, float):  # 9.797958971132712 -> 9.798
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) < 80 else text[:77] + "..."


def _write_text(path: Path, text: str) -> None:
    _io.write_text(path, text if text.endswith("\n") else text + "\n")


# --- interpretation -----------------------------------------------------------------------
def _num(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out


def _close(a: float | None, b: float | None, rel: float = 0.02) -> bool:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return False
    return abs(a - b) <= rel * max(abs(b), 1e-12)


#: DynamicLossScale's default floors (the smallest normal of float32/bfloat16, float16).
_SCALE_FLOORS = {2.0**-126: -126, 2.0**-14: -14}


def _divergence_fact(u: dict[str, Any]) -> str:
    """ "diverged at step N", with where inf/NaN first appeared inside a step (telemetry)
    beside it: the loss can stay finite for a step or more after a tensor inside the step
    (GELU's cubic term, a gradient) became inf/NaN, so the two steps can differ."""
    step = u.get("divergence_step")
    text = f"diverged at step {step}" if step is not None else "diverged"
    first = (u.get("telemetry") or {}).get("first_nonfinite")
    if not first:
        return text
    where = first.get("layer", "?")
    if first.get("site") and first["site"] != where:
        where = f"{where}:{first['site']}"
    if first.get("tensor"):
        where = f"{where}.{first['tensor']}"
    pass_ = "backward" if first.get("backward") else "forward"
    at = first.get("step")
    if step is not None and at is not None and at < step:
        why = (
            f"; inf/NaN first appeared inside step {at} ({pass_} pass, `{where}`) while that "
            f"step's loss stayed finite: the non-finite values reached the loss at step {step}"
        )
    else:
        why = f"; inf/NaN first appeared at step {at} ({pass_} pass, `{where}`)"
    return text + why


def interpret(summary: dict[str, Any]) -> list[str]:
    """Bullets of what a ``train`` run shows, from its summary: per setting, each variant
    against the setting's first variant (the reference): divergence and when, skipped steps,
    a collapsed loss scale, the underflow meter, and the evaluation loss beside the
    reference's. Measured numbers only; no claim the summary does not hold."""
    by_setting: dict[str, list[dict[str, Any]]] = {}
    seen = set()
    for unit in summary.get("variants", []):
        key = (unit.get("setting"), unit.get("variant"))
        if key in seen:
            continue  # with several seeds, the first seed speaks for the group
        seen.add(key)
        by_setting.setdefault(unit.get("setting") or "", []).append(unit)
    lines = []
    for setting, units in by_setting.items():
        ref = units[0]
        ref_name = ref.get("variant", ref.get("name"))
        ref_eval = _num(ref.get("eval_loss"))
        matching: list[str] = []
        findings: list[str] = []
        for u in units[1:]:
            name = str(u.get("variant", u.get("name")))
            ev = _num(u.get("eval_loss"))
            steps = u.get("steps") or 0
            skipped = int(u.get("skipped_steps") or 0)
            facts = []
            if u.get("status") == "failed":
                facts.append(f"failed ({u.get('error')})")
            if u.get("diverged"):
                facts.append(_divergence_fact(u))
            if skipped:
                facts.append(f"skipped {skipped} of {steps} steps (inf/NaN gradients)")
            low = _num(u.get("min_loss_scale"))
            if low == 0:
                facts.append("its loss scale collapsed to 0")
            elif low in _SCALE_FLOORS:  # DynamicLossScale's default floor: it hit bottom
                facts.append(f"its loss scale fell to its floor (2^{_SCALE_FLOORS[low]})")
            underflow = _num(u.get("mean_underflow_fraction"))
            ref_underflow = _num(ref.get("mean_underflow_fraction"))
            if (
                underflow is not None
                and underflow >= 0.5
                and (ref_underflow is None or underflow > ref_underflow + 0.25)
            ):
                facts.append(
                    f"underflow meter {100 * underflow:.0f}% "
                    f"(reference {100 * (ref_underflow or 0):.0f}%)"
                )
            nonfinite = _num(u.get("mean_nonfinite_fraction"))
            if nonfinite:
                facts.append(f"inf/NaN in {100 * nonfinite:.0f}% of gradient elements (mean)")
            if not facts and _close(ev, ref_eval):
                matching.append(name)
                continue
            if ev is not None and ref_eval is not None and math.isfinite(ref_eval):
                evs = f"{ev:.4g}" if math.isfinite(ev) else str(ev)
                facts.append(f"eval loss {evs} against {ref_name}'s {ref_eval:.4g}")
            findings.append(f"{name}: " + "; ".join(facts))
        body = []
        if matching:
            verb = "matches" if len(matching) == 1 else "match"
            body.append(
                f"{', '.join(matching)} {verb} {ref_name} (eval loss within 2%, no divergence, "
                "no skipped steps)"
            )
        body += findings
        if not body:
            continue
        if setting:
            lines.append(f"- **{setting}**: {body[0]}")
            lines += [f"  - {b}" for b in body[1:]]
        else:
            lines += [f"- {b}" for b in body]
    return lines
