"""Policy parsing (jmp's syntax, checked against jmp itself) and casting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precisionlab.mixed import FP32_OPS, Policy, get_policy, parse_dtype
from precisionlab.mixed._policy import DTYPE_NAMES

SPECS = [
    "params=float32,compute=bfloat16,output=float32",
    "p=f32,c=bf16,o=f32",
    "p=f32,c=f16",
    "c=f16",
    "c=bf16,o=f32",
    "p=f16,c=bf16",
    "float32",
    "bf16",
    "f16",
    "full",
]


@pytest.mark.parametrize("spec", SPECS)
def test_parse_matches_jmp(spec):
    jmp = pytest.importorskip("jmp")  # in the dev extra; only this test needs it
    ours, theirs = get_policy(spec), jmp.get_policy(spec)
    assert ours.param_dtype == np.dtype(theirs.param_dtype)
    assert ours.compute_dtype == np.dtype(theirs.compute_dtype)
    assert ours.output_dtype == np.dtype(theirs.output_dtype)


def test_str_round_trips():
    for spec in SPECS:
        p = get_policy(spec)
        assert get_policy(str(p)) == p


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("half", "ambiguous"),
        ("p=f32,c=f17", "unknown dtype 'f17'"),
        ("q=f32", "unknown policy key 'q'"),
        ("p=f32,p=bf16", "given twice"),
        ("p=f32,,c=bf16", "bad policy part"),
        ("", "empty policy"),
    ],
)
def test_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        get_policy(spec)


def test_bad_types_and_ops():
    with pytest.raises(TypeError):
        get_policy(3)
    with pytest.raises(ValueError, match="unknown fp32_ops"):
        get_policy("bf16", fp32_ops=["softmax", "sqrt"])
    with pytest.raises(ValueError, match="unsupported dtype"):
        parse_dtype(np.int32)


def test_cast_only_floating_leaves():
    p = get_policy("p=f32,c=bf16,o=f16")
    tree = {
        "w": jnp.ones((2,), jnp.float32),
        "i": jnp.arange(3),
        "h": np.ones(2, np.float16),
        "s": "name",
    }
    c = p.cast_to_compute(tree)
    assert c["w"].dtype == jnp.bfloat16 and c["h"].dtype == jnp.bfloat16
    assert c["i"].dtype == tree["i"].dtype and c["s"] == "name"
    assert p.cast_to_output(tree)["w"].dtype == jnp.float16
    assert p.cast_to_param(c)["w"].dtype == jnp.float32


def test_fp32_ops_and_static_jit_argument():
    p = get_policy("p=f32,c=bf16,o=f32")
    assert p.fp32_ops == frozenset(FP32_OPS)
    assert p.op_dtype("softmax") == np.float32
    q = p.with_fp32_ops([])
    assert q.op_dtype("softmax") == jnp.bfloat16
    with pytest.raises(ValueError, match="unknown op"):
        p.keeps_fp32("exp")
    f = jax.jit(lambda x, pol: pol.cast_to_compute(x), static_argnums=1)
    assert f(jnp.ones(2), p).dtype == jnp.bfloat16
    assert hash(p) == hash(get_policy("p=f32,c=bf16,o=f32"))
    assert isinstance(Policy.parse("c=f16"), Policy)


@pytest.mark.parametrize("value", [None, True])
def test_a_missing_dtype_is_an_error_not_float64(value):
    with pytest.raises(TypeError, match="expected a dtype"):
        parse_dtype(value)


@pytest.mark.parametrize(
    "ops", [None, [], ["softmax"], ["reduce", "layer_norm"], list(FP32_OPS)]
)  # fmt: skip
@pytest.mark.parametrize("spec", ["p=f32,c=bf16,o=f32", "bf16", "p=f32,c=f16,o=f16", "e4m3"])
def test_str_round_trips_exactly(spec, ops):
    # str(policy) used to drop fp32_ops: get_policy(str(p)) != p when fp32_ops=[].
    p = get_policy(spec, fp32_ops=ops)
    assert get_policy(str(p)) == p
    if ops is None or set(ops) == set(FP32_OPS):
        assert "fp32" not in str(p)  # the default list is not written


def test_fp32_ops_given_twice_is_an_error():
    with pytest.raises(ValueError, match="given twice"):
        get_policy("p=f32,c=bf16,fp32=none", fp32_ops=["softmax"])
    with pytest.raises(ValueError, match="unknown fp32_ops"):
        get_policy("p=f32,c=bf16,fp32=softmax+gelu")


def test_one_table_of_dtype_names_with_the_format_catalog():
    # formats.ALIASES and policy.DTYPE_NAMES used to disagree; now every name the catalog gives
    # one of the policy dtypes parses to it, except jmp's device-dependent "half".
    from precisionlab.formats import ALIASES
    from precisionlab.mixed._policy import POLICY_DTYPES

    for alias, canonical in ALIASES.items():
        if canonical in POLICY_DTYPES and alias != "half":
            assert parse_dtype(alias) == np.dtype(canonical), alias
    for canonical, names in DTYPE_NAMES.items():
        assert all(ALIASES.get(n, n) == canonical for n in names)
    with pytest.raises(ValueError, match="ambiguous"):
        parse_dtype("half")
