"""The built-in datasets: generated ones with learnable structure (no downloads) and real ones.

Every batch is a pure function of ``(seed, split, step, batch_size)``, so a run's data order is
reproducible and resumable from the step count alone (that is what checkpoints store).

- ``teacher``: classification. ``x ~ N(0, I_D) * input_scale``, label = argmax of a fixed random
  two-layer tanh teacher network (fixed by ``task_seed``), with optional label noise.
  Batch ``{"x": float32[B, D], "y": int32[B]}``.
- ``markov``: language modelling. Token sequences from a fixed random order-2 Markov chain over
  ``vocab_size`` tokens in which every context has ``branching`` likely successors (fixed by
  ``task_seed``). Batch ``{"tokens": int32[B, seq_len + 1]}`` (inputs ``[:, :-1]``, targets
  ``[:, 1:]``).
- ``text`` (real text, :mod:`precisionlab.train._data.text`): bytes of the Python standard library's
  source or of user files, ``{"tokens": int32[B, seq_len + 1]}`` over 256 byte values.
- ``digits`` (real images, :mod:`precisionlab.train._data.digits`, needs scikit-learn): the 8x8
  digits, ``{"x": float32[B, 64], "y": int32[B]}``.
"""

from __future__ import annotations

from typing import Any

from precisionlab.train import _registry as registry
from precisionlab.train._data.base import SPLITS, Dataset
from precisionlab.train._data.digits import DigitsData
from precisionlab.train._data.synthetic import MarkovData, TeacherData
from precisionlab.train._data.text import TextData

__all__ = [
    "DATASETS",
    "SPLITS",
    "Dataset",
    "DigitsData",
    "MarkovData",
    "TeacherData",
    "TextData",
    "data_kind",
    "make_data",
]

#: The built-in datasets :func:`make_data` makes.
DATASETS: tuple[str, ...] = ("teacher", "markov", "text", "digits")

_BUILDERS: dict[str, type[Dataset]] = {
    "teacher": TeacherData,
    "markov": MarkovData,
    "text": TextData,
    "digits": DigitsData,
}


def data_kind(name: str) -> str:
    """``"classification"`` or ``"lm"``: the kind of data the dataset ``name`` gives."""
    return registry.lookup(_BUILDERS, name, "dataset").kind


def make_data(name: str, **kwargs: Any) -> Dataset:
    """Build a dataset by name (see :data:`DATASETS`); unknown options raise ValueError."""
    return registry.build(_BUILDERS, name, "dataset", kwargs)
