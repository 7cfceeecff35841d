"""The divergence forecaster: per-layer predictors in, a per-step score and an alarm out.

:class:`Forecaster` reads the rows :mod:`precisionlab.train._predictors` records (one every N
steps) and applies a small set of explainable rules, one per failure mechanism
(:data:`MECHANISMS`). Each rule compares one signal of one layer (or its trend over the last
records) with a threshold; the thresholds were fitted on the training part of
``experiments/divergence_suite.toml`` and are frozen in ``forecast_model.json`` next to this
module (``precisionlab diagnose --forecast RUN_DIR --fit`` refits them; the guide
``docs/guides/forecast.md`` lists them). A rule must hold on ``debounce`` consecutive records
to fire. The score of a step is the largest ratio of a rule's signal to its threshold
(>= 1: the rule's condition holds). The alarm::

    likely to diverge within about N steps; layer L; mechanism M; evidence E

N is the rule's extrapolation where it has one (binades of headroom left over the amax slope)
and otherwise the median lead the rule had on the fitting runs.

:class:`ForecastHook` runs a forecaster during training (``[train.predictors] live = true``,
``precisionlab run --forecast``) and prints the first alarm.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from precisionlab.train._predictors import run_meta

__all__ = [
    "MECHANISMS",
    "MODEL_PATH",
    "Alarm",
    "ForecastHook",
    "Forecaster",
    "Rule",
    "load_model",
    "slope",
]

#: Failure mechanisms the rules name, with the signal each reads.
MECHANISMS: dict[str, str] = {
    "fp16-overflow": "a compute-dtype tensor at or near its format's max (headroom in binades) "
    "while the layer's amax grows",
    "fp8-delayed-overflow": "amax times the delayed-scaling scale near the FP8 max "
    "(scaled_headroom) while the amax grows",
    "grad-underflow": "output gradients flushed to zero (grad_underflow, its "
    "rise since the first records)",
    "grad-noise": "weight-gradient norm below sqrt(3) times its quantization noise "
    "(noise_ratio, Chmiel et al.)",
    "ln-quant-bias": "quantized LayerNorm weights scale the gradient (ln_bias, Su et al.)",
    "weight-oscillation": "quantized weights flipping every step under a 4-bit recipe "
    "(flip_rate, TetraJet)",
    "quant-error-growth": "the quantization error of a recipe's operands growing (q_mse rise, "
    "in binades)",
    "update-swamping": "updates lost in low-precision params (update_applied)",
    "outlier-growth": "activation kurtosis (FOG) above its threshold",
    "swiglu-alignment": "SwiGLU gate/up columns aligned (swiglu_align, Fishman et al.)",
    "loss-scale-collapse": "dynamic loss scale falling with skipped steps",
}

#: The frozen model (fitted thresholds) shipped with the package.
MODEL_PATH = Path(__file__).with_name("forecast_model.json")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One mechanism's rule: ``signal`` of a layer (``feature``: ``"value"``, ``"rise"`` above
    the lowest of the run's first ``window`` records, or ``"slope"`` per 100 steps over the
    last ``window`` records; ``amax``, ``loss_scale`` and ``q_mse`` in binades, log2)
    compared (``op``: ``"<"`` or ``">"``) with ``threshold``; None disables the rule.
    ``requires``: a run property the rule needs (``"recipe"``, ``"4bit"``, ``"low_params"``,
    ``"fp16"``, ``"delayed"``, or ``""``). ``lead``: the median steps from first firing to the
    failure on the fitting runs (the "within about N steps" where the rule cannot
    extrapolate). ``window``: records of the trend (None: the model's). A slope is read only
    after the run's first ``settle`` records (the model's): the first steps of any training
    move fast, and that is not the growth a rule looks for."""

    mechanism: str
    signal: str
    feature: str
    op: str
    threshold: float | None
    requires: str = ""
    lead: float | None = None
    window: int | None = None

    def holds(self, value: float | None) -> bool:
        """Whether ``value`` is on the alarm side of the threshold (never for None or NaN)."""
        if value is None or self.threshold is None or not math.isfinite(value):
            return False
        return value < self.threshold if self.op == "<" else value > self.threshold

    def ratio(self, value: float | None) -> float:
        """How far the value is into the alarm side (>= 1 where :meth:`holds`)."""
        if value is None or self.threshold is None or not math.isfinite(value):
            return 0.0
        t = self.threshold
        if self.op == ">":
            return value / t if t > 0 else (math.inf if value > t else 0.0)
        # "<": for thresholds > 0 the ratio t / value; for headroom-like thresholds near 0,
        # the margin in binades mapped so that the threshold gives 1
        if t > 0 and value > 0:
            return t / value
        return 1.0 + (t - value) if value < t else 1.0 / (1.0 + (value - t))


def load_model(path: str | Path | None = None) -> dict[str, Any]:
    """The frozen forecaster model (``{"rules": [...], "debounce", "window", "settle"}``)."""
    return json.loads(Path(path or MODEL_PATH).read_text())


def slope(steps: Sequence[float], values: Sequence[float | None]) -> float | None:
    """Least-squares slope of ``values`` over ``steps`` (None with fewer than 2 points or no
    spread in the steps; None and non-finite values are left out)."""
    pts = [(s, v) for s, v in zip(steps, values, strict=True) if v is not None and math.isfinite(v)]
    if len(pts) < 2:
        return None
    n = len(pts)
    ms = sum(p[0] for p in pts) / n
    mv = sum(p[1] for p in pts) / n
    den = sum((p[0] - ms) ** 2 for p in pts)
    if den == 0:
        return None
    return sum((p[0] - ms) * (p[1] - mv) for p in pts) / den


@dataclasses.dataclass(frozen=True)
class Alarm:
    """A fired rule: the step it fired at, the mechanism, the layer, the steps to the expected
    failure (``within``), the score and the evidence (one line)."""

    step: int
    mechanism: str
    layer: str
    within: int
    score: float
    evidence: str

    def message(self) -> str:
        """The alarm as one line."""
        return (
            f"likely to diverge within about {self.within} steps; layer {self.layer}; "
            f"mechanism {self.mechanism}; evidence: {self.evidence}"
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of the fields."""
        return dataclasses.asdict(self)


def _fmt(v: float) -> str:
    return f"{v:.3g}"


def run_properties(meta: Mapping[str, Any]) -> set[str]:
    """The properties of a run the rules may require, from a row's ``meta``."""
    props = {""}
    recipe = meta.get("recipe")
    if recipe:
        props.add("recipe")
        if recipe in ("mxfp4", "nvfp4") or meta.get("weight_bits", 16) <= 4:
            props.add("4bit")
        if recipe == "delayed":
            props.add("delayed")
    if meta.get("compute") == "float16":
        props.add("fp16")
    if meta.get("params") in ("bfloat16", "float16"):
        props.add("low_params")
    return props


class Forecaster:
    """Online rules over predictor rows (see the module docstring); feed rows in step order
    with :meth:`update`; :attr:`alarm` is the first alarm (kept), :attr:`scores` the score
    of every row."""

    def __init__(self, model: Mapping[str, Any] | None = None) -> None:
        model = load_model() if model is None else model
        self.model = dict(model)
        self.rules = [Rule(**r) for r in model["rules"]]
        self.debounce = int(model.get("debounce", 2))
        self.window = int(model.get("window", 5))
        self.settle = int(model.get("settle", 10))
        self.history: list[dict[str, Any]] = []
        self.streak: dict[tuple[str, str], int] = {}
        self.alarm: Alarm | None = None
        self.scores: list[tuple[int, float]] = []

    def features(self, rule: Rule) -> dict[str, float | None]:
        """The rule's feature per layer at the newest row."""
        rows = self.history
        last = rows[-1]
        layers = last["layers"]
        window = rule.window or self.window
        out: dict[str, float | None] = {}
        for layer in layers:
            series = [(r["step"], _at(r, rule.signal, layer)) for r in rows[-window:]]
            value = series[-1][1]
            if rule.feature == "value":
                out[layer] = value
            elif rule.feature == "rise":  # above the lowest of the run's first records
                scaled = [_scale(rule, _at(r, rule.signal, layer)) for r in rows[:window]]
                first = [v for v in scaled if v is not None]
                v = _scale(rule, value)
                out[layer] = None if v is None or not first else v - min(first)
            elif len(rows) < max(self.settle, 2):
                out[layer] = None
            else:  # least-squares slope per 100 steps over the last records
                vals = [_scale(rule, v) for _, v in series]
                s = slope([p[0] for p in series], vals)
                out[layer] = None if s is None else 100.0 * s
        return out

    def update(self, row: Mapping[str, Any]) -> Alarm | None:
        """Add one predictor row; returns the alarm when one fires at this row (the first
        alarm of the run is kept in :attr:`alarm`)."""
        self.history.append(dict(row))
        props = run_properties(row.get("meta", {}))
        best: tuple[float, Rule, str, float] | None = None
        fired: list[tuple[float, Rule, str, float]] = []
        for rule in self.rules:
            if rule.threshold is None or rule.requires not in props:
                continue
            feats = self.features(rule)
            for layer, value in feats.items():
                key = (rule.mechanism + ":" + rule.signal + ":" + rule.feature, layer)
                r = rule.ratio(value)
                if best is None or r > best[0]:
                    best = (r, rule, layer, value if value is not None else math.nan)
                if rule.holds(value):
                    self.streak[key] = self.streak.get(key, 0) + 1
                    if self.streak[key] >= self.debounce:
                        assert value is not None  # holds() is False for None
                        fired.append((r, rule, layer, value))
                else:
                    self.streak[key] = 0
        score = 0.0 if best is None else best[0]
        self.scores.append((int(row["step"]), score))
        if self.alarm is not None or not fired:
            return None
        r, rule, layer, value = max(fired, key=lambda f: f[0])
        self.alarm = Alarm(
            step=int(row["step"]),
            mechanism=rule.mechanism,
            layer=layer,
            within=self._within(rule, layer),
            score=r,
            evidence=self._evidence(rule, layer, value),
        )
        return self.alarm

    def _within(self, rule: Rule, layer: str) -> int:
        lead = rule.lead if rule.lead is not None else 100.0
        if rule.signal in ("headroom", "scaled_headroom"):
            # binades left over the amax growth in binades per step
            head = _at(self.history[-1], rule.signal, layer)
            rows = self.history[-self.window :]
            s = slope([r["step"] for r in rows], [_log2(_at(r, "amax", layer)) for r in rows])
            if head is not None and s is not None and s > 0 and head > 0:
                return max(1, round(min(head / s, 10 * lead)))
        return max(1, round(lead))

    def _evidence(self, rule: Rule, layer: str, value: float) -> str:
        what = {"value": "", "rise": " rise since the first records", "slope": " per 100 steps"}
        assert rule.threshold is not None  # update() skips the rules without one
        text = (
            f"{rule.signal}{what[rule.feature]} = {_fmt(value)} {rule.op} {_fmt(rule.threshold)} "
            f"in {layer} for {self.debounce} records"
        )
        last = self.history[-1]
        extra = []
        for sig in ("amax", "kurtosis", "headroom", "grad_underflow", "noise_ratio"):
            v = _at(last, sig, layer)
            if v is not None and sig != rule.signal:
                extra.append(f"{sig} {_fmt(v)}")
        return text + (f" ({', '.join(extra[:3])})" if extra else "")


def _at(row: Mapping[str, Any], signal: str, layer: str) -> float | None:
    """The signal of ``layer`` in ``row``; a run-wide value (``loss_scale``) for every layer."""
    vals = row["signals"].get(signal)
    if vals is None:
        v = row.get(signal)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None
    try:
        j = row["layers"].index(layer)
    except ValueError:
        return None
    return vals[j]


#: Signals whose trends are read in binades (log2): growth by a factor, not by an amount.
LOG_SIGNALS = ("amax", "loss_scale", "q_mse")


def _scale(rule: Rule, v: float | None) -> float | None:
    return _log2(v) if rule.signal in LOG_SIGNALS else v


def _log2(v: float | None) -> float | None:
    return None if v is None or not v > 0 or not math.isfinite(v) else math.log2(v)


class ForecastHook:
    """A live forecaster during training: feeds each predictor row (with ``meta``) to a
    :class:`Forecaster` and calls ``say`` with the alarm's message when it fires."""

    def __init__(
        self,
        meta: Mapping[str, Any],
        *,
        label: str = "",
        say: Callable[[str], None] | None = None,
        model: Mapping[str, Any] | None = None,
    ) -> None:
        self.meta, self.label = dict(meta), label
        self.say = say or (lambda m: print(m, file=sys.stderr, flush=True))
        self.forecaster = Forecaster(model)

    @classmethod
    def for_config(
        cls,
        config: Any,
        *,
        label: str = "",
        say: Callable[[str], None] | None = None,
        model: Mapping[str, Any] | None = None,
    ) -> ForecastHook:
        """The hook for a run of ``config`` (a :class:`~precisionlab.train.TrainConfig`: its
        compute and params dtypes and recipe are what the rules need to know)."""
        prec = config.precision
        params = prec.storage.param_dtype(prec.policy.param_dtype)
        meta = run_meta(prec.policy, params, prec.recipe)
        return cls(meta, label=label, say=say, model=model)

    def on_step(self, end: Any) -> None:
        row = end.record.get("predictors")
        if row is None:
            return
        alarm = self.forecaster.update({**row, "meta": self.meta})
        if alarm is not None:
            where = f"{self.label}: " if self.label else ""
            self.say(f"forecast: {where}step {alarm.step}: {alarm.message()}")

    def close(self) -> None:
        pass
