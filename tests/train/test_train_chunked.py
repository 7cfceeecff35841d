"""Chunked training (k steps per compiled call under ``lax.scan``) is bitwise the per-step loop:
same metrics, same final state, same checkpoints; it stops at the same step on divergence."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from precisionlab.train import TrainConfig, train
from precisionlab.train._compose import build
from precisionlab.train._loop import LoopOptions, _chunk_len, _chunk_steps
from precisionlab.train._timing import LoopTimings

# The main job's (b) setting, fp16 with dynamic loss scaling: skipped steps, a moving loss
# scale, GELU overflow; and swamping's pure-bf16 params with stochastic rounding (the PRNG).
CASES = {
    "fp16-dynamic-range": dict(
        policy="p=f32,c=f16,o=f32",
        loss_scale="dynamic",
        lr=1e-2,
        model_kwargs={"width": 16, "depth": 3, "activation": "gelu"},
        data_kwargs={"input_scale": 100.0},
    ),
    "bf16-pure-stochastic": dict(
        policy="p=bf16,c=bf16,o=f32",
        update_rounding="stochastic",
        lr=3e-4,
        model_kwargs={"width": 16, "depth": 2, "activation": "tanh"},
    ),
}


def _config(case: str, **kw) -> TrainConfig:
    base = dict(
        model="mlp", data="teacher", optimizer="adam", steps=12, batch_size=16, eval_batches=2,
        hist_interval=4, eval_interval=6, progress=False,
        telemetry={"interval": 3},
    )  # fmt: skip
    return TrainConfig(**{**base, **CASES[case], **kw})


def _leaves(state) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]


def _same_records(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b, strict=True):
        ra = {k: v for k, v in ra.items() if k != "step_time_s"}
        rb = {k: v for k, v in rb.items() if k != "step_time_s"}
        # repr: nan == nan, and -0.0 != 0.0
        assert repr(ra) == repr(rb)


@pytest.mark.parametrize(
    ("case", "probes"),
    [
        # ~6 s of CPU without probes, ~20 s with (the default suite runs the stop test below)
        pytest.param("bf16-pure-stochastic", False, marks=pytest.mark.slow),
        pytest.param("bf16-pure-stochastic", True, marks=pytest.mark.slow),
        pytest.param("fp16-dynamic-range", True, marks=pytest.mark.slow),
    ],
)
def test_chunked_is_bitwise_the_per_step_loop(case, probes):
    # without probes (and telemetry, ~10 s of compilation): an evaluation mid-run and one at
    # the end, so chunks of 6 steps
    kw = {} if probes else {"hist_interval": 0, "telemetry": None}
    one = train(_config(case, chunk_steps=1, **kw), quiet=True)
    timings = LoopTimings()
    many = train(_config(case, **kw), quiet=True, timings=timings)
    # with probes: the gcd of 4 (hist) and 6 (eval)
    assert (timings.chunk_steps, timings.calls) == ((2, 6) if probes else (6, 2))
    _same_records(one.metrics, many.metrics)
    for x, y in zip(_leaves(one.state), _leaves(many.state), strict=True):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
    assert any(r.get("telemetry") for r in many.metrics) == probes


def test_chunked_stops_where_the_per_step_loop_stops(tmp_path):
    # fp16 without loss scaling under the range setting: the loss overflows and the run stops.
    kw = dict(
        loss_scale="none", chunk_steps=5, steps=10, hist_interval=0, eval_interval=0,
        telemetry=None,
    )  # fmt: skip
    one = train(_config("fp16-dynamic-range", **{**kw, "chunk_steps": 1}), quiet=True)
    many = train(_config("fp16-dynamic-range", **kw), quiet=True)
    assert one.diverged and one.steps_done < 10
    assert many.steps_done == one.steps_done
    _same_records(one.metrics, many.metrics)
    for x, y in zip(_leaves(one.state), _leaves(many.state), strict=True):
        assert x.tobytes() == y.tobytes()


def test_chunk_boundaries_fall_on_every_event():
    loop = LoopOptions(steps=300, hist_interval=100, checkpoint_interval=100)
    assert _chunk_steps(loop, None) == 100
    loop = LoopOptions(steps=50, hist_interval=7, eval_interval=10)
    assert _chunk_steps(loop, None) == 1  # gcd(7, 10)
    loop = dataclasses.replace(loop, chunk_steps=8)
    ends, step = [], 0
    while step < loop.steps:
        step += _chunk_len(step, 8, loop)
        ends.append(step)
    for s in (7, 14, 10, 20, 50):
        assert s in ends  # a hist step starts a chunk; an eval step ends one
    assert max(b - a for a, b in zip([0, *ends], ends, strict=False)) <= 8
    assert _chunk_steps(LoopOptions(steps=1000), None) == 100
    assert _chunk_steps(LoopOptions(steps=300, divergence_k=3.0), None) == 1


def test_build_passes_chunk_steps():
    assert build(_config("bf16-pure-stochastic", chunk_steps=3)).loop.chunk_steps == 3
    with pytest.raises(ValueError, match="chunk_steps"):
        LoopOptions(steps=3, chunk_steps=-1)
