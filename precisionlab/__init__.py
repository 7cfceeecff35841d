"""precisionlab: exact, measured answers about number formats, quantization and mixed precision.

The curated top-level API; the submodules (``formats``, ``bits``, ``quant``, ``metrics``,
``mixed``, ``train``, ``memory``, ``experiments``) hold the rest.

Names are imported on first use (PEP 562): ``import precisionlab`` alone imports neither JAX
nor a submodule, so that ``precisionlab --version`` answers at once.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = [
    "ROUNDING_MODES",
    "Class",
    "FloatFormat",
    "IntFormat",
    "QArray",
    "Rounding",
    "Specials",
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

#: Each top-level name -> the module it comes from.
_HOME = {
    **dict.fromkeys(
        ("ROUNDING_MODES", "Class", "Rounding", "classify", "decode", "encode", "fields",
         "round_to_format"),
        "precisionlab.bits",
    ),
    **dict.fromkeys(
        ("FloatFormat", "IntFormat", "Specials", "format_names", "get_format"),
        "precisionlab.formats",
    ),
    **dict.fromkeys(("QArray", "dequantize", "fake_quant", "quantize"), "precisionlab.quant"),
}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
    else:  # a submodule (``precisionlab.quant``), as an eager import made it an attribute
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
