"""What :func:`precisionlab.verify.check` reports: the verdict per tensor, the report of a
dump, the bit comparison (ULPs of any format) and the fixed set of mechanism labels."""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np

from precisionlab import recipes
from precisionlab.verify._format import to_storage

__all__ = ["INPUT_ROLES", "LABELS", "Report", "TensorCheck", "compare"]

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
