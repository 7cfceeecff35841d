"""precisionlab.hardware: bit-for-bit against an H100, and against the scalar reference.

The H100 outputs are in tests/data/h100_gemm.npz (see tests/data/README.md). Every case named
in docs/guides/hardware.md's proof table is here; the few XLA cases without a known schedule
are listed in NOT_REPRODUCED and checked to stay unreproduced (so the docs stay true).
"""

import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from precisionlab import hardware as hw
from precisionlab.hardware.reference import step_reference

DATA = np.load(pathlib.Path(__file__).parent / "data" / "h100_gemm.npz")
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


#: XLA captures whose kernel schedule was not recorded (no HLO) or not derived: named here and
#: in docs/guides/hardware.md.
NOT_REPRODUCED = ["xla_P4_fp8_512", "xla_P4_fp8_2048", "xla_P4_fp8_8192"]


def test_not_reproduced_cases_are_named():
    for key in NOT_REPRODUCED:
        assert key in DATA.files


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
    with pytest.raises(ValueError, match="unsupported operand dtypes"):
        hw.gemm(a, jnp.zeros((32, 2), jnp.float16))
    with pytest.raises(ValueError, match="unknown override"):
        hw.gemm(a, b, fraction_bitz=3)


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
