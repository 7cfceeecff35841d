"""Generated datasets with learnable structure (no downloads): ``teacher`` (classification) and
``markov`` (language modelling); see :mod:`precisionlab.train._data`."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from precisionlab._schema import check_fits, check_float, check_int
from precisionlab.train._data.base import MAX_INPUT_SCALE, Dataset
from precisionlab.train._data.base import split_rng as _rng

__all__ = ["MAX_MARKOV_VOCAB", "MarkovData", "TeacherData"]

#: Inputs in the sample that centres the teacher's logits.
PROBE = 4096
#: Largest Markov vocabulary: the order-2 table holds one row per pair of tokens, each drawn on
#: its own, so making it takes time growing as vocab_size^2 (512^2 rows: 1.7 s on one core of
#: the 2-core AMD EPYC VM, measured 2026-11-29).
MAX_MARKOV_VOCAB = 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class TeacherData(Dataset):
    """Teacher-network classification (see module docstring)."""

    in_dim: int = 32
    num_classes: int = 10
    teacher_width: int = 64
    input_scale: float = 1.0
    label_noise: float = 0.0
    task_seed: int = 0

    name = "teacher"
    kind = "classification"

    def __post_init__(self) -> None:
        check_int("in_dim", self.in_dim, 1)
        check_int("num_classes", self.num_classes, 2)
        check_int("teacher_width", self.teacher_width, 1)
        check_float("input_scale", self.input_scale, 1e-30, MAX_INPUT_SCALE)
        check_float("label_noise", self.label_noise, 0.0, 1.0)
        check_int("task_seed", self.task_seed, 0)
        # the teacher's weights and its probe sample in float64: a lower bound of what drawing
        # them holds at once (the probe's products add more), so data that fits is never refused
        d, w, c = self.in_dim, self.teacher_width, self.num_classes
        need = 8 * (d * w + w * c + PROBE * (d + w + c))
        check_fits(f"teacher data (in_dim {d}, teacher_width {w})", need, "in float64")
        _ = self._teacher  # drawn now, as the options are checked

    @functools.cached_property
    def _teacher(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The teacher's two weight matrices and the centre of its logits."""
        g = np.random.default_rng([self.task_seed, 12345])
        w1 = g.normal(size=(self.in_dim, self.teacher_width)) / np.sqrt(self.in_dim)
        w2 = g.normal(size=(self.teacher_width, self.num_classes)) / np.sqrt(self.teacher_width)
        # Balance the classes: centre the logits over a large probe sample.
        probe = g.normal(size=(PROBE, self.in_dim))
        centre = (np.tanh(probe @ w1 * 2.0) @ w2).mean(axis=0)
        return w1, w2, centre

    @property
    def chance(self) -> float:  # type: ignore[override]
        return 1.0 / self.num_classes

    def batch(
        self, step: int, batch_size: int, *, seed: int = 0, split: str = "train"
    ) -> dict[str, np.ndarray]:
        g = _rng(seed, split, step)
        z = g.normal(size=(batch_size, self.in_dim))
        w1, w2, centre = self._teacher
        y = np.argmax(np.tanh(z @ w1 * 2.0) @ w2 - centre, axis=-1)
        if self.label_noise:
            flip = g.random(batch_size) < self.label_noise
            y = np.where(flip, g.integers(0, self.num_classes, batch_size), y)
        return {"x": (z * self.input_scale).astype(np.float32), "y": y.astype(np.int32)}

    def model_kwargs(self) -> dict[str, Any]:
        return {"in_dim": self.in_dim, "num_classes": self.num_classes}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MarkovData(Dataset):
    """Order-2 Markov language (see module docstring)."""

    vocab_size: int = 32
    seq_len: int = 64
    branching: int = 2
    concentration: float = 0.5
    task_seed: int = 0

    name = "markov"
    kind = "lm"

    def __post_init__(self) -> None:
        why = "the order-2 table has a row for each pair of tokens, drawn one by one"
        check_int("vocab_size", self.vocab_size, 2, MAX_MARKOV_VOCAB, why)
        check_int("seq_len", self.seq_len, 2)
        check_int("branching", self.branching, 1)
        if self.branching > self.vocab_size:
            raise ValueError(f"branching {self.branching} > vocab_size {self.vocab_size}")
        check_float("concentration", self.concentration, 1e-6)
        check_int("task_seed", self.task_seed, 0)
        _ = self._table  # drawn now, as the options are checked

    @functools.cached_property
    def _table(self) -> tuple[np.ndarray, np.ndarray]:
        """Each pair of tokens' successors (int32) and the cumulative probabilities of them."""
        v, k = self.vocab_size, self.branching
        g = np.random.default_rng([self.task_seed, 54321])
        succ = np.stack([g.choice(v, size=k, replace=False) for _ in range(v * v)])
        probs = g.dirichlet(np.full(k, self.concentration), size=v * v)
        cdf = np.cumsum(probs, axis=-1)
        cdf[:, -1] = 1.0
        return succ.astype(np.int32), cdf

    @property
    def chance(self) -> float:  # type: ignore[override]
        return 1.0 / self.vocab_size

    def bayes_accuracy(self) -> float:
        """Expected accuracy of always predicting the most likely successor (upper bound, up to
        the first two tokens of each sequence)."""
        _, cdf = self._table
        probs = np.diff(np.concatenate([np.zeros((cdf.shape[0], 1)), cdf], axis=1), axis=1)
        return float(probs.max(axis=1).mean())

    def batch(
        self, step: int, batch_size: int, *, seed: int = 0, split: str = "train"
    ) -> dict[str, np.ndarray]:
        g = _rng(seed, split, step)
        v = self.vocab_size
        succ, cdf = self._table
        n = self.seq_len + 1
        tokens = np.empty((batch_size, n), np.int32)
        tokens[:, :2] = g.integers(0, v, size=(batch_size, 2))
        u = g.random((batch_size, n))
        rows = np.arange(batch_size)
        for t in range(2, n):
            ctx = tokens[:, t - 2] * v + tokens[:, t - 1]
            choice = (u[:, t, None] > cdf[ctx]).sum(axis=-1)
            tokens[:, t] = succ[ctx, np.minimum(choice, self.branching - 1)]
        del rows
        return {"tokens": tokens}

    def model_kwargs(self) -> dict[str, Any]:
        return {"vocab_size": self.vocab_size, "seq_len": self.seq_len}
