"""Golden trainer test: 3 steps of the default MLP from a fixed seed, numbers pinned.

A refactor of the trainer (config parsing, step construction, loop, hooks) must not change the
numerics: these values are compared to a relative 1e-6 (a few float32 ulps). Not exactly: XLA's
CPU backend emits different vector code for different processors (AVX2, AVX-512, AMD's
variants), and the pinned values differ in their last bit or two between the machine that made
them and others (4.340184688568115 vs 4.340185165405273 for the first fp32 gradient norm on an
AMD EPYC); a change of the numerics themselves (a dropped cast, another loss scale, a wrong
update) moves them by far more. Bitwise refactor checks on one machine live beside the code they
guard (chunked vs per-step training, telemetry on vs off), and tests/train/test_train_golden_bits.py
pins the exact bits of runs through every hook of the loop. They were produced by running
``train(TrainConfig(steps=3, seed=0, **case))`` on the tree before the issue-9 refactor
(commit 512c52a, jax 0.10.2, CPU) and printing the per-step ``loss`` / ``grad_norm`` /
``loss_scale``, the float64 sum and sum of absolute values of the final params, and the final
evaluation. Regenerate them only for a deliberate change of numerics, and say so in the commit.
"""

import jax
import numpy as np
import pytest

from precisionlab.train import TrainConfig, train

#: Relative tolerance: a few float32 ulps (see the module docstring).
RTOL = 1e-6

GOLDEN = {
    "fp32": dict(
        config={},
        loss=[2.956965923309326, 2.5984723567962646, 2.3510260581970215],
        grad_norm=[4.340184688568115, 2.8750414848327637, 1.9249227046966553],
        loss_scale=[1.0, 1.0, 1.0],
        param_sum=-17.809849266848005,
        param_abs_sum=6384.044749981482,
        eval_loss=2.3472344875335693,
        eval_metric=0.1591796875,
    ),
    "fp16-dynamic": dict(
        config={"policy": "p=f32,c=f16,o=f32", "loss_scale": "dynamic"},
        loss=[2.9570837020874023, 2.598226547241211, 2.351202964782715],
        grad_norm=[4.340925216674805, 2.87412691116333, 1.92512845993042],
        loss_scale=[65536.0, 65536.0, 65536.0],
        param_sum=-17.820162698653803,
        param_abs_sum=6384.044330700468,
        eval_loss=2.347228765487671,
        eval_metric=0.158203125,
    ),
}


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_three_steps_of_the_default_mlp_are_pinned(case):
    want = GOLDEN[case]
    result = train(TrainConfig(steps=3, seed=0, **want["config"]))
    close = dict(rtol=RTOL, atol=0)
    np.testing.assert_allclose([m["loss"] for m in result.metrics], want["loss"], **close)
    np.testing.assert_allclose([m["grad_norm"] for m in result.metrics], want["grad_norm"], **close)
    assert [m["loss_scale"] for m in result.metrics] == want["loss_scale"]
    leaves = jax.tree_util.tree_leaves(jax.device_get(result.state.params))
    assert all(np.asarray(x).dtype == np.float32 for x in leaves)
    param_sum = sum(float(np.sum(np.asarray(x, np.float64))) for x in leaves)
    abs_sum = sum(float(np.sum(np.abs(np.asarray(x, np.float64)))) for x in leaves)
    np.testing.assert_allclose(param_sum, want["param_sum"], **close)
    np.testing.assert_allclose(abs_sum, want["param_abs_sum"], **close)
    np.testing.assert_allclose(result.eval_loss, want["eval_loss"], **close)
    np.testing.assert_allclose(result.eval_metric, want["eval_metric"], **close)
