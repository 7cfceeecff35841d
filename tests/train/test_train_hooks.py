"""The trainer's loop pieces: recorded lr after skipped steps, aggregates, hooks, progress."""

import dataclasses
import math

import optax
import pytest

from precisionlab._schema import Field
from precisionlab.train import (
    Aggregates,
    StepOptions,
    TrainConfig,
    build_step,
    parse_step_options,
    train,
)
from precisionlab.train import _models as models
from precisionlab.train._config import TRAIN_FIELDS

SMALL = {"model_kwargs": {"width": 16}, "batch_size": 32, "eval_batches": 1}


def test_recorded_lr_is_the_rate_applied_after_skipped_steps():
    # A float16 gradient scaled by 2^24 overflows: the first steps are skipped while the
    # dynamic scale backs off. optax counts applied updates only, so the lr of a linear decay
    # must not advance on skipped steps (it used to be reported as schedule(step - 1)).
    lr, steps = 1e-2, 8
    cfg = TrainConfig(
        **SMALL, steps=steps, lr=lr, schedule="linear", policy="p=f32,c=f16,o=f32",
        loss_scale="dynamic", loss_scale_kwargs={"init_scale": 2.0**24, "backoff_factor": 2.0**-4},
    )  # fmt: skip
    result = train(cfg)
    skipped = [m["skipped"] for m in result.metrics]
    assert skipped[0] and not all(skipped), skipped
    oracle = optax.linear_schedule(lr, 0.0, steps)  # independent of the trainer's schedule
    applied = 0
    for m in result.metrics:
        assert m["lr"] == pytest.approx(float(oracle(applied)), rel=1e-6), (m["step"], applied)
        applied += not m["skipped"]


def test_aggregates_update_is_pure_and_marks_divergence_once():
    a0 = Aggregates()
    rec = {"loss": 2.0, "skipped": False, "loss_scale": 4.0, "underflow_fraction": 0.5}
    a1 = a0.update(1, rec, divergence_k=None)
    assert a0 == Aggregates()  # unchanged
    assert (a1.final_loss, a1.running_min, a1.min_loss_scale, a1.underflow_sum) == (2, 2, 4, 0.5)
    a2 = a1.update(2, {**rec, "loss": math.nan, "skipped": True}, None)
    a3 = a2.update(3, {**rec, "loss": math.inf}, None)
    assert (a2.diverged, a2.divergence_step, a3.divergence_step) == (True, 2, 2)
    assert a3.skipped_steps == 1 and a3.running_min == 2.0
    assert Aggregates.from_dict(a3.to_dict()) == a3


def test_step_options_take_typed_objects_and_the_mesh_is_returned():
    with pytest.raises(TypeError, match=r"policy must be a Policy.*parse_step_options"):
        StepOptions(policy="p=f32,c=bf16,o=f32")
    options = parse_step_options(policy="p=f32,c=bf16,o=f32", loss_scale="dynamic")
    assert options.skips and str(options.policy) == "p=f32,c=bf16,o=f32"

    def loss_fn(params, batch):
        return (params["w"] * batch).sum()

    import jax.numpy as jnp

    step = build_step(loss_fn, {"w": jnp.ones(3)}, optax.sgd(0.1), options)
    assert step.mesh is None and not hasattr(step.fn, "mesh")


def test_a_model_declares_the_data_it_reads(monkeypatch):
    # A new model registered with its data kind is checked when the config is made, not with a
    # KeyError when the run is built.
    class Lm(models.MLP):
        data_kind = "lm"

    monkeypatch.setitem(models._BUILDERS, "lm-mlp", Lm)
    from precisionlab.train import _config as config

    field = TRAIN_FIELDS["model"]
    wider = dataclasses.replace(field, choices=(*field.choices, "lm-mlp"))
    monkeypatch.setitem(TRAIN_FIELDS, "model", wider)
    monkeypatch.setitem(config._TYPES_ONLY, "model", wider)
    with pytest.raises(ValueError, match=r"model .lm-mlp. needs a lm dataset.*allowed: markov"):
        TrainConfig(model="lm-mlp", data="teacher")

    class Undeclared(models.MLP):
        data_kind = ""

    monkeypatch.setitem(models._BUILDERS, "lm-mlp", Undeclared)
    with pytest.raises(ValueError, match="does not declare the data_kind"):
        TrainConfig(model="lm-mlp", data="teacher")
    assert isinstance(field, Field)


def test_one_loss_knob():
    with pytest.raises(ValueError, match="loss_multiplier"):
        models.make_model("mlp", loss_multiplier=2.0)


def test_a_config_is_parsed_once_and_training_parses_no_strings():
    # Policy and loss-scale strings used to be parsed three times before training and the inner
    # layers re-normalised them (nine entries into mixed/_policy.py). Now the config parses each
    # once, when it is made, and everything below takes the typed objects.
    import sys
    from collections import Counter

    from precisionlab.mixed import _loss_scale as ls_mod
    from precisionlab.mixed import _policy as pol_mod

    codes = {
        pol_mod.get_policy.__code__: "get_policy",
        pol_mod.parse_dtype.__code__: "parse_dtype",
        ls_mod.parse_loss_scale.__code__: "parse_loss_scale",
    }
    calls: Counter = Counter()

    def profile(frame, event, arg):
        name = codes.get(frame.f_code) if event == "call" else None
        if name is not None:
            first = frame.f_locals.get("spec", frame.f_locals.get("value"))
            if isinstance(first, str):
                calls[name] += 1

    sys.setprofile(profile)
    try:
        cfg = TrainConfig(
            **SMALL, steps=1, policy="p=f32,c=bf16,o=f32", loss_scale="dynamic",
            grads_dtype="bfloat16",
        )  # fmt: skip
        made = dict(calls)
        calls.clear()
        train(cfg)
    finally:
        sys.setprofile(None)
    assert made["get_policy"] == 1 and made["parse_loss_scale"] == 1, made
    assert dict(calls) == {}, calls


def test_the_field_table_declares_every_config_field_with_its_default():
    # The [train] schema is a declared table, not derived from annotation strings: it must
    # list every TrainConfig field, with the dataclass's own default.
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    assert list(TRAIN_FIELDS) == list(fields)
    for name, f in fields.items():
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert TRAIN_FIELDS[name].default == default, name
    assert TrainConfig().to_dict() == {k: v.default for k, v in TRAIN_FIELDS.items()}


def test_record_hooks_are_due_on_their_intervals_and_fold_into_the_aggregates():
    # what the loop measures every N steps: each hook says when it is due (steps done, or the
    # 0-based step for row hooks) and what it adds; the loop only asks and writes
    from precisionlab.train._record_hooks import EvalHook, LrHook, ProbeHook

    probe = ProbeHook(lambda state, batch: {}, hist_interval=4, shadow_interval=6)
    assert [s for s in range(13) if probe.due(s)] == [0, 4, 6, 8, 12]
    no_shadow = ProbeHook(lambda state, batch: {}, hist_interval=4, shadow_interval=None)
    assert [s for s in range(13) if no_shadow.due(s)] == [0, 4, 8, 12]
    ev = EvalHook(lambda params: {"eval_loss": 1.5}, interval=0)
    assert not any(ev.due(s) for s in range(1, 10))  # the loop still runs it after the last step
    agg = ev.fold(Aggregates(), 7, ev.evaluate(None))
    assert agg.evals == ({"step": 7, "eval_loss": 1.5},)
    lr = LrHook(lambda count: 0.5**count)
    skipped = Aggregates(skipped_steps=2)
    assert lr.due(5) and lr.row(5, None, skipped) == {"lr": 0.5**3}
