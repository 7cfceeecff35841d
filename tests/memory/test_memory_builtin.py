"""Estimate vs XLA for the built-in models (mlp, transformer, conv) of precisionlab.train and
their real train step.

Arguments and outputs must match exactly. Temporaries: measured / estimated within [0.6, 1.6]
with float32 compute; with bf16/fp16 compute the CPU backend keeps float32 intermediates (its
measured temporaries equal float32's), so the band there is [0.6, 3.0].
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from _memory_steps import plain_step

from precisionlab.memory._builtin import (
    activation_bytes,
    measure_train_table,
    param_count,
    transformer_spec,
)
from precisionlab.memory._estimate import estimate_step
from precisionlab.memory._measure import measure
from precisionlab.train import make_model


@pytest.mark.parametrize(
    ("name", "kw"),
    [
        ("mlp", {}),
        ("mlp", {"use_layernorm": True, "depth": 3, "width": 64}),
        ("transformer", {}),
        ("transformer", {"use_layernorm": False, "depth": 3, "d_model": 32, "heads": 2}),
        ("conv", {}),
        ("conv", {"depth": 3, "width": 8}),
        ("conv", {"in_dim": 36, "num_classes": 3}),
        ("conv", {"in_dim": 49, "depth": 1}),
    ],
)
def test_param_count_from_sizes_matches_the_pytree(name, kw):
    model = make_model(name, **kw)
    params = model.init(jax.random.PRNGKey(0))  # drawn on the host: cheap, and real
    assert param_count(model) == sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))


def test_transformer_spec():
    model = make_model("transformer", d_model=64, depth=2, heads=4, seq_len=64, vocab_size=32)
    spec = transformer_spec(model)
    assert (spec.n_layers, spec.d_model, spec.n_heads, spec.d_head, spec.d_ff) == (
        2,
        64,
        4,
        16,
        256,
    )
    with pytest.raises(ValueError, match="transformer"):
        transformer_spec(make_model("mlp"))


TEACHER64 = {"data": "teacher", "data_kwargs": {"in_dim": 64}}  # the conv model's 8x8 images
TABLES = [
    {"model": "mlp", "batch_size": 64},
    pytest.param(
        {"model": "mlp", "policy": "p=f32,c=bf16", "loss_scale": "dynamic", "batch_size": 64},
        marks=pytest.mark.slow,
    ),
    {
        "model": "mlp",
        "update_rounding": "kahan",
        "params_dtype": "bf16",
        "opt_state_dtype": "bf16",
        "batch_size": 64,
    },
    pytest.param(
        {"model": "transformer", "data": "markov", "batch_size": 32}, marks=pytest.mark.slow
    ),
    # The library's transformer step takes ~15 s to compile on 2 cores: slow suite.
    pytest.param(
        {
            "model": "transformer",
            "model_kwargs": {"d_model": 32, "depth": 1, "heads": 2},
            "data": "markov",
            "batch_size": 16,
            "microbatches": 2,
            "policy": "p=f32,c=f16",
            "loss_scale": "dynamic",
        },
        marks=pytest.mark.slow,
    ),
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
    low_precision = "c=" in table.get("policy", "") and "c=f32" not in table.get("policy", "")
    high = 3.0 if low_precision else 1.6
    assert 0.6 <= rows["temporaries"]["ratio"] <= high, rows


@pytest.mark.parametrize(
    "name", ["mlp", "transformer", pytest.param("conv", marks=pytest.mark.slow)]
)
def test_plain_step_around_the_builtin_loss(name):
    kw = {"vocab_size": 32, "seq_len": 32} if name == "transformer" else {}
    model = make_model(name, **kw)
    built = plain_step(model, batch=16)
    got = measure(built.step, *built.args, run=False)
    est = estimate_step(built.params, built.batch, activation_bytes=built.activation_bytes)
    assert (got.arguments, got.outputs) == (est.arguments, est.outputs)
    assert 0.6 <= got.temporaries / est.temporaries <= 1.6


@pytest.mark.parametrize(("name", "batch"), [("mlp", 64), ("conv", 32)])
def test_activation_bytes_halve_with_16_bit_compute_except_float32_ops(name, batch):
    model = make_model(name, width=128 if name == "mlp" else 8, depth=2)
    f32 = activation_bytes(model, batch, "f32")
    bf16 = activation_bytes(model, batch, "p=f32,c=bf16")
    logits = batch * 10 * 4  # float32 logits in both
    assert (bf16 - logits) * 2 == f32 - logits
