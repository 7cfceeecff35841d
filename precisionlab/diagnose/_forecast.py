"""``diagnose --forecast``: the divergence forecaster on a run directory, its fitting, and its
evaluation against the ground truth and two baselines.

A run directory of ``precisionlab run`` whose units recorded predictors
(``[train.predictors]``, ``predictors.jsonl``) is read unit by unit:

- :func:`forecast_unit` replays the frozen :class:`~precisionlab.train._forecast.Forecaster`
  over the unit's rows: the first alarm and the score of every record.
- :func:`outcome` is the ground truth, from the unit's losses and those of its reference
  (the variant named ``[diagnose] forecast_reference``, ``"fp32"`` by default, in the same
  setting with the same seed): *diverged* at the first non-finite loss or the step the run
  marked diverged; *stalled* at the first step from which the smoothed loss stays more than
  ``margin`` (relative) above the reference's to the end. A failure is a *precision* failure
  when the reference did not fail as well (a learning rate that breaks float32 too is not).
- :func:`evaluate` scores a method on the units: precision and recall of "an alarm before a
  precision failure", the median lead (steps from the alarm to the failure, and as a
  fraction of the failure step), the share of alarms naming the mechanism of the setting
  (its name's prefix) and, where ``diagnose --bisect`` found the culprit layers of a setting,
  the share naming one of them. Methods: the forecaster, kurtosis alone (FOG's signal, its
  threshold fitted the same way) and Transformer Engine's ``AutoswitchGemm`` thresholds
  (underflow above 5% or MSE above 1e-4 of any operand of any layer; not fitted).
- :func:`fit` fits every rule's threshold on the fitting units (the settings matching
  ``[diagnose] forecast_fit``): among the thresholds maximizing (precision failures alarmed
  before they fail) - 2 x (other units alarmed), the middle one; a trend threshold must be
  on the side of change; a rule with no gain is off. The result is the frozen model.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from precisionlab.experiments import _store as store
from precisionlab.train._forecast import MECHANISMS, Forecaster, Rule, load_model, run_properties

__all__ = [
    "DEFAULT_RULES",
    "Outcome",
    "Scores",
    "UnitRun",
    "alarms_of",
    "evaluate",
    "fit",
    "fit_kurtosis",
    "fit_rule",
    "forecast_unit",
    "ground_truth",
    "load_run",
    "outcome",
    "references",
    "run_forecast",
    "split",
    "te_model",
]

#: The rules the forecaster fits (mechanism, signal, feature, op, requires[, window]): per
#: mechanism, on the signals its paper names (a level, a rise since the start, a slope).
DEFAULT_RULES: tuple[tuple, ...] = (
    ("fp16-overflow", "headroom", "value", "<", "fp16"),
    ("fp16-overflow", "amax", "rise", ">", "fp16"),
    ("fp8-delayed-overflow", "scaled_headroom", "value", "<", "delayed"),
    ("fp8-delayed-overflow", "amax", "rise", ">", "delayed"),
    ("grad-underflow", "grad_underflow", "rise", ">", "fp16"),
    ("grad-underflow", "noise_ratio", "value", "<", "fp16"),
    ("grad-noise", "noise_ratio", "value", "<", "recipe"),
    ("ln-quant-bias", "ln_bias", "value", ">", ""),
    ("weight-oscillation", "flip_rate", "value", ">", "4bit"),
    ("quant-error-growth", "q_mse", "rise", ">", "recipe"),
    ("update-swamping", "update_applied", "value", "<", "low_params"),
    ("fp16-overflow", "amax", "slope", ">", "fp16", 10),
    ("fp8-delayed-overflow", "amax", "slope", ">", "delayed", 10),
    ("outlier-growth", "kurtosis", "slope", ">", "", 10),
    ("swiglu-alignment", "swiglu_align", "value", ">", ""),
    ("loss-scale-collapse", "loss_scale", "slope", "<", "fp16"),
)

#: What a false alarm costs in the fitting objective (alarmed failures minus this many per
#: alarmed other run): a rule is kept only where it is right at least 2 times in 3.
FP_WEIGHT = 2.0

#: Mechanisms a setting's name may start with (the ground truth of "mechanism M").
SETTING_MECHANISMS: tuple[str, ...] = tuple(MECHANISMS)


@dataclasses.dataclass
class UnitRun:
    """One unit of a run directory: its record (id, name, setting, variant, seed), losses per
    step (index 0 = step 1; None where not finite), whether it marked itself diverged and
    where, and its predictor rows."""

    id: str
    name: str
    setting: str
    variant: str
    seed: int
    losses: list[float | None]
    diverged_at: int | None
    rows: list[dict[str, Any]]
    steps: int


def _loss(v: Any) -> float | None:
    if isinstance(v, str):
        return None
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def load_run(run_dir: str | Path) -> tuple[list[UnitRun], dict[str, Any]]:
    """The units of a ``precisionlab run`` directory (those with ``metrics.jsonl``) and its
    resolved config."""
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.json"
    if not cfg_path.exists():
        raise ValueError(f"{run_dir}: not a run directory (no config.json)")
    config = store.read_json(cfg_path)
    resolved = config.get("resolved", {})
    units = []
    for rec in resolved.get("units", []):
        udir = run_dir / "variants" / rec["id"]
        mpath = udir / "metrics.jsonl"
        if not mpath.exists():
            continue
        metrics = store.read_jsonl(mpath)
        losses = [_loss(m.get("loss")) for m in metrics]
        div = next((int(m["step"]) for m in metrics if m.get("diverged")), None)
        ppath = udir / "predictors.jsonl"
        rows = store.read_jsonl(ppath) if ppath.exists() else []
        units.append(
            UnitRun(
                id=rec["id"], name=rec["name"], setting=rec.get("setting", ""),
                variant=rec.get("variant", ""), seed=int(rec.get("seed", 0)), losses=losses,
                diverged_at=div, rows=rows, steps=int(rec.get("params", {}).get("steps", 0)),
            )
        )  # fmt: skip
    return units, resolved


# --- ground truth -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Outcome:
    """kind: ``"diverged"``, ``"stalled"`` or ``""`` (trained); step: the failure step (1-based)
    or None; precision: a failure its reference does not share."""

    kind: str
    step: int | None
    precision: bool


def _smooth(losses: Sequence[float | None], window: int) -> list[float | None]:
    out: list[float | None] = []
    for i in range(len(losses)):
        part = [v for v in losses[max(0, i - window + 1) : i + 1] if v is not None]
        out.append(sum(part) / len(part) if part else None)
    return out


def _diverged(u: UnitRun) -> int | None:
    bad = next((i + 1 for i, v in enumerate(u.losses) if v is None), None)
    cands = [s for s in (bad, u.diverged_at) if s is not None]
    return min(cands) if cands else None


def outcome(u: UnitRun, ref: UnitRun | None, *, margin: float = 0.1, window: int = 20) -> Outcome:
    """The ground truth of ``u`` against its reference ``ref`` (see the module docstring)."""
    div = _diverged(u)
    ref_div = None if ref is None else _diverged(ref)
    if div is not None:
        precision = ref is not None and (ref_div is None or ref_div > div + window)
        return Outcome("diverged", div, precision)
    if ref is None or u is ref:
        return Outcome("", None, False)
    a, b = _smooth(u.losses, window), _smooth(ref.losses, window)
    n = min(len(a), len(b))
    if ref_div is not None:
        n = min(n, ref_div - 1)
    start = None
    for i in range(n - 1, window - 2, -1):  # from the end back: the last step still failing
        x, y = a[i], b[i]
        if x is None or y is None or not x > y + margin * abs(y):
            break
        start = i + 1
    if start is None:
        return Outcome("", None, False)
    return Outcome("stalled", start, ref_div is None)


def references(units: Sequence[UnitRun], reference: str) -> dict[str, UnitRun | None]:
    """Unit id -> its reference unit (same setting and seed, variant ``reference``)."""
    by = {(u.setting, u.seed, u.variant): u for u in units}
    return {u.id: by.get((u.setting, u.seed, reference)) for u in units}


# --- replaying a method -------------------------------------------------------------------


def forecast_unit(u: UnitRun, model: Mapping[str, Any]) -> Forecaster:
    """The forecaster ``model`` replayed over the unit's rows (its ``alarm`` and ``scores``)."""
    f = Forecaster(model)
    for row in u.rows:
        f.update(row)
        if f.alarm is not None:
            break
    return f


def te_model(underflow: float = 0.05, mse: float = 1e-4) -> dict[str, Any]:
    """Transformer Engine's ``AutoswitchGemm`` defaults as a forecaster model (no fitting,
    switching at the first exceedance)."""
    rules = [
        dict(mechanism="te-autoswitch", signal="q_underflow", feature="value", op=">",
             threshold=underflow),
        dict(mechanism="te-autoswitch", signal="q_mse", feature="value", op=">", threshold=mse),
    ]  # fmt: skip
    return {"rules": rules, "debounce": 1, "window": 5}


# --- fitting ------------------------------------------------------------------------------


def _feature_table(u: UnitRun, rule: Rule, window: int, settle: int = 10) -> list[tuple[int, list]]:
    """(step, [feature per layer]) for every row of ``u``, as the forecaster computes them."""
    f = Forecaster({"rules": [], "debounce": 1, "window": window, "settle": settle})
    table = []
    for row in u.rows:
        f.history.append(row)
        table.append((int(row["step"]), list(f.features(rule).values())))
    return table


def _first_alarm(table: list[tuple[int, list]], rule: Rule, debounce: int) -> int | None:
    """The step the rule first holds ``debounce`` records in a row for one layer."""
    streak: dict[int, int] = {}
    for step, feats in table:
        for j, v in enumerate(feats):
            streak[j] = streak.get(j, 0) + 1 if rule.holds(v) else 0
            if streak[j] >= debounce:
                return step
    return None


def _candidates(values: Sequence[float], limit: int = 80) -> list[float]:
    vals = sorted(set(values))
    if len(vals) > limit:
        vals = [vals[round(i * (len(vals) - 1) / (limit - 1))] for i in range(limit)]
    # thresholds just beside the observed values, both ways
    out: set[float] = set()
    for v in vals:
        eps = 1e-6 * max(abs(v), 1e-12)
        out.update((v - eps, v + eps))
    return sorted(out)


def fit_rule(
    rule: Rule,
    units: Sequence[UnitRun],
    truth: Mapping[str, Outcome],
    *,
    debounce: int,
    window: int,
    settle: int = 10,
) -> tuple[Rule, dict[str, Any]]:
    """``rule`` with the threshold maximizing (precision failures alarmed before their
    failure) - :data:`FP_WEIGHT` x (other units alarmed) on ``units``, the middle of the
    thresholds that reach it, and ``lead`` the median lead; threshold None when no
    candidate gains."""

    def props(u: UnitRun) -> set[str]:
        return run_properties(u.rows[0].get("meta", {}) if u.rows else {})

    usable = [u for u in units if rule.requires in props(u)]
    tables = {u.id: _feature_table(u, rule, window, settle) for u in usable}
    values = [
        v for t in tables.values() for _, feats in t for v in feats
        if v is not None and math.isfinite(v)
    ]  # fmt: skip

    def score(t: float) -> tuple[float, list[float], int]:
        r = dataclasses.replace(rule, threshold=t)
        gain, false = 0.0, 0
        leads: list[float] = []
        for u in usable:
            step = _first_alarm(tables[u.id], r, debounce)
            o = truth[u.id]
            if o.precision and o.step is not None:
                if step is not None and step < o.step:
                    gain += 1
                    leads.append(o.step - step)
            elif step is not None:
                gain -= FP_WEIGHT
                false += 1
        return gain, leads, false

    cands = [t for t in _candidates(values) if _meaningful(rule, t)]
    scored = [(t, *score(t)) for t in cands]
    best_gain = max((g for _, g, _, _ in scored), default=0.0)
    if best_gain <= 0:
        fitted = dataclasses.replace(rule, threshold=None, lead=None)
        return fitted, {"gain": best_gain, "runs": len(usable), "alarmed_failures": 0}
    # the middle of the thresholds that do best: as far from the fitting runs' values on
    # either side as the data allows (the most permissive one would alarm on anything)
    top = [t for t, g, _, _ in scored if g == best_gain]
    t = (min(top) + max(top)) / 2
    gain, leads, false = score(t)
    if gain < best_gain:  # the best thresholds are not contiguous: keep the best lead's
        t = max((x for x in scored if x[1] == best_gain), key=lambda x: statistics.median(x[2]))[0]
        gain, leads, false = score(t)
    fitted = dataclasses.replace(
        rule, threshold=t, lead=float(statistics.median(leads)) if leads else None
    )
    return fitted, {
        "gain": gain, "runs": len(usable), "alarmed_failures": len(leads), "false_alarms": false,
    }  # fmt: skip


def _meaningful(rule: Rule, t: float) -> bool:
    """A trend threshold on the side of change (a rise above 0, a slope away from 0): a
    run whose signal does not move never fires it."""
    if rule.feature in ("rise", "slope"):
        return t > 0 if rule.op == ">" else t < 0
    return True


def fit(
    units: Sequence[UnitRun],
    truth: Mapping[str, Outcome],
    *,
    rules: Sequence[tuple] = DEFAULT_RULES,
    debounce: int = 2,
    window: int = 5,
    settle: int = 10,
) -> dict[str, Any]:
    """The forecaster model fitted on ``units`` (see :func:`fit_rule`)."""
    fitted, notes = [], {}
    for mech, signal, feature, op, requires, *rest in rules:
        r = Rule(mech, signal, feature, op, None, requires, window=rest[0] if rest else None)
        fr, note = fit_rule(r, units, truth, debounce=debounce, window=window, settle=settle)
        fitted.append(dataclasses.asdict(fr))
        notes[f"{mech}:{signal}:{feature}"] = note
    return {
        "version": 1,
        "debounce": debounce,
        "window": window,
        "settle": settle,
        "rules": fitted,
        "fit": {"units": [u.name for u in units], "notes": notes},
    }


def fit_kurtosis(units: Sequence[UnitRun], truth: Mapping[str, Outcome], *, debounce: int = 2,
                 window: int = 5) -> dict[str, Any]:  # fmt: skip
    """The kurtosis-alone baseline: one rule on the kurtosis value, fitted like :func:`fit`."""
    r = Rule("outlier-growth", "kurtosis", "value", ">", None, "")
    fr, _ = fit_rule(r, units, truth, debounce=debounce, window=window)
    return {"rules": [dataclasses.asdict(fr)], "debounce": debounce, "window": window}


# --- evaluation ---------------------------------------------------------------------------


@dataclasses.dataclass
class Scores:
    """A method's figures on a set of units (see :func:`evaluate`)."""

    method: str
    units: int
    positives: int
    alarms: int
    tp: int
    fp: int
    fn: int
    precision: float | None
    recall: float | None
    median_lead: float | None
    median_lead_fraction: float | None
    mechanism_share: float | None
    layer_share: float | None
    layer_checked: int


def _setting_mechanism(setting: str) -> str | None:
    for m in sorted(SETTING_MECHANISMS, key=len, reverse=True):
        if setting == m or setting.startswith(m + "-"):
            return m
    return None


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _median(values: list) -> float | None:
    return float(statistics.median(values)) if values else None


def evaluate(
    method: str,
    units: Sequence[UnitRun],
    truth: Mapping[str, Outcome],
    alarms: Mapping[str, Any],
    layers: Mapping[str, Sequence[str]] | None = None,
) -> tuple[Scores, list[dict[str, Any]]]:
    """Precision, recall, lead, mechanism and layer shares of ``alarms`` (unit id -> Alarm or
    None) on ``units``; ``layers``: setting -> culprit layers found by bisect. Returns the
    scores and one row per unit."""
    tp = fp = fn = 0
    leads, fracs, mech_ok, layer_ok = [], [], [], []
    rows = []
    for u in units:
        o, a = truth[u.id], alarms.get(u.id)
        pos = o.precision and o.step is not None
        early = a is not None and pos and a.step < o.step
        verdict = "TP" if early else "FN" if pos else "FP" if a is not None else "TN"
        tp += verdict == "TP"
        fp += verdict == "FP"
        fn += verdict == "FN"
        if early and a is not None:  # (early says a is not None)
            leads.append(o.step - a.step)
            fracs.append((o.step - a.step) / o.step)
            want = _setting_mechanism(u.setting)
            if want is not None:
                mech_ok.append(a.mechanism == want)
            culprits = (layers or {}).get(u.setting)
            if culprits:
                layer_ok.append(a.layer in culprits)
        rows.append(
            {
                "unit": u.name, "setting": u.setting, "variant": u.variant, "seed": u.seed,
                "failure": o.kind, "failure_step": o.step, "precision_failure": o.precision,
                "alarm_step": None if a is None else a.step,
                "mechanism": None if a is None else a.mechanism,
                "layer": None if a is None else a.layer,
                "within": None if a is None else a.within, "verdict": verdict,
                "message": None if a is None else a.message(),
            }
        )  # fmt: skip
    return (
        Scores(
            method=method,
            units=len(units),
            positives=tp + fn,
            alarms=tp + fp,
            tp=tp,
            fp=fp,
            fn=fn,
            precision=_ratio(tp, tp + fp),
            recall=_ratio(tp, tp + fn),
            median_lead=_median(leads),
            median_lead_fraction=_median(fracs),
            mechanism_share=_ratio(sum(mech_ok), len(mech_ok)),
            layer_share=_ratio(sum(layer_ok), len(layer_ok)),
            layer_checked=len(layer_ok),
        ),
        rows,
    )


def split(units: Sequence[UnitRun], fit_patterns: Sequence[str]) -> tuple[list, list]:
    """(fitting units, evaluation units): a unit fits when its setting matches a pattern."""
    fitting = [u for u in units if any(fnmatch.fnmatchcase(u.setting, p) for p in fit_patterns)]
    ids = {u.id for u in fitting}
    return fitting, [u for u in units if u.id not in ids]


def ground_truth(
    units: Sequence[UnitRun], reference: str, *, margin: float = 0.1, window: int = 20
) -> dict[str, Outcome]:
    """unit id -> :class:`Outcome` (references judged by divergence only)."""
    refs = references(units, reference)
    return {u.id: outcome(u, refs[u.id], margin=margin, window=window) for u in units}


def alarms_of(units: Sequence[UnitRun], model: Mapping[str, Any]) -> dict[str, Any]:
    """unit id -> the first alarm of ``model`` replayed over the unit (or None)."""
    return {u.id: forecast_unit(u, model).alarm for u in units}


def run_forecast(
    run_dir: str | Path,
    *,
    model: Mapping[str, Any] | None = None,
    refit: bool = False,
    bisect_layers: Callable[[Sequence[UnitRun]], Mapping[str, Sequence[str]]] | None = None,
    say: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """Everything ``diagnose --forecast RUN_DIR`` reports, as a JSON-able dict: per unit the
    forecaster's alarm; with ``[diagnose] forecast_fit`` settings in the run's experiment, the
    evaluation on the other units of the forecaster, kurtosis alone and TE's thresholds
    (``refit``: the forecaster refitted on the fitting units first; otherwise the frozen
    model, or ``model``)."""
    units, resolved = load_run(run_dir)
    diag = resolved.get("diagnose", {})
    reference = diag.get("forecast_reference", "fp32")
    fit_patterns = diag.get("forecast_fit", [])
    margin = float(diag.get("forecast_margin", 0.1))
    truth = ground_truth(units, reference, margin=margin)
    fitting, evaluation = split(units, fit_patterns)
    out: dict[str, Any] = {"run_dir": str(run_dir), "reference": reference, "margin": margin}
    if refit:
        if not fitting:
            raise ValueError(
                f"{run_dir}: --fit needs fitting units: the experiment's [diagnose] "
                "forecast_fit names no setting of its units"
            )
        model = fit(fitting, truth)
        say(f"fitted the forecaster on {len(fitting)} units")
    model = load_model() if model is None else dict(model)
    out["model"] = model
    main = alarms_of(units, model)
    out["units"] = [
        {
            "unit": u.name, "setting": u.setting, "variant": u.variant, "seed": u.seed,
            "split": "fit" if u in fitting else "eval", "records": len(u.rows),
            "failure": truth[u.id].kind, "failure_step": truth[u.id].step,
            "precision_failure": truth[u.id].precision,
            "alarm": None if main[u.id] is None else main[u.id].to_dict(),
            "message": None if main[u.id] is None else main[u.id].message(),
        }
        for u in units
    ]  # fmt: skip
    if not fitting or not evaluation:
        return out
    kurt = fit_kurtosis(fitting, truth)
    layers = {} if bisect_layers is None else dict(bisect_layers(evaluation))
    out["bisect_layers"] = {k: list(v) for k, v in layers.items()}
    methods = {
        "forecaster": main,
        "kurtosis alone": alarms_of(units, kurt),
        "TE AutoswitchGemm": alarms_of(units, te_model()),
    }
    out["baselines"] = {"kurtosis alone": kurt, "TE AutoswitchGemm": te_model()}
    out["evaluation"] = {}
    out["fit_scores"] = {}
    for name, alarms in methods.items():
        s, rows = evaluate(name, evaluation, truth, alarms, layers)
        out["evaluation"][name] = {"scores": dataclasses.asdict(s), "units": rows}
        sf, _ = evaluate(name, fitting, truth, alarms)
        out["fit_scores"][name] = dataclasses.asdict(sf)
    return out
