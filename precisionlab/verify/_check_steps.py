"""Checking the recorded steps of a recipe that owns its GEMMs (a gemm entry of model
``"steps"``): each step recomputed from its own recorded inputs with the same codec
(:func:`precisionlab.recipes.replay_fp4_step`), each output compared bit for bit; the first
difference labelled by recomputing the step the ways a mechanism would have (another scale
rule or 4-or-6 choice, other stochastic-rounding bits, zeros)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab import recipes
from precisionlab.quant import SCALE_RULES
from precisionlab.verify._context import CheckContext
from precisionlab.verify._diagnose import labelled, zeroed_or_nonfinite
from precisionlab.verify._format import DumpError, Tensor, from_storage, to_storage
from precisionlab.verify._report import TensorCheck, compare

__all__ = ["check_steps", "scale_alternatives"]


def _input(ctx: CheckContext, t: Tensor, impl: str | None) -> Any:
    a = ctx.arr(t)
    if impl is not None and impl.startswith("typed:"):
        return jax.random.wrap_key_data(jnp.asarray(a, jnp.uint32), impl=impl.split(":", 1)[1])
    return jnp.asarray(a)


def _ref(t: Tensor, value: Any) -> np.ndarray:
    """The recomputed output as the recorded tensor is stored (codes: its format's codes)."""
    v = np.asarray(value)
    if t.dtype == "float4_e2m1fn":
        return from_storage(to_storage(v, t.dtype), t.dtype)
    return v


def _hashable(v: Any) -> Any:
    return tuple(_hashable(x) for x in v) if isinstance(v, list) else v


@partial(jax.jit, static_argnums=(0, 1, 2))
def _replay_jit(recipe: recipes.Recipe, op: str, static: tuple, ins: dict) -> dict:
    return recipes.replay_fp4_step(recipe, op, ins, dict(static))


def replay(recipe: recipes.Recipe, op: str, ins: dict, static: dict) -> dict:
    """:func:`precisionlab.recipes.replay_fp4_step`, compiled once per op, arguments and
    shapes (a step's dozens of small operations dispatched one by one cost more)."""
    items = tuple(sorted((k, _hashable(v)) for k, v in static.items()))
    try:
        hash(items)
    except TypeError:
        raise ValueError(f"{op}: its static arguments are not plain values") from None
    return _replay_jit(recipe, op, items, ins)


def scale_alternatives(op: str, static: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The static arguments of a quantizer step under the other scale rules: NVFP4's 4-or-6
    choice (off, or by another error) and its E4M3 scale range (448 or 256); MXFP4's E8M0
    rounding (floor, rceil, ...)."""
    out = []
    if op == "nvfp4":
        for fos in (None, "mse", "mae", "abs_max"):
            for smax in (448.0, 256.0):
                alt = {**static, "four_over_six": fos, "scale_max": smax}
                if alt != static:
                    out.append((f"four_over_six={fos!r}, scale_max={smax:g}", alt))
    elif op == "mxfp4":
        out += [(f"rule={r!r}", {**static, "rule": r}) for r in SCALE_RULES
                if r != static.get("rule")]  # fmt: skip
    return out


def check_steps(
    ctx: CheckContext, g: dict, ts: dict[str, Tensor], check: Callable[..., TensorCheck]
) -> None:
    """Check the steps of gemm entry ``g`` (``ts``: its tensors by relative name; ``check``:
    the checker's ``_check(t, rec, ref)``), adding a verdict per tensor to ``ctx``."""
    steps = g.get("steps")
    if not isinstance(steps, list):
        raise DumpError(f"gemm {g['id']}: model 'steps' without a list of steps")
    recipe = ctx.recipe
    if not isinstance(recipe, recipes.FP4Recipe):
        raise DumpError(f"gemm {g['id']}: recorded steps in a dump without an FP4 recipe")
    for j, st in enumerate(steps):
        fields = ("static", "inputs", "outputs")
        ok = isinstance(st, dict) and isinstance(st.get("op"), str)
        ok = ok and all(isinstance(st.get(f), dict) for f in fields)
        if not ok:
            raise DumpError(f"gemm {g['id']}: steps[{j}] is not an op with static, inputs, "
                            "outputs")  # fmt: skip
        keys = st.get("keys") or {}
        ins = {}
        for name, rel in st["inputs"].items():
            t = _tensor(ts, rel, g)
            ins[name] = _input(ctx, t, keys.get(name))
            ctx.add(TensorCheck(t.name, t.role, t.order, t.gemm, "input",
                                int(np.prod(t.shape, dtype=np.int64)), 0, 0, None,
                                "a stochastic-rounding key" if t.role == "key"
                                else f"an input of {st['op']}"))  # fmt: skip
        try:
            ref = replay(recipe, st["op"], ins, st["static"])
        except (TypeError, ValueError, KeyError) as err:
            raise DumpError(f"gemm {g['id']}: step {j} ({st['op']}) does not recompute from "
                            f"the dump: {str(err).splitlines()[0]}") from None  # fmt: skip
        outs = {name: _tensor(ts, rel, g) for name, rel in st["outputs"].items()}
        for name, t in outs.items():
            if name not in ref:
                raise DumpError(f"gemm {g['id']}: step {j} ({st['op']}) has no output {name!r}")
            c = check(t, ctx.arr(t), _ref(t, ref[name]))
            if c.status == "differ":
                c = _diagnose(ctx, c, t, ref, st, ins, outs, "key" in ins)
            ctx.add(c)


def _tensor(ts: dict[str, Tensor], rel: Any, g: dict) -> Tensor:
    if not isinstance(rel, str) or rel not in ts:
        raise DumpError(f"gemm {g['id']}: a step names a tensor {rel!r} it does not hold")
    return ts[rel]


def _same(ctx: CheckContext, outs: dict[str, Tensor], other: dict[str, Any]) -> bool:
    for name, t in outs.items():
        if name not in other:
            return False
        n, eq, _, _ = compare(ctx.arr(t), _ref(t, other[name]), t.dtype)
        if eq != n:
            return False
    return True


def _diagnose(
    ctx: CheckContext,
    c: TensorCheck,
    t: Tensor,
    ref_all: dict,
    st: dict[str, Any],
    ins: dict[str, Any],
    outs: dict[str, Tensor],
    keyed: bool,
) -> TensorCheck:
    rec, ref = ctx.arr(t), ref_all[t.name.rsplit("/", 1)[-1]]
    z = zeroed_or_nonfinite(np.asarray(rec).astype(np.float32), np.asarray(ref))
    if z:
        ctx.full()
        return labelled(c, "zeroed-or-nonfinite", z)
    if not ctx.full():
        return labelled(c, None, "not analysed (only the first difference is)")
    scale = outs.get("scale")
    same_scale = scale is not None and _same(ctx, {"scale": scale}, {"scale": ref_all["scale"]})
    # another scale rule shows in the scales; with the scales the recipe's, skip the search
    assert ctx.recipe is not None  # check_steps checked that it is an FP4 recipe
    for name, alt in [] if same_scale else scale_alternatives(st["op"], st["static"]):
        try:
            other = replay(ctx.recipe, st["op"], ins, alt)
        except (TypeError, ValueError):
            continue
        if _same(ctx, outs, other):
            now = ", ".join(f"{k}={st['static'].get(k)!r}" for k in alt if alt[k] != st["static"]
                            .get(k))  # fmt: skip
            return labelled(c, "scale-rule", f"the {st['op']} step's outputs are those of "
                             f"{name} (the recipe has {now})")  # fmt: skip
    if t.role == "codes" and c.max_ulp == 1:
        how = "stochastically rounded by the recipe" if keyed else "rounded to nearest"
        return labelled(c, "sr-bits", (
            f"{c.elements - c.equal} codes one float4_e2m1fn code from the recipe's ({how}): "
            "other stochastic-rounding bits or another rounding direction"))  # fmt: skip
    return labelled(c, "unknown", f"the {st['op']} step's {t.name.rsplit('/', 1)[-1]} is not "
                    "what any mechanism reproduces")  # fmt: skip
