"""``Stack``: one numerics stack, everything that decides the bits of a model's logits.

A trainer and an inference engine run the same model with the same weights, and still compute
different log-probabilities: the compute format, the GEMM kernels (the hardware and library's
schedule), the evaluation (one full-sequence call, or token-by-token decoding with a KV cache
and its own attention kernel, batch size) and the precision of the LM head all change the bits.
A :class:`Stack` names each of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from precisionlab import hardware as _hw
from precisionlab.mixed._policy import Policy, dtype_name, get_policy

__all__ = ["MODES", "Stack", "hardware_names", "parse_stack"]

#: How the tokens are evaluated: ``"full"`` (one call on the whole sequence, as a trainer
#: computes its log-probabilities) or ``"decode"`` (token by token with a KV cache, as a
#: sampler scores the tokens it generates).
MODES = ("full", "decode")


def hardware_names() -> tuple[str, ...]:
    """Every ``Stack.hardware`` name: ``"native"`` (``jax.jit`` on the running backend), then
    the matmul models of :func:`precisionlab.emulate.emulate`: ``"float32"`` and every preset
    and alias of :mod:`precisionlab.hardware` (``"h100-xla"``, ``"h100-cublaslt"``, ...)."""
    return ("native", "float32", *_hw.PRESETS, *_hw.PRESET_ALIASES)


_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _policy(spec: Any) -> Policy:
    """A bare format name (``"bf16"``) means params float32, compute and output in it."""
    if isinstance(spec, str) and "=" not in spec:
        spec = f"c={spec.strip()}"
    return get_policy(spec)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stack:
    """One numerics stack (frozen, hashable).

    Attributes:
      policy: the mixed-precision policy (a :class:`~precisionlab.mixed.Policy` or a string:
        ``"bf16"`` means ``"c=bf16"``, params float32, compute and logits bfloat16).
      hardware: ``"native"``: ``jax.jit`` on the running backend; any other name: the program
        computed as that GPU computes it, by :func:`precisionlab.emulate.emulate` with this
        matmul model (``"h100-xla"``: XLA on an H100; ``"h100-cublaslt"``: cuBLASLt's
        default on an H100, as a PyTorch inference engine calls it; see :func:`hardware_names`).
      mode: ``"full"`` or ``"decode"`` (:data:`MODES`).
      batch_size: rows evaluated together (None: all the rows at once); must divide the
        number of rows. The GEMMs' M dimension, hence a library's kernel choice.
      kv_block: in ``"decode"``, the attention over the KV cache is computed in blocks of this
        many keys with an online softmax (FlashDecoding's split-KV, as an inference engine's
        decode kernel does); None: one softmax over the whole cache, as in ``"full"``.
      lm_head_fp32: the LM head (unembedding) in float32 on float32 weights, the logits in
        float32 (a common fix for the sampler's log-probabilities).
      name: a label for tables (default: made from the fields).
    """

    policy: Policy = dataclasses.field(default_factory=Policy)
    hardware: str = "native"
    mode: str = "full"
    batch_size: int | None = None
    kv_block: int | None = 16
    lm_head_fp32: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", _policy(self.policy))
        if not isinstance(self.hardware, str) or self.hardware not in hardware_names():
            if isinstance(self.hardware, str) and self.hardware in _hw.AMBIGUOUS_PRESETS:
                _hw.canonical_preset(self.hardware)  # raises, naming the choices
            raise ValueError(
                f"Stack.hardware must be one of {', '.join(hardware_names())}; "
                f"got {self.hardware!r}"
            )
        if self.mode not in MODES:
            raise ValueError(f"Stack.mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        for field in ("batch_size", "kv_block"):
            v = getattr(self, field)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | np.integer)
                                  or v < 1):  # fmt: skip
                raise ValueError(f"Stack.{field} must be a positive int or None; got {v!r}")
        if not isinstance(self.lm_head_fp32, bool):
            raise ValueError(f"Stack.lm_head_fp32 must be a bool; got {self.lm_head_fp32!r}")
        if not isinstance(self.name, str):
            raise ValueError(f"Stack.name must be a string; got {self.name!r}")

    @property
    def format(self) -> str:
        """The compute format's short name (``"bf16"``, ``"fp16"``, ``"fp32"``, ...)."""
        name = dtype_name(self.policy.compute_dtype)
        return _SHORT.get(name, name)

    @property
    def label(self) -> str:
        """``name``, or a description such as ``"bf16 h100-xla decode/8 kv16"`` (the policy
        written out, ``"p=f32,c=f32,o=bf16 native full"``, when it is not the format's usual
        one)."""
        if self.name:
            return self.name
        mode = self.mode
        if self.batch_size is not None:
            mode += f"/{self.batch_size}"
        if self.mode == "decode":
            mode += f" kv{self.kv_block}" if self.kv_block else " kv-all"
        head = " head-fp32" if self.lm_head_fp32 else ""
        # the format alone names the usual policy (params float32, compute and logits in the
        # format); any other is written out, so two stacks never share a label
        fmt = self.format if self.policy == _policy(self.format) else str(self.policy)
        return f"{fmt} {self.hardware} {mode}{head}"

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values (the policy as its string); :func:`parse_stack` reads
        it back to an equal Stack."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["policy"] = str(self.policy)
        return out

    def replace(self, **changes: Any) -> Stack:
        """A copy with ``changes`` (field -> value), validated."""
        return dataclasses.replace(self, **changes)


_FIELDS = tuple(f.name for f in dataclasses.fields(Stack))


def parse_stack(spec: Any) -> Stack:
    """A :class:`Stack` from a Stack (returned), a format or policy string (``"bf16"``,
    ``"c=f16"``: native, full-sequence) or a dict of Stack fields (``{"policy": "bf16",
    "hardware": "h100-xla", "mode": "decode", "batch_size": 8}``). ValueError naming what is
    wrong and what is allowed."""
    if isinstance(spec, Stack):
        return spec
    if isinstance(spec, str):
        return Stack(policy=_policy(spec))
    if isinstance(spec, dict):
        unknown = [k for k in spec if k not in _FIELDS]
        if unknown:
            raise ValueError(f"unknown Stack field {unknown[0]!r}; allowed: {', '.join(_FIELDS)}")
        return Stack(**spec)
    raise TypeError(
        f"a stack is a format string ('bf16'), a policy string, a dict of Stack fields or a "
        f"Stack; got {type(spec).__name__}"
    )
