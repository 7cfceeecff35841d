"""Runs that differ only in values (learning rate, optimizer eps, loss weight, seed) share one
compiled program (precisionlab.train._programs), and give the numbers of separately compiled
runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precisionlab.train import TrainConfig, train
from precisionlab.train import _programs as programs
from precisionlab.train._compose import program_key, run_values

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


# --- a recipe's value fields -----------------------------------------------------------------
RECIPE_BASE = {**BASE, "hist_interval": 0, "policy": "p=f32,c=bf16,o=f32"}


def _with_recipe(recipe, **more) -> TrainConfig:
    return TrainConfig(**{**RECIPE_BASE, "recipe": recipe, **more})


def test_recipe_value_fields_leave_the_program_key_alone():
    def key(recipe):
        return program_key(_with_recipe(recipe))

    assert key("current") == key({"name": "current", "eps": 0.05})
    assert key({"name": "delayed", "margin": 0}) == key({"name": "delayed", "margin": 3})
    assert key("rowwise") == key({"name": "rowwise", "eps": 1e-3})
    assert key("nvfp4") == key({"name": "nvfp4", "hadamard_seed": 5})
    # structural fields (shapes, formats, flags, a floor or none) are part of the key
    for a, b in [
        ("current", {"name": "current", "eps": 0.0}),
        ("current", {"name": "current", "pow2_scales": True}),
        ({"name": "delayed", "amax_history_len": 4}, {"name": "delayed", "amax_history_len": 8}),
        ("nvfp4", {"name": "nvfp4", "hadamard": False}),
        ("mxfp8", {"name": "mxfp8", "block": 16}),
        ("rowwise", "rowwise_with_gw_hp"),
    ]:
        assert key(a) != key(b), (a, b)


def test_recipe_numbers_are_the_value_fields():
    from precisionlab.recipes import NVFP4, Current, Delayed, Rowwise
    from precisionlab.recipes._scaling import hadamard_matrix

    assert Delayed(margin=5).numbers() == {"margin_scale": np.float32(32.0)}
    # the floor is the smallest float32 >= eps (0.7 and 0.05 round down and up to float32),
    # the clamp fmt_max / eps rounded once from float64 (E4M3 forward, E5M2 gradients)
    for eps in (0.7, 0.05):
        lo = Current(eps=eps).numbers()["eps_lo"]
        assert float(lo) >= eps > float(np.nextafter(lo, np.float32(0)))
    n = Current(eps=0.05).numbers()
    assert n["eps_clamp_x"] == np.float32(8960.0) and n["eps_clamp_g"] == np.float32(1146880.0)
    assert Current(eps=0.7).numbers()["eps_clamp_x"] == np.float32(448 / 0.7)
    assert Current(eps=0.0).numbers() == {} and Rowwise(eps=0.0).numbers() == {}
    assert Rowwise(eps=0.5).numbers()["eps_clamp_g"] == np.float32(896.0)  # E4M3 throughout
    np.testing.assert_array_equal(NVFP4(hadamard_seed=5).numbers()["hadamard"],
                                  hadamard_matrix(5, 16))  # fmt: skip
    assert NVFP4(hadamard=False).numbers() == {}


def _recipe_case(name):
    from precisionlab.recipes import NVFP4, Current, Delayed, Rowwise

    return {
        "current": Current(eps=0.05),
        "delayed": Delayed(margin=3, amax_history_len=2),
        "rowwise": Rowwise(eps=0.01),
        "nvfp4": NVFP4(hadamard_seed=5, pad=True),
    }[name]


SLOW_CASES = ("delayed", "rowwise", "nvfp4")


@pytest.mark.parametrize(
    "name", ["current", *(pytest.param(n, marks=pytest.mark.slow) for n in SLOW_CASES)]
)
def test_recipe_numbers_as_arguments_give_the_bits_of_constants(name):
    """A recipe computing with its numbers passed as arguments of the jitted function gives
    the bits of the same recipe with them as constants (the compares, selects, divisions by a
    power of two and the Hadamard product it uses them in are the same operations)."""
    from precisionlab.recipes import apply

    recipe = _recipe_case(name)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    # small weights and inputs: amaxes below eps, so the floor decides some scales
    w = 0.02 * jax.random.normal(keys[0], (32, 16))
    x = 0.03 * jax.random.normal(keys[1], (16, 32)) + jnp.arange(32.0) * 1e-3

    def loss(w, x):  # one matmul: fprop, dgrad and wgrad quantized
        return jnp.sum((x @ w) ** 2)

    def run(r, state, p, x, key):
        applied = apply(loss, r)
        out, grads, observed = applied.value_and_grad()(state, p, x, key=key)
        return out, grads, applied.update_state(state, observed)

    state = apply(loss, recipe).init_state(w, x)
    key = jax.random.PRNGKey(1)
    const = jax.jit(lambda s, p, x, k: run(recipe, s, p, x, k))(state, w, x, key)
    nums = {k: jnp.asarray(v) for k, v in recipe.numbers().items()}
    args = jax.jit(lambda n, s, p, x, k: run(recipe.with_numbers(n), s, p, x, k))(
        nums, state, w, x, key
    )
    a, b = jax.tree_util.tree_leaves(const), jax.tree_util.tree_leaves(args)
    assert [np.asarray(v).tobytes() for v in a] == [np.asarray(v).tobytes() for v in b]
    # and the numbers are used: other numbers, other bits
    other = {k: v * 2 for k, v in nums.items()}
    moved = jax.jit(lambda n, s, p, x, k: run(recipe.with_numbers(n), s, p, x, k))(
        other, state, w, x, key
    )
    assert [np.asarray(v).tobytes() for v in jax.tree_util.tree_leaves(moved)] != [
        np.asarray(v).tobytes() for v in a
    ]


@pytest.mark.parametrize(
    "first,second",
    [
        ("current", {"name": "current", "eps": 0.05}),
        pytest.param(
            {"name": "delayed", "amax_history_len": 2},
            {"name": "delayed", "amax_history_len": 2, "margin": 4},
            marks=pytest.mark.slow,
            id="delayed-margin",
        ),
        pytest.param(
            "nvfp4", {"name": "nvfp4", "hadamard_seed": 5}, marks=pytest.mark.slow, id="nvfp4-seed"
        ),
    ],
)
def test_runs_differing_in_recipe_values_share_one_compilation(compiles, first, second):
    programs.clear()
    ran = train(_with_recipe(first), quiet=True)
    assert compiles, "the first run compiles its programs"
    compiles.clear()
    shared = train(_with_recipe(second), quiet=True)
    assert compiles == [], "the second run reuses the first run's compiled programs"
    # the second run's numbers are used, not the first run's constants
    assert [m["loss"] for m in shared.metrics] != [m["loss"] for m in ran.metrics]
    programs.clear()
    alone = train(_with_recipe(second), quiet=True)
    assert compiles, "after clear() the run compiles again"
    assert _numbers(shared) == _numbers(alone)
