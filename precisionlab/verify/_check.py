"""Recompute every recorded tensor from its recorded inputs and name what went wrong.

Each stage is checked from the dump's own record of that stage's inputs, never from the
recomputed output of the stage before, so a difference shows where it arises and nowhere
after: the quantization of each GEMM operand from its recorded input (with the recorded
delayed-scaling scale and stochastic-rounding key) by the recipe's rule; each GEMM from the
recorded codes and scales by the model the manifest names; the delayed-scaling state from
the recorded state and the amaxes of the recorded inputs. A tensor matches when it is equal
bit for bit (any NaN equals any NaN). The first differing tensor in program order gets a
mechanism label (:data:`LABELS`), found by recomputing it the other ways the mechanisms
would have produced it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from precisionlab import hardware, recipes
from precisionlab.recipes import _scaling as S
from precisionlab.verify import _models as M
from precisionlab.verify._check_steps import check_steps
from precisionlab.verify._context import CheckContext
from precisionlab.verify._diagnose import (
    OUT_BITS,
    diagnose_codes,
    diagnose_output,
    diagnose_scale,
    exact_sums,
    labelled,
    plain_exact,
)
from precisionlab.verify._format import DumpError, Tensor, read_dump, to_storage
from precisionlab.verify._report import LABELS, Report, TensorCheck, compare
from precisionlab.verify._tape import element_format, expand, gemm_kinds

__all__ = ["LABELS", "Report", "TensorCheck", "check", "find_dumps"]


def _check(
    t: Tensor, rec: np.ndarray, ref: np.ndarray, dtype: str | None = None, **kw: Any
) -> TensorCheck:
    n, eq, ulp, _ = compare(rec, ref, dtype or t.dtype)
    status = "match" if eq == n else "differ"
    return TensorCheck(t.name, t.role, t.order, t.gemm, status, n, eq, ulp, **kw)


def _status(t: Tensor, status: str, detail: str = "") -> TensorCheck:
    n = int(np.prod(t.shape, dtype=np.int64))
    return TensorCheck(t.name, t.role, t.order, t.gemm, status, n, 0, 0, None, detail)


def _amax(x: np.ndarray) -> np.float32:
    """max |x| on the bits (NaN wins over inf), as the recipes observe it."""
    if x.size == 0:
        return np.float32(0)
    b = np.asarray(x, np.float32).view(np.uint32) & np.uint32(0x7FFFFFFF)
    return np.uint32(b.max()).view(np.float32)


def _recipe_from(step: dict[str, Any], where: Path) -> recipes.Recipe | None:
    spec = step.get("recipe")
    if spec is None:
        return None
    if not isinstance(spec, dict) or not isinstance(spec.get("fields"), dict):
        raise DumpError(f"{where}: step.recipe is not an object with 'class' and 'fields'")
    cls = getattr(recipes, str(spec.get("class")), None)
    if not (isinstance(cls, type) and issubclass(cls, recipes.Recipe)):
        raise DumpError(f"{where}: unknown recipe class {spec.get('class')!r}")
    try:
        return cls(**spec["fields"])
    except (TypeError, ValueError) as err:
        raise DumpError(f"{where}: the recipe does not rebuild: {err}") from None


def check(path: str | os.PathLike, *, diagnose: bool = True) -> Report:
    """Recompute the dump in ``path`` and report per tensor (see the module docstring).

    ``diagnose``: label the first difference (tries the other mechanisms; costs a few
    recomputations). A damaged or unreadable dump raises :class:`DumpError` (one line).
    """
    dump = read_dump(path)
    m = dump.manifest
    where = dump.path / "manifest.json"
    raw_step, raw_env = m.get("step"), m.get("environment")
    step: dict[str, Any] = raw_step if isinstance(raw_step, dict) else {}
    env: dict[str, Any] = raw_env if isinstance(raw_env, dict) else {}
    recipe = _recipe_from(step, where) if m["kind"] == "step" else None
    weight = step.get("weight", "rhs")
    if weight not in recipes.WEIGHT_OPERANDS:
        raise DumpError(f"{where}: step.weight {weight!r} is not one of rhs, lhs, none")
    hw = step.get("hardware")
    if hw is not None:
        try:
            hw = M.check_hardware(hw)
        except ValueError:
            raise DumpError(f"{where}: unknown hardware model {hw!r}") from None
    ctx = CheckContext(dump, recipe, weight, hw, [])
    if not diagnose:
        ctx.diagnosed = True
    gemms = _gemm_entries(m.get("gemms", []), where)
    by_gemm: dict[str, dict[str, Tensor]] = {}
    for t in dump.tensors:
        if t.gemm is not None:
            if t.gemm not in gemms:
                raise DumpError(f"{where}: tensor {t.name} names an unknown gemm {t.gemm!r}")
            key = t.name[len(t.gemm) + 1 :] if t.name.startswith(t.gemm + "/") else t.name
            by_gemm.setdefault(t.gemm, {})[key] = t
    _note_platform(ctx, env, recipe, m["kind"])
    _note_not_recorded(ctx, m.get("skipped_sites"))
    state_ts = [t for t in dump.tensors if t.role in ("state", "state_after")]
    if state_ts and not isinstance(recipe, recipes.Delayed):
        raise DumpError(f"{where}: state tensors without a delayed-scaling recipe")
    done: set[str] = set()
    for t in dump.tensors:
        if t.role == "state":
            _check_state(ctx, t)
        elif t.gemm is not None and t.gemm not in done:
            done.add(t.gemm)
            g = gemms[t.gemm]
            ts = by_gemm[t.gemm]
            if m["kind"] == "gemm":
                _check_capture(ctx, g, ts)
            elif g["model"] == "plain":
                _check_plain(ctx, g, ts)
            elif g["model"] == "steps":
                check_steps(ctx, g, ts, _check)
            else:
                _check_recipe_gemm(ctx, g, ts)
        elif t.role == "result":
            ctx.add(_status(t, "input", "the step's output (not recomputed)"))
    after = [t for t in dump.tensors if t.role == "state_after"]
    if after:
        _check_state_after(ctx, after, gemms, by_gemm, bool(step.get("skipped_update")))
    out = [ctx.results.get(t.name) or _status(t, "input") for t in dump.tensors]
    return Report(str(dump.path), m["kind"], env, step, tuple(out), tuple(ctx.notes))


def _note_platform(ctx: CheckContext, env: dict, recipe: recipes.Recipe | None, kind: str) -> None:
    here = jax.default_backend()
    there = env.get("backend")
    if kind == "step" and there and there != here:
        bound = []
        if recipe is not None and M.platform_bound("recipe", recipe):
            bound.append("the recipe's float32 GEMMs (XLA's summation order)")
        if ctx.hardware == "xla-cpu":
            bound.append("'xla-cpu' GEMMs")
        if bound:
            ctx.notes.append(
                f"recorded on {there}, checked on {here}: {' and '.join(bound)} are exact only "
                "on the recording platform; their differences are expected"
            )


def _note_not_recorded(ctx: CheckContext, skipped: Any) -> None:
    """Say which operations the dump has no records of (a convolution, a matmul inside a
    while_loop): nothing of theirs was checked."""
    if not isinstance(skipped, list) or not skipped:
        return
    items = [f"{s.get('site')} ({s.get('why')})" for s in skipped[:3] if isinstance(s, dict)]
    more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
    ctx.notes.append(f"not recorded, so not checked: {'; '.join(items)}{more}")


def _gemm_entries(raw: Any, where: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for i, g in enumerate(raw):
        if not isinstance(g, dict) or not isinstance(g.get("id"), str):
            raise DumpError(f"{where}: gemms[{i}] is not an object with an 'id'")
        model = g.get("model")
        if model not in ("recipe", "native", "hp", "plain", "hardware", "steps"):
            raise DumpError(f"{where}: gemms[{i}] has an unknown model {model!r}")
        if model == "steps" and not (
            isinstance(g.get("site"), str) and g.get("pass") in ("fprop", "backward")
        ):
            raise DumpError(f"{where}: gemms[{i}] (steps) has no site or an unknown pass "
                            f"{g.get('pass')!r}")  # fmt: skip
        if model in ("recipe", "native", "hp"):
            for f in ("m", "n"):
                if not isinstance(g.get(f), int):
                    raise DumpError(f"{where}: gemms[{i}] field {f!r} is not an integer")
            if not isinstance(g.get("site"), str):
                raise DumpError(f"{where}: gemms[{i}] has no site")
            if g.get("pass") not in ("fprop", "dgrad", "wgrad"):
                raise DumpError(f"{where}: gemms[{i}] has an unknown pass {g.get('pass')!r}")
        if model == "plain":
            dn = g.get("dimension_numbers")
            ok = (isinstance(dn, list) and len(dn) == 2
                  and all(isinstance(p, list) and len(p) == 2 for p in dn))  # fmt: skip
            if not ok:
                raise DumpError(f"{where}: gemms[{i}] has no valid dimension_numbers")
            prec = g.get("precision")
            names = {p.name for p in lax.Precision}
            if prec is not None and not (
                isinstance(prec, list) and all(p is None or str(p).split(".")[-1] in names
                                               for p in prec)
            ):  # fmt: skip
                raise DumpError(f"{where}: gemms[{i}] has an unknown precision {prec!r}")
            pet = g.get("preferred_element_type")
            if pet is not None and pet not in ("float32", "float16", "bfloat16", "float64"):
                raise DumpError(f"{where}: gemms[{i}] has an unknown output type {pet!r}")
        if g["id"] in out:
            raise DumpError(f"{where}: two gemms share the id {g['id']!r}")
        out[g["id"]] = g
    return out


def _need(ts: dict[str, Tensor], key: str, g: dict) -> Tensor:
    if key not in ts:
        raise DumpError(f"gemm {g['id']}: no {key} tensor")
    return ts[key]


# --- recipe GEMMs --------------------------------------------------------------------------
def _key(ctx: CheckContext, t: Tensor | None) -> Any:
    if t is None:
        return None
    data = jnp.asarray(ctx.arr(t), jnp.uint32)
    kind = ctx.dump.manifest.get("step", {}).get("key") or "raw"
    if isinstance(kind, str) and kind.startswith("typed:"):
        return jax.random.wrap_key_data(data, impl=kind.split(":", 1)[1])
    return data


_STATE_INDEX = {("fprop", "lhs"): 0, ("fprop", "rhs"): 1, ("dgrad", "lhs"): 2,
                ("dgrad", "rhs"): 1, ("wgrad", "lhs"): 2, ("wgrad", "rhs"): 0}  # fmt: skip


def _state_index(weight: str, what: str, side: str) -> int:
    """Which of the state's (lhs, rhs, output gradient) scales a GEMM operand uses."""
    return _STATE_INDEX[(what, side)]


def _check_recipe_gemm(ctx: CheckContext, g: dict, ts: dict[str, Tensor]) -> None:
    recipe = ctx.recipe
    if recipe is None:
        raise DumpError(f"gemm {g['id']}: a recipe GEMM in a dump without a recipe")
    kinds = gemm_kinds(ctx.weight, g["pass"])
    model = g["model"]
    operands = {}
    inputs = {}
    for side, kind in zip(("lhs", "rhs"), kinds, strict=True):
        t_in = _need(ts, f"{side}/input", g)
        if len(t_in.shape) != 3 or t_in.dtype != "float32":
            raise DumpError(f"gemm {g['id']}: {side}/input is not a float32 (B, R, K) array")
        x = np.asarray(ctx.arr(t_in), np.float32)
        inputs[side] = x
        ctx.add(_status(t_in, "input", "a stage input"))
        t_key = ts.get(f"{side}/key")
        if t_key is not None:
            ctx.add(_status(t_key, "input", "a stochastic-rounding key"))
        t_s = ts.get(f"{side}/given_scale")
        scale = None
        if t_s is not None and (t_s.shape != () or t_s.dtype != "float32"):
            raise DumpError(f"gemm {g['id']}: {side}/given_scale is not a float32 scalar")
        if t_s is not None:
            scale = np.asarray(ctx.arr(t_s), np.float32).reshape(())
            _check_given_scale(ctx, g, side, t_s, scale)
        if model == "hp":
            continue
        layout = _layout(recipe, kind)
        t_c = _need(ts, f"{side}/codes", g)
        if t_c.shape != t_in.shape:
            raise DumpError(f"gemm {g['id']}: {side}/codes {list(t_c.shape)} and its input "
                            f"{list(t_in.shape)} differ in shape")  # fmt: skip
        try:
            key = _key(ctx, t_key)
            ref = M.quantize(recipe, kind, layout, x, scale, key)
        except (TypeError, ValueError) as err:
            raise DumpError(f"gemm {g['id']}: {side} does not recompute from the dump: "
                            f"{str(err).splitlines()[0]}") from None  # fmt: skip
        for role in ("row_scale", "block_scale", "block_exp"):
            t = ts.get(f"{side}/{role}")
            if role in ref and t is None:
                raise DumpError(f"gemm {g['id']}: {side} has no {role}, which the recipe's "
                                "operands have")  # fmt: skip
            if t is None:
                continue
            if role not in ref:
                ctx.add(_status(t, "not checked", f"the {recipe.name} recipe has no {role}"))
                continue
            c = _check(t, ctx.arr(t), ref[role])
            if c.status == "differ":
                c = diagnose_scale(ctx, c, t, role, ref[role], recipe, kind, layout, x, scale,
                                    key)  # fmt: skip
            ctx.add(c)
        want = element_format(recipe, kind)
        codes = ctx.arr(t_c)
        if t_c.dtype != want:
            c = _check(t_c, np.asarray(codes, np.float32), ref["codes"], "float32")
            c = dataclasses.replace(c, status="differ", label="wrong-dtype", detail=(
                f"recorded as {t_c.dtype}; the {recipe.name} recipe's {kind} elements are "
                f"{want}"))  # fmt: skip
            ctx.full()
        else:
            refc = to_storage(ref["codes"], want)
            refc = refc.view(codes.dtype) if want != "float32" else ref["codes"]
            c = _check(t_c, codes, refc)
            if c.status == "differ":
                c = diagnose_codes(ctx, c, codes, refc, want, t_key is not None)
        ctx.add(c)
        operands[side] = _operand(ctx, ts, side, codes, recipe, kind)
    t_out = _need(ts, "out", g)
    rec_out = np.asarray(ctx.arr(t_out), np.float32)
    m, n = g["m"], g["n"]
    compute: Callable[[Any], np.ndarray | None]  # the output under another accumulator
    try:
        if model == "hp":
            ref_out = M.hp_gemm(inputs["lhs"], inputs["rhs"])
            compute = lambda alt: None  # noqa: E731
        elif model == "native":
            hw = g.get("hardware") or ctx.hardware
            if hw is None:
                raise M.NotModelled("no hardware model is named for the native GEMMs")
            a = _typed(ts["lhs/codes"], ctx)
            b = _typed(ts["rhs/codes"], ctx)
            factor = operands["lhs"].output_factor(operands["rhs"])
            ref_out = M.native_gemm(a, b, factor, hw)[:, :m, :n]
            compute = lambda alt: M.native_gemm(a, b, factor, alt)[:, :m, :n]  # noqa: E731
        else:
            qa, qb = operands["lhs"], operands["rhs"]
            ref_out = M.recipe_gemm(recipe, kinds, m, n, qa, qb)
            compute = lambda alt: M.recipe_gemm(alt, kinds, m, n, qa, qb)  # noqa: E731
    except M.NotModelled as why:
        ctx.add(_status(t_out, "not checked", str(why)))
        return
    except (TypeError, ValueError) as err:
        raise DumpError(f"gemm {g['id']}: its output does not recompute from the recorded "
                        f"operands: {str(err).splitlines()[0]}") from None  # fmt: skip
    c = _check(t_out, rec_out, ref_out)
    if c.status == "differ":
        if model == "recipe":
            alts = [(name, partial(compute, r)) for name, r in M.recipe_candidates(recipe)]
        elif model == "native":
            current = g.get("hardware") or ctx.hardware
            alts = [(h, partial(compute, h)) for h in M.hardware_candidates(current)]
        else:
            alts = []
        bf16 = []
        if model != "hp":
            bf16 = [(name, partial(M.bf16_gemm, inputs["lhs"], inputs["rhs"], name))
                    for name in M.sixteen_bit_candidates()]  # fmt: skip
        reorder = None
        if model == "hp" or (model == "recipe" and M.platform_bound("recipe", recipe)):
            reorder = partial(exact_sums, operands, inputs, model == "hp", m, n)
        c = diagnose_output(ctx, c, rec_out, ref_out, alts, bf16, reorder)
    ctx.add(c)


def _layout(recipe: recipes.Recipe, kind: str) -> tuple[int, bool] | None:
    sizes = recipe.block_sizes(kind)
    return None if not sizes else (int(sizes[0]), bool(recipe.two_d(kind)))


def _typed(t: Tensor, ctx: CheckContext) -> jax.Array:
    a = ctx.arr(t)
    return jnp.asarray(a) if t.dtype != "float32" else jnp.asarray(a, jnp.float32)


def _operand(
    ctx: CheckContext,
    ts: dict[str, Tensor],
    side: str,
    codes: np.ndarray,
    recipe: recipes.Recipe,
    kind: str,
) -> S.QOperand:
    """The recorded operand as the GEMM takes it (elements and factors as recorded)."""
    layout = _layout(recipe, kind)
    elems = jnp.asarray(np.asarray(codes).astype(np.float32))
    t_row, t_blk, t_exp = (ts.get(f"{side}/{r}") for r in ("row_scale", "block_scale", "block_exp"))
    row = None if t_row is None else jnp.asarray(ctx.arr(t_row))
    blk = None
    if t_blk is not None:
        blk = jnp.asarray(expand(np.asarray(ctx.arr(t_blk)), layout))
    exp = None
    if t_exp is not None:
        exp = jnp.asarray(expand(np.asarray(ctx.arr(t_exp)), layout))
    for name, v in (("block_scale", blk), ("block_exp", exp)):
        if v is not None and v.shape != elems.shape:
            raise DumpError(f"{side}/{name} expands to {v.shape}, its codes are {elems.shape}")
    return S.QOperand(elems, row, blk, exp)


# --- delayed scaling's state -------------------------------------------------------------
def _delayed(ctx: CheckContext) -> recipes.Delayed:
    assert isinstance(ctx.recipe, recipes.Delayed)  # check() refuses state without one
    return ctx.recipe


def _kind_max(recipe: recipes.Delayed, weight: str) -> np.ndarray:
    kinds = (*recipes.WEIGHT_OPERANDS[weight], "g")
    return np.asarray([recipe.fmt(k).max for k in kinds], np.float32)


def _state_arrays(ctx: CheckContext, role: str, site: str) -> tuple[np.ndarray, np.ndarray] | None:
    s = ctx.dump.get(f"{role}/{site}/scale")
    h = ctx.dump.get(f"{role}/{site}/history")
    if s is None or h is None:
        return None
    return np.asarray(s, np.float32), np.asarray(h, np.float32)


def _next_scale(
    recipe: recipes.Delayed, hist: np.ndarray, scale: np.ndarray, weight: str
) -> np.ndarray:
    return np.asarray(recipe.next_scale(jnp.asarray(hist), jnp.asarray(scale),
                                        jnp.asarray(_kind_max(recipe, weight))))  # fmt: skip


def _older(hist: np.ndarray) -> np.ndarray:
    """The history one step earlier, as far as it is known (its oldest row lost)."""
    return np.concatenate([hist[1:], np.zeros_like(hist[:1])])


def _check_state(ctx: CheckContext, t: Tensor) -> None:
    if not t.name.endswith("/scale"):
        ctx.add(_status(t, "input", "the amax history the step starts from"))
        return
    got = _state_arrays(ctx, "state", t.site or "")
    if got is None:
        raise DumpError(f"{t.name}: its history is missing")
    scale, hist = got
    expect = _next_scale(_delayed(ctx), hist, scale, ctx.weight)
    c = _check(t, scale, expect)
    if c.status == "differ":
        ctx.full()
        stale = _next_scale(_delayed(ctx), _older(hist), scale, ctx.weight)
        if compare(scale, stale, "float32")[1] == c.elements:
            c = labelled(c, "stale-amax", "the scale is the one of the history before its "
                          "newest amax (one step old)")  # fmt: skip
        else:
            c = labelled(c, "unknown", "the scale is not the recipe's rule of its history")
    ctx.add(c)


def _check_given_scale(ctx: CheckContext, g: dict, side: str, t: Tensor, scale: Any) -> None:
    recipe = ctx.recipe
    got = _state_arrays(ctx, "state", g["site"])
    if got is None or not isinstance(recipe, recipes.Delayed):
        ctx.add(_status(t, "not checked", "no recorded state to compare the scale with"))
        return
    st_scale, hist = got
    i = _state_index(ctx.weight, g["pass"], side)
    c = _check(t, scale, st_scale[i])
    if c.status == "differ":
        ctx.full()
        stale = _next_scale(recipe, _older(hist), st_scale, ctx.weight)[i]
        if compare(scale, stale, "float32")[1] == 1:
            c = labelled(c, "stale-amax", "the quantizer used the scale of the history "
                          "before its newest amax (one step old), not the state's")  # fmt: skip
        else:
            c = labelled(c, "unknown", "the quantizer used another scale than the state's")
    ctx.add(c)


def _observed(
    ctx: CheckContext, site: str, gemms: dict[str, dict], by_gemm: dict[str, dict[str, Tensor]]
) -> np.ndarray | None:
    """The amaxes (lhs, rhs, output gradient) of a site's recorded inputs, max over its
    iterations; None if a pass is missing."""
    found: dict[int, list[np.float32]] = {0: [], 1: [], 2: []}
    for gid, g in gemms.items():
        if g.get("site") != site:
            continue
        ts = by_gemm.get(gid, {})
        if g.get("pass") == "fprop":
            found[0].append(_amax(ctx.arr(ts["lhs/input"])))
            found[1].append(_amax(ctx.arr(ts["rhs/input"])))
        elif g.get("pass") == "dgrad":
            found[2].append(_amax(ctx.arr(ts["lhs/input"])))
    if not all(found.values()):
        return None
    out = []
    for i in range(3):
        bits = np.asarray(found[i], np.float32).view(np.uint32)
        out.append(np.uint32(bits.max()).view(np.float32))
    return np.asarray(out, np.float32)


def _check_state_after(
    ctx: CheckContext,
    after: list[Tensor],
    gemms: dict[str, dict],
    by_gemm: dict[str, dict[str, Tensor]],
    skipped: bool,
) -> None:
    recipe = _delayed(ctx)
    for t in after:
        site = t.site or ""
        before = _state_arrays(ctx, "state", site)
        now = _state_arrays(ctx, "state_after", site)
        if before is None or now is None:
            raise DumpError(f"{t.name}: the state before or after is incomplete")
        scale0, hist0 = before
        obs = _observed(ctx, site, gemms, by_gemm)
        if obs is None and not skipped:
            ctx.add(_status(t, "not checked", "the site's GEMMs are not all recorded"))
            continue
        if skipped:
            exp_scale, exp_hist = scale0, hist0
        else:
            st = {"scale": jnp.asarray(scale0), "history": jnp.asarray(hist0),
                  "probe": jnp.zeros((3,), jnp.float32)}  # fmt: skip
            new = jax.device_get(recipes.update_site_state(recipe, st, jnp.asarray(obs),
                                                           ctx.weight))  # fmt: skip
            exp_scale, exp_hist = np.asarray(new["scale"]), np.asarray(new["history"])
        part = t.name.rsplit("/", 1)[-1]
        rec = ctx.arr(t)
        c = _check(t, rec, exp_scale if part == "scale" else exp_hist)
        if c.status == "differ":
            c = _diagnose_state_after(ctx, c, part, rec, scale0, hist0)
        ctx.add(c)


def _diagnose_state_after(
    ctx: CheckContext,
    c: TensorCheck,
    part: str,
    rec: np.ndarray,
    scale0: np.ndarray,
    hist0: np.ndarray,
) -> TensorCheck:
    ctx.full()
    rec = np.asarray(rec, np.float32)
    if part == "history":
        if rec.shape == hist0.shape and compare(rec, hist0, "float32")[1] == rec.size:
            return labelled(c, "stale-amax", "the history was not rolled: it lacks this "
                             "step's amax")  # fmt: skip
        if (
            rec.shape == hist0.shape
            and len(hist0) > 1
            and compare(rec[0], hist0[0], "float32")[1] == rec.shape[1]
        ):
            return labelled(c, "stale-amax", "the newest history row holds the previous "
                             "step's amax, not this step's")  # fmt: skip
        return labelled(c, "unknown", "the history is not this step's amaxes rolled in")
    stale = _next_scale(_delayed(ctx), hist0, scale0, ctx.weight)
    if compare(rec, stale, "float32")[1] == rec.size:
        return labelled(c, "stale-amax", "the new scale is computed from the history before "
                         "this step's amax")  # fmt: skip
    return labelled(c, "unknown", "the new scale is not the recipe's rule of the new history")


# --- plain GEMMs and captures ------------------------------------------------------------
def _check_plain(ctx: CheckContext, g: dict, ts: dict[str, Tensor]) -> None:
    t_l, t_r, t_o = _need(ts, "lhs", g), _need(ts, "rhs", g), _need(ts, "out", g)
    for t in (t_l, t_r):
        ctx.add(_status(t, "input", "a GEMM operand"))
    hw = g.get("hardware") or ctx.hardware
    if hw is None:
        ctx.add(_status(t_o, "not checked", "no GEMM model is named for this device"))
        return
    lhs, rhs, rec = ctx.arr(t_l), ctx.arr(t_r), ctx.arr(t_o)
    try:
        ref = M.plain_gemm(jnp.asarray(lhs), jnp.asarray(rhs), g, hw)
    except M.NotModelled as why:
        ctx.add(_status(t_o, "not checked", str(why)))
        return
    c = _check(t_o, rec, ref)
    if c.status == "differ":
        la, ra = jnp.asarray(lhs), jnp.asarray(rhs)
        alts = [(h, partial(M.plain_gemm, la, ra, g, h)) for h in M.hardware_candidates(hw)]
        reorder = partial(plain_exact, lhs, rhs, g) if hw == "xla-cpu" else None
        c = diagnose_output(ctx, c, np.asarray(rec).astype(np.float32),
                             np.asarray(ref).astype(np.float32), alts, [], reorder,
                             OUT_BITS.get(t_o.dtype, 24))  # fmt: skip
    ctx.add(c)


def _check_capture(ctx: CheckContext, g: dict, ts: dict[str, Tensor]) -> None:
    t_a, t_b, t_o = _need(ts, "a", g), _need(ts, "b", g), _need(ts, "out", g)
    for t in (t_a, t_b):
        ctx.add(_status(t, "input", "a GEMM operand"))
    hw = g.get("hardware")
    try:
        kw = hardware.preset(hw)
    except (ValueError, TypeError):
        raise DumpError(f"gemm {g['id']}: unknown hardware preset {hw!r}") from None
    overrides = g.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise DumpError(f"gemm {g['id']}: overrides is not an object")
    a, b, rec = ctx.arr(t_a), ctx.arr(t_b), ctx.arr(t_o)
    out_dtype = t_o.dtype

    def run(preset_kw: dict[str, Any], ov: dict[str, Any]) -> np.ndarray:
        ov = {k: tuple(v) if isinstance(v, list) else v for k, v in ov.items()}
        return np.asarray(hardware.gemm(
            jnp.asarray(a), jnp.asarray(b), out_dtype=jnp.dtype(getattr(ml_dtypes, out_dtype,
                                                                        out_dtype)),
            scale_a=g.get("scale_a"), scale_b=g.get("scale_b"), **preset_kw, **ov,
        ))  # fmt: skip

    try:
        ref = run(kw, overrides)
    except (ValueError, TypeError) as err:
        raise DumpError(f"gemm {g['id']}: the model does not take it: {err}") from None
    c = _check(t_o, rec, ref)
    if c.status == "differ":
        alts = [(h, partial(run, hardware.preset(h), {})) for h in hardware.PRESETS if h != hw]
        c = diagnose_output(ctx, c, np.asarray(rec).astype(np.float32),
                             np.asarray(ref).astype(np.float32), alts, [])  # fmt: skip
    ctx.add(c)


# --- finding dumps -------------------------------------------------------------------------
def find_dumps(path: str | os.PathLike, *, max_depth: int = 6, limit: int = 10_000) -> list[Path]:
    """The dump directories at or below ``path`` (those holding a manifest.json), in sorted
    order; links are not followed. ``path`` itself if it is a dump."""
    root = Path(path)
    if (root / "manifest.json").exists():
        return [root]
    if not root.is_dir():
        raise DumpError(f"{root}: not a directory")
    found: list[Path] = []
    stack = [(root, 0)]
    while stack:
        d, depth = stack.pop()
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            continue
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                if os.path.lexists(os.path.join(e.path, "manifest.json")):
                    found.append(Path(e.path))
                elif depth + 1 < max_depth:
                    stack.append((Path(e.path), depth + 1))
        if len(found) > limit:
            raise DumpError(f"{root}: more than {limit} dumps below it; name one")
    return sorted(found)
