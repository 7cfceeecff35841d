"""The tiny train experiments the run-directory tests start from (a 2-layer, width-8 MLP on
the teacher data, batch 8), and a working directory holding them."""

from __future__ import annotations

from pathlib import Path

import pytest

ONE = """
kind = "train"
name = "tiny"
[train]
model = "mlp"
steps = 2
batch_size = 8
model_kwargs = { width = 8, depth = 2 }
[[variant]]
name = "a"
"""

TWO = """
kind = "train"
name = "tiny"
[train]
model = "mlp"
steps = {steps}
batch_size = 8
model_kwargs = {{ width = 8, depth = 2 }}
[[variant]]
name = "a"
[[variant]]
name = "b"
"""


def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, str]) -> Path:
    """``tmp_path`` as the working directory, without the debug switch, holding ``files``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PRECISIONLAB_DEBUG", raising=False)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def one_variant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tiny.toml: one variant, 2 steps."""
    return workdir(tmp_path, monkeypatch, {"tiny.toml": ONE})


def two_variants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """s2.toml and s5.toml: variants a and b, 2 and 5 steps."""
    return workdir(
        tmp_path, monkeypatch, {"s2.toml": TWO.format(steps=2), "s5.toml": TWO.format(steps=5)}
    )
