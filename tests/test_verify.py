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


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """name -> (dump directory, recipe, record kwargs): one recorded MLP step per recipe."""
    root = tmp_path_factory.mktemp("verify")
    out = {}
    rec_d, st = _delayed_state()
    cases = {
        "delayed": (rec_d, {"state": st}),
        "current": ("current", {}),
        "blockwise": (recipes.Blockwise(block=16), {}),
        "mxfp8": ("mxfp8", {}),
        "nvfp4": ("nvfp4", {"key": jax.random.PRNGKey(7)}),
    }
    for name, (rec, kw) in cases.items():
        r = verify.record(mlp_loss, PARAMS, X, out=root / name, recipe=rec, **kw)
        out[name] = (r.path, r, kw)
    return out


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
@pytest.mark.parametrize("name", ["delayed", "current", "blockwise", "mxfp8", "nvfp4"])
def test_recorded_steps_verify_bit_equal(dumps, name):
    path, rec, kw = dumps[name]
    rep = verify.check(path)
    assert rep.ok and rep.share() == 1.0, rep.text()
    # every GEMM of both matmuls in the three passes, each with its codes and output checked
    gemms = {(g["site"], g["pass"]) for g in json.loads((path / "manifest.json").read_text())
             ["gemms"]}  # fmt: skip
    assert gemms == {(f"dot_general[{i}]", p) for i in (0, 1) for p in ("fprop", "dgrad",
                                                                       "wgrad")}  # fmt: skip
    roles = {t.role for t in rep.checked}
    assert {"codes", "output"} <= roles
    # the recording changed nothing: the step's value and gradients are recipes.apply's
    ref = recipes.apply(mlp_loss, _rebuild(path)).value_and_grad(0)(
        kw.get("state"), PARAMS, X, key=kw.get("key")
    )
    for a, b in zip(jax.tree.leaves(ref[1]), jax.tree.leaves(rec.value[1]), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


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

    r = verify.record(loss, ws, X, out=tmp_path / "scan", recipe="mxfp8")
    m = r.path / "manifest.json"
    ids = [g["id"] for g in json.loads(m.read_text())["gemms"]]
    assert ids[:3] == [f"dot_general[0]@{i}/fprop" for i in range(3)]
    assert ids[3:] == [f"dot_general[0]@{i}/{w}" for i in (2, 1, 0) for w in ("dgrad", "wgrad")]
    assert verify.check(r.path).ok


# --- one injected fault per mechanism -------------------------------------------------------
def test_fault_scale_rule_floor_instead_of_rceil(dumps, tmp_path):
    """MXFP8's activation quantized with OCP's floor rule where the recipe (TE) says rceil."""
    src = dumps["mxfp8"][0]
    d = _read(src)
    g = "dot_general[0]/fprop"
    x = jnp.asarray(d.arrays[f"{g}/lhs/input"])
    floor = recipes.get_recipe("mxfp8", scale_rule="floor", pad=True)
    q = floor.quantize(x, "x")
    qb = recipes.get_recipe("mxfp8", pad=True).quantize(jnp.asarray(d.arrays[f"{g}/rhs/input"]),
                                                         "w")  # fmt: skip
    exps = _compact(np.asarray(q.block_exp), 32)
    assert not np.array_equal(exps, d.arrays[f"{g}/lhs/block_exp"])  # the rules differ here
    out = recipes.operand_gemm(floor, q, qb)
    bad = damage(src, tmp_path / "bad", {
        f"{g}/lhs/block_scale": _compact(np.asarray(q.block_inv), 32),
        f"{g}/lhs/block_exp": exps, f"{g}/lhs/codes": np.asarray(q.elems),
        f"{g}/out": np.asarray(out)[:, :16, :32],
    })  # fmt: skip
    _expect_first(bad, f"{g}/lhs/block_scale", "scale-rule", "scale_rule='floor'")


def test_fault_stale_amax_in_the_history_and_in_the_scale(dumps, tmp_path):
    """Delayed scaling: (a) the history after the step holds the previous step's amax;
    (b) the quantizer used the scale of the history one step old."""
    src = dumps["delayed"][0]
    d = _read(src)
    site = "dot_general[0]"
    hist0 = d.arrays[f"state/{site}/history"]
    hist1 = d.arrays[f"state_after/{site}/history"].copy()
    assert not np.array_equal(hist1[0], hist0[0])
    hist1[0] = hist0[0]
    a = damage(src, tmp_path / "a", {f"state_after/{site}/history": hist1})
    _expect_first(a, f"state_after/{site}/history", "stale-amax", "previous step's amax")

    rec = _rebuild(src)
    g = f"{site}/fprop"
    older = np.concatenate([hist0[1:], np.zeros_like(hist0[:1])])
    kmax = jnp.asarray([448.0, 448.0, 57344.0], jnp.float32)
    stale = np.asarray(rec.next_scale(jnp.asarray(older), jnp.asarray(
        d.arrays[f"state/{site}/scale"]), kmax))[0]  # fmt: skip
    assert stale != d.arrays[f"{g}/lhs/given_scale"]
    q = rec.quantize(jnp.asarray(d.arrays[f"{g}/lhs/input"]), "x", scale=jnp.float32(stale))
    b = damage(src, tmp_path / "b", {
        f"{g}/lhs/given_scale": np.float32(stale), f"{g}/lhs/row_scale": np.asarray(q.row_inv),
        f"{g}/lhs/codes": np.asarray(q.elems),
    })  # fmt: skip
    _expect_first(b, f"{g}/lhs/given_scale", "stale-amax", "one step old")


def test_fault_stochastic_rounding_bits_from_another_key(dumps, tmp_path):
    """NVFP4's output gradient rounded stochastically with another key."""
    src = dumps["nvfp4"][0]
    d = _read(src)
    g = "dot_general[1]/dgrad"
    x = jnp.asarray(d.arrays[f"{g}/lhs/input"])
    rec = _rebuild(src)
    q = rec.quantize(x, "g", key=jax.random.PRNGKey(12345))
    assert not np.array_equal(np.asarray(q.elems), d.arrays[f"{g}/lhs/codes"].astype(np.float32))
    bad = damage(src, tmp_path / "bad", {f"{g}/lhs/codes": np.asarray(q.elems)})
    _expect_first(bad, f"{g}/lhs/codes", "sr-bits", "stochastically")


def test_fault_zeroed_stochastic_rounding_output(dumps, tmp_path):
    """TE PR #3281: NVFP4's stochastic rounding returned all-zero data."""
    src = dumps["nvfp4"][0]
    g = "dot_general[1]/wgrad"
    codes = _read(src).arrays[f"{g}/lhs/codes"]
    bad = damage(src, tmp_path / "bad", {f"{g}/lhs/codes": np.zeros(codes.shape, np.float32)})
    _expect_first(bad, f"{g}/lhs/codes", "zeroed-or-nonfinite", "all zero")


def test_fault_accumulator_of_another_preset(dumps, tmp_path):
    """Current scaling's forward GEMM summed as cuBLASLt with fast accumulation sums it on an
    H100 (13 fraction bits, truncated) where the recipe says float32."""
    src = dumps["current"][0]
    d = _read(src)
    g = "dot_general[0]/fprop"
    rec = _rebuild(src)
    qa = rec.quantize(jnp.asarray(d.arrays[f"{g}/lhs/input"]), "x")
    qb = rec.quantize(jnp.asarray(d.arrays[f"{g}/rhs/input"]), "w")
    fast = dataclasses.replace(rec, accumulate="h100-cublaslt-fast")
    out = np.asarray(recipes.operand_gemm(fast, qa, qb))
    assert not np.array_equal(out, d.arrays[f"{g}/out"])
    bad = damage(src, tmp_path / "bad", {f"{g}/out": out})
    _expect_first(bad, f"{g}/out", "accumulator", "h100-cublaslt")


def test_fault_wrong_dtype_bf16_where_fp8_was_asked(dumps, tmp_path):
    """marin#6660: the FP8 run computed its GEMM in bfloat16: the operands are the inputs
    rounded to bfloat16, and the output their product."""
    src = dumps["blockwise"][0]
    d = _read(src)
    g = "dot_general[1]/fprop"
    a16 = d.arrays[f"{g}/lhs/input"].astype(ml_dtypes.bfloat16).astype(np.float32)
    b16 = d.arrays[f"{g}/rhs/input"].astype(ml_dtypes.bfloat16).astype(np.float32)
    out = np.einsum("bmk,bnk->bmn", a16.astype(np.float64), b16.astype(np.float64))
    bad = damage(
        src, tmp_path / "bad",
        {f"{g}/lhs/codes": a16, f"{g}/rhs/codes": b16, f"{g}/out": out.astype(np.float32)},
        dtypes={f"{g}/lhs/codes": "bfloat16", f"{g}/rhs/codes": "bfloat16"},
    )  # fmt: skip
    _expect_first(bad, f"{g}/lhs/codes", "wrong-dtype", "bfloat16", "float8_e4m3fn")


def test_fault_wrong_dtype_seen_in_the_output_alone(dumps, tmp_path):
    """Only the output recorded as computed: it equals the bfloat16 GEMM of the inputs."""
    src = dumps["mxfp8"][0]
    d = _read(src)
    g = "dot_general[0]/fprop"
    a = jnp.asarray(d.arrays[f"{g}/lhs/input"]).astype(jnp.bfloat16).astype(jnp.float32)
    b = jnp.asarray(d.arrays[f"{g}/rhs/input"]).astype(jnp.bfloat16).astype(jnp.float32)
    out = jnp.einsum("bmk,bnk->bmn", a, b, precision=jax.lax.Precision.HIGHEST)
    bad = damage(src, tmp_path / "bad", {f"{g}/out": np.asarray(out)[:, :16, :32]})
    _expect_first(bad, f"{g}/out", "wrong-dtype", "bfloat16")


def test_fault_one_flipped_output_bit_is_unknown(dumps, tmp_path):
    src = dumps["mxfp8"][0]
    g = "dot_general[0]/wgrad"
    out = _read(src).arrays[f"{g}/out"].copy()
    flat = out.reshape(-1).view(np.uint32)
    flat[5] ^= np.uint32(1 << 29)  # an exponent bit: no accumulation gives that
    bad = damage(src, tmp_path / "bad", {f"{g}/out": out})
    rep = _expect_first(bad, f"{g}/out", "unknown")
    assert rep.first.elements - rep.first.equal == 1


def test_every_label_is_documented_and_tested():
    """The fixed set: each label has a meaning, and a fault test above asserts it."""
    assert set(verify.LABELS) == {"scale-rule", "stale-amax", "sr-bits", "accumulator",
                                  "wrong-dtype", "zeroed-or-nonfinite", "unknown"}  # fmt: skip
    source = Path(__file__).read_text()
    for label in verify.LABELS:
        assert f'"{label}"' in source.split("def test_every_label")[0], label
    page = (Path(__file__).parents[1] / "docs/guides/verify.md").read_text()
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
    for name, edit in {
        "future-version": lambda m: m.update(version=99),
        "other-format": lambda m: m.update(format="something-else"),
        "wrong-shape": lambda m: m["tensors"][3].update(shape=[1, 2, 3]),
        "wrong-storage": lambda m: m["tensors"][3].update(dtype="float16", storage="float16"),
        "unknown-gemm": lambda m: m["tensors"][3].update(gemm="nowhere/fprop"),
        "tensors-not-list": lambda m: m.update(tensors={"a": 1}),
        "bad-recipe": lambda m: m["step"]["recipe"].update({"class": "Nope"}),
    }.items():
        p = copy(name)
        m = json.loads((p / "manifest.json").read_text())
        edit(m)
        (p / "manifest.json").write_text(json.dumps(m))
    return cases


def test_cli_damaged_dumps_are_one_line_exit_2(dumps, tmp_path, capsys):
    cases = _damaged_dumps(dumps["current"][0], tmp_path)
    cases["a-file"] = tmp_path / "a-file.txt"
    cases["a-file"].write_text("x")
    for name, path in cases.items():
        status = main(["verify", str(path)])
        err = capsys.readouterr().err
        assert status == 2, (name, err)
        assert err.count("\n") == 1 and "Traceback" not in err, (name, err)
        assert err.startswith("precisionlab verify: error: "), (name, err)


def test_reading_a_dump_checks_versions_and_sizes(dumps, tmp_path):
    src = dumps["current"][0]
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


def test_size_estimate_and_bound(tmp_path):
    size = verify.estimate(mlp_loss, PARAMS, X, recipe="mxfp8")
    r = verify.record(mlp_loss, PARAMS, X, out=tmp_path / "all", recipe="mxfp8")
    assert size == r.bytes
    with pytest.raises(ValueError, match=r"would hold about .* max_bytes=1000; record fewer"):
        verify.record(mlp_loss, PARAMS, X, out=tmp_path / "no", recipe="mxfp8", max_bytes=1000)
    assert not (tmp_path / "no").exists()
    one = verify.record(mlp_loss, PARAMS, X, out=tmp_path / "one", recipe="mxfp8",
                        sites="dot_general[1]", results=False)  # fmt: skip
    assert one.bytes < r.bytes / 2
    names = {g["site"] for g in json.loads((one.path / "manifest.json").read_text())["gemms"]}
    assert names == {"dot_general[1]"}
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


def test_native_gemm_mode_on_cpu(tmp_path):
    """gemm='native': the backend's own FP8 dot_general; on a CPU its model is 'xla-cpu'."""
    r = verify.record(mlp_loss, PARAMS, X, out=tmp_path / "n", recipe="current", gemm="native")
    rep = verify.check(r.path)
    assert rep.ok, rep.text()
    g = json.loads((r.path / "manifest.json").read_text())["gemms"][0]
    assert g["model"] == "native" and g["hardware"] == "xla-cpu"
