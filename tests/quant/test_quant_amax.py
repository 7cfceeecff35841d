"""The per-group statistics (``core.group_amax``, ``core._min_max``) against numpy, NaN first.

XLA's CPU float max/min reduce drops NaN once arrays are large (openxla/xla#21461): under
jit, a reduce over a (64, 8, 32) array holding one NaN can return 1.0. The group statistics
must still be NaN for exactly the groups holding a NaN, wherever in the group (every offset
of a block, both ends of a channel, beside inf, beside the group's max, every NaN payload)
and at the bench's size, where the bug shows. numpy's reduces propagate NaN: the oracle,
with float32 subnormals read as zero, as XLA on CPU reads them in float arithmetic (a
subnormal-only group's amax is 0, as it was before the reduce carried a NaN flag).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precisionlab.quant import _core as core
from precisionlab.quant import fake_quant
from precisionlab.quant._spec import resolve

F32 = np.float32
# NaN payloads: quiet, negative quiet, signalling, all-ones mantissa, negative signalling.
_NANS = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFF800001], np.uint32).view(F32)

# (fmt, kwargs) of the bench's cases (precisionlab bench quant), plus an asymmetric one.
SPECS = [
    pytest.param("int8", {"axis": 0}, id="int8-channel"),
    pytest.param("int4", {"block_size": 128}, id="int4-block128"),
    pytest.param("e4m3fn", {}, id="e4m3fn-tensor"),
    pytest.param("mxfp8_e4m3", {}, id="mxfp8"),
    pytest.param("mxfp4", {}, id="mxfp4"),
    pytest.param("int8", {"axis": 1}, id="int8-channel-strided"),
    pytest.param("int4", {"block_size": 96}, id="int4-block96-ragged"),
]


def _with_nans(shape, group_len: int, n_groups: int, seed: int = 0) -> np.ndarray:
    """Normal data; two of every three groups hold one NaN, at offset g mod group_len (so
    every offset of a block occurs), beside an inf or the group's largest value now and then;
    some groups subnormal-only, some all zero, one all NaN."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(F32)
    flat = x.reshape(n_groups, group_len)  # a view: groups are rows here
    for g in range(n_groups):
        if g % 3 == 0:
            continue
        k = g % group_len
        flat[g, k] = _NANS[g % len(_NANS)]
        if g % 5 == 1:
            flat[g, (k + 1) % group_len] = np.inf if g % 2 else -np.inf
        if g % 7 == 2:
            flat[g, (k - 1) % group_len] = F32(3e38)
    flat[3] = rng.choice(np.array([1e-45, -3e-41, 1.1e-38, 0.0, -0.0], F32), group_len)
    flat[6] = 0.0
    flat[9] = -np.inf
    flat[4] = np.nan
    return x


def _ftz(x: np.ndarray) -> np.ndarray:
    """Subnormals to zero of the same sign (XLA on CPU reads them so in float arithmetic)."""
    return np.where(np.abs(x) < F32(2.0**-126), np.copysign(F32(0), x), x)


def _grouped_input(fmt, kwargs, shape=(1024, 4096)):
    """The spec of (fmt, kwargs) and an input with NaNs laid out by its groups."""
    spec = resolve(len(shape), fmt, **kwargs)
    if spec.granularity == "block" and shape[-1] % spec.block_size == 0 and spec.axis == 1:
        x = _with_nans(shape, spec.block_size, shape[0] * shape[1] // spec.block_size)
    elif spec.granularity == "channel" and spec.axis == 0:
        x = _with_nans(shape, shape[1], shape[0])
    elif spec.granularity == "channel":  # groups are columns: lay them out transposed
        x = np.ascontiguousarray(_with_nans(shape[::-1], shape[0], shape[1]).T)
    else:  # one group (tensor), or a ragged block layout: NaNs anywhere
        x = _with_nans(shape, 128, shape[0] * shape[1] // 128)
    return spec, x


@pytest.mark.parametrize("fmt,kwargs", SPECS)
def test_amax_equals_numpy_at_bench_size(fmt, kwargs):
    spec, x = _grouped_input(fmt, kwargs)
    xg, axes = jax.jit(lambda v: core.to_groups(v, spec)[0])(x), core.to_groups(x, spec)[1]
    got = np.asarray(jax.jit(lambda v: core.group_amax(*core.to_groups(v, spec)))(x))
    want = np.max(np.abs(_ftz(np.asarray(xg))), axis=axes, keepdims=True)
    assert (np.isnan(want).any() and not np.isnan(want).all()) or spec.granularity == "tensor"
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))


@pytest.mark.parametrize("axis,block", [(0, None), (1, None), (1, 128), (0, 64)])
def test_min_max_equals_numpy_at_bench_size(axis, block):
    kwargs = {"axis": axis, "scheme": "asymmetric"}
    if block:
        kwargs["block_size"] = block
    spec, x = _grouped_input("uint8", kwargs, shape=(512, 2048))
    xg, axes = core.to_groups(jnp.asarray(x), spec)
    lo, hi = jax.jit(lambda v: core._min_max(*core.to_groups(v, spec)))(x)
    xg = _ftz(np.asarray(xg))
    with np.errstate(invalid="ignore"):
        want_lo = np.minimum(np.min(xg, axis=axes, keepdims=True), F32(0))
        want_hi = np.maximum(np.max(xg, axis=axes, keepdims=True), F32(0))
    assert np.isnan(want_hi).any() and not np.isnan(want_hi).all()
    np.testing.assert_array_equal(np.asarray(lo), want_lo)  # NaN == NaN, -0 == +0 here
    np.testing.assert_array_equal(np.asarray(hi), want_hi)


def test_small_and_bench_size_agree_on_a_nan_at_each_lane():
    """One NaN per block of 32 at each offset 0..31, in arrays from tiny to bench size: the
    block holding it, and only that block, has NaN amax (the bug depended on the size)."""
    spec = resolve(2, "mxfp8_e4m3")
    amax = jax.jit(lambda v: core.group_amax(*core.to_groups(v, spec)))
    for rows in (1, 8, 64, 1024):
        x = np.ones((rows, 4096), F32)
        x[::2, ::32] = 2.0  # the block's max beside its NaN, in every other row
        offs = (np.arange(rows)[:, None] + np.arange(128)[None, :]) % 32
        cols = np.arange(128)[None, :] * 32 + offs
        has = (np.arange(rows)[:, None] + np.arange(128)[None, :]) % 3 != 0
        x[np.nonzero(has)[0], cols[has]] = np.nan
        got = np.asarray(amax(x))
        np.testing.assert_array_equal(np.isnan(got[..., 0]), has, err_msg=f"{rows} rows")


@pytest.mark.parametrize("fmt,kwargs", SPECS[:5])
def test_fake_quant_nan_groups(fmt, kwargs):
    """Through fake_quant: a group holding NaN comes back all NaN; every other group has the
    bits it gets when the NaN groups are zeroed instead (groups are independent). 256 rows:
    large enough for the bug (it showed at 64x256), a quarter of the bench's input."""
    spec, x = _grouped_input(fmt, kwargs, shape=(256, 4096))
    f = jax.jit(lambda v: fake_quant(v, fmt, **kwargs))
    got = np.asarray(f(x))
    if spec.granularity == "tensor":
        assert np.isnan(got).all()
        return
    xg, axes = core.to_groups(jnp.asarray(x), spec)
    bad_g = np.isnan(np.asarray(xg)).any(axis=axes, keepdims=True)
    bad = np.asarray(core.from_groups(jnp.broadcast_to(bad_g, xg.shape), spec, x.shape))
    clean = np.asarray(f(np.where(bad, F32(0), x)))
    np.testing.assert_array_equal(np.isnan(got), bad | np.isnan(clean))
    ok = ~bad
    np.testing.assert_array_equal(got[ok].view(np.uint32), clean[ok].view(np.uint32))
