"""Runs that differ only in values (learning rate, optimizer eps, loss weight, seed) share one
compiled program (precisionlab.train.programs), and give the numbers of separately compiled
runs."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from precisionlab.train import TrainConfig, programs, train
from precisionlab.train.compose import program_key, run_values

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@pytest.fixture
def compiles():
    """A list that receives one entry per XLA compilation while the test runs (the suite runs
    with the persistent cache off, so every program that is not in memory compiles)."""
    seen: list[str] = []

    def listener(event: str, _seconds: float, **_kw) -> None:
        if event == COMPILE_EVENT:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


BASE = dict(
    model="mlp",
    model_kwargs={"width": 16, "depth": 1},
    steps=6,
    batch_size=16,
    eval_batches=2,
    hist_interval=3,
    optimizer_kwargs={"eps": 1e-12},
    loss_weight=0.25,
    telemetry=None,
)


def _leaves(result) -> list[bytes]:
    state = result.state._replace(values=None)  # the values differ by construction
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(state)]


def _numbers(result) -> tuple:
    rows = [
        (m["loss"], m["grad_norm"], m.get("grad_hist"), m.get("telemetry")) for m in result.metrics
    ]
    return (_leaves(result), repr(rows), result.eval_loss, result.eval_metric)


def test_value_fields_leave_the_program_key_alone():
    a = TrainConfig(**BASE)
    b = TrainConfig(**{**BASE, "lr": 3e-2, "seed": 5, "loss_weight": 1.0, "optimizer_kwargs": {}})
    assert program_key(a) == program_key(b)
    assert run_values(a) == {"lr": 1e-3, "eps": 1e-12}
    assert run_values(b) == {"lr": 3e-2, "eps": 1e-8}  # optax's default eps
    # structure is part of the key
    for change in ({"policy": "p=f32,c=bf16,o=f32"}, {"model_kwargs": {"width": 8, "depth": 1}},
                   {"loss_scale": "static:8"}, {"optimizer_kwargs": {"b1": 0.8}}):  # fmt: skip
        assert program_key(TrainConfig(**{**BASE, **change})) != program_key(a), change


@pytest.mark.parametrize(
    "telemetry", [None, pytest.param({"interval": 3}, marks=pytest.mark.slow, id="telemetry")]
)
def test_runs_differing_in_values_share_one_compilation(compiles, telemetry):
    programs.clear()
    base = {**BASE, "telemetry": telemetry}
    first = TrainConfig(**{**base, "loss_scale": "static:1024"})
    # every value differs: lr, optimizer eps, loss weight, seed, the static scale's value
    second = TrainConfig(**{**base, "lr": 4e-3, "seed": 3, "optimizer_kwargs": {"eps": 1e-6},
                            "loss_weight": 1.0, "loss_scale": "static:8"})  # fmt: skip
    ran = train(first, quiet=True)
    assert compiles, "the first run compiles its programs"
    compiles.clear()
    shared = train(second, quiet=True)
    assert compiles == [], "the second run reuses the first run's compiled programs"
    assert [m["loss_scale"] for m in shared.metrics] == [8.0] * BASE["steps"]
    assert [m["loss"] for m in shared.metrics] != [m["loss"] for m in ran.metrics]
    # the same run compiled on its own gives the same bits
    programs.clear()
    alone = train(second, quiet=True)
    assert compiles, "after clear() the run compiles again"
    assert _numbers(shared) == _numbers(alone)
