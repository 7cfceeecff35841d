"""The experiment kinds: the TOML top-level ``kind`` -> the module that runs it.

A kind other than ``train`` is a module exposing ``KIND``, ``validate(section, where) -> dict``
and ``run(section, out_dir, *, quiet=False) -> dict``; ``train`` is
:mod:`precisionlab.experiments._train_kind`. A plain dict of imported modules: every edge of the
import graph is visible.
"""

from __future__ import annotations

from types import ModuleType

from precisionlab import survey
from precisionlab.experiments import _mismatch_kind as mismatch_kind
from precisionlab.experiments import _tournament as tournament
from precisionlab.experiments import _train_kind as train_kind
from precisionlab.memory import _checkpointing as checkpointing_experiment
from precisionlab.memory import _experiment as memory_experiment

__all__ = ["KINDS", "load", "names_text"]

#: kind -> module implementing it.
KINDS: dict[str, ModuleType] = {
    "train": train_kind,
    "survey": survey,
    "memory": memory_experiment,
    "checkpointing": checkpointing_experiment,
    "mismatch": mismatch_kind,
    "tournament": tournament,
}


def names_text() -> str:
    return ", ".join(KINDS)


def load(kind: str) -> ModuleType:
    """The module of ``kind``; ValueError naming the allowed kinds if it is unknown."""
    if kind not in KINDS:
        raise ValueError(f"unknown experiment kind {kind!r}; allowed: {names_text()}")
    return KINDS[kind]
