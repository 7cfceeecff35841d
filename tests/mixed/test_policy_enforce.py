"""``Policy.enforce``: the rounding at op boundaries is a field of the policy (parsed, printed,
hashed), the ops and the models read it, the config's ``enforce_numerics`` sets it, and the old
``enforce=`` keyword beside a policy is gone (a TypeError naming it)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precisionlab.mixed import Policy, get_policy, ops
from precisionlab.train import TrainConfig
from precisionlab.train._models.mlp import MLP


def test_enforce_is_a_field_on_by_default_hashed_and_shown():
    p = Policy()
    assert p.enforce is True
    off = p.with_enforce(False)
    assert off == dataclasses.replace(p, enforce=False)
    assert off.enforce is False and off != p
    assert len({p, off, Policy(), Policy(enforce=False)}) == 2
    assert "enforce=True" in repr(p) and "enforce=False" in repr(off)
    # with_fp32_ops / get_policy(policy, fp32_ops=...) keep the field
    assert get_policy(off, fp32_ops=["softmax"]).enforce is False


@pytest.mark.parametrize(
    "spec, enforce",
    [
        ("p=f32,c=bf16,o=f32", True),
        ("p=f32,c=bf16,o=f32,enforce=false", False),
        ("c=f16, Enforce=FALSE", False),
        ("c=f16,enforce=true", True),
        ("enforce=false,c=bf16,fp32=none", False),
    ],
)
def test_policy_strings_set_enforce_and_round_trip(spec, enforce):
    p = Policy.parse(spec)
    assert p.enforce is enforce
    assert get_policy(str(p)) == p
    assert ("enforce=false" in str(p)) is (not enforce)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("c=bf16,enforce=no", "bad enforce value 'no'.*allowed: true, false"),
        ("c=bf16,enforce=false,enforce=true", "'enforce' given twice"),
        ("c=bf16,enforced=false", "unknown policy key 'enforced'.*fp32, enforce"),
    ],
)
def test_bad_enforce_parts_raise(spec, message):
    with pytest.raises(ValueError, match=message):
        get_policy(spec)


def test_enforce_must_be_a_bool():
    with pytest.raises(TypeError, match=r"Policy\.enforce must be a bool, got 'false'"):
        Policy(enforce="false")
    assert Policy(enforce=np.bool_(False)).enforce is False


def test_old_enforce_keyword_raises_naming_it():
    p = get_policy("bf16")
    x = jnp.ones((2, 2), jnp.float32)
    with pytest.raises(TypeError, match="unexpected keyword argument 'enforce'"):
        ops.matmul(x, x, policy=p, enforce=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'enforce'"):
        ops.boundary(x, p, enforce=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'enforce'"):
        MLP(in_dim=2, width=2, depth=1, num_classes=2).loss_fn(p, enforce=False)


@pytest.fixture(scope="module")
def mlp_case():
    model = MLP(in_dim=16, width=32, depth=2, num_classes=4, activation="gelu", use_layernorm=True)
    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.standard_normal((8, 16)), jnp.float32),
        "y": jnp.asarray(rng.integers(0, 4, 8), jnp.int32),
    }
    return model, model.init(jax.random.PRNGKey(0)), batch


def _loss_and_grads(model, params, batch, policy):
    f = jax.jit(jax.value_and_grad(lambda q, b: model.loss_fn(policy)(q, b)[0]))
    return [np.asarray(leaf) for leaf in jax.tree.leaves(f(params, batch))]


@pytest.mark.parametrize("spec, equal", [("f32", True), ("p=f32,c=bf16,o=f32", False)])
def test_the_models_read_enforce_from_the_policy(mlp_case, spec, equal):
    """In float32 enforcing is a no-op (bitwise equal); in bfloat16 the forced rounding at each
    op boundary changes the loss or gradients that XLA's fused, wider arithmetic gives."""
    policy = get_policy(spec)
    on = _loss_and_grads(*mlp_case, policy)
    off = _loss_and_grads(*mlp_case, policy.with_enforce(False))
    assert all(np.array_equal(a, b) for a, b in zip(on, off, strict=True)) is equal


def test_the_config_key_enforce_numerics_sets_the_policy_field():
    assert TrainConfig().precision.policy.enforce is True
    cfg = TrainConfig(policy="p=f32,c=f16,o=f32", enforce_numerics=False)
    assert cfg.precision.policy == get_policy("p=f32,c=f16,o=f32,enforce=false")
    # one place says it in a config: the key, not the policy string
    with pytest.raises(ValueError, match="sets enforce; in a config say enforce_numerics = false"):
        TrainConfig(policy="c=f16,enforce=false")
