"""Record chosen steps of a training loop: a :class:`~precisionlab.train._hooks.Hook`.

Before a chosen step runs, the hook records that step's loss and gradients from the state
and batch the loop hands it (``before_step``), under the step's own recipe, key, loss scale
and compute-dtype casts: :func:`precisionlab.verify.record` of the function the train step
differentiates. The recording is a program of its own; after the step, the hook compares
its loss with the loop's (``on_step``) and writes both into the manifest (``loop_loss``),
so a recording that did not reproduce its step says so.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from precisionlab import _io
from precisionlab.train import build
from precisionlab.train._hooks import StepEnd
from precisionlab.train._step import (
    StepOptions,
    cast_compute,
    normalize_loss_fn,
    recipe_key,
    weighted_loss,
)
from precisionlab.verify._record import DEFAULT_MAX_BYTES, record

__all__ = ["RecordHook", "parse_steps"]


def parse_steps(steps: Iterable[int] | str) -> tuple[int, ...]:
    """Step numbers (1-based) from ints or a text ``"1,100"``; ValueError naming a bad one."""
    items = steps.split(",") if isinstance(steps, str) else list(steps)
    out = []
    for item in items:
        text = str(item).strip()
        try:
            n = int(text)
        except ValueError:
            raise ValueError(f"record steps are step numbers >= 1, got {text!r}") from None
        if isinstance(item, bool) or n < 1:
            raise ValueError(f"record steps are step numbers >= 1, got {text!r}")
        out.append(n)
    if not out:
        raise ValueError("no step to record: give step numbers such as 1,100")
    return tuple(sorted(set(out)))


class RecordHook:
    """Records steps ``steps`` (1-based) of a training loop into ``out/step_NNNNNN``.

    ``loss_fn`` and ``options``: the loop's (``train_loop``'s ``loss_fn`` and
    :class:`~precisionlab.train._step.StepOptions`); :meth:`RecordHook.for_config` takes them from a
    ``TrainConfig``. The loop must start a compiled call at each chosen step
    (``chunk_steps=1`` does; a step that ran inside a call raises ValueError after it).
    ``sites``, ``hardware``, ``max_bytes``, ``gemm``: as :func:`~precisionlab.verify.record`.
    Micro-batched and data-parallel steps are refused (one recorded program runs one batch on
    one device).
    """

    def __init__(
        self,
        out: str | os.PathLike,
        steps: Iterable[int] | str,
        *,
        loss_fn: Any,
        options: StepOptions,
        sites: Any = None,
        hardware: str | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        gemm: str = "recipe",
    ) -> None:
        if options.microbatches != 1 or options.data_parallel:
            raise ValueError(
                "recording a step needs microbatches = 1 and no data parallelism (one batch on "
                f"one device); got microbatches={options.microbatches}, data_parallel="
                f"{options.data_parallel}"
            )
        self.out = Path(out)
        self.steps = parse_steps(steps)
        self.loss_fn, self.options = loss_fn, options
        self.sites, self.hardware, self.max_bytes, self.gemm = sites, hardware, max_bytes, gemm
        self.recorded: dict[int, tuple[Path, float]] = {}
        self._loss_weight = 1.0
        self._start: int | None = None  # the steps done when this loop (or resume) began
        self._warned = False

    @classmethod
    def for_config(cls, config: Any, out: str | os.PathLike, steps: Iterable[int] | str,
                   **kwargs: Any) -> RecordHook:  # fmt: skip
        """A hook for ``precisionlab.train.train(config, hooks=[...])`` (its loss function
        and step options built from ``config``; run it with ``chunk_steps=1``)."""
        late = [s for s in parse_steps(steps) if s > config.steps]
        if late:
            raise ValueError(f"record step {late[0]}: the run has {config.steps} steps")
        setup = build(config)
        return cls(out, steps, loss_fn=setup.loss_fn, options=setup.options, **kwargs)

    def path(self, step: int) -> Path:
        """The dump directory of step ``step``."""
        return self.out / f"step_{step:06d}"

    def before_step(self, step: int, state: Any, batch: Any) -> None:
        if self._start is None:
            self._start = step
        n = step + 1
        if n not in self.steps or n in self.recorded:
            return
        if (self.path(n) / "manifest.json").exists():  # a resumed run recorded it before
            return
        opts = self.options
        values = state.values
        self._loss_weight = float((values or {}).get("loss_weight", 1.0))
        f = normalize_loss_fn(weighted_loss(self.loss_fn, values))

        def scaled(p: Any, b: Any, ls: Any) -> Any:  # what the train step differentiates
            loss, aux = f(p, b)
            return ls.scale(loss), (loss, aux)

        pc = cast_compute(state.params, opts.policy.compute_dtype, opts.fp32_params)
        kw: dict[str, Any] = {}
        if opts.recipe is not None:
            rec = opts.recipe.for_values(values)
            kw = dict(recipe=rec.recipe, include=rec.include, exclude=rec.exclude,
                      attention=rec.attention, state=state.recipe_state,
                      key=recipe_key(state.rng), gemm=self.gemm)  # fmt: skip
        rec_out = record(
            scaled, pc, batch, state.loss_scale, out=self.path(n), has_aux=True,
            sites=self.sites, hardware=self.hardware, max_bytes=self.max_bytes,
            note=f"step {n} of a training loop", **kw,
        )  # fmt: skip
        loss = float(rec_out.value[0][1][0])
        self.recorded[n] = (rec_out.path, loss)

    def on_step(self, end: StepEnd) -> None:
        start = self._start or 0
        missed = [s for s in self.steps if s <= end.step and s not in self.recorded
                  and not (self.path(s) / "manifest.json").exists()]  # fmt: skip
        before = [s for s in missed if s <= start]
        if before and not self._warned:  # a resumed run: those steps ran in an earlier run
            self._warned = True
            warnings.warn(f"steps {before} ran before this run resumed at step {start} and "
                          "were not recorded then", stacklevel=2)  # fmt: skip
        missed = [s for s in missed if s > start]
        if missed:
            raise ValueError(
                f"step {missed[0]} ran inside a compiled call of several steps, so it was not "
                "recorded: record with chunk_steps = 1"
            )
        if end.step in self.recorded:
            path, loss = self.recorded[end.step]
            ours = loss / self._loss_weight if self._loss_weight != 1 else loss
            theirs = end.record.get("loss")
            same = theirs is not None and float(theirs) == ours
            manifest = _io.read_json(path / "manifest.json")
            manifest["loop_loss"] = theirs
            manifest["loop_loss_matches"] = bool(same)
            _io.write_json(path / "manifest.json", manifest, indent=1)
            if not same:
                warnings.warn(
                    f"the recording of step {end.step} computed loss {ours!r}, the loop "
                    f"{theirs!r}: the recorded program differs from the train step there",
                    stacklevel=2,
                )

    def close(self) -> None:
        pass
