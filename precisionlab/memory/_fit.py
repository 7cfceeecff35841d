"""Does a training setup fit a memory budget, and if not, what is the smallest change that does?

Changes are tried from the mildest to the strongest, one at a time, then combined:

1. activation checkpointing every K layers (costs about one extra forward pass);
2. gradient accumulation over M micro-batches (same result, more sequential steps);
3. ZeRO sharding over the data-parallel devices already there (stage 1, 2, 3; communication);
4. lower-precision state: bfloat16 optimizer moments, then bfloat16 gradients (numerics).

If nothing fits on the devices given, the data-parallel degree that ZeRO-3 needs (with
checkpointing and micro-batches, precision unchanged) is searched.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from precisionlab.memory._estimate import Breakdown, ModelSpec, TrainSetup, estimate

__all__ = ["FitResult", "fit"]


@dataclasses.dataclass(frozen=True)
class FitResult:
    """The answer of :func:`fit`.

    Attributes:
      budget: bytes per device.
      fits: whether the setup as given fits.
      breakdown: its breakdown.
      changes: the changes found (empty if it fits as given, or if nothing was found).
      setup: the changed setup (None if nothing fits).
      changed: the changed setup's breakdown (None if nothing fits).
    """

    budget: int
    fits: bool
    breakdown: Breakdown
    changes: tuple[str, ...]
    setup: TrainSetup | None
    changed: Breakdown | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget": self.budget,
            "fits": self.fits,
            "total": self.breakdown.total,
            "changes": list(self.changes),
            "changed_total": None if self.changed is None else self.changed.total,
            "changed_setup": None if self.setup is None else _setup_dict(self.setup),
        }


def _setup_dict(setup: TrainSetup) -> dict[str, Any]:
    out = {}
    for field in dataclasses.fields(setup):
        value = getattr(setup, field.name)
        out[field.name] = str(value) if value is not None else None
    return out


def _divisors(n: int, most: int = 64) -> list[int]:
    """Divisors of ``n`` above 1, ascending: the ``most`` smallest and ``n`` itself. Trial
    division up to sqrt(n) (n <= 2^40 is checked by TrainSetup, so at most 2^20 steps)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    found = [m for m in small + large[::-1] if m > 1]
    return found if len(found) <= most else [*found[: most - 1], n]


def _options(model: ModelSpec, setup: TrainSetup) -> list[list[tuple[str, dict[str, Any]]]]:
    """Per kind of change, its candidate values from mildest to strongest."""
    kinds: list[list[tuple[str, dict[str, Any]]]] = []
    if setup.checkpoint_every is None:
        ks = sorted(
            range(1, model.n_layers + 1),
            key=lambda k: (
                estimate(model, dataclasses.replace(setup, checkpoint_every=k)).total,
                -k,
            ),
        )
        plural = "s" if ks[0] > 1 else ""
        kinds.append([(f"checkpoint every {ks[0]} layer{plural}", {"checkpoint_every": ks[0]})])
    divisors = _divisors(setup.batch)
    if setup.microbatches == 1 and divisors:
        kinds.append([(f"{m} micro-batches", {"microbatches": m}) for m in divisors])
    if setup.dp > 1:
        kinds.append(
            [
                (f"ZeRO stage {s} over dp={setup.dp}", {"zero_stage": s})
                for s in (1, 2, 3)
                if s > setup.zero_stage
            ]
        )
    bf16 = "bfloat16"
    precision = []
    if setup.state_dtype.itemsize > 2:
        precision.append(("bfloat16 optimizer state", {"opt_dtype": bf16}))
    if setup.gradient_dtype.itemsize > 2:
        precision.append(
            ("bfloat16 optimizer state and gradients", {"opt_dtype": bf16, "grad_dtype": bf16})
        )
    if precision:
        kinds.append(precision)
    return [kind for kind in kinds if kind]


def fit(model: ModelSpec, setup: TrainSetup, budget: int) -> FitResult:
    """Check ``setup`` against ``budget`` bytes per device and search the smallest change.

    Single changes are tried first (in the order of the module docstring, each kind's values
    from mildest to strongest); then pairs, then all kinds together; then, if still too big,
    ZeRO-3 with the smallest data-parallel degree that fits.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"budget must be a positive number of bytes, got {budget!r}")
    base = estimate(model, setup)
    if base.total <= budget:
        return FitResult(budget, True, base, (), setup, base)
    kinds = _options(model, setup)
    for size in range(1, len(kinds) + 1):
        for combo in itertools.combinations(kinds, size):
            for choice in itertools.product(*combo):
                kw: dict[str, Any] = {}
                for _, change in choice:
                    kw.update(change)
                trial = dataclasses.replace(setup, **kw)
                got = estimate(model, trial)
                if got.total <= budget:
                    return FitResult(
                        budget, False, base, tuple(name for name, _ in choice), trial, got
                    )
    # Checkpointing and micro-batches at their strongest (precision kept), then shard over more
    # devices.
    kw = {}
    names = []
    for kind in kinds:
        if not {"checkpoint_every", "microbatches"} & set(kind[-1][1]):
            continue
        names.append(kind[-1][0])
        kw.update(kind[-1][1])
    strongest = dataclasses.replace(setup, **kw)
    if estimate(model, dataclasses.replace(strongest, zero_stage=3, dp=2**40)).total > budget:
        return FitResult(budget, False, base, (), None, None)
    lo, hi = max(setup.dp, 1), 1
    while estimate(model, dataclasses.replace(strongest, zero_stage=3, dp=hi)).total > budget:
        lo, hi = hi, hi * 2
    while lo < hi:  # smallest dp that fits, by bisection
        mid = (lo + hi) // 2
        if estimate(model, dataclasses.replace(strongest, zero_stage=3, dp=mid)).total <= budget:
            hi = mid
        else:
            lo = mid + 1
    trial = dataclasses.replace(strongest, zero_stage=3, dp=hi)
    names.append(f"ZeRO stage 3 over dp={hi} devices")
    return FitResult(budget, False, base, tuple(names), trial, estimate(model, trial))
