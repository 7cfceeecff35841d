"""Presets: (device, library, fast accumulation) -> step and schedule, and names for them."""

from __future__ import annotations

import dataclasses

from precisionlab.hardware.profiles import DEVICE_ALIASES, Profile, devices, get_profile
from precisionlab.hardware.schedule import Schedule
from precisionlab.hardware.step import Step

__all__ = ["LIBRARIES", "PRESETS", "Resolved", "preset", "resolve"]

#: the libraries a preset or ``gemm(library=...)`` may name
LIBRARIES = ("cublaslt", "xla")

#: name -> (device, library, fast_accumulation)
PRESETS: dict[str, tuple[str, str, bool]] = {
    "h100-fast": ("h100", "cublaslt", True),
    "h100": ("h100", "cublaslt", False),
    "h100-xla": ("h100", "xla", False),
    "a100": ("a100", "cublaslt", False),
    "v100": ("v100", "cublaslt", False),
    "l40s-fast": ("l40s", "cublaslt", True),
    "l40s": ("l40s", "cublaslt", False),
    "b200": ("b200", "cublaslt", False),
}


def _schedule(device: str, library: str, kind: str, fast: bool) -> Schedule:
    if library == "xla":
        # XLA's Triton GEMMs on Hopper upcast FP8 to float16 on small tiles; block K, split-K
        # and the reduction order depend on the shape (read them from the compiled HLO and
        # pass split_k / split_order).
        return Schedule(upcast="float16" if kind == "fp8" else None)
    if kind == "fp8" and not fast:
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
            overrides: dict) -> Resolved:  # fmt: skip
    """The step and schedule for a call, with ``overrides`` (any Step or Schedule field)."""
    if library not in LIBRARIES:
        raise ValueError(f"unknown library {library!r}; known: {', '.join(LIBRARIES)}")
    dev = DEVICE_ALIASES.get(str(device).lower(), str(device).lower())
    sched = _schedule(dev, library, kind, bool(fast_accumulation))
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
    step = dataclasses.replace(prof.step, **{k: v for k, v in overrides.items() if k in step_f})
    sched = dataclasses.replace(sched, **{k: v for k, v in overrides.items() if k in sched_f})
    return Resolved(prof, step, sched)


def preset(name: str) -> dict:
    """``gemm`` keyword arguments of a named preset; ValueError listing the names."""
    if name not in PRESETS:
        raise ValueError(f"unknown hardware preset {name!r}; known: {', '.join(PRESETS)}")
    dev, lib, fast = PRESETS[name]
    return {"device": dev, "library": lib, "fast_accumulation": fast}


def known_devices() -> tuple[str, ...]:
    return devices()
