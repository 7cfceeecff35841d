"""``diagnose --forecast``'s command: run (or resume) an experiment when given one, find the
culprit layers with ``--bisect``, evaluate, and write ``forecast.json`` and ``forecast.md``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from precisionlab.diagnose._bisect import BisectOptions, bisect, final_loss
from precisionlab.diagnose._forecast import UnitRun, ground_truth, load_run, run_forecast
from precisionlab.experiments import _runner as runner
from precisionlab.experiments import _store as store
from precisionlab.experiments._config import experiment_from_document, load_experiment
from precisionlab.experiments._report import markdown_table, text_table
from precisionlab.train._forecast import load_model

__all__ = ["ForecastOptions", "bisect_layers", "forecast_command", "scores_table", "write_forecast"]


def _run_suite(path: Path, out: Path | None, overrides: Sequence[str], quiet: bool) -> Path:
    """Run the experiment at ``path`` into ``out`` (resuming a run already there)."""
    if out is not None and (out / "config.json").exists():
        return runner.resume(out, quiet=quiet)
    return runner.run_file(path, out=out, overrides=overrides, quiet=quiet)


def bisect_layers(
    run_dir: Path, *, say: Callable[[str], None] = lambda _m: None
) -> Callable[[Sequence[UnitRun]], dict[str, list[str]]]:
    """A function giving, for each setting of the evaluation units, the layers
    ``diagnose --bisect`` returns to high precision to make its first precision failure (by
    seed) pass against its reference; settings without an answer are left out."""

    def find(units: Sequence[UnitRun]) -> dict[str, list[str]]:
        units_all, resolved = load_run(run_dir)
        config = store.read_json(run_dir / "config.json")
        experiment = experiment_from_document(
            config["document"], config.get("source", str(run_dir)), default_name=run_dir.name
        )
        by_id = {u.id: u for u in experiment.units}
        diag = resolved.get("diagnose", {})
        reference = diag.get("forecast_reference", "fp32")
        truth = ground_truth(units_all, reference, margin=float(diag.get("forecast_margin", 0.1)))
        refs = {(u.setting, u.seed): u for u in units_all if u.variant == reference}
        out: dict[str, list[str]] = {}
        for u in sorted(units, key=lambda x: x.seed):
            o = truth[u.id]
            if u.setting in out or not o.precision or (u.setting, u.seed) not in refs:
                continue
            fail, passing = by_id[u.id], by_id[refs[(u.setting, u.seed)].id]

            def runner(cfg: Any, tail: int) -> float:
                # the search runs train without the instruments
                return final_loss(dataclasses.replace(cfg, predictors=None, telemetry=None), tail)

            ref_loss = _tail_loss(refs[(u.setting, u.seed)], 10)
            tol = max(0.05, float(diag.get("forecast_margin", 0.1)) * abs(ref_loss))
            say(f"bisect {u.name} against {passing.name}")
            try:
                result = bisect(fail, passing, BisectOptions(tolerance=tol), runner=runner)
            except ValueError as err:
                say(f"  bisect of {u.name} gave no answer: {err}")
                continue
            if result.answer:
                out[u.setting] = list(result.answer)
                say(f"  culprit layers: {', '.join(result.answer)}")
            else:
                say("  no set of layers returned to high precision makes it pass")
        return out

    return find


def _tail_loss(u: UnitRun, tail: int) -> float:
    vals = [v for v in u.losses[-tail:] if v is not None]
    return sum(vals) / len(vals) if vals else math.inf


def _num(v: Any, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def scores_table(result: Mapping[str, Any], *, markdown: bool = True) -> str:
    """The evaluation's methods side by side (precision, recall, lead, mechanism, layer)."""
    hdr = [
        "method", "precision", "recall", "alarms (TP+FP)", "median lead (steps)",
        "median lead / failure step", "right mechanism", "right layer (bisect)",
    ]  # fmt: skip
    rows = []
    for name, ev in result.get("evaluation", {}).items():
        s = ev["scores"]
        layer = (
            "-" if s["layer_share"] is None else f"{s['layer_share']:.2f} of {s['layer_checked']}"
        )
        rows.append(
            [
                name, _num(s["precision"]), _num(s["recall"]),
                f"{s['alarms']} ({s['tp']}+{s['fp']})",
                _num(s["median_lead"], ".0f"), _num(s["median_lead_fraction"]),
                _num(s["mechanism_share"]), layer,
            ]
        )  # fmt: skip
    return markdown_table(rows, hdr) if markdown else text_table(rows, hdr)


def _rules_table(model: Mapping[str, Any]) -> str:
    hdr = ["mechanism", "signal", "feature", "alarm when", "requires", "median lead (fit)"]
    rows = []
    for r in model.get("rules", []):
        t = r.get("threshold")
        when = "off" if t is None else f"{r['op']} {t:.4g}"
        rows.append(
            [r["mechanism"], r["signal"], r["feature"], when, r.get("requires") or "-",
             _num(r.get("lead"), ".0f")]
        )  # fmt: skip
    return markdown_table(rows, hdr)


def _units_table(result: Mapping[str, Any]) -> str:
    hdr = ["unit", "split", "failure", "at step", "alarm at", "mechanism", "layer", "within"]
    rows = []
    for u in result.get("units", []):
        a = u.get("alarm")
        fail = u["failure"] or "-"
        if u["failure"] and not u["precision_failure"]:
            fail += " (not precision)"
        rows.append(
            [u["unit"], u["split"], fail, _num(u["failure_step"], "d"),
             "-" if a is None else str(a["step"]), "-" if a is None else a["mechanism"],
             "-" if a is None else a["layer"], "-" if a is None else str(a["within"])]
        )  # fmt: skip
    return markdown_table(rows, hdr)


def write_forecast(out_dir: Path, result: Mapping[str, Any]) -> tuple[Path, str]:
    """``forecast.json`` and ``forecast.md`` in ``out_dir``; returns the report's path and
    the text printed."""
    store.write_json(out_dir / "forecast.json", result)
    lines = [f"# diagnose --forecast: {result['run_dir']}", ""]
    text = []
    if "evaluation" in result:
        n = len([u for u in result["units"] if u["split"] == "eval"])
        lines += [
            f"Evaluation on the {n} units not used for fitting (reference variant "
            f"{result['reference']!r}, stall margin {result['margin']:g}):",
            "",
            scores_table(result),
            "",
        ]
        text.append(scores_table(result, markdown=False))
    if result.get("bisect_layers"):
        lines += ["Culprit layers found by `diagnose --bisect`:", ""]
        lines += [f"- {k}: {', '.join(v)}" for k, v in result["bisect_layers"].items()]
        lines.append("")
    lines += ["## Alarms per unit", "", _units_table(result), "", "## The forecaster's rules", ""]
    lines += [_rules_table(result["model"]), ""]
    alarms = [u for u in result["units"] if u.get("message")]
    for u in alarms:
        text.append(f"{u['unit']}: step {u['alarm']['step']}: {u['message']}")
    if not alarms:
        text.append("no alarm")
    path = out_dir / "forecast.md"
    store.write_text(path, "\n".join(lines) + "\n")
    return path, "\n".join(text)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForecastOptions:
    """The options of ``diagnose --forecast``. quick: an experiment file runs its
    ``[diagnose] forecast_quick`` subset, without the bisect runs. fit: refit the rules'
    thresholds on the suite's fitting settings first (``forecast_model.json`` is written
    beside the report). model: a forecaster model's JSON file (None: the frozen one).
    bisect: check the alarms' layers with ``diagnose --bisect`` runs."""

    quick: bool = False
    fit: bool = False
    model: str | Path | None = None
    bisect: bool = True

    def __post_init__(self) -> None:
        for name in ("quick", "fit", "bisect"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.model is not None and not isinstance(self.model, str | Path):
            raise TypeError(f"model must be a path or None, got {type(self.model).__name__}")


def forecast_command(
    target: str | Path,
    options: ForecastOptions = ForecastOptions(),
    *,
    out: str | Path | None = None,
    overrides: Sequence[str] = (),
    quiet: bool = False,
    say: Callable[[str], None] = lambda _m: None,
) -> tuple[Path, dict[str, Any], str]:
    """Run ``diagnose --forecast TARGET`` with ``options``: a run directory is analysed; an
    experiment file is run first, with the ``--set`` ``overrides`` (``quiet``: without the
    runner's progress). ``out``: the directory to run the file into, or to write a run
    directory's report to (default: the run directory). Returns (the directory written to,
    the result, the text to print)."""
    target = Path(target)
    bisect = options.bisect
    if target.is_dir():
        if options.quick or overrides:
            raise ValueError("quick and overrides apply to an experiment file, not a run directory")
        run_dir = target
    else:
        sets = list(overrides)
        if options.quick:
            exp = load_experiment(target, overrides)
            sets += list(exp.resolved.get("diagnose", {}).get("forecast_quick", []))
            bisect = False
        run_dir = _run_suite(target, None if out is None else Path(out), sets, quiet)
    model = None if options.model is None else load_model(options.model)
    result = run_forecast(
        run_dir,
        model=model,
        refit=options.fit,
        bisect_layers=bisect_layers(run_dir, say=say) if bisect else None,
        say=say,
    )
    dest = Path(out) if (out is not None and target.is_dir()) else run_dir
    dest.mkdir(parents=True, exist_ok=True)
    if options.fit:
        store.write_json(dest / "forecast_model.json", result["model"])
    path, text = write_forecast(dest, result)
    return path, result, text
