"""Schedules: how a library runs tensor-core steps over K, and converts the result.

- one chain (``restart_every=None``): the accumulator is carried through every step over K
  (cuBLASLt with fast accumulation);
- restart every N (``restart_every=N``): the chain restarts from zero every N k and its result
  is added into a float32 register, rounded to nearest even (cuBLASLt's default for FP8 with
  N = 128, DeepSeek-V3's promotion, Triton's promotion every BLOCK_K);
- split-K (``split_k=W`` when ``K >= split_k_min_k``): K is cut into W-wide slices, each run
  as above, and the slices are summed in float32 in ``split_order``: ``"sequential"``
  (``((s0 + s1) + s2) + ...``) or a butterfly given as bit order (``(4, 3, 2, 1, 0)`` adds
  slice i to slice i + 16 first, then i + 8, ...);
- ``upcast``: inputs converted (exactly) to this dtype first, as XLA's Triton kernels do
  with FP8 on small tiles (they then run 16-bit steps);
- ``k_order``: which k each step takes. ``"natural"``: consecutive k. ``"fp8_pairs"``
  (XLA's Triton FP8 GEMMs on an H100, upcast to float16): in every 32-k block the first
  16-product step takes the k with ``k % 4`` in {0, 1} and the second those in {2, 3} (the
  FP8 operand registers hold 4 consecutive k; each splits into two float16 pairs, one per
  ``mma.m16n8k16``). K is padded with zeros to a multiple of 32. Found on the 2026-11-27
  H100 capture ``tests/data/h100_xla_fp8_slices.npz`` (every output, bit for bit).

The output conversion (``alpha = fl32(scale_a * scale_b)``, ``y = fl32(acc * alpha)``,
``y = fl32(y + bias)``, then rounding to nearest even to the output dtype) is part of
:func:`precisionlab.hardware.gemm`: it matched every ``torch._scaled_mm`` capture.
"""

from __future__ import annotations

import dataclasses

__all__ = ["K_ORDERS", "Schedule"]

#: Orders in which the steps take k (:class:`Schedule` ``k_order``).
K_ORDERS = ("natural", "fp8_pairs")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    """How the steps run over K (see the module docstring). Frozen and hashable."""

    restart_every: int | None = None
    split_k: int | None = None
    split_k_min_k: int = 0
    split_order: str | tuple[int, ...] = "sequential"
    upcast: str | None = None
    k_order: str = "natural"

    def __post_init__(self) -> None:
        for name in ("restart_every", "split_k"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"Schedule.{name} must be a positive int or None, got {v!r}")
        o = self.split_order
        if isinstance(o, list):
            object.__setattr__(self, "split_order", tuple(o))
            o = self.split_order
        if not (o == "sequential" or (isinstance(o, tuple) and sorted(o) == list(range(len(o))))):
            raise ValueError(
                f"Schedule.split_order must be 'sequential' or a permutation of 0..n-1 "
                f"(butterfly bit order), got {o!r}"
            )
        if self.upcast not in (None, "float16", "bfloat16"):
            raise ValueError(
                f"Schedule.upcast must be None, 'float16' or 'bfloat16', got {self.upcast!r}"
            )
        if self.k_order not in K_ORDERS:
            raise ValueError(
                f"Schedule.k_order must be one of {', '.join(K_ORDERS)}, got {self.k_order!r}"
            )
