"""Deterministic CPU runs: the fixed summation order gives the same bits on one core and on two, is
the documented one, and a deterministic run records its CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import _im2col as im2col
import numpy as np
import pytest
from _tiny_runs import TWO, two_variants

from precisionlab.experiments import _store as store


@pytest.fixture
def work(tmp_path, monkeypatch):
    return two_variants(tmp_path, monkeypatch)


_CORES = textwrap.dedent(
    """
    import os, sys, hashlib
    if sys.argv[2] != "all":  # before JAX starts: the cores XLA may split a sum over
        os.sched_setaffinity(0, {int(sys.argv[2])})
    import jax, jax.numpy as jnp, numpy as np
    from precisionlab.train._deterministic import fixed_order
    a = jnp.asarray(np.random.default_rng(0).standard_normal((512, 2048)).astype(np.float32))
    w = jnp.asarray(np.random.default_rng(1).standard_normal((2048, 8)).astype(np.float32))
    f = lambda a, w: (jnp.sum(a), jnp.mean(a, axis=0), a @ w)
    fn = fixed_order(f) if sys.argv[1] == "fixed" else f
    print(hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.jit(fn)(a, w))).hexdigest())
    """
)


def _digest(mode: str, cores: str | None) -> str:
    argv = [sys.executable, "-c", _CORES, mode, "all" if cores is None else cores]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120)
    return out.stdout.strip()


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2,
    reason="compares a sum on one core with the same sum on two, and this process may use "
    "only one core",
)
def test_fixed_order_gives_the_same_bits_on_one_core_and_on_two():
    """Why: the main job's numbers differed between two CPUs with the same jax. One cause
    reproduces on this machine: XLA splits a large sum over the cores the process may use, so
    jnp.sum's last bits change with the core count. The fixed order does not."""
    assert _digest("plain", "0") != _digest("plain", None)  # what the fixed order fixes
    assert _digest("fixed", "0") == _digest("fixed", None)


def _pairwise(t: np.ndarray) -> np.ndarray:
    """numpy reference of the fixed order: zero-pad the last axis to a power of two, halve."""
    k = t.shape[-1]
    width = 1 << max(0, (k - 1).bit_length())
    t = np.concatenate([t, np.zeros((*t.shape[:-1], width - k), t.dtype)], axis=-1)
    while t.shape[-1] > 1:
        h = t.shape[-1] // 2
        t = t[..., :h] + t[..., h:]
    return t[..., 0]


@pytest.mark.parametrize("jit", [False, True])
def test_the_fixed_order_is_the_documented_one(jit):
    """pairwise_dot and pairwise_sum against a numpy float32 reimplementation of the order
    (bit for bit), with a batch axis, an odd K and a bfloat16 matmul rounded once; op by op
    and compiled (XLA fuses a product into its sum, where LLVM would contract an FMA: the
    compiled order was fma(a, b, p) at the first halving before the products were kept
    apart)."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    from precisionlab.train import _deterministic

    pairwise_dot, pairwise_sum = _deterministic.pairwise_dot, _deterministic.pairwise_sum
    if jit:
        pairwise_dot = jax.jit(pairwise_dot, static_argnums=(2, 3))
        pairwise_sum = jax.jit(pairwise_sum, static_argnums=1)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 5, 37)).astype(np.float32)
    b = rng.standard_normal((2, 37, 3)).astype(np.float32)
    got = pairwise_dot(jnp.asarray(a), jnp.asarray(b), (((2,), (1,)), ((0,), (0,))), jnp.float32)
    want = _pairwise(np.moveaxis(a[:, :, :, None] * b[:, None, :, :], 2, -1))
    np.testing.assert_array_equal(np.asarray(got), want)
    x = rng.standard_normal((6, 19, 4)).astype(np.float32)
    np.testing.assert_array_equal(
        np.asarray(pairwise_sum(jnp.asarray(x), (0, 2))),
        _pairwise(np.transpose(x, (1, 0, 2)).reshape(19, -1)),
    )
    a16, b16 = a[0].astype(ml_dtypes.bfloat16), b[0].astype(ml_dtypes.bfloat16)
    got16 = pairwise_dot(jnp.asarray(a16), jnp.asarray(b16), (((1,), (0,)), ((), ())),
                         jnp.bfloat16)  # fmt: skip
    wide = a16.astype(np.float32)[:, :, None] * b16.astype(np.float32)[None, :, :]
    want16 = _pairwise(np.moveaxis(wide, 1, -1)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(got16).view(np.uint16), want16.view(np.uint16))


def test_a_convolution_and_its_gradient_run_in_the_fixed_order():
    """A convolution is the GEMM over its patches in the fixed order: bit for bit the numpy
    reimplementation on a hand-made im2col (strided, padded, two feature groups, K = kernel
    taps then channels); and in a function computing its gradient, no convolution, matmul or
    sum is left in XLA's order (the gradient's transposed convolutions included)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from precisionlab.train._deterministic import fixed_order

    rng = np.random.default_rng(5)
    n, c, h, w, o, g = 2, 4, 7, 6, 6, 2
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    k = rng.standard_normal((o, c // g, 3, 2)).astype(np.float32)
    strides, pads = (2, 1), ((1, 1), (0, 1))

    def conv(x, k):
        return lax.conv_general_dilated(x, k, strides, pads, feature_group_count=g)

    got = np.asarray(jax.jit(fixed_order(conv))(x, k))
    # the GEMM's operands made by hand (tests/_im2col.py), products summed in the fixed order
    a, b = im2col.patches(x, (3, 2), strides, pads, g), im2col.kernel_rows(k, g)
    gemm = _pairwise(a[:, :, None, :] * b[:, None, :, :])  # (G, M, O_g)
    ho, wo = im2col.out_size(h, 3, 2, pads[0]), im2col.out_size(w, 2, 1, pads[1])
    want = gemm.transpose(1, 0, 2).reshape(n, ho, wo, o).transpose(0, 3, 1, 2)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, np.asarray(conv(x, k)), rtol=1e-5, atol=1e-5)

    def loss(x, k):
        return jnp.sum(conv(x, k) ** 2)

    step = fixed_order(jax.value_and_grad(loss, argnums=(0, 1)))
    program = str(jax.make_jaxpr(step)(x, k))
    assert not [p for p in ("conv_general_dilated", "dot_general", "reduce_sum") if p in program]
    (_, grads), (_, plain) = jax.jit(step)(x, k), jax.jit(jax.value_and_grad(loss, (0, 1)))(x, k)
    for a, b in zip(grads, plain, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_a_deterministic_run_records_the_cpu_and_trains(work, cli):
    """`run --deterministic` sets train.deterministic, trains through the fixed order (its
    losses are finite and close to the plain run's) and records the CPU's instruction set,
    the usable cores and XLA's version and flags in environment.json."""
    (work / "d.toml").write_text(TWO.format(steps=3).replace(
        "[[variant]]\nname = \"b\"\n", "") + "telemetry = { enabled = false }\n")  # fmt: skip
    base = ["run", "d.toml", "--quiet", "--no-report", "--no-cache"]
    cli([*base, "--out", "plain"], status=0, limit_s=600)  # compiles: slow on a loaded machine
    cli([*base, "--out", "fixed", "--deterministic"], status=0, limit_s=600)
    config = store.read_json(work / "fixed" / "config.json")
    assert config["resolved"]["units"][0]["params"]["deterministic"] is True
    env = store.read_json(work / "fixed" / "environment.json")
    assert env["cpu"]["cores_usable"] >= 1 and env["xla"]["jaxlib"]
    if env["cpu"]["machine"] in ("x86_64", "AMD64"):
        assert "sse4_2" in env["cpu"]["isa"]
    rows = {d: store.read_jsonl(work / d / "variants" / "00-a" / "metrics.jsonl")
            for d in ("plain", "fixed")}  # fmt: skip
    for p, f in zip(rows["plain"], rows["fixed"], strict=True):
        assert np.isfinite(f["loss"]) and f["loss"] == pytest.approx(p["loss"], rel=1e-5)
    _, err = cli(["run", "--resume", "fixed", "--deterministic"])
    assert "--deterministic and --forecast apply to a new run" in err
