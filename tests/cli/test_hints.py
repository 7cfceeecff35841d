"""Every suggestion an error makes is code: evaluated as Python and used as it is, it works.

(The train step's advice for an Equinox model is run in tests/models/test_models_equinox.py.)
"""

from __future__ import annotations

import ast

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from precisionlab import recipes, telemetry
from precisionlab.intercept import _boundary as boundary
from precisionlab.intercept import intercept
from precisionlab.recipes import get_recipe, init_site_state

P = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4)), jnp.float32)
X = jnp.asarray(np.random.default_rng(1).normal(size=(3, 4)), jnp.float32)


def _suggested(message: str, keyword: str) -> str:
    """The code after ``keyword=`` in a message: up to the ``)`` closing the parenthesis the
    suggestion sits in (or the end of a sentence)."""
    start = message.index(f"{keyword}=") + len(keyword) + 1
    depth = 0
    for i, ch in enumerate(message[start:], start):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return message[start:i]
            depth -= 1
        elif ch in ", " and depth == 0:
            return message[start:i]
    return message[start:]


# --- a shard_map inside the wrapped function -------------------------------------------------
def _inner_shard_map(p, x):
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    spec = PartitionSpec()
    inner = jax.shard_map(lambda p, x: jnp.tanh(x @ p), mesh=mesh, in_specs=(spec, spec),
                          out_specs=spec)  # fmt: skip
    return inner(p, x) @ p.T @ p


@pytest.mark.parametrize("wrap", ["apply", "observe"])
def test_the_unsupported_primitive_hint_is_valid_code_that_works(wrap):
    """A wrapper around a function that calls shard_map itself cannot enter it: the error
    names the site and suggests exclude=[...]; evaluated and passed as it is, it runs (the
    excluded matmul as it was, the others quantized or observed)."""

    def wrapped(**kw):
        if wrap == "apply":
            return recipes.apply(_inner_shard_map, "current", **kw)
        return lambda *a: telemetry.observe(_inner_shard_map, **kw)(*a)[0]

    with pytest.raises(boundary.UnsupportedPrimitive) as err:
        wrapped()(P, X)
    exclude = ast.literal_eval(_suggested(str(err.value), "exclude"))
    assert exclude == ["dot_general[0]"], str(err.value)
    out = wrapped(exclude=exclude)(P, X)
    if wrap == "observe":
        np.testing.assert_array_equal(out, jax.jit(_inner_shard_map)(P, X))
    else:
        assert out.shape == (3, 4) and not np.array_equal(out, _inner_shard_map(P, X))


def test_the_hint_lists_several_sites_as_one_valid_list():
    """Two sites inside: one list of two names (it was one comma-joined string, itself no
    site's name)."""

    def two_inside(p, x):
        mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
        spec = PartitionSpec()
        f = jax.shard_map(lambda p, x: (x @ p) @ p, mesh=mesh, in_specs=(spec, spec),
                          out_specs=spec)  # fmt: skip
        return f(p, x)

    with pytest.raises(boundary.UnsupportedPrimitive) as err:
        recipes.apply(two_inside, "current")(P, X)
    exclude = ast.literal_eval(_suggested(str(err.value), "exclude"))
    assert exclude == ["dot_general[0]", "dot_general[1]"]
    np.testing.assert_array_equal(
        recipes.apply(two_inside, "current", exclude=exclude)(P, X), two_inside(P, X)
    )


def test_emulate_s_hint_is_its_own_keep_list_and_works():
    """emulate names the operations inside the shard_map and suggests keep=[...] (its option;
    it once named none and suggested nothing): passed as it is, the inner operations run
    unrounded and the outer matmul is rounded to float16, bitwise the inner function as
    written followed by the emulated outer matmul."""
    from precisionlab.emulate import emulate

    with pytest.raises(boundary.UnsupportedPrimitive) as err:
        emulate(_inner_shard_map, "c=f16")(P, X)
    assert "exclude=" not in str(err.value)
    keep = ast.literal_eval(_suggested(str(err.value), "keep"))
    assert keep == ["dot_general[0]", "tanh[1]"], str(err.value)
    out = np.asarray(emulate(_inner_shard_map, "c=f16", keep=keep)(P, X))
    inner = jnp.tanh(X @ P)
    outer = emulate(lambda h, p: h @ p.T @ p, "c=f16")(inner, P)
    np.testing.assert_array_equal(out, np.asarray(outer))
    assert not np.array_equal(out, np.asarray(jax.jit(_inner_shard_map)(P, X)))


# --- a matmul in a while loop's condition ------------------------------------------------------
class _Double:
    primitives = ("dot_general",)

    def apply(self, ctx, lhs, rhs, **params):
        return [o * 2 for o in ctx.original(lhs, rhs)]


def test_the_while_condition_hint_works():
    def loop(p, x):
        def cond(c):
            return (c @ p).sum() < 100.0

        return jax.lax.while_loop(cond, lambda c: c @ p + 1.0, x)

    f = intercept(loop, _Double())  # the body's matmul is dot_general[0], the condition's [1]
    with pytest.raises(NotImplementedError) as err:
        f.call_with_state({"dot_general[0]": jnp.zeros(())}, P, X)
    exclude = ast.literal_eval(_suggested(str(err.value), "exclude"))
    assert exclude == ["dot_general[1]"]
    out = intercept(loop, _Double(), exclude=exclude).call_with_state(
        {"dot_general[0]": jnp.zeros(())}, P, X
    )
    assert out.shape == X.shape


# --- the recipes' options ----------------------------------------------------------------------
def test_the_pad_hint_is_a_recipe_that_pads():
    strict = get_recipe("mxfp8", pad=False)
    x, w = jnp.ones((4, 48)), jnp.ones((48, 4))
    with pytest.raises(ValueError) as err:
        recipes.matmul(x, w, recipe=strict)
    names = {"get_recipe": get_recipe, "recipe": strict}
    padded = eval(_suggested(str(err.value), "recipe"), names)
    assert padded.pad and recipes.matmul(x, w, recipe=padded).shape == (4, 4)


def test_the_state_hints_are_states_that_run():
    delayed = get_recipe("delayed")
    dims = (((1,), (0,)), ((), ()))
    with pytest.raises(ValueError) as err:
        recipes.dot_general(X, P, dims, recipe=delayed)
    state = eval(_suggested(str(err.value), "state"), {"init_site_state": init_site_state,
                                                        "recipe": delayed})  # fmt: skip
    assert recipes.dot_general(X, P, dims, recipe=delayed, state=state).shape == (3, 4)
    f = recipes.apply(lambda p, x: x @ p, "delayed")
    with pytest.raises(ValueError) as err:
        f(P, X)
    state = eval(_suggested(str(err.value), "state"), {"f": f, "args": (P, X)})
    assert f(P, X, state=state).shape == (3, 4)


def test_the_key_hint_is_a_key_and_the_alternative_a_recipe():
    x, w = jnp.ones((16, 32)), jnp.ones((32, 16))

    def loss(w, recipe="nvfp4", key=None):
        return recipes.matmul(x, w, recipe=recipe, key=key).sum()

    with pytest.raises(ValueError) as err:
        jax.grad(loss)(w)
    message = str(err.value)
    key = eval(_suggested(message, "key"), {"jax": jax})
    assert jax.grad(loss)(w, key=key).shape == w.shape
    other = eval(_suggested(message, "recipe"), {"get_recipe": get_recipe})
    assert not other.stochastic_gradients and jax.grad(loss)(w, recipe=other).shape == w.shape
