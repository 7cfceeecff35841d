"""The memory estimator against textbook and published figures, computed independently here."""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from precisionlab.memory._estimate import (
    ModelSpec,
    TrainSetup,
    best_checkpoint_interval,
    estimate,
    layer_activation_bytes,
)
from precisionlab.memory._fit import fit
from precisionlab.memory._presets import PRESETS, get_preset
from precisionlab.memory._units import UNITS, format_size, parse_size

GPT3_175B = get_preset("gpt3-175b")
MIXED = TrainSetup(policy="p=f32,c=f16", optimizer="adam", batch=1, seq=2048)


def test_fp16_weights_of_gpt3_175b_are_350_gb():
    b = estimate(GPT3_175B, MIXED)
    assert b.weights == 350 * 10**9  # 175e9 params x 2 bytes, decimal GB


def test_mixed_precision_adam_is_16_bytes_per_param():
    b = estimate(GPT3_175B, MIXED)
    n = 175 * 10**9
    # 2 (fp16 weights) + 4 (fp32 master) + 2 (fp16 gradients) + 4 + 4 (fp32 Adam moments)
    assert (b.weights, b.master_weights, b.gradients, b.optimizer_state) == (
        2 * n,
        4 * n,
        2 * n,
        8 * n,
    )
    assert b.grad_accumulator == 0
    assert b.bytes_per_param == 16
    assert b.model_states == 2_800 * 10**9  # 2.8 TB


def test_boundary_activation_is_batch_seq_dmodel_bytes_per_layer():
    setup = dataclasses.replace(MIXED, batch=3, seq=1024)
    b = estimate(GPT3_175B, setup)
    assert b.activations_boundary == 96 * (3 * 1024 * 12288 * 2)
    boundary, _ = layer_activation_bytes(GPT3_175B, batch=3, seq=1024, dtype=np.float16)
    assert boundary == 3 * 1024 * 12288 * 2


@pytest.mark.parametrize("name", ["gpt3-small", "gpt3-2.7b", "gpt3-175b"])
def test_full_layer_count_matches_korthikanti_et_al_2022(name):
    # Sec. 4.1 of Korthikanti et al. 2022 (16-bit activations, dropout): sbh(34 + 5as/h) bytes.
    m = get_preset(name)
    s, b, h, a = 2048, 2, m.d_model, m.n_heads
    _, full = layer_activation_bytes(m, batch=b, seq=s, dtype=np.float16, dropout=True)
    assert full == s * b * h * 34 + 5 * a * s * s * b


def test_full_layer_count_without_dropout_scales_with_dtype():
    m = get_preset("gpt3-small")
    _, f16 = layer_activation_bytes(m, batch=1, seq=128, dtype=np.float16)
    _, f32 = layer_activation_bytes(m, batch=1, seq=128, dtype=np.float32)
    assert f32 == 2 * f16
    s, h, a = 128, 768, 12
    assert f16 == 2 * (16 * s * h + a * s * s)


def test_zero_stages_reproduce_rajbhandari_et_al_2020_figure_1():
    # Psi = 7.5B parameters, N_d = 64 devices, K = 12 (fp32 master + Adam moments).
    m = ModelSpec(
        name="zero-7.5b", n_params=7_500_000_000, n_layers=1, d_model=1, n_heads=1, d_head=1
    )
    psi, nd = 7.5e9, 64
    expected = {
        0: (2 + 2 + 12) * psi,
        1: 4 * psi + 12 * psi / nd,
        2: 2 * psi + 14 * psi / nd,
        3: 16 * psi / nd,
    }
    printed_gb = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage in range(4):
        setup = TrainSetup(policy="p=f32,c=f16", zero_stage=stage, dp=nd)
        got = estimate(m, setup).model_states
        assert got == expected[stage]
        assert round(got / 1e9, 1) == pytest.approx(printed_gb[stage], abs=0.06)


def test_microbatches_divide_activations_and_add_an_accumulator():
    one = estimate(GPT3_175B, dataclasses.replace(MIXED, batch=8))
    four = estimate(GPT3_175B, dataclasses.replace(MIXED, batch=8, microbatches=4))
    assert four.activations_full * 4 == one.activations_full
    assert four.activations_boundary * 4 == one.activations_boundary
    assert four.temporaries * 4 == one.temporaries
    assert four.grad_accumulator == 4 * 175 * 10**9
    assert one.grad_accumulator == 0


@pytest.mark.parametrize("n_layers", [9, 16, 25, 64, 100])
def test_boundary_memory_vs_checkpoint_interval_is_least_at_sqrt_n(n_layers):
    m = ModelSpec(
        name="deep", n_params=10**6, n_layers=n_layers, d_model=64, n_heads=4, d_head=16, seq_len=32
    )
    setup = TrainSetup(batch=2)
    unit = 2 * 32 * 64 * 4
    costs = {}
    for k in range(1, n_layers + 1):
        b = estimate(m, dataclasses.replace(setup, checkpoint_every=k))
        assert b.activations_boundary == (math.ceil(n_layers / k) + k) * unit
        costs[k] = b.activations_boundary
    assert min(costs, key=costs.get) == math.isqrt(n_layers)
    assert best_checkpoint_interval(m, setup, full=False) == math.isqrt(n_layers)


def test_full_count_optimum_is_sqrt_of_n_times_boundary_over_block():
    m = get_preset("gpt3-175b")
    boundary, full = layer_activation_bytes(m, batch=1, seq=2048, dtype=np.float16)
    predicted = math.sqrt(96 * boundary / full)
    k = best_checkpoint_interval(m, MIXED)
    assert abs(k - predicted) <= 1
    plain = estimate(m, MIXED).activations_full
    assert estimate(m, dataclasses.replace(MIXED, checkpoint_every=k)).activations_full < plain


_DTYPES = {
    "f32": np.dtype(np.float32),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f16": np.dtype(np.float16),
    "e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
}


@given(
    p=st.sampled_from(["f32", "bf16", "f16"]),
    c=st.sampled_from(["f32", "bf16", "f16"]),
    state=st.sampled_from(list(_DTYPES)),
    opt=st.sampled_from([("sgd", 0), ("momentum", 1), ("lion", 1), ("adam", 2), ("adamw", 2)]),
)
def test_bytes_per_param_is_the_sum_of_the_stored_itemsizes(p, c, state, opt):
    name, moments = opt
    setup = TrainSetup(policy=f"p={p},c={c}", optimizer=name, opt_dtype=state)
    b = estimate(get_preset("gpt3-small"), setup)
    size = {k: v.itemsize for k, v in _DTYPES.items()}
    master = size[p] if p != c else 0
    expected = size[c] + master + size[c] + moments * size[state]
    assert b.bytes_per_param == expected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"optimizer": "adagrad"}, "adagrad"),
        ({"zero_stage": 4}, "zero_stage"),
        ({"batch": 0}, "batch"),
        ({"batch": 6, "microbatches": 4}, "divisible"),
        ({"dp": -1}, "dp"),
        ({"policy": "p=f32,c=f17"}, "f17"),
        ({"opt_dtype": "int3"}, "int3"),
        ({"checkpoint_every": 0}, "checkpoint_every"),
    ],
)
def test_bad_setups_raise_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainSetup(**kwargs)


def test_checkpoint_interval_beyond_the_layers_is_an_error():
    with pytest.raises(ValueError, match=r"1\.\.96"):
        estimate(GPT3_175B, dataclasses.replace(MIXED, checkpoint_every=97))


# --- presets ---------------------------------------------------------------------------------

# Brown et al. 2020, Table 2.1: n_params, n_layers, d_model, n_heads, d_head, batch, lr.
TABLE_2_1 = {
    "gpt3-small": (125e6, 12, 768, 12, 64, 0.5e6, 6.0e-4),
    "gpt3-medium": (350e6, 24, 1024, 16, 64, 0.5e6, 3.0e-4),
    "gpt3-large": (760e6, 24, 1536, 16, 96, 0.5e6, 2.5e-4),
    "gpt3-xl": (1.3e9, 24, 2048, 24, 128, 1e6, 2.0e-4),
    "gpt3-2.7b": (2.7e9, 32, 2560, 32, 80, 1e6, 1.6e-4),
    "gpt3-6.7b": (6.7e9, 32, 4096, 32, 128, 2e6, 1.2e-4),
    "gpt3-13b": (13.0e9, 40, 5140, 40, 128, 2e6, 1.0e-4),
    "gpt3-175b": (175.0e9, 96, 12288, 96, 128, 3.2e6, 0.6e-4),
}


def test_presets_are_table_2_1():
    assert list(PRESETS) == list(TABLE_2_1)
    for name, row in TABLE_2_1.items():
        s = PRESETS[name]
        got = (
            s.n_params,
            s.n_layers,
            s.d_model,
            s.n_heads,
            s.d_head,
            s.batch_tokens,
            s.learning_rate,
        )
        assert got == pytest.approx(row, rel=0, abs=0), name
        assert s.seq_len == 2048 and s.vocab == 50257


def test_preset_param_counts_agree_with_12_l_d2_plus_embeddings():
    for s in PRESETS.values():
        approx = 12 * s.n_layers * s.d_model**2 + (s.vocab + s.seq_len) * s.d_model
        assert approx == pytest.approx(s.n_params, rel=0.03), s.name


def test_preset_aliases_and_unknown_names():
    assert get_preset("GPT3-125M") is PRESETS["gpt3-small"]
    with pytest.raises(ValueError, match=r"unknown preset 'gpt3-9b'.*gpt3-175b"):
        get_preset("gpt3-9b")


# --- units -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 2**30),
        ("80 GB", 80 * 10**9),
        ("1.5KB", 1500),
        ("1.5kib", 1536),
        ("512B", 512),
        ("2TiB", 2 * 2**40),
        ("3.2TB", 3_200_000_000_000),
        ("1e3B", 1000),
        ("0.5MiB", 2**19),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "malformed"),
        ("GB", "malformed"),
        ("80", "malformed"),
        ("80 XB", "unknown unit 'XB'"),
        ("-1GB", "malformed"),
        ("0GB", "positive"),
        ("0.5B", "whole number"),
        ("1..5GB", "malformed"),
        ("nanGB", "malformed"),
    ],
)
def test_malformed_sizes_raise(text, match):
    with pytest.raises(ValueError, match=match):
        parse_size(text)


@given(n=st.integers(1, 10**6), unit=st.sampled_from(list(UNITS)))
def test_parse_size_round_trips_integers(n, unit):
    assert parse_size(f"{n}{unit}") == n * UNITS[unit]


def test_format_size():
    assert format_size(350e9, "GB") == "350.00 GB"
    assert format_size(2**30, "GiB", digits=1) == "1.0 GiB"
    with pytest.raises(ValueError, match="GiBs"):
        format_size(1, "GiBs")


# --- fit ---------------------------------------------------------------------------------------


def test_fit_says_fits_when_it_fits():
    r = fit(get_preset("gpt3-small"), TrainSetup(policy="p=f32,c=bf16"), parse_size("80GiB"))
    assert r.fits and r.changes == ()


def test_fit_finds_checkpointing_first():
    model = get_preset("gpt3-xl")
    setup = TrainSetup(policy="p=f32,c=bf16", batch=8)
    base = estimate(model, setup).total
    budget = base - base // 10  # 10 % too big: checkpointing alone is enough
    r = fit(model, setup, budget)
    assert not r.fits
    assert len(r.changes) == 1 and r.changes[0].startswith("checkpoint every")
    assert r.changed.total <= budget < r.breakdown.total


def test_fit_searches_the_devices_zero_3_needs():
    r = fit(GPT3_175B, MIXED, parse_size("80GiB"))
    assert not r.fits and r.setup is not None
    assert r.setup.zero_stage == 3
    dp = r.setup.dp
    assert r.changed.total <= parse_size("80GiB")
    fewer = dataclasses.replace(r.setup, dp=dp - 1)
    assert estimate(GPT3_175B, fewer).total > parse_size("80GiB")


def test_fit_rejects_a_bad_budget():
    with pytest.raises(ValueError, match="budget"):
        fit(GPT3_175B, MIXED, -5)


@given(
    name=st.sampled_from(list(PRESETS)),
    batch=st.sampled_from([1, 2, 4, 8]),
    policy=st.sampled_from(["f32", "p=f32,c=bf16", "bf16"]),
    dp=st.sampled_from([1, 8]),
    budget_gib=st.integers(1, 4096),
)
def test_fit_answers_are_consistent(name, batch, policy, dp, budget_gib):
    model = get_preset(name)
    setup = TrainSetup(policy=policy, batch=batch, dp=dp)
    budget = budget_gib * 2**30
    r = fit(model, setup, budget)
    assert r.fits == (estimate(model, setup).total <= budget)
    if r.setup is not None:
        assert estimate(model, r.setup).total == r.changed.total <= budget
    if r.fits:
        assert r.changes == ()
    elif r.setup is not None:
        assert r.changes
