"""``digits``: scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes).

Needs the optional ``data`` extra (``pip install -e ".[data]"``: scikit-learn, whose package
ships the images, so nothing is downloaded). Pixels are integers 0..16; ``x = pixels / 16 *
input_scale`` flattened row-major to ``float32[B, 64]`` (an 8x8 image, one channel), ``y`` the
digit ``int32[B]``: the same batch layout as ``teacher``, so the MLP and the conv model read it.

The split is fixed and independent of the run's seed: a permutation of the 1,797 images drawn
from ``split_seed`` (default 0); the last ``eval_size`` (default 297) are the eval set, the
remaining 1,500 the train set. :meth:`DigitsData.describe` records the sizes and a hash of the
eval indices and of the images. Train batches sample train images with replacement at seeded
random positions (a pure function of ``(seed, step, batch_size)``); eval batch ``i`` holds eval
images ``i * B .. (i + 1) * B - 1`` (cycling), so ``eval_batches`` with ``n * B >= 297`` covers
the eval set (a few images twice).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any

import numpy as np

from precisionlab._schema import check_float, check_int
from precisionlab.train._data.base import MAX_INPUT_SCALE, Dataset, split_rng

__all__ = ["DigitsData", "MissingExtraError", "load_digits_arrays"]

_N_IMAGES = 1797


class MissingExtraError(ModuleNotFoundError, ValueError):
    """An optional dependency is not installed. A ModuleNotFoundError (what it is) and a
    ValueError (a config naming this dataset is unusable here), so config validation and the
    CLI report it in one line like any other bad value."""


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8[1797, 8, 8] in 0..16, labels int32[1797])`` from scikit-learn.

    Raises :class:`MissingExtraError` (a ModuleNotFoundError) with the install command when
    scikit-learn is missing."""
    try:
        from sklearn.datasets import load_digits
    except ModuleNotFoundError as err:
        raise MissingExtraError(
            "dataset 'digits' needs scikit-learn (it ships the 8x8 digits images): "
            'pip install -e ".[data]" or pip install "scikit-learn>=1.3"',
            name=err.name,
        ) from err
    bunch = load_digits()
    return bunch.images.astype(np.uint8), bunch.target.astype(np.int32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DigitsData(Dataset):
    """8x8 digits classification (see module docstring)."""

    input_scale: float = 1.0
    eval_size: int = 297
    split_seed: int = 0

    name = "digits"
    kind = "classification"
    chance = 0.1
    image_shape = (8, 8, 1)

    def __post_init__(self) -> None:
        check_float("input_scale", self.input_scale, 1e-30, MAX_INPUT_SCALE)
        check_int("eval_size", self.eval_size, 1)
        if self.eval_size > _N_IMAGES - 100:
            raise ValueError(
                f"eval_size must be an int in [1, {_N_IMAGES - 100}] (at least 100 images left "
                f"to train on), got {self.eval_size!r}"
            )
        check_int("split_seed", self.split_seed, 0)
        _ = self._loaded  # read now: a missing extra or a bad file fails here

    @functools.cached_property
    def _loaded(self) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, Any]]:
        """(split -> (images, labels), the record :meth:`describe` adds)."""
        images, labels = load_digits_arrays()
        order = np.random.default_rng([self.split_seed, 8008]).permutation(len(labels))
        eval_idx, train_idx = order[-self.eval_size :], order[: -self.eval_size]
        x = images.reshape(len(labels), -1).astype(np.float32) / np.float32(16.0)
        x = x * np.float32(self.input_scale)
        info = {
            "name": self.name,
            "source": "sklearn.datasets.load_digits",
            "images": len(labels),
            "image_shape": list(self.image_shape),
            "train_size": int(train_idx.size),
            "eval_size": int(eval_idx.size),
            "split_seed": self.split_seed,
            "eval_indices_sha256": hashlib.sha256(
                np.sort(eval_idx).astype("<i4").tobytes()
            ).hexdigest(),
            "sha256": hashlib.sha256(images.tobytes() + labels.astype("<i4").tobytes()).hexdigest(),
        }
        arrays = {
            "train": (x[train_idx], labels[train_idx]),
            "eval": (x[eval_idx], labels[eval_idx]),
        }
        return arrays, info

    def describe(self) -> dict[str, Any]:
        """JSON-able record of the options and ``source``, ``images``, ``image_shape``,
        ``train_size``, ``eval_size``, ``split_seed``, ``eval_indices_sha256``, ``sha256``
        (images and labels)."""
        return {
            **super().describe(),
            **{k: list(v) if isinstance(v, list) else v for k, v in self._loaded[1].items()},
        }

    def batch(
        self, step: int, batch_size: int, *, seed: int = 0, split: str = "train"
    ) -> dict[str, np.ndarray]:
        g = split_rng(seed, split, step)  # also checks the split name
        x, y = self._loaded[0][split]
        if split == "train":
            idx = g.integers(0, y.size, size=batch_size)
        else:
            idx = (int(step) * batch_size + np.arange(batch_size)) % y.size
        return {"x": x[idx], "y": y[idx]}

    def model_kwargs(self) -> dict[str, Any]:
        return {"in_dim": 64, "num_classes": 10}
