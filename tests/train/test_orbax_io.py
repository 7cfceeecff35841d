"""Orbax export/import of checkpoints: bitwise round trips, readable by plain Orbax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

ocp = pytest.importorskip("orbax.checkpoint")

from precisionlab.mixed import Storage  # noqa: E402
from precisionlab.train import make_model, make_train_step, save_checkpoint  # noqa: E402
from precisionlab.train._checkpoint import load_checkpoint  # noqa: E402
from precisionlab.train.orbax_io import (  # noqa: E402
    export_checkpoint,
    import_checkpoint,
    load_orbax,
    save_orbax,
)


def _raw(x) -> np.ndarray:
    x = np.ascontiguousarray(np.asarray(x))
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def _bitwise(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(_raw(x), _raw(y))


@pytest.fixture(scope="module")
def state():
    """A real TrainState (bf16 params and moments, dynamic loss scale, Adam), its float leaves
    filled with random bit patterns so the round trip is checked on every bit (no step is run:
    compiling one would take most of this file's time)."""
    model = make_model("mlp", in_dim=8, width=16, depth=1, num_classes=3)
    _, st = make_train_step(
        model.loss_fn("p=f32,c=bf16"),
        model.init(jax.random.PRNGKey(0)),
        optax.adam(1e-2),
        policy="p=f32,c=bf16",
        loss_scale="dynamic",
        storage=Storage(params="bfloat16", opt_state="bfloat16"),
    )
    rng = np.random.default_rng(0)

    def scramble(x):
        x = np.asarray(jax.device_get(x))
        if not np.issubdtype(x.dtype, np.floating) and x.dtype != jnp.bfloat16:
            return x
        width = {2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
        return rng.integers(0, np.iinfo(width).max, x.shape, dtype=width).view(x.dtype)

    return jax.tree.map(scramble, st)


def test_a_training_checkpoint_round_trips_through_orbax_bitwise(tmp_path, state):
    assert state.params["hidden"][0]["w"].dtype == jnp.bfloat16
    ckpt = save_checkpoint(tmp_path / "ours", state, step=2, extra={"data": {"position": 2}})
    orb = export_checkpoint(ckpt, tmp_path / "orbax", state)
    back = import_checkpoint(orb, tmp_path / "again", state)
    restored, step, extra = load_checkpoint(back, state)
    _bitwise(restored, state)
    assert (step, extra) == (2, {"data": {"position": 2}})


def test_plain_orbax_reads_the_state_by_name_in_its_own_dtypes(tmp_path, state):
    save_orbax(tmp_path / "o", state, step=2)
    tree = ocp.StandardCheckpointer().restore((tmp_path / "o" / "state").resolve())
    w = tree["params"]["hidden"]["0"]["w"]
    assert np.asarray(w).dtype == np.dtype(jnp.bfloat16)
    np.testing.assert_array_equal(_raw(w), _raw(state.params["hidden"][0]["w"]))


def test_every_dtype_survives_bitwise(tmp_path):
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 256, 64, dtype=np.uint8)
    tree = {
        "e4m3": bits.view(ml_dtypes.float8_e4m3fn).reshape(8, 8),  # NaN patterns included
        "e5m2": bits.view(ml_dtypes.float8_e5m2),
        "bf16": rng.integers(0, 2**16, 16, dtype=np.uint16).view(ml_dtypes.bfloat16),
        "f16": rng.integers(0, 2**16, 16, dtype=np.uint16).view(np.float16),
        "f32": rng.standard_normal(5).astype(np.float32),
        "key": np.array([7, 9], np.uint32),
        "step": np.int32(5),
        "layers": [np.ones(2, np.float32), np.zeros((), np.float32)],
    }
    save_orbax(tmp_path / "o", tree, step=5, extra={"note": "x"})
    got, step, extra = load_orbax(tmp_path / "o", tree)
    _bitwise(got, tree)
    assert (step, extra) == (5, {"note": "x"})


def test_mismatches_and_bad_destinations_are_clear_errors(tmp_path):
    tree = {"w": np.ones((2, 3), np.float32)}
    save_orbax(tmp_path / "o", tree, step=1)
    with pytest.raises(ValueError, match="already exists"):
        save_orbax(tmp_path / "o", tree, step=1)
    with pytest.raises(ValueError, match=r"'w': float32\[2, 3\] does not match .*float32\[3, 2\]"):
        load_orbax(tmp_path / "o", {"w": np.ones((3, 2), np.float32)})
    with pytest.raises(ValueError, match="has no leaf 'v'"):
        load_orbax(tmp_path / "o", {"v": np.ones((2, 3), np.float32)})
    with pytest.raises(ValueError, match="no Orbax checkpoint"):
        load_orbax(tmp_path / "missing", tree)
