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

from precisionlab import recipes
from precisionlab.quant import SCALE_RULES
from precisionlab.recipes import scaling as S
from precisionlab.verify import _models as M
from precisionlab.verify._format import Dump, DumpError, Tensor, read_dump, to_storage
from precisionlab.verify._record import element_format, expand, gemm_kinds

__all__ = ["LABELS", "Report", "TensorCheck", "check", "find_dumps"]

#: The mechanism labels, each with what it means (the fixed set of the guide).
LABELS: dict[str, str] = {
    "scale-rule": "a scale was computed by another rule (floor instead of rceil E8M0, a "
    "power of two one binade off, pow2 scales on or off)",
    "stale-amax": "delayed scaling used or stored an amax history one step off (the scale "
    "from the history before this step's amax, or the history not rolled)",
    "sr-bits": "element codes one code apart from the recipe's: other stochastic-rounding "
    "bits (another key) or another rounding direction",
    "accumulator": "the GEMM output is what another accumulation computes from the same "
    "operands (another width, promotion or library: the model named; or float32 sums in "
    "another order, within float32's bound for reordering them)",
    "wrong-dtype": "a tensor of another format than the recipe's (bfloat16 where FP8 was "
    "asked), or a GEMM output equal to the product of the operands rounded to bfloat16",
    "zeroed-or-nonfinite": "a tensor all zero, or non-finite where the recipe's is finite",
    "unknown": "differs in a way none of the mechanisms above reproduces",
}
#: Roles a check only reads (inputs of a stage): reported, never compared.
INPUT_ROLES = ("input", "key", "result")
_MAX_CANDIDATES_SHARE = 0.999


@dataclasses.dataclass(frozen=True)
class TensorCheck:
    """The verdict on one recorded tensor.

    ``status``: ``"match"`` (bit-equal), ``"differ"``, ``"input"`` (read, not recomputed:
    stage inputs, keys, the step's outputs) or ``"not checked"`` (``detail`` says why).
    ``elements`` and ``equal``: how many elements, how many bit-equal; ``max_ulp``: the
    largest difference in units in the last place of the tensor's format (codes apart for
    element codes; None when a NaN meets a number); ``label``: a key of :data:`LABELS` for a
    differing tensor that was diagnosed (the first one always is).
    """

    name: str
    role: str
    order: int
    gemm: str | None
    status: str
    elements: int = 0
    equal: int = 0
    max_ulp: int | None = 0
    label: str | None = None
    detail: str = ""

    @property
    def share(self) -> float:
        """The bit-equal fraction (1.0 for an empty tensor)."""
        return 1.0 if self.elements == 0 else self.equal / self.elements


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`check` found for one dump."""

    path: str
    kind: str
    environment: dict[str, Any]
    step: dict[str, Any]
    tensors: tuple[TensorCheck, ...]
    notes: tuple[str, ...]

    @property
    def checked(self) -> list[TensorCheck]:
        """The tensors compared (status ``"match"`` or ``"differ"``), in program order."""
        return [t for t in self.tensors if t.status in ("match", "differ")]

    @property
    def differing(self) -> list[TensorCheck]:
        """The tensors that differ, in program order."""
        return [t for t in self.tensors if t.status == "differ"]

    @property
    def ok(self) -> bool:
        """Every checked tensor matches."""
        return not self.differing

    @property
    def first(self) -> TensorCheck | None:
        """The first differing tensor in program order, or None."""
        d = self.differing
        return d[0] if d else None

    @property
    def label(self) -> str | None:
        """The mechanism label of the first difference (None when everything matches)."""
        return None if self.first is None else self.first.label

    def share(self) -> float:
        """Bit-equal elements over all checked elements."""
        n = sum(t.elements for t in self.checked)
        return 1.0 if n == 0 else sum(t.equal for t in self.checked) / n

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-able data (what ``precisionlab verify --json`` writes)."""
        return {
            "path": self.path, "kind": self.kind, "ok": self.ok, "label": self.label,
            "first": None if self.first is None else self.first.name,
            "share": self.share(), "environment": self.environment, "step": self.step,
            "notes": list(self.notes),
            "tensors": [dataclasses.asdict(t) for t in self.tensors],
        }  # fmt: skip

    def text(self, *, every: bool = False, limit: int = 20) -> str:
        """A readable summary: the dump, the counts, the first difference and its label, and
        the differing tensors (``every``: all checked tensors), at most ``limit`` lines."""
        env = self.environment
        versions = ", ".join(f"{k} {env[k]}" for k in ("jax", "torch", "cuda") if k in env)
        lines = [
            f"dump: {self.path}",
            f"  recorded on {env.get('backend', '?')} ({env.get('device_kind', '?')})"
            + (f"; {versions}" if versions else ""),
            f"  {_what_text(self)}",
        ]
        checked = self.checked
        n_el = sum(t.elements for t in checked)
        n_eq = sum(t.equal for t in checked)
        others = len(self.tensors) - len(checked)
        lines.append(
            f"  {len(checked)} tensors checked, {len(checked) - len(self.differing)} "
            f"bit-equal; {n_eq} of {n_el} elements ({100 * self.share():.3f}%); {others} "
            "read as inputs or not checked"
        )
        first = self.first
        if first is None:
            lines.append("  every checked tensor matches")
        else:
            lines.append(f"  first difference: {first.name} ({_verdict(first)})")
            lines.append(f"  mechanism: {first.label}: {first.detail}")
        shown = checked if every else self.differing
        if shown:
            lines.append("")
            lines.append(f"  {'tensor':<44} {'bit-equal':>10} {'max ulp':>8}  label")
            for t in shown[:limit]:
                ulp = "nan" if t.max_ulp is None else str(t.max_ulp)
                lines.append(f"  {t.name:<44} {100 * t.share:>9.3f}% {ulp:>8}  {t.label or ''}")
            if len(shown) > limit:
                lines.append(f"  ... {len(shown) - limit} more")
        not_checked = [t for t in self.tensors if t.status == "not checked"]
        if not_checked:
            why = sorted({t.detail for t in not_checked})
            lines.append(f"  not checked: {len(not_checked)} ({'; '.join(why[:3])})")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _recipe_text(spec: dict[str, Any]) -> str:
    """``mx (element=float8_e4m3fn, scale_rule='rceil')``: the name and the fields that
    differ from the class's defaults."""
    cls = getattr(recipes, str(spec.get("class")), None)
    fields = spec.get("fields") or {}
    if not isinstance(cls, type) or not dataclasses.is_dataclass(cls):
        return str(spec.get("name"))
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    diff = [f"{k}={v!r}" for k, v in fields.items() if defaults.get(k, v) != v]
    return f"{spec.get('name')}" + (f" ({', '.join(diff)})" if diff else "")


def _what_text(report: Report) -> str:
    step = report.step
    if report.kind == "gemm":
        n = sum(t.role == "output" for t in report.tensors)
        return f"{n} GEMMs computed elsewhere, each checked by its hardware preset"
    spec = step.get("recipe")
    if spec is None:
        return f"a plain step; GEMMs: the program's dot_general, model {step.get('hardware')}"
    rec = f"a step under the {_recipe_text(spec)} recipe"
    if step.get("gemm") == "native":
        return f"{rec}; GEMMs: the backend's own (native), model {step.get('hardware')}"
    fields = spec.get("fields", {}) if isinstance(spec, dict) else {}
    acc = fields.get("accumulate")
    if acc is None and fields.get("accumulate_bits") is not None:
        acc = f"sequential, {fields['accumulate_bits']} bits"
    return f"{rec}; GEMMs: the recipe's ({acc or 'float32 products summed by XLA'})"


def _verdict(t: TensorCheck) -> str:
    ulp = "a NaN where a number is" if t.max_ulp is None else f"max {t.max_ulp} ulp"
    return f"{t.elements - t.equal} of {t.elements} elements differ, {ulp}"


# --- comparing ------------------------------------------------------------------------
def _bits_and_order(a: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(raw bits, an ordered integer per element, NaN mask) of ``a`` of logical ``dtype``."""
    if dtype in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "bool"):  # fmt: skip
        v = np.asarray(a).astype(np.int64)
        return v, v, np.zeros(v.shape, bool)
    stored = to_storage(a, dtype)
    raw = stored.view(f"uint{8 * stored.dtype.itemsize}").astype(np.uint64)  # the bits
    if dtype in ("float32", "float16", "float64"):
        bits = np.finfo(np.dtype(dtype)).bits
    else:
        bits = ml_dtypes.finfo(getattr(ml_dtypes, dtype)).bits
    nan = np.isnan(np.asarray(a).astype(np.float32)) if dtype != "float64" else np.isnan(a)
    if dtype == "float8_e8m0fnu":  # unsigned: the code is the order
        return raw, raw.astype(np.int64), nan
    sign = np.uint64(1 << (bits - 1))
    mag = (raw & ~sign).astype(np.int64)
    order = np.where((raw & sign) != 0, -mag, mag)
    return raw, order, nan


def compare(rec: np.ndarray, ref: np.ndarray, dtype: str) -> tuple[int, int, int | None, Any]:
    """(elements, bit-equal elements, max difference in ordered codes (None: a NaN against a
    number), differing mask) of a recorded and a recomputed array of logical ``dtype``."""
    rec, ref = np.asarray(rec), np.asarray(ref)
    if rec.shape != ref.shape:
        return int(rec.size), 0, None, np.ones(rec.shape, bool)
    br, orr, nr = _bits_and_order(rec, dtype)
    bf, orf, nf = _bits_and_order(ref, dtype)
    eq = (br == bf) | (nr & nf)
    diff = ~eq
    if not diff.any():
        return int(rec.size), int(rec.size), 0, diff
    if (diff & (nr ^ nf)).any():
        ulp = None
    else:
        d = np.abs(orr - orf)[diff & ~(nr | nf)]
        ulp = int(d.max()) if d.size else 0
    return int(rec.size), int(eq.sum()), ulp, diff


def _check(t: Tensor, rec, ref, dtype=None, **kw) -> TensorCheck:
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


# --- the context of one check ----------------------------------------------------------
@dataclasses.dataclass
class _Ctx:
    dump: Dump
    recipe: recipes.Recipe | None
    weight: str
    hardware: str | None
    notes: list[str]
    diagnosed: bool = False  # the first difference got its full diagnosis
    results: dict[str, TensorCheck] = dataclasses.field(default_factory=dict)

    def arr(self, t: Tensor) -> np.ndarray:
        return self.dump.arrays[t.name]

    def add(self, c: TensorCheck) -> None:
        self.results[c.name] = c

    def full(self) -> bool:
        """Whether this difference gets the full (costly) diagnosis: the first one only."""
        if self.diagnosed:
            return False
        self.diagnosed = True
        return True


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
    step = m.get("step") if isinstance(m.get("step"), dict) else {}
    env = m.get("environment") if isinstance(m.get("environment"), dict) else {}
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
    ctx = _Ctx(dump, recipe, weight, hw, [])
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
            else:
                _check_recipe_gemm(ctx, g, ts)
        elif t.role == "result":
            ctx.add(_status(t, "input", "the step's output (not recomputed)"))
    after = [t for t in dump.tensors if t.role == "state_after"]
    if after:
        _check_state_after(ctx, after, gemms, by_gemm, bool(step.get("skipped_update")))
    out = [ctx.results.get(t.name) or _status(t, "input") for t in dump.tensors]
    return Report(str(dump.path), m["kind"], env, step, tuple(out), tuple(ctx.notes))


def _note_platform(ctx: _Ctx, env: dict, recipe, kind: str) -> None:
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


def _gemm_entries(raw: Any, where: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for i, g in enumerate(raw):
        if not isinstance(g, dict) or not isinstance(g.get("id"), str):
            raise DumpError(f"{where}: gemms[{i}] is not an object with an 'id'")
        model = g.get("model")
        if model not in ("recipe", "native", "hp", "plain", "hardware"):
            raise DumpError(f"{where}: gemms[{i}] has an unknown model {model!r}")
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
def _key(ctx: _Ctx, t: Tensor | None) -> Any:
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


def _check_recipe_gemm(ctx: _Ctx, g: dict, ts: dict[str, Tensor]) -> None:
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
                c = _diagnose_scale(ctx, c, t, role, ref[role], recipe, kind, layout, x, scale,
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
                c = _diagnose_codes(ctx, c, codes, refc, want, t_key is not None)
        ctx.add(c)
        operands[side] = _operand(ctx, ts, side, codes, recipe, kind)
    t_out = _need(ts, "out", g)
    rec_out = np.asarray(ctx.arr(t_out), np.float32)
    m, n = g["m"], g["n"]
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
            factor = _factor(operands["lhs"], operands["rhs"])
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
            reorder = partial(_exact_sums, operands, inputs, model == "hp", m, n)
        c = _diagnose_output(ctx, c, rec_out, ref_out, alts, bf16, reorder)
    ctx.add(c)


def _exact_sums(operands, inputs, hp: bool, m: int, n: int):
    """The exact (float64) GEMM of the recorded operands, the sum of its |products| and K."""
    if hp:
        a, b, fa, fb = inputs["lhs"], inputs["rhs"], None, None
    else:
        qa, qb = operands["lhs"], operands["rhs"]
        a, b = (np.asarray(q.block_values(), np.float64) for q in (qa, qb))
        fa = None if qa.row_inv is None else np.asarray(qa.row_inv, np.float64)
        fb = None if qb.row_inv is None else np.swapaxes(np.asarray(qb.row_inv, np.float64), -1,
                                                         -2)  # fmt: skip
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    exact = np.einsum("bmk,bnk->bmn", a, b)[:, :m, :n]
    absum = np.einsum("bmk,bnk->bmn", np.abs(a), np.abs(b))[:, :m, :n]
    for f in (fa, fb):
        if f is not None:
            exact, absum = exact * f, absum * np.abs(f)
    return exact, absum, a.shape[-1]


def _layout(recipe, kind: str):
    sizes = recipe.block_sizes(kind)
    return None if not sizes else (int(sizes[0]), bool(recipe.two_d(kind)))


def _typed(t: Tensor, ctx: _Ctx) -> jax.Array:
    a = ctx.arr(t)
    return jnp.asarray(a) if t.dtype != "float32" else jnp.asarray(a, jnp.float32)


def _operand(ctx, ts, side, codes, recipe, kind) -> S.QOperand:
    """The recorded operand as the GEMM takes it (elements and factors as recorded)."""
    layout = _layout(recipe, kind)
    elems = jnp.asarray(np.asarray(codes).astype(np.float32))
    get = lambda r: ts.get(f"{side}/{r}")  # noqa: E731
    row = None if get("row_scale") is None else jnp.asarray(ctx.arr(get("row_scale")))
    blk = None
    if get("block_scale") is not None:
        blk = jnp.asarray(expand(np.asarray(ctx.arr(get("block_scale"))), layout))
    exp = None
    if get("block_exp") is not None:
        exp = jnp.asarray(expand(np.asarray(ctx.arr(get("block_exp"))), layout))
    for name, v in (("block_scale", blk), ("block_exp", exp)):
        if v is not None and v.shape != elems.shape:
            raise DumpError(f"{side}/{name} expands to {v.shape}, its codes are {elems.shape}")
    return S.QOperand(elems, row, blk, exp)


def _factor(qa: S.QOperand, qb: S.QOperand):
    factor = None
    if qa.row_inv is not None:
        factor = qa.row_inv
    if qb.row_inv is not None:
        fb = jnp.swapaxes(qb.row_inv, -1, -2)
        factor = fb if factor is None else factor * fb
    return factor


# --- diagnoses -------------------------------------------------------------------------
def _zeroed_or_nonfinite(rec: np.ndarray, ref: np.ndarray) -> str | None:
    r = np.asarray(rec).astype(np.float32)
    f = np.asarray(ref).astype(np.float32)
    if r.size and not np.any(r) and np.any(f):
        return "all zero where the recipe's has nonzero values"
    bad = ~np.isfinite(r) & np.isfinite(f)
    if bad.any():
        return f"{int(bad.sum())} non-finite values where the recipe's are finite"
    return None


def _labelled(c: TensorCheck, label: str, detail: str) -> TensorCheck:
    return dataclasses.replace(c, label=label, detail=detail)


def _diagnose_codes(ctx, c, rec, ref, fmt: str, stochastic: bool) -> TensorCheck:
    z = _zeroed_or_nonfinite(rec, ref)
    if z:
        ctx.full()
        return _labelled(c, "zeroed-or-nonfinite", z)
    if c.max_ulp == 1:
        ctx.full()
        how = "stochastically rounded by the recipe" if stochastic else "rounded to nearest"
        return _labelled(c, "sr-bits", (
            f"{c.elements - c.equal} codes one {fmt} code from the recipe's ({how}): other "
            "stochastic-rounding bits or another rounding direction"))  # fmt: skip
    if not ctx.full():
        return _labelled(c, None, "not analysed (only the first difference is)")
    return _labelled(c, "unknown", f"codes up to {c.max_ulp} codes apart")


def _scale_alternatives(recipe) -> list[tuple[str, Any]]:
    out = []
    if isinstance(recipe, recipes.MX):
        out += [(f"scale_rule={r!r}", dataclasses.replace(recipe, scale_rule=r))
                for r in SCALE_RULES if r != recipe.scale_rule]  # fmt: skip
    if isinstance(recipe, recipes.Current):
        out.append((f"pow2_scales={not recipe.pow2_scales}",
                    dataclasses.replace(recipe, pow2_scales=not recipe.pow2_scales)))  # fmt: skip
    return out


def _diagnose_scale(ctx, c, t, role, ref, recipe, kind, layout, x, scale, key) -> TensorCheck:
    rec = ctx.arr(t)
    z = _zeroed_or_nonfinite(rec, ref) if role != "block_exp" else None
    if z:
        ctx.full()
        return _labelled(c, "zeroed-or-nonfinite", z)
    full = ctx.full()
    if full:
        for name, alt in _scale_alternatives(recipe):
            other = M.quantize(alt, kind, layout, x, scale, key).get(role)
            if other is not None and compare(rec, other, t.dtype)[1] == c.elements:
                return _labelled(c, "scale-rule", f"equals the {role} of {name} (the recipe "
                                 f"has {_rule_of(recipe)})")  # fmt: skip
    diff = compare(rec, ref, t.dtype)[3]
    r = np.asarray(rec)[diff].astype(np.float64)
    f = np.asarray(ref)[diff].astype(np.float64)
    if role == "block_exp":
        binade = np.all(np.abs(r - f) == 1)
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = r / f
        binade = np.all((ratio == 2) | (ratio == 0.5))
    if binade:
        return _labelled(c, "scale-rule", f"{int(diff.sum())} scales one binade (a factor 2) "
                         "from the recipe's rule, as another rounding of log2 gives")  # fmt: skip
    if not full:
        return _labelled(c, None, "not analysed (only the first difference is)")
    return _labelled(c, "unknown", f"scales differ, up to {c.max_ulp} ulp")


def _rule_of(recipe) -> str:
    if isinstance(recipe, recipes.MX):
        return f"scale_rule={recipe.scale_rule!r}"
    if isinstance(recipe, recipes.Current):
        return f"pow2_scales={recipe.pow2_scales}"
    return recipe.name


def _within_reordering(rec, exact, absum, k: int, out_bits: int = 24) -> bool:
    """Whether every output is within the error bound of summing the same exact products in
    float32 in some order: ``|out - sum| <= (k + 1) 2**-24 sum |a_k b_k|`` (the k - 1
    additions, the final scaling, float32's products being exact or rounded once), plus
    ``2**-out_bits |sum|`` for an output rounded to a narrower format."""
    bound = (k + 1) * 2.0**-24 * absum + 2.0**-out_bits * np.abs(exact)
    return bool(np.all(np.abs(rec.astype(np.float64) - exact) <= bound))


def _diagnose_output(ctx, c, rec, ref, alts, bf16, reorder=None, out_bits=24) -> TensorCheck:
    """``reorder``: for a float32 model (XLA's order), ``() -> (exact sum, sum of |products|,
    K)`` in float64, so a difference of summation order is told apart."""
    z = _zeroed_or_nonfinite(rec, ref)
    if z:
        ctx.full()
        return _labelled(c, "zeroed-or-nonfinite", z)
    if not ctx.full():
        return _labelled(c, None, "not analysed (only the first difference is)")
    for name, f in bf16:
        other = _try(f)
        if other is not None and compare(rec, other, "float32")[1] == c.elements:
            return _labelled(
                c,
                "wrong-dtype",
                "equals the GEMM of the operands' inputs "
                f"rounded to bfloat16 ({name}), not of the recipe's codes",
            )
    best = (c.share, None)
    for name, f in alts:
        other = _try(f)
        if other is None:
            continue
        n, eq, _, _ = compare(rec, other, "float32")
        if eq == n:
            return _labelled(c, "accumulator", f"equals, bit for bit, the GEMM of the same "
                             f"codes by {name}")  # fmt: skip
        if eq / n > best[0]:
            best = (eq / n, name)
    if best[1] is not None and best[0] >= _MAX_CANDIDATES_SHARE:
        return _labelled(
            c,
            "accumulator",
            f"{100 * best[0]:.3f}% bit-equal to the GEMM of "
            f"the same codes by {best[1]} ({100 * c.share:.3f}% to the named model)",
        )
    if reorder is not None:
        exact, absum, k = reorder()
        if _within_reordering(np.asarray(rec), exact, absum, k, out_bits):
            what = f"{c.elements - c.equal} outputs differ (max {c.max_ulp} ulp)"
            return _labelled(c, "accumulator", (
                f"float32 sums of the same products in another order: {what}, each within "
                f"float32's bound for summing {k} products in any order (XLA's order depends "
                "on the program)"))  # fmt: skip
    near = "" if best[1] is None else f"; closest model {best[1]} ({100 * best[0]:.3f}%)"
    return _labelled(c, "unknown", f"{c.elements - c.equal} outputs differ, max "
                     f"{c.max_ulp} ulp{near}")  # fmt: skip


def _try(f: Callable[[], Any]) -> Any:
    try:
        return f()
    except (M.NotModelled, ValueError):
        return None


# --- delayed scaling's state -------------------------------------------------------------
def _kind_max(recipe, weight: str) -> np.ndarray:
    kinds = (*recipes.WEIGHT_OPERANDS[weight], "g")
    return np.asarray([recipe.fmt(k).max for k in kinds], np.float32)


def _state_arrays(ctx: _Ctx, role: str, site: str) -> tuple[np.ndarray, np.ndarray] | None:
    s = ctx.dump.get(f"{role}/{site}/scale")
    h = ctx.dump.get(f"{role}/{site}/history")
    if s is None or h is None:
        return None
    return np.asarray(s, np.float32), np.asarray(h, np.float32)


def _next_scale(recipe, hist, scale, weight) -> np.ndarray:
    return np.asarray(recipe.next_scale(jnp.asarray(hist), jnp.asarray(scale),
                                        jnp.asarray(_kind_max(recipe, weight))))  # fmt: skip


def _older(hist: np.ndarray) -> np.ndarray:
    """The history one step earlier, as far as it is known (its oldest row lost)."""
    return np.concatenate([hist[1:], np.zeros_like(hist[:1])])


def _check_state(ctx: _Ctx, t: Tensor) -> None:
    if not t.name.endswith("/scale"):
        ctx.add(_status(t, "input", "the amax history the step starts from"))
        return
    got = _state_arrays(ctx, "state", t.site or "")
    if got is None:
        raise DumpError(f"{t.name}: its history is missing")
    scale, hist = got
    expect = _next_scale(ctx.recipe, hist, scale, ctx.weight)
    c = _check(t, scale, expect)
    if c.status == "differ":
        ctx.full()
        stale = _next_scale(ctx.recipe, _older(hist), scale, ctx.weight)
        if compare(scale, stale, "float32")[1] == c.elements:
            c = _labelled(c, "stale-amax", "the scale is the one of the history before its "
                          "newest amax (one step old)")  # fmt: skip
        else:
            c = _labelled(c, "unknown", "the scale is not the recipe's rule of its history")
    ctx.add(c)


def _check_given_scale(ctx, g, side, t, scale) -> None:
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
            c = _labelled(c, "stale-amax", "the quantizer used the scale of the history "
                          "before its newest amax (one step old), not the state's")  # fmt: skip
        else:
            c = _labelled(c, "unknown", "the quantizer used another scale than the state's")
    ctx.add(c)


def _observed(ctx, site: str, gemms, by_gemm) -> np.ndarray | None:
    """The amaxes (lhs, rhs, output gradient) of a site's recorded inputs, max over its
    iterations; None if a pass is missing."""
    found = {0: [], 1: [], 2: []}
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


def _check_state_after(ctx, after: list[Tensor], gemms, by_gemm, skipped: bool) -> None:
    recipe = ctx.recipe
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


def _diagnose_state_after(ctx, c, part, rec, scale0, hist0) -> TensorCheck:
    ctx.full()
    rec = np.asarray(rec, np.float32)
    if part == "history":
        if rec.shape == hist0.shape and compare(rec, hist0, "float32")[1] == rec.size:
            return _labelled(c, "stale-amax", "the history was not rolled: it lacks this "
                             "step's amax")  # fmt: skip
        if (
            rec.shape == hist0.shape
            and len(hist0) > 1
            and compare(rec[0], hist0[0], "float32")[1] == rec.shape[1]
        ):
            return _labelled(c, "stale-amax", "the newest history row holds the previous "
                             "step's amax, not this step's")  # fmt: skip
        return _labelled(c, "unknown", "the history is not this step's amaxes rolled in")
    stale = _next_scale(ctx.recipe, hist0, scale0, ctx.weight)
    if compare(rec, stale, "float32")[1] == rec.size:
        return _labelled(c, "stale-amax", "the new scale is computed from the history before "
                         "this step's amax")  # fmt: skip
    return _labelled(c, "unknown", "the new scale is not the recipe's rule of the new history")


# --- plain GEMMs and captures ------------------------------------------------------------
def _check_plain(ctx: _Ctx, g: dict, ts: dict[str, Tensor]) -> None:
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
        reorder = partial(_plain_exact, lhs, rhs, g) if hw == "xla-cpu" else None
        c = _diagnose_output(ctx, c, np.asarray(rec).astype(np.float32),
                             np.asarray(ref).astype(np.float32), alts, [], reorder,
                             _BITS.get(t_o.dtype, 24))  # fmt: skip
    ctx.add(c)


_BITS = {"float32": 24, "bfloat16": 8, "float16": 11}


def _plain_exact(lhs, rhs, g: dict):
    """The exact (float64) dot_general of a plain site's operands, laid out as its output,
    the sum of its |products| and K."""
    (lc, rc), (lb, rb) = g["dimension_numbers"]

    def canon(x, contract, batch):
        x = np.asarray(x).astype(np.float64)
        free = [d for d in range(x.ndim) if d not in contract and d not in batch]
        xt = np.transpose(x, (*batch, *free, *contract))
        shape = [x.shape[d] for d in free]
        k = int(np.prod([x.shape[d] for d in contract], dtype=np.int64))
        bsz = int(np.prod([x.shape[d] for d in batch], dtype=np.int64))
        return xt.reshape(bsz, -1, k), shape

    a, lfree = canon(lhs, lc, lb)
    b, rfree = canon(rhs, rc, rb)
    bshape = [np.shape(lhs)[d] for d in lb]
    out = (*bshape, *lfree, *rfree)
    exact = np.einsum("bmk,bnk->bmn", a, b).reshape(out)
    absum = np.einsum("bmk,bnk->bmn", np.abs(a), np.abs(b)).reshape(out)
    return exact, absum, a.shape[-1]


def _check_capture(ctx: _Ctx, g: dict, ts: dict[str, Tensor]) -> None:
    from precisionlab import hardware

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

    def run(preset_kw, ov):
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
        c = _diagnose_output(ctx, c, np.asarray(rec).astype(np.float32),
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
