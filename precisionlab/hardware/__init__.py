"""Hardware-exact GEMMs: what a tensor core and its library compute, bit for bit, anywhere.

- :class:`Step`: one tensor-core step as data; :data:`PROFILES`: each device's steps with
  their sources (Hopper checked against H100 captures);
- :class:`Schedule`: how a library runs steps over K (one chain, restart every N, split-K,
  upcast); :data:`PRESETS`: names (``"h100-fast"``, ``"h100"``, ...) for device + library;
- :func:`gemm` / :func:`dot_general`: the vectorized model under ``jit``/``vmap``;
- :mod:`precisionlab.hardware.reference`: the scalar reference (Python integers).
"""

from precisionlab.hardware.gemm import dot_general, gemm
from precisionlab.hardware.presets import LIBRARIES, PRESETS, preset, resolve
from precisionlab.hardware.profiles import PROFILES, Profile, get_profile
from precisionlab.hardware.schedule import Schedule
from precisionlab.hardware.step import Step

__all__ = [
    "LIBRARIES",
    "PRESETS",
    "PROFILES",
    "Profile",
    "Schedule",
    "Step",
    "dot_general",
    "gemm",
    "get_profile",
    "preset",
    "resolve",
]
