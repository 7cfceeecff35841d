"""precisionlab: exact, measured answers about number formats, quantization and mixed precision."""

from precisionlab.formats import FloatFormat, IntFormat, Specials, format_names, get_format

__version__ = "0.1.0"

__all__ = ["FloatFormat", "IntFormat", "Specials", "format_names", "get_format"]
