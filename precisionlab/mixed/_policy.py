"""Mixed-precision policies: the dtype of params, of compute and of outputs.

A :class:`Policy` is parsed from jmp's syntax (``"params=float32,compute=bfloat16,output=float32"``
or ``"p=f32,c=bf16,o=f32"``; a bare dtype name sets all three). It also names the numerically
sensitive ops that stay in float32 whatever the compute dtype (``Policy.fp32_ops``) and whether
each op's result is rounded to the compute dtype at its boundary (``Policy.enforce``); the helpers
in :mod:`precisionlab.mixed.ops` honour both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab.formats import ALIASES

__all__ = [
    "DEFAULT_FP32_OPS",
    "DTYPE_NAMES",
    "FP32_OPS",
    "POLICY_DTYPES",
    "Policy",
    "cast_floating",
    "dtype_name",
    "get_policy",
    "parse_dtype",
]

T = TypeVar("T")

#: Ops that a policy may keep in float32 (names used by precisionlab.mixed.ops).
FP32_OPS: tuple[str, ...] = (
    "softmax",
    "layer_norm",
    "cross_entropy",
    "reduce",
    "matmul_accumulate",
)
#: Kept in float32 by default: the mixed-precision practice of Micikevicius et al. 2018.
DEFAULT_FP32_OPS: frozenset[str] = frozenset(
    {"softmax", "layer_norm", "cross_entropy", "reduce", "matmul_accumulate"}
)

#: Floating dtypes a policy or storage may name (numpy/JAX dtypes).
POLICY_DTYPES: tuple[str, ...] = (
    "float32",
    "bfloat16",
    "float16",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
)
#: The one exception to the format catalog's names: jmp reads "half" as bfloat16 on TPU and
#: float16 elsewhere, so a policy string saying "half" is refused (the catalog's "half" is
#: IEEE binary16, float16).
_JMP_AMBIGUOUS = ("half",)
# Canonical name -> accepted spellings: the format catalog's names (precisionlab.formats), one
# table for formats and policies.
DTYPE_NAMES: dict[str, tuple[str, ...]] = {
    name: (name, *sorted(a for a, t in ALIASES.items() if t == name and a not in _JMP_AMBIGUOUS))
    for name in POLICY_DTYPES
}
_F32 = np.dtype("float32")
_ENFORCE_VALUES = {"true": True, "false": False}
_ALIAS = {alias: name for name, aliases in DTYPE_NAMES.items() for alias in aliases}


def parse_dtype(value: str | np.dtype | type) -> np.dtype:
    """Return the numpy dtype named by ``value`` (``"bf16"``, ``"float16"``, ``jnp.float32``...).

    Raises ValueError for unknown names (listing the accepted ones) and for jmp's ``"half"``.
    """
    if value is None or isinstance(value, bool):
        # np.dtype(None) is float64: never what a caller who forgot a dtype meant.
        raise TypeError(f"expected a dtype or dtype name, got {value!r}")
    if not isinstance(value, str):
        try:
            dtype = np.dtype(value)
        except TypeError as err:
            raise TypeError(f"expected a dtype or dtype name, got {value!r}") from err
        if dtype_name(dtype) not in DTYPE_NAMES:
            raise ValueError(f"unsupported dtype {dtype.name!r}; allowed: {', '.join(DTYPE_NAMES)}")
        return dtype
    key = value.strip().lower()
    if key in _JMP_AMBIGUOUS:
        raise ValueError(
            "dtype 'half' is ambiguous (jmp maps it to bfloat16 on TPU and float16 elsewhere); "
            "say 'float16' or 'bfloat16'"
        )
    if key not in _ALIAS:
        raise ValueError(f"unknown dtype {value!r}; allowed: {', '.join(sorted(_ALIAS))}")
    return np.dtype(getattr(jnp, _ALIAS[key]))


def dtype_name(dtype: Any) -> str:
    """Canonical name of a dtype (``"bfloat16"``, ``"float32"``, ...)."""
    return np.dtype(dtype).name


def _is_floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def cast_floating(tree: T, dtype: Any) -> T:
    """Cast the floating leaves of ``tree`` to ``dtype``; other leaves are returned as they are."""
    dtype = np.dtype(dtype)

    def cast(x: Any) -> Any:
        if _is_floating(x) and x.dtype != dtype:
            return jnp.asarray(x).astype(dtype)
        return x

    return jax.tree_util.tree_map(cast, tree)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy:
    """Dtypes of a mixed-precision computation.

    Attributes:
      param_dtype: dtype the params are stored in (the master copy).
      compute_dtype: dtype of the forward and backward computation.
      output_dtype: dtype of the model's outputs (e.g. logits handed to the loss).
      fp32_ops: names of ops computed in float32 whatever ``compute_dtype`` is; a subset of
        :data:`FP32_OPS`. Their results are cast back to ``compute_dtype``.
      enforce: whether the ops of :mod:`precisionlab.mixed.ops` round each result to
        ``compute_dtype`` at the op boundary (:func:`precisionlab.mixed._numerics.enforce`), so a
        CPU run rounds and overflows where a GPU computing in that dtype would. ``False`` leaves
        the rounding to XLA, which may keep intermediates wider. No effect in float32.

    Hashable, so it can be a static argument of ``jax.jit``.
    """

    param_dtype: np.dtype = _F32
    compute_dtype: np.dtype = _F32
    output_dtype: np.dtype = _F32
    fp32_ops: frozenset[str] = DEFAULT_FP32_OPS
    enforce: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.enforce, (bool, np.bool_)):
            raise TypeError(f"Policy.enforce must be a bool, got {self.enforce!r}")
        object.__setattr__(self, "enforce", bool(self.enforce))
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, parse_dtype(getattr(self, field)))
        ops = frozenset(self.fp32_ops)
        unknown = sorted(ops - set(FP32_OPS))
        if unknown:
            raise ValueError(f"unknown fp32_ops {unknown}; allowed: {', '.join(FP32_OPS)}")
        object.__setattr__(self, "fp32_ops", ops)

    @classmethod
    def parse(cls, spec: Any, *, fp32_ops: Iterable[str] | None = None) -> Policy:
        """A policy from jmp's syntax, a jmp ``Policy`` or a dtype; see :func:`get_policy`."""
        return get_policy(spec, fp32_ops=fp32_ops)

    def cast_to_param(self, tree: T) -> T:
        """Cast floating leaves to ``param_dtype``."""
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: T) -> T:
        """Cast floating leaves to ``compute_dtype``."""
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: T) -> T:
        """Cast floating leaves to ``output_dtype``."""
        return cast_floating(tree, self.output_dtype)

    def keeps_fp32(self, op: str) -> bool:
        """Whether ``op`` (one of :data:`FP32_OPS`) is computed in float32 under this policy."""
        if op not in FP32_OPS:
            raise ValueError(f"unknown op {op!r}; allowed: {', '.join(FP32_OPS)}")
        return op in self.fp32_ops

    def op_dtype(self, op: str) -> np.dtype:
        """The dtype ``op`` computes in: float32 if kept in float32, else ``compute_dtype``."""
        if self.keeps_fp32(op):
            return jnp.promote_types(self.compute_dtype, np.float32)
        return self.compute_dtype

    def to_jmp(self) -> Any:
        """The equivalent ``jmp.Policy`` (needs jmp installed; the float32 ops and ``enforce``
        have no jmp counterpart and are dropped)."""
        try:
            import jmp
        except ImportError as err:  # optional dependency
            raise ImportError("Policy.to_jmp needs jmp: pip install jmp") from err
        return jmp.Policy(
            param_dtype=self.param_dtype,
            compute_dtype=self.compute_dtype,
            output_dtype=self.output_dtype,
        )

    def with_fp32_ops(self, ops: Iterable[str]) -> Policy:
        """This policy with ``fp32_ops`` replaced by ``ops``."""
        return dataclasses.replace(self, fp32_ops=frozenset(ops))

    def with_output_dtype(self, dtype: Any) -> Policy:
        """This policy with ``output_dtype`` replaced by ``dtype``."""
        return dataclasses.replace(self, output_dtype=parse_dtype(dtype))

    def with_enforce(self, enforce: bool) -> Policy:
        """This policy with ``enforce`` set: ``policy.with_enforce(False)`` leaves the
        rounding at op boundaries to XLA (as ``dataclasses.replace(policy, enforce=False)``)."""
        return dataclasses.replace(self, enforce=enforce)

    @property
    def is_mixed(self) -> bool:
        """True when compute differs from float32."""
        return self.compute_dtype != np.dtype("float32")

    def __str__(self) -> str:
        """The policy string, parsed back to an equal Policy by :func:`get_policy` (the float32
        ops are written only when they differ from the default: ``fp32=softmax+reduce`` or
        ``fp32=none``; ``enforce=false`` only when ``enforce`` is off)."""
        short = {
            "float32": "f32",
            "bfloat16": "bf16",
            "float16": "f16",
            "float64": "f64",
            "float8_e4m3fn": "e4m3",
            "float8_e5m2": "e5m2",
        }
        p, c, o = (
            short[dtype_name(d)] for d in (self.param_dtype, self.compute_dtype, self.output_dtype)
        )
        text = f"p={p},c={c},o={o}"
        if self.fp32_ops != DEFAULT_FP32_OPS:
            ops = [op for op in FP32_OPS if op in self.fp32_ops]
            text += f",fp32={'+'.join(ops) or 'none'}"
        if not self.enforce:
            text += ",enforce=false"
        return text


def _is_jmp_policy(obj: Any) -> bool:
    """A jmp ``Policy`` (or any object with its three dtype attributes), without importing jmp."""
    return all(hasattr(obj, f) for f in ("param_dtype", "compute_dtype", "output_dtype"))


def get_policy(spec: Any, *, fp32_ops: Iterable[str] | None = None) -> Policy:
    """A :class:`Policy` from a policy string in jmp's syntax, a jmp ``Policy`` or a dtype.

    ``"params=float32,compute=bfloat16,output=float32"``, ``"p=f32,c=bf16,o=f32"``, ``"c=f16"``
    (params float32; output follows compute) or a bare dtype (``"bf16"``: all three). As in jmp,
    compute defaults to the param dtype and output to the compute dtype. A part
    ``fp32=softmax+reduce`` (or ``fp32=none``) sets the ops kept in float32, as ``str(policy)``
    writes them; a part ``enforce=false`` (or ``enforce=true``, the default) sets
    ``Policy.enforce``.

    Args:
      spec: the policy string; a Policy (returned, with ``fp32_ops`` replaced if given); a jmp
        ``Policy`` (its three dtypes); or a dtype object (``jnp.bfloat16``, ``np.dtype("f2")``:
        all three).
      fp32_ops: ops kept in float32; default :data:`DEFAULT_FP32_OPS`.

    Example:
      >>> from precisionlab.mixed import get_policy
      >>> policy = get_policy("p=f32,c=bf16,o=f32")
      >>> policy.param_dtype, policy.compute_dtype, policy.output_dtype
      (dtype('float32'), dtype(bfloat16), dtype('float32'))
      >>> str(get_policy("bf16"))
      'p=bf16,c=bf16,o=bf16'
    """
    ops = DEFAULT_FP32_OPS if fp32_ops is None else frozenset(fp32_ops)
    if isinstance(spec, Policy):
        return spec if fp32_ops is None else spec.with_fp32_ops(ops)
    if not isinstance(spec, str) and _is_jmp_policy(spec):
        dtypes = [parse_dtype(getattr(spec, f)) for f in ("param_dtype", "compute_dtype",
                                                         "output_dtype")]  # fmt: skip
        return Policy(
            param_dtype=dtypes[0], compute_dtype=dtypes[1], output_dtype=dtypes[2], fp32_ops=ops
        )
    if not isinstance(spec, str):
        try:
            # dtype objects and scalar types (np.float16, jnp.bfloat16) only: np.dtype also reads
            # dicts and lists as structured dtypes
            dtype = np.dtype(spec) if isinstance(spec, (np.dtype, type)) else None
        except (TypeError, ValueError):
            dtype = None
        if dtype is None or spec is None or dtype.kind == "O":
            raise TypeError(
                f"policy must be a string ('p=f32,c=bf16,o=f32'), a Policy, a jmp Policy or a "
                f"dtype, got {type(spec).__name__} {spec!r}"
            )
        dtype = parse_dtype(dtype)
        return Policy(param_dtype=dtype, compute_dtype=dtype, output_dtype=dtype, fp32_ops=ops)
    text = spec.strip()
    if not text:
        raise ValueError("empty policy string; expected e.g. 'p=f32,c=bf16,o=f32'")
    if "=" not in text:
        dtype = parse_dtype(text)
        return Policy(param_dtype=dtype, compute_dtype=dtype, output_dtype=dtype, fp32_ops=ops)
    keys = {
        "p": "param",
        "params": "param",
        "c": "compute",
        "compute": "compute",
        "o": "output",
        "output": "output",
    }
    found: dict[str, np.dtype] = {}
    enforce: bool | None = None
    for part in text.split(","):
        part = part.strip()
        if part.count("=") != 1:
            raise ValueError(f"bad policy part {part!r} in {spec!r}; expected key=dtype")
        key, value = (s.strip() for s in part.split("="))
        if key.lower() in ("fp32", "fp32_ops"):
            if fp32_ops is not None:
                raise ValueError(f"fp32 ops given twice: in {spec!r} and as fp32_ops")
            named = [] if value.lower() == "none" else value.split("+")
            fp32_ops = ops = frozenset(op.strip() for op in named)
            continue
        if key.lower() == "enforce":
            if enforce is not None:
                raise ValueError(f"policy key {key!r} given twice in {spec!r}")
            enforce = _ENFORCE_VALUES.get(value.lower())
            if enforce is None:
                raise ValueError(f"bad enforce value {value!r} in {spec!r}; allowed: true, false")
            continue
        if key.lower() not in keys:
            allowed = ", ".join([*keys, "fp32", "enforce"])
            raise ValueError(f"unknown policy key {key!r} in {spec!r}; allowed: {allowed}")
        name = keys[key.lower()]
        if name in found:
            raise ValueError(f"policy key {key!r} given twice in {spec!r}")
        found[name] = parse_dtype(value)
    param = found.get("param", np.dtype("float32"))
    compute = found.get("compute", param)
    output = found.get("output", compute)
    return Policy(
        param_dtype=param,
        compute_dtype=compute,
        output_dtype=output,
        fp32_ops=ops,
        enforce=True if enforce is None else enforce,
    )
