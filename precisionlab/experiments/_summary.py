"""Per-unit and per-run summaries of a ``train`` experiment, computed from the run store.

A unit's summary is derived from its ``metrics.jsonl`` (what was recorded, also after a resume)
and the trainer's final result (evaluation). ``final_loss`` is honest: the last recorded loss
when it is inf/NaN (a run that diverged ends there), else the mean of the finite training losses
of the last ``FINAL_WINDOW`` recorded steps (less noisy than the last minibatch).
``final_loss_finite`` is that mean of the finite losses in every case (for a diverged run: its
loss just before the divergence; None when the window holds no finite loss).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from precisionlab.experiments import _store as store
from precisionlab.experiments._telemetry_views import summarize_telemetry

__all__ = [
    "FINAL_WINDOW",
    "GROUP_KEYS",
    "SUMMARY_KEYS",
    "failed_units",
    "summarize_run",
    "summarize_unit",
]

#: Number of last recorded steps averaged into ``final_loss``.
FINAL_WINDOW = 10

#: Keys of every unit summary, in table order.
SUMMARY_KEYS = (
    "name",
    "group",
    "setting",
    "variant",
    "seed",
    "status",
    "error",
    "policy",
    "loss_scale",
    "update_rounding",
    "steps",
    "final_loss",
    "final_loss_finite",
    "eval_loss",
    "eval_metric",
    "eval_metric_name",
    "skipped_steps",
    "diverged",
    "divergence_step",
    "min_loss_scale",
    "max_loss_scale",
    "mean_underflow_fraction",
    "mean_nonfinite_fraction",
    "wall_time_s",
    "recipe_metrics",
    "telemetry",
)

#: Numeric keys averaged (mean and std) over the seeds of a group.
GROUP_KEYS = (
    "final_loss",
    "eval_loss",
    "eval_metric",
    "skipped_steps",
    "mean_underflow_fraction",
    "mean_nonfinite_fraction",
    "wall_time_s",
)


def _float(value: Any) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def summarize_unit(unit: Any, unit_dir: Path, status: dict[str, Any]) -> dict[str, Any]:
    """The summary of one unit (see :data:`SUMMARY_KEYS`)."""
    rows = [r for r in store.read_jsonl(Path(unit_dir) / "metrics.jsonl") if "loss" in r]
    result = status.get("result") or {}
    params = unit.params
    losses = [_float(r["loss"]) for r in rows]
    tail = losses[-FINAL_WINDOW:]
    finite = [x for x in tail if x is not None and math.isfinite(x)]
    final_loss_finite = statistics.fmean(finite) if finite else None
    if tail and (tail[-1] is None or not math.isfinite(tail[-1])):
        final_loss = tail[-1]  # the run ended diverged: say so, not its earlier loss
    else:
        final_loss = final_loss_finite
    scales = [s for s in (_float(r.get("loss_scale")) for r in rows) if s is not None]
    under = [u for u in (_float(r.get("underflow_fraction")) for r in rows) if u is not None]
    nonfinite = [u for u in (_float(r.get("nonfinite_fraction")) for r in rows) if u is not None]
    diverged = result.get("diverged")
    divergence_step = result.get("divergence_step")
    if diverged is None:  # failed or interrupted: judge from the recorded losses
        bad = [
            r["step"]
            for r, x in zip(rows, losses, strict=True)
            if x is None or not math.isfinite(x)
        ]
        diverged = bool(bad)
        divergence_step = bad[0] if bad else None
    return {
        "name": unit.name,
        "group": unit.group,
        "setting": unit.setting,
        "variant": unit.variant,
        "seed": unit.seed,
        "status": status.get("status"),
        "error": status.get("error"),
        "policy": params.get("policy"),
        "loss_scale": params.get("loss_scale"),
        "update_rounding": params.get("update_rounding"),
        "steps": len(rows),
        "final_loss": final_loss,
        "final_loss_finite": final_loss_finite,
        "eval_loss": _float(result.get("eval_loss")),
        "eval_metric": _float(result.get("eval_metric")),
        "eval_metric_name": result.get("eval_metric_name"),
        "skipped_steps": sum(1 for r in rows if r.get("skipped")),
        "diverged": bool(diverged),
        "divergence_step": divergence_step,
        "min_loss_scale": min(scales) if scales else None,
        "max_loss_scale": max(scales) if scales else None,
        "mean_underflow_fraction": statistics.fmean(under) if under else None,
        # inf/NaN gradient elements, apart from the underflow meter (None: not recorded)
        "mean_nonfinite_fraction": statistics.fmean(nonfinite) if nonfinite else None,
        "wall_time_s": status.get("wall_time_s"),
        # recipe runs with hist_interval: {group: {stat: value}}
        # (precisionlab.train._recipe_metrics)
        "recipe_metrics": result.get("recipe_metrics"),
        # telemetry.jsonl's worst layers (precisionlab.experiments._telemetry_views)
        "telemetry": summarize_telemetry(unit_dir),
    }


def _groups(units: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_group: dict[str, list[dict[str, Any]]] = {}
    for u in units:
        by_group.setdefault(u["group"], []).append(u)
    out = []
    for group, members in by_group.items():
        if len(members) < 2:
            continue
        entry: dict[str, Any] = {
            "group": group,
            "seeds": [m["seed"] for m in members],
            "n": len(members),
            "diverged": sum(bool(m["diverged"]) for m in members),
            "failed": sum(m["status"] == "failed" for m in members),
        }
        for key in GROUP_KEYS:
            values = [
                v
                for v in (_float(m.get(key)) for m in members)
                if v is not None and math.isfinite(v)
            ]
            entry[f"{key}_mean"] = statistics.fmean(values) if values else None
            entry[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else None
        out.append(entry)
    return out


def failed_units(run_dir: str | Path) -> int:
    """How many units of the run in ``run_dir`` failed (for another kind: 1 if it failed)."""
    summary = store.read_json(Path(run_dir) / "summary.json")
    if summary.get("kind") == "train":
        return sum(u.get("status") == "failed" for u in summary["variants"])
    return int(summary.get("status") == "failed")


def summarize_run(run_dir: Path, experiment: Any) -> dict[str, Any]:
    """Collect the unit summaries of ``run_dir`` into ``summary.json`` (atomically); returns it.
    Units not started yet are listed with status ``pending``."""
    run_dir = Path(run_dir)
    units = []
    for unit in experiment.units:
        status_path = run_dir / "variants" / unit.id / "status.json"
        status: dict[str, Any] = (
            store.read_json(status_path) if status_path.exists() else {"status": "pending"}
        )
        summary = status.get("summary")
        if summary is None or status.get("status") in ("running", "pending"):
            summary = summarize_unit(unit, run_dir / "variants" / unit.id, status)
        units.append({"id": unit.id, **summary})
    data = {
        "kind": "train",
        "name": experiment.name,
        "description": experiment.description,
        "final_loss_window": FINAL_WINDOW,
        "variants": units,
        "groups": _groups(units),
    }
    store.write_json(run_dir / "summary.json", data)
    return data
