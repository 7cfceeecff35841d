"""``diagnose``'s capture of a model with a ``lax.cond``: the branch that ran is captured
(operands, output and output cotangent equal numpy's), the untaken branch's entries are left
out of that step's captures; a matmul inside a while loop is named as not captured."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from precisionlab.diagnose._capture import Capture
from precisionlab.mixed import NoLossScale, get_policy


def _loss_fn(policy, capture=True):
    def loss(p, batch):
        x = batch["x"]
        with jax.named_scope("layer0"):
            y = lax.cond(batch["flag"], lambda x: x @ p["w1"], lambda x: 3.0 * (x @ p["w2"]), x)
        with jax.named_scope("layer1"):  # a while loop (on data only: reverse mode
            # does not differentiate through one)
            m = lax.fori_loop(0, batch["n"], lambda _, m: m @ batch["a"], batch["a"])
        return jnp.sum(y * y) + 0.0 * jnp.sum(m), {"activations": {}}

    return loss


def _setup():
    model = SimpleNamespace(remat=False, layer_names=lambda: ["layer0", "layer1"])
    model.loss_fn = _loss_fn
    return SimpleNamespace(
        config=SimpleNamespace(loss_weight=1.0),
        policy=get_policy("float32"),
        model=model,
        options=SimpleNamespace(fp32_params=(), recipe=None),
    )


def test_capture_keeps_the_branch_that_ran_only():
    params = {
        "w1": jnp.full((4, 3), 0.5, jnp.float32),
        "w2": jnp.full((4, 3), -0.25, jnp.float32),
    }
    state = SimpleNamespace(params=params, loss_scale=NoLossScale(), recipe_state=None)
    x = np.arange(32, dtype=np.float64).reshape(8, 4) - 7.0
    cap = Capture(_setup())
    # lax.cond lists its branches false first: the false branch's matmul is site 0
    for flag, ran, other, w, scale in (
        (True, "dot_general[1]", "dot_general[0]", 0.5, 1.0),
        (False, "dot_general[0]", "dot_general[1]", -0.25, 3.0),
    ):
        batch = {"x": jnp.asarray(x, jnp.float32), "flag": jnp.bool_(flag), "n": jnp.int32(1)}
        batch["a"] = jnp.eye(3, dtype=jnp.float32)
        got = cap(state, batch)
        y = x @ np.full((4, 3), w)
        expect = {"lhs": x, "rhs": np.full((4, 3), w), "out": y, "grad": 2 * scale**2 * y}
        for part, v in expect.items():
            np.testing.assert_array_equal(got[f"layer0:{ran}.{part}"], v, err_msg=f"{flag}")
            assert f"layer0:{other}.{part}" not in got, (flag, part)
        assert cap.uncaptured == ["dot_general[2]"]  # the while loop's matmul
    assert {t.match for t in cap.tensors if t.kind == "grad"} == {
        "layer0:matmul[0].grad",
        "layer0:matmul[1].grad",
    }
