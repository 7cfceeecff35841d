"""The state of one check of a dump: the dump, its recipe and the verdicts so far (shared by
the checker and the mechanism labels, which :mod:`._check` imports)."""

from __future__ import annotations

import dataclasses

import numpy as np

from precisionlab import recipes
from precisionlab.verify._format import Dump, Tensor
from precisionlab.verify._report import TensorCheck

__all__ = ["CheckContext"]


@dataclasses.dataclass
class CheckContext:
    """One check: the ``dump``, its ``recipe`` (None for plain GEMMs), the weight operand,
    the hardware model, the notes and the verdict per tensor name (``results``)."""

    dump: Dump
    recipe: recipes.Recipe | None
    weight: str
    hardware: str | None
    notes: list[str]
    diagnosed: bool = False  # the first difference got its full diagnosis
    results: dict[str, TensorCheck] = dataclasses.field(default_factory=dict)

    def arr(self, t: Tensor) -> np.ndarray:
        """The recorded array of ``t``."""
        return self.dump.arrays[t.name]

    def add(self, c: TensorCheck) -> None:
        """Keep the verdict ``c`` (one per tensor name)."""
        self.results[c.name] = c

    def full(self) -> bool:
        """Whether this difference gets the full (costly) diagnosis: the first one only."""
        if self.diagnosed:
            return False
        self.diagnosed = True
        return True
