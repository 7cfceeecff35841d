"""What runs around a training step: the :class:`Hook` protocol, the :class:`StepEnd` a hook
sees, and the built-in hooks (callback, checkpoints, progress bar)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from tqdm.auto import tqdm

from precisionlab.train._aggregates import Aggregates
from precisionlab.train._checkpoint import save_checkpoint
from precisionlab.train._step import (
    TrainState,
)

__all__ = ["CallbackHook", "CheckpointHook", "Hook", "ProgressHook", "StepEnd"]


@dataclasses.dataclass(frozen=True)
class StepEnd:
    """What a hook sees after each step: ``record`` is the step's metrics dict (plain values).

    ``state`` is the state after this step when the step ends its compiled call (the loop runs
    several steps per call, see ``LoopOptions.chunk_steps``): always at checkpoint, evaluation
    and probe boundaries and after the last step; None for the steps inside a call (set
    ``chunk_steps=1`` for a hook that reads every step's state)."""

    step: int
    steps: int
    record: dict[str, Any]
    state: TrainState | None
    aggregates: Aggregates
    last: bool


class Hook(Protocol):
    """Something done after each step (``on_step``) and when the loop ends (``close``).

    A hook may also define ``before_step(step, state, batch)``: called before each compiled
    call with the steps done, the state the call starts from and its first batch (every
    step's with ``chunk_steps=1``), e.g. to record that step (``precisionlab.verify``)."""

    def on_step(self, end: StepEnd) -> None: ...

    def close(self) -> None: ...


class CallbackHook:
    """Calls ``callback(record)`` after each step."""

    def __init__(self, callback: Callable[[dict[str, Any]], None]) -> None:
        self.callback = callback

    def on_step(self, end: StepEnd) -> None:
        self.callback(end.record)

    def close(self) -> None:
        pass


class CheckpointHook:
    """Saves the state and the aggregates every ``interval`` steps and after the last one."""

    def __init__(self, directory: Any, interval: int) -> None:
        self.directory, self.interval = directory, interval

    def on_step(self, end: StepEnd) -> None:
        if (self.interval and end.step % self.interval == 0) or end.last:
            extra = {"aggregates": end.aggregates.to_dict()}
            save_checkpoint(self.directory, end.state, step=end.step, extra=extra)

    def close(self) -> None:
        pass


class ProgressHook:
    """A tqdm bar on stderr with the loss and the loss scale.

    ``bar`` may be shared by several runs (the experiment runner passes one bar for all its
    variants, so its ETA is the whole run's): a run that stops early advances it by the steps
    it did not do.
    """

    def __init__(self, bar: Any, *, own: bool = True) -> None:
        self.bar, self.own = bar, own
        self.remaining = 0

    @classmethod
    def for_run(cls, total: int, initial: int, desc: str | None) -> ProgressHook:
        return cls(tqdm(total=total, initial=initial, desc=desc, leave=False, dynamic_ncols=True))

    def on_step(self, end: StepEnd) -> None:
        self.bar.update(1)
        self.remaining = end.steps - end.step
        loss, scale = end.record["loss"], end.record["loss_scale"]
        self.bar.set_postfix(loss=f"{loss:.4g}", scale=f"{scale:.3g}")

    def close(self) -> None:
        if self.own:
            self.bar.close()
        elif self.remaining:
            self.bar.update(self.remaining)
