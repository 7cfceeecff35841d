"""``diagnose --bisect``: the smallest set of layers whose return to high precision makes a
failing variant pass.

A run of the failing variant with layers ``S`` returned to high precision
(``TrainConfig.high_precision_layers``) *passes* when its final loss (the mean training loss
of its last ``tail`` steps; infinite when the run diverged) is at most the passing variant's
plus ``tolerance``. The search first halves the candidates as if one layer were the culprit
(keep the half that passes, else the other), then runs the last candidate alone unless that
run was already made: at most ``ceil(log2 L) + 1`` runs for a single culprit among ``L``
layers. If the candidate does not pass alone (several layers interact), it runs all
candidates, and when they pass, drops layers one at a time while the run still passes (a
1-minimal set). The two reference runs (the variants as they are) come first and are
counted separately.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from precisionlab.diagnose._options import check_counts
from precisionlab.diagnose._variants import with_layers_high
from precisionlab.experiments._config import Unit
from precisionlab.train import TrainConfig, build, train_loop
from precisionlab.train._models import layer_names, resolve_layers

__all__ = [
    "BisectOptions",
    "BisectResult",
    "BisectRun",
    "bisect",
    "final_loss",
    "run_budget",
    "search",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BisectOptions:
    """tolerance: a run passes when its final loss <= the passing variant's + tolerance (>= 0).
    tail: steps averaged into the final loss (>= 1). layers: glob patterns of the candidate
    layers (empty: every layer). steps: steps per run (None: the variants')."""

    tolerance: float = 0.05
    tail: int = 10
    layers: tuple[str, ...] = ()
    steps: int | None = None

    def __post_init__(self) -> None:
        t = self.tolerance
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < math.inf:
            raise ValueError(f"tolerance must be a number >= 0, got {t!r}")
        check_counts(self, counts=("tail",), optional=("steps",))
        object.__setattr__(self, "layers", tuple(self.layers))


@dataclasses.dataclass(frozen=True)
class BisectRun:
    """One run: ``label`` (``"reference"`` or ``"search"``), the variant, the layers in high
    precision, its final loss and whether it passed."""

    label: str
    variant: str
    layers: tuple[str, ...]
    loss: float
    passed: bool


@dataclasses.dataclass(kw_only=True)
class SearchRuns:
    """What every bisection's result (over a run's layers or a function's operations) holds:
    the candidates, every run (references first), the answer (None: no set of the candidates
    passes) and the run ``budget`` (:func:`run_budget` of the candidates)."""

    candidates: tuple[str, ...]
    runs: list[BisectRun]
    answer: tuple[str, ...] | None
    budget: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.budget = run_budget(len(self.candidates))

    @property
    def search_runs(self) -> int:
        """The runs of the search proper."""
        return sum(r.label == "search" for r in self.runs)


@dataclasses.dataclass
class BisectResult(SearchRuns):
    """The search over a run's layers: the variants, the reference loss and the pass
    threshold, with :class:`SearchRuns`' fields (candidate layers; ``budget`` =
    ceil(log2 L) + 1)."""

    fail: str
    passing: str
    reference_loss: float
    threshold: float


def run_budget(n_layers: int) -> int:
    """ceil(log2 L) + 1: the runs the search needs for one culprit among ``L`` layers."""
    return math.ceil(math.log2(max(n_layers, 1))) + 1


def final_loss(config: TrainConfig, tail: int) -> float:
    """Train ``config`` (no evaluation, histograms or checkpoints) and return the mean loss of
    its last ``tail`` steps; inf when it diverged or a loss was not finite."""
    cfg = dataclasses.replace(
        config, hist_interval=0, checkpoint_interval=0, shadow=False, progress=False
    )
    setup = build(cfg)
    result = train_loop(
        setup.loss_fn,
        setup.params,
        setup.optimizer,
        lambda start: setup.data.batches(cfg.batch_size, seed=cfg.seed, start=start),
        options=setup.options,
        loop=dataclasses.replace(setup.loop, progress=False),
    )
    losses = np.asarray([m["loss"] for m in result.metrics], np.float64)
    if result.diverged or losses.size == 0 or not np.isfinite(losses).all():
        return math.inf
    return float(losses[-tail:].mean())


def bisect(
    fail: Unit,
    passing: Unit,
    options: BisectOptions = BisectOptions(),
    *,
    say: Callable[[str], None] = lambda _m: None,
    runner: Callable[[TrainConfig, int], float] = final_loss,
) -> BisectResult:
    """Find the smallest set of layers of ``fail`` whose return to high precision makes it
    pass (see the module docstring). ``runner(config, tail) -> final loss`` trains one run."""
    changes = {} if options.steps is None else {"steps": options.steps}
    cfg_fail = dataclasses.replace(fail.config, **changes)
    cfg_pass = dataclasses.replace(passing.config, **changes)
    names = layer_names(cfg_fail.model, cfg_fail.model_kwargs)
    cands = resolve_layers(options.layers, names, "--layers pattern") if options.layers else names
    runs: list[BisectRun] = []

    def record(label: str, unit: Unit, layers: Sequence[str], loss: float, ok: bool) -> None:
        runs.append(BisectRun(label, unit.name, tuple(layers), loss, ok))
        hp = ", ".join(layers) if layers else "none"
        n = sum(r.label == label for r in runs)
        say(
            f"{label} run {n}: {unit.name} with layers in high precision: {hp} -> final loss "
            f"{loss:.4g}: {'pass' if ok else 'fail'}"
        )

    ref = runner(cfg_pass, options.tail)
    if not math.isfinite(ref):
        raise ValueError(f"the passing variant {passing.name!r} diverged: nothing to compare to")
    threshold = ref + options.tolerance
    record("reference", passing, (), ref, True)

    def passes(loss: float) -> bool:
        return math.isfinite(loss) and loss <= threshold

    base = runner(cfg_fail, options.tail)
    record("reference", fail, (), base, passes(base))

    def test(layers: Sequence[str]) -> bool:
        loss = runner(with_layers_high(cfg_fail, layers), options.tail)
        record("search", fail, layers, loss, passes(loss))
        return passes(loss)

    answer = () if passes(base) else search(cands, test)
    return BisectResult(
        fail.name, passing.name, ref, threshold, candidates=cands, runs=runs, answer=answer
    )


def search(cands: Sequence[str], test: Callable[[Sequence[str]], bool]) -> tuple[str, ...] | None:
    """The search of :func:`bisect` over ``cands`` (names, in order), ``test(names) -> passes``
    (each distinct set is tested once: memoize in ``test`` if runs are dear): halve as if one
    candidate were the culprit (keep the half that passes, else the other), test the last
    one alone; if it does not pass, test all, then drop candidates one at a time while the
    rest passes (a 1-minimal set). None when not even all candidates pass."""
    tested: dict[tuple[str, ...], bool] = {}

    def once(names: Sequence[str]) -> bool:
        key = tuple(n for n in cands if n in names)
        if key not in tested:
            tested[key] = test(key)
        return tested[key]

    c = list(cands)
    while len(c) > 1:
        half = c[: len(c) // 2]
        c = half if once(half) else c[len(half) :]
    if c and once(c):
        return tuple(c)
    if not once(cands):
        return None
    keep = list(cands)
    for name in cands:
        trial = [n for n in keep if n != name]
        if trial and once(trial):
            keep = trial
    return tuple(keep)
