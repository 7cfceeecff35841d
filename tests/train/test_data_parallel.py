"""Data parallelism over 4 host devices equals one device within float32 tolerance.

The check runs in a subprocess because the device count must be set (XLA_FLAGS) before jax is
imported.
"""

import textwrap

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, optax
    assert jax.device_count() == 4, jax.devices()
    from precisionlab.train import build_step, make_data, make_model, parse_step_options
    from precisionlab.train._parallel import local_mesh, shard_batch

    data = make_data("teacher")
    model = make_model("mlp", width=32, **data.model_kwargs())
    params = model.init(jax.random.PRNGKey(0))
    loss_fn = model.loss_fn("p=f32,c=f32,o=f32")

    def run(dp, red=None, steps=3):
        options = parse_step_options(data_parallel=dp, allreduce_dtype=red)
        step, state, mesh = build_step(loss_fn, params, optax.adam(1e-2), options)
        assert (mesh is None) == (not dp)  # the mesh is returned, not attached to the function
        js = jax.jit(step)
        for i in range(steps):
            batch = data.batch(i, 64)
            if dp:
                batch = shard_batch(batch, mesh)
            state, m = js(state, batch)
        return state, m

    one, m1 = run(False)
    four, m4 = run(True)
    for a, b in zip(jax.tree_util.tree_leaves(one.params), jax.tree_util.tree_leaves(four.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(m1["loss"]), float(m4["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m1["grad_norm"]), float(m4["grad_norm"]), rtol=1e-5)
    # The gradient is really sharded: the batch lives on 4 devices.
    b = shard_batch(data.batch(0, 64), local_mesh())
    assert len(b["x"].sharding.device_set) == 4
    # A bfloat16 all-reduce runs and stays close (but is not the float32 result bit for bit).
    _, low = run(True, "bfloat16", steps=1)
    _, ref = run(False, steps=1)
    np.testing.assert_allclose(float(low["grad_norm"]), float(ref["grad_norm"]), rtol=1e-2)
    assert float(low["grad_norm"]) != float(ref["grad_norm"])
    try:
        shard_batch(data.batch(0, 6), local_mesh())
    except ValueError as err:
        assert "not divisible by 4" in str(err)
    else:
        raise AssertionError("expected ValueError")
    print("OK")
    """
)


def test_four_devices_match_one(run_on_host_devices):
    run_on_host_devices(SCRIPT, devices=4)
