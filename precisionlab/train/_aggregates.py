"""The totals of a training run (:class:`Aggregates`), updated by a pure function after each
step and checkpointed with the state."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from precisionlab._io import from_json_float

__all__ = ["Aggregates"]


@dataclasses.dataclass(frozen=True)
class Aggregates:
    """Totals of a run so far (checkpointed with the state, so a resumed run continues them).

    ``final_loss`` is the last step's loss (nan/inf after a divergence); ``running_min`` the least
    finite loss (for ``divergence_k``); ``underflow_sum`` the sum of the underflow meter.
    """

    diverged: bool = False
    divergence_step: int | None = None
    running_min: float = math.inf
    skipped_steps: int = 0
    min_loss_scale: float = math.inf
    max_loss_scale: float = -math.inf
    underflow_sum: float = 0.0
    final_loss: float = math.nan
    evals: tuple[dict[str, Any], ...] = ()
    recipe_metrics: dict[str, dict[str, float]] | None = None
    recipe_probes: int = 0

    def update(self, step: int, rec: dict[str, Any], divergence_k: float | None) -> Aggregates:
        """The totals after step ``step`` (1-based) recorded as ``rec``. Pure."""
        loss = rec["loss"]
        bad = not math.isfinite(loss) or (
            divergence_k is not None
            and math.isfinite(self.running_min)
            and loss > divergence_k * self.running_min
        )
        newly = bad and not self.diverged
        return dataclasses.replace(
            self,
            diverged=self.diverged or bad,
            divergence_step=step if newly else self.divergence_step,
            running_min=min(self.running_min, loss) if math.isfinite(loss) else self.running_min,
            skipped_steps=self.skipped_steps + int(rec["skipped"]),
            min_loss_scale=min(self.min_loss_scale, rec["loss_scale"]),
            max_loss_scale=max(self.max_loss_scale, rec["loss_scale"]),
            underflow_sum=self.underflow_sum + rec["underflow_fraction"],
            final_loss=loss,
        )

    def with_recipe_metrics(self, m: dict[str, dict[str, float]]) -> Aggregates:
        """Fold one histogram step's recipe metrics in: means of the fractions and SQNR,
        extremes of the scale range. Pure."""
        n, old = self.recipe_probes, self.recipe_metrics or {}
        out: dict[str, dict[str, float]] = {}
        for group, stats in m.items():
            prev = old.get(group)
            if prev is None:
                out[group] = dict(stats)
                continue
            out[group] = {k: (prev[k] * n + v) / (n + 1) for k, v in stats.items()}
            out[group]["log2_scale_min"] = min(prev["log2_scale_min"], stats["log2_scale_min"])
            out[group]["log2_scale_max"] = max(prev["log2_scale_max"], stats["log2_scale_max"])
        return dataclasses.replace(self, recipe_metrics=out, recipe_probes=n + 1)

    def with_eval(self, step: int, ev: dict[str, float]) -> Aggregates:
        return dataclasses.replace(self, evals=(*self.evals, {"step": step, **ev}))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["evals"] = list(self.evals)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Aggregates:
        """Inverse of :meth:`to_dict`, also after a JSON round trip (non-finite floats are
        stored as strings, see :mod:`precisionlab._io`)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in data.items() if k in names}
        for key in ("running_min", "min_loss_scale", "max_loss_scale", "final_loss"):
            if key in kw:
                kw[key] = from_json_float(kw[key])
        if kw.get("recipe_metrics"):
            kw["recipe_metrics"] = {
                g: {k: from_json_float(v) for k, v in st.items()}
                for g, st in kw["recipe_metrics"].items()
            }
        kw["evals"] = tuple(
            {k: v if k == "step" else from_json_float(v) for k, v in ev.items()}
            for ev in kw.get("evals", ())
        )
        return cls(**kw)
