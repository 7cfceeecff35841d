"""The memory estimator knows the built-in ``conv`` model: estimate vs XLA, as for mlp/transformer
(tests/test_memory_builtin.py): arguments and outputs exact; temporaries within [0.6, 1.6] with
float32 compute, [0.6, 3.0] with 16-bit compute (the CPU keeps float32 intermediates)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from precisionlab.memory.builtin import (
    activation_bytes,
    measure_train_table,
    param_count,
    plain_step,
)
from precisionlab.memory.estimate import estimate_step
from precisionlab.memory.measure import measure
from precisionlab.train import make_model


@pytest.mark.parametrize(
    "kw",
    [{}, {"depth": 3, "width": 8}, {"in_dim": 36, "num_classes": 3}, {"in_dim": 49, "depth": 1}],
)
def test_param_count_from_sizes_matches_the_pytree(kw):
    model = make_model("conv", **kw)
    params = model.init(jax.random.PRNGKey(0))
    assert param_count(model) == sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))


TEACHER64 = {"data": "teacher", "data_kwargs": {"in_dim": 64}}
TABLES = [
    {"model": "conv", "batch_size": 64, **TEACHER64},
    pytest.param(
        {
            "model": "conv",
            "batch_size": 64,
            "policy": "p=f32,c=bf16",
            "loss_scale": "dynamic",
            **TEACHER64,
        },
        marks=pytest.mark.slow,
    ),
    pytest.param(
        {
            "model": "conv",
            "batch_size": 32,
            "model_kwargs": {"depth": 3, "width": 8},
            "microbatches": 2,
            **TEACHER64,
        },
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("table", TABLES)
def test_real_train_step_arguments_and_outputs_match_xla(table):
    report = measure_train_table(table, "test")
    rows = {row["name"]: row for row in report["rows"]}
    assert rows["arguments"]["estimated"] == rows["arguments"]["measured"]
    assert rows["outputs"]["estimated"] == rows["outputs"]["measured"]
    high = 3.0 if "c=bf16" in table.get("policy", "") else 1.6
    assert 0.6 <= rows["temporaries"]["ratio"] <= high, rows


@pytest.mark.slow
def test_plain_step_around_the_builtin_conv_loss():
    built = plain_step(make_model("conv"), batch=16)
    got = measure(built.step, *built.args, run=False)
    est = estimate_step(built.params, built.batch, activation_bytes=built.activation_bytes)
    assert (got.arguments, got.outputs) == (est.arguments, est.outputs)
    assert 0.6 <= got.temporaries / est.temporaries <= 1.6


def test_conv_activations_halve_with_16_bit_compute_except_the_float32_logits():
    model = make_model("conv", width=8, depth=2)
    f32 = activation_bytes(model, 32, "f32")
    bf16 = activation_bytes(model, 32, "p=f32,c=bf16")
    logits = 32 * 10 * 4
    assert (bf16 - logits) * 2 == f32 - logits
