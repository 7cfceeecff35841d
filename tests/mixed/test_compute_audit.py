"""The compute-dtype audit: which dtype each matmul and convolution multiplies in, and a
warning when a requested 16-bit policy left most FLOPs in float32 (the Flax NNX case: nnx.Embed
fixes its dtype at construction, so its float32 output promotes every later layer back).

Oracles: FLOPs counted by hand from the shapes; whether a run really computed in float32 is
checked by running it: a model that computes in float32 on bfloat16-valued parameters gives
bitwise the output of the same model run in float32 on those values, one that computes in
bfloat16 does not.
"""

from __future__ import annotations

import warnings

import equinox as eqx
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _user_models import SEQ, VOCAB, D, nnx_lm, plain_model, plain_params

import precisionlab
from precisionlab import recipes
from precisionlab.compute_audit import ComputeDtypeWarning, audit
from precisionlab.emulate import emulate
from precisionlab.mixed import cast_floating, get_policy

POLICY = get_policy("p=f32,c=bf16,o=f32")


def _lm_flops(batch: int = 2, depth: int = 2) -> int:
    """Hand count of MiniLM's matmul FLOPs (2 per multiply-add)."""
    t, d, h = SEQ, D, 2
    proj = 2 * batch * t * d * d  # q, k, v and the output projection: (B, T, D) x (D, D)
    scores = 2 * batch * h * t * t * (d // h)  # QK^T and PV, each
    mlp = 2 * batch * t * d * 4 * d  # fc1 and fc2, each
    return depth * (4 * proj + 2 * scores + 2 * mlp) + 2 * batch * t * d * VOCAB


def test_nnx_policy_casts_only_computes_in_float32_and_the_audit_says_why():
    graphdef, state, tokens = nnx_lm()

    def fwd(s, t):  # the pattern of notebook 06: the policy casts the params, nothing else
        return nnx.merge(graphdef, POLICY.cast_to_compute(s))(t)

    with pytest.warns(ComputeDtypeWarning, match="asks for bfloat16, but 100%") as rec:
        a = precisionlab.audit(fwd, state, tokens, policy=POLICY)
    msg = str(rec[0].message)
    assert a.warning == msg and a.requested == "bfloat16"
    assert sum(a.flops.values()) == _lm_flops() and a.share("float32") == 1.0
    assert a.first_float32 == "dot_general[0]" and "layers/0/attn/query/kernel" in msg
    # the first promotion: the embedding table, cast back to float32 by nnx.Embed itself
    p = a.promotion
    assert p.primitive == "convert_element_type" and p.value == "`embed/embedding`"
    assert (p.src, p.dst) == ("bfloat16", "float32") and "explicit cast" in p.reason
    assert "nnx.Embed" in msg and a.cause == ""
    # the run really is float32 arithmetic on bfloat16-valued params: bitwise the float32 model
    # on those values
    rounded = cast_floating(cast_floating(state, jnp.bfloat16), jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(fwd)(state, tokens)),
        np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(rounded, tokens)),
    )


def test_nnx_with_bfloat16_modules_really_runs_in_bfloat16_and_the_audit_is_silent():
    graphdef, state, tokens = nnx_lm(dtype=jnp.bfloat16)  # NNX's own mixed precision

    def fwd(s, t):
        return nnx.merge(graphdef, s)(t)

    with warnings.catch_warnings():
        warnings.simplefilter("error", ComputeDtypeWarning)
        a = audit(fwd, state, tokens, policy="p=f32,c=bf16")
    assert a.warning == "" and a.share("bfloat16") == 1.0
    assert sum(a.flops.values()) == _lm_flops()
    assert all(s.in_dtypes == ("bfloat16", "bfloat16") for s in a.sites)
    # and the run is not float32 arithmetic: it differs from the float32 model on the values
    out = np.asarray(jax.jit(fwd)(state, tokens), np.float32)
    graph32, _, _ = nnx_lm()
    ref = np.asarray(jax.jit(lambda s, t: nnx.merge(graph32, s)(t))(state, tokens))
    assert not np.array_equal(out, ref)


def test_plain_scan_model_flops_counted_per_iteration_and_the_float32_input_named():
    p, x = plain_params(), jax.random.normal(jax.random.key(2), (4, 8))
    both = audit(lambda p, x: plain_model(POLICY.cast_to_compute(p), POLICY.cast_to_compute(x)),
                 p, x, policy=POLICY)  # fmt: skip
    assert both.warning == "" and both.flops == {
        "bfloat16": 2 * 4 * (8 * 32 + 3 * 32 * 32 + 32 * 4)
    }
    assert [s.param for s in both.sites] == ["w_in", "hidden/w", "w_out"]
    with pytest.warns(ComputeDtypeWarning) as rec:
        half = audit(lambda p, x: plain_model(POLICY.cast_to_compute(p), x), p, x, policy=POLICY)
    assert half.promotion is None and "`arg1` (float32 input)" in half.cause
    assert "mixed operands" in str(rec[0].message)
    # no policy: a listing, never a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", ComputeDtypeWarning)
        assert audit(plain_model, p, x).warning == ""


def test_conv_flops_and_report_lines():
    conv = eqx.nn.Conv2d(3, 8, 3, key=jax.random.key(0))
    params, static = eqx.partition(conv, eqx.is_array)
    x = jnp.ones((4, 3, 10, 10), jnp.bfloat16)

    def fwd(p, x):
        return jax.vmap(eqx.combine(POLICY.cast_to_compute(p), static))(x)

    a = audit(fwd, params, x, policy=POLICY)
    assert a.flops == {"bfloat16": 2 * 4 * 8 * 8 * 8 * (3 * 3 * 3)} and a.warning == ""
    assert "compute dtypes: 1 matmuls/convolutions, FLOPs in bfloat16 100.0%" in (
        recipes.apply(fwd, "mxfp8").report(params, x)
    )
    text = emulate(lambda p, x: plain_model(p, x), "bf16").report(plain_params(), jnp.ones((2, 8)))
    assert text.splitlines()[-1] == (
        "compute dtypes: 3 matmuls/convolutions, FLOPs in float32 100.0% (emulate rounds every "
        "float32 result to bfloat16)"
    )
