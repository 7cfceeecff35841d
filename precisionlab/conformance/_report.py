"""The matrix (library x format x source type), ``report.md`` and the JSON record."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from precisionlab.conformance._classify import RULES
from precisionlab.conformance._run import Cell, Example, Result
from precisionlab.conformance._spec import SPECS, spec_for_format
from precisionlab.experiments import _store as store
from precisionlab.formats import get_format

__all__ = ["markdown", "matrix_tables", "to_json", "write_report"]

LEGEND = (
    "Each cell: inputs on which the library disagrees with the exact reference "
    "(`precisionlab/bits/reference.py`), by class: V = spec violation, C = documented "
    "convention, U = undefined case; 0 = every input agrees; · = no such conversion in that "
    "library."
)


def _cell_text(cell: Cell) -> str:
    if not cell.mismatches:
        return "0"
    return ", ".join(f"{n} {k[0].upper()}" for k, n in cell.counts().items() if n)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def matrix_tables(result: Result) -> list[tuple[str, str]]:
    """``(title, markdown table)`` per source type and rounding mode: rows are formats,
    columns the libraries that claim that mode."""
    out = []
    modes = list(dict.fromkeys(c.mode for c in result.cells))
    for source in result.sources:
        for mode in modes:
            cells = [c for c in result.cells if c.source == source and c.mode == mode]
            if not cells:
                continue
            libs = list(dict.fromkeys(c.library for c in cells))
            fmts = [f for f in result.formats if any(c.format == f for c in cells)]
            by = {(c.library, c.format): c for c in cells}
            rows = [
                [f] + [_cell_text(by[(lib, f)]) if (lib, f) in by else "·" for lib in libs]
                for f in fmts
            ]
            out.append((f"from {source}, {mode}", _table(["format", *libs], rows)))
    return out


def _num(v: float | None) -> str:
    if v is None:
        return "—"
    if math.isnan(v):
        return "nan"
    return repr(v)


def _example_row(e: Example, bits: int) -> list[str]:
    width = (bits + 3) // 4
    if e.output is None:
        got = f"no code ({_num(e.output_value)}{'; ' + e.note if e.note else ''})"
    else:
        got = f"0x{e.output:0{width}x} ({_num(e.output_value)})"
    return [
        f"{_num(e.input)} ({e.input_bits})",
        got,
        f"0x{e.exact:0{width}x} ({_num(e.exact_value)})",
    ]


def _format_bits(name: str) -> int:
    return get_format(name).bits


def markdown(result: Result) -> str:
    """The whole report as Markdown."""
    total = sum(c.mismatches for c in result.cells)
    lines = [
        "# Conformance of number conversions",
        "",
        f"{len(result.cells)} conversions (library x format x source type x rounding mode), "
        f"{sum(c.inputs for c in result.cells)} inputs, {total} disagreements with the exact "
        f"reference; {result.checked_by_arbiter} results re-checked with Python fractions "
        f"(`bits.reference.encode_scalar`). Ran in {result.seconds:.1f} s.",
        "",
        "Libraries: "
        + ", ".join(f"{k} {v or ''}".strip() for k, v in result.versions.items())
        + ".",
        "",
        LEGEND,
        "",
        "## Matrix",
    ]
    for title, table in matrix_tables(result):
        lines += ["", f"### {title}", "", table]
    if result.skipped:
        lines += ["", "## Skipped", ""]
        lines += [f"- {lib}: {why}" for lib, why in result.skipped.items()]
    if result.unsupported:
        lines += ["", "## Not supported", ""]
        for lib, why in result.unsupported.items():
            by_reason: dict[str, list[str]] = {}
            for what, reason in why.items():
                by_reason.setdefault(reason, []).append(what)
            for reason, whats in by_reason.items():
                lines.append(f"- {lib}: {', '.join(whats)}: {reason}")
    lines += ["", "## Disagreements", ""]
    used_specs: list[str] = []
    for cell in result.cells:
        if not cell.mismatches:
            continue
        lines += [
            f"### {cell.library}: {cell.format} from {cell.source} ({cell.mode}) — "
            f"{cell.mismatches} of {cell.inputs} inputs",
            "",
            f"Governing spec: {spec_for_format(cell.format)}.",
            "",
        ]
        bits = _format_bits(cell.format)
        for f in cell.findings:
            spec = SPECS[f.spec]
            used_specs.append(f.spec)
            lines.append(f"- **{f.title}** — {f.category}, {f.count} inputs; see {spec.source}")
            rows = [_example_row(e, bits) for e in f.examples]
            lines += ["", _indent(_table(["input (bits)", "library", "exact"], rows)), ""]
    lines += ["## Spec texts", ""]
    for key in dict.fromkeys(used_specs):
        spec = SPECS[key]
        text = f"“{spec.text}”" if spec.kind == "quote" else f"{spec.text} (paraphrase)"
        lines.append(f"- {spec.source}: {text}")
    lines += ["", "## Rules", ""]
    for rule, r in RULES.items():
        lines.append(f"- `{rule}` ({r.category}): {r.title}")
    return "\n".join(lines) + "\n"


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def to_json(result: Result) -> dict:
    """The result as plain data (cells with findings and examples, specs, rules)."""
    data = dataclasses.asdict(result)
    data["specs"] = {k: s._asdict() for k, s in SPECS.items()}
    data["rules"] = {k: r._asdict() for k, r in RULES.items()}
    return data


#: The files :func:`write_report` writes.
REPORT_FILES = ("report.md", "conformance.json", "environment.json")


def existing_results(out_dir: Path) -> list[str]:
    """The names among :data:`REPORT_FILES` (and a run's ``summary.json``) already in
    ``out_dir`` (links and other non-files included): what a write would replace."""
    return [n for n in (*REPORT_FILES, "summary.json") if os.path.lexists(Path(out_dir) / n)]


def write_report(result: Result, out_dir: Path, *, force: bool = False) -> Path:
    """Write ``report.md``, ``conformance.json`` and ``environment.json`` into ``out_dir``
    (created if needed); returns the report's path. ValueError when ``out_dir`` already holds
    results (:func:`existing_results`) unless ``force``; links are never followed."""
    out_dir = Path(out_dir)
    found = existing_results(out_dir)
    if found and not force:
        raise ValueError(
            f"{out_dir} already holds {', '.join(found)}; choose a new --out directory or "
            "pass --force to replace them"
        )
    store.makedirs(out_dir)
    with store.confined(out_dir):
        path = out_dir / "report.md"
        store.write_text(path, markdown(result))
        store.write_json(out_dir / "conformance.json", to_json(result))
        store.write_json(out_dir / "environment.json", store.environment())
    return path
