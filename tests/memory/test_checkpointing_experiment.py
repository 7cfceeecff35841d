"""Activation checkpointing measured: XLA's peak temporaries of the real train step fall from
K = N to K ~ sqrt(N) (deterministic: read from the compiled program, nothing timed), the
estimator's checkpointing model, and the ``checkpointing`` experiment on a reduced config."""

import dataclasses
import json

import pytest

from precisionlab.memory import TrainSetup, estimate
from precisionlab.memory._builtin import transformer_spec
from precisionlab.memory._checkpointing import (
    checkpointed_bytes,
    layer_bytes,
    measure_point,
    run,
    validate,
)
from precisionlab.mixed import get_policy
from precisionlab.train._models import make_model

# 17 layers: the first (in_dim -> width) stays unrolled, N = 16 are scanned. A wide batch makes
# a layer's saved activations about its input's size, as the textbook model assumes.
DEEP_MLP = {"model": "mlp", "model_kwargs": {"depth": 17, "width": 32}, "batch_size": 1024}


def test_peak_temporaries_fall_from_k_n_to_k_sqrt_n():
    temp = {k: measure_point(DEEP_MLP, remat_every=k)["measured_temp"] for k in (16, 4)}
    # K = N: one group of all layers keeps what no checkpointing keeps. sqrt(16) = 4: N/K + K =
    # 8 boundary tensors instead of ~16 layers' worth.
    assert temp[4] < 0.75 * temp[16], temp


def test_checkpointed_bytes_is_the_estimators_model():
    # Oracle: the memory estimator's own activation count for a built-in transformer.
    model = make_model("transformer", depth=12, d_model=32, heads=4, seq_len=16, vocab_size=32)
    spec, policy = transformer_spec(model), get_policy("f32")
    boundary, layer = layer_bytes(model, 4, policy)
    base = TrainSetup(policy="f32", batch=4, seq=16)
    for k in (1, 3, 5, 12):
        expect = estimate(spec, dataclasses.replace(base, checkpoint_every=k)).activations_full
        assert checkpointed_bytes(12, boundary, layer, k) == expect
    assert checkpointed_bytes(12, boundary, layer, 0) == estimate(spec, base).activations_full
    # The textbook shape: with equal boundary and layer sizes the least is at K = sqrt(N).
    costs = {k: checkpointed_bytes(36, 1, 1, k) for k in range(1, 37)}
    assert min(costs, key=lambda k: (costs[k], k)) == 6


def test_experiment_runs_on_a_reduced_config(tmp_path):
    section = {
        "remat_every": [1, 2],
        "microbatches": [1, 2],
        "repeats": 1,
        "models": {
            "m": {"model": "mlp", "model_kwargs": {"depth": 3, "width": 8}, "batch_size": 8}
        },
    }
    summary = run(section, tmp_path, quiet=True)
    res = summary["models"]["m"]
    assert res["n_layers"] == 2
    assert [r["k"] for r in res["checkpoint"]] == [1, 2]
    assert [r["microbatches"] for r in res["microbatches"]] == [1, 2]
    for r in res["checkpoint"] + res["microbatches"] + [res["none"]]:
        assert r["measured_temp"] > 0 and r["estimated_temp"] > 0 and r["step_s"] > 0
    for name in ("rows.jsonl", "checkpointing.json", "summary.txt", "checkpointing_m.png"):
        assert (tmp_path / name).is_file(), name
    assert json.loads((tmp_path / "checkpointing.json").read_text())["kind"] == "checkpointing"
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 4


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"remat_every": [0]}, r"remat_every\[0\]: expected an int >= 1"),
        ({"microbatches": [3]}, r"microbatches\[0\].*dividing transformer's batch_size=8"),
        ({"remat_policy": "x"}, "remat_policy: unknown remat_policy 'x'"),
        ({"models": {"a": {"model": "nope"}}}, r"models\.a"),
        ({"colour": 1}, "colour"),
    ],
)
def test_bad_tables(section, match):
    with pytest.raises(ValueError, match=match):
        validate(section, "checkpointing")
