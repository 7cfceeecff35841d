"""Presets: (device, library, fast accumulation) -> step and schedule, and names for them."""

from __future__ import annotations

import dataclasses

from precisionlab.hardware._profiles import DEVICE_ALIASES, Profile, get_profile
from precisionlab.hardware._schedule import Schedule
from precisionlab.hardware._step import Step

__all__ = [
    "AMBIGUOUS_PRESETS",
    "LIBRARIES",
    "PRESETS",
    "PRESET_ALIASES",
    "Resolved",
    "canonical_preset",
    "preset",
    "resolve",
    "xla_split",
]

#: The GEMM libraries whose schedules are modelled: cuBLASLt (torch._scaled_mm, cuBLAS),
#: XLA's GPU GEMMs, and DeepGEMM's Hopper FP8 kernels (``deepgemm``: FP8 only, on h100; the
#: chain restarts every 128 k, DeepSeek-V3's promotion; ``fast_accumulation`` does not
#: apply to it and is ignored).
LIBRARIES = ("cublaslt", "xla", "deepgemm")

#: Preset names, ``<device>-<library>[-fast]`` -> (device, library, fast_accumulation).
#: One name means one thing everywhere (``gemm``, recipes' ``accumulate=``, ``emulate``'s
#: ``hardware=``, conformance): ``h100-xla`` is what XLA on an H100 computes (Triton GEMMs,
#: split-K chosen by K with :func:`xla_split`), ``h100-cublaslt`` cuBLASLt's default.
PRESETS: dict[str, tuple[str, str, bool]] = {
    "h100-cublaslt-fast": ("h100", "cublaslt", True),
    "h100-cublaslt": ("h100", "cublaslt", False),
    "h100-xla": ("h100", "xla", False),
    "h100-deepgemm": ("h100", "deepgemm", False),
    "a100-cublaslt": ("a100", "cublaslt", False),
    "v100-cublaslt": ("v100", "cublaslt", False),
    "l40s-cublaslt-fast": ("l40s", "cublaslt", True),
    "l40s-cublaslt": ("l40s", "cublaslt", False),
    "b200-cublaslt": ("b200", "cublaslt", False),
}

#: Short names kept because each can mean only one preset (one library modelled for the
#: device, or "fast", which only cuBLASLt has).
PRESET_ALIASES: dict[str, str] = {
    "h100-fast": "h100-cublaslt-fast",
    "a100": "a100-cublaslt",
    "v100": "v100-cublaslt",
    "l40s-fast": "l40s-cublaslt-fast",
    "l40s": "l40s-cublaslt",
    "b200": "b200-cublaslt",
}

#: Names refused because they meant different things in different places (``"h100"`` was
#: XLA's GEMMs in emulate and cuBLASLt's in recipes and ``gemm``): name -> the choices.
AMBIGUOUS_PRESETS: dict[str, tuple[str, ...]] = {
    "h100": ("h100-xla", "h100-cublaslt", "h100-cublaslt-fast"),
}

_WHAT = {
    "h100-xla": "XLA's Triton GEMMs on an H100",
    "h100-cublaslt": "cuBLASLt's default on an H100, FP8 promoted every 128",
    "h100-cublaslt-fast": "cuBLASLt with fast accumulation on an H100",
    "h100-deepgemm": "DeepGEMM's FP8 kernels on an H100, promoted every 128",
}


def canonical_preset(name: object) -> str:
    """The preset ``name`` stands for (itself or its alias's target). ValueError for an
    ambiguous name (listing the choices) or an unknown one (listing the names)."""
    if isinstance(name, str) and name in PRESETS:
        return name
    if isinstance(name, str) and name in PRESET_ALIASES:
        return PRESET_ALIASES[name]
    if isinstance(name, str) and name in AMBIGUOUS_PRESETS:
        opts = "; ".join(f"{c!r} ({_WHAT.get(c, c)})" for c in AMBIGUOUS_PRESETS[name])
        raise ValueError(f"hardware preset {name!r} is ambiguous; choose one of: {opts}")
    aliases = ", ".join(f"{k}={v}" for k, v in PRESET_ALIASES.items())
    raise ValueError(
        f"unknown hardware preset {name!r}; known: {', '.join(PRESETS)} (aliases: {aliases})"
    )


def xla_split(k: int) -> dict:
    """The split-K schedule taken for XLA's Triton GEMM on an H100 at contraction length
    ``k`` (:class:`Schedule` fields). From the captures: K <= 64 runs one chain (``xla_P1``
    to ``P3``); K = 128, 256, 512 (the float16 MLP's GEMMs and their transposes) fit 64-wide
    slices summed in float32 in order best; K = 4096 at 64 x 64 outputs is 128-wide slices
    summed by halves (``g16``). XLA picks its tiling per shape (M and N too), so other shapes
    are a guess: slices of 64 below K = 4096, of 128 (by halves where their count is a power
    of two, else in order) from there. (Exceptions measured: the FP8 64 x 1024 x 64 HIGHEST
    capture summed 64-wide slices by halves; the 32 x 4096 x 32 P4 GEMMs used the order
    (4, 2, 1, 0, 3): pass ``split_k``/``split_order`` to override.)"""
    if k <= 64:
        return {"split_k": None}
    if k < 4096:
        return {"split_k": 64, "split_order": "sequential"}
    n = -(-k // 128)
    if n & (n - 1) == 0:
        return {"split_k": 128, "split_order": tuple(reversed(range(n.bit_length() - 1)))}
    return {"split_k": 128, "split_order": "sequential"}


def _schedule(device: str, library: str, kind: str, fast: bool, k: int | None) -> Schedule:
    if library == "deepgemm":
        # DeepGEMM (deep_gemm/include/deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh and _1d1d.cuh):
        # per 128-k block, 4 wgmma k32 steps with the accumulator zeroed at the first
        # (scale_d = k), then the block's float32 result is promoted on CUDA cores. Without
        # scales, the promotion is a float32 add (fma(1, p, acc)): restart every 128.
        if device != "h100" or kind != "fp8":
            raise ValueError(
                f"library 'deepgemm' is modelled for FP8 operands on h100 (its sm90 kernels); "
                f"got {kind} on {device}. Presets for other cases: "
                + ", ".join(n for n, (_, lib, _) in PRESETS.items() if lib != "deepgemm")
            )
        return Schedule(restart_every=128)
    if library == "xla":
        # XLA's Triton GEMMs on Hopper upcast FP8 to float16 on small tiles; block K, split-K
        # and the reduction order depend on the shape: the rule of xla_split by K (the
        # compiled HLO shows the split; pass split_k / split_order to override).
        split = xla_split(k) if (k is not None and device == "h100") else {}
        if kind != "fp8":
            return Schedule(**split)
        # the float16 steps take each 32-k block's k in FP8 register pairs (2026-11-27 capture)
        return Schedule(upcast="float16", k_order="fp8_pairs", **split)
    if kind in ("fp8", "f8f6f4") and not fast:
        return Schedule(restart_every=128)
    if kind == "fp8" and fast and device == "h100":
        # cuBLASLt's heuristic split K at 2816 for K >= 8192 at M = N = 64 (captured)
        return Schedule(split_k=2816, split_k_min_k=8192)
    return Schedule()


@dataclasses.dataclass(frozen=True)
class Resolved:
    profile: Profile
    step: Step
    schedule: Schedule


def resolve(device: str, library: str, fast_accumulation: bool, kind: str,
            overrides: dict, k: int | None = None) -> Resolved:  # fmt: skip
    """The step and schedule for a call of contraction length ``k`` (None: the schedule's
    K-independent part), with ``overrides`` (any Step or Schedule field)."""
    if library not in LIBRARIES:
        raise ValueError(f"unknown library {library!r}; known: {', '.join(LIBRARIES)}")
    dev = DEVICE_ALIASES.get(str(device).lower(), str(device).lower())
    sched = _schedule(dev, library, kind, bool(fast_accumulation), k)
    upcast = overrides.get("upcast", sched.upcast)
    prof = get_profile(dev, "16bit" if upcast else kind)
    step_f = {f.name for f in dataclasses.fields(Step)}
    sched_f = {f.name for f in dataclasses.fields(Schedule)}
    unknown = set(overrides) - step_f - sched_f
    if unknown:
        raise ValueError(
            f"unknown override(s) {', '.join(sorted(unknown))}; allowed: "
            + ", ".join(sorted(step_f | sched_f))
        )
    assert prof.step is not None  # get_profile raised for a profile without one
    step = dataclasses.replace(prof.step, **{k: v for k, v in overrides.items() if k in step_f})
    sched = dataclasses.replace(sched, **{k: v for k, v in overrides.items() if k in sched_f})
    return Resolved(prof, step, sched)


def preset(name: object) -> dict:
    """``gemm`` keyword arguments of a named preset or alias (:func:`canonical_preset`)."""
    dev, lib, fast = PRESETS[canonical_preset(name)]
    return {"device": dev, "library": lib, "fast_accumulation": fast}
