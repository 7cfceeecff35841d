"""precisionlab.memory._zero on a backend without XLA's memory analysis."""

import jax
import pytest

from precisionlab.memory._zero import measure_zero_table


def test_no_memory_analysis_is_a_clear_error(monkeypatch):
    # mypy found it: memory_analysis() may return None, and the ZeRO measurement read its
    # sizes without looking (an AttributeError on None) where the other measurements raise
    monkeypatch.setattr(jax.stages.Compiled, "memory_analysis", lambda self: None)
    table = dict(model="mlp", model_kwargs={"width": 8}, batch_size=8, optimizer="sgd")
    with pytest.raises(ValueError, match="no memory analysis"):
        measure_zero_table(table, zero_stage=0, dp=1)
