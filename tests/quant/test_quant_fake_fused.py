"""fake_quant's one-pass pipeline (``core.fake_values``) against the reference paths.

The references are fake_quant's former forward (scale, round, unscale as three steps, each
with its own choice between float multiply and exact ldexp) and, for finite inputs,
``dequantize(quantize(x))``, which materializes the codes. The fused path must give the
same float32 bits (signed zeros included; NaN where the reference
has NaN) for every scale rule, rounding mode, element format and for blocks that are NaN,
inf, zero, subnormal, saturating, or whose scale leaves the float-multiply range (the exact
ldexp branch). ``-m slow`` runs the whole product of formats, rules and modes.
"""

import itertools
from functools import partial

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from precisionlab.bits import ROUNDING_MODES
from precisionlab.quant import MX_FORMATS, SCALE_RULES, dequantize, fake_quant, quantize
from precisionlab.quant import _core as core
from precisionlab.quant._spec import resolve

F32 = np.float32
ROWS, COLS = 6, 96  # 3 MX blocks per row; ragged for block_size 64


def assert_same_bits(got, want):
    got, want = np.asarray(got, F32), np.asarray(want, F32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    g, w = got.view(np.uint32)[~nan], want.view(np.uint32)[~nan]
    bad = np.flatnonzero(g != w)
    assert bad.size == 0, [(hex(g[i]), hex(w[i])) for i in bad[:5]]


def _special_rows(seed: int, zero_blocks: bool = True) -> np.ndarray:
    """Rows of 96: normal data, then blocks of 32 that are NaN-holding, inf-holding, all
    zero, all -0, subnormal, saturating (an outlier whose mantissa is above the element
    max's, so the floor rule clips it) and ties at half a step. A zero or subnormal block
    has the smallest power-of-two scale, outside the float-multiply range, so its array
    takes the exact branch; ``zero_blocks=False`` mixes zeros and subnormals into normal
    blocks instead, for the fast branch."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ROWS, COLS)).astype(F32) * F32(3)
    x[0, 5] = np.nan
    x[0, 40] = np.inf
    x[0, 70] = -np.inf
    tiny = rng.choice(np.array([1e-40, -3e-41, 1.2e-38, -1e-45, 0.0, -0.0], F32), 96)
    if zero_blocks:
        x[1, :32] = 0.0
        x[1, 32:64] = -0.0
        x[1, 64:] = tiny[64:]
    else:
        x[1, ::2] = tiny[::2]
    x[2, 3] = 15.9  # 1.9875 * 2**3: above 1.75 (E4M3 max mantissa) -> floor saturates
    x[2, 35] = -7.99
    x[3, :32] = np.arange(-16, 16, dtype=F32) + F32(0.5)  # ties for integer grids
    x[3, 32:64] = np.ldexp(F32(1.5), np.arange(-16, 16))  # one binade per element
    x[4] = np.abs(x[4])
    x[5, 64:] = -np.abs(x[5, 64:]) * F32(1e-3)
    return x


def _extreme_rows(seed: int) -> np.ndarray:
    """Blocks whose power-of-two scale leaves [-100, 126] (the exact ldexp branch): tiny and
    huge amaxes, subnormals beside normals."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ROWS, COLS)).astype(F32)
    x[0, :32] *= F32(1e-33)
    x[1, 32:64] *= F32(3e37)
    x[2, :32] = F32(3.3e38) * np.sign(rng.standard_normal(32)).astype(F32)
    x[3, 64:] = rng.standard_normal(32).astype(F32) * F32(1e-38)
    x[4, :32] = 0.0
    x[4, 0] = F32(1e-45)  # the only nonzero is the smallest subnormal
    return x


@partial(jax.jit, static_argnames="spec")
def _three_steps(x, key, spec):
    """fake_quant's forward as it was before the fused pipeline: scale, round and unscale as
    three steps, each power-of-two step with its own cond (the steps quantize uses)."""
    xg, sc = core.choose_scale(x, spec)
    y = core.apply_scale(xg, sc, spec)
    values = core.round_elements(y, sc, spec, key, codes=False)
    return core.from_groups(core.unapply_scale(values, sc, spec), spec, x.shape)


def _check(x, fmt, key=None, **kw):
    """Same bits as the three steps; and, for finite inputs, as dequantize(quantize(x)).

    (With a NaN input an asymmetric zero point is NaN: fake_quant returns NaN for the group,
    while quantize stores the NaN zero point as code 0 and dequantize returns finite values.)
    """
    x = jnp.asarray(x)
    got = fake_quant(x, fmt, key=key, **kw)
    assert_same_bits(got, _three_steps(x, key, resolve(x.ndim, fmt, **kw)))
    if np.isfinite(np.asarray(x)).all():
        assert_same_bits(got, dequantize(quantize(x, fmt, key=key, pack_codes=False, **kw)))


_DEFAULT_MX = {
    ("mxfp8_e4m3", "floor"),
    ("mxfp4", "rceil"),
    ("mxint8", "even"),
    ("mxfp6_e3m2", "ceil"),
}
MX_CASES = [
    pytest.param(n, r, id=f"{n}-{r}", marks=() if (n, r) in _DEFAULT_MX else pytest.mark.slow)
    for n in MX_FORMATS
    for r in SCALE_RULES
]


@pytest.mark.parametrize("name,rule", MX_CASES)
def test_mx_fused_equals_reference(name, rule):
    for x in (_special_rows(0, False), _special_rows(0), _extreme_rows(1)):
        _check(x, name, scale_rule=rule)
    _check(_special_rows(2), name, scale_rule=rule, axis=0)


SCALED_CASES = [
    pytest.param("int8", {"axis": 0}, id="int8-channel"),
    pytest.param("int4", {"block_size": 64}, id="int4-block64-ragged"),
    pytest.param("int8", {"full_range": True}, id="int8-full-range", marks=pytest.mark.slow),
    pytest.param("uint8", {"axis": 1}, id="uint8-asym-channel"),
    pytest.param("int8", {"scale_format": "pow2", "axis": 0}, id="int8-pow2-rceil"),
    pytest.param("int4", {"scale_format": "e8m0", "scale_rule": "floor"}, id="int4-e8m0-floor"),
    pytest.param(
        "uint4",
        {"scale_format": "pow2", "scale_rule": "ceil"},
        id="uint4-pow2-ceil",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "int8",
        {"scale_format": "pow2", "scale_rule": "even"},
        id="int8-pow2-even",
        marks=pytest.mark.slow,
    ),
    pytest.param("e4m3fn", {}, id="e4m3fn-tensor"),
    pytest.param(
        "e5m2",
        {"block_size": 32, "scale_format": "bfloat16"},
        id="e5m2-block-bf16",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "fp4", {"axis": 0, "scale_format": "float16"}, id="fp4-channel-fp16", marks=pytest.mark.slow
    ),
    pytest.param("e4m3fn", {"scale_format": "e8m0", "scale_rule": "floor"}, id="e4m3fn-e8m0"),
    pytest.param("int8", {"scale": "mse", "axis": 0}, id="int8-mse", marks=pytest.mark.slow),
    pytest.param("e4m3fn", {"scale": "none"}, id="e4m3fn-plain-cast", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("fmt,kw", SCALED_CASES)
def test_scaled_fused_equals_reference(fmt, kw):
    for x in (_special_rows(3, False), _special_rows(3), _extreme_rows(4)):
        _check(x, fmt, **kw)


ROUNDING_CASES = [("int8", {"axis": 0}), ("e4m3fn", {}), ("mxfp4", {}), ("mxint8", {})]


@pytest.mark.parametrize(
    "rounding",
    [pytest.param(m, marks=() if m == "toward_zero" else pytest.mark.slow) for m in ROUNDING_MODES],
)
def test_every_rounding_mode_fused_equals_reference(rounding):
    key = jax.random.key(7) if rounding == "stochastic" else None
    for fmt, kw in ROUNDING_CASES:
        for x in (_special_rows(5, False), _special_rows(5)):
            _check(x, fmt, key=key, rounding=rounding, **kw)


def test_both_pow2_branches_are_taken():
    """The inputs above reach both branches of the one lax.cond (else the exact branch is
    never compared): the fast branch needs every block's exponent inside [-100, 126]."""
    cases = ((_special_rows(0, False), True), (_special_rows(0), False), (_extreme_rows(1), False))
    for x, want in cases:
        spec = resolve(2, "mxfp8_e4m3")
        _, sc = core.choose_scale(jnp.asarray(x), spec)
        e = np.asarray(sc.e)
        assert bool(np.all((e >= core._FAST_E_MIN) & (e <= core._FAST_E_MAX))) == want


def test_one_pass_after_the_reduce():
    """MX fake_quant compiles to the amax reduce plus one elementwise pass over the data per
    branch: no intermediate of the input's size is written between scale and dequantize."""
    x = jnp.zeros((64, 256), jnp.float32)
    hlo = jax.jit(lambda v: fake_quant(v, "mxfp8_e4m3")).lower(x).compile().as_text()
    entry = hlo[hlo.index("ENTRY") :]
    big = [ln for ln in entry.splitlines() if "f32[64,8,32]" in ln.split("=")[-1][:40]]
    assert sum(" conditional(" in ln for ln in entry.splitlines()) == 1
    assert not any("fusion(" in ln for ln in big), big  # nothing input-sized outside the cond


_VALUES = st.one_of(
    st.floats(-1e4, 1e4, width=32),
    st.floats(width=32),  # any float32: subnormals, extremes, inf, NaN
    st.sampled_from([0.0, -0.0, 0.5, -1.5, 2.5, 448.0, 480.0, 6.0, 7.0]),
)
_SPECS = [
    ("int8", {"axis": 0}),
    ("int4", {"block_size": 32}),
    ("mxfp8_e4m3", {}),
    ("mxint8", {"scale_rule": "even"}),
    ("uint8", {"axis": 0, "scale_format": "pow2"}),
]


@settings(max_examples=20, deadline=None)
@given(
    values=st.lists(_VALUES, min_size=4 * 64, max_size=4 * 64),
    spec=st.sampled_from(_SPECS),
    scale=st.floats(1e-30, 1e30),
)
def test_fused_equals_reference_on_hypothesis_inputs(values, spec, scale):
    fmt, kw = spec
    with np.errstate(over="ignore"):
        x = (np.array(values, F32).reshape(4, 64) * F32(scale)).astype(F32)
    _check(x, fmt, **kw)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,rule,rounding", list(itertools.product(MX_FORMATS, SCALE_RULES, ROUNDING_MODES))
)
def test_mx_every_rule_and_mode_fused_equals_reference(name, rule, rounding):
    key = jax.random.key(3) if rounding == "stochastic" else None
    for x in (_special_rows(6, False), _special_rows(6), _extreme_rows(7)):
        _check(x, name, key=key, scale_rule=rule, rounding=rounding)


def _boundary_float32() -> np.ndarray:
    """Every float32 exponent and sign with the mantissas around every rounding position."""
    mants = {0, 1, 0x7FFFFF}
    for d in range(1, 24):
        for base in (1 << d, 1 << (d - 1), 3 << (d - 1)):
            mants |= {(base + k) & 0x7FFFFF for k in (-1, 0, 1)}
    m = np.array(sorted(mants), dtype=np.uint32)
    bits = ((np.arange(256, dtype=np.uint32) << np.uint32(23))[:, None] | m[None, :]).ravel()
    return np.concatenate([bits, bits | np.uint32(0x80000000)]).view(F32)


INT_GRIDS = [("int2", False), ("int4", False), ("int4", True), ("int8", False), ("int8", True)]


@pytest.mark.parametrize("name,full_range", INT_GRIDS)
def test_int_grid_rounding_equals_codec(name, full_range):
    """The float-domain integer rounding gives the bits of round_to_format (encode, then
    decode) on clipped inputs, NaN, infinities, subnormals and -0 included."""
    from precisionlab.bits import round_to_format
    from precisionlab.formats import get_format

    spec = resolve(1, name, full_range=full_range)
    x = jnp.asarray(_boundary_float32())
    yc = jnp.clip(x, spec.qmin, spec.qmax)
    got = jax.jit(core.round_int_grid)(yc)
    want = jax.jit(lambda v: round_to_format(v, get_format(name)))(yc)
    assert_same_bits(got, want)
    assert not np.isnan(np.asarray(got)).any()


@pytest.mark.slow
@pytest.mark.parametrize("name,full_range", INT_GRIDS)
def test_int_grid_rounding_equals_codec_on_every_float32(name, full_range):
    from precisionlab.bits import round_to_format
    from precisionlab.formats import get_format

    spec, fmt, n = resolve(1, name, full_range=full_range), get_format(name), 1 << 24

    @jax.jit
    def mismatches(start):
        x = jax.lax.bitcast_convert_type(start + jnp.arange(n, dtype=jnp.uint32), jnp.float32)
        yc = jnp.clip(x, spec.qmin, spec.qmax)
        a = jax.lax.bitcast_convert_type(core.round_int_grid(yc), jnp.uint32)
        b = jax.lax.bitcast_convert_type(round_to_format(yc, fmt), jnp.uint32)
        return jnp.sum(a != b)

    assert sum(int(mismatches(jnp.uint32(i * n))) for i in range(1 << 8)) == 0
