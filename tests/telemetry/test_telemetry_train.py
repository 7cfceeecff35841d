"""Telemetry in the train loop and the run store (issue 13, items 1 and 3 and the acceptance).

Oracles: float16 casts and counts in numpy (RNE, subnormals included) on tensors dumped from
the same state; the per-tensor :func:`tensor_stats` (itself checked against numpy in
test_telemetry.py) for the batched :func:`stacked_stats`; single-device statistics for the
data-parallel ones.
"""

from __future__ import annotations

import json
import shutil
import struct
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _host_devices import run_on_host_devices

from precisionlab._schema import ConfigError
from precisionlab.experiments import _report as report
from precisionlab.experiments import _runner as runner
from precisionlab.experiments import _store as store
from precisionlab.telemetry import stacked_stats, tensor_stats
from precisionlab.train import TrainConfig, train
from precisionlab.train._compose import build
from precisionlab.train._step import normalize_loss_fn, weighted_loss
from precisionlab.train._telemetry import (
    Telemetry,
    auto_interval,
    make_telemetry_fn,
    parse_telemetry,
    telemetry_rows,
)

# The underflow setting of experiments/fp16_vs_bf16.toml, reduced (width 16, batch 32).
UNDERFLOW = dict(
    model="mlp",
    model_kwargs={"width": 16, "depth": 2, "activation": "tanh"},
    lr=3e-3,
    loss_weight=2.0**-16,
    optimizer_kwargs={"eps": 1e-15},
    batch_size=32,
    progress=False,
)


def test_telemetry_table_is_validated_and_defaults_to_every_tenth():
    assert parse_telemetry(None, 100) is None
    assert parse_telemetry({"enabled": False}, 100) is None
    t = parse_telemetry({}, 500)
    assert t.interval == 50 == auto_interval(500) and t.targets == ("fp16", "bf16", "e4m3:tensor")
    assert parse_telemetry({}, 30).interval == 10  # at most every 10 steps
    assert [s for s in range(25) if Telemetry(interval=10).due(s)] == [0, 10, 20]
    with pytest.raises(ConfigError, match="telemetry: unknown key 'every'"):
        TrainConfig(telemetry={"every": 3})
    with pytest.raises(ConfigError, match="telemetry target 'nope'"):
        TrainConfig(telemetry={"targets": ["nope"]})
    with pytest.raises(ConfigError, match=r"telemetry.interval: must be an int >= 0"):
        TrainConfig(telemetry={"interval": -1})
    with pytest.raises(ValueError, match="interval must be an int >= 1"):
        Telemetry(interval=0)


@pytest.mark.slow  # ~30 s of compiles on 2 cores
def test_stacked_stats_equal_one_call_per_tensor():
    rng = np.random.default_rng(1)
    sub = struct.unpack("<f", struct.pack("<I", 5))[0]  # a float32 subnormal
    xs = [
        rng.standard_normal((33, 70)).astype(np.float32) * 1e-6,
        np.array([1.0, 0.0, -0.0, np.inf, np.nan, sub, -3e-40, 7e4], np.float32),
        (rng.standard_normal((4, 70)) * 1e3).astype(jnp.bfloat16),
    ]
    targets = ("e4m3:tensor", "e4m3:row")  # both paths: one scale per tensor, per row
    got = jax.jit(lambda xs: stacked_stats(xs, targets))(xs)
    for i, x in enumerate(xs):
        ref = tensor_stats(jnp.asarray(x), targets)
        for f in ref._fields:
            a, b = np.asarray(getattr(ref, f)), np.asarray(getattr(got, f))[i]
            if f in ("mean_n", "m2_n", "power_n", "noise_n"):  # sums in another order
                np.testing.assert_allclose(b, a, rtol=1e-5, err_msg=f"tensor {i} {f}")
            else:
                assert np.array_equal(a, b, equal_nan=True), (i, f, a, b)


@pytest.mark.parametrize(
    "policy", ["p=f32,c=f32,o=f32", pytest.param("p=f32,c=f16,o=f32", marks=pytest.mark.slow)]
)
def test_underflow_fractions_equal_a_numpy_recount(policy):
    """fp16_vs_bf16's underflow setting: the activation gradients' fp16 underflow (fp32 run,
    what-if) and their zeros (fp16-noscale run, flushed) per layer equal a numpy recount of
    the tensors dumped by the same program; the train loop writes the same rows."""
    cfg = TrainConfig(
        **UNDERFLOW, policy=policy, steps=1,
        telemetry={"interval": 1, "targets": ["fp16"], "ops": False},  # matmuls: the subject
    )  # fmt: skip
    setup = build(cfg)
    tel = setup.options.telemetry
    loss_fn = weighted_loss(
        setup.loss_fn, {"loss_weight": cfg.loss_weight}
    )  # as the loop differentiates it
    fn = make_telemetry_fn(normalize_loss_fn(loss_fn), setup.policy, tel, dump=True)
    batch = next(iter(setup.data.batches(cfg.batch_size, seed=cfg.seed, start=0)))
    params = jax.tree.map(lambda p: p.astype(jnp.float32), setup.params)
    opt_state = setup.optimizer.init(params)
    g32 = jax.tree.map(jnp.zeros_like, params)
    out = jax.device_get(
        jax.jit(fn)(params, opt_state, setup.options.loss_scale, g32, batch, jnp.int32(0))
    )
    rows = telemetry_rows(out, fn.names, 1, tel.targets)
    grads = {r["site"]: r for r in rows if r["kind"] == "matmul" and r["tensor"] == "grad"}
    dumped = {
        site: np.asarray(x, np.float32)
        for (site, t, _), x in zip(fn.names["matmul"], out["tensors"]["matmul"], strict=True)
        if t == "grad" and site.startswith("dot_general[")
    }
    assert sorted(grads) == sorted(dumped) and len(dumped) == 3
    lost = []
    for site, g in dumped.items():
        nonzero = g != 0
        row = grads[site]
        assert row["n"] == g.size and row["n_zero"] == int((~nonzero).sum())
        assert row["amax"] == float(np.abs(g).max())
        assert row["amin_nonzero"] == float(np.abs(g[nonzero]).min())
        flushed = (g.astype(np.float16) == 0) & nonzero  # numpy casts with RNE
        expect = flushed.sum() / max(nonzero.sum(), 1)
        assert row["targets"]["fp16"]["underflow"] == expect
        lost.append(expect if "c=f32" in policy else row["frac_zero"])
    # the setting underflows: some layer loses most of its activation gradients in fp16
    assert max(lost) > 0.4, lost

    # the loop computes the same statistics at step 1 (another program: to float32 rounding)
    looped = train(cfg, quiet=True).metrics[0]["telemetry"]
    key = lambda r: (r["kind"], r["layer"], r["tensor"])  # noqa: E731
    assert [key(r) for r in looped if r["kind"] == "matmul"] == [
        key(r) for r in rows if r["kind"] == "matmul"
    ]
    for r in looped:
        if r["kind"] == "matmul" and r["tensor"] == "grad":
            ref = grads[r["site"]]
            assert r["n_zero"] == ref["n_zero"]
            assert r["amax"] == pytest.approx(ref["amax"], rel=1e-6)
            u, v = r["targets"]["fp16"]["underflow"], ref["targets"]["fp16"]["underflow"]
            assert abs(u - v) <= 2 / ref["n"]


TOML = """
kind = "train"
name = "tel"
[train]
model = "mlp"
steps = 6
batch_size = 32
checkpoint_interval = 3
model_kwargs = {{ width = 16, depth = 2, activation = "tanh" }}
lr = 3e-3
loss_weight = 1.52587890625e-05
optimizer_kwargs = {{ eps = 1e-15 }}
{telemetry}
[[variant]]
name = "fp32"
policy = "p=f32,c=f32,o=f32"
"""


def _events(tb_dir) -> set[str]:
    """Scalar tags of the TensorBoard event files (read with tensorboardX's protobufs)."""
    from tensorboardX.proto import event_pb2

    tags = set()
    for path in tb_dir.iterdir():
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            ev = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
            tags |= {v.tag for v in ev.summary.value}
            pos += 12 + n + 4
    return tags


def test_experiment_writes_telemetry_jsonl_summary_tensorboard_and_report(tmp_path):
    pytest.importorskip("tensorboardX")
    path = tmp_path / "tel.toml"
    path.write_text(TOML.format(telemetry='telemetry = { interval = 2, targets = ["fp16"] }'))
    run_dir = runner.run_file(path, out=tmp_path / "run", quiet=True)
    unit = run_dir / "variants" / "00-fp32"
    rows = store.read_jsonl(unit / "telemetry.jsonl")
    assert sorted({r["step"] for r in rows}) == [1, 3, 5]
    per_step = sum(r["kind"] != "op" for r in rows) // 3
    # 3 matmuls x (lhs, rhs, out, grad) + params, grads (6 leaves each) + Adam's mu, nu
    assert per_step == 3 * 4 + 6 + 6 + 12
    # and every other operation that can overflow: output and gradient, here tanh among them
    ops = {(r["layer"], r["site"], r["tensor"]) for r in rows if r["kind"] == "op"}
    assert {("layer0", "tanh[0]", "out"), ("layer0", "tanh[0]", "grad")} <= ops
    summary = store.read_json(run_dir / "summary.json")["variants"][0]["telemetry"]
    assert summary["steps"] == [1, 3, 5] and summary["targets"] == ["fp16"]
    worst = summary["worst_underflow"]
    assert worst and all(e["kind"] in ("matmul", "op", "grad") for e in worst)
    fracs = [e["fraction"] for e in worst]
    assert fracs == sorted(fracs, reverse=True)
    tags = _events(unit / "tb")
    assert "telemetry/matmul/layer0/dot_general.0/grad/amax" in tags
    assert "telemetry/grad/out.w/fp16/underflow" in tags
    assert "telemetry/opt_state/0.mu.hidden.1.w/dynamic_range" in tags
    report.write_report(run_dir)
    text = (run_dir / "report.md").read_text()
    assert "## Numerics telemetry" in text and "What-if underflow" in text
    assert (run_dir / "plots" / "telemetry_heatmap_00-fp32.png").stat().st_size > 0
    assert (run_dir / "plots" / "telemetry_range_00-fp32.png").stat().st_size > 0


@pytest.mark.slow  # two runs' compiles
def test_resume_after_a_kill_neither_loses_nor_repeats_telemetry_rows(tmp_path):
    path = tmp_path / "tel.toml"
    path.write_text(TOML.format(telemetry='telemetry = { interval = 2, targets = ["fp16"] }'))
    run_dir = runner.run_file(path, out=tmp_path / "run", quiet=True)
    unit = run_dir / "variants" / "00-fp32"
    # A kill after step 5 (checkpoint at 3): rows of steps 4-5 and a torn line are on disk.
    full = (unit / "telemetry.jsonl").read_text()
    with open(unit / "telemetry.jsonl", "a") as f:
        f.write('{"step": 6, "kind": "ma')
    status = store.read_json(unit / "status.json")
    status["status"] = "running"
    store.write_json(unit / "status.json", status)
    shutil.rmtree(unit / "checkpoints" / "step_00000006")  # the kill came before it
    runner.resume(run_dir, quiet=True)
    assert (unit / "telemetry.jsonl").read_text() == full  # nothing lost, nothing repeated


def test_experiments_turn_telemetry_on_by_default(tmp_path):
    from precisionlab.experiments._config import load_experiment

    path = tmp_path / "tel.toml"
    path.write_text(TOML.format(telemetry=""))
    exp = load_experiment(path)
    assert exp.units[0].config.telemetry == {}
    assert build(exp.units[0].config).options.telemetry.interval == 10
    path.write_text(TOML.format(telemetry="telemetry = { enabled = false }"))
    assert build(load_experiment(path).units[0].config).options.telemetry is None
    assert TrainConfig().telemetry is None  # the library's default: off


DP_SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np, optax
    assert jax.device_count() == 4
    from precisionlab.train import build_step, make_data, make_model, parse_step_options
    from precisionlab.train._parallel import shard_batch
    from precisionlab.train._telemetry import Telemetry, telemetry_rows

    data = make_data("teacher")
    model = make_model("mlp", width=32, **data.model_kwargs())
    params = model.init(jax.random.PRNGKey(0))
    loss_fn = model.loss_fn("p=f32,c=f32,o=f32")
    tel = Telemetry(interval=1, targets=("fp16", "e4m3:tensor"))

    def rows(**kw):
        opts = parse_step_options(telemetry=tel, **kw)
        step, state, mesh = build_step(loss_fn, params, optax.adam(1e-2), opts)
        batch = data.batch(0, 64)
        if mesh is not None:
            batch = shard_batch(batch, mesh)
        _, m = jax.jit(step)(state, batch)
        return telemetry_rows(jax.device_get(m["telemetry"]), step.telemetry_names, 1, tel.targets)

    one, four, micro = rows(), rows(data_parallel=True), rows(microbatches=4)
    for other in (four, micro):
        assert len(one) == len(other)
        for a, b in zip(one, other):
            assert (a["kind"], a["layer"], a["tensor"]) == (b["kind"], b["layer"], b["tensor"])
            if a["tensor"] == "grad":
                continue  # each shard's / micro-batch's loss is its own mean: cotangents x4
            # the weight operand is the same on every shard / micro-batch: counted 4 times
            copies = 4 if a["tensor"] == "rhs" else 1
            if a["n"] == 1:
                # a scalar of the whole batch (the loss's sum, its count, its mean) is one value
                # per shard / micro-batch: 4 values, whose statistics are not the whole batch's
                assert b["n"] == 4, (a["layer"], a["tensor"], b["n"])
                continue
            # (matmuls on a shard round like the whole batch's only up to float32 blocking)
            assert a["n"] * copies == b["n"], (a["layer"], a["tensor"], a["n"], b["n"])
            assert abs(a["n_zero"] * copies - b["n_zero"]) <= 2 * copies, (a, b)
            for k, rtol in (("amax", 1e-4), ("amin_nonzero", 1e-2), ("mean", 1e-4), ("std", 1e-4)):
                if a[k] is None or b[k] is None:
                    assert a[k] == b[k], (a["layer"], k, a[k], b[k])
                    continue
                assert np.isclose(a[k], b[k], rtol=rtol, atol=1e-7), (a["layer"], k, a[k], b[k])
            ua, ub = a["targets"]["fp16"]["underflow"], b["targets"]["fp16"]["underflow"]
            assert abs(ua - ub) <= 2 / a["n"], (a["layer"], a["tensor"], ua, ub)
    print("OK")
    """
)


@pytest.mark.slow
def test_data_parallel_and_micro_batch_statistics_equal_one_device():
    run_on_host_devices(DP_SCRIPT, devices=4, timeout=900)


@pytest.mark.slow
def test_outlier_features_flag_tensorwise_scaling_not_blockwise():
    """A transformer with 2 outlier channels (x1e4) in the inputs of its qkv and fc1 matmuls:
    current (tensorwise) e4m3 scaling loses those operands' small values (underflow plus
    subnormal), 32-element blocks (blockwise, MX) lose 4x fewer; the other matmuls' inputs
    are not affected. Row-wise scaling along K cannot isolate a channel outlier (every row
    holds one): it lies between."""
    targets = ["e4m3:tensor", "e4m3:row", "e4m3:block32", "mxfp8"]
    kw = {"d_model": 64, "depth": 1, "heads": 2, "outlier_channels": 2, "outlier_scale": 1e4}
    cfg = TrainConfig(
        model="transformer", data="markov", model_kwargs=kw, steps=1, batch_size=8,
        telemetry={"interval": 1, "targets": targets, "state": False}, progress=False,
    )  # fmt: skip
    rows = train(cfg, quiet=True).metrics[0]["telemetry"]
    lhs = {r["site"]: r["targets"] for r in rows if r["tensor"] == "lhs"}

    def lost(t):
        return t["underflow"] + t["subnormal"]

    affected = [s for s, t in lhs.items() if lost(t["e4m3:tensor"]) > 0.3]
    assert len(affected) == 2, {s: lost(t["e4m3:tensor"]) for s, t in lhs.items()}  # qkv, fc1
    for s in affected:
        t = lhs[s]
        assert lost(t["e4m3:block32"]) < lost(t["e4m3:tensor"]) / 3
        assert lost(t["mxfp8"]) < lost(t["e4m3:tensor"]) / 3
        assert lost(t["e4m3:block32"]) < lost(t["e4m3:row"]) < lost(t["e4m3:tensor"])
    json.dumps(rows)  # the rows are JSON as written


def test_a_convolution_s_rows_are_a_product_s():
    """The built-in CNN's telemetry: a convolution's rows are kind "matmul" (its operands and
    output, as a matmul's), never "op", whose tensors are only "out" and "grad"."""
    cfg = TrainConfig(model="conv", data="digits", model_kwargs={"width": 4, "depth": 1},
                      batch_size=8, steps=1, telemetry={"interval": 1})  # fmt: skip
    setup = build(cfg)
    tel = setup.options.telemetry
    fn = make_telemetry_fn(normalize_loss_fn(setup.loss_fn), setup.policy, tel)
    batch = next(iter(setup.data.batches(cfg.batch_size, seed=cfg.seed, start=0)))
    params = jax.tree.map(lambda p: p.astype(jnp.float32), setup.params)
    g32 = jax.tree.map(jnp.zeros_like, params)
    opt_state, ls = setup.optimizer.init(params), setup.options.loss_scale
    out = jax.device_get(jax.jit(fn)(params, opt_state, ls, g32, batch, jnp.int32(0)))
    rows = telemetry_rows(out, fn.names, 1, tel.targets)
    conv = [r for r in rows if r.get("site", "").startswith("conv_general_dilated[")]
    assert conv and {r["kind"] for r in conv} == {"matmul"}
    assert {r["tensor"] for r in conv} >= {"lhs", "rhs", "out"}
    assert all(r["tensor"] in ("out", "grad") for r in rows if r["kind"] == "op")
