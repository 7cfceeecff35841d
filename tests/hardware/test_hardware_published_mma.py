"""``hardware.mma`` (one instruction, ``D = A @ B + C``) against its oracle: the scalar
reference ``hardware.reference.step_reference`` (Python fractions), chained by hand over K
with ``C`` entering the first step, for every profile with a 16-bit or FP8 step; random
values with subnormal inputs, zeros, both signs and a nonzero float32 ``C`` (float32
subnormal results included for bfloat16)."""

from functools import partial

import ml_dtypes
import numpy as np
import pytest

from precisionlab import hardware as hw
from precisionlab.hardware._reference import chain_reference

F16, BF16 = np.float16, ml_dtypes.bfloat16
E4, E5 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
#: smallest subnormal of each input format (as an exponent of two) and its subnormal span
_SUB = {F16: (-24, 10), BF16: (-133, 7), E4: (-9, 3), E5: (-16, 2)}


def _values(rng, shape, dtype, lo, hi):
    """Random values of ``dtype``: magnitudes 2**[lo, hi), 15% subnormal, 10% zero."""
    u = rng.uniform(lo, hi, shape)
    x = np.sign(rng.uniform(-1, 1, shape)) * 2.0**u
    emin, span = _SUB[dtype]
    sub = np.sign(rng.uniform(-1, 1, shape)) * rng.integers(1, 2**span, shape) * 2.0**emin
    r = rng.uniform(0, 1, shape)
    x = np.where(r < 0.15, sub, np.where(r < 0.25, 0.0, x))
    return x.astype(dtype)


def _chain(a, b, c, step, fa, fb):
    """The oracle: ``chain_reference`` (``step_reference`` over K in order) per output."""
    out = np.empty(c.shape, np.float32)
    for i, j in np.ndindex(out.shape):
        xs = [float(v) for v in a[i]]
        ys = [float(v) for v in b[:, j]]
        out[i, j] = chain_reference(xs, ys, float(c[i, j]), step, fa, fb)
    return out


# the pairing of each profile run by default (the others under -m slow); profiles with equal
# steps share a compilation (a100/l40s 16-bit, h100/b200 16-bit): 6 in all
_DEFAULT = {"v100/16bit": F16, "a100/16bit": F16, "l40s/16bit": F16, "h100/16bit": BF16,
            "b200/16bit": BF16, "h100/fp8": E4, "l40s/fp8": E5, "b200/fp8": E4}  # fmt: skip


def _cases():
    for key, p in sorted(hw.PROFILES.items()):
        if p.step is None or p.kind not in ("16bit", "fp8"):
            continue
        pairs = [(F16, F16), (BF16, BF16)] if p.kind == "16bit" else [(E4, E4), (E5, E4)]
        for da, db in pairs:
            if p.device == "v100" and da is BF16:
                continue  # Volta has no bfloat16 instruction (mma raises; tested below)
            marks = () if _DEFAULT.get(key) is da else pytest.mark.slow
            name = f"{key}-{np.dtype(da).name}-{np.dtype(db).name}"
            yield pytest.param(p.device, p.kind, da, db, id=name, marks=marks)


@pytest.mark.parametrize("device,kind,da,db", list(_cases()))
def test_mma_matches_chained_step_reference(device, kind, da, db):
    step = hw.get_profile(device, kind).step
    rng = np.random.default_rng(sum(map(ord, device + kind + np.dtype(da).name)))
    m, n, kk = 4, 3, 2 * step.products  # two chained steps
    fa, fb = np.dtype(da).name, np.dtype(db).name
    scenarios = [(-6, 6, -8, 8)]  # exponent windows of a/b and of c: cancellations, carries
    if da is BF16:
        # products and C near float32's subnormal range: the results' cut to its grid
        scenarios.append((-70, -60, -140, -126))
    for lo, hi, clo, chi in scenarios:
        a = _values(rng, (m, kk), da, lo, hi)
        b = _values(rng, (kk, n), db, lo, hi)
        c = np.sign(rng.uniform(-1, 1, (m, n))) * 2.0 ** rng.uniform(clo, chi, (m, n))
        c = c.astype(np.float32)
        c[0, 0] = 0.0  # a zero accumulator too
        got = np.asarray(hw.mma(a, b, c, device))
        want = _chain(a, b, c, step, fa, fb)
        assert got.dtype == np.float32 and got.shape == (m, n)
        bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
        assert bad.size == 0, (device, kind, fa, fb, lo, got.ravel()[bad], want.ravel()[bad])


def test_mma_chains_steps_over_k_in_order():
    """On an A100 an mma.m16n8k16 is two fused 8-product steps: two products of 2**-24 with
    C = 1 sum exactly to 1 + 2**-23 inside one step (24 fraction bits below 2**0 hold them),
    but in different steps each step's 1 + 2**-24 is cut to float32's 24 bits, giving 1."""
    a = np.zeros((1, 16), F16)
    b = np.zeros((16, 1), F16)
    c = np.ones((1, 1), np.float32)
    a[0, 0], b[0, 0] = 2.0**-10, 2.0**-14  # 2**-24 in the first step
    a[0, 9], b[9, 0] = 2.0**-10, 2.0**-14  # 2**-24 in the second step
    got = float(hw.mma(a, b, c, "a100")[0, 0])
    assert got == 1.0
    a[0, 9], b[9, 0] = 0, 0
    a[0, 3], b[3, 0] = 2.0**-10, 2.0**-14  # same step: 1 + 2**-23 exactly
    assert float(hw.mma(a, b, c, "a100")[0, 0]) == 1 + 2.0**-23


def test_mma_is_jittable_and_vmappable():
    import jax

    rng = np.random.default_rng(1)
    a = _values(rng, (3, 2, 16), F16, -4, 4)
    b = _values(rng, (3, 16, 2), F16, -4, 4)
    c = rng.uniform(-1, 1, (3, 2, 2)).astype(np.float32)
    eager = np.stack([np.asarray(hw.mma(a[i], b[i], c[i], "h100")) for i in range(3)])
    batched = jax.jit(jax.vmap(partial(hw.mma, device="h100")))(a, b, c)
    assert np.array_equal(np.asarray(batched).view(np.uint32), eager.view(np.uint32))


def test_mma_specials_follow_ieee():
    a = np.ones((1, 16), F16)
    b = np.ones((16, 1), F16)
    for cv, want in ((np.inf, np.inf), (-np.inf, -np.inf), (np.nan, np.nan)):
        y = float(hw.mma(a, b, np.full((1, 1), cv, np.float32), "a100")[0, 0])
        assert y == want or (np.isnan(want) and np.isnan(y))
    a[0, 3] = np.inf
    assert float(hw.mma(a, b, np.zeros((1, 1), np.float32), "h100")[0, 0]) == np.inf


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: hw.mma(np.ones((1, 16), F16), np.ones((16, 1), F16),
                        np.zeros((1, 1), np.float32), "tpu"), "unknown device 'tpu'; known"),
        (lambda: hw.mma(np.ones((1, 12), F16), np.ones((12, 1), F16),
                        np.zeros((1, 1), np.float32), "a100"), "K=12 .* 8 products; allowed"),
        (lambda: hw.mma(np.ones((1, 16), BF16), np.ones((16, 1), BF16),
                        np.zeros((1, 1), np.float32), "v100"), "no bfloat16 .* devices with one"),
        (lambda: hw.mma(np.ones((1, 32), E4), np.ones((32, 1), E4),
                        np.zeros((1, 1), np.float32), "a100"), "no fp8 .* devices with one"),
        (lambda: hw.mma(np.ones((1, 16), np.float32), np.ones((16, 1), np.float32),
                        np.zeros((1, 1), np.float32)), "unsupported operand dtypes .* supported"),
        (lambda: hw.mma(np.ones((1, 16), F16), np.ones((16, 1), BF16),
                        np.zeros((1, 1), np.float32)), "unsupported operand dtypes"),
        (lambda: hw.mma(np.ones((1, 16), F16), np.ones((16, 1), F16),
                        np.zeros((1, 1), F16)), "c must be float32"),
        (lambda: hw.mma(np.ones((1, 16), F16), np.ones((16, 2), F16),
                        np.zeros((1, 1), np.float32)), r"needs a \(M, K\)"),
        (lambda: hw.mma(np.ones((1, 16), F16), np.ones((16, 1), F16),
                        np.zeros((1, 1), np.float32), bits=3), "unknown override.*allowed"),
    ],
)  # fmt: skip
def test_mma_bad_input_raises_listing_what_exists(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_an_initial_accumulator_needs_one_chain():
    """mma runs gemm's chain with C as the first step's accumulator; a schedule that
    restarts or splits K has no single first step, so the chain refuses C there."""
    from precisionlab.hardware._gemm import chain_all

    a = np.ones((1, 32), np.float16)
    res = hw.resolve("h100", "cublaslt", False, "16bit", {"restart_every": 16})
    with pytest.raises(ValueError, match="initial accumulator is modelled for one chain"):
        chain_all(a, a.T, res, init=np.zeros((1, 1), np.float32))
