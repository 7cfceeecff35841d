"""Bitwise golden runs of the trainer through its public API, one per kind of hook.

Every case trains a small MLP through ``train(TrainConfig(...))`` and reduces the run to the
exact bits of what it produced: each step's record (every metric, float bits as ``float.hex``;
timings and the source locations telemetry rows name left out), the final state (params,
optimizer state, loss scale, rng, recipe state) and the evaluations. The digests in
``tests/data/train_golden_bits.json`` were recorded on the tree before the trainer became a
step plus hooks (commit c6c3316, jax 0.10.2, CPU), by ``python tests/train/test_train_golden_bits.py
--update``; a refactor of the loop, the step or a hook must reproduce them bit for bit.
Regenerate them only for a deliberate change of numerics, and say so in the commit.

XLA's CPU backend emits different vector code on different processors, so the bits are only
comparable on a machine whose float32 arithmetic gives the recorded bits: a canary computation
independent of the trainer (a matmul, transcendental functions and reductions) is recorded too.
Where it differs (another CPU, another jax), each case is checked against its recorded losses,
gradient norms and loss scales to a relative 1e-4 instead (the numerics, not their last bits).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import pathlib
import sys
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precisionlab.train import TrainConfig, train

DATA = pathlib.Path(__file__).parents[1] / "data" / "train_golden_bits.json"

SMALL: dict[str, Any] = {
    "model_kwargs": {"width": 16},
    "batch_size": 32,
    "eval_batches": 1,
    "progress": False,
}

#: Per-call timings: not results.
_TIMES = ("step_time_s",)

#: The cases: name -> TrainConfig fields. "default" ones run in the default suite (cheap, they
#: cover every hook between them); the others are slow.
CASES: dict[str, dict[str, Any]] = {
    # probes (histograms), shadow comparison, recipe metrics, telemetry rows, predictors,
    # evaluation every 2 steps, a linear schedule's lr, steps chunked 2 per call
    "hooks-recipe": dict(
        steps=4,
        recipe="mxfp8",
        policy="p=f32,c=bf16,o=f32",
        hist_interval=2,
        shadow=True,
        shadow_interval=2,
        eval_interval=2,
        schedule="linear",
        telemetry={"interval": 2, "targets": ["fp16"]},
        predictors={"interval": 2},
    ),
    # the same hooks without the recipe and predictors
    "hooks": dict(
        steps=4,
        hist_interval=2,
        shadow=True,
        eval_interval=2,
        schedule="linear",
        telemetry={"interval": 2, "targets": ["fp16"], "ops": False},
    ),
    # fp16 with a dynamic loss scale that starts too high: skipped steps, the lr after them
    "fp16-skips": dict(
        steps=5,
        policy="p=f32,c=f16,o=f32",
        loss_scale="dynamic",
        schedule="linear",
        loss_scale_kwargs={"init_scale": 2.0**24, "backoff_factor": 2.0**-4},
        eval_interval=5,
    ),
    # the default suite's case: histograms and shadow every 3 steps, evaluation every 2, lr
    "fp32-one-per-call": dict(
        steps=4, chunk_steps=1, eval_interval=2, hist_interval=3, shadow=True
    ),
    "fp32-scan-deterministic": dict(
        steps=6,
        chunk_steps=3,
        microbatches=2,
        deterministic=True,
        report_leaves=True,
        loss_weight=0.5,
    ),
    "delayed-recipe": dict(
        steps=4, recipe={"name": "delayed", "amax_history_len": 4}, hist_interval=2
    ),
    "diverges-and-stops": dict(steps=6, lr=30.0, divergence_k=1.5, eval_interval=3),
}
DEFAULT = ("fp32-one-per-call",)

#: A run of 4 steps with a checkpoint every 2, resumed to 6: the resumed run's records.
RESUME: dict[str, Any] = dict(steps=6, checkpoint_interval=2, hist_interval=2, eval_interval=3)


#: Not results: where in the source an operation was traced (telemetry rows name it).
_SOURCE = ("where",)


def _bits(x: Any) -> Any:
    """``x`` (a record, nested lists and dicts) with every float as its exact hex bits."""
    if isinstance(x, dict):
        return {k: _bits(v) for k, v in x.items() if k not in _SOURCE}
    if isinstance(x, (list, tuple)):
        return [_bits(v) for v in x]
    if isinstance(x, float):
        return x.hex()
    if isinstance(x, (np.floating, np.integer, np.bool_)):
        return _bits(x.item())
    return x


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:24]


def _tree_digest(tree: Any) -> str:
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(tree)):
        a = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)} {a.dtype} {a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:24]


def _summary(result: Any) -> dict[str, Any]:
    records = [{k: v for k, v in m.items() if k not in _TIMES} for m in result.metrics]
    return {
        "steps_done": result.steps_done,
        "keys": sorted({k for r in records for k in r}),
        "loss": [_bits(float(r["loss"])) for r in records],
        "grad_norm": [_bits(float(r["grad_norm"])) for r in records],
        "loss_scale": [float(r["loss_scale"]) for r in records],
        "records": _digest(_bits(records)),
        "state": _tree_digest(result.state),
        "evals": _digest(_bits(result.evals)),
        "recipe_metrics": _digest(_bits(result.recipe_metrics)),
        "aggregates": _digest(
            _bits(
                [
                    result.final_loss,
                    result.skipped_steps,
                    result.diverged,
                    result.divergence_step,
                    result.mean_underflow_fraction,
                ]
            )
        ),
    }


def run_case(name: str) -> dict[str, Any]:
    """The summary of one case (or of the resumed run, ``"resume"``)."""
    if name != "resume":
        return _summary(train(TrainConfig(**SMALL, seed=0, **CASES[name]), quiet=True))
    with tempfile.TemporaryDirectory() as d:
        first = dict(RESUME, steps=4)
        train(TrainConfig(**SMALL, **first), checkpoint_dir=d, quiet=True)
        return _summary(train(TrainConfig(**SMALL, **RESUME), checkpoint_dir=d, resume=True))


def canary() -> list[str]:
    """Bits of a float32 computation independent of the trainer: equal iff this machine's XLA
    computes float32 as the recording machine's did (as far as one sample can tell)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((48, 32)), jnp.float32)

    @jax.jit
    def f(x: jax.Array, w: jax.Array) -> jax.Array:
        h = jnp.tanh(x @ w)
        return jnp.stack([h.sum(), jnp.exp(h).mean(), jnp.log1p(jnp.abs(h)).var()])

    return [float(v).hex() for v in np.asarray(f(x, w))]


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return json.loads(DATA.read_text())


@pytest.fixture(scope="module")
def same_machine(golden: dict[str, Any]) -> bool:
    return golden["canary"] == canary() and golden["jax"] == jax.__version__


def _check(name: str, golden: dict[str, Any], same_machine: bool) -> None:
    want, got = golden["cases"][name], run_case(name)
    assert got["keys"] == want["keys"] and got["steps_done"] == want["steps_done"]
    if same_machine:
        assert got == want, {k: (got[k], want[k]) for k in want if got[k] != want[k]}
        return
    for key in ("loss", "grad_norm"):
        a = [float.fromhex(v) for v in got[key]]
        b = [float.fromhex(v) for v in want[key]]
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=0, err_msg=f"{name} {key}")
    assert got["loss_scale"] == want["loss_scale"]


@pytest.mark.parametrize("name", DEFAULT)
def test_hooked_runs_are_bitwise_the_recorded_ones(name, golden, same_machine):
    _check(name, golden, same_machine)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*sorted(set(CASES) - set(DEFAULT)), "resume"])
def test_more_runs_are_bitwise_the_recorded_ones(name, golden, same_machine):
    _check(name, golden, same_machine)


def test_the_golden_file_names_every_case_and_its_machine(golden):
    assert sorted(golden["cases"]) == sorted([*CASES, "resume"])
    assert len(golden["canary"]) == 3 and all(isinstance(v, str) for v in golden["canary"])
    # the bits differ from step to step: a record that stopped changing would show here
    assert all(len(set(c["loss"])) == len(c["loss"]) for c in golden["cases"].values())


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite " + str(DATA))
    args = parser.parse_args(argv)
    out = {
        "jax": jax.__version__,
        "canary": canary(),
        "cases": {n: run_case(n) for n in [*CASES, "resume"]},
    }
    if args.update:
        DATA.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    else:
        print(json.dumps(out, indent=1, sort_keys=True))
    assert all(math.isfinite(float.fromhex(v)) for v in out["canary"])


if __name__ == "__main__":
    main(sys.argv[1:])
