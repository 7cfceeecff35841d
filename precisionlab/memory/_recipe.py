"""The memory a low-precision matmul recipe adds to a training step, as hardware would hold it.

A recipe (:mod:`precisionlab.recipes`) quantizes the operands of every GEMM of a linear layer
``y = x @ w`` (x: M x K tokens by features, w: K x N, output gradient g: M x N) along the
contraction axis of the GEMM that reads them:

- fprop ``x @ w``: x along K (M rows), w along K (N rows);
- dgrad ``g @ w.T``: g along N (M rows), w along N (K rows);
- wgrad ``x.T @ g``: x along M (K rows), g along M (N rows).

So each tensor has a *rowwise* and a *columnwise* copy (Transformer Engine keeps both, because
a GEMM reads its operands contiguous along the contraction axis), and each copy has its own
scales unless the scale is one per tensor (delayed, current) or per square tile (blockwise
and NVFP4 weights, shared by both copies). What is counted, in bytes:

- ``weight_codes`` / ``weight_scales``: both copies of every weight (kept for the step;
  TE caches them over micro-batches);
- ``saved_codes`` / ``saved_scales``: copies kept from the forward to the backward pass: the
  columnwise x of every GEMM (for wgrad), and both copies of a right operand that is an
  activation (the attention products);
- ``transient``: the copies of one GEMM at a time (x rowwise, both copies of g), the largest;
- ``amax_history``: delayed scaling's state, as :mod:`precisionlab.recipes` keeps it per
  matmul: a float32 (L, 3) history, 3 scales and 3 probe slots.

Element codes take the element format's bits (E4M3/E5M2 8, E2M1 4, ...). Scales: float32 per
tensor (delayed, current), per row (rowwise), per 1 x 128 block or 128 x 128 weight tile
(blockwise); one E8M0 byte per 32 elements (MX: 8.25 bits per element for MXFP8); one E4M3
byte per 16 elements (or 16 x 16 weight tile) plus one float32 per tensor (NVFP4: 4.5 bits).
``rowwise_with_gw_hp`` runs wgrad unquantized, so it has no columnwise x or g copy.

Not counted here: the high-precision tensors the recipe quantizes from (master weights, the
compute copy and the block's activations are in :class:`~precisionlab.memory.Breakdown`;
the recipe adds to them: the counts here are an upper bound where a kernel saves the FP8 copy
*instead* of a high-precision input).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, NamedTuple

from precisionlab.memory._estimate import ModelSpec, TrainSetup
from precisionlab.memory._rows import byte_dict, byte_rows, byte_sum
from precisionlab.recipes import (
    MX,
    NVFP4,
    Blockwise,
    Current,
    Delayed,
    FP4Recipe,
    Recipe,
    Reference,
    Rowwise,
)

__all__ = [
    "Gemm",
    "RecipeMemory",
    "bits_per_element",
    "builtin_gemms",
    "copy_bytes",
    "model_gemms",
    "recipe_memory",
]

_E2M1_BITS = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemm:
    """One matmul site ``(batch, m, k) @ (batch, k, n)``; ``weight``: the right operand is a
    parameter (False for the attention products, whose both operands are activations)."""

    name: str
    m: int
    k: int
    n: int
    batch: int = 1
    weight: bool = True


@dataclasses.dataclass(frozen=True)
class RecipeMemory:
    """Bytes a recipe adds to one training step (see the module docstring)."""

    _ROWS = (
        ("FP8/FP4 weight copies (rowwise + columnwise)", "weight_codes"),
        ("weight scales", "weight_scales"),
        ("saved activation copies (columnwise)", "saved_codes"),
        ("saved activation scales", "saved_scales"),
        ("transient copies (largest GEMM)", "transient"),
        ("amax history (delayed scaling)", "amax_history"),
        ("recipe total", "total"),
    )

    recipe: str
    weight_codes: int
    weight_scales: int
    saved_codes: int
    saved_scales: int
    transient: int
    amax_history: int

    @property
    def total(self) -> int:
        return byte_sum(self, (name for _, name in self._ROWS[:-1]))  # the rows above it

    def rows(self) -> list[tuple[str, int]]:
        """(label, bytes) in display order."""
        return byte_rows(self, self._ROWS)

    def to_dict(self) -> dict[str, Any]:
        return byte_dict(self, ("total",))


def _elem_bits(recipe: Recipe, kind: str) -> int:
    if isinstance(recipe, Reference):
        return 16 if recipe.dtype == "bfloat16" else 32
    if isinstance(recipe, NVFP4):
        return _E2M1_BITS
    if hasattr(recipe, "fmt"):
        return int(recipe.fmt(kind).bits)
    return 8  # rowwise, blockwise: E4M3


def _scale_count(recipe: Recipe, kind: str, rows: int, k: int) -> tuple[int, int]:
    """(number of scales, bytes per scale) of one copy of ``rows`` x ``k`` along k."""
    if isinstance(recipe, (Delayed, Current)):
        return 1, 4
    if isinstance(recipe, Rowwise):
        return rows, 4
    if isinstance(recipe, (Blockwise, MX, NVFP4)):
        b = recipe.block
        per = 4 if isinstance(recipe, Blockwise) else 1  # float32; E8M0 / E4M3 bytes
        if recipe.two_d(kind):
            return math.ceil(rows / b) * math.ceil(k / b), per
        return rows * math.ceil(k / b), per
    if isinstance(recipe, Reference):
        return 0, 0
    raise ValueError(f"no memory rule for recipe {recipe.name!r}")


def copy_bytes(recipe: Recipe, kind: str, rows: int, k: int) -> tuple[int, int]:
    """(code bytes, scale bytes) of one copy of a ``rows`` x ``k`` operand of ``kind``
    (``"x"``, ``"w"``, ``"g"``) quantized along ``k``; NVFP4 adds its float32 per-tensor
    scale."""
    codes = math.ceil(rows * k * _elem_bits(recipe, kind) / 8)
    n, per = _scale_count(recipe, kind, rows, k)
    extra = 4 if isinstance(recipe, NVFP4) else 0
    return codes, n * per + extra


def bits_per_element(recipe: Recipe, kind: str, rows: int, k: int) -> float:
    """Storage bits per element of one copy, scales included (MXFP8 on 32-blocks: 8.25)."""
    codes, scales = copy_bytes(recipe, kind, rows, k)
    return 8 * (codes + scales) / (rows * k)


def _shared_scales(recipe: Recipe, kind: str) -> bool:
    """Whether the rowwise and columnwise copies share their scales (one per tensor, or
    square tiles)."""
    return isinstance(recipe, (Delayed, Current)) or recipe.two_d(kind)


class _Copies(NamedTuple):
    """Bytes of quantized copies: their codes and their scales."""

    codes: int
    scales: int

    def plus(self, copies: tuple[int, int], times: int = 1) -> _Copies:
        """These and ``times`` x ``copies`` (codes, scales)."""
        return _Copies(self.codes + times * copies[0], self.scales + times * copies[1])


def _pair(recipe: Recipe, kind: str, r: int, c: int, batch: int) -> tuple[int, int]:
    """(codes, scales) of both copies of a ``r`` x ``c`` tensor (along c, then along r)."""
    c1, s1 = copy_bytes(recipe, kind, r, c)
    c2, s2 = copy_bytes(recipe, kind, c, r)
    scales = s1 if _shared_scales(recipe, kind) else s1 + s2
    return batch * (c1 + c2), batch * scales


def recipe_memory(recipe: Recipe, gemms: list[Gemm]) -> RecipeMemory:
    """What ``recipe`` adds for the matmul sites ``gemms`` (see :class:`RecipeMemory`)."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a precisionlab.recipes.Recipe, got {recipe!r}")
    if isinstance(recipe, FP4Recipe):  # their copies (rotations, EMAs, 4-or-6) are not modelled
        raise ValueError(
            f"memory accounting does not model the 4-bit training recipe {type(recipe).__name__} "
            "(its rotated copies and state); it models delayed, current, rowwise, blockwise, "
            "mxfp8, mxfp4, nvfp4, bf16 and fp32"
        )
    weights = saved = _Copies(0, 0)
    transient = 0
    hp_wgrad = recipe.wgrad_hp
    for g in gemms:
        rhs = _pair(recipe, "w", g.k, g.n, g.batch)  # rhs: fprop along k, dgrad along n
        if g.weight:
            weights = weights.plus(rhs)
        else:
            saved = saved.plus(rhs)
        if not hp_wgrad:  # x along m, for wgrad
            saved = saved.plus(copy_bytes(recipe, "x", g.k, g.m), g.batch)
        xc, xs = copy_bytes(recipe, "x", g.m, g.k)
        if hp_wgrad:
            gc, gs = copy_bytes(recipe, "g", g.m, g.n)
        else:
            gc, gs = _pair(recipe, "g", g.m, g.n, 1)
        transient = max(transient, g.batch * (xc + xs + gc + gs))
    history = 0
    if isinstance(recipe, Delayed):
        history = len(gemms) * 4 * 3 * (recipe.amax_history_len + 2)
    return RecipeMemory(
        recipe=_describe(recipe),
        weight_codes=weights.codes,
        weight_scales=weights.scales,
        saved_codes=saved.codes,
        saved_scales=saved.scales,
        transient=transient,
        amax_history=history,
    )


def _describe(recipe: Recipe) -> str:
    key = {"element", "scale_rule", "amax_history_len", "hadamard"}  # named even at default
    fields = {
        f.name: getattr(recipe, f.name)
        for f in dataclasses.fields(recipe)
        if getattr(recipe, f.name) != f.default or f.name in key
    }
    extra = ", ".join(f"{k}={v}" for k, v in fields.items())
    return f"{recipe.name}({extra})" if extra else recipe.name


def model_gemms(model: ModelSpec, setup: TrainSetup, *, unembed: bool = False) -> list[Gemm]:
    """The linear layers of ``model`` for one micro-batch of ``setup``: per block qkv, the
    attention output projection, fc1 and fc2 (the attention products run in a fused
    high-precision kernel, as in TE); with ``unembed`` the logits matmul too (TE keeps it in
    high precision by default)."""
    tokens = (setup.batch // setup.microbatches) * (setup.seq or model.seq_len)
    h, ha, f = model.d_model, model.n_heads * model.d_head, model.ffn_width
    out = []
    for i in range(model.n_layers):
        out += [
            Gemm(name=f"{i}.qkv", m=tokens, k=h, n=3 * ha),
            Gemm(name=f"{i}.proj", m=tokens, k=ha, n=h),
            Gemm(name=f"{i}.fc1", m=tokens, k=h, n=f),
            Gemm(name=f"{i}.fc2", m=tokens, k=f, n=h),
        ]
    if unembed:
        out.append(Gemm(name="unembed", m=tokens, k=h, n=model.vocab))
    return out


def builtin_gemms(model: Any, batch: int) -> list[Gemm]:
    """Every matmul site of a built-in model as ``precisionlab.train`` runs it with a recipe.
    Transformer: per block qkv, the two attention products (heads x batch of them), the
    projection, fc1, fc2; then the unembedding. MLP: each dense layer."""
    if model.name == "mlp":
        widths = [model.in_dim] + [model.width] * model.depth + [model.num_classes]
        return [
            Gemm(name=f"dense{i}", m=batch, k=a, n=b)
            for i, (a, b) in enumerate(itertools.pairwise(widths))
        ]
    if model.name != "transformer":
        raise ValueError(
            f"no matmul list for built-in model {model.name!r}; allowed: mlp, transformer"
        )
    s, d, f = model.seq_len, model.d_model, model.d_model * model.mlp_ratio
    t, dh, bh = batch * s, model.d_model // model.heads, batch * model.heads
    out = []
    for i in range(model.depth):
        out += [
            Gemm(name=f"{i}.qkv", m=t, k=d, n=3 * d),
            Gemm(name=f"{i}.scores", m=s, k=dh, n=s, batch=bh, weight=False),
            Gemm(name=f"{i}.values", m=s, k=s, n=dh, batch=bh, weight=False),
            Gemm(name=f"{i}.proj", m=t, k=d, n=d),
            Gemm(name=f"{i}.fc1", m=t, k=d, n=f),
            Gemm(name=f"{i}.fc2", m=t, k=f, n=d),
        ]
    out.append(Gemm(name="unembed", m=t, k=d, n=model.vocab_size))
    return out
