"""Real data (``text``, ``digits``), the ``conv`` model and ``ops.conv2d``, against independent
references: the files on disk read with pathlib/hashlib, scikit-learn's own arrays, and float64
numpy convolutions rounded with ml_dtypes."""

import hashlib
import json
import pathlib
import sysconfig

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from precisionlab.mixed import get_policy, ops
from precisionlab.train import TrainConfig, make_data, make_model, train

# --- text ------------------------------------------------------------------------------------


def _rows(batch):
    return [bytes(r.astype(np.uint8)) for r in batch["tokens"]]


def _letters_dir(tmp_path, n=6, size=500):
    """n files whose bytes are all one letter each (file i: chr(ord('a') + i))."""
    for i in range(n):
        (tmp_path / f"f{i}.txt").write_bytes(bytes([ord("a") + i]) * size)
    return tmp_path


def test_text_default_corpus_is_the_stdlib_source_read_independently():
    d = make_data("text", max_bytes=200_000)
    info = d.describe()
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = sorted(
        (
            p
            for p in root.rglob("*.py")
            if p.is_file()
            and not skip.intersection(p.relative_to(root).parts)
            and not any(s.startswith(".") for s in p.relative_to(root).parts)
        ),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    names, blobs, total = [], [], 0
    for p in files:
        if total >= 200_000:
            break
        data = p.read_bytes()[: 200_000 - total]
        if not data or b"\0" in data:
            continue
        names.append(p.relative_to(root).as_posix())
        blobs.append(data)
        total += len(data)
    assert info["source"] == "python-stdlib" and info["root"] == str(root)
    assert info["file_list"] == names and info["files"] == len(names)
    assert info["bytes"] == total == 200_000 and info["truncated"]
    h = hashlib.sha256()
    for n, b in zip(names, blobs, strict=True):
        h.update(n.encode() + b"\0" + len(b).to_bytes(8, "little") + b)
    assert info["sha256"] == h.hexdigest()
    # Every train window is a substring of the train files' concatenation, every eval window of
    # the held-out files' (every 10th file).
    held = set(info["eval_files"])
    assert held and held < set(names)
    train_stream = b"".join(b for n, b in zip(names, blobs, strict=True) if n not in held)
    eval_stream = b"".join(b for n, b in zip(names, blobs, strict=True) if n in held)
    assert info["bytes_train"] == len(train_stream) and info["bytes_eval"] == len(eval_stream)
    for row in _rows(d.batch(0, 8)):
        assert len(row) == 65 and row in train_stream
    for row in _rows(d.batch(0, 8, split="eval")):
        assert row in eval_stream
    assert d.model_kwargs() == {"vocab_size": 256, "seq_len": 64}
    assert json.loads(json.dumps(info)) == info  # what a run store can write
    assert (info["seq_len"], info["max_bytes"], info["path"]) == (64, 200_000, None)


def test_describe_of_the_generated_datasets_is_their_options():
    assert make_data("teacher", in_dim=8).describe() == {
        "name": "teacher",
        "in_dim": 8,
        "num_classes": 10,
        "teacher_width": 64,
        "input_scale": 1.0,
        "label_noise": 0.0,
        "task_seed": 0,
    }


def test_text_batches_are_a_pure_function_of_seed_split_step(tmp_path):
    path = str(_letters_dir(tmp_path))
    a, b = make_data("text", path=path, seq_len=8), make_data("text", path=path, seq_len=8)
    np.testing.assert_array_equal(a.batch(5, 4, seed=3)["tokens"], b.batch(5, 4, seed=3)["tokens"])
    resumed = next(a.batches(4, seed=3, start=5))["tokens"]  # what a resumed run reads first
    np.testing.assert_array_equal(resumed, a.batch(5, 4, seed=3)["tokens"])
    assert a.batch(5, 4, seed=3)["tokens"].dtype == np.int32
    assert not np.array_equal(a.batch(5, 64, seed=3)["tokens"], a.batch(6, 64, seed=3)["tokens"])
    assert a.describe() == b.describe()


def test_text_split_by_file(tmp_path):
    # eval_fraction 0.5: every 2nd file is held out, f1, f3, f5 ('b', 'd', 'f').
    d = make_data("text", path=str(_letters_dir(tmp_path)), seq_len=8, eval_fraction=0.5)
    assert d.describe()["eval_files"] == ["f1.txt", "f3.txt", "f5.txt"]
    train_bytes = set(b"".join(_rows(d.batch(0, 256))))
    eval_bytes = set(b"".join(_rows(d.batch(0, 256, split="eval"))))
    assert train_bytes == set(b"ace") and eval_bytes == set(b"bdf")


def test_text_single_file_split_by_bytes_and_cap(tmp_path):
    f = tmp_path / "one.txt"
    f.write_bytes(b"x" * 900 + b"y" * 100)
    d = make_data("text", path=str(f), seq_len=8, eval_fraction=0.1)
    info = d.describe()
    assert (info["bytes_train"], info["bytes_eval"]) == (900, 100)
    assert set(b"".join(_rows(d.batch(0, 64)))) == {ord("x")}
    assert set(b"".join(_rows(d.batch(0, 64, split="eval")))) == {ord("y")}
    capped = make_data("text", path=str(f), seq_len=8, max_bytes=500).describe()
    assert capped["bytes"] == 500 and capped["truncated"]


@pytest.mark.parametrize(
    ("setup", "kwargs", "match"),
    [
        (None, {"path": "/no/such/dir"}, "does not exist"),
        ("empty", {}, "no files matching"),
        ("nul", {}, "is binary"),
        ("latin1", {}, "is binary"),
        ("tiny", {}, "fewer than one window"),
        ("ok", {"pattern": "*.md"}, "no files matching"),
        ("ok", {"max_bytes": 2**29}, "max_bytes must be <= 268435456"),
        ("ok", {"eval_fraction": 0.9}, "eval_fraction"),
        ("ok", {"seq_len": 1}, "seq_len"),
        ("ok", {"window": 3}, "unknown option"),
    ],
)
def test_text_bad_input_names_the_value(tmp_path, setup, kwargs, match):
    if setup == "ok":
        _letters_dir(tmp_path)
    elif setup == "nul":
        (tmp_path / "a.txt").write_text("hello " * 100)
        (tmp_path / "b.bin").write_bytes(b"abc\0def" * 100)
    elif setup == "latin1":
        (tmp_path / "a.txt").write_bytes("caf\u00e9 ".encode("latin-1") * 100)
    elif setup == "tiny":
        (tmp_path / "a.txt").write_text("short")
        (tmp_path / "b.txt").write_text("text")
    kw = {"path": str(tmp_path), **kwargs}
    with pytest.raises(ValueError, match=match) as err:
        make_data("text", **kw)
    if setup == "nul":
        assert "b.bin" in str(err.value)


# --- digits ----------------------------------------------------------------------------------


def test_digits_images_labels_and_fixed_split():
    datasets = pytest.importorskip("sklearn.datasets")
    ref = datasets.load_digits()
    lookup = {
        img.astype(np.uint8).tobytes(): int(t)
        for img, t in zip(ref.images, ref.target, strict=True)
    }
    d = make_data("digits")
    info = d.describe()
    assert (info["images"], info["train_size"], info["eval_size"]) == (1797, 1500, 297)
    ev = d.batch(0, 297, split="eval")
    tr = d.batch(0, 20_000, seed=1)
    for b in (ev, tr):
        assert b["x"].dtype == np.float32 and b["x"].shape[1] == 64 and b["y"].dtype == np.int32
        pixels = np.rint(b["x"] * 16).astype(np.uint8)
        np.testing.assert_array_equal(pixels, b["x"] * 16)  # exact: k / 16 is a float32
        assert [lookup[p.tobytes()] for p in pixels] == b["y"].tolist()
    eval_set = {r.tobytes() for r in ev["x"]}
    train_set = {r.tobytes() for r in tr["x"]}
    assert len(eval_set) == 297 and len(train_set) == 1500 and not eval_set & train_set
    # Fixed: the same for another instance and independent of the run seed.
    again = make_data("digits").batch(0, 297, seed=7, split="eval")
    np.testing.assert_array_equal(again["x"], ev["x"])
    assert make_data("digits").describe() == info
    assert (
        make_data("digits", split_seed=1).describe()["eval_indices_sha256"]
        != info["eval_indices_sha256"]
    )
    assert make_data("digits", input_scale=100.0).batch(0, 297, split="eval")["x"].max() == 100.0


def test_digits_without_scikit_learn_says_how_to_install(monkeypatch, tmp_path, capsys):
    import sys

    from precisionlab.cli import main

    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # import fails
    with pytest.raises(ModuleNotFoundError, match=r"scikit-learn.*pip install") as err:
        make_data("digits")
    assert isinstance(err.value, ValueError)  # config validation reports it in one line
    exp = tmp_path / "e.toml"
    exp.write_text('kind = "train"\nname = "d"\n[train]\nmodel = "conv"\ndata = "digits"\n')
    assert main(["run", str(exp), "--out", str(tmp_path / "run")]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and "needs scikit-learn" in err_lines[0], err_lines
    assert err_lines[0].startswith("precisionlab run: error: ")


# --- conv2d and the conv model -------------------------------------------------------------


def _conv_same_f64(x, w):
    """Direct float64 SAME convolution, NHWC x HWIO, stride 1."""
    kh, kw = w.shape[:2]
    xp = np.pad(x, ((0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2), (0, 0)))
    out = np.zeros((*x.shape[:3], w.shape[3]))
    for i in range(kh):
        for j in range(kw):
            out += xp[:, i : i + x.shape[1], j : j + x.shape[2], :] @ w[i, j]
    return out


@pytest.mark.parametrize(("spec", "np_dtype"), [("f16", np.float16), ("bf16", ml_dtypes.bfloat16)])
def test_conv2d_rounds_once_to_the_compute_dtype(spec, np_dtype):
    g = np.random.default_rng(0)
    x = g.normal(size=(2, 6, 6, 3)).astype(np.float32)
    w = g.normal(size=(3, 3, 3, 4)).astype(np.float32)
    b = g.normal(size=(4,)).astype(np.float32)
    p = get_policy(f"p=f32,c={spec},o=f32")
    got = np.asarray(jax.jit(lambda x, w, b: ops.conv2d(x, w, b, policy=p))(x, w, b))
    assert got.dtype == np_dtype
    xc, wc, bc = (a.astype(np_dtype).astype(np.float64) for a in (x, w, b))
    conv = _conv_same_f64(xc, wc).astype(np_dtype).astype(np.float64)  # one rounding
    ref = (conv + bc).astype(np_dtype)  # bias add rounded
    # float32 accumulation then one rounding can differ from the exact sum by a double rounding:
    # at most one unit in the last place, and rarely.
    ulp = np.abs(np.spacing(np.abs(ref.astype(np.float64)).astype(np_dtype)).astype(np.float64))
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    assert (diff <= ulp).all() and (diff == 0).mean() > 0.95


def test_conv2d_fp16_overflow_is_inf_and_bf16_is_not():
    x = jnp.full((1, 3, 3, 1), 300.0)
    w = jnp.full((3, 3, 1, 1), 300.0)  # centre pixel sums 9 * 90000 > 65504
    f16 = np.asarray(ops.conv2d(x, w, policy=get_policy("p=f32,c=f16,o=f32")))
    bf16 = np.asarray(ops.conv2d(x, w, policy=get_policy("p=f32,c=bf16,o=f32")))
    assert np.isinf(f16[0, 1, 1, 0]) and np.isfinite(bf16).all()
    with pytest.raises(ValueError, match="padding"):
        ops.conv2d(x, w, padding="FULL")


def test_conv_model_matches_a_float64_numpy_network():
    m = make_model("conv", in_dim=64, num_classes=10, width=4, depth=2)
    params = m.init(jax.random.PRNGKey(0))
    x = np.random.default_rng(1).uniform(0, 1, size=(5, 64)).astype(np.float32)
    got = np.asarray(m.apply(params, jnp.asarray(x)))
    h = x.astype(np.float64).reshape(5, 8, 8, 1)
    for layer in params["convs"]:
        h = np.maximum(_conv_same_f64(h, np.asarray(layer["w"], np.float64)) + layer["b"], 0)
        h = h.reshape(5, h.shape[1] // 2, 2, h.shape[2] // 2, 2, -1).max(axis=(2, 4))
    ref = h.reshape(5, -1) @ np.asarray(params["out"]["w"], np.float64) + params["out"]["b"]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    shapes = m.activation_shapes(5, "p=f32,c=bf16,o=f32")
    assert shapes["conv1/out"].shape == (5, 2, 2, 8) and shapes["conv1/out"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="square"):
        make_model("conv", in_dim=60)
    with pytest.raises(ValueError, match="activation"):
        make_model("conv", activation="swish")


def test_train_runs_on_text_and_digits(tmp_path):
    pytest.importorskip("sklearn")
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    (tmp_path / "b.txt").write_text("pack my box with five dozen liquor jugs. " * 40)
    text = TrainConfig(
        model="transformer",
        data="text",
        data_kwargs={"path": str(tmp_path), "seq_len": 16, "eval_fraction": 0.5},
        model_kwargs={"d_model": 16, "depth": 1, "heads": 2},
        lr=1e-2,
        steps=30,
        batch_size=8,
        eval_batches=2,
        policy="p=f32,c=bf16,o=f32",
    )
    digits = TrainConfig(
        model="conv",
        data="digits",
        model_kwargs={"width": 4},
        lr=1e-2,
        steps=30,
        batch_size=32,
        eval_batches=2,
        policy="p=f32,c=f16,o=f32",
        loss_scale="dynamic",
    )
    for cfg, chance in ((text, 1 / 256), (digits, 0.1)):
        r = train(cfg, quiet=True)
        assert not r.diverged and r.eval_metric > 2 * chance


# --- experiments/real_data.toml --------------------------------------------------------------

_REAL_DATA = pathlib.Path(__file__).parents[2] / "experiments" / "real_data.toml"


def _real_data_experiment(overrides=(), keep=None):
    import tomllib

    from precisionlab.experiments._config import apply_overrides, experiment_from_document

    doc = apply_overrides(tomllib.loads(_REAL_DATA.read_text()), list(overrides))
    if keep is not None:
        doc["settings"] = {k: v for k, v in doc["settings"].items() if k in keep}
        doc["variant"] = [v for v in doc["variant"] if v["name"] in keep[next(iter(keep))]]
    return experiment_from_document(doc, str(_REAL_DATA))


def test_real_data_experiment_validates():
    pytest.importorskip("sklearn")
    _real_data_experiment()  # every setting and variant checked, data and models built


@pytest.mark.slow
def test_real_data_digits_mlp_outcomes(tmp_path):
    """The digits-mlp claims of docs/guides/real-data.md, at the shipped steps: swamping in
    pure bf16 with round-to-nearest, cured by stochastic rounding; fp16 without scaling
    matches fp32 (no harmful underflow); no overflow (no skipped step, the dynamic scale never
    backs off)."""
    pytest.importorskip("sklearn")
    from precisionlab.experiments import _runner as runner
    from precisionlab.experiments import _store as store

    names = ("fp32", "fp16-noscale", "fp16-dynamic", "bf16-pure-nearest", "bf16-pure-stochastic")
    exp = _real_data_experiment(
        ["train.hist_interval=0", "train.shadow=false", "train.checkpoint_interval=0"],
        keep={"digits-mlp": names},
    )
    with store.locked_run(tmp_path) as previous:
        runner.run_locked(exp, tmp_path, previous=previous, quiet=True)
    out = {u["name"]: u for u in store.read_json(tmp_path / "summary.json")["variants"]}
    fp32, noscale, dynamic = (out[f"digits-mlp/{n}"] for n in names[:3])
    nearest, stochastic = (
        out["digits-mlp/bf16-pure-nearest"],
        out["digits-mlp/bf16-pure-stochastic"],
    )
    assert fp32["eval_metric"] > 0.9
    assert nearest["final_loss"] > 2 * fp32["final_loss"]
    assert abs(stochastic["final_loss"] - fp32["final_loss"]) < 0.3 * fp32["final_loss"]
    assert abs(noscale["eval_loss"] - fp32["eval_loss"]) < 0.05 * fp32["eval_loss"]
    assert dynamic["skipped_steps"] == 0 and dynamic["min_loss_scale"] == 2.0**16


def test_run_store_records_the_corpus_of_each_unit(tmp_path):
    from precisionlab.experiments import _store as store
    from precisionlab.experiments._runner import run_file

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    (corpus / "b.txt").write_text("pack my box with five dozen liquor jugs. " * 40)
    toml = tmp_path / "tiny_text.toml"
    toml.write_text(
        f"""kind = "train"
name = "tiny_text"
[train]
model = "transformer"
data = "text"
data_kwargs = {{ path = "{corpus}", seq_len = 16, eval_fraction = 0.5 }}
model_kwargs = {{ d_model = 16, depth = 1, heads = 2 }}
steps = 2
batch_size = 4
eval_batches = 1
telemetry = {{ enabled = false }}  # not the subject: most of the run's compile time
[[variant]]
name = "fp32"
"""
    )
    run_dir = run_file(toml, out=tmp_path / "run", quiet=True)
    (unit,) = store.read_json(run_dir / "summary.json")["variants"]
    recorded = store.read_json(run_dir / "variants" / unit["id"] / "data.json")
    # The record names both files and their total size as read from disk, with a content hash.
    assert sorted(recorded["file_list"]) == ["a.txt", "b.txt"]
    assert recorded["bytes"] == sum(p.stat().st_size for p in corpus.iterdir())
    assert len(recorded["sha256"]) == 64 and int(recorded["sha256"], 16) >= 0
