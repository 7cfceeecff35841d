"""precisionlab.verify: record real steps, recompute them bit for bit, and name each injected
fault's mechanism.

The faults are made here, in the test, the way each real failure would make them (the
recipe's own quantizer with another scale rule, key or rounding, a GEMM by another hardware
model, bfloat16 operands, zeros, one flipped bit), on dumps recorded from real MLP steps
under the delayed, current, blockwise, MXFP8 and NVFP4 recipes; the built-in transformer's
dumps get the same treatment under ``-m slow``. Every recorded step must verify 100%
bit-equal on the CPU it was recorded on.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from precisionlab import recipes, verify
from precisionlab.cli import main

ROOT = Path(__file__).resolve().parents[2]

# --- a small MLP and its recorded steps ----------------------------------------------------
_RNG = np.random.default_rng(0)
PARAMS = {
    "w1": jnp.asarray(_RNG.normal(size=(32, 32)) * 0.2, jnp.float32),
    "w2": jnp.asarray(_RNG.normal(size=(32, 16)) * 0.2, jnp.float32),
}
X = jnp.asarray(_RNG.normal(size=(16, 32)), jnp.float32)


def mlp_loss(p, x):
    h = jax.nn.relu(x @ p["w1"])
    return jnp.mean((h @ p["w2"]) ** 2)


def _delayed_state():
    """The delayed recipe's state after two steps whose amax grows (the newest amax is the
    history's max, so a history one step old gives another scale)."""
    rec = recipes.Delayed(amax_history_len=4)
    ap = recipes.apply(mlp_loss, rec)
    st = ap.init_state(PARAMS, X)
    for x in (X, 3 * X):
        _, _, obs = ap.value_and_grad(0)(st, PARAMS, x)
        st = ap.update_state(st, obs)
    return rec, st


class _Dumps(dict):
    """name -> (dump directory, Recording, record kwargs): one recorded MLP step per recipe,
    recorded when first asked for (the default suite asks for three)."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, name):
        rec_d, st = _delayed_state() if name == "delayed" else (None, None)
        rec, kw = {
            "delayed": (rec_d, {"state": st}),
            "current": ("current", {}),
            "blockwise": (recipes.Blockwise(block=16), {}),
            "mxfp8": ("mxfp8", {}),
            "nvfp4": ("nvfp4", {"key": jax.random.PRNGKey(7)}),
        }[name]
        r = verify.record(mlp_loss, PARAMS, X, out=self.root / name, recipe=rec, **kw)
        self[name] = (r.path, r, kw)
        return self[name]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    return _Dumps(tmp_path_factory.mktemp("verify"))


SLOW = pytest.mark.slow


def _read(path):
    return verify.read_dump(path)


def _recipe(path):
    return verify.check(path, diagnose=False) and _rebuild(path)


def _rebuild(path) -> recipes.Recipe:
    spec = json.loads((Path(path) / "manifest.json").read_text())["step"]["recipe"]
    return getattr(recipes, spec["class"])(**spec["fields"])


def _storage(a, dtype: str) -> np.ndarray:
    """The archive's bits of ``a`` as a dump keeps a tensor of logical ``dtype``."""
    if hasattr(ml_dtypes, dtype) and dtype not in ("float32", "float16"):
        dt = np.dtype(getattr(ml_dtypes, dtype))
        return np.asarray(a).astype(np.float32).astype(dt).view(f"uint{8 * dt.itemsize}")
    return np.asarray(a, dtype=np.dtype(dtype))


def damage(src: Path, dst: Path, arrays: dict, dtypes: dict | None = None) -> Path:
    """A copy of dump ``src`` with the tensors in ``arrays`` (name -> logical values) replaced;
    ``dtypes`` (name -> dtype name) changes what the manifest says they are."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    d = _read(src)
    store = {}
    for t in manifest["tensors"]:
        if dtypes and t["name"] in dtypes:
            t["dtype"] = dtypes[t["name"]]
            t["storage"] = _storage(np.zeros(1, np.float32), t["dtype"]).dtype.name
        value = arrays.get(t["name"], d.arrays[t["name"]])
        store[t["key"]] = _storage(value, t["dtype"])
    np.savez(dst / "tensors.npz", **store)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def _gemm(path, what: str, site: str = "dot_general[0]") -> dict:
    m = json.loads((Path(path) / "manifest.json").read_text())
    return next(g for g in m["gemms"] if g["site"] == site and g["pass"] == what)


def _expect_first(path, name: str, label: str, *words: str):
    rep = verify.check(path)
    assert not rep.ok
    assert rep.first.name == name, (rep.first.name, rep.first.detail)
    assert rep.label == label, (rep.label, rep.first.detail)
    for w in words:
        assert w in rep.first.detail, (w, rep.first.detail)
    return rep


def _compact(x, block):
    b, r, k = x.shape
    return x.reshape(b, r, k // block, block)[..., 0]


# --- record and verify: 100% bit-equal on the CPU that recorded ---------------------------
@pytest.mark.parametrize(
    "name",
    [
        "delayed",
        pytest.param("current", marks=SLOW),
        pytest.param("blockwise", marks=SLOW),
        "mxfp8",
        "nvfp4",
    ],
)
def test_recorded_steps_verify_bit_equal(dumps, name):
    path = dumps[name][0]
    rep = verify.check(path)
    assert rep.ok and rep.share() == 1.0, rep.text()
    # every GEMM of both matmuls in the three passes, each with its codes and output checked
    gemms = {(g["site"], g["pass"]) for g in json.loads((path / "manifest.json").read_text())
             ["gemms"]}  # fmt: skip
    assert gemms == {(f"dot_general[{i}]", p) for i in (0, 1) for p in ("fprop", "dgrad",
                                                                       "wgrad")}  # fmt: skip
    roles = {t.role for t in rep.checked}
    assert {"codes", "output"} <= roles


def _same_step_as_apply(dumps, name):
    path, rec, kw = dumps[name]
    ref = recipes.apply(mlp_loss, _rebuild(path)).value_and_grad(0)(
        kw.get("state"), PARAMS, X, key=kw.get("key")
    )
    for a, b in zip(jax.tree.leaves(ref[1]), jax.tree.leaves(rec.value[1]), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_recording_changes_nothing(dumps):
    """The recorded step's gradients are recipes.apply's, bit for bit (NVFP4: stochastic
    rounding keys, the Hadamard transform; the other recipes under -m slow)."""
    _same_step_as_apply(dumps, "nvfp4")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["delayed", "current", "blockwise", "mxfp8"])
def test_recording_changes_nothing_every_recipe(dumps, name):
    _same_step_as_apply(dumps, name)


def _record_and_check(tmp_path, name):
    kw = {"key": jax.random.PRNGKey(0)} if name == "nvfp4" else {}
    r = verify.record(mlp_loss, PARAMS, X, out=tmp_path / name, recipe=name, **kw)
    return verify.check(r.path)


@pytest.mark.slow
def test_high_precision_weight_gradient_verifies(tmp_path):
    """rowwise_with_gw_hp keeps the weight-gradient GEMM in float32 (model "hp")."""
    rep = _record_and_check(tmp_path, "rowwise_with_gw_hp")
    assert rep.ok, rep.text()
    gemms = json.loads((tmp_path / "rowwise_with_gw_hp" / "manifest.json").read_text())["gemms"]
    assert {g["pass"] for g in gemms if g["model"] == "hp"} == {"wgrad"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rowwise", "mxfp6", "mxfp4", "bf16", "fp32"])
def test_every_other_recipe_verifies(tmp_path, name):
    """Every recipe name records and verifies bit for bit, the fp32 reference included (its
    48-bit products make XLA's float32 summation order visible: the recorder's optimization
    barrier gives the check's order)."""
    rep = _record_and_check(tmp_path, name)
    assert rep.ok, rep.text()


def test_float32_order_difference_is_labelled(dumps, tmp_path):
    """A float32 GEMM whose outputs moved by an ulp, as another summation order moves them
    (within float32's reordering bound of the products), is an accumulator difference, not
    unknown. (Summing this dump's FP8 products in reverse order changes nothing: few exact
    products, exact sums; so the order's effect is written directly.)"""
    src = dumps["mxfp8"][0]
    g = _gemm(src, "wgrad", "dot_general[1]")
    d, gid = _arrays(src), g["id"]
    out = np.array(d[f"{gid}/out"], np.float32)
    flat = out.reshape(-1)
    flat[::7] = np.nextafter(flat[::7], np.float32(np.inf))
    assert not np.array_equal(out, d[f"{gid}/out"])
    bad = damage(src, tmp_path / "bad", {f"{gid}/out": out})
    _expect_first(bad, f"{gid}/out", "accumulator", "another order")


def test_recorded_codes_and_scales_match_an_independent_mx_oracle(dumps):
    """The MXFP8 dump's fprop lhs codes and E8M0 exponents against numpy + ml_dtypes: the
    rceil rule (TE / cuBLAS: the smallest power of two X with amax / X <= 448)."""
    path = dumps["mxfp8"][0]
    d = _read(path)
    x = d.arrays["dot_general[0]/fprop/lhs/input"].astype(np.float64)
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1)
    e = np.ceil(np.log2(amax / 448.0))
    assert np.array_equal(d.arrays["dot_general[0]/fprop/lhs/block_exp"], e.astype(np.int32))
    scaled = (blocks / np.exp2(e)[..., None]).reshape(x.shape)
    want = np.clip(scaled, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    got = d.arrays["dot_general[0]/fprop/lhs/codes"]
    assert got.dtype == ml_dtypes.float8_e4m3fn
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


def test_plain_bf16_step_records_forward_and_backward_gemms(tmp_path):
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), PARAMS)
    x16 = X.astype(jnp.bfloat16)
    r = verify.record(mlp_loss, p16, x16, out=tmp_path / "plain")
    rep = verify.check(r.path)
    assert rep.ok, rep.text()
    outs = [t for t in rep.checked if t.role == "output"]
    # x @ w1, h @ w2 forward; their input and weight gradients (the first layer's input
    # gradient is not needed: argnums=0 differentiates the params only)
    assert len(outs) >= 5 and all(t.status == "match" for t in outs)
    d = _read(r.path)
    assert d.arrays["dot_general[0]/lhs"].dtype == ml_dtypes.bfloat16
    assert d.manifest["step"]["mode"] == "plain" and d.manifest["step"]["hardware"] == "xla-cpu"


def test_recording_with_scan_records_every_iteration(tmp_path):
    """A matmul inside a scan over layers: one record per iteration, forward and backward."""
    ws = jnp.stack([PARAMS["w1"], 0.5 * PARAMS["w1"], -PARAMS["w1"]])

    def loss(ws, x):
        def body(h, w):
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(body, x, ws)
        return jnp.mean(h**2)

    r = verify.record(loss, ws, X, out=tmp_path / "scan", recipe="current")
    m = r.path / "manifest.json"
    ids = [g["id"] for g in json.loads(m.read_text())["gemms"]]
    assert ids[:3] == [f"dot_general[0]@{i}/fprop" for i in range(3)]
    assert ids[3:] == [f"dot_general[0]@{i}/{w}" for i in (2, 1, 0) for w in ("dgrad", "wgrad")]
    assert verify.check(r.path).ok


# --- the faults, each made the way the real failure makes it -----------------------------
def _arrays(src):
    return _read(src).arrays


def _cut(x, g):
    return np.asarray(x)[:, : g["m"], : g["n"]]


def fault_scale_rule(src, dst, g):
    """MXFP8's lhs quantized with OCP's floor rule where the recipe (TE) says rceil."""
    d, gid = _arrays(src), g["id"]
    rec = _rebuild(src)
    floor = dataclasses.replace(rec, scale_rule="floor")
    kinds = tuple(g["kinds"])
    q = floor.quantize(jnp.asarray(d[f"{gid}/lhs/input"]), kinds[0])
    qb = rec.quantize(jnp.asarray(d[f"{gid}/rhs/input"]), kinds[1])
    exps = _compact(np.asarray(q.block_exp), rec.block)
    assert not np.array_equal(exps, d[f"{gid}/lhs/block_exp"])  # the rules differ here
    out = _cut(recipes.operand_gemm(floor, q, qb, kinds), g)
    bad = damage(src, dst, {
        f"{gid}/lhs/block_scale": _compact(np.asarray(q.block_inv), rec.block),
        f"{gid}/lhs/block_exp": exps, f"{gid}/lhs/codes": np.asarray(q.elems), f"{gid}/out": out,
    })  # fmt: skip
    return bad, f"{gid}/lhs/block_scale", "scale-rule", ("scale_rule='floor'",)


def fault_stale_history(src, dst, site):
    """Delayed scaling: the history after the step holds the previous step's amax."""
    d = _arrays(src)
    hist0 = d[f"state/{site}/history"]
    hist1 = d[f"state_after/{site}/history"].copy()
    assert not np.array_equal(hist1[0], hist0[0])
    hist1[0] = hist0[0]
    bad = damage(src, dst, {f"state_after/{site}/history": hist1})
    return bad, f"state_after/{site}/history", "stale-amax", ("previous step's amax",)


def fault_stale_scale(src, dst, g):
    """Delayed scaling: the quantizer used the scale of the history one step old."""
    d, gid = _arrays(src), g["id"]
    rec = _rebuild(src)
    hist0 = d[f"state/{g['site']}/history"]
    older = np.concatenate([hist0[1:], np.zeros_like(hist0[:1])])
    kmax = jnp.asarray([448.0, 448.0, 57344.0], jnp.float32)
    scale0 = jnp.asarray(d[f"state/{g['site']}/scale"])
    stale = np.asarray(rec.next_scale(jnp.asarray(older), scale0, kmax))[0]
    assert stale != d[f"{gid}/lhs/given_scale"]
    q = rec.quantize(jnp.asarray(d[f"{gid}/lhs/input"]), g["kinds"][0], scale=jnp.float32(stale))
    bad = damage(src, dst, {
        f"{gid}/lhs/given_scale": np.float32(stale), f"{gid}/lhs/row_scale": np.asarray(q.row_inv),
        f"{gid}/lhs/codes": np.asarray(q.elems),
    })  # fmt: skip
    return bad, f"{gid}/lhs/given_scale", "stale-amax", ("one step old",)


def fault_sr_key(src, dst, g):
    """NVFP4's output gradient rounded stochastically with another key."""
    d, gid = _arrays(src), g["id"]
    q = _rebuild(src).quantize(jnp.asarray(d[f"{gid}/lhs/input"]), "g",
                               key=jax.random.PRNGKey(12345))  # fmt: skip
    assert not np.array_equal(np.asarray(q.elems), d[f"{gid}/lhs/codes"].astype(np.float32))
    bad = damage(src, dst, {f"{gid}/lhs/codes": np.asarray(q.elems)})
    return bad, f"{gid}/lhs/codes", "sr-bits", ("stochastically",)


def fault_zeroed_codes(src, dst, g):
    """TE PR #3281: NVFP4's stochastic rounding returned all-zero data."""
    gid = g["id"]
    codes = _arrays(src)[f"{gid}/lhs/codes"]
    bad = damage(src, dst, {f"{gid}/lhs/codes": np.zeros(codes.shape, np.float32)})
    return bad, f"{gid}/lhs/codes", "zeroed-or-nonfinite", ("all zero",)


def fault_accumulator(src, dst, g):
    """The GEMM summed as cuBLASLt with fast accumulation sums it on an H100 (13 fraction
    bits, truncated) where the recipe says float32."""
    d, gid = _arrays(src), g["id"]
    rec = _rebuild(src)
    kinds = tuple(g["kinds"])
    qa = rec.quantize(jnp.asarray(d[f"{gid}/lhs/input"]), kinds[0])
    qb = rec.quantize(jnp.asarray(d[f"{gid}/rhs/input"]), kinds[1])
    preset = "b200" if isinstance(rec, recipes.MX) else "h100-cublaslt-fast"
    fast = dataclasses.replace(rec, accumulate=preset)
    out = _cut(recipes.operand_gemm(fast, qa, qb, kinds), g)
    assert not np.array_equal(out, d[f"{gid}/out"])
    bad = damage(src, dst, {f"{gid}/out": out})
    return bad, f"{gid}/out", "accumulator", (preset.split("-")[0],)


def fault_bf16_operands(src, dst, g):
    """marin#6660: the FP8 run computed its GEMM in bfloat16: the operands are the inputs
    rounded to bfloat16, and the output their product."""
    d, gid = _arrays(src), g["id"]
    a16 = d[f"{gid}/lhs/input"].astype(ml_dtypes.bfloat16).astype(np.float32)
    b16 = d[f"{gid}/rhs/input"].astype(ml_dtypes.bfloat16).astype(np.float32)
    out = np.einsum("bmk,bnk->bmn", a16.astype(np.float64), b16.astype(np.float64))
    bad = damage(
        src, dst,
        {f"{gid}/lhs/codes": a16, f"{gid}/rhs/codes": b16,
         f"{gid}/out": _cut(out.astype(np.float32), g)},
        dtypes={f"{gid}/lhs/codes": "bfloat16", f"{gid}/rhs/codes": "bfloat16"},
    )  # fmt: skip
    return bad, f"{gid}/lhs/codes", "wrong-dtype", ("bfloat16",)


def fault_bf16_output(src, dst, g):
    """Only the output shows it: the bfloat16 GEMM of the inputs."""
    d, gid = _arrays(src), g["id"]
    a = jnp.asarray(d[f"{gid}/lhs/input"]).astype(jnp.bfloat16).astype(jnp.float32)
    b = jnp.asarray(d[f"{gid}/rhs/input"]).astype(jnp.bfloat16).astype(jnp.float32)
    out = jnp.einsum("bmk,bnk->bmn", a, b, precision=jax.lax.Precision.HIGHEST)
    bad = damage(src, dst, {f"{gid}/out": _cut(out, g)})
    return bad, f"{gid}/out", "wrong-dtype", ("bfloat16",)


def fault_flipped_bit(src, dst, g):
    """One output bit flipped (an exponent bit: no accumulation order gives that)."""
    gid = g["id"]
    out = _arrays(src)[f"{gid}/out"].copy()
    flat = out.reshape(-1).view(np.uint32)
    flat[min(5, flat.size - 1)] ^= np.uint32(1 << 29)
    bad = damage(src, dst, {f"{gid}/out": out})
    return bad, f"{gid}/out", "unknown", ()


def _inject(fault, src, dst, where):
    path, name, label, words = fault(src, dst, where)
    rep = _expect_first(path, name, label, *words)
    return rep


# --- one injected fault per mechanism, on the MLP's recorded steps -------------------------
def test_fault_scale_rule_floor_instead_of_rceil(dumps, tmp_path):
    src = dumps["mxfp8"][0]
    _inject(fault_scale_rule, src, tmp_path / "bad", _gemm(src, "fprop"))


def test_fault_stale_amax_in_the_history_and_in_the_scale(dumps, tmp_path):
    src = dumps["delayed"][0]
    _inject(fault_stale_history, src, tmp_path / "a", "dot_general[0]")
    _inject(fault_stale_scale, src, tmp_path / "b", _gemm(src, "fprop"))


def test_fault_stochastic_rounding_bits_from_another_key(dumps, tmp_path):
    src = dumps["nvfp4"][0]
    _inject(fault_sr_key, src, tmp_path / "bad", _gemm(src, "dgrad", "dot_general[1]"))


def test_fault_zeroed_stochastic_rounding_output(dumps, tmp_path):
    src = dumps["nvfp4"][0]
    _inject(fault_zeroed_codes, src, tmp_path / "bad", _gemm(src, "wgrad", "dot_general[1]"))


@pytest.mark.parametrize("name", ["mxfp8", pytest.param("current", marks=SLOW)])
def test_fault_accumulator_of_another_preset(dumps, tmp_path, name):
    """The GEMM as Blackwell's block-scaled MMA (MXFP8) or cuBLASLt's fast accumulation on
    an H100 (current scaling) computes it, where the recipe says float32."""
    src = dumps[name][0]
    _inject(fault_accumulator, src, tmp_path / "bad", _gemm(src, "fprop"))


@pytest.mark.parametrize("name", ["mxfp8", pytest.param("blockwise", marks=SLOW)])
def test_fault_wrong_dtype_bf16_where_fp8_was_asked(dumps, tmp_path, name):
    src = dumps[name][0]
    rep = _inject(fault_bf16_operands, src, tmp_path / "a", _gemm(src, "fprop", "dot_general[1]"))
    assert "float8_e4m3fn" in rep.first.detail
    _inject(fault_bf16_output, src, tmp_path / "b", _gemm(src, "fprop"))


def test_fault_one_flipped_output_bit_is_unknown(dumps, tmp_path):
    src = dumps["mxfp8"][0]
    rep = _inject(fault_flipped_bit, src, tmp_path / "bad", _gemm(src, "wgrad"))
    assert rep.first.elements - rep.first.equal == 1


# --- the built-in transformer (slow: about a minute of CPU per recipe) -----------------------
def _transformer_dump(root, recipe):
    from precisionlab.train import TrainConfig, build
    from precisionlab.train._step import build_step

    # delayed: the newest amax sets the scale, so a history one step old gives another one
    spec = recipe
    if recipe == "delayed":
        spec = {"name": "delayed", "amax_compute_algo": "most_recent"}
    cfg = TrainConfig(model="transformer", data="markov", recipe=spec, batch_size=4,
                      model_kwargs={"d_model": 32, "depth": 2, "heads": 2},
                      data_kwargs={"seq_len": 16}, steps=4)  # fmt: skip
    setup = build(cfg)
    batches = setup.data.batches(cfg.batch_size, seed=0, start=0)
    batch = next(iter(batches))
    step_fn, state, _ = build_step(setup.loss_fn, setup.params, setup.optimizer,
                                   setup.options, batch, None)  # fmt: skip
    if recipe == "delayed":  # a state two updates old, so a stale amax shows
        step = jax.jit(step_fn)
        for b in itertools.islice(batches, 2):
            state, _ = step(state, b)
    hook = verify.RecordHook(root / recipe, [3], loss_fn=setup.loss_fn, options=setup.options)
    hook.before_step(2, state, batch)
    return hook.path(3)


@pytest.fixture(scope="module")
def transformer_dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("transformer")
    return {r: _transformer_dump(root, r)
            for r in ("delayed", "current", "blockwise", "mxfp8", "nvfp4")}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", ["delayed", "current", "blockwise", "mxfp8", "nvfp4"])
def test_transformer_steps_verify_bit_equal(transformer_dumps, name):
    rep = verify.check(transformer_dumps[name])
    assert rep.ok and rep.share() == 1.0, rep.text()
    assert len([t for t in rep.checked if t.role == "output"]) >= 3 * 6  # every GEMM


@pytest.mark.slow
# sites of the linear layers: the train step (and so the hook's recording) leaves attention's
# products (dot_general[1], [2], [7], [8]) as they are
@pytest.mark.parametrize(("name", "fault", "what", "site"), [
    ("mxfp8", fault_scale_rule, "fprop", "dot_general[3]"),
    ("delayed", fault_stale_scale, "fprop", "dot_general[0]"),
    ("nvfp4", fault_sr_key, "wgrad", "dot_general[3]"),
    ("nvfp4", fault_zeroed_codes, "dgrad", "dot_general[0]"),
    ("current", fault_accumulator, "dgrad", "dot_general[4]"),
    ("blockwise", fault_bf16_operands, "wgrad", "dot_general[6]"),
    ("mxfp8", fault_flipped_bit, "dgrad", "dot_general[5]"),
])  # fmt: skip
def test_transformer_faults(transformer_dumps, tmp_path, name, fault, what, site):
    src = transformer_dumps[name]
    _inject(fault, src, tmp_path / "bad", _gemm(src, what, site))


@pytest.mark.slow
def test_transformer_stale_history(transformer_dumps, tmp_path):
    _inject(fault_stale_history, transformer_dumps["delayed"], tmp_path / "bad", "dot_general[0]")


def test_every_label_is_documented_and_tested():
    """The fixed set: each label has a meaning, and a fault test above asserts it."""
    assert set(verify.LABELS) == {"scale-rule", "stale-amax", "sr-bits", "accumulator",
                                  "wrong-dtype", "zeroed-or-nonfinite", "unknown"}  # fmt: skip
    source = Path(__file__).read_text()
    for label in verify.LABELS:
        assert f'"{label}"' in source.split("def test_every_label")[0], label
    page = (Path(__file__).parents[2] / "docs/guides/verify.md").read_text()
    for label in verify.LABELS:
        assert f"`{label}`" in page, label


# --- the command line: exit 0, 1, 2 ----------------------------------------------------------
def test_cli_exit_status_match_and_differ(dumps, tmp_path, capsys):
    src = dumps["mxfp8"][0]
    assert main(["verify", str(src)]) == 0
    assert "every checked tensor matches" in capsys.readouterr().out
    g = "dot_general[1]/dgrad"
    out = _read(src).arrays[f"{g}/out"].copy()
    out.reshape(-1)[0] = 0.0 if out.reshape(-1)[0] != 0 else 1.0
    bad = damage(src, tmp_path / "bad", {f"{g}/out": out})
    assert main(["verify", str(bad), "--json", str(tmp_path / "r.json")]) == 1
    text = capsys.readouterr().out
    assert f"first difference: {g}/out" in text
    report = json.loads((tmp_path / "r.json").read_text())
    assert report[0]["first"] == f"{g}/out" and report[0]["ok"] is False


def _damaged_dumps(src: Path, root: Path) -> dict[str, Path]:
    cases = {}

    def copy(name):
        p = root / name
        shutil.copytree(src, p)
        cases[name] = p
        return p

    (copy("no-manifest") / "manifest.json").unlink()
    (copy("bad-json") / "manifest.json").write_text("{not json")
    p = copy("truncated-npz")
    data = (p / "tensors.npz").read_bytes()
    (p / "tensors.npz").write_bytes(data[: len(data) // 2])
    (copy("no-npz") / "tensors.npz").unlink()
    p = copy("codes-reshaped")  # an array whose shape agrees with its (edited) manifest entry
    m = json.loads((p / "manifest.json").read_text())
    t = next(t for t in m["tensors"] if t["role"] == "codes")
    arrays = dict(np.load(p / "tensors.npz"))
    arrays[t["key"]] = arrays[t["key"]].reshape(-1)
    t["shape"] = [int(np.prod(t["shape"]))]
    np.savez(p / "tensors.npz", **arrays)
    (p / "manifest.json").write_text(json.dumps(m))
    for name, edit in {
        "future-version": lambda m: m.update(version=99),
        "other-format": lambda m: m.update(format="something-else"),
        "wrong-shape": lambda m: m["tensors"][3].update(shape=[1, 2, 3]),
        "wrong-storage": lambda m: m["tensors"][3].update(dtype="float16", storage="float16"),
        "unknown-gemm": lambda m: m["tensors"][3].update(gemm="nowhere/fprop"),
        "tensors-not-list": lambda m: m.update(tensors={"a": 1}),
        "bad-recipe": lambda m: m["step"]["recipe"].update({"class": "Nope"}),
        "bad-recipe-field": lambda m: m["step"]["recipe"]["fields"].update(margin=-1),
        "gemm-without-site": lambda m: m["gemms"][0].pop("site"),
        "bad-weight": lambda m: m["step"].update(weight="left"),
    }.items():
        p = copy(name)
        m = json.loads((p / "manifest.json").read_text())
        edit(m)
        (p / "manifest.json").write_text(json.dumps(m))
    return cases


def test_cli_damaged_dumps_are_one_line_exit_2(dumps, tmp_path, capsys):
    cases = _damaged_dumps(dumps["delayed"][0], tmp_path)
    cases["a-file"] = tmp_path / "a-file.txt"
    cases["a-file"].write_text("x")
    for name, path in cases.items():
        status = main(["verify", str(path)])
        err = capsys.readouterr().err
        assert status == 2, (name, err)
        assert err.count("\n") == 1 and "Traceback" not in err, (name, err)
        assert err.startswith("precisionlab verify: error: "), (name, err)


def test_reading_a_dump_checks_versions_and_sizes(dumps, tmp_path):
    src = dumps["delayed"][0]
    m = json.loads((src / "manifest.json").read_text())
    assert m["format"] == "precisionlab-verify-dump" and m["version"] == verify.FORMAT_VERSION
    assert m["bytes"] == sum(
        int(np.prod(t["shape"])) * np.dtype(t["storage"]).itemsize for t in m["tensors"]
    )
    assert [t["order"] for t in m["tensors"]] == list(range(len(m["tensors"])))
    for field in ("name", "site", "role", "producer", "dtype", "shape", "file", "key"):
        assert all(field in t for t in m["tensors"]), field
    env = m["environment"]
    assert env["backend"] == "cpu" and env["jax"] == jax.__version__


def test_size_estimate_and_bound(dumps, tmp_path):
    path, rec, _ = dumps["mxfp8"]
    assert verify.estimate(mlp_loss, PARAMS, X, recipe="mxfp8") == rec.bytes
    assert rec.bytes == json.loads((path / "manifest.json").read_text())["bytes"]
    with pytest.raises(ValueError, match=r"would hold about .* max_bytes=1000; record fewer"):
        verify.record(mlp_loss, PARAMS, X, out=tmp_path / "no", recipe="mxfp8", max_bytes=1000)
    assert not (tmp_path / "no").exists()
    kw = dict(recipe="current", sites="dot_general[1]", results=False, grad=False)
    one = verify.record(mlp_loss, PARAMS, X, out=tmp_path / "one", **kw)
    assert one.bytes == verify.estimate(mlp_loss, PARAMS, X, **kw)
    gemms = json.loads((one.path / "manifest.json").read_text())["gemms"]
    assert [(g["site"], g["pass"]) for g in gemms] == [("dot_general[1]", "fprop")]
    # the forward value (eager here, one program there: the last bits may differ)
    assert np.isclose(float(one.value), float(recipes.apply(mlp_loss, "current")(PARAMS, X)),
                      rtol=1e-6)  # fmt: skip
    assert verify.check(one.path).ok


def test_record_refuses_bad_options(tmp_path):
    with pytest.raises(ValueError, match="unknown gemm 'tensor'; allowed: recipe, native"):
        verify.record(mlp_loss, PARAMS, X, out=tmp_path / "a", recipe="mxfp8", gemm="tensor")
    with pytest.raises(ValueError, match="gemm='native': the mx recipe scales blocks"):
        verify.record(mlp_loss, PARAMS, X, out=tmp_path / "b", recipe="mxfp8", gemm="native")
    with pytest.raises(ValueError, match="preset 'h100' is ambiguous; choose one of: 'h100-xla'"):
        verify.record(mlp_loss, PARAMS, X, out=tmp_path / "c", hardware="h100")
    with pytest.raises(ValueError, match=r"unknown hardware preset 'tpu'.*or 'xla-cpu'"):
        verify.record(mlp_loss, PARAMS, X, out=tmp_path / "c", hardware="tpu")
    with pytest.raises(ValueError, match="stateful: state has no entry"):
        verify.record(mlp_loss, PARAMS, X, out=tmp_path / "d", recipe="delayed", state={})
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "x").write_text("")
    with pytest.raises(ValueError, match="not an empty directory"):
        verify.record(mlp_loss, PARAMS, X, out=tmp_path / "e", recipe="current")


@pytest.mark.slow  # the same path runs in test_gpu_script_cpu_path
def test_native_gemm_mode_on_cpu(tmp_path):
    """gemm='native': the backend's own FP8 dot_general; on a CPU its model is 'xla-cpu'."""
    r = verify.record(mlp_loss, PARAMS, X, out=tmp_path / "n", recipe="current", gemm="native")
    rep = verify.check(r.path)
    assert rep.ok, rep.text()
    g = json.loads((r.path / "manifest.json").read_text())["gemms"][0]
    assert g["model"] == "native" and g["hardware"] == "xla-cpu"


def test_gpu_script_cpu_path(tmp_path):
    """tools/verify_gpu.py on the CPU: XLA's own FP8 GEMMs (gemm="native", model xla-cpu) and
    a plain bfloat16 step recorded and verified; every case under -m slow."""
    spec = importlib.util.spec_from_file_location("verify_gpu", ROOT / "tools/verify_gpu.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "gpu"
    argv = ["--out", str(out), "--cpu", "--width", "32", "--batch", "16"]
    assert tool.main([*argv, "--only", "current-native,plain-bf16"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [s["dump"] for s in summary] == ["current-native", "plain-bf16"]
    assert all(s["ok"] and s["share"] == 1.0 and s["not_checked"] == 0 for s in summary)
    m = json.loads((out / "current-native" / "manifest.json").read_text())
    assert m["step"]["gemm"] == "native" and m["gemms"][0]["hardware"] == "xla-cpu"


@pytest.mark.slow
def test_gpu_script_cpu_path_every_case(tmp_path):
    spec = importlib.util.spec_from_file_location("verify_gpu", ROOT / "tools/verify_gpu.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    argv = ["--out", str(tmp_path / "gpu"), "--cpu", "--width", "32", "--batch", "16"]
    assert tool.main(argv) == 0


# --- a CNN: its convolutions are recorded as the GEMMs over their patches ---------------------
CNN_PARAMS = {
    "k": jnp.asarray(_RNG.normal(size=(6, 2, 3, 2)) * 0.3, jnp.float32),
    "w": jnp.asarray(_RNG.normal(size=(6 * 4 * 6, 5)) * 0.1, jnp.float32),
}
CNN_X = jnp.asarray(_RNG.normal(size=(3, 4, 7, 6)), jnp.float32)


def cnn_loss(p, x):
    """A strided, padded convolution of two feature groups (NCHW), then a dense head."""
    h = jax.lax.conv_general_dilated(x, p["k"], (2, 1), ((1, 1), (0, 1)), feature_group_count=2)
    return jnp.mean((jax.nn.relu(h).reshape(x.shape[0], -1) @ p["w"]) ** 2)


@pytest.mark.parametrize("name", ["delayed", "mxfp8"])
def test_a_cnn_step_records_and_verifies_its_convolution(tmp_path, name):
    """A convolution is recorded as the GEMM over its patches the recipe runs (fprop, dgrad,
    wgrad: codes, scales and outputs checked bit for bit), and the recorded step's gradients
    are recipes.apply's, bit for bit. The convolution used to run unquantized in the recording,
    unlisted, while every checked tensor matched."""
    rec = (
        recipes.Delayed(amax_history_len=4)
        if name == "delayed"
        else recipes.get_recipe("mxfp8", pad=True)
    )
    applied = recipes.apply(cnn_loss, rec)
    state = applied.init_state(CNN_PARAMS, CNN_X) if name == "delayed" else None
    r = verify.record(cnn_loss, CNN_PARAMS, CNN_X, out=tmp_path / name, recipe=rec, state=state)
    rep = verify.check(r.path)
    assert rep.ok and rep.share() == 1.0 and not rep.notes, rep.text()
    manifest = json.loads((r.path / "manifest.json").read_text())
    assert manifest["skipped_sites"] == []
    assert {(g["site"], g["pass"]) for g in manifest["gemms"]} == {
        (s, p) for s in ("conv_general_dilated[0]", "dot_general[0]")
        for p in ("fprop", "dgrad", "wgrad")
    }  # fmt: skip
    conv = [t for t in rep.checked if t.name.startswith("conv_general_dilated[0]/")]
    assert {t.role for t in conv} >= {"codes", "output"}
    value, grads = applied.value_and_grad(0)(state, CNN_PARAMS, CNN_X)[:2]
    # (the loss's mean is summed in another order op by op than in the recording's program)
    assert float(value) == pytest.approx(float(r.value[0]), rel=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(r.value[1]), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_what_the_recorder_has_no_records_for_is_listed_and_warned(tmp_path, monkeypatch):
    """A plain recording (no recipe) has records for matmuls only: the convolutions of the
    function and of its gradient run as written, named in the dump and in verify's report,
    and warned about."""
    from precisionlab.intercept import SkippedOperationWarning, _interpret

    monkeypatch.setattr(_interpret, "_WARNED", set())
    with pytest.warns(SkippedOperationWarning, match="verify.record leaves .* conv_general"):
        r = verify.record(cnn_loss, CNN_PARAMS, CNN_X, out=tmp_path / "plain")
    skipped = json.loads((r.path / "manifest.json").read_text())["skipped_sites"]
    assert skipped and all(s["site"].startswith("conv_general_dilated[") for s in skipped)
    assert "no rule for conv_general_dilated" in skipped[0]["why"]
    rep = verify.check(r.path)
    assert rep.ok and any(n.startswith("not recorded, so not checked: conv_general") for n in
                          rep.notes)  # fmt: skip
