"""precisionlab.hardware: bit-for-bit against an H100, and against the scalar reference.

The H100 outputs are in tests/data/h100_gemm.npz (see tests/data/README.md). Every case named
in the proof table of docs/explanations/hardware-validation.md is here. XLA's FP8 GEMMs at a
32 x 32 output are also checked slice by slice against tests/data/h100_xla_fp8_slices.npz.
"""

import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from precisionlab import hardware as hw
from precisionlab.hardware._reference import step_reference

DATA = np.load(pathlib.Path(__file__).parents[1] / "data" / "h100_gemm.npz")
E4, E5 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def _same(y, ref) -> float:
    y = np.asarray(jnp.asarray(y).astype(jnp.float32))
    return float(np.mean(y.view(np.uint32) == np.asarray(ref, np.float32).view(np.uint32)))


def _fp8(tag, bdt=E4):
    return DATA["a_" + tag].view(E4), DATA["b_" + tag].view(bdt)


# --- cuBLASLt (torch._scaled_mm) ------------------------------------------------------------
SLOW = pytest.mark.slow


@pytest.mark.parametrize("k,fast", [(256, 0), pytest.param(256, 1, marks=SLOW)]
                         + [pytest.param(k, f, marks=SLOW) for k in (1024, 4096, 16384)
                            for f in (1, 0)])  # fmt: skip
def test_cublaslt_fp8_random(k, fast):
    a, b = DATA[f"fp8_a_{k}"].view(E4), DATA[f"fp8_b_{k}"].view(E4)
    y = hw.gemm(a, b, "h100", "cublaslt", fast_accumulation=bool(fast))
    assert _same(y, DATA[f"fp8_torch_fast{fast}_{k}"]) == 1.0


@SLOW
def test_cublaslt_subnormal_and_carry_vectors():
    """P1 (subnormal alignment), P2 (carry headroom)."""
    cases = ["P1"] + [f"P2_{x}_{k}" for x in (44, 45) for k in (32, 64)]
    for tag in cases:
        a, b = _fp8(tag, E5 if (tag == "P1" or "_45_" in tag) else E4)
        for fast in (1, 0):
            y = hw.gemm(a, b, fast_accumulation=bool(fast))
            assert _same(y, DATA[f"torch{fast}_{tag}"]) == 1


@SLOW
def test_cublaslt_step_boundaries():
    """P3: one large product at k = pos shows where the 32-k steps begin."""
    # the seven P3 vectors share shapes: one vmapped call
    tags = [f"P3_{p}" for p in (0, 15, 16, 31, 32, 33, 63)]
    a = np.stack([DATA["a_" + t] for t in tags]).view(E4)
    b = np.stack([DATA["b_" + t] for t in tags]).view(E4)
    for fast in (1, 0):
        y = jax.vmap(lambda x, z, f=fast: hw.gemm(x, z, fast_accumulation=bool(f)))(a, b)
        assert _same(y, np.stack([DATA[f"torch{fast}_{t}"] for t in tags])) == 1.0


@pytest.mark.parametrize("out", ["f32", pytest.param("bf16", marks=SLOW),
                                 pytest.param("f16", marks=SLOW)])  # fmt: skip
def test_cublaslt_scaled_outputs(out):
    """P7: scale_a, scale_b and 16-bit outputs, fast accumulation on and off."""
    a, b = _fp8("P7")
    od = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}[out]
    scales = ((1.0, 1.0), (0.375, 3.0), (2.0**-7, 2.0**5), (1.1, 0.9))
    sa = jnp.array([s[0] for s in scales], jnp.float32)
    sb = jnp.array([s[1] for s in scales], jnp.float32)
    for fast in (1, 0):
        f = lambda x, y, fa=fast: hw.gemm(a, b, fast_accumulation=bool(fa), out_dtype=od,  # noqa: E731
                                         scale_a=x, scale_b=y)  # fmt: skip
        y = jax.vmap(f)(sa, sb)
        ref = np.stack([DATA[f"P7_{out}_{x}_{z}_fast{fast}"] for x, z in scales])
        assert _same(y, ref) == 1.0


@SLOW
def test_cublaslt_bias():
    a, b = _fp8("P7")
    y = hw.gemm(a, b, out_dtype=jnp.bfloat16, scale_a=0.375, scale_b=3.0, bias=DATA["P7_bias"])
    assert _same(y, DATA["P7_bf16_bias_fast1"]) == 1.0


# --- XLA (Triton GEMM fusions), schedules read from the compiled HLO -------------------------
@SLOW
def test_xla_targeted_single_chain():
    """K <= 64 at M = N = 16: one Triton chain of 16-bit steps on FP8 upcast to float16."""
    for tag in ["P1", "P2_44_32", "P2_45_64", "P3_0", "P3_33", "P3_63"]:
        a, b = _fp8(tag, E5 if (tag == "P1" or "_45_" in tag) else E4)
        assert _same(hw.gemm(a, b, library="xla"), DATA["xla_" + tag]) == 1.0


@pytest.mark.parametrize("name", ["f16", pytest.param("bf16", marks=SLOW)])
def test_xla_16bit_split_k(name):
    """P4 (32 x 4096 x 32): 32 slices of 128 (HLO), reduced in butterfly order (4, 2, 1, 0, 3)."""
    dt = np.float16 if name == "f16" else ml_dtypes.bfloat16
    a, b = DATA[f"a_P4_{name}_4096"].view(dt), DATA[f"b_P4_{name}_4096"].view(dt)
    y = hw.gemm(a, b, library="xla", split_k=128, split_order=(4, 2, 1, 0, 3))
    assert _same(y, DATA[f"xla_P4_{name}_4096"]) == 1.0


def test_xla_split_k_order_probe():
    """P5: the pattern that reveals the reduction order of XLA's split-K (32 slices of 64)."""
    a, b = _fp8("P5")
    y = hw.gemm(a, b, library="xla", split_k=64, split_order=(4, 2, 1, 0, 3))
    assert _same(y, DATA["xla_P5"]) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["f16", "bf16"])
def test_xla_16bit_gemm_64(name):
    """g16 (64 x 4096 x 64): 32 slices of 128 summed by halves; float32 and 16-bit outputs."""
    dt = np.float16 if name == "f16" else ml_dtypes.bfloat16
    a, b = DATA[f"g16_{name}_a"].view(dt), DATA[f"g16_{name}_b"].view(dt)
    kw = dict(library="xla", split_k=128, split_order=(4, 3, 2, 1, 0))
    assert _same(hw.gemm(a, b, **kw), DATA[f"g16_{name}_xla_f32out"]) == 1.0
    y16 = np.asarray(hw.gemm(a, b, out_dtype=dt, **kw)).view(np.uint16)
    assert np.array_equal(y16, DATA[f"g16_{name}_xla"])


@pytest.mark.slow
def test_xla_fp8_cases_with_known_schedule():
    """fp8_xla at K = 4096 is cuBLASLt's promotion every 128; HIGHEST at K = 1024 is Triton's
    16-bit split-K (16 slices of 64, butterfly (3, 2, 1, 0))."""
    a, b = DATA["fp8_a_4096"].view(E4), DATA["fp8_b_4096"].view(E4)
    y = hw.gemm(a, b, fast_accumulation=False)
    assert _same(y, DATA["fp8_xla_DEFAULT_4096"]) == _same(y, DATA["fp8_xla_HIGHEST_4096"]) == 1.0
    a, b = DATA["fp8_a_1024"].view(E4), DATA["fp8_b_1024"].view(E4)
    y = hw.gemm(a, b, library="xla", split_k=64, split_order=(3, 2, 1, 0))
    assert _same(y, DATA["fp8_xla_HIGHEST_1024"]) == 1.0


@pytest.mark.parametrize("key,k,every", [("fp8_xla_DEFAULT_256", 256, 32),
                                         ("fp8_xla_HIGHEST_256", 256, 32),
                                         pytest.param("fp8_xla_DEFAULT_1024", 1024, 64,
                                                      marks=SLOW)])  # fmt: skip
def test_xla_fp8_promoted_every_block(key, k, every):
    """64 x K x 64 XLA FP8 GEMMs without captured HLO, found by searching schedules against
    the capture: the FP8 wgmma step (32 products, 13 bits) chained over ``every`` k, each
    chain added into float32 in order (Triton's promotion every BLOCK_K)."""
    a, b = DATA[f"fp8_a_{k}"].view(E4), DATA[f"fp8_b_{k}"].view(E4)
    y = hw.gemm(a, b, **hw.preset("h100-cublaslt"), restart_every=every)
    assert _same(y, DATA[key]) == 1.0
    assert _same(hw.gemm(a, b, **hw.preset("h100-cublaslt")), DATA[key]) < 1  # not every 128


@pytest.mark.slow
def test_xla_fp8_16384_is_fp8_steps_promoted_every_256():
    """fp8_xla_{DEFAULT,HIGHEST}_16384 (64 x 16384 x 64, no HLO captured): found by searching
    schedules against the capture: the FP8 wgmma step (32 products, 13 bits), its chain
    restarted every 256 k and added into float32 in order (= 64 slices of 256, each one
    chain, summed in order)."""
    a, b = DATA["fp8_a_16384"].view(E4), DATA["fp8_b_16384"].view(E4)
    y = hw.gemm(a, b, **hw.preset("h100-cublaslt"), restart_every=256)
    assert _same(y, DATA["fp8_xla_DEFAULT_16384"]) == _same(y, DATA["fp8_xla_HIGHEST_16384"]) == 1
    z = hw.gemm(a, b, **hw.preset("h100-cublaslt-fast"), split_k=256, split_k_min_k=0)
    assert _same(z, y) == 1.0
    # cuBLASLt's own schedules (torch at the same K) differ from XLA's here
    assert _same(hw.gemm(a, b, **hw.preset("h100-cublaslt")), DATA["fp8_xla_DEFAULT_16384"]) < 1


# --- XLA's Triton FP8 GEMMs at 32 x 32 outputs (2026-11-27 slice capture) -------------------
SLICES = np.load(pathlib.Path(__file__).parents[1] / "data" / "h100_xla_fp8_slices.npz")
P4_SLICE = {512: 32, 2048: 64, 8192: 128}  # split-K slice width in the compiled HLO
#: split-K reduction orders found on the captures (unique among in order, reversed and every
#: butterfly bit order); K = 512 "old" is h100_gemm.npz's run (a loop fusion summing in order)
P4_ORDER = {512: (1, 2, 3, 0), 2048: (4, 2, 1, 0, 3), 8192: (5, 4, 3, 2, 1, 0)}


def _slice_cases(k: int) -> list[str]:
    return sorted(t for t in SLICES.files if t.split("_")[1] == str(k)
                  and not t.endswith(("_a", "_b")) and not t.startswith("full"))  # fmt: skip


def _slice_gemm(tags: list[str], k: int, **kw):
    """The model of each one-slice capture ``tags`` (vmapped: one compile) and the captures."""
    a = np.stack([SLICES[t + "_a"] for t in tags]).view(E4)
    b = np.stack([SLICES[t + "_b"] for t in tags]).view(E4)
    kw = {"library": "xla", "split_k": P4_SLICE[k], "split_order": "sequential", **kw}
    y = jax.vmap(lambda x, z: hw.gemm(x, z, "h100", **kw))(a, b)
    return y, np.stack([SLICES[t] for t in tags])


@pytest.mark.parametrize("k", [512, pytest.param(2048, marks=SLOW), pytest.param(8192, marks=SLOW)])
def test_xla_fp8_one_slice_captures(k):
    """Only one split-K slice nonzero (the others add exact zeros): the slice's own value.
    first_K_n (n = 1 .. 32 nonzero k), slice_K_j, rand_K_r: float16 steps of 16 products (25
    bits, truncation) on each 32-k block's k in FP8 register pairs, every output."""
    tags = _slice_cases(k)
    assert len(tags) == 13
    for shape in {SLICES[t].shape for t in tags}:  # K = 8192: 8 x 8 cuts and 32 x 32 rand
        y, ref = _slice_gemm([t for t in tags if SLICES[t].shape == shape], k)
        assert _same(y, ref) == 1.0


@SLOW
def test_xla_fp8_k_order_matters():
    """The same captures in natural k order (16 consecutive k per step) and as MMA-Sim's
    Hopper mma (32 FP8 products, 25 bits, one step) miss outputs: the captures tell them
    apart. (n = 1, 2 nonzero k are the same in every order.)"""
    tags = ["first_512_4", "first_512_8", "first_512_16", "first_512_32", "slice_512_0"]
    y, ref = _slice_gemm(tags, 512, k_order="natural")
    natural = [_same(y[i], ref[i]) for i in range(len(tags))]
    assert max(natural) < 1.0 and min(natural) < 0.7, natural
    y, ref = _slice_gemm(tags, 512, upcast=None, k_order="natural", fraction_bits=25,
                         result_bits=24)  # fmt: skip
    assert _same(y, ref) < 0.9


def test_xla_fp8_pairs_order_matches_scalar_reference():
    """k_order="fp8_pairs" against the scalar reference run on explicit k groups: per 32-k
    block, k = 0, 1, 4, 5, ..., 28, 29 then 2, 3, 6, 7, ..., 30, 31 (K = 40: the second
    block holds 8 k), each a float16 step of 16 products (FP8 upcast exactly)."""
    rng = np.random.default_rng(3)
    a = _random_values(rng, E4, 4 * 40).reshape(4, 40)
    b = _random_values(rng, E4, 40 * 3).reshape(40, 3)
    got = np.asarray(hw.gemm(a, b, library="xla", split_k=None))
    step = hw.get_profile("h100", "16bit").step
    groups = [[k for k in range(32) if k % 4 < 2], [k for k in range(32) if k % 4 >= 2]]
    for i, j in np.ndindex(got.shape):
        c = 0.0
        for g in (grp for base in (0, 32) for grp in ([base + k for k in g] for g in groups)):
            g = [k for k in g if k < 40]
            if g:
                xs = [float(a[i, k]) for k in g]
                c = step_reference(xs, [float(b[k, j]) for k in g], c, step, "float16", "float16")
        assert np.float32(got[i, j]).view(np.uint32) == np.float32(c).view(np.uint32), (i, j)


def test_xla_fp8_k_order_errors():
    a = np.ones((2, 64), E4)
    with pytest.raises(ValueError, match="k_order must be one of natural, fp8_pairs"):
        hw.gemm(a, a.T, library="xla", k_order="reversed")
    with pytest.raises(ValueError, match=r"16-product steps.*got 8 products.*k_order='natural'"):
        hw.gemm(a, a.T, library="xla", products=8)
    with pytest.raises(ValueError, match="split_k to be a multiple of 32, got 48"):
        hw.gemm(np.ones((2, 96), E4), np.ones((96, 2), E4), library="xla", split_k=48)


@pytest.mark.parametrize("k,run", [(512, "old"), pytest.param(512, "new", marks=SLOW),
                                   pytest.param(2048, "old", marks=SLOW),
                                   pytest.param(2048, "new", marks=SLOW),
                                   pytest.param(8192, "old", marks=SLOW),
                                   pytest.param(8192, "new", marks=SLOW)])  # fmt: skip
def test_xla_fp8_p4_split_k(k, run):
    """xla_P4_fp8_K (h100_gemm.npz, "old") and full_K (the 2026-11-27 rerun, "new"): the
    slices above summed in float32 in the reduction order each run's HLO implies (K = 512:
    a loop fusion in order on the old run, a Triton reduction on the new one)."""
    if run == "old":
        a, b, ref = DATA[f"a_P4_fp8_{k}"], DATA[f"b_P4_fp8_{k}"], DATA[f"xla_P4_fp8_{k}"]
    else:
        a, b, ref = SLICES[f"full_{k}_a"], SLICES[f"full_{k}_b"], SLICES[f"full_{k}"]
    order = "sequential" if (k, run) == (512, "old") else P4_ORDER[k]
    y = hw.gemm(a.view(E4), b.view(E4), library="xla", split_k=P4_SLICE[k], split_order=order)
    assert _same(y, ref) == 1.0


# --- the scalar reference --------------------------------------------------------------------
def _random_values(rng, dt, n):
    bits = 8 if np.dtype(dt).itemsize == 1 else 16
    codes = rng.integers(0, 2**bits, n).astype(np.uint8 if bits == 8 else np.uint16)
    if dt is ml_dtypes.bfloat16:  # keep products inside float32's range
        exp = (codes >> 7) & 0xFF
        codes = (codes & ~np.uint16(0xFF << 7)) | ((exp % 64 + 96).astype(np.uint16) << 7)
    v = codes.view(dt)
    return np.where(np.isfinite(v.astype(np.float32)), v, dt(0)).astype(dt)


@pytest.mark.parametrize("dt,bdt,device", [(E4, E5, "h100"), (np.float16, np.float16, "h100"),
                                           pytest.param(E4, E4, "h100", marks=SLOW),
                                           pytest.param(ml_dtypes.bfloat16, ml_dtypes.bfloat16,
                                                        "h100", marks=SLOW),
                                           pytest.param(np.float16, np.float16, "a100",
                                                        marks=SLOW)])  # fmt: skip
def test_vectorized_chain_matches_scalar_reference(dt, bdt, device):
    """Random codes (subnormals and zeros included), three chained steps, 64 vectors."""
    rng = np.random.default_rng(7)
    kind = "fp8" if np.dtype(dt).itemsize == 1 else "16bit"
    step = hw.get_profile(device, kind).step
    w, n = step.products, 64
    a = np.stack([_random_values(rng, dt, 3 * w) for _ in range(n)])[:, None, :]
    b = np.stack([_random_values(rng, bdt, 3 * w) for _ in range(n)])[:, :, None]
    f = lambda x, y: hw.gemm(x, y, device, split_k=None, restart_every=None)  # noqa: E731
    got = np.asarray(jax.vmap(f)(a, b))[:, 0, 0]
    na, nb = np.dtype(dt).name, np.dtype(bdt).name
    for i in range(n):
        c = 0.0
        for s in range(3):
            sl = slice(s * w, (s + 1) * w)
            xs = [float(x) for x in a[i, 0, sl].astype(np.float64)]
            ys = [float(x) for x in b[i, sl, 0].astype(np.float64)]
            c = step_reference(xs, ys, c, step, na, nb)
        assert np.float32(got[i]).view(np.uint32) == np.float32(c).view(np.uint32), (i, got[i], c)


def test_reference_hand_example():
    """Hopper FP8: 2**-9 + 2**-4 * 2**-16 keeps only 2**-9 (the small addend is below the
    13-bit grid of the largest alignment exponent, emin = -6 for the subnormal)."""
    step = hw.get_profile("h100", "fp8").step
    got = step_reference(
        [2.0**-9, 2.0**-4], [1.0, 2.0**-16], 0.0, step, "float8_e4m3fn", "float8_e5m2"
    )
    assert got == 2.0**-9


# --- API -------------------------------------------------------------------------------------
def test_errors_list_what_exists():
    a = jnp.zeros((2, 32), jnp.float8_e4m3fn)
    b = jnp.zeros((32, 2), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="known: a100, b200, h100, l40s, v100"):
        hw.gemm(a, b, device="tpu")
    with pytest.raises(ValueError, match="known: cublaslt, xla"):
        hw.gemm(a, b, library="cudnn")
    with pytest.raises(ValueError, match="a100 has no fp8"):
        hw.gemm(a, b, device="a100")
    with pytest.raises(ValueError, match="unsupported operand formats float8_e4m3fn x float16"):
        hw.gemm(a, jnp.zeros((32, 2), jnp.float16))
    with pytest.raises(ValueError, match="unknown override"):
        hw.gemm(a, b, fraction_bitz=3)
    bf = jnp.zeros((2, 16), jnp.bfloat16)
    msg = r"gemm: v100 has no bfloat16 .*\(Volta's .* float16 only\); devices with one: a100"
    with pytest.raises(ValueError, match=msg):
        hw.gemm(bf, bf.T, device="volta")


def test_jit_and_dot_general_batch():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 64)).astype(E4)
    w = rng.standard_normal((3, 64, 5)).astype(E4)
    dn = (((2,), (1,)), ((0,), (0,)))
    y = jax.jit(lambda p, q: hw.dot_general(p, q, dn, device="h100"))(x, w)
    assert y.shape == (3, 4, 5)
    for i in range(3):
        assert _same(y[i], hw.gemm(x[i], w[i])) == 1.0


# --- CLI -------------------------------------------------------------------------------------
def test_cli_gemm_conformance_and_bench_usage(capsys):
    from precisionlab.cli import main

    assert main(["conformance", "--gemm", "--libs", "numpy"]) == 2
    assert "--gemm takes only --seed and --json" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_gemm_conformance_runs(capsys):
    from precisionlab.cli import main

    assert main(["conformance", "--gemm"]) == 0
    out = capsys.readouterr().out
    assert "xla:cpu" in out and "h100-cublaslt-fast" in out
    assert main(["bench", "hardware", "--m", "8", "--n", "8", "--k", "256", "--repeats", "1"]) == 0
    assert "M products/s" in capsys.readouterr().out


def test_dot_general_preset_and_contracting_dims():
    """lhs contracted on its first axis, rhs on its last; preset= picks device and library."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 3)).astype(np.float16)
    w = rng.standard_normal((2, 64)).astype(np.float16)
    y = hw.dot_general(x, w, (((0,), (1,)), ((), ())), preset="h100-cublaslt")
    assert y.shape == (3, 2)
    assert _same(y, hw.gemm(x.T, w.T, "h100", "cublaslt", False)) == 1.0
    with pytest.raises(ValueError, match="unknown hardware preset 'h100-turbo'; known: h100-cub"):
        hw.dot_general(x, w, (((0,), (1,)), ((), ())), preset="h100-turbo")
    with pytest.raises(ValueError, match="'h100' is ambiguous; choose one of: 'h100-xla'"):
        hw.dot_general(x, w, (((0,), (1,)), ((), ())), preset="h100")


def test_preset_names_and_aliases():
    """Canonical names are <device>-<library>[-fast]; each alias names one of them."""
    for name, (dev, lib, fast) in hw.PRESETS.items():
        assert name == f"{dev}-{lib}" + ("-fast" if fast else "")
    for alias, target in hw.PRESET_ALIASES.items():
        assert target in hw.PRESETS and hw.preset(alias) == hw.preset(target)
    assert set(hw.AMBIGUOUS_PRESETS) & (set(hw.PRESETS) | set(hw.PRESET_ALIASES)) == set()
