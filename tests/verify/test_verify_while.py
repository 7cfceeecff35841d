"""verify.record of a plain step (no recipe) whose matmul sits inside a while loop."""

import json

import jax
import jax.numpy as jnp

from precisionlab import verify


def test_plain_record_skips_a_while_loops_matmul(tmp_path):
    # mypy found it: the plain mode listed a while loop's matmul as skipped but still
    # recorded it, and np.ndindex failed on its unknown iteration count (TypeError on None);
    # now it is skipped as in the recipe mode, and the matmul after the loop is recorded
    def f(w, x):
        def body(c):
            i, h = c
            return i + 1, jnp.tanh(h @ w)

        _, h = jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))
        return jnp.sum(h @ w)

    w = jnp.full((4, 4), 0.1, jnp.float32)
    x = jnp.ones((2, 4), jnp.float32)
    rec = verify.record(f, w, x, out=tmp_path / "dump", grad=False)
    manifest = json.loads((rec.path / "manifest.json").read_text())
    recorded = {s["site"]: s["recorded"] for s in manifest["sites"]}
    assert recorded == {"dot_general[0]": False, "dot_general[1]": True}
    assert manifest["skipped_sites"] == [{"site": "dot_general[0]", "why": "inside a while_loop"}]
    assert [g["site"] for g in manifest["gemms"]] == ["dot_general[1]"]
    outs = [t.status for t in verify.check(rec.path).tensors if t.role == "output"]
    assert outs == ["match"]
