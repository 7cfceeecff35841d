"""emulate's per-operation model (precisionlab.emulate._model): what XLA:GPU computes for one
operation of a 16-bit program.

Oracles: Python's ``math`` module in float64 (an implementation independent of the numpy
tables emulate uses), rounded once to the 16-bit format with ml_dtypes, over every finite
float16 code; float64 arithmetic rounded per operation for the expansions XLA performs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from precisionlab.emulate import emulate

F16 = np.arange(65536, dtype=np.uint16).view(np.float16)
F16 = F16[np.isfinite(F16.astype(np.float32))]


def _r(v, dt=np.float16) -> np.ndarray:
    with np.errstate(over="ignore"):  # overflow to inf is part of the rounding
        return np.asarray(v, np.float64).astype(dt).astype(np.float64)


def _math(f, x: np.ndarray) -> np.ndarray:
    out = []
    for v in x.astype(np.float64).tolist():
        try:
            out.append(f(v))
        except OverflowError:  # exp of a large float16
            out.append(math.inf)
        except ValueError:  # log of zero or of a negative number
            out.append(-math.inf if v == 0 and f is math.log else math.nan)
    return np.asarray(out)


def _same(got, want) -> None:
    g = np.asarray(got, np.float64)
    bad = (g != want) & ~(np.isnan(g) & np.isnan(want))
    assert not bad.any(), (int(bad.sum()), np.asarray(F16)[bad][:5], g[bad][:5], want[bad][:5])


@pytest.mark.parametrize("name", ["exp", "tanh", "log", "erf"])
def test_transcendentals_are_correctly_rounded_for_every_float16(name):
    f = {"exp": jnp.exp, "tanh": jnp.tanh, "log": jnp.log, "erf": jax.scipy.special.erf}[name]
    g = {"exp": math.exp, "tanh": math.tanh, "log": math.log, "erf": math.erf}[name]
    got = jax.jit(emulate(f, "f16"))(jnp.asarray(F16))
    _same(got, _r(_math(g, F16)))
    if name == "exp":  # plain jit on this CPU is not correctly rounded everywhere
        plain = np.asarray(jax.jit(f)(jnp.asarray(F16)), np.float64)
        want = _r(_math(g, F16))
        assert ((plain != want) & ~np.isnan(want)).any()


def test_sigmoid_is_xla_expansion_rounded_per_operation():
    x = F16.astype(np.float64)
    with np.errstate(all="ignore"):
        want = _r(1 / _r(1 + _r(_math(math.exp, -x))))
    _same(jax.jit(emulate(jax.nn.sigmoid, "f16"))(jnp.asarray(F16)), want)


def test_integer_pow_and_true_division():
    rng = np.random.default_rng(3)
    a = rng.uniform(-40, 40, 4096).astype(np.float16)
    b = rng.uniform(0.5, 9, 64).astype(np.float16)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(all="ignore"):
        cube = _r(_r(a64 * a64) * a64)  # x**3 as JAX lowers it: (x*x)*x, each rounded
        inv = _r(1 / _r(_r(a64 * a64) * _r(a64 * a64)))  # x**-4: ((x*x)*(x*x)), then 1/
    _same(jax.jit(emulate(lambda x: x**3, "f16"))(jnp.asarray(a)), cube)
    _same(jax.jit(emulate(lambda x: x**-4, "f16"))(jnp.asarray(a)), inv)
    # a / broadcast(b): a true division (XLA:CPU would multiply by a rounded reciprocal)
    q = jax.jit(emulate(lambda a, b: a.reshape(64, 64) / b[:, None], "f16"))(a, b)
    _same(np.asarray(q).ravel(), _r(a64.reshape(64, 64) / b64[:, None]).ravel())


def test_a_16bit_program_keeps_its_float32_upcasts_and_a_float32_one_is_rounded():
    x = jnp.full((4096,), 12.0, jnp.float16)
    # jnp.mean sums float16 in float32: 4096 * 144 = 589824 > 65504 stays finite there
    assert float(jax.jit(emulate(lambda x: jnp.mean(x * x), "c=f16"))(x)) == 144.0
    # the same program in float32 under c=f16: every float32 result is a float16 value
    y = jax.jit(emulate(lambda x: jnp.sum(x * x), "c=f16"))(x.astype(jnp.float32))
    assert np.isinf(float(y))
    # bfloat16 values in a float16 policy: own rounding first, then the policy's
    z = jax.jit(emulate(lambda x: x.astype(jnp.bfloat16) * 3, "c=f16"))(jnp.float32(1000.3))
    assert float(z) == float(ml_dtypes.bfloat16(3000.0))
