"""Run every (library, format, source type, rounding mode) cell against the exact reference."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import numpy as np

from precisionlab.bits.reference import encode_scalar
from precisionlab.conformance import _cases as cases
from precisionlab.conformance._adapters import (
    LIBRARIES,
    Adapter,
    Claim,
    Output,
    Unsupported,
    adapters_for,
)
from precisionlab.conformance._classify import RULES, classify, rule_spec
from precisionlab.conformance._exact import (
    as_float_format,
    decode_codes,
    encode_exact,
    is_nan_code,
)
from precisionlab.formats import FORMATS, FloatFormat

__all__ = [
    "DEFAULT_LIBS",
    "DEFAULT_SOURCES",
    "Cell",
    "Example",
    "Finding",
    "Result",
    "default_formats",
    "run_conformance",
]

#: The libraries checked by default (those not installed are skipped).
DEFAULT_LIBS = ("ml_dtypes", "xla", "numpy", "gfloat", "torch")
#: The source dtypes converted from by default.
DEFAULT_SOURCES = ("float32", "float64")
EXAMPLES = 3


@dataclasses.dataclass
class Example:
    """One disagreement: the input, what the library gave, what the exact reference gives."""

    input: float
    input_bits: str
    output: int | None  # None: no code of the format (raised, or a value it cannot hold)
    output_value: float | None
    exact: int
    exact_value: float
    note: str | None = None


@dataclasses.dataclass
class Finding:
    rule: str
    category: str
    title: str
    spec: str  # key of precisionlab.conformance._spec.SPECS
    count: int
    examples: list[Example]


@dataclasses.dataclass
class Cell:
    library: str
    format: str
    source: str
    mode: str
    saturate: bool
    inputs: int
    mismatches: int
    findings: list[Finding]
    seconds: float

    def counts(self) -> dict[str, int]:
        out = {"violation": 0, "convention": 0, "undefined": 0}
        for f in self.findings:
            out[f.category] += f.count
        return out


@dataclasses.dataclass
class Result:
    cells: list[Cell]
    skipped: dict[str, str]  # library row -> why it did not run
    unsupported: dict[str, dict[str, str]]  # library row -> format -> why not
    versions: dict[str, str | None]
    formats: list[str]
    sources: list[str]
    seed: int
    checked_by_arbiter: int
    seconds: float = 0.0


def default_formats() -> list[str]:
    """Every float format of the catalog narrower than float64."""
    return [n for n, f in FORMATS.items() if isinstance(f, FloatFormat) and f.bits < 64]


def _widening(fmt: FloatFormat, src: FloatFormat) -> bool:
    """Whether ``fmt`` holds every value of ``src`` (then nothing rounds)."""
    return (
        fmt.mantissa_bits >= src.mantissa_bits
        and fmt.emax >= src.emax
        and fmt.emin <= src.emin
        and fmt.emin - fmt.mantissa_bits <= src.emin - src.mantissa_bits
        and fmt.has_inf >= src.has_inf
        and fmt.has_nan >= src.has_nan
        and fmt.signed >= src.signed
    )


@functools.cache
def _inputs(fmt: FloatFormat, source: str, seed: int, random: int) -> np.ndarray:
    return cases.edge_inputs(fmt, source, seed=seed, random=random)


def _sample(x: np.ndarray, n: int, seed: int, fmt: FloatFormat, source: str) -> np.ndarray:
    """Indices of a deterministic sample of ``n`` inputs that keeps the ends of the range and
    the specials (:func:`cases.extreme_inputs`) and the pinned cases of :data:`cases.KNOWN`."""
    if len(x) <= n:
        return np.arange(len(x))
    with np.errstate(invalid="ignore"):
        x64 = x.astype(np.float64)
        ends = cases.extreme_inputs(fmt, source).astype(np.float64)
    keep = ~np.isfinite(x64) | np.isin(x64, ends) | np.isin(np.abs(x64), cases.KNOWN)
    rest = np.flatnonzero(~keep)
    rng = np.random.default_rng(seed)
    picked = rng.choice(rest, max(n - int(keep.sum()), 0), replace=False)
    return np.sort(np.concatenate([np.flatnonzero(keep), picked]))


def _hex(code: int, bits: int) -> str:
    return f"0x{code:0{(bits + 3) // 4}x}"


def _input_bits(v: np.generic) -> str:
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[v.dtype.itemsize]
    return _hex(int(np.asarray(v).view(uint)), v.dtype.itemsize * 8)


def _same(a: int, b: int, fmt: FloatFormat) -> bool:
    return a == b or bool(is_nan_code(np.array([a, b]), fmt).all())


def _check_arbiter(
    x64: np.ndarray, idx: Sequence[int], ref: np.ndarray, fmt: FloatFormat, claim: Claim
) -> int:
    """Re-derive the reference codes at ``idx`` with ``bits.reference.encode_scalar`` (Python
    fractions); a difference is a bug of the vectorized reference, never a finding."""
    for i in idx:
        want = encode_scalar(float(x64[i]), fmt, rounding=claim.mode, saturate=claim.saturate)
        if not _same(want, int(ref[i]), fmt):
            raise RuntimeError(
                f"vectorized reference disagrees with bits.reference for {x64[i]!r} -> "
                f"{fmt.name}: {ref[i]:#x} vs {want:#x}"
            )
    return len(idx)


def _pick(x64: np.ndarray, idx: np.ndarray) -> list[int]:
    """Up to three example indices, the pinned known cases first, then spread out."""
    idx = np.asarray(idx)
    known = idx[np.isin(np.abs(x64[idx]), cases.KNOWN)].tolist()
    spread = [int(idx[j]) for j in sorted({0, len(idx) // 2, len(idx) - 1})] if len(idx) else []
    return [int(i) for i in dict.fromkeys(known + spread)][:EXAMPLES]


def _examples(
    x: np.ndarray,
    x64: np.ndarray,
    chosen: Sequence[int],
    out: Output,
    ref: np.ndarray,
    fmt: FloatFormat,
) -> list[Example]:
    """The examples at indices ``chosen``."""
    res = []
    for i in chosen:
        code = int(out.codes[i])
        shown = float(decode_codes([code], fmt)[0]) if code >= 0 else None
        if code < 0 and out.values is not None:
            shown = float(out.values[i])
        note = None
        if out.raised is not None and out.raised[i]:
            note = out.error
        elif code < 0:
            note = "not a value of the format"
        res.append(
            Example(
                input=float(x64[i]),
                input_bits=_input_bits(x[i]),
                output=code if code >= 0 else None,
                output_value=shown,
                exact=int(ref[i]),
                exact_value=float(decode_codes([ref[i]], fmt)[0]),
                note=note,
            )
        )
    return res


@functools.cache
def _reference(
    fmt: FloatFormat, source: str, seed: int, random: int, claim: Claim
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The inputs, their float64 images and the exact codes (shared by every library)."""
    x = _inputs(fmt, source, seed, random)
    with np.errstate(invalid="ignore"):  # signalling NaN payloads
        x64 = x.astype(np.float64)
    ref = encode_exact(x64, fmt, claim.mode, saturate=claim.saturate)
    return x, x64, ref, is_nan_code(ref, fmt)


def _run_cell(
    adapter: Adapter,
    fmt: FloatFormat,
    source: str,
    claim: Claim,
    seed: int,
    random: int,
    confirm: int,
) -> tuple[Cell, int]:
    start = time.perf_counter()
    x, x64, ref, ref_nan = _reference(fmt, source, seed, random, claim)
    if adapter.max_inputs is not None:
        idx = _sample(x, adapter.max_inputs, seed, fmt, source)
        x, x64, ref, ref_nan = x[idx], x64[idx], ref[idx], ref_nan[idx]
    out = adapter.convert(x, fmt, claim)
    match = (out.codes == ref) | (is_nan_code(out.codes, fmt) & ref_nan)
    bad = np.flatnonzero(~match)
    findings = []
    checked_idx = []
    if len(bad):
        rules = classify(
            x64[bad],
            out.codes[bad],
            ref[bad],
            fmt,
            claim.mode,
            source,
            saturate=claim.saturate,
            lib_values=None if out.values is None else out.values[bad],
        )
        for rule in RULES:  # in rule order
            sel = bad[rules == rule]
            if not len(sel):
                continue
            chosen = _pick(x64, sel)
            examples = _examples(x, x64, chosen, out, ref, fmt)
            checked_idx += chosen
            r = RULES[rule]
            findings.append(
                Finding(rule, r.category, r.title, rule_spec(rule, claim.mode), len(sel), examples)
            )
    rng = np.random.default_rng(seed)
    good = np.flatnonzero(match)
    checked_idx += rng.choice(good, min(confirm, len(good)), replace=False).tolist()
    checked_idx += rng.choice(bad, min(confirm, len(bad)), replace=False).tolist()
    checked = _check_arbiter(x64, sorted(set(checked_idx)), ref, fmt, claim)
    cell = Cell(
        library=adapter.name,
        format=fmt.name,
        source=source,
        mode=claim.mode.value,
        saturate=claim.saturate,
        inputs=len(x),
        mismatches=len(bad),
        findings=findings,
        seconds=time.perf_counter() - start,
    )
    return cell, checked


def run_conformance(
    libs: Sequence[str] | None = None,
    formats: Sequence[str] | None = None,
    sources: Sequence[str] | None = None,
    *,
    seed: int = 0,
    random: int = 4096,
    confirm: int = 32,
    require: bool = False,
) -> Result:
    """Convert the edge-case inputs with every library and compare with the exact reference.

    Args:
      libs: library names (default :data:`DEFAULT_LIBS`); missing ones are skipped with a reason.
      formats: target formats (default: every float format narrower than float64).
      sources: source types (default float32 and float64).
      seed: seed of the random bit patterns and samples. random: random inputs per cell.
      confirm: agreements and disagreements per cell re-checked with ``encode_scalar``.
      require: a library of ``libs`` that is not installed is a ValueError (naming it and
        the installed ones) instead of a skipped entry: for a caller that asked for it.
    """
    start = time.perf_counter()
    adapters = adapters_for(list(libs or DEFAULT_LIBS))
    if require:
        missing = {a.lib: a.unavailable() for a in adapters if a.unavailable() is not None}
        if missing:
            ok = sorted({a.lib for a in adapters_for(list(LIBRARIES)) if a.unavailable() is None})
            lib, why = next(iter(missing.items()))
            raise ValueError(f"library {lib!r} was asked for but {why}; installed: {', '.join(ok)}")
    fmts = [as_float_format(f) for f in (formats or default_formats())]
    srcs = [cases.parse_source(s) for s in (sources or DEFAULT_SOURCES)]
    for f in fmts:
        if f.bits >= 64:
            raise ValueError(f"{f.name}: conformance covers formats narrower than float64")
    cells, skipped, versions = [], {}, {}
    unsupported: dict[str, dict[str, str]] = {}
    checked = 0
    for adapter in adapters:
        reason = adapter.unavailable()
        if reason is not None:
            skipped[adapter.name] = reason
            continue
        versions[adapter.name] = adapter.version()
        for fmt in fmts:
            for source in srcs:
                if _widening(fmt, cases.source_format(source)):
                    continue
                why = adapter.support(fmt, source)
                if why is not None:
                    unsupported.setdefault(adapter.name, {})[f"{fmt.name} from {source}"] = why
                    continue
                try:
                    for claim in adapter.claims(fmt):
                        cell, n = _run_cell(adapter, fmt, source, claim, seed, random, confirm)
                        cells.append(cell)
                        checked += n
                except Unsupported as err:
                    unsupported.setdefault(adapter.name, {})[f"{fmt.name} from {source}"] = str(err)
    _reference.cache_clear()
    _inputs.cache_clear()
    return Result(
        cells=cells,
        skipped=skipped,
        unsupported=unsupported,
        versions=versions,
        formats=[f.name for f in fmts],
        sources=srcs,
        seed=seed,
        checked_by_arbiter=checked,
        seconds=time.perf_counter() - start,
    )
