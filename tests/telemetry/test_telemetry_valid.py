"""Training telemetry of a user's model with a ``lax.cond``: the branch that did not run gives
no matmul row (its statistics would be of zeros), and the branch that ran gives rows whose
counts equal a numpy recount of its tensors."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from precisionlab.mixed import NoLossScale, get_policy
from precisionlab.train._telemetry import Telemetry, make_telemetry_fn, telemetry_rows


def _loss(params, batch):
    x = batch["x"]

    def first(x):
        return x @ params["w1"]

    def second(x):
        return 3.0 * (x @ params["w2"])

    y = lax.cond(batch["flag"], first, second, x)
    return jnp.sum(y * y), {}


_TEL = Telemetry(interval=1, targets=("fp16",), state=False, ops=False)  # the matmuls
_FN = make_telemetry_fn(_loss, get_policy("float32"), _TEL)
_JIT = jax.jit(_FN)  # one compile: the branch taken is data


def _rows(flag: bool) -> list[dict]:
    params = {"w1": jnp.full((4, 3), 0.5, jnp.float32), "w2": jnp.full((4, 3), -0.25, jnp.float32)}
    batch = {"x": jnp.arange(32, dtype=jnp.float32).reshape(8, 4) - 7.0, "flag": jnp.bool_(flag)}
    g32 = jax.tree.map(jnp.zeros_like, params)
    out = _JIT(params, None, NoLossScale(), g32, batch, jnp.int32(0))
    rows = telemetry_rows(jax.device_get(out), _FN.names, 1, _TEL.targets)
    assert len(_FN.names["matmul"]) == 8  # two sites x (lhs, rhs, out, grad), both traced
    return rows


def test_untaken_cond_branch_gives_no_rows():
    x = np.arange(32, dtype=np.float64).reshape(8, 4) - 7.0
    # lax.cond lists its branches false first: the false branch's matmul is site 0
    for flag, ran, w in ((True, "dot_general[1]", 0.5), (False, "dot_general[0]", -0.25)):
        rows = _rows(flag)
        assert {r["site"] for r in rows} == {ran}, flag
        by = {r["tensor"]: r for r in rows}
        assert sorted(by) == ["grad", "lhs", "out", "rhs"]
        y = x @ np.full((4, 3), w)
        scale = 1.0 if flag else 3.0
        expect = {"lhs": x, "rhs": np.full((4, 3), w), "out": y, "grad": 2 * scale**2 * y}
        for t, v in expect.items():
            assert by[t]["n"] == v.size, (flag, t)
            assert by[t]["n_zero"] == int(np.sum(v == 0)), (flag, t)
            assert by[t]["amax"] == float(np.max(np.abs(v))), (flag, t)
