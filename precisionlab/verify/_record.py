"""Record one step of any JAX function: every GEMM's quantize inputs, scales, codes, keys,
operands and output, the recipe's state before and after, and the step's outputs.

Two modes:

- with a recipe: every matched ``dot_general`` runs the recipe's own GEMM steps
  (:func:`precisionlab.recipes.fprop_gemm` and :func:`~precisionlab.recipes.vjp_gemms`, the
  functions :func:`precisionlab.recipes.dot_general` runs), and every convolution the same
  steps on the GEMM over its patches (as :func:`precisionlab.recipes.conv_general_dilated`;
  an FP4 recipe's convolution is not recorded), with a ``tap`` that collects what each GEMM
  computed, passed out of the program as :mod:`precisionlab.verify._tape` says
  (inside a ``scan``: one record per iteration);
- without one (plain dtypes, a policy): the function and its gradient are traced together
  and every ``dot_general`` of both (forward and backward) records its operands and output
  (a convolution runs as written, not recorded).

What is not recorded is named in the dump (``skipped_sites``) and warned about.

Everything runs in one ``jit`` program on the default backend; the host receives the
arrays once, at the end.
"""

from __future__ import annotations

import dataclasses
import platform
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jaxlib
import ml_dtypes
import numpy as np

from precisionlab import __version__, recipes
from precisionlab.intercept import (
    Intercepted,
    PerIteration,
    Site,
    SkippedOperationWarning,
    intercept,
    select,
)
from precisionlab.verify._format import DumpWriter, storage_dtype
from precisionlab.verify._models import check_hardware
from precisionlab.verify._steps import StepsRule, step_pass
from precisionlab.verify._tape import (
    PlainRule,
    RecipeRule,
    block_layout,
    element_format,
    from_halves,
    gemm_kinds,
    key_data,
    native_gemm,
    pinned_gemm,
)

__all__ = ["DEFAULT_MAX_BYTES", "GEMM_MODES", "Recording", "estimate", "record"]

#: The largest dump :func:`record` writes unless told otherwise (the estimate is checked
#: before anything runs).
DEFAULT_MAX_BYTES = 2 << 30
#: How a recipe's GEMMs are computed while recording: ``"recipe"`` (the recipe's own
#: GEMM: float32 products, its accumulator or hardware model) or ``"native"`` (the
#: backend's own low-precision ``dot_general`` on the element dtype: a GPU's FP8 tensor
#: cores; per-tensor and per-row scaled recipes only).
GEMM_MODES = ("recipe", "native")


class Recording(NamedTuple):
    """What :func:`record` wrote and computed: ``path`` (the dump directory), ``bytes`` (of
    its arrays), ``tensors`` (how many), ``value`` (the function's output; with ``grad``,
    ``(value, grads)`` as ``jax.value_and_grad`` returns), ``state_after`` (the recipe's
    state after the step: delayed scaling; else None)."""

    path: Path
    bytes: int
    tensors: int
    value: Any
    state_after: Any


# --- the environment and the recipe as data ------------------------------------------
def environment() -> dict[str, Any]:
    """Where the step ran: backend, device kind, platform version, library versions."""
    dev = jax.devices()[0]
    try:
        pv = jax.extend.backend.get_backend().platform_version
    except Exception:  # an old jax without jax.extend.backend: only the version is lost
        pv = ""
    return {
        "backend": jax.default_backend(),
        "device_kind": str(dev.device_kind),
        "device_count": jax.device_count(),
        "platform_version": str(pv),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "precisionlab": __version__,
        "numpy": np.__version__,
        "ml_dtypes": ml_dtypes.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def default_hardware() -> str | None:
    """The GEMM model a native dot_general on this backend is checked against: ``"xla-cpu"``
    on a CPU, ``"h100-xla"`` on an H100 (or H200), else None (no model)."""
    kind = str(jax.devices()[0].device_kind).lower()
    if jax.default_backend() == "cpu":
        return "xla-cpu"
    if "h100" in kind or "h200" in kind:
        return "h100-xla"
    return None


def recipe_json(recipe: recipes.Recipe) -> dict[str, Any]:
    """A recipe as data: its class and fields (the check rebuilds it from them)."""
    fields = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe)}
    return {"class": type(recipe).__name__, "name": recipe.name, "fields": fields}


# --- record ------------------------------------------------------------------------------
def _iterations(site: Site) -> list[tuple[int, ...]]:
    lengths = _known_lengths(site)
    assert lengths is not None  # recorded sites are in no while loop (_plan leaves them out)
    return list(np.ndindex(*lengths)) if lengths else [()]


def _known_lengths(site: Site) -> tuple[int, ...] | None:
    """The iteration counts of the site's loops; None inside a while loop (unknown)."""
    if any(n is None for n in site.lengths):
        return None
    return tuple(n for n in site.lengths if n is not None)


def _suffix(it: tuple[int, ...]) -> str:
    return "" if not it else "@" + ".".join(map(str, it))


def _index(tree: Any, it: tuple[int, ...]) -> Any:
    return jax.tree.map(lambda a: a[it] if it else a, tree)


@dataclasses.dataclass
class _Plan:
    """What a recording run needs, found by tracing once (nothing computed)."""

    sites: list[Site]
    recorded: list[Site]
    skipped: list[dict[str, str]]
    states: dict[str, Any]  # state entries with zero tapes (recipe mode)
    aux_shapes: Any
    tape_shapes: dict[str, Any]
    value_shapes: Any
    rule: Any


def _check_args(
    recipe: recipes.Recipe | None, gemm: str, weight: str, grad: bool, has_aux: bool
) -> None:
    if gemm not in GEMM_MODES:
        raise ValueError(f"unknown gemm {gemm!r}; allowed: {', '.join(GEMM_MODES)}")
    if weight not in recipes.WEIGHT_OPERANDS:
        raise ValueError(
            f"unknown weight {weight!r}; allowed: {', '.join(recipes.WEIGHT_OPERANDS)}"
        )
    if gemm == "native" and recipe is None:
        raise ValueError("gemm='native' applies to a recipe's GEMMs (plain ones are native)")
    if has_aux and not grad:
        raise ValueError("has_aux applies with grad=True (the value is the output as it is)")


def _grad_fn(fn: Callable, grad: bool, argnums: int | Sequence[int], has_aux: bool) -> Callable:
    return jax.value_and_grad(fn, argnums=argnums, has_aux=has_aux) if grad else fn


def _loop_stack(x: Any, lengths: tuple[int, ...]) -> Any:
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (*lengths, *jnp.shape(a))), x)


def _plan(
    fn: Callable,
    args: tuple,
    *,
    recipe: recipes.Recipe | None,
    state: Any,
    key: jax.Array | None,
    grad: bool,
    argnums: int | Sequence[int],
    has_aux: bool,
    include: Any,
    exclude: Any,
    weight: str,
    sites: Any,
    gemm_fn: Callable,
    default: Callable | None,
) -> _Plan:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    del nums  # the plain mode differentiates fn itself
    if recipe is None:
        g = _grad_fn(fn, grad, argnums, has_aux)
        probe = intercept(g, PlainRule(frozenset()), include=include, exclude=exclude)
        found = probe.sites(*args)
        # a while loop's sites have no per-iteration records: skipped, as in the recipe mode
        chosen = [s for s in _chosen(found, sites) if all(n is not None for n in s.lengths)]
        plain = PlainRule(frozenset(s.name for s in chosen))
        inter = intercept(g, plain, include=include, exclude=exclude)
        value_shapes, aux_shapes = jax.eval_shape(lambda *a: inter.call_with_aux(None, *a), *args)
        skipped = [{"site": s.name, "why": "inside a while_loop"} for s in found
                   if s.selected and any(n is None for n in s.lengths)]  # fmt: skip
        skipped += _not_recorded(probe, args)
        return _Plan(found, chosen, skipped, {}, aux_shapes, {}, value_shapes, plain)
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    Rule = StepsRule if isinstance(recipe, recipes.FP4Recipe) else RecipeRule
    # names per primitive, as recipes.apply gives them (a delayed state is keyed by them)
    probe = intercept(fn, Rule(recipe, weight, frozenset(), gemm_fn), include=include,
                      exclude=exclude, default=default, numbering="primitive")  # fmt: skip
    found = probe.sites(*args)
    chosen = [s for s in _chosen(found, sites) if all(n is not None for n in s.lengths)]
    skipped = [{"site": s.name, "why": "inside a while_loop (no per-iteration records)"}
               for s in found if s.selected and any(n is None for n in s.lengths)]  # fmt: skip
    skipped += _not_recorded(probe, args)
    if recipe.stateful:
        missing = [s.name for s in found if s.selected and s.name not in (state or {})]
        if missing:
            raise ValueError(
                f"the {recipe.name} recipe is stateful: state has no entry for {missing}; "
                "pass state=recipes.apply(fn, recipe).init_state(*args)"
            )
    entries = _entries(found, chosen, recipe, state, tapes=None)
    shapes: dict[str, Any] = {}
    rule = Rule(recipe, weight, frozenset(s.name for s in chosen), gemm_fn, shapes)
    inter = intercept(fn, rule, include=include, exclude=exclude, default=default,
                      numbering="primitive")  # fmt: skip
    out_shapes, aux_shapes = jax.eval_shape(
        lambda st, *a: inter.call_with_aux(st, *a, key=key), entries, *args
    )
    value_shapes = out_shapes
    if grad:
        value_shapes = (out_shapes, jax.eval_shape(lambda *a: [a[n] for n in nums], *args))
    rule.shapes = None
    tapes = {s.name: shapes[s.name] for s in chosen}
    states = _entries(found, chosen, recipe, state, tapes=tapes)
    return _Plan(found, chosen, skipped, states, aux_shapes, tapes, value_shapes, rule)


def _not_recorded(probe: Intercepted, args: tuple) -> list[dict[str, str]]:
    """The products the recorder has no records for (a convolution, a grouped matmul): they
    run as the program has them, not through the recipe (warned about once by the probe)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedOperationWarning)  # the probe warned already
        skipped = probe.skipped(*args)
    return [{"site": s.name, "why": f"{s.skipped}: run as written, not recorded"} for s in skipped]


def _chosen(found: list[Site], sites: Any) -> list[Site]:
    selected = [s for s in found if s.selected]
    if sites is None:
        return selected
    items = (sites,) if isinstance(sites, (str, int)) else tuple(sites)
    marked = select(found, items, ())
    names = {s.name for s in marked if s.selected}
    return [s for s in selected if s.name in names]


def _entries(
    found: list[Site],
    chosen: list[Site],
    recipe: recipes.Recipe,
    state: Any,
    tapes: dict[str, Any] | None,
) -> dict[str, Any]:
    """The per-site state: ``{"recipe": its recipe state, "tape": zeros}`` (PerIteration,
    stacked, inside loops)."""
    rec_names = {s.name for s in chosen}
    out: dict[str, Any] = {}
    for s in found:
        if not s.selected:
            continue
        rs = (state or {}).get(s.name) if recipe.stateful else None
        known = _known_lengths(s)
        tape = None
        if tapes is not None and s.name in rec_names:
            one = jax.tree.map(lambda sd: jnp.zeros((2, *sd.shape), jnp.float32), tapes[s.name])
            tape = _loop_stack(one, known) if known else one  # (recorded: lengths known)
        if known:
            out[s.name] = PerIteration({"recipe": _loop_stack(rs, known), "tape": tape})
        else:
            out[s.name] = {"recipe": rs, "tape": tape}
    return out


def _runner(
    inter: Intercepted,
    grad: bool,
    nums: tuple[int, ...],
    single: bool,
    has_aux: bool,
    key: jax.Array | None,
) -> Callable[..., tuple[Any, Any, Any]]:
    """``run(states, *args) -> (value, aux, state grads or None)``: the function under the
    rule, differentiated w.r.t. the states (the tapes) and the ``nums`` arguments when
    ``grad``; ``value`` as ``jax.value_and_grad`` returns it (or the output)."""
    if not grad:

        def plain(states: Any, *args: Any) -> tuple[Any, Any, None]:
            out, aux = inter.call_with_aux(states, *args, key=key)
            return out, aux, None

        return plain

    def call(states: Any, *args: Any) -> tuple[Any, tuple[Any, Any]]:
        out, aux = inter.call_with_aux(states, *args, key=key)
        loss = out[0] if has_aux else out
        return loss, (out, aux)

    vg = jax.value_and_grad(call, argnums=(0, *(n + 1 for n in nums)), has_aux=True)

    def run(states: Any, *args: Any) -> tuple[Any, Any, Any]:
        (_, (out, aux)), grads = vg(states, *args)
        g = grads[1] if single else tuple(grads[1:])
        return (out, g), aux, grads[0]

    return run


def estimate(fn: Callable, *args: Any, **options: Any) -> int:
    """The bytes of arrays :func:`record` would write for ``fn(*args)`` with these options
    (traced, nothing computed; an upper bound only where a ``cond`` branch does not run)."""
    opts = _plan_options(**options)
    return _estimate(_plan(fn, args, **opts), opts, options.get("results", True))


def _nbytes(shape: Sequence[int], itemsize: int) -> int:
    return int(np.prod(shape, dtype=np.int64)) * itemsize


def _record_bytes(key: str, sd: Any, rec: recipes.Recipe, weight: str, what: str | None) -> int:
    """Stored bytes of one record entry (``[what/]side/role`` or ``out``): element codes
    take their format's width, everything else its own dtype."""
    parts = key.split("/")
    if what is None and parts[0] in ("fprop", "dgrad", "wgrad"):
        what, parts = parts[0], parts[1:]
    if parts[-1] == "codes":
        kind = gemm_kinds(weight, what or "fprop")[0 if parts[0] == "lhs" else 1]
        size = storage_dtype(element_format(rec, kind)).itemsize
    elif parts[-1] == "input" or parts[-1] == "out":
        size = 4
    else:
        size = jnp.dtype(sd.dtype).itemsize
    return _nbytes(sd.shape, size)


def _estimate(plan: _Plan, opts: dict[str, Any], results: bool) -> int:
    rec, weight = opts["recipe"], opts["weight"]
    total = 0
    if isinstance(rec, recipes.FP4Recipe):  # steps: each array at most its own width
        rec = None
    for aux in plan.aux_shapes.values():
        for key, sd in aux.value.items():
            if rec is None:
                total += _nbytes(sd.shape, jnp.dtype(sd.dtype).itemsize)
            else:
                total += _record_bytes(key, sd, rec, weight, "fprop")
    for s in plan.recorded if opts["grad"] else ():  # the backward records
        known = _known_lengths(s)
        assert known is not None  # recorded sites are in no while loop (_plan leaves them out)
        reps = int(np.prod(known, dtype=np.int64)) if known else 1
        for key, sd in plan.tape_shapes.get(s.name, {}).items():
            if rec is None:
                total += reps * _nbytes(sd.shape, jnp.dtype(sd.dtype).itemsize)
            else:
                total += reps * _record_bytes(key, sd, rec, weight, None)
    if isinstance(rec, recipes.Delayed):
        hist = rec.amax_history_len  # scale (3,) and history (L, 3), before and after
        per_site = (3 + 3 * hist) * 4 * (2 if opts["grad"] else 1)
        total += per_site * sum(1 for s in plan.sites if s.selected)
    if results:
        for leaf in jax.tree.leaves(plan.value_shapes):
            dt = jnp.dtype(leaf.dtype)
            try:
                storage_dtype(dt.name)
            except ValueError:
                continue
            total += _nbytes(leaf.shape, dt.itemsize)
    return int(total)


def _weight_products(site: Site) -> bool:
    return not site.activations_only


def _plan_options(
    *,
    recipe: Any = None,
    state: Any = None,
    key: jax.Array | None = None,
    grad: bool = True,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    include: Any = None,
    exclude: Any = (),
    weight: str = "rhs",
    sites: Any = None,
    gemm: str = "recipe",
    attention: bool = True,
    **_ignored: Any,
) -> dict[str, Any]:
    rec = None if recipe is None else recipes.get_recipe(recipe)
    if isinstance(rec, recipes.FP4Recipe) and gemm != "recipe":
        raise ValueError(
            f"gemm={gemm!r}: the {rec.name} recipe computes its GEMMs itself (rotated, "
            "re-quantized operands); record it with gemm='recipe'"
        )
    if (
        isinstance(recipe, str)
        and rec is not None
        and "pad" in {f.name for f in dataclasses.fields(rec)}
    ):
        # as recipes.apply takes a name; the recipe's class has a pad field (checked above),
        # which the base Recipe that mypy sees here has not
        rec = dataclasses.replace(rec, pad=True)  # type: ignore[call-arg]
    _check_args(rec, gemm, weight, grad, has_aux)
    if not isinstance(attention, bool):
        raise ValueError(f"attention must be True or False, got {attention!r}")
    return dict(recipe=rec, state=state, key=key, grad=grad, argnums=argnums, has_aux=has_aux,
                include=include, exclude=exclude, weight=weight, sites=sites,
                gemm_fn=native_gemm if gemm == "native" else pinned_gemm,
                default=None if attention else _weight_products)  # fmt: skip


def record(
    fn: Callable,
    *args: Any,
    out: str | Path,
    recipe: recipes.Recipe | str | None = None,
    state: dict | None = None,
    key: jax.Array | None = None,
    grad: bool = True,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    include: Sequence[int | str] | int | str | None = None,
    exclude: Sequence[int | str] | int | str = (),
    weight: str = "rhs",
    sites: Sequence[int | str] | int | str | None = None,
    attention: bool = True,
    gemm: str = "recipe",
    hardware: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    results: bool = True,
    note: str | None = None,
) -> Recording:
    """Run one step of ``fn(*args)`` and write everything its GEMMs computed to ``out``.

    Args:
      fn: any JAX function: with ``grad`` (default) a loss (a scalar, or ``(loss, aux)``
        with ``has_aux``), differentiated w.r.t. ``argnums`` like ``jax.value_and_grad``.
      out: the dump directory (new or empty).
      recipe: a :class:`~precisionlab.recipes.Recipe` or name: every matched ``dot_general``
        and convolution runs through it (as :func:`precisionlab.recipes.apply`, with ``include``,
        ``exclude``, ``weight``, ``state`` for delayed scaling and ``key`` for stochastic
        rounding). None: the function as it is (plain low-precision dtypes, a policy's
        casts), every ``dot_general`` of it and of its gradient recorded.
      sites: which of the replaced matmuls to record (positions, names or patterns as in
        ``include``; default all): a bound on the dump's size.
      attention: with a recipe and no ``include``, replace the products of two activations
        (attention's ``QK^T`` and ``PV``) too (default); False: leave them as they are, as
        :func:`precisionlab.recipes.apply` does by default (the training hook passes the
        run's choice).
      gemm: ``"recipe"`` or ``"native"`` (:data:`GEMM_MODES`).
      hardware: the GEMM model the dump names for GEMMs the backend computed itself (plain
        sites; ``gemm="native"``): a preset of :data:`precisionlab.hardware.PRESETS` or
        ``"xla-cpu"``; default: by the device (``"xla-cpu"`` on a CPU, ``"h100-xla"`` on
        an H100).
      max_bytes: refuse (ValueError, before anything runs) a dump estimated larger.
      results: also write the step's outputs (the value and the gradients).
      note: free text kept in the manifest.

    Returns:
      A :class:`Recording`; ``value`` is what ``jax.value_and_grad(fn)`` (or ``fn``)
      returned.
    """
    opts = _plan_options(recipe=recipe, state=state, key=key, grad=grad, argnums=argnums,
                         has_aux=has_aux, include=include, exclude=exclude, weight=weight,
                         sites=sites, gemm=gemm, attention=attention)  # fmt: skip
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")

    hw = default_hardware() if hardware is None else check_hardware(hardware)
    plan = _plan(fn, args, **opts)
    size = _estimate(plan, opts, results)
    if size > max_bytes:
        raise ValueError(
            f"the dump would hold about {size} bytes ({size / 2**20:.1f} MiB), more than "
            f"max_bytes={max_bytes}; record fewer sites (sites=...), or raise max_bytes"
        )
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not an empty directory; name a new one")
    rec = opts["recipe"]
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if rec is None:
        inter = intercept(_grad_fn(fn, grad, argnums, has_aux), plan.rule, include=include,
                          exclude=exclude)  # fmt: skip
        value, aux = jax.jit(lambda *a: inter.call_with_aux(None, *a))(*args)
        state_grads = None
    else:
        inter = intercept(fn, plan.rule, include=include, exclude=exclude,
                          default=opts["default"], numbering="primitive")  # fmt: skip
        run = _runner(inter, grad, nums, isinstance(argnums, int), has_aux, key)
        value, aux, state_grads = jax.jit(run)(plan.states, *args)
    value, aux, state_grads = jax.device_get((value, aux, state_grads))
    writer = DumpWriter(out)
    header, state_after = _write(writer, plan, rec, state, value, aux, state_grads, opts,
                                 grad=grad, results=results, gemm=gemm, hw=hw, key=key)  # fmt: skip
    if note is not None:
        header["note"] = str(note)
    path = writer.write(header)
    return Recording(path, writer.nbytes, len(writer.tensors), value, state_after)


# --- writing the records in program order ------------------------------------------------
def _write(
    writer: DumpWriter,
    plan: _Plan,
    rec: recipes.Recipe | None,
    state: Any,
    value: Any,
    aux: Any,
    state_grads: Any,
    opts: dict[str, Any],
    *,
    grad: bool,
    results: bool,
    gemm: str,
    hw: str | None,
    key: jax.Array | None,
) -> tuple[dict[str, Any], Any]:
    weight = opts["weight"]
    gemms: list[dict[str, Any]] = []
    state_after, skipped = None, False
    if rec is None:
        _write_plain(writer, plan, aux, gemms, hw)
        mode = "plain"
    elif isinstance(rec, recipes.FP4Recipe):
        mode = "recipe"
        _write_fp4(writer, plan, aux, state_grads, gemms, grad)
    else:
        mode = "recipe"
        if rec.stateful:
            _write_state(writer, plan, state, "state", "previous step")
        for s in plan.recorded:
            for it in _iterations(s):
                if not _valid(aux, s, it):
                    continue
                _write_gemm(writer, gemms, rec, weight, s, it, "fprop",
                            _index(aux[s.name].value, it), gemm, hw)  # fmt: skip
        if grad:
            for s in reversed(plan.recorded):
                tape = state_grads[s.name]
                tape = tape.value if isinstance(tape, PerIteration) else tape
                tape = tape["tape"]
                flat = {k: from_halves(v, np.dtype(plan.tape_shapes[s.name][k].dtype),
                                        len(s.lengths)) for k, v in tape.items()}  # fmt: skip
                for it in reversed(_iterations(s)):
                    if not _valid(aux, s, it):
                        continue
                    one = _index(flat, it) if it else flat
                    for what in ("dgrad", "wgrad"):
                        part = {k.split("/", 1)[1]: v for k, v in one.items()
                                if k.startswith(what + "/")}  # fmt: skip
                        if part:
                            _write_gemm(writer, gemms, rec, weight, s, it, what, part, gemm,
                                        hw)  # fmt: skip
            if rec.stateful:  # delayed scaling (the FP4 recipes' state is not written)
                state_after, skipped = _state_after(plan, rec, state, state_grads, value, weight)
                _write_state(writer, plan, state_after, "state_after", "state update")
    if results:
        _write_results(writer, value, grad)
    header = {
        "kind": "step",
        "environment": environment(),
        "step": {
            "mode": mode,
            "recipe": None if rec is None else recipe_json(rec),
            "weight": weight,
            "gemm": gemm if rec is not None else "native",
            "hardware": hw,
            "grad": bool(grad),
            "key": None if key is None else key_data(jnp.asarray(key))[1],
            "skipped_update": bool(rec is not None and rec.stateful and grad and skipped),
        },
        "sites": [_site_json(s, s in plan.recorded) for s in plan.sites if s.selected],
        "skipped_sites": plan.skipped,
        "gemms": gemms,
    }
    return header, state_after


def _site_json(s: Site, recorded: bool) -> dict[str, Any]:
    return {"site": s.name, "scope": s.scope, "where": s.where, "loops": list(s.loops),
            "lengths": list(s.lengths), "recorded": recorded}  # fmt: skip


def _valid(aux: Any, s: Site, it: tuple[int, ...]) -> bool:
    if s.name not in aux:
        return False
    v = np.asarray(aux[s.name].valid)
    return bool(v[it] if it and v.ndim else v)


def _write_gemm(
    writer: DumpWriter,
    gemms: list[dict[str, Any]],
    rec: recipes.Recipe,
    weight: str,
    s: Site,
    it: tuple[int, ...],
    what: str,
    part: dict,
    gemm: str,
    hw: str | None,
) -> None:
    gid = f"{s.name}{_suffix(it)}/{what}"
    hp = not any(k.endswith("/codes") for k in part)
    kinds = gemm_kinds(weight, what)
    model = "hp" if hp else ("native" if gemm == "native" else "recipe")
    out = np.asarray(part["out"])
    entry = {
        "id": gid, "site": s.name, "iteration": list(it), "pass": what, "kinds": list(kinds),
        "model": model, "hardware": hw if model == "native" else None,
        "m": int(out.shape[1]), "n": int(out.shape[2]),
        "formats": [None if hp else element_format(rec, k) for k in kinds],
        "blocks": [block_layout(rec, k) for k in kinds],
    }  # fmt: skip
    gemms.append(entry)
    meta = dict(site=s.name, gemm=gid, iteration=it)
    for side, kind in zip(("lhs", "rhs"), kinds, strict=True):
        fmt = element_format(rec, kind)
        p = f"{gid}/{side}"
        writer.add(f"{p}/input", part[f"{side}/input"], "float32", "input", operand=side,
                   producer="program", **meta)  # fmt: skip
        if f"{side}/key" in part:
            writer.add(f"{p}/key", part[f"{side}/key"], "uint32", "key", operand=side,
                       producer="key split", **meta)  # fmt: skip
        if f"{side}/given_scale" in part:
            writer.add(f"{p}/given_scale", part[f"{side}/given_scale"], "float32",
                       "given_scale", operand=side, producer="recipe state", **meta)  # fmt: skip
        for role in ("row_scale", "block_scale", "block_exp"):
            if f"{side}/{role}" in part:
                dt = "int32" if role == "block_exp" else "float32"
                writer.add(f"{p}/{role}", part[f"{side}/{role}"], dt, role, operand=side,
                           producer="quantize", **meta)  # fmt: skip
        if f"{side}/codes" in part:
            writer.add(f"{p}/codes", part[f"{side}/codes"], fmt, "codes", operand=side,
                       producer="quantize", **meta)  # fmt: skip
    writer.add(f"{gid}/out", out, "float32", "output", producer="gemm", **meta)


#: the steps whose output holds E2M1 values (stored as float4_e2m1fn codes when finite)
_E2M1_OUT = {"nvfp4": "elems", "mxfp4": "elems", "quest": "elems", "ms_eden": "elems",
             "qema_nearest": "out"}  # fmt: skip


def _untape(v: np.ndarray, dtype: np.dtype, axis: int) -> np.ndarray:
    if dtype.itemsize == 4:
        return from_halves(v, dtype, axis)
    return from_halves(v, np.dtype(np.float32), axis).astype(dtype)


def _write_fp4(
    writer: DumpWriter,
    plan: _Plan,
    aux: Any,
    state_grads: Any,
    gemms: list[dict[str, Any]],
    grad: bool,
) -> None:
    """The steps of a recipe owning its GEMMs: per site and iteration, its forward, then
    (sites in reverse) its backward."""
    for s in plan.recorded:
        for it in _iterations(s):
            if _valid(aux, s, it):
                one = _index(aux[s.name].value, it)
                _write_steps(writer, gemms, plan.rule.steps[s.name].fprop, s, it, "fprop", one)
    if not grad:
        return
    for s in reversed(plan.recorded):
        tape = state_grads[s.name]
        tape = (tape.value if isinstance(tape, PerIteration) else tape)["tape"]
        shapes = plan.tape_shapes[s.name]
        flat = {k: _untape(v, np.dtype(shapes[k].dtype), len(s.lengths)) for k, v in tape.items()}
        for it in reversed(_iterations(s)):
            if _valid(aux, s, it):
                one = _index(flat, it) if it else flat
                _write_steps(writer, gemms, plan.rule.steps[s.name].backward, s, it, "backward",
                             one)  # fmt: skip


def _write_steps(
    writer: DumpWriter,
    gemms: list[dict[str, Any]],
    meta: list[dict],
    s: Site,
    it: tuple[int, ...],
    which: str,
    arrays: Any,
) -> None:
    gid = f"{s.name}{_suffix(it)}/{which}"
    steps = []
    info = dict(site=s.name, gemm=gid, iteration=it)
    for i, (m, what) in enumerate(zip(meta, step_pass(meta, which), strict=True)):
        tag = f"{i:03d}.{m['op']}"
        entry = {"op": m["op"], "pass": what, "static": m["static"], "inputs": {},
                 "outputs": {}, "keys": m["keys"]}  # fmt: skip
        for io in ("inputs", "outputs"):
            for name in m[io]:
                a = np.asarray(arrays[f"{tag}/{name}"])
                dt, role = np.dtype(a.dtype).name, "output" if io == "outputs" else "input"
                if io == "inputs" and (name in m["keys"] or name == "key"):
                    role = "key"
                elif io == "outputs" and _E2M1_OUT.get(m["op"]) == name and np.isfinite(a).all():
                    dt, role = "float4_e2m1fn", "codes"
                elif io == "outputs" and name == "scale":
                    role = "block_scale"
                writer.add(f"{gid}/{tag}/{name}", a, dt, role, producer=m["op"], step=i,
                           **info)  # fmt: skip
                entry[io][name] = f"{tag}/{name}"
        steps.append(entry)
    gemms.append({"id": gid, "site": s.name, "iteration": list(it), "pass": which,
                  "model": "steps", "steps": steps})  # fmt: skip


def _write_plain(
    writer: DumpWriter, plan: _Plan, aux: Any, gemms: list[dict[str, Any]], hw: str | None
) -> None:
    for s in plan.recorded:
        if s.name not in aux:
            continue
        params = plan.rule.params.get(s.name)
        if params is None:
            continue
        for it in _iterations(s):
            if not _valid(aux, s, it):
                continue
            v = _index(aux[s.name].value, it)
            gid = f"{s.name}{_suffix(it)}"
            lhs, rhs, out = (np.asarray(v[k]) for k in ("lhs", "rhs", "out"))
            gemms.append({
                "id": gid, "site": s.name, "iteration": list(it), "pass": "plain",
                "model": "plain", "hardware": hw, **params,
            })  # fmt: skip
            meta = dict(site=s.name, gemm=gid, iteration=it)
            writer.add(f"{gid}/lhs", lhs, jnp.dtype(lhs.dtype).name, "input", operand="lhs",
                       producer="program", **meta)  # fmt: skip
            writer.add(f"{gid}/rhs", rhs, jnp.dtype(rhs.dtype).name, "input", operand="rhs",
                       producer="program", **meta)  # fmt: skip
            writer.add(f"{gid}/out", out, jnp.dtype(out.dtype).name, "output",
                       producer="dot_general", **meta)  # fmt: skip


def _write_state(writer: DumpWriter, plan: _Plan, state: Any, role: str, producer: str) -> None:
    for s in plan.sites:
        if not s.selected or s.name not in state:
            continue
        for k in ("scale", "history"):
            writer.add(f"{role}/{s.name}/{k}", np.asarray(state[s.name][k]), "float32", role,
                       site=s.name, producer=producer)  # fmt: skip


def _state_after(
    plan: _Plan, rec: recipes.Recipe, state: Any, state_grads: Any, value: Any, weight: str
) -> tuple[dict[str, Any], bool]:
    """The recipe's state after the step (``update_site_state``; unchanged where a gradient
    is not finite, as the train step skips such a step), and whether it was skipped."""
    assert isinstance(rec, recipes.Delayed)  # the stateful recipe it is called for
    grads = value[1]
    finite = all(bool(np.all(np.isfinite(np.asarray(g)))) for g in jax.tree.leaves(grads)
                 if np.issubdtype(np.asarray(g).dtype, np.floating))  # fmt: skip
    new = {}
    for s in plan.sites:
        if not s.selected:
            continue
        g = state_grads[s.name]
        g = g.value if isinstance(g, PerIteration) else g
        probe = np.asarray(g["recipe"]["probe"])
        observed = probe.reshape(-1, 3).max(axis=0) if s.lengths else probe
        if finite:
            upd = recipes.update_site_state(rec, state[s.name], jnp.asarray(observed), weight)
            new[s.name] = jax.device_get(upd)
        else:
            new[s.name] = jax.device_get(state[s.name])
    return new, not finite


def _write_results(writer: DumpWriter, value: Any, grad: bool) -> None:
    if grad:
        out, grads = value
        trees = [("result/value", out), ("result/grad", grads)]
    else:
        trees = [("result/value", value)]
    for prefix, tree in trees:
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        for path, leaf in leaves:
            a = np.asarray(leaf)
            try:
                dt = jnp.dtype(a.dtype).name
                storage_dtype(dt)
            except (TypeError, ValueError):
                continue  # a key or an object: not a tensor of the step
            name = prefix + (jax.tree_util.keystr(path) or "")
            writer.add(name, a, dt, "result", producer="step")
