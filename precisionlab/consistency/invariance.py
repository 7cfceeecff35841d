"""Batch invariance: is a row's output the same, bit for bit, when the batch size M changes?

:func:`measure_gemm` measures it on the running backend for one GEMM shape (rows of ``A[:M]
@ B``, the first rows compared with the smallest M's); :func:`measure_model` does it for a
model's logits. :func:`predict` answers for a named GPU from :mod:`precisionlab.hardware`:

- the tensor-core arithmetic computes each output from its own row of A and column of B, so
  with one kernel (one schedule over K) for every M a row is bitwise invariant: a fact of
  the model;
- whether the library keeps that kernel when M changes is its heuristic's choice (tile sizes,
  split-K, a GEMV path for M = 1). The models choose a schedule by K alone, fitted at the
  captured shapes; no capture covers a change of M, so the verdict is ``"unknown"``, with the
  reason, never a guess presented as a fact;
- what is at stake: the share of outputs that change between the schedule modelled at this K
  and the other schedules the same library was seen (or, for cuBLASLt, is known) to use,
  computed with the models on random inputs.
"""

from __future__ import annotations

import dataclasses
import platform
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab import hardware
from precisionlab.consistency.run import Runner
from precisionlab.consistency.stack import parse_stack
from precisionlab.hardware.profiles import check_inputs

__all__ = [
    "GemmInvariance",
    "ModelInvariance",
    "Prediction",
    "backend_name",
    "measure_gemm",
    "measure_model",
    "predict",
]

_DTYPES = ("float32", "bfloat16", "float16")


def _check_ms(ms: Sequence[int]) -> list[int]:
    out = []
    for m in ms:
        if isinstance(m, bool) or not isinstance(m, int | np.integer) or m < 1:
            raise ValueError(f"batch sizes must be ints >= 1; got {m!r}")
        out.append(int(m))
    if len(out) < 2:
        raise ValueError(f"give at least two batch sizes to compare; got {list(ms)}")
    return sorted(set(out))


def _bits(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


class _ByBatchSize:
    """What both measurements answer: whether every batch size gave the reference's bits."""

    differ: tuple[int, ...]

    @property
    def invariant(self) -> bool:
        """Every M gives the reference's bits."""
        return not any(self.differ)


@dataclasses.dataclass(frozen=True)
class GemmInvariance(_ByBatchSize):
    """One GEMM shape measured on the running backend.

    Attributes:
      backend: the JAX backend and device it ran on.
      dtype, n, k: the operands' dtype and the shape of B (K x N).
      ms: the batch sizes, ascending; the first is the reference.
      differ: per M, how many of the compared outputs (the reference's rows, all N columns)
        differ bit for bit from the reference's.
      max_abs: per M, the largest |difference|.
    """

    backend: str
    dtype: str
    n: int
    k: int
    ms: tuple[int, ...]
    differ: tuple[int, ...]
    max_abs: tuple[float, ...]

    @property
    def verdict(self) -> str:
        """``"invariant"`` or ``"varies at M=..."``."""
        if self.invariant:
            return "invariant"
        ms = [str(m) for m, d in zip(self.ms, self.differ, strict=True) if d]
        return "varies at M=" + ",".join(ms)


def _against_first(outs: list[np.ndarray]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Per output of ``outs`` (same shape and dtype), the elements whose bits differ from the
    first's, and the largest |difference| (0 where there are no elements)."""
    ref = outs[0]
    differ = tuple(int(np.sum(_bits(y) != _bits(ref))) for y in outs)
    diffs = [np.abs(y.astype(np.float64) - ref.astype(np.float64)) for y in outs]
    return differ, tuple(float(np.max(d)) if d.size else 0.0 for d in diffs)


def _operands(m: int, n: int, k: int, dtype: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)
    a = rng.standard_normal((m, k)).astype(np.float32).astype(dt)
    b = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32).astype(dt)
    return a, b


def backend_name() -> str:
    """``"cpu (x86_64)"``, ``"gpu (NVIDIA H100 ...)"``: the backend and its first device."""
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", "") or platform.machine()
    return f"{jax.default_backend()} ({kind})"


def measure_gemm(ms: Sequence[int], n: int, k: int, dtype: str = "float32", *,
                 seed: int = 0) -> GemmInvariance:  # fmt: skip
    """Rows of ``A[:M] @ B`` (``jax.jit(jnp.matmul)`` on the running backend, output in
    ``dtype``) for each M of ``ms``, the first ``min(ms)`` rows compared bit for bit with
    those of the smallest M. A, B: seeded normal values in ``dtype``."""
    ms = _check_ms(ms)
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(_DTYPES)}")
    for name, v in (("n", n), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1; got {v!r}")
    a, b = _operands(max(ms), n, k, dtype, seed)
    f = jax.jit(jnp.matmul)
    r = ms[0]
    # copies of the compared rows: a view would keep every M x N output alive
    differ, max_abs = _against_first([np.asarray(f(a[:m], b))[:r].copy() for m in ms])
    return GemmInvariance(backend_name(), dtype, n, k, tuple(ms), differ, max_abs)


@dataclasses.dataclass(frozen=True)
class ModelInvariance(_ByBatchSize):
    """A model's logits for the first rows under each batch size (``stack`` with
    ``batch_size=M`` on the first M rows): ``differ`` per M, logits of the reference rows
    that differ bit for bit from the smallest M's; ``max_abs`` the largest difference."""

    stack: str
    ms: tuple[int, ...]
    differ: tuple[int, ...]
    max_abs: tuple[float, ...]


def measure_model(model: Any, params: Any, tokens: Any, ms: Sequence[int],
                  stack: Any = "fp32") -> ModelInvariance:  # fmt: skip
    """The logits of the first ``min(ms)`` rows of ``tokens`` [B, T] when they are evaluated
    in batches of M rows (the first M rows of ``tokens``), for each M of ``ms`` (each <= B),
    compared bit for bit with the smallest M's. ``stack``: a
    :class:`~precisionlab.consistency.Stack` or its string (its ``batch_size`` is set to M)."""
    ms = _check_ms(ms)
    tok = np.asarray(tokens)
    if tok.ndim != 2 or max(ms) > tok.shape[0]:
        raise ValueError(f"tokens must be [B, T] with B >= {max(ms)}; got shape {tok.shape}")
    st = parse_stack(stack)
    runner = Runner(model, params)
    r = ms[0]
    outs = [runner.run(st.replace(batch_size=m), tok[:m]).logits[:r] for m in ms]
    differ, max_abs = _against_first(outs)
    return ModelInvariance(st.label, tuple(ms), differ, max_abs)


# --- predictions for named GPUs -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The batch-invariance answer for one preset and shape.

    Attributes:
      preset: the :mod:`precisionlab.hardware` preset (``"h100-xla"``, ...).
      dtype, n, k, ms: the GEMM (operands' dtype, B is K x N) and the batch sizes.
      verdict: ``"unknown"`` (the library's kernel choice per M is not modelled),
        ``"unsupported"`` (the device has no tensor-core GEMM for ``dtype``); never a guess.
      why: the reason, one sentence.
      schedule: the schedule the model takes at this K.
      with_one_kernel: what the model says when the library keeps one kernel for every M
        (``"invariant"``: each output depends only on its row and column).
      at_stake: per alternative schedule (a description), the share of outputs of an
        M x N x K GEMM on random inputs whose bits change from the modelled schedule's, in
        the float32 accumulator (before any rounding to the output dtype).
      at_stake_out: the same in the output dtype (``dtype`` for 16-bit inputs, float32 for
        FP8): what the next layer sees.
    """

    preset: str
    dtype: str
    n: int
    k: int
    ms: tuple[int, ...]
    verdict: str
    why: str
    schedule: str
    with_one_kernel: str | None
    at_stake: dict[str, float]
    at_stake_out: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        """Plain values."""
        return dataclasses.asdict(self)


def _describe(sched: hardware.Schedule, k: int) -> str:
    parts = []
    if sched.split_k and k >= sched.split_k_min_k and sched.split_k < k:
        order = "in order" if sched.split_order == "sequential" else "by halves"
        parts.append(f"split-K {sched.split_k} ({order})")
    if sched.restart_every:
        parts.append(f"restart every {sched.restart_every}")
    if sched.upcast:
        parts.append(f"upcast to {sched.upcast}")
    return ", ".join(parts) or "one chain over K"


def _alternatives(library: str, k: int) -> dict[str, dict]:
    """Other schedules the library runs at other shapes (overrides for ``hardware.gemm``)."""
    alts: dict[str, dict] = {}
    if library == "xla":
        # seen on the H100 captures: one chain (K <= 64), 64-wide slices in order (K 128..512),
        # 64-wide by halves (the FP8 64x1024x64 capture), 128-wide by halves (K = 4096)
        alts["one chain over K"] = {"split_k": None}
        for w in (64, 128):
            n = -(-k // w)
            if w < k:
                alts[f"split-K {w} (in order)"] = {"split_k": w, "split_order": "sequential"}
                if n & (n - 1) == 0 and n > 1:
                    bits = tuple(reversed(range(n.bit_length() - 1)))
                    alts[f"split-K {w} (by halves)"] = {"split_k": w, "split_order": bits}
    else:
        # cuBLASLt has split-K kernels its heuristic may pick for some shapes (its reduction
        # order is not modelled): halves of K summed in float32, as one such kernel
        half = -(-k // 2)
        half = -(-half // 16) * 16
        if half < k:
            alts[f"split-K {half} (2 slices, hypothetical)"] = {"split_k": half}
    return alts


def predict(preset: str, ms: Sequence[int], n: int, k: int, dtype: str = "bfloat16", *,
            seed: int = 0, stake: bool = True) -> Prediction:  # fmt: skip
    """Whether rows of an M x N x K GEMM are bitwise batch invariant on the GPU of
    ``preset``, for the batch sizes ``ms`` (see the module docstring). ``stake=False``
    skips the at-stake GEMMs (the verdict only)."""
    ms = _check_ms(ms)
    if dtype not in ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"):
        raise ValueError(f"predictions cover tensor-core inputs: bfloat16, float16, "
                         f"float8_e4m3fn, float8_e5m2; got {dtype!r}")  # fmt: skip
    kw = hardware.preset(preset)
    name = hardware.canonical_preset(preset)
    kind = "fp8" if "float8" in dtype else "16bit"
    try:
        res = hardware.resolve(kw["device"], kw["library"], kw["fast_accumulation"], kind, {}, k)
        prof = hardware.get_profile(kw["device"], kind)
        check_inputs(prof.device, kind, (dtype,), "gemm")  # the device takes these inputs
    except ValueError as err:
        return Prediction(name, dtype, n, k, tuple(ms), "unsupported", str(err), "", None, {},
                          {})  # fmt: skip
    sched = _describe(res.schedule, k)
    out = dtype if kind == "16bit" else "float32"
    shares, shares_out = {}, {}
    alternatives = _alternatives(kw["library"], k) if stake else {}
    if alternatives:
        a, b = _operands(max(ms), n, k, dtype, seed)
        base = np.asarray(hardware.gemm(a, b, **kw))  # the float32 accumulator
    for label, ov in alternatives.items():
        if (
            ov.get("split_k") == res.schedule.split_k
            and ov.get("split_order", "sequential") == res.schedule.split_order
        ):
            continue
        try:
            alt = np.asarray(hardware.gemm(a, b, **kw, **ov))
        except ValueError:
            continue
        shares[label] = float(np.mean(_bits(alt) != _bits(base)))
        alt_o, base_o = alt.astype(jnp.dtype(out)), base.astype(jnp.dtype(out))
        shares_out[label] = float(np.mean(_bits(alt_o) != _bits(base_o)))
    lib = {"xla": "XLA", "cublaslt": "cuBLASLt", "deepgemm": "DeepGEMM"}[kw["library"]]
    why = (
        f"{lib} picks its kernel (tiles, split-K, a GEMV path at M = 1) per (M, N, K); the "
        f"model takes its schedule from K alone, fitted at the captured shapes, and no "
        f"capture varies M"
    )
    return Prediction(name, dtype, n, k, tuple(ms), "unknown", why, sched, "invariant", shares,
                      shares_out)  # fmt: skip
