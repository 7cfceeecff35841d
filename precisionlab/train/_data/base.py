"""The dataset interface shared by the built-in datasets (generated and real).

A batch is a pure function of ``(seed, split, step, batch_size)`` (:func:`split_rng`), so a run's
data order is reproducible and resumable from the step count alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["SPLITS", "Dataset", "split_rng"]

SPLITS: dict[str, int] = {"train": 0, "eval": 1}


def split_rng(seed: int, split: str, step: int) -> np.random.Generator:
    """The generator of batch ``step`` of ``split`` under ``seed`` (ValueError: unknown split)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, SPLITS[split], int(step)])


class Dataset:
    """Base class: ``batch(step, batch_size, *, seed, split)`` is deterministic."""

    name: str = ""
    kind: str = ""  # "classification" or "lm"
    chance: float = 0.0

    def batch(
        self, step: int, batch_size: int, *, seed: int = 0, split: str = "train"
    ) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def batches(
        self, batch_size: int, *, seed: int = 0, start: int = 0, split: str = "train"
    ) -> Iterator[dict[str, np.ndarray]]:
        """Infinite iterator of batches ``start, start + 1, ...``."""
        step = start
        while True:
            yield self.batch(step, batch_size, seed=seed, split=split)
            step += 1

    def eval_batches(
        self, n: int, batch_size: int, *, seed: int = 0
    ) -> list[dict[str, np.ndarray]]:
        """``n`` held-out batches (split "eval"), the same for every run with this seed."""
        return [self.batch(i, batch_size, seed=seed, split="eval") for i in range(n)]

    def describe(self) -> dict[str, Any]:
        """JSON-able record of what the data is, for a run store: ``name`` and the options
        (real datasets add what they read: file list, byte counts, content hashes)."""
        out: dict[str, Any] = {"name": self.name}
        if dataclasses.is_dataclass(self):
            out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        return out

    def model_kwargs(self) -> dict[str, Any]:
        """Sizes a model needs to read this data (e.g. ``in_dim``, ``num_classes``)."""
        raise NotImplementedError


#: Largest ``input_scale`` of the generated data sets: |x| reaches a few units times it, and
#: the data is float32 (max 3.4e38): past this it would be inf, not data.
MAX_INPUT_SCALE = 1e30
