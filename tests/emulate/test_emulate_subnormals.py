"""Emulated bf16 arithmetic keeps its subnormal results (against ml_dtypes), and emulate's check
names the operations that produce them."""

from __future__ import annotations

import numpy as np
import pytest


def _bf16_pairs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random bfloat16 codes: a third subnormal or zero, a third near 2^-126, the rest wide."""
    import ml_dtypes

    rng = np.random.default_rng(seed)

    def codes():
        sub = rng.integers(0, 0x80, n) | (rng.integers(0, 2, n) << 15)
        near = rng.integers(0x0080, 0x0400, n) | (rng.integers(0, 2, n) << 15)
        wide = rng.integers(0, 0x7F80, n) | (rng.integers(0, 2, n) << 15)
        pick = rng.integers(0, 3, n)
        return np.choose(pick, [sub, near, wide]).astype(np.uint16).view(ml_dtypes.bfloat16)

    return codes(), codes()


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_emulate_bf16_arithmetic_keeps_subnormals(op):
    """Why: XLA on the CPU flushes float32 subnormals, which bfloat16's are: emulate's
    bfloat16 + - * / lost subnormal operands and results an H100 keeps. Against float64 numpy
    rounded once to bfloat16 by ml_dtypes (IEEE with subnormals; 53 >= 2 * 8 + 2 bits, so the
    two roundings are one), on 3,000 pairs of which a third are subnormal or zero."""
    import operator

    import jax.numpy as jnp
    import ml_dtypes

    from precisionlab.emulate import emulate

    fn = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
          "div": operator.truediv}[op]  # fmt: skip
    a, b = _bf16_pairs(3000, seed=len(op))
    with np.errstate(all="ignore"):
        want = fn(a.astype(np.float64), b.astype(np.float64)).astype(ml_dtypes.bfloat16)
    got = np.asarray(emulate(fn, "c=bf16")(jnp.asarray(a), jnp.asarray(b)))
    wv, gv = want.view(np.uint16), got.view(np.uint16)
    same = (wv == gv) | (np.isnan(want.astype(np.float32)) & np.isnan(got.astype(np.float32)))
    assert same.all(), (a[~same][:5], b[~same][:5], want[~same][:5], got[~same][:5])
    sub = (wv & 0x7F80) == 0
    assert (sub & (wv & 0x7F != 0)).sum() > 20  # subnormal results were tested


def test_emulate_exp_ratio_in_bf16_keeps_its_subnormals():
    """Why: on a held-out H100 capture of ``exp(x) / exp(x)`` in bfloat16, 79 of 8,192
    outputs were NaN (0/0) under emulate where the H100 gives 1.0: exp(x) is subnormal there.
    Against float64 numpy and ml_dtypes (exp correctly rounded to bfloat16, then the
    quotient): 1.0 wherever exp(x) is a nonzero subnormal, NaN only where it is 0."""
    import jax.numpy as jnp
    import ml_dtypes

    from precisionlab.emulate import emulate

    x = np.arange(-100.0, -80.0, 0.0625).astype(ml_dtypes.bfloat16)
    e = np.exp(x.astype(np.float64)).astype(ml_dtypes.bfloat16)
    with np.errstate(all="ignore"):
        want = (e.astype(np.float64) / e.astype(np.float64)).astype(ml_dtypes.bfloat16)
    got = np.asarray(emulate(lambda v: jnp.exp(v) / jnp.exp(v), "c=bf16")(jnp.asarray(x)))
    sub = (e.view(np.uint16) & 0x7F80) == 0
    assert sub.sum() > 20 and np.isnan(want.astype(np.float32)).sum() > 0
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


def test_emulate_check_names_the_operations_with_subnormal_results():
    """Where bit-exactness cannot be promised (an operation other than bfloat16 + - * / that
    reads a subnormal), emulate.check names the operations whose results are subnormal."""
    import jax.numpy as jnp
    import ml_dtypes

    from precisionlab.emulate import check

    x = jnp.asarray(np.array([-90.0, -1.0, 0.5], ml_dtypes.bfloat16))
    report = check(lambda v: jnp.exp(v) / jnp.exp(v), "c=bf16", x)
    names = [o.name for o in report.subnormal]
    assert names and all(n.startswith("exp") for n in names), names
    assert "subnormal results (below 2^-126, which this CPU flushes) in exp" in report.text()
