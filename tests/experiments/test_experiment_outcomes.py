"""The shipped fp16-vs-bf16 experiment, reduced, shows its three phenomena with margins.

The reduced run keeps every setting of ``experiments/fp16_vs_bf16.toml`` (model, data, seed,
optimizer, learning rate) and the variants that carry each claim, with half the steps and no
histograms or checkpoints. Measured at 150 steps (eval loss / accuracy): underflow fp32
0.910/64.0%, fp16-noscale 1.353/57.8% (underflow meter 100%), fp16-dynamic 0.910/64.1%; range
fp32 1.729/43.6%, bf16 1.635/47.9%, fp16-noscale diverged at step 2, fp16-dynamic 150 of 150
steps skipped (9.2%); swamping fp32 1.726, bf16-pure-nearest 1.991, bf16-pure-stochastic 1.727.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from precisionlab.experiments import _runner as runner
from precisionlab.experiments import _store as store
from precisionlab.experiments._config import apply_overrides, experiment_from_document

ROOT = Path(__file__).parents[2]
STEPS = 150
KEEP = {
    "underflow": ("fp32", "fp16-noscale", "fp16-dynamic"),
    "range": ("fp32", "bf16", "fp16-noscale", "fp16-dynamic"),
    "swamping": ("fp32", "bf16-pure-nearest", "bf16-pure-stochastic"),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict]:
    path = ROOT / "experiments" / "fp16_vs_bf16.toml"
    doc = tomllib.loads(path.read_text())
    doc = apply_overrides(
        doc,
        [
            f"train.steps={STEPS}",
            "train.hist_interval=0",
            "train.checkpoint_interval=0",
            "train.telemetry.enabled=false",  # not what these outcomes are about
        ],
    )
    names = {v for keep in KEEP.values() for v in keep}
    doc["variant"] = [v for v in doc["variant"] if v["name"] in names]
    for v in doc["variant"]:
        v["settings"] = [s for s, keep in KEEP.items() if v["name"] in keep]
    experiment = experiment_from_document(doc, str(path))
    run_dir = tmp_path_factory.mktemp("outcomes")
    with store.locked_run(run_dir) as previous:
        runner.run_locked(experiment, run_dir, previous=previous, quiet=True)
    summary = store.read_json(run_dir / "summary.json")
    out = {u["name"]: u for u in summary["variants"]}
    assert len(out) == sum(len(k) for k in KEEP.values())
    assert all(u["status"] == "finished" for u in out.values()), out
    return out


def test_a_underflow_fp16_loses_gradients_and_loss_scaling_recovers(outcomes):
    fp32 = outcomes["underflow/fp32"]
    noscale = outcomes["underflow/fp16-noscale"]
    dynamic = outcomes["underflow/fp16-dynamic"]
    # The underflow meter: most fp16 gradient elements are zero or subnormal without scaling.
    assert noscale["mean_underflow_fraction"] > 0.5
    assert fp32["mean_underflow_fraction"] < 0.01
    assert dynamic["mean_underflow_fraction"] < 0.05
    # ... and training ends measurably worse than fp32, while dynamic scaling matches fp32.
    assert noscale["eval_loss"] > fp32["eval_loss"] + 0.2
    assert noscale["eval_metric"] < fp32["eval_metric"] - 0.03
    assert abs(dynamic["eval_loss"] - fp32["eval_loss"]) < 0.03
    assert dynamic["skipped_steps"] <= 2


def test_b_range_fp16_overflows_even_with_loss_scaling_bf16_matches_fp32(outcomes):
    fp32 = outcomes["range/fp32"]
    bf16 = outcomes["range/bf16"]
    noscale = outcomes["range/fp16-noscale"]
    dynamic = outcomes["range/fp16-dynamic"]
    assert fp32["eval_metric"] > 0.3  # the setting is learnable (chance: 0.1)
    assert not fp32["diverged"] and not bf16["diverged"]
    assert abs(bf16["eval_loss"] - fp32["eval_loss"]) < 0.15 * fp32["eval_loss"]
    assert abs(bf16["eval_metric"] - fp32["eval_metric"]) < 0.08
    # fp16 without scaling diverges; with dynamic scaling every step is skipped (it stalls).
    assert noscale["diverged"]
    assert dynamic["skipped_steps"] >= 0.9 * STEPS
    for fp16 in (noscale, dynamic):
        assert fp16["eval_metric"] < 0.15  # near chance (10 classes)


def test_c_swamping_pure_bf16_nearest_stalls_stochastic_rounding_recovers(outcomes):
    fp32 = outcomes["swamping/fp32"]
    nearest = outcomes["swamping/bf16-pure-nearest"]
    stochastic = outcomes["swamping/bf16-pure-stochastic"]
    assert nearest["final_loss"] > fp32["final_loss"] + 0.1
    assert nearest["eval_loss"] > fp32["eval_loss"] + 0.1
    assert abs(stochastic["eval_loss"] - fp32["eval_loss"]) < 0.05


# test_train_loop.py::test_loss_weight_records_the_plain_loss_and_fp32_adam_ignores_it checks the
# same in the default suite (10 steps, through train()); this one (two 30-step runs through the
# experiments' train_kind, ~90 s on 2 loaded cores) runs with the slow checks.
@pytest.mark.slow
def test_loss_weight_is_invisible_to_fp32_adam(tmp_path):
    """The loss weight used to put gradients below fp16's range changes nothing in fp32 with
    Adam (scale invariant up to eps), and the recorded loss is the plain loss."""
    from precisionlab.experiments import _train_kind as train_kind

    base = {
        "model": "mlp",
        "steps": 30,
        "batch_size": 32,
        "lr": 3e-3,
        "optimizer_kwargs": {"eps": 1e-15},
        "model_kwargs": {"width": 16},
    }
    curves = {}
    for weight in (1.0, 2.0**-16):
        config = train_kind.config({**base, "loss_weight": weight}, "test")
        rows: list[dict] = []
        result = train_kind.run_unit(
            config,
            tmp_path / str(weight),
            on_step=rows.append,
            on_hist=lambda _h: None,
            resume=False,
            quiet=True,
            label="w",
        )
        assert result["loss_weight"] == weight
        curves[weight] = [r["loss"] for r in rows]
    plain, weighted = curves[1.0], curves[2.0**-16]
    assert len(plain) == len(weighted) == 30
    assert plain[0] == pytest.approx(weighted[0], rel=1e-6)  # same init, same batch
    assert weighted == pytest.approx(plain, rel=1e-3)
