"""Record a low-precision step where it runs, recompute it exactly anywhere, and name the
first thing that went wrong.

- :func:`record` runs one step of any JAX function (under a recipe, or as it is: plain
  16-bit dtypes, a policy's casts) and writes a dump: every GEMM's quantize inputs, scales,
  element codes, stochastic-rounding keys, operands and outputs in program order, the
  delayed-scaling state before and after, the step's outputs and the environment;
  :func:`estimate` gives its size first; :class:`RecordHook` records chosen steps of a
  training loop (``precisionlab run --record-steps 1,100``).
- :func:`check` (``precisionlab verify DIR``) recomputes every recorded tensor from its
  recorded inputs with the exact codecs, the recipe's rules and the GEMM model the dump
  names, and reports per tensor the bit-equal share and the largest difference in ULPs, the
  first difference in program order and its mechanism (:data:`LABELS`).
- :func:`gemm_dump` writes GEMMs computed elsewhere (an H100's captured outputs,
  ``torch._scaled_mm``) as a dump that :func:`check` recomputes with a hardware model.

The dump format (a directory with ``manifest.json`` and ``.npz`` arrays, version
:data:`FORMAT_VERSION`) is documented in ``docs/reference/verify-dump-format.md``.
"""

from precisionlab.verify._capture import gemm_dump
from precisionlab.verify._check import LABELS, Report, TensorCheck, check, find_dumps
from precisionlab.verify._format import FORMAT_VERSION, Dump, DumpError, read_dump
from precisionlab.verify._hook import RecordHook
from precisionlab.verify._models import HARDWARE_MODELS
from precisionlab.verify._record import (
    DEFAULT_MAX_BYTES,
    GEMM_MODES,
    Recording,
    estimate,
    record,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "FORMAT_VERSION",
    "GEMM_MODES",
    "HARDWARE_MODELS",
    "LABELS",
    "Dump",
    "DumpError",
    "RecordHook",
    "Recording",
    "Report",
    "TensorCheck",
    "check",
    "estimate",
    "find_dumps",
    "gemm_dump",
    "read_dump",
    "record",
]
