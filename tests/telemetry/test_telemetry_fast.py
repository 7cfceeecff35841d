"""The fast telemetry statistics against the exact-cast path they replace.

:func:`round_to_format` (float-domain or bit rounding) against the recipes' integer encoder
and decode, bit for bit; the count thresholds against the encoder's classes; and
:func:`stacked_stats` (threshold counts, one integer pass, power-of-two moments) against a
per-tensor reference written here with the recipes' exact quantizers (counts from the cast
values' bits, moments with the exact ldexp), on adversarial tensors: values exactly on the
rounding, underflow, subnormal and overflow thresholds, ties, zeros, NaN/inf, float32
subnormals, all-zero and all-subnormal tensors, amax at the top of float32's range.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from precisionlab.formats import FORMATS, FloatFormat
from precisionlab.quant import _pow2 as pow2
from precisionlab.recipes import _scaling as S
from precisionlab.telemetry import derive, parse_targets, stacked_stats
from precisionlab.telemetry._targets import (
    count_thresholds,
    magnitude_bits,
    quantize_target_exact,
    round_to_format,
)

FLOATS = [f for f in FORMATS.values() if isinstance(f, FloatFormat) and f.signed and f.bits <= 32]
# one format per rounding mode and specials kind by default (float32's and bf16's bit
# rounding, the float-domain grid with inf, fn and fnuz NaN, no NaN code); all under -m slow
QUICK = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e4m3fnuz", "float4_e2m1fn")
_INF = 0x7F800000


def _f32(bits) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


def _near(bits) -> np.ndarray:
    """Each bit pattern and its two neighbours (both signs)."""
    b = np.asarray(bits, np.int64)
    b = np.concatenate([b - 1, b, b + 1]).clip(0, _INF)
    return np.concatenate([b, b | 0x80000000]).astype(np.uint32)


def _points(fmt: FloatFormat) -> np.ndarray:
    """float32 values where ``fmt``'s rounding changes class (and their neighbours):
    half the smallest subnormal (a tie that rounds to zero), the subnormal/normal boundary,
    every value of the format and every midpoint between two (ties), the max and past it."""
    cands = [count_thresholds(fmt) or ()]
    grid = []
    m = fmt.mantissa_bits
    for e in range(max(fmt.emin, -126), min(fmt.emax, 127) + 1):
        step = 2.0 ** (e - m)
        for j in range(0, 1 << min(m, 4)):  # a few significands per binade, and midpoints
            v = 2.0**e + j * step
            grid += [v, v + step / 2]
    grid += [fmt.max, fmt.smallest_subnormal / 2, fmt.smallest_normal, 2.0 * fmt.max]
    g = np.asarray([v for v in grid if v < 3.4e38], np.float64).astype(np.float32)
    cands.append(g.view(np.uint32))
    return _f32(_near(np.concatenate([np.asarray(c, np.uint32) for c in cands])))


def _dense(seed: int, n: int) -> np.ndarray:
    """Every bfloat16 bit pattern, every float32 pattern below 2**16 (subnormals), and
    ``n`` random float32 patterns (NaN and inf included)."""
    rng = np.random.default_rng(seed)
    return np.concatenate(
        [
            np.arange(1 << 16, dtype=np.uint32) << 16,
            np.arange(1 << 16, dtype=np.uint32),
            rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32),
        ]
    ).view(np.float32)


def _check_round(fmt: FloatFormat, x: np.ndarray) -> None:
    fast = np.asarray(jax.jit(lambda v: round_to_format(v, fmt))(x))
    exact = np.asarray(jax.jit(lambda v: S.round_elements(v, fmt))(x))
    same = (fast == exact) | (np.isnan(fast) & np.isnan(exact))
    assert same.all(), (fmt.name, x[~same][:5], fast[~same][:5], exact[~same][:5])
    thr = count_thresholds(fmt)
    if thr is None:
        return
    under, normal, sat = thr
    fin = np.isfinite(x)
    b = magnitude_bits(x)
    b = np.asarray(b).astype(np.int64)[fin]
    a = np.abs(exact[fin]).astype(np.float64)
    np.testing.assert_array_equal(b <= under, a == 0, err_msg=f"{fmt.name} underflow")
    np.testing.assert_array_equal(b >= normal, a >= fmt.smallest_normal, err_msg=fmt.name)
    np.testing.assert_array_equal(b >= sat, a == fmt.max, err_msg=f"{fmt.name} saturate")


@pytest.mark.parametrize(
    "fmt",
    [f if f.name in QUICK else pytest.param(f, marks=pytest.mark.slow) for f in FLOATS],
    ids=lambda f: f.name,
)
def test_round_to_format_is_the_encoder_bit_for_bit(fmt):
    """On every class boundary of the format and its neighbours, and on float32's
    subnormals: the same values as the encode + decode, and the thresholds give the same
    underflow / normal / saturate classes."""
    x = np.concatenate([_points(fmt), _f32(np.arange(0, 1 << 12, 7, dtype=np.uint32))])
    x = np.concatenate([x, [np.inf, -np.inf, np.nan, 0.0, -0.0]]).astype(np.float32)
    _check_round(fmt, x)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FLOATS, ids=lambda f: f.name)
def test_round_to_format_dense(fmt):
    _check_round(fmt, _dense(FLOATS.index(fmt), 1 << 22))


# --- stacked statistics against an exact-cast reference -------------------------------
@functools.cache
def _reference_fn(targets: tuple):
    """Per-tensor statistics computed as the exact-cast path did: each target cast with the
    recipes' quantizers (integer encode + decode), counts from the cast values' bits,
    moments and squared errors scaled by 2**-k with the exact ldexp."""
    ts = parse_targets(targets)

    @jax.jit
    def one(x2):
        b = magnitude_bits(x2)
        finite = b < _INF
        nonzero = finite & (b != 0)
        amax = lax.bitcast_convert_type(jnp.max(jnp.where(finite, b, 0)), jnp.float32)
        k = pow2.floor_log2(amax)
        xn = pow2.ldexp(jnp.where(finite, x2, 0.0), jnp.broadcast_to(-k, x2.shape))
        out = {"power": jnp.sum(jnp.square(xn)), "targets": []}
        for t in ts:
            q = quantize_target_exact(x2, t)
            qb = magnitude_bits(q.elems)
            sb = magnitude_bits(q.scaled)
            thr, tie = t.overflow_threshold
            tb = np.float32(thr).view(np.uint32)
            past = (sb >= tb) if tie else (sb > tb)
            mx = np.float32(t.fmt.max).view(np.uint32)
            small = np.float32(t.fmt.smallest_normal).view(np.uint32)
            qn = pow2.ldexp(jnp.where(finite, q.values, 0.0), jnp.broadcast_to(-k, x2.shape))
            cnt = [
                nonzero & past & (sb < _INF),
                nonzero & (qb == mx),
                nonzero & (qb == 0),
                nonzero & (qb > 0) & (qb < small),
                nonzero & (qb > _INF),
            ]
            out["targets"].append(
                [jnp.sum(c, dtype=jnp.int32) for c in cnt] + [jnp.sum(jnp.square(xn - qn))]
            )
        return out

    return one


def _reference(x: np.ndarray, targets: tuple) -> dict:
    x2 = jnp.asarray(x, jnp.float32).reshape(-1, x.shape[-1])
    return jax.device_get(_reference_fn(targets)(x2))


def _adversarial() -> list[np.ndarray]:
    """(8, 64) float32 tensors built to sit on the thresholds of the default targets."""
    rng = np.random.default_rng(7)

    def spread(lo, hi):
        mag = np.exp2(rng.uniform(lo, hi, size=(8, 64)))
        return (mag * rng.choice([-1.0, 1.0], size=mag.shape)).astype(np.float32)

    f16, e4 = FORMATS["float16"], FORMATS["float8_e4m3fn"]
    edges = np.concatenate([_points(f16), _points(e4), _points(FORMATS["bfloat16"])[:200]])
    xs = []
    for i in range(3):  # format thresholds and ties, with zeros and float32 subnormals mixed in
        x = rng.choice(edges, size=(8, 64)).astype(np.float32)
        flat = x.reshape(-1)
        flat[rng.permutation(flat.size)[:20]] = 0.0
        if i == 1:
            flat[rng.permutation(flat.size)[:10]] = _f32(rng.integers(1, 1 << 23, 10))
        xs.append(x)
    x = spread(-30, 20)
    x.reshape(-1)[:6] = [np.inf, -np.inf, np.nan, 65520.0, 464.0, -465.0]  # NaN/inf, ties
    xs.append(x)
    xs.append(np.zeros((8, 64), np.float32))  # all zeros
    xs.append(_f32(rng.integers(1, 1 << 23, (8, 64))) * rng.choice([-1, 1], (8, 64)))  # subnormal
    top = spread(100, 128)
    top.reshape(-1)[0] = np.float32(3.4e38)  # amax in float32's top binade (k = 127)
    xs.append(top)
    xs.append(spread(-125, -110))  # amax near the bottom of the normal range
    xs.append(spread(-3, 3))  # an ordinary tensor
    return [x.astype(np.float32) for x in xs]


@functools.cache
def _stacked_fn(targets: tuple):
    return jax.jit(lambda xs: stacked_stats(xs, targets))  # one compile per list of shapes


def _compare(xs, targets) -> np.ndarray:
    """Asserts the stacked statistics equal the reference; returns the counts (tensor,
    target, kind) so that a test can check that its inputs exercise every kind."""
    st = jax.device_get(_stacked_fn(targets)([jnp.asarray(x) for x in xs]))
    d = jax.device_get(jax.vmap(derive)(st))
    for i, x in enumerate(xs):
        ref = _reference(x, targets)
        for j, name in enumerate(targets):
            r = ref["targets"][j]
            got = [int(getattr(st, f)[i, j]) for f in
                   ("overflow", "saturate", "underflow", "subnormal", "poisoned")]  # fmt: skip
            assert got == [int(v) for v in r[:5]], (i, name, got, r[:5])
            power, noise = np.float64(ref["power"]), np.float64(r[5])
            sq = float(d["sqnr_db"][i, j])
            if power == 0 or noise == 0:  # +inf (exact copy) or NaN (no signal)
                want = np.inf if noise == 0 < power else np.nan
                assert sq == want or (np.isnan(sq) and np.isnan(want)), (i, name, sq)
            else:
                want = 10 * (np.log10(power) - np.log10(noise))
                assert sq == pytest.approx(want, abs=1e-3, nan_ok=True), (i, name, sq, want)
    fields = ("overflow", "saturate", "underflow", "subnormal", "poisoned")
    return np.stack([np.asarray(getattr(st, f)) for f in fields], axis=-1)


DEFAULT_KINDS = ("fp16", "bf16", "e4m3:tensor")  # the telemetry defaults


def test_stacked_stats_equal_the_exact_cast_path():
    """Counts bit for bit and SQNR to float tolerance on the adversarial tensors (the
    all-subnormal tensor sends the whole buffer down the exact ldexp branch)."""
    total = _compare(_adversarial(), DEFAULT_KINDS).sum(axis=0)
    # every plain cast overflows, saturates, underflows and lands in subnormals somewhere;
    # e4m3:tensor cannot overflow (x * 448 / amax <= 448) but does the rest, and poisons
    assert (total[:2, :4] > 0).all() and (total[2, 1:] > 0).all(), total


def test_fast_branch_equals_the_exact_cast_path():
    """Without float32 subnormals and with every 2**-k a normal float32, the moments take
    the power-of-two multiply branch: the same numbers."""
    rng = np.random.default_rng(3)
    edges = np.concatenate([_points(FORMATS[f]) for f in ("float16", "float8_e4m3fn")])
    edges = edges[(np.abs(edges) >= 2.0**-126) & (np.abs(edges) < 2.0**126)]
    xs = [rng.choice(edges, size=(8, 64)).astype(np.float32) for _ in range(2)]
    xs += [x for x in _adversarial()[3:] if np.all(np.abs(x[x != 0]) >= 2.0**-126)]
    xs = [x for x in xs if np.nanmax(np.abs(np.where(np.isinf(x), 0, x))) < 2.0**126]
    while len(xs) < len(_adversarial()):  # the same shapes: the compiled program is reused
        xs.append(rng.standard_normal((8, 64)).astype(np.float32))
    total = _compare(xs, DEFAULT_KINDS).sum(axis=0)
    assert (total[0, :4] > 0).all() and (total[2, 1:4] > 0).all(), total


@pytest.mark.slow
def test_stacked_stats_every_target_kind():
    kinds = ("e4m3", "e2m1", "e5m2", "tf32", "fp32", "e4m3fnuz", "e3m2", "e2m3", "e3m4",
             "bf16:tensor",
             "fp16:row", "e4m3:block32", "e5m2:block", "mxfp8", "mxfp6", "mxfp4")  # fmt: skip
    _compare(_adversarial(), kinds)
