"""precisionlab: exact, measured answers about number formats, quantization and mixed precision.

The curated top-level API; the submodules (``formats``, ``bits``, ``quant``, ``metrics``,
``mixed``, ``train``, ``memory``, ``experiments``) hold the rest. :func:`audit` says which
dtype each matmul and convolution of a function multiplies in
(:mod:`precisionlab.compute_audit`).

Names are imported on first use (PEP 562): ``import precisionlab`` alone imports neither JAX
nor a submodule, so that ``precisionlab --version`` answers at once.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

__version__ = "0.1.0"  # the one place: pyproject.toml reads it (dynamic version)

__all__ = [
    "ROUNDING_MODES",
    "Class",
    "FloatFormat",
    "IntFormat",
    "QArray",
    "Rounding",
    "Specials",
    "audit",
    "classify",
    "decode",
    "dequantize",
    "encode",
    "fake_quant",
    "fields",
    "format_names",
    "get_format",
    "quantize",
    "round_to_format",
]

_BITS = ("ROUNDING_MODES", "Class", "Rounding", "classify", "decode", "encode", "fields",
         "round_to_format")  # fmt: skip
_FORMATS = ("FloatFormat", "IntFormat", "Specials", "format_names", "get_format")
_QUANT = ("QArray", "dequantize", "fake_quant", "quantize")


def __getattr__(name: str) -> Any:
    # the three subpackages an eager import made attributes of the package, and their names
    home: ModuleType
    if name == "bits" or name in _BITS:
        import precisionlab.bits as home
    elif name == "formats" or name in _FORMATS:
        import precisionlab.formats as home
    elif name == "quant" or name in _QUANT:
        import precisionlab.quant as home
    elif name == "audit":
        from precisionlab.compute_audit import audit

        globals()[name] = audit
        return audit
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = home if name in ("bits", "formats", "quant") else getattr(home, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
