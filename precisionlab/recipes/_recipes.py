"""The recipes: small frozen dataclasses stating each vendor's scaling rule.

Every recipe quantizes the operands of the three GEMMs of a matmul (fprop ``y = x w``, dgrad
``dx = g w^T``, wgrad ``dw = x^T g``) along their contraction axis. Operands have a *kind*:
``"x"`` (activation), ``"w"`` (weight) or ``"g"`` (gradient); a transposed operand (``w^T``
in dgrad, ``x^T`` and ``g^T`` in wgrad) is quantized from the high-precision tensor, not from
its quantized copy (as Transformer Engine does for MXFP8).

Common fields (accumulator emulation): ``accumulate`` (None: float32 products summed by XLA
at HIGHEST precision, or the study model below when ``accumulate_bits`` is set; a hardware
preset of :data:`precisionlab.hardware.PRESETS` such as ``"h100-cublaslt-fast"`` (alias
``"h100-fast"``) or ``"h100-cublaslt"``: the
GEMM computed bit for bit as that device and library do, see :mod:`precisionlab.hardware`;
the block-scaled recipes MX (FP8 or FP4 elements) and NVFP4 take only presets with a
block-scaled MMA (``"b200"``), which multiplies their elements and block scales as
Blackwell does (:mod:`precisionlab.recipes._blockhw`), and raise otherwise, as Blockwise
always does; ``"sequential"``: the study model, named explicitly). The *sequential study model* (see
:mod:`precisionlab.recipes._accumulate`; not hardware: no tensor core rounds after every
product) is configured by ``accumulate_bits`` (None: float32; m: partial sums kept to m
mantissa bits),
``accumulate_rounding`` (``"nearest_even"`` or ``"toward_zero"``) and ``promote_every``
(None, or N: the narrow partial sum is added into a float32 accumulator every N products,
as DeepSeek-V3 does with N = 128).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import ArrayLike

from precisionlab import hardware as hw
from precisionlab.formats import FloatFormat
from precisionlab.hardware import canonical_preset
from precisionlab.quant._mx import SCALE_RULES
from precisionlab.recipes import _blockhw
from precisionlab.recipes import _scaling as S

__all__ = [
    "MX",
    "NVFP4",
    "RECIPE_NAMES",
    "Blockwise",
    "Current",
    "Delayed",
    "Recipe",
    "Reference",
    "Rowwise",
    "get_recipe",
]

E4M3 = S.E4M3
E5M2 = S.float_format("float8_e5m2")
KINDS = ("x", "w", "g")
FP8_FORMATS = ("HYBRID", "E4M3")
ACC_ROUNDINGS = ("nearest_even", "toward_zero")


def _fp8_formats(fp8_format: str) -> dict[str, FloatFormat]:
    if fp8_format not in FP8_FORMATS:
        is_e5m2 = str(fp8_format).upper() == "E5M2"
        extra = " (an E5M2 forward is not a recipe: E5M2 is for gradients)" if is_e5m2 else ""
        raise ValueError(
            f"unknown fp8_format {fp8_format!r}{extra}; allowed: {', '.join(FP8_FORMATS)}"
        )
    return {"x": E4M3, "w": E4M3, "g": E5M2 if fp8_format == "HYBRID" else E4M3}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """Base: the accumulator fields shared by every recipe (see the module docstring)."""

    name: ClassVar[str] = "recipe"
    stateful: ClassVar[bool] = False
    _deepgemm_ok: ClassVar[bool] = False  # takes the deepgemm presets (blockwise only)
    #: Fields whose values are numbers of the recipe's programs, not their structure (see
    #: :meth:`numbers`): recipes differing only in them compute with the same operations.
    value_fields: ClassVar[tuple[str, ...]] = ()
    accumulate: str | None = None
    accumulate_bits: int | None = None
    accumulate_rounding: str = "nearest_even"
    promote_every: int | None = None

    def __post_init__(self) -> None:
        acc = self.accumulate
        if acc is not None:
            if acc != "sequential":
                try:
                    canonical_preset(acc)
                except ValueError as e:
                    raise ValueError(
                        f"accumulate={acc!r}: {e}; or 'sequential' (the study model, with "
                        "accumulate_bits)"
                    ) from None
                if _library(acc) == "deepgemm" and not self._deepgemm_ok:
                    raise ValueError(
                        f"accumulate={acc!r}: DeepGEMM's kernels take FP8 operands with "
                        "1 x 128 / 128 x 128 block scales, which only the blockwise recipe "
                        f"makes; not the {self.name} recipe (per-tensor and per-row recipes "
                        "take 'h100-cublaslt', 'h100-cublaslt-fast', 'h100-xla', ...; mxfp8, "
                        "mxfp4 and nvfp4 take 'b200')"
                    )
            if acc == "sequential" and self.accumulate_bits is None:
                raise ValueError("accumulate='sequential' needs accumulate_bits")
            if acc != "sequential" and self.accumulate_bits is not None:
                raise ValueError(
                    f"accumulate={acc!r} (hardware) and accumulate_bits (the sequential study "
                    "model) exclude each other"
                )
        for f in dataclasses.fields(self):
            # a TOML string "no" would be truthy: flags must be real booleans
            if f.type in ("bool", bool) and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.name} must be true or false, got {getattr(self, f.name)!r}")
        b = self.accumulate_bits
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 23):
            raise ValueError(f"accumulate_bits must be an int in 1..23 or None, got {b!r}")
        if self.accumulate_rounding not in ACC_ROUNDINGS:
            raise ValueError(
                f"unknown accumulate_rounding {self.accumulate_rounding!r}; "
                f"allowed: {', '.join(ACC_ROUNDINGS)}"
            )
        p = self.promote_every
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p < 1):
            raise ValueError(f"promote_every must be a positive int or None, got {p!r}")
        if p is not None and b is None:
            raise ValueError("promote_every needs accumulate_bits (a narrow accumulator)")

    @property
    def wgrad_hp(self) -> bool:
        """The weight-gradient GEMM stays in high precision (torchao rowwise_with_gw_hp)."""
        return False

    # --- numbers: the value fields as arguments of a program --------------------------------
    def numbers(self) -> dict[str, ArrayLike]:
        """The float32 arrays the recipe computes with that its :attr:`value_fields` give,
        derived on the host (``{}`` for a recipe without value fields)."""
        return {}

    def structure(self) -> Recipe:
        """This recipe with its value fields set to fixed ones: recipes with equal structures
        differ only in :meth:`numbers` (the key of a program that takes them as arguments)."""
        return self

    def with_numbers(self, numbers: Mapping[str, ArrayLike] | None) -> Recipe:
        """A copy that computes with ``numbers`` (the arrays of :meth:`numbers`, e.g. traced
        arguments of a jitted function) instead of constants derived from its fields; None:
        the constants."""
        if numbers is None and self.given_numbers is None:
            return self
        out = dataclasses.replace(self)
        object.__setattr__(out, "_numbers", None if numbers is None else dict(numbers))
        return out

    @property
    def given_numbers(self) -> dict[str, ArrayLike] | None:
        """The numbers :meth:`with_numbers` gave, or None."""
        return getattr(self, "_numbers", None)

    def _number(self, key: str) -> ArrayLike:
        given = self.given_numbers
        return self.numbers()[key] if given is None else given[key]

    def two_d(self, kind: str) -> bool:
        """Whether operands of this kind use square 2-D tiles (weights in blockwise, NVFP4)."""
        return False

    def block_sizes(self, kind: str) -> tuple[int, ...]:
        """Sizes the operand's contraction axis (and, for 2-D blocks, its rows) must be
        multiples of."""
        return ()

    def pad_ok(self) -> bool:
        return bool(getattr(self, "pad", False))

    def quantize(
        self, t: Array, kind: str, *, scale: Array | None = None, key: Array | None = None
    ) -> S.QOperand:
        """Quantize a float32 (B, R, K) operand of ``kind`` along K (``scale``: the per-tensor
        scale of a stateful recipe's state; ``key``: for stochastic rounding)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reference(Recipe):
    """No quantization: operands rounded to ``dtype`` (``"bfloat16"`` or ``"float32"``),
    products accumulated in float32 (``preferred_element_type=float32``), so experiments
    compare a recipe with the same code path in 16 or 32 bits."""

    name: ClassVar[str] = "reference"
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"Reference dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")

    def quantize(
        self, t: Array, kind: str, *, scale: Array | None = None, key: Array | None = None
    ) -> S.QOperand:
        if self.dtype == "float32":
            return S.QOperand(t, None, None)
        return S.QOperand(t.astype(jnp.bfloat16).astype(jnp.float32), None, None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Delayed(Recipe):
    """Per-tensor delayed scaling (NVIDIA Transformer Engine ``DelayedScaling``).

    Rule: each step quantizes with the scale in the state, ``cast(x * scale)`` saturating to
    the format's max; it records ``amax(x)``; after the step the amax history (window of the
    last ``amax_history_len`` amaxes) gives ``amax = max(history)`` (``"max"``) or the newest
    (``"most_recent"``), and ``scale = (fp8_max / amax) / 2**margin``, the old scale being
    kept where amax is 0 or non-finite. Formats: ``"HYBRID"`` (E4M3 forward, E5M2 gradients;
    the default) or ``"E4M3"``. Initial scale 1, history zeros. State per matmul: one
    history and scale for each of lhs, rhs and the output gradient.
    """

    name: ClassVar[str] = "delayed"
    stateful: ClassVar[bool] = True
    value_fields: ClassVar[tuple[str, ...]] = ("margin",)
    fp8_format: str = "HYBRID"
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        _fp8_formats(self.fp8_format)
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"unknown amax_compute_algo {self.amax_compute_algo!r}; allowed: max, most_recent"
            )
        if isinstance(self.amax_history_len, bool) or not (
            isinstance(self.amax_history_len, int) and 1 <= self.amax_history_len <= 1 << 16
        ):
            raise ValueError(
                f"amax_history_len must be an int in 1..65536, got {self.amax_history_len!r}"
            )
        m = self.margin
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= 127:
            raise ValueError(f"margin must be an int in 0..127 (binades), got {m!r}")

    def fmt(self, kind: str) -> FloatFormat:
        return _fp8_formats(self.fp8_format)[kind]

    def numbers(self) -> dict[str, ArrayLike]:
        # 2**margin is exact in float32 for every margin allowed (0..127)
        return {"margin_scale": np.float32(2.0**self.margin)}

    def structure(self) -> Recipe:
        return dataclasses.replace(self, margin=0)

    def quantize(
        self, t: Array, kind: str, *, scale: Array | None = None, key: Array | None = None
    ) -> S.QOperand:
        if scale is None:
            raise ValueError(
                "the delayed recipe quantizes with the scale of its state: pass scale= (the "
                "state's, see init_site_state)"
            )
        return S.with_scale(t, scale, self.fmt(kind))

    def next_scale(self, history: Array, scale: Array, kind_max: Array) -> Array:
        """New scale from a history (L, ...) whose row 0 is the newest amax."""
        a = jnp.max(history, axis=0) if self.amax_compute_algo == "max" else history[0]
        sf = (kind_max / a) / jnp.asarray(self._number("margin_scale"), jnp.float32)
        ok = (a > 0) & jnp.isfinite(a)
        return jnp.where(ok, sf, scale)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Current(Recipe):
    """Per-tensor current (dynamic) scaling: TE ``Float8CurrentScaling``, torchao
    ``tensorwise``.

    Rule: ``scale = fp8_max / max(amax, eps)`` (float64, rounded to float32; torchao's eps
    1e-12), rounded down to a power of two if ``pow2_scales``; elements ``cast(x * scale)``
    saturating. Formats as :class:`Delayed` (default HYBRID: E4M3 forward, E5M2 gradients).
    """

    name: ClassVar[str] = "current"
    value_fields: ClassVar[tuple[str, ...]] = ("eps",)
    fp8_format: str = "HYBRID"
    eps: float = 1e-12
    pow2_scales: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _fp8_formats(self.fp8_format)
        if not (isinstance(self.eps, (int, float)) and self.eps >= 0):
            raise ValueError(f"eps must be a number >= 0, got {self.eps!r}")

    def fmt(self, kind: str) -> FloatFormat:
        return _fp8_formats(self.fp8_format)[kind]

    def numbers(self) -> dict[str, ArrayLike]:
        return _eps_numbers(self.eps, self.fmt)

    def structure(self) -> Recipe:
        return dataclasses.replace(self, eps=_eps_structure(self.eps))

    def quantize(
        self, t: Array, kind: str, *, scale: Array | None = None, key: Array | None = None
    ) -> S.QOperand:
        eps = _eps(self, kind)
        return S.tensorwise(t, self.fmt(kind), eps=eps, pow2_scales=self.pow2_scales)[0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rowwise(Recipe):
    """Row-wise scaling (torchao ``rowwise``): one scale per row of each GEMM operand along
    its contraction axis, ``2**floor(log2(fp8_max / max(amax, eps)))`` (eps 1e-12), E4M3 for
    every operand (gradients included), elements ``cast(x * scale)`` saturating.

    ``gw_high_precision`` (torchao ``rowwise_with_gw_hp``): the weight-gradient GEMM runs
    unquantized, in the operands' own precision.
    """

    name: ClassVar[str] = "rowwise"
    value_fields: ClassVar[tuple[str, ...]] = ("eps",)
    eps: float = 1e-12
    gw_high_precision: bool = False

    @property
    def wgrad_hp(self) -> bool:
        return self.gw_high_precision

    def numbers(self) -> dict[str, ArrayLike]:
        return _eps_numbers(self.eps, lambda kind: E4M3)

    def structure(self) -> Recipe:
        return dataclasses.replace(self, eps=_eps_structure(self.eps))

    def quantize(
        self, t: Array, kind: str, *, scale: Array | None = None, key: Array | None = None
    ) -> S.QOperand:
        return S.per_row(t, E4M3, eps=_eps(self, kind))[0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Blocked(Recipe):
    """Base of the block recipes: ``block`` elements along the contraction axis share a scale;
    ``pad`` allows sizes that are not multiples of ``block`` (zeros fill the last block)."""

    block: int = 32
    pad: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_block(self.block)
        self._check_fields()
        if self.accumulate not in (None, "sequential"):
            self._check_hardware(self.accumulate)

    def block_sizes(self, kind: str) -> tuple[int, ...]:
        return (self.block,)

    def _check_fields(self) -> None:
        """The subclass's own field checks (before the hardware check, which reads them)."""

    def _check_hardware(self, acc: str) -> None:
        """ValueError unless preset ``acc`` computes this recipe's block-scaled GEMMs."""
        raise NotImplementedError

    def hardware_blocks(self, kind: str) -> tuple[str, str]:
        """(element dtype name, block-scale dtype name) of an operand of ``kind`` on
        Blackwell's block-scaled MMA (see :mod:`precisionlab.recipes._blockhw`)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Blockwise(Blocked):
    """Block scaling (DeepSeek-V3 section 3.3; TE ``Float8BlockScaling``): E4M3 everywhere;
    1 x ``block`` tiles along the contraction axis for activations and gradients,
    ``block`` x ``block`` tiles for weights; scale per tile
    ``2**floor(log2(float32(448 / amax)))`` (amax 0 -> 1). ``pad``: allow sizes that are not
    multiples of ``block`` (zeros fill the last tile: they change neither its amax nor the
    products); without it such a size is a ValueError.
    """

    name: ClassVar[str] = "blockwise"
    _deepgemm_ok: ClassVar[bool] = True
    block: int = 128

    def two_d(self, kind: str) -> bool:
        return kind == "w"

    def quantize(
        self, t: Array, kind: str, *, scale: Array | None = None, key: Array | None = None
    ) -> S.QOperand:
        return S.block_pow2(t, E4M3, self.block, two_d=kind == "w")[0]

    def _check_hardware(self, acc: str) -> None:
        works = deepgemm_presets()
        if _library(acc) != "deepgemm":
            raise ValueError(
                f"accumulate={acc!r}: the blockwise recipe's 1 x {self.block} and {self.block} "
                f"x {self.block} tiles are scaled outside the tensor cores, per 128-k chunk, as "
                "DeepGEMM's Hopper kernels do (DeepSeek-V3); that schedule is the preset "
                f"{', '.join(works)}. {acc!r} is not it (a block-scaled MMA takes MX or NVFP4 "
                "blocks, cuBLASLt's own Hopper block scaling is not modelled)"
            )
        if self.block != 128:
            raise ValueError(
                f"accumulate={acc!r}: DeepGEMM scales blocks of 128 along K (its kernels "
                f"assert BLOCK_K == 128); the recipe has block={self.block}: use block=128"
            )


def _library(acc: str) -> str:
    return hw.PRESETS[hw.canonical_preset(acc)][1]


def deepgemm_presets() -> tuple[str, ...]:
    """Hardware presets running DeepGEMM's kernels (the blockwise recipe's schedule)."""
    return tuple(n for n, (_, lib, _) in hw.PRESETS.items() if lib == "deepgemm")


_MX_ELEMENTS = {
    "mxfp8": ("float8_e4m3fn", "rceil"),
    "mxfp6": ("float6_e2m3fn", "floor"),
    "mxfp4": ("float4_e2m1fn", "floor"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MX(Blocked):
    """OCP Microscaling (OCP MX v1.0; TE ``MXFP8BlockScaling``): ``block`` (32) elements
    along the contraction axis share an E8M0 scale ``X = 2**e``, elements ``x / X`` rounded
    to nearest even and saturated. ``element``/``grad_element``: element formats of the
    forward operands and of the gradients. ``scale_rule`` (see
    :data:`precisionlab.quant.SCALE_RULES`): ``"floor"`` (OCP), ``"ceil"`` (torchao CEIL),
    ``"rceil"`` (TE / cuBLAS), ``"even"`` (torchao EVEN). Presets: ``mxfp8`` (E4M3, rceil,
    as TE), ``mxfp6`` (E2M3, floor), ``mxfp4`` (E2M1, floor).
    """

    name: ClassVar[str] = "mx"
    element: str = "float8_e4m3fn"
    grad_element: str | None = None
    scale_rule: str = "rceil"

    def _check_fields(self) -> None:
        for f in (self.element, self.grad_element):
            if f is not None and f not in {v[0] for v in _MX_ELEMENTS.values()} | {
                "float8_e5m2", "float6_e3m2fn"
            }:  # fmt: skip
                raise ValueError(
                    f"unknown MX element format {f!r}; allowed: float8_e4m3fn, float8_e5m2, "
                    "float6_e2m3fn, float6_e3m2fn, float4_e2m1fn"
                )
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(
                f"unknown scale_rule {self.scale_rule!r}; allowed: {', '.join(SCALE_RULES)}"
            )

    def fmt(self, kind: str) -> FloatFormat:
        name = self.grad_element if (kind == "g" and self.grad_element) else self.element
        return S.float_format(name)

    def quantize(
        self, t: Array, kind: str, *, scale: Array | None = None, key: Array | None = None
    ) -> S.QOperand:
        return S.mx_blocks(t, self.fmt(kind), self.block, self.scale_rule)[0]

    def hardware_blocks(self, kind: str) -> tuple[str, str]:
        return self.fmt(kind).name, "float8_e8m0fnu"

    def _check_hardware(self, acc: str) -> None:
        label = {v[0]: k for k, v in _MX_ELEMENTS.items()}.get(self.element, "mx")
        err = _blockhw.device_error(label, acc, f"blocks of {self.block} (E8M0)")
        if err is not None:
            raise err
        x, g = self.fmt("x").name, self.fmt("g").name
        pairs = [("forward GEMM (x, w)", x, x), ("gradient GEMMs (g with x or w)", g, x)]
        _blockhw.check_pairs(label, acc, pairs, "float8_e8m0fnu", self.block)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NVFP4(Blocked):
    """NVFP4 (TE ``NVFP4BlockScaling``; NVIDIA, "Pretraining Large Language Models with
    NVFP4", 2025): E2M1 elements, ``block`` (16) elements along the contraction axis share
    an E4M3 scale, plus one float32 scale per tensor (see ``scaling.nvfp4`` for the
    float32 steps); weights use ``block`` x ``block`` tiles; gradients are rounded
    stochastically (``stochastic_gradients``; needs a key); ``hadamard``: both operands of
    the weight-gradient GEMM get the 16 x 16 random Hadamard transform
    ``diag(signs) H / 4`` along their contraction axis before quantization (signs from
    ``hadamard_seed``, recorded here; the transform is orthogonal, so the product is
    unchanged in exact arithmetic).
    """

    name: ClassVar[str] = "nvfp4"
    value_fields: ClassVar[tuple[str, ...]] = ("hadamard_seed",)
    block: int = 16
    stochastic_gradients: bool = True
    hadamard: bool = True
    hadamard_seed: int = 0

    def two_d(self, kind: str) -> bool:
        return kind == "w"

    def numbers(self) -> dict[str, ArrayLike]:
        # without the transform the seed is used nowhere
        return {"hadamard": S.hadamard_matrix(self.hadamard_seed, 16)} if self.hadamard else {}

    def structure(self) -> Recipe:
        return dataclasses.replace(self, hadamard_seed=0)

    def hadamard_matrix(self) -> np.ndarray | Array:
        """The (16, 16) float32 transform (a traced array when :meth:`Recipe.with_numbers` gave
        it)."""
        h = self._number("hadamard")
        assert isinstance(h, (np.ndarray, Array))  # numbers() made a matrix
        return h

    def quantize(
        self, t: Array, kind: str, *, scale: Array | None = None, key: Array | None = None
    ) -> S.QOperand:
        sr = kind == "g" and self.stochastic_gradients
        rounding = "stochastic" if sr else "nearest_even"
        return S.nvfp4(
            t, self.block, two_d=kind == "w", rounding=rounding, key=key if sr else None
        )[0]

    def hardware_blocks(self, kind: str) -> tuple[str, str]:
        return "float4_e2m1fn", "float8_e4m3fn"  # E4M3 scales >= 0: UE4M3's codes

    def _check_hardware(self, acc: str) -> None:
        err = _blockhw.device_error(self.name, acc, f"blocks of {self.block} (UE4M3)")
        if err is not None:
            raise err
        e = "float4_e2m1fn"
        pairs = [("GEMMs", e, e)]
        _blockhw.check_pairs(self.name, acc, pairs, "float8_e4m3fn", self.block)


def _eps_numbers(eps: float, fmt: Callable[[str], FloatFormat]) -> dict[str, ArrayLike]:
    """An amax floor eps > 0 as the two float32 numbers its scale rule uses (see
    :class:`precisionlab.recipes._scaling.Floor`), the clamp for each operand kind's format;
    ``{}`` for eps 0 (no floor: a different program)."""
    if eps == 0:
        return {}
    out: dict[str, ArrayLike] = {}
    for kind in KINDS:
        floor = S.floor_numbers(float(fmt(kind).max), eps)
        out["eps_lo"], out[f"eps_clamp_{kind}"] = floor.lo, floor.clamp
    return out


def _eps_structure(eps: float) -> float:
    return 1.0 if eps > 0 else 0.0


def _eps(recipe: Current | Rowwise, kind: str) -> float | S.Floor:
    """The eps a quantizer takes: the field, or a Floor of the given numbers."""
    given = recipe.given_numbers
    if given is None or recipe.eps == 0:
        return recipe.eps
    return S.Floor(given["eps_lo"], given[f"eps_clamp_{kind}"])


def _check_block(b: object) -> None:
    if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 1 << 16:
        raise ValueError(f"block must be an int in 1..65536, got {b!r}")


_PRESETS: dict[str, tuple[type[Recipe], dict[str, Any]]] = {
    "delayed": (Delayed, {}),
    "current": (Current, {}),
    "rowwise": (Rowwise, {}),
    "rowwise_with_gw_hp": (Rowwise, {"gw_high_precision": True}),
    "blockwise": (Blockwise, {}),
    "mxfp8": (MX, {"element": "float8_e4m3fn", "scale_rule": "rceil"}),
    "mxfp6": (MX, {"element": "float6_e2m3fn", "scale_rule": "floor"}),
    "mxfp4": (MX, {"element": "float4_e2m1fn", "scale_rule": "floor"}),
    "nvfp4": (NVFP4, {}),
    "bf16": (Reference, {"dtype": "bfloat16"}),
    "fp32": (Reference, {"dtype": "float32"}),
}
#: The names :func:`get_recipe` accepts.
RECIPE_NAMES: tuple[str, ...] = tuple(_PRESETS)


def get_recipe(name: str | Recipe, **overrides: Any) -> Recipe:
    """The recipe called ``name`` (one of :data:`RECIPE_NAMES`) with its defaults, fields
    overridden by keyword (``get_recipe("mxfp8", scale_rule="floor")``); a Recipe passes
    through."""
    if isinstance(name, Recipe):
        return dataclasses.replace(name, **overrides) if overrides else name
    if not isinstance(name, str) or name.strip().lower() not in _PRESETS:
        raise ValueError(f"unknown recipe {name!r}; allowed: {', '.join(RECIPE_NAMES)}")
    cls, kw = _PRESETS[name.strip().lower()]
    return build_preset(name, cls, kw, overrides)


def build_preset(
    name: str | Recipe, cls: type[Recipe], defaults: dict[str, Any], overrides: dict[str, Any]
) -> Recipe:
    """The recipe class ``cls`` with a named preset's ``defaults``, fields overridden by
    ``overrides``; ``ValueError`` names the fields ``cls`` does not have."""
    fields = {f.name for f in dataclasses.fields(cls)}
    bad = set(overrides) - fields
    if bad:
        raise ValueError(
            f"recipe {name!r} has no field(s) {sorted(bad)}; fields: {', '.join(sorted(fields))}"
        )
    return cls(**{**defaults, **overrides})
