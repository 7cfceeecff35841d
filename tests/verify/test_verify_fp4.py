"""precisionlab.verify on every registered recipe, including the FP4 tournament's, which own
their three GEMMs: each step of their forward and backward (quantizers, rotations, random
signs, casts, GEMMs) is recorded and recomputed bit for bit, and faults injected the way the
real failures make them get their mechanism labels.

The registry tests are parametrized over ``recipes.RECIPE_NAMES``: a recipe added without
verify support fails them. Recording a step costs one compile of the step (a few CPU
seconds), so the default suite records one FP4 recipe (its dump shared by the fault tests) and
plans every recipe (traced, nothing compiled); ``-m slow`` records every one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from precisionlab import recipes, verify
from precisionlab.quant import fp4

_RNG = np.random.default_rng(0)
W = jnp.asarray(_RNG.normal(size=(32, 32)) * 0.2, jnp.float32)
X = jnp.asarray(_RNG.normal(size=(32, 32)), jnp.float32)
PARAMS = {"w1": W, "w2": jnp.asarray(_RNG.normal(size=(32, 32)) * 0.2, jnp.float32)}
KEY = jax.random.key(3)
FP4 = [n for n in recipes.RECIPE_NAMES if isinstance(recipes.get_recipe(n), recipes.FP4Recipe)]
SLOW = pytest.mark.slow


def one_matmul(w, x):
    return jnp.mean((x @ w) ** 2)


def mlp_loss(p, x):
    h = jax.nn.relu(x @ p["w1"])
    return jnp.mean((h @ p["w2"]) ** 2)


def _record(fn, params, name, out, **kw):
    rec = recipes.get_recipe(name)
    state = recipes.apply(fn, name).init_state(params, X) if rec.stateful else None
    return verify.record(fn, params, X, out=out, recipe=name, key=KEY, state=state, **kw)


@pytest.fixture(scope="module")
def nvidia(tmp_path_factory):
    """nvidia_fp4 on one matmul: its dump and Recording."""
    r = _record(one_matmul, W, "nvidia_fp4", tmp_path_factory.mktemp("fp4") / "nvidia_fp4")
    return r.path, r


def _manifest(path) -> dict:
    return json.loads((Path(path) / "manifest.json").read_text())


def _steps(path, which: str) -> tuple[str, list[dict]]:
    g = next(g for g in _manifest(path)["gemms"] if g["pass"] == which)
    return g["id"], g["steps"]


# --- every registered recipe ---------------------------------------------------------------
@pytest.mark.parametrize("name", recipes.RECIPE_NAMES)
def test_every_registered_recipe_plans_a_recording(name):
    """Every recipe of the registry is recordable: the recorder plans its step (traces the
    forward and backward through its taps) and sizes the dump; nothing refuses it."""
    rec = recipes.get_recipe(name)
    state = recipes.apply(one_matmul, name).init_state(W, X) if rec.stateful else None
    size = verify.estimate(one_matmul, W, X, recipe=name, key=KEY, state=state)
    # at least the two operands and the output of the three GEMMs, float32 or narrower codes
    assert size >= 3 * 32 * 32 // 2


@pytest.mark.parametrize(
    "name", [n if n == "nvidia_fp4" else pytest.param(n, marks=SLOW) for n in recipes.RECIPE_NAMES]
)
def test_every_registered_recipe_records_and_verifies_bit_equal(tmp_path, nvidia, name):
    """Record one MLP step (two matmuls) under each recipe on the CPU and recompute it: 100%
    bit-equal; an FP4 recipe's dump holds quantizer codes and scales, keys and GEMMs in both
    passes of both matmuls, and the recording computed what ``recipes.apply`` computes."""
    if name == "nvidia_fp4":  # the default suite: the shared one-matmul dump
        path, r = nvidia
        fn, params = one_matmul, W
    else:
        fn, params = mlp_loss, PARAMS
        r = _record(fn, params, name, tmp_path / name)
        path = r.path
    rep = verify.check(path)
    assert rep.ok and rep.share() == 1.0, rep.text()
    if name not in FP4:
        return
    m = _manifest(path)
    passes = {(g["site"], g["pass"]) for g in m["gemms"]}
    sites = {s["site"] for s in m["sites"]}
    assert passes == {(s, p) for s in sites for p in ("fprop", "backward")}
    ops = [(st["pass"], st["op"]) for g in m["gemms"] for st in g["steps"]]
    for what in ("fprop", "dgrad", "wgrad"):  # each GEMM computed, from quantized operands
        assert (what, "gemm") in ops, (what, ops)
    roles = {c.role for c in rep.checked}
    assert {"output", "block_scale"} <= roles or name == "tseng_fp4"  # BF16 forward, MXFP4 back
    assert "codes" in roles and "key" in {t.role for t in verify.read_dump(path).tensors}
    ap = recipes.apply(fn, name, weight="rhs")
    state = ap.init_state(params, X) if recipes.get_recipe(name).stateful else None
    grads = ap.value_and_grad(0)(state, params, X, key=KEY)[1]
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(r.value[1]), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@SLOW
def test_tetrajet_v2_outcontrol_records_both_groups(tmp_path):
    """TetraJet-v2 past its OutControl window: the MXFP8 outlier channels and the NVFP4 rest
    (a ``cond`` in the recipe) are recorded and verify; the recording equals the recipe's."""
    ap = recipes.apply(one_matmul, "tetrajet_v2", weight="rhs")
    st = {k: {**v, "count": jnp.float32(600),
              "norm": v["norm"] + jnp.arange(32, dtype=jnp.float32)}
          for k, v in ap.init_state(W, X).items()}  # fmt: skip
    r = verify.record(one_matmul, W, X, out=tmp_path / "d", recipe="tetrajet_v2", key=KEY,
                      state=st)  # fmt: skip
    assert verify.check(r.path).ok
    ops = [s["op"] for g in _manifest(r.path)["gemms"] for s in g["steps"]]
    assert ops.count("mxfp8") >= 4
    ref = ap.value_and_grad(0)(st, W, X, key=KEY)[1]
    assert np.array_equal(np.asarray(ref), np.asarray(r.value[1]))


# --- an independent oracle -------------------------------------------------------------------
def test_recorded_nvfp4_codes_match_an_independent_oracle(nvidia):
    """The fprop activation's NVFP4 codes and scales equal a float32 numpy/ml_dtypes
    reimplementation of NVIDIA's quantizer (arXiv 2509.25149 sec. 2), not the codec's."""
    path, _ = nvidia
    gid, steps = _steps(path, "fprop")
    st = steps[0]
    assert st["op"] == "nvfp4" and st["static"]["two_d"] is False
    d = verify.read_dump(path).arrays
    x = np.asarray(d[f"{gid}/{st['inputs']['x']}"], np.float32)
    f32 = np.float32
    s_enc = f32(448.0) * f32(6.0) / np.abs(x).max()
    amax_b = np.abs(x.reshape(*x.shape[:-1], -1, 16)).max(-1, keepdims=True)
    sb = (amax_b * (f32(1) / f32(6)) * s_enc).astype(ml_dtypes.float8_e4m3fn).astype(f32)
    y = x.reshape((*amax_b.shape[:-1], 16)) * (s_enc / sb)
    elems = np.clip(y, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(f32).reshape(x.shape)
    rec_e = np.asarray(d[f"{gid}/{st['outputs']['elems']}"]).astype(f32)
    rec_s = np.asarray(d[f"{gid}/{st['outputs']['scale']}"], f32)
    assert np.array_equal(rec_e, elems)
    assert np.array_equal(rec_s, np.broadcast_to(sb, y.shape).reshape(x.shape))


# --- faults, each made the way the real failure makes it ------------------------------------
def damage(src: Path, dst: Path, arrays: dict) -> Path:
    """A copy of dump ``src`` with the tensors in ``arrays`` (name -> values) replaced."""
    shutil.copytree(src, dst)
    manifest = _manifest(dst)
    d = verify.read_dump(src).arrays
    store = {}
    for t in manifest["tensors"]:
        v = np.asarray(arrays.get(t["name"], d[t["name"]]))
        if t["dtype"] == "float4_e2m1fn":
            v = v.astype(np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
        store[t["key"]] = v.astype(t["storage"])
    np.savez(dst / "tensors.npz", **store)
    return dst


def _sr_step(path):
    """The first stochastically rounded quantizer step of the backward (the dgrad's output
    gradient): (gemm id, step)."""
    gid, steps = _steps(path, "backward")
    st = next(s for s in steps if s["op"] == "nvfp4" and s["static"]["rounding"] == "stochastic")
    return gid, st


def _expect_first(path, name, label, *words):
    rep = verify.check(path)
    assert not rep.ok
    assert rep.first.name == name, (rep.first.name, rep.first.detail)
    assert rep.label == label, (rep.label, rep.first.detail)
    for w in words:
        assert w in rep.first.detail, (w, rep.first.detail)


def test_fault_stochastic_rounding_bits_from_another_key(nvidia, tmp_path):
    """The output gradient rounded stochastically with another key (its scales unchanged):
    the first difference is that step's codes, labelled stochastic-rounding bits."""
    path, _ = nvidia
    gid, st = _sr_step(path)
    d = verify.read_dump(path).arrays
    x = jnp.asarray(d[f"{gid}/{st['inputs']['x']}"])
    static = {k: v for k, v in st["static"].items() if k != "key"}
    q = fp4.nvfp4(x, **{**static, "key": jax.random.key(12345)})
    codes = f"{gid}/{st['outputs']['elems']}"
    assert not np.array_equal(np.asarray(q.elems), d[codes].astype(np.float32))
    bad = damage(path, tmp_path / "bad", {codes: np.asarray(q.elems)})
    _expect_first(bad, codes, "sr-bits", "stochastically")


def test_fault_zeroed_stochastic_rounding_output(nvidia, tmp_path):
    """TE PR #3281: NVFP4's stochastic rounding returned all-zero data."""
    path, _ = nvidia
    gid, st = _sr_step(path)
    codes = f"{gid}/{st['outputs']['elems']}"
    shape = verify.read_dump(path).arrays[codes].shape
    bad = damage(path, tmp_path / "bad", {codes: np.zeros(shape, np.float32)})
    _expect_first(bad, codes, "zeroed-or-nonfinite", "all zero")


def test_fault_scale_rule_four_or_six(nvidia, tmp_path):
    """The activation quantized with Four Over Six's per-block 4-or-6 choice (E4M3 range 256)
    where NVIDIA's recipe maps every block's amax to 6: labelled scale rule, naming it."""
    path, _ = nvidia
    gid, steps = _steps(path, "fprop")
    st = steps[0]
    d = verify.read_dump(path).arrays
    x = jnp.asarray(d[f"{gid}/{st['inputs']['x']}"])
    static = {**st["static"], "four_over_six": "mse", "scale_max": 256.0}
    q = fp4.nvfp4(x, **static)
    names = {k: f"{gid}/{v}" for k, v in st["outputs"].items()}
    assert not np.array_equal(np.asarray(q.scale), d[names["scale"]])
    bad = damage(path, tmp_path / "bad", {names[k]: np.asarray(getattr(q, k)) for k in names})
    _expect_first(bad, names["elems"], "scale-rule", "four_over_six='mse'")


def test_damaged_step_description_is_one_line_error(nvidia, tmp_path):
    """A step naming an op no codec has, or a tensor the dump lacks: DumpError."""
    path, _ = nvidia
    for n, change in enumerate([("op", "nvfp5"), ("inputs", {"x": "999.nvfp4/x"})]):
        dst = tmp_path / f"bad{n}"
        shutil.copytree(path, dst)
        m = _manifest(dst)
        m["gemms"][0]["steps"][0][change[0]] = change[1]
        (dst / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(verify.DumpError) as err:
            verify.check(dst)
        assert "\n" not in str(err.value) and "step" in str(err.value)


def test_native_gemm_mode_is_refused_for_recipes_owning_their_gemms(tmp_path):
    with pytest.raises(ValueError, match="nvidia_fp4 recipe computes its GEMMs itself"):
        verify.record(one_matmul, W, X, out=tmp_path / "d", recipe="nvidia_fp4", key=KEY,
                      gemm="native")  # fmt: skip
    assert not (tmp_path / "d").exists()


@SLOW
def test_fault_scale_rule_e8m0_rceil_instead_of_floor(tmp_path):
    """Tseng et al.'s MXFP4 uses OCP's floor E8M0 scale; a backward operand quantized with
    TE's rceil instead is labelled scale rule, naming it."""
    r = _record(one_matmul, W, "tseng_fp4", tmp_path / "tseng")
    gid, steps = _steps(r.path, "backward")
    st = next(s for s in steps if s["op"] == "mxfp4")
    assert st["static"]["rule"] == "floor"
    d = verify.read_dump(r.path).arrays
    ins = {k: jnp.asarray(d[f"{gid}/{v}"]) for k, v in st["inputs"].items()}
    ins["key"] = jax.random.wrap_key_data(ins["key"], impl=st["keys"]["key"].split(":")[1])
    static = {k: v for k, v in st["static"].items() if k not in ins}
    q = fp4.mxfp4(**ins, **{**static, "rule": "rceil"})
    names = {k: f"{gid}/{v}" for k, v in st["outputs"].items()}
    assert not np.array_equal(np.asarray(q.scale), d[names["scale"]])
    bad = damage(r.path, tmp_path / "bad", {names[k]: np.asarray(getattr(q, k)) for k in names})
    _expect_first(bad, names["elems"], "scale-rule", "rule='rceil'")


@SLOW
def test_transformer_step_in_a_training_loop_verifies(tmp_path):
    """The built-in transformer under TetraJet (MXFP4, Q-EMA state per matmul) recorded by the
    training hook from the loop's state and batch: every step of every matmul bit-equal."""
    from precisionlab.train import TrainConfig, build
    from precisionlab.train._step import build_step

    cfg = TrainConfig(model="transformer", data="markov", recipe="tetrajet", batch_size=4,
                      model_kwargs={"d_model": 32, "depth": 2, "heads": 2},
                      data_kwargs={"seq_len": 16}, steps=4)  # fmt: skip
    setup = build(cfg)
    batch = next(iter(setup.data.batches(cfg.batch_size, seed=0, start=0)))
    _, state, _ = build_step(setup.loss_fn, setup.params, setup.optimizer, setup.options,
                             batch, None)  # fmt: skip
    hook = verify.RecordHook(tmp_path, [1], loss_fn=setup.loss_fn, options=setup.options)
    hook.before_step(0, state, batch)
    rep = verify.check(hook.path(1))
    assert rep.ok and rep.share() == 1.0, rep.text()
    m = _manifest(hook.path(1))
    assert len({g["site"] for g in m["gemms"]}) >= 8  # every linear layer's matmul
    assert any(s["op"] == "qema_nearest" for g in m["gemms"] for s in g["steps"])


@SLOW
def test_steps_inside_a_scan_are_recorded_per_iteration(tmp_path):
    """Quartet on a matmul inside ``lax.scan`` (3 iterations): each iteration's forward and
    backward steps are recorded (backward in reverse program order) and verify."""
    ws = jnp.stack([W, W * 0.5, W * 2.0])

    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.mean(h**2)

    r = verify.record(loss, ws, X, out=tmp_path / "d", recipe="quartet", key=KEY)
    assert verify.check(r.path).ok
    ids = [g["id"] for g in _manifest(r.path)["gemms"]]
    assert ids == [f"dot_general[0]@{i}/fprop" for i in (0, 1, 2)] + [
        f"dot_general[0]@{i}/backward" for i in (2, 1, 0)
    ]
