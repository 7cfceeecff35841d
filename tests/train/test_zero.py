"""ZeRO stages 0-3 over 8 host devices: numerics, per-device memory, resume across device counts.

Numerics. The 8-device step computes each device's gradient of its 8 examples and sums the 8
partial gradients in device order (the CPU backend's all-reduce and reduce-scatter both add
sequentially, device 0 first); a single device with 8 micro-batches of 8 examples does the same
additions in the same order (``lax.scan`` accumulation). So the oracle for every stage is that
single-device run, bitwise: loss curve, params and optimizer state. (Stages only move elements
between devices; the update is elementwise.) Against the plain single-device run (one reduction
over the 64 examples, in another order) the losses agree within the rounding bound of a float32
sum of B = 64 non-negative terms in two orders: |a - b| <= 2 gamma_(B-1) sum|l_i| / B with
gamma_k = k u / (1 - k u), u = 2^-24 (Higham, Accuracy and Stability, Sec. 4.2), so a relative
tolerance of 2 gamma_63 (7.5e-6) per step; the first step is exactly that bound (same params);
later steps carry the gradients' reduction differences too, checked against ``steps`` times it.

Memory. XLA's ``memory_analysis()`` of the compiled step (per device) against
:func:`precisionlab.memory._zero.zero_state_bytes`, counted from the leaves' shapes.

Every check runs in a subprocess: the device count must be set before JAX starts its backend.
"""

import textwrap

import pytest
from _host_devices import run_on_host_devices

PRELUDE = textwrap.dedent(
    """
    import tempfile
    import jax, jax.numpy as jnp, numpy as np, optax
    assert jax.device_count() == 8, jax.devices()
    from precisionlab.train import LoopOptions, StepOptions, build_step, make_data, make_model
    from precisionlab.train import parse_step_options, train_loop
    from precisionlab.train._parallel import place_state, shard_batch

    data = make_data("teacher")
    model = make_model("mlp", width=32, **data.model_kwargs())  # a 10-class head: replicated
    params = model.init(jax.random.PRNGKey(0))
    B = 64

    def run(policy="p=f32,c=f32,o=f32", dp=False, stage=0, mb=1, steps=4, **kw):
        options = parse_step_options(
            policy=policy, data_parallel=dp, zero_stage=stage, microbatches=mb, **kw
        )
        loss_fn = model.loss_fn(policy)
        example = data.batch(0, B)  # traced by a stateful recipe (delayed scaling)
        step, state, mesh = build_step(loss_fn, params, optax.adam(1e-2), options, example)
        state = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), state)
        if mesh is not None:
            state = place_state(state, mesh, stage)
        js = jax.jit(step, donate_argnums=0)
        losses = []
        for i in range(steps):
            b = data.batch(i, B)
            state, m = js(state, b if mesh is None else shard_batch(b, mesh))
            losses.append(float(m["loss"]))
        return np.array(losses), state

    def same(a, b):
        la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
        return len(la) == len(lb) and all(
            np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)
        )

    u = 2.0**-24
    gamma = lambda k: k * u / (1 - k * u)  # noqa: E731
    """
)


def _run(script: str, timeout: int = 600) -> str:
    return run_on_host_devices(PRELUDE + textwrap.dedent(script), devices=8, timeout=timeout)


NUMERICS = """
acc_losses, acc = run(mb=8)                      # one device, 8 micro-batches of 8
plain_losses, plain = run()                      # one device, one reduction over 64
for stage in (0, 1, 2, 3):
    losses, state = run(dp=8, stage=stage)
    assert np.array_equal(losses, acc_losses), (stage, losses, acc_losses)
    assert same(state.params, acc.params) and same(state.opt_state, acc.opt_state), stage
    rel = np.abs(losses - plain_losses) / plain_losses
    assert rel[0] <= 2 * gamma(B - 1), (stage, rel)
    assert np.all(rel <= len(rel) * 2 * gamma(B - 1)), (stage, rel)
    # the layout is the stage's: optimizer state split from stage 1, params at stage 3
    w = state.params["hidden"][0]["w"]
    mu = state.opt_state[0].mu["hidden"][0]["w"]
    assert len(w.addressable_shards[0].data) == (4 if stage == 3 else 32), stage
    assert len(mu.addressable_shards[0].data) == (4 if stage >= 1 else 32), stage
    head = state.opt_state[0].mu["out"]["b"]         # 10 classes on 8 devices: replicated
    assert head.addressable_shards[0].data.shape == (10,)
    if stage == 0:
        full, end = losses, jax.device_get(state)
# from a TrainConfig (the TOML path): bf16 compute on float32 master weights, dynamic loss
# scaling, ZeRO-3 on 8 devices = one device with 8 micro-batches, bitwise
from precisionlab.train import TrainConfig, train
cfg = dict(
    model="mlp", model_kwargs={"width": 32}, batch_size=B, steps=3, lr=1e-2, eval_batches=1,
    policy="p=f32,c=bf16,o=f32", loss_scale="dynamic", progress=False,
)
z3 = train(TrainConfig(**cfg, data_parallel=True, zero_stage=3))
m8 = train(TrainConfig(**cfg, microbatches=8))
assert [r["loss"] for r in z3.metrics] == [r["loss"] for r in m8.metrics]
assert same(jax.device_get(z3.state), jax.device_get(m8.state))
assert "data" in str(z3.state.params["hidden"][0]["w"].sharding.spec)
"""


MIXED = """
plain_losses, _ = run()
# mixed precision with dynamic loss scaling, bf16 params (the update applied with Kahan
# compensation, sharded with the optimizer state) and a bf16 reduce-scatter
kw = dict(policy="p=f32,c=bf16,o=f32", loss_scale="dynamic", allreduce_dtype="bfloat16")
from precisionlab.mixed._storage import Storage
kw["storage"] = Storage(params="bfloat16", update="kahan")
ref_losses, ref = run(mb=8, **kw)
for stage in (0, 3):
    losses, state = run(dp=8, stage=stage, **kw)
    if stage == 0:  # a bf16 all-reduce rounds each partial sum: not the f32 accumulation
        base_losses, base = losses, state
        assert np.array_equal(losses[:1], ref_losses[:1]), (losses, ref_losses)
    assert np.array_equal(losses, base_losses) and same(state, base), stage
# stochastic rounding of the update into bf16 params: its random bits do not depend on the
# layout (JAX's partitionable threefry)
sr = dict(storage=Storage(params="bfloat16", update="stochastic"))
sr_losses, sr_state = run(dp=8, stage=0, **sr)
losses, state = run(dp=8, stage=2, **sr)
assert np.array_equal(losses, sr_losses) and same(state, sr_state)
# gradient accumulation inside each device (2 micro-batches of 4) and delayed FP8 scaling
# (its amax history is replicated state): every stage equals stage 0 bitwise
from precisionlab.train._recipe import parse_recipe
rec = parse_recipe({"name": "delayed", "amax_history_len": 2})
for extra in (dict(mb=2), dict(recipe=rec)):
    base_losses, base = run(dp=8, stage=0, **extra)
    for stage in (1, 2, 3):
        losses, state = run(dp=8, stage=stage, **extra)
        assert np.array_equal(losses, base_losses) and same(state, base), (stage, extra)
    if "mb" in extra:
        rel = np.abs(base_losses - plain_losses) / plain_losses
        assert np.all(rel <= 3 * 2 * gamma(B - 1)), rel
    else:  # amaxes: max over devices = max over micro-batches; so one device, 8 micro-batches
        one_losses, one = run(mb=8, **extra)
        assert np.array_equal(base_losses, one_losses), (base_losses, one_losses)
        assert same(jax.device_get(base.recipe_state), jax.device_get(one.recipe_state))
print("OK")
"""


def test_stages_numerics_memory_and_resume():
    """One subprocess (its start is seconds): stages 0-3 against one device, the per-device
    memory of stage 3, a stage-3 checkpoint of 8 devices resumed on 4 at stage 2."""
    memory = MEMORY.replace("STAGES", "(3,)").replace('print("OK")', "")
    _run(NUMERICS + memory + RESUME.replace("SAME_COUNT", "False") + 'print("OK")')


@pytest.mark.slow
def test_stages_mixed_precision_bitwise():
    _run(MIXED)


MEMORY = """
from precisionlab.memory._zero import measure_zero_table, zero_state_bytes
table = dict(model="mlp", model_kwargs={"width": 32}, batch_size=64, optimizer="adam")
n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
for stage in STAGES:
    rep = measure_zero_table(table, zero_stage=stage, dp=8)
    rows = {r["name"]: r for r in rep["rows"]}
    for name in ("params", "optimizer state", "arguments", "outputs"):
        assert rows[name]["estimated"] == rows[name]["measured"], (stage, rows[name])
    # by hand: the 10-class head bias (10) is the only leaf no axis of which divides by 8
    split = (n_params - 10) // 8 + 10
    want_p = 4 * (split if stage == 3 else n_params)
    want_o = 2 * 4 * (split if stage >= 1 else n_params)
    assert rows["params"]["measured"] == want_p, (stage, rows["params"], want_p)
    assert rows["optimizer state"]["measured"] == want_o, (stage, rows["optimizer state"])
    assert rows["gradients"]["estimated"] == 4 * (split if stage >= 2 else n_params)
    # bf16 params with Kahan compensation, fp8 optimizer state (per-tensor float32 scales),
    # dynamic loss scaling, 2 micro-batches per device
    mixed = dict(
        table, policy="p=f32,c=bf16,o=f32", loss_scale="dynamic", microbatches=2,
        params_dtype="bfloat16", update_rounding="kahan", opt_state_dtype="float8_e4m3fn",
    )
    rows = {r["name"]: r for r in measure_zero_table(mixed, zero_stage=stage, dp=8)["rows"]}
    for name in ("params", "optimizer state", "arguments", "outputs"):
        assert rows[name]["estimated"] == rows[name]["measured"], (stage, rows[name])
    assert rows["optimizer state"]["measured"] == 2 * (split if stage >= 1 else n_params)
print("OK")
"""


TEXTBOOK = """
# A transformer whose leaves all divide by 8: the per-leaf count equals the flat
# ceil(n_params / 8) of the preset estimator (float32: no separate master copy)
from precisionlab.memory import TrainSetup, estimate
from precisionlab.memory._builtin import transformer_spec
table = dict(model="transformer", data="markov", batch_size=32, optimizer="adam")
spec = None
for stage in (0, 1, 2, 3):
    rep = measure_zero_table(table, zero_stage=stage, dp=8)
    rows = {r["name"]: r for r in rep["rows"]}
    if spec is None:
        from precisionlab.train import TrainConfig, build
        spec = transformer_spec(build(TrainConfig.from_dict(table)).model)
    b = estimate(spec, TrainSetup(policy="f32", zero_stage=stage, dp=8, batch=32))
    assert rows["params"]["measured"] == b.weights, (stage, rows["params"], b.weights)
    assert rows["optimizer state"]["measured"] == b.optimizer_state, stage
    assert rows["gradients"]["estimated"] == b.gradients, stage
    assert rows["arguments"]["estimated"] == rows["arguments"]["measured"], stage
print("OK")
"""


@pytest.mark.slow
def test_per_device_memory_equals_estimate_every_stage():
    _run(MEMORY.replace("STAGES", "(0, 1, 2, 3)").replace('print("OK")', "") + TEXTBOOK)


RESUME = """
from precisionlab.train._checkpoint import load_checkpoint

def loop(dp, stage, steps, ckpt=None, resume=False, mb=1):
    loss_fn = model.loss_fn("p=f32,c=f32,o=f32")
    out = train_loop(
        loss_fn, params, optax.adam(1e-2), lambda s: (data.batch(i, B) for i in range(s, 99)),
        options=StepOptions(data_parallel=dp, zero_stage=stage, microbatches=mb),
        loop=LoopOptions(steps=steps, checkpoint_dir=ckpt, resume=resume, progress=False),
    )
    return np.array([r["loss"] for r in out.metrics]), out.state

with tempfile.TemporaryDirectory() as d:
    first, mid = loop(8, 3, 2, ckpt=d)              # written by 8 devices at stage 3
    assert np.array_equal(first, full[:2])
    saved, step, _ = load_checkpoint(d, jax.device_get(mid))
    assert step == 2 and same(saved, jax.device_get(mid))  # full arrays, gathered
    assert saved.params["hidden"][0]["w"].shape == (32, 32)
    import shutil
    shutil.copytree(d, d + "_8")
    # 4 devices at stage 2 (2 micro-batches each: another order): within the rounding bound
    rest4, last4 = loop(4, 2, 4, ckpt=d, resume=True, mb=2)
    assert len(last4.opt_state[0].mu["hidden"][0]["w"].sharding.device_set) == 4
    rel = np.abs(rest4 - full[2:]) / full[2:]
    assert np.all(rel <= 4 * 2 * gamma(B - 1)), rel
    if SAME_COUNT:  # 8 devices at stage 1: the same order, so bitwise the uninterrupted run
        rest, last = loop(8, 1, 4, ckpt=d + "_8", resume=True)
        assert np.array_equal(rest, full[2:]) and same(jax.device_get(last), end)
    shutil.rmtree(d + "_8")
"""


@pytest.mark.slow
def test_resume_across_layouts_bitwise():
    _run(NUMERICS + RESUME.replace("SAME_COUNT", "True") + 'print("OK")')


def test_zero_stage_errors_name_the_value(capsys):
    from precisionlab.cli import main
    from precisionlab.memory._zero import zero_state_bytes
    from precisionlab.train import StepOptions, TrainConfig

    with pytest.raises(ValueError, match="needs data_parallel"):
        TrainConfig(zero_stage=1)
    with pytest.raises(ValueError, match=r"train\.zero_stage: unknown value 4; allowed: 0, 1"):
        TrainConfig.from_dict({"zero_stage": 4, "data_parallel": True})
    with pytest.raises(ValueError, match="needs data_parallel"):
        StepOptions(zero_stage=2)
    with pytest.raises(ValueError, match="got True"):
        StepOptions(zero_stage=True, data_parallel=True)
    with pytest.raises(ValueError, match="got 5"):
        zero_state_bytes({}, stage=5, dp=2, param_dtype="f4", opt_state_dtype="f4", optimizer="sgd")
    assert TrainConfig(zero_stage=3, data_parallel=True).zero_stage == 3
    # this process has fewer devices than --dp: one line, exit 2
    argv = [
        "memory",
        "--zero-stage",
        "2",
        "--dp",
        "4096",
        "--measure",
        "experiments/tiny_train.toml",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dp 4096 needs 4096 devices" in err[0], err


def test_zero_state_bytes_by_hand():
    import jax
    import numpy as np

    from precisionlab.memory._zero import leaf_elements_per_device, zero_state_bytes

    shapes = {
        "w": jax.ShapeDtypeStruct((6, 16), np.float32),
        "b": jax.ShapeDtypeStruct((10,), np.float32),
    }
    assert leaf_elements_per_device((6, 16), 8, True) == 12  # axis 1 divides
    assert leaf_elements_per_device((10,), 8, True) == 10  # replicated
    assert leaf_elements_per_device((6, 16), 8, False) == 96
    got = zero_state_bytes(
        shapes,
        stage=2,
        dp=8,
        param_dtype="bfloat16",
        opt_state_dtype="float32",
        optimizer="adam",
        kahan=True,
    )
    assert got == {
        "params": 106 * 2,  # stage 2 keeps params whole
        "gradients": (12 + 10) * 4,
        "optimizer_state": 2 * (12 + 10) * 4,
        "compensation": (12 + 10) * 2,
    }
