"""Batch invariance: the measurement on this backend against an independent comparison,
predictions that say "unknown" wherever a library's kernel choice is not modelled (every
preset), the model's "one kernel: invariant" claim checked on the model itself; and the
``invariance`` and ``order`` commands (output, JSON, one-line errors with exit status 2)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precisionlab import hardware
from precisionlab.cli import main
from precisionlab.consistency import measure_gemm, measure_model, predict
from precisionlab.train import make_model


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def test_measure_gemm_against_a_direct_comparison():
    r = measure_gemm([2, 1, 5], 32, 96, "float32", seed=3)
    assert r.ms == (1, 2, 5) and r.differ[0] == 0 and r.max_abs[0] == 0
    rng = np.random.default_rng(3)
    a = rng.standard_normal((5, 96)).astype(np.float32)
    b = (rng.standard_normal((96, 32)) / np.sqrt(96)).astype(np.float32)
    f = jax.jit(jnp.matmul)
    ref = _bits(f(a[:1], b))
    for m, d in zip(r.ms, r.differ, strict=True):
        assert d == int(np.sum(_bits(np.asarray(f(a[:m], b))[:1]) != ref))
    assert r.invariant == (not any(r.differ))
    assert r.verdict == ("invariant" if r.invariant else "varies at M=" + ",".join(
        str(m) for m, d in zip(r.ms, r.differ, strict=True) if d))  # fmt: skip
    with pytest.raises(ValueError, match="at least two"):
        measure_gemm([4], 8, 8)
    with pytest.raises(ValueError, match="unknown dtype"):
        measure_gemm([1, 2], 8, 8, "int8")


def test_measure_model_against_a_direct_comparison():
    model = make_model("transformer", vocab_size=16, seq_len=4, d_model=8, depth=1, heads=2)
    params = model.init(jax.random.PRNGKey(0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 16, (3, 4)), jnp.int32)
    r = measure_model(model, params, tokens, [1, 3], "fp32")
    f = jax.jit(model.apply)
    want = int(np.sum(_bits(f(params, tokens)[:1]) != _bits(f(params, tokens[:1]))))
    assert r.differ == (0, want)
    with pytest.raises(ValueError, match="B >= 4"):
        measure_model(model, params, tokens, [1, 4])


def test_predictions_are_unknown_for_every_preset_never_a_guess():
    for name in hardware.PRESETS:
        for dtype in ("bfloat16", "float16", "float8_e4m3fn"):
            p = predict(name, [1, 2, 8], 16, 128, dtype, stake=False)
            assert p.verdict in ("unknown", "unsupported"), (name, dtype, p.verdict)
            if p.verdict == "unknown":
                assert p.with_one_kernel == "invariant" and "per (M, N, K)" in p.why
            else:
                assert p.why and p.with_one_kernel is None
    assert predict("v100", [1, 2], 16, 64, "bfloat16").verdict == "unsupported"
    with pytest.raises(ValueError, match="predictions cover"):
        predict("h100-xla", [1, 2], 16, 64, "float32")
    with pytest.raises(ValueError, match="ambiguous"):
        predict("h100", [1, 2], 16, 64, "bfloat16")


@pytest.mark.parametrize("preset", ["h100-xla", "h100-cublaslt"])
def test_one_kernel_for_every_m_is_invariant_on_the_model(preset):
    # the claim "with one kernel: invariant" is the model's: each output from its row only
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 80)).astype(jnp.bfloat16)  # K = 80: two slices on h100-xla
    b = rng.standard_normal((80, 8)).astype(jnp.bfloat16)
    kw = hardware.preset(preset)
    full = np.asarray(hardware.gemm(a, b, **kw))
    assert np.array_equal(_bits(np.asarray(hardware.gemm(a[:1], b, **kw))), _bits(full[:1]))


@pytest.mark.slow  # compiles five GEMM programs at K = 512 (~4 CPU s); test_invariance_command
# reaches the same code (K = 80)
def test_what_is_at_stake_is_computed_on_the_model():
    p = predict("h100-xla", [1, 4], 16, 512, "float16", seed=2)
    assert p.schedule == "split-K 64 (in order)"
    assert set(p.at_stake) == set(p.at_stake_out) and "one chain over K" in p.at_stake
    rng = np.random.default_rng(2)
    a = rng.standard_normal((4, 512)).astype(np.float32).astype(jnp.float16)
    b = (rng.standard_normal((512, 16)) / np.sqrt(512)).astype(np.float32).astype(jnp.float16)
    kw = hardware.preset("h100-xla")
    base = np.asarray(hardware.gemm(a, b, **kw))
    chain = np.asarray(hardware.gemm(a, b, split_k=None, **kw))
    assert p.at_stake["one chain over K"] == np.mean(_bits(base) != _bits(chain)) > 0.5
    out = np.mean(_bits(base.astype(np.float16)) != _bits(chain.astype(np.float16)))
    assert p.at_stake_out["one chain over K"] == out < p.at_stake["one chain over K"]


# --- the commands -------------------------------------------------------------------------
def test_invariance_command(capsys):
    assert main(["invariance", "--m", "1,2", "--n", "4", "--k", "16,80", "--dtype",
                 "float32,bfloat16", "--predict", "h100-xla"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "Measured on cpu" in out and "M=2" in out
    assert "Predicted for named GPUs" in out and "h100-xla: unknown: XLA picks" in out
    # two K, bfloat16 only (float32 is not predicted), in each of the two tables
    assert out.count("\nh100-xla ") == 4 and "\nAt stake if the schedule changes" in out
    assert max(len(line) for line in out.splitlines()) <= 100  # the site's code blocks
    assert main(["invariance", "--m", "1,2", "--n", "4", "--k", "8", "--dtype", "float16",
                 "--json"]) == 0  # fmt: skip
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["kind"] for r in rows] == ["measured", "predicted", "predicted"]
    assert rows[1]["verdict"] == "unknown"


@pytest.mark.parametrize(("argv", "message"), [
    (["--m", "1"], "at least two batch sizes"),
    (["--m", "1,x"], "'x' is not an integer"),
    (["--n", "0"], "out of range"),
    (["--dtype", "int8"], "unknown 'int8'"),
    (["--predict", "h100"], "ambiguous"),
    (["--n", "1,2,3,4,5", "--k", "1,2,3,4,5", "--dtype", "float32,float16,bfloat16"], "at most"),
])  # fmt: skip
def test_invariance_bad_input_is_one_line(capsys, argv, message):
    assert main(["invariance", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_order_command(capsys):
    assert main(["order", "--k", "8"]) == 0
    out = capsys.readouterr().out
    assert "XLA's reduce on cpu" in out and "probes (all pairs: 28)" in out
    assert main(["order", "--op", "dot", "--k", "40", "--dtype", "float16", "--backend",
                 "h100-xla", "--compare", "h100-xla"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "{steps[0..31 by 16], 32, 33, 34" in out and "h100-xla at K=40: matches" in out
    assert main(["order", "--op", "dot", "--k", "40", "--dtype", "float16", "--compare",
                 "a100", "--json"]) == 0  # fmt: skip
    got = json.loads(capsys.readouterr().out)
    assert got["comparison"].startswith("differs: the model computes")
    assert got["probes"] < got["all_pairs"] and isinstance(got["tree"], list)


@pytest.mark.parametrize(("argv", "message"), [
    (["--k", "1"], "out of range"),
    (["--k", "300", "--dtype", "bfloat16"], "allowed 2..256"),
    (["--dtype", "int8"], "unknown 'int8'"),
    (["--backend", "h100"], "ambiguous"),
    (["--backend", "h100-xla"], "use it with --op dot"),
    (["--compare", "h100-xla"], "16-bit inputs"),
    (["--width", "5"], "out of range"),
])  # fmt: skip
def test_order_bad_input_is_one_line(capsys, argv, message):
    assert main(["order", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_order_with_torch_says_when_it_is_missing(capsys):
    pytest.importorskip("jax")
    try:
        import torch  # noqa: F401
    except ImportError:
        assert main(["order", "--backend", "torch"]) == 2
        assert "torch is not installed" in capsys.readouterr().err
    else:
        assert main(["order", "--backend", "torch", "--k", "8"]) == 0
