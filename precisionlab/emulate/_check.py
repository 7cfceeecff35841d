"""``check(fn, policy, *args)``: where a function run natively (jit on this machine) and under
:func:`~precisionlab.emulate.emulate` differ, operation by operation.

Both runs are jitted and record every floating-point operation's result (as the program
stores it). Each run feeds its own values forward, so a row shows what that operation returns
in each world; the first differing row is where this machine's XLA hides what a GPU computes
(excess float32 precision between fused 16-bit operations, an overflow, a different
simplification), the rows after it include what flowed from there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab.emulate._emulate import Emulated, emulate
from precisionlab.intercept import Emit, intercept

__all__ = ["CheckReport", "OpDiff", "check"]


@dataclasses.dataclass(frozen=True)
class OpDiff:
    """One operation: ``differ`` of ``size`` elements differ bit for bit (NaN equals NaN);
    ``max_abs``: the largest |native - emulated| over finite pairs; ``native_inf`` /
    ``emulated_inf``: how many infinities each run holds; likewise NaN."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    size: int
    differ: int
    max_abs: float
    native_inf: int
    emulated_inf: int
    native_nan: int
    emulated_nan: int
    #: elements of the emulated result below float32's smallest normal (bfloat16 and float32
    #: subnormals): this CPU flushes them in float arithmetic, see :attr:`CheckReport.subnormal`
    subnormal: int = 0

    def describe(self) -> str:
        extra = []
        if self.native_inf != self.emulated_inf:
            extra.append(f"inf {self.native_inf} -> {self.emulated_inf}")
        if self.native_nan != self.emulated_nan:
            extra.append(f"nan {self.native_nan} -> {self.emulated_nan}")
        tail = f"  ({', '.join(extra)})" if extra else ""
        shape = "x".join(map(str, self.shape)) or "scalar"
        return (
            f"{self.name:<24} {self.dtype:<8} {shape:<12} {self.differ:>8}/{self.size:<8} "
            f"{self.max_abs:>10.3g}{tail}"
        )


@dataclasses.dataclass(frozen=True)
class CheckReport:
    """Every recorded operation in program order (``ops``) and the policy checked."""

    policy: str
    ops: tuple[OpDiff, ...]

    @property
    def differing(self) -> tuple[OpDiff, ...]:
        return tuple(o for o in self.ops if o.differ)

    @property
    def subnormal(self) -> tuple[OpDiff, ...]:
        """The operations whose emulated results hold float32 subnormals (nonzero, below
        2**-126): XLA on this CPU reads such operands as 0. emulate computes bfloat16 + - * /
        on them exactly and moves them exactly (reshape, select, ...); any other operation
        that reads them (a comparison, max/min, a reduction, a float32 operation, a
        transcendental of a subnormal) may differ from a GPU, which keeps subnormals: the
        results downstream of these operations are not bit-exact claims."""
        return tuple(o for o in self.ops if o.subnormal)

    def text(self, every: bool = False) -> str:
        """A table: the differing operations (``every``: all of them) and a summary line."""
        rows = self.ops if every else self.differing
        head = f"{'operation':<24} {'dtype':<8} {'shape':<12} {'differ/size':>17} {'max|diff|':>10}"
        first = next((o.name for o in self.ops if o.differ), None)
        summary = (
            f"{len(self.differing)} of {len(self.ops)} operations differ under {self.policy}"
            + (f"; first: {first}" if first else "")
        )
        lines = [head, *(o.describe() for o in rows), summary]
        if self.subnormal:
            names = ", ".join(o.name for o in self.subnormal[:8])
            more = f" and {len(self.subnormal) - 8} more" if len(self.subnormal) > 8 else ""
            lines.append(
                f"subnormal results (below 2^-126, which this CPU flushes) in {names}{more}: "
                "their bfloat16 + - * / are exact, other operations reading them may differ "
                "from a GPU"
            )
        return "\n".join(lines)


@dataclasses.dataclass
class _Recording:
    """A rule that applies ``inner`` (None: the operation as written) and emits its first
    floating result."""

    primitives: tuple[str, ...]
    inner: Any = None

    def apply(self, ctx, *operands, **params):
        outs = list(ctx.original(*operands) if self.inner is None else self.inner.apply(
            ctx, *operands, **params))  # fmt: skip
        first = next((y for y in outs if jnp.issubdtype(jnp.result_type(y), jnp.floating)), None)
        if first is None:
            return outs
        return Emit(outs, jnp.asarray(first))


def _record(fn: Callable, rule: Any, keep: tuple, args: tuple, kwargs: dict) -> dict[str, Any]:
    inter = intercept(fn, rule, exclude=keep)
    _, aux = jax.jit(lambda a, k: inter.call_with_aux(None, *a, **k))(args, kwargs)
    return {name: np.asarray(a.value) for name, a in aux.items()}


def _compare(name: str, a: np.ndarray, b: np.ndarray) -> OpDiff:
    a32 = np.asarray(a, np.float32)
    b32 = np.asarray(b, np.float32)
    both_nan = np.isnan(a32) & np.isnan(b32)
    differ = (a32.view(np.uint32) != b32.view(np.uint32)) & ~both_nan
    finite = np.isfinite(a32) & np.isfinite(b32)
    diff = np.abs(a32[finite].astype(np.float64) - b32[finite].astype(np.float64))
    return OpDiff(
        name, tuple(a.shape), np.dtype(a.dtype).name, int(a.size), int(differ.sum()),
        float(diff.max()) if diff.size else 0.0,
        int(np.isinf(a32).sum()), int(np.isinf(b32).sum()),
        int(np.isnan(a32).sum()), int(np.isnan(b32).sum()),
        int(((b32.view(np.uint32) & 0x7F800000) == 0).sum() - (b32 == 0).sum()),
    )  # fmt: skip


def check(fn: Callable, policy: Any, *args: Any, **kwargs: Any) -> CheckReport:
    """``fn(*args, **kwargs)`` jitted natively and under ``emulate(fn, policy)``, compared
    operation by operation (see the module docstring). ``fn`` may also be an
    :class:`~precisionlab.emulate.Emulated` (its policy and options are used)."""
    em = fn if isinstance(fn, Emulated) else emulate(fn, policy)
    _, rule = em._intercepted(args, kwargs)
    native = _record(em.fn, _Recording(rule.primitives), em.keep, args, kwargs)
    emulated = _record(em.fn, _Recording(rule.primitives, rule), em.keep, args, kwargs)
    order = [s.name for s in em.sites(*args, **kwargs)]
    ops = tuple(
        _compare(name, native[name], emulated[name])
        for name in order
        if name in native and name in emulated
    )
    return CheckReport(str(policy), ops)
