"""Conformance of number conversions: which libraries and backends convert numbers correctly.

Every library that is installed (ml_dtypes, XLA on each JAX backend, numpy, gfloat, torch)
converts an edge-case input set into every format it supports, and each result is compared
with the exact reference (:mod:`precisionlab.bits.reference`, vectorized exactly in
:mod:`._exact`). Disagreements are classified as spec violations, documented conventions or
undefined cases, each with the spec text it rests on (:mod:`._spec`).

Layering: uses formats and bits; writes into the run store of :mod:`precisionlab.experiments`.
"""

from precisionlab.conformance._adapters import LIBRARIES, Claim
from precisionlab.conformance._cases import SOURCES, edge_inputs
from precisionlab.conformance._classify import CATEGORIES, RULES, classify
from precisionlab.conformance._exact import encode_exact, is_midpoint
from precisionlab.conformance._report import markdown, matrix_tables, to_json, write_report
from precisionlab.conformance._run import (
    DEFAULT_LIBS,
    DEFAULT_SOURCES,
    Result,
    default_formats,
    run_conformance,
)

__all__ = [
    "CATEGORIES",
    "DEFAULT_LIBS",
    "DEFAULT_SOURCES",
    "LIBRARIES",
    "RULES",
    "SOURCES",
    "Claim",
    "Result",
    "classify",
    "default_formats",
    "edge_inputs",
    "encode_exact",
    "is_midpoint",
    "markdown",
    "matrix_tables",
    "run_conformance",
    "to_json",
    "write_report",
]
