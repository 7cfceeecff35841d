"""Policy interop: jmp Policy objects and dtype objects are accepted as well as strings."""

from __future__ import annotations

import jax.numpy as jnp
import jmp
import numpy as np
import pytest

from precisionlab.mixed import DEFAULT_FP32_OPS, Policy, get_policy

SPECS = ["p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f16", "bf16", "c=f16", "p=f16,c=f16,o=f32"]


@pytest.mark.parametrize("spec", SPECS)
def test_a_jmp_policy_gives_the_same_policy_as_its_string(spec):
    theirs = jmp.get_policy(spec)
    assert get_policy(theirs) == get_policy(spec)
    assert get_policy(theirs, fp32_ops=["softmax"]).fp32_ops == frozenset({"softmax"})


@pytest.mark.parametrize("spec", SPECS)
def test_to_jmp_round_trips_and_casts_like_jmp(spec):
    ours = get_policy(spec)
    back = ours.to_jmp()
    assert isinstance(back, jmp.Policy)
    assert get_policy(back) == ours
    tree = {"w": np.ones((2,), np.float32), "i": np.arange(2)}
    for mine, theirs in (
        (ours.cast_to_compute(tree), back.cast_to_compute(tree)),
        (ours.cast_to_param(tree), back.cast_to_param(tree)),
        (ours.cast_to_output(tree), back.cast_to_output(tree)),
    ):
        assert {k: np.dtype(v.dtype) for k, v in mine.items()} == {
            k: np.dtype(v.dtype) for k, v in theirs.items()
        }


@pytest.mark.parametrize(
    ("dtype", "name"),
    [
        (jnp.bfloat16, "bfloat16"),
        (np.float16, "float16"),
        (np.dtype("float32"), "float32"),
        (jnp.dtype("float8_e4m3fn"), "float8_e4m3fn"),
    ],
)
def test_a_dtype_object_sets_all_three_dtypes(dtype, name):
    p = get_policy(dtype)
    assert {d.name for d in (p.param_dtype, p.compute_dtype, p.output_dtype)} == {name}
    assert p.fp32_ops == DEFAULT_FP32_OPS
    assert p == get_policy(name)


@pytest.mark.parametrize("bad", [3, 2.5, None, True, object(), [1, 2], {"c": "bf16"}])
def test_other_objects_are_a_type_error_naming_what_is_allowed(bad):
    with pytest.raises(TypeError, match=r"a string .*a Policy, a jmp Policy or a dtype"):
        get_policy(bad)


def test_a_non_floating_dtype_is_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match="unsupported dtype 'int32'; allowed: float32"):
        get_policy(np.int32)


def test_policy_parse_takes_the_same_kinds():
    assert Policy.parse(jmp.get_policy("c=bf16")) == get_policy("c=bf16")
    assert Policy.parse(jnp.bfloat16) == get_policy("bf16")


def test_policy_fields_accept_dtype_objects():
    p = Policy(param_dtype=jnp.float32, compute_dtype=jnp.bfloat16, output_dtype=np.float32)
    assert p == get_policy("p=f32,c=bf16,o=f32")
