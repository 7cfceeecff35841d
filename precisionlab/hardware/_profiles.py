"""Tensor-core profiles: each device's step for each input kind, with its source.

``hardware_checked`` says whether precisionlab reproduced that device's outputs bit for bit
(Hopper: the H100 captures in ``tests/data/h100_gemm.npz``); the other profiles follow the
published models and have not been run against hardware by this project.
"""

from __future__ import annotations

import dataclasses

from precisionlab.hardware._step import Step

__all__ = [
    "DEVICE_ALIASES", "PROFILES", "UNSUPPORTED_INPUTS", "Profile", "check_inputs", "get_profile",
]  # fmt: skip

KH = "Khattak and Mikaitis, Accurate Models of NVIDIA Tensor Cores, arXiv:2512.07004 (2025)"
MS = "Xie et al., MMA-Sim, arXiv:2511.10909 (2025), github.com/microsoft/MMA-Sim"
FASI = "Fasi, Higham, Mikaitis, Pranesh, Numerical behavior of NVIDIA tensor cores, PeerJ CS (2021)"
H100 = "H100 captures (tests/data/h100_gemm.npz; cuBLASLt via torch 2.11, XLA via jax 0.11.2)"


@dataclasses.dataclass(frozen=True)
class Profile:
    """A device's step for one input kind: ``"fp8"``, ``"16bit"``, ``"fp4"`` (block-scaled
    FP4, ``kind::mxf4nvf4``) or ``"f8f6f4"`` (FP6 operands, or FP4 mixed with FP8/FP6:
    Blackwell's ``kind::f8f6f4``)."""

    device: str
    kind: str
    step: Step | None  # None: the device has no such tensor-core instruction
    instruction: str
    source: str
    hardware_checked: bool
    note: str = ""


_FP8_HOPPER = Step(products=32, fraction_bits=13, result_bits=14)
_16_HOPPER = Step(products=16, fraction_bits=25, result_bits=24)
# Ampere's 16-bit step and instruction, which Ada (L40S) shares
_16_AMPERE = Step(products=8, fraction_bits=24)
_MMA_16 = "mma.m16n8k16 (two fused 8-product steps)"

#: Tensor-core profiles by "device/kind" (e.g. "h100/fp8"): each step's arithmetic, its
#: source and whether it was checked on hardware.
PROFILES: dict[str, Profile] = {
    f"{p.device}/{p.kind}": p
    for p in (
        Profile(
            "h100",
            "fp8",
            _FP8_HOPPER,
            "wgmma.m64nNk32 (e4m3/e5m2, f32 accumulator)",
            f"{H100}; agrees with {KH} and {MS}",
            True,
        ),
        Profile(
            "h100",
            "16bit",
            _16_HOPPER,
            "wgmma.m64nNk16 (f16/bf16, f32 accumulator)",
            f"{H100}; agrees with {KH} and {MS}",
            True,
            "published checks (tests/test_hardware_published.py, via hardware.mma): FTTN's "
            "extra-bit, FMA-width and subnormal outcomes and its matmul value 191.875; "
            "Khattak and Mikaitis' H100 and H200 outputs bit for bit "
            "(tests/hardware_km_validation.py)",
        ),
        Profile(
            "a100",
            "16bit",
            _16_AMPERE,
            _MMA_16,
            f"{MS}; {FASI}",
            False,
            "published checks (tests/test_hardware_published.py, via hardware.mma): Fasi et "
            "al.'s A100 suite (binary32 mode, float16 and bfloat16), FTTN's extra-bit, "
            "FMA-width and subnormal outcomes and its matmul value 0, Khattak and Mikaitis' "
            "A30 features; their A100 and A2 outputs bit for bit "
            "(tests/hardware_km_validation.py)",
        ),
        Profile("a100", "fp8", None, "none (Ampere has no FP8 tensor cores)", MS, False),
        Profile(
            "v100",
            "16bit",
            Step(products=4, fraction_bits=23),
            "mma.m8n8k4 (f16 only)",
            f"{FASI}; {MS}",
            False,
            "bfloat16 inputs are not supported by Volta. Published checks "
            "(tests/test_hardware_published.py, via hardware.mma): Fasi et al.'s V100 suite "
            "(binary32 mode), FTTN's extra-bit and subnormal outcomes and its matmul value 0; "
            "Khattak and Mikaitis' V100 outputs bit for bit (tests/hardware_km_validation.py). "
            "FTTN's FMA-width rule gives 1 on this step, FTTN published 4 (the rule never reaches "
            "the unit without an extra bit; Khattak and Mikaitis' probe gives 4)",
        ),
        Profile("v100", "fp8", None, "none (Volta has no FP8 tensor cores)", FASI, False),
        Profile(
            "l40s",
            "16bit",
            _16_AMPERE,
            _MMA_16,
            MS,
            False,
            "published checks: Khattak and Mikaitis' L40S and Ada RTX 1000 outputs bit for "
            "bit (tests/hardware_km_validation.py)",
        ),
        Profile(
            "l40s",
            "fp8",
            Step(products=16, fraction_bits=13, result_bits=14),
            "mma.m16n8k32 e4m3/e5m2 (two fused 16-product steps, 13-bit accumulation)",
            f"{MS}; {KH}",
            False,
            "published checks: Khattak and Mikaitis' L40S and Ada RTX 1000 E4M3 and E5M2 "
            "outputs bit for bit (tests/hardware_km_validation.py)",
        ),
        Profile(
            "b200",
            "16bit",
            Step(products=16, fraction_bits=25),
            "tcgen05.mma kind::f16",
            f"{MS}; {KH}",
            False,
            "published checks: Khattak and Mikaitis' B200 float16 and bfloat16 outputs bit for "
            "bit (tests/hardware_km_validation.py)",
        ),
        Profile(
            "b200",
            "fp8",
            Step(products=32, fraction_bits=25),
            "tcgen05.mma kind::f8f6f4 "
            "(also MXFP8 block-scaled: the E8M0 block scales add to the exponents)",
            f"{MS}; {KH} (its B200TC model has these parameters)",
            False,
            "Khattak and Mikaitis' published B200 FP8 outputs (mma.sync.m16n8k32 with a "
            "float32 C) are all reproduced by this step with accumulator_in_alignment=False "
            "(C added after the 32 products, round to nearest), 65% with C in the alignment "
            "(tests/hardware_km_validation.py); whether tcgen05.mma, this profile's "
            "instruction, joins C as mma.sync does is not known: MMA-Sim's choice is kept",
        ),
        Profile(
            "b200",
            "f8f6f4",
            Step(products=32, fraction_bits=25),
            "tcgen05.mma kind::f8f6f4 with FP6 (E2M3, E3M2) or mixed operands (E2M1 x FP8, "
            "FP6 x FP8, ...; MXFP6 with E8M0 scales per 32)",
            f"{MS} (its f8f6f4 model, extended to FP6)",
            False,
            "extrapolated: MMA-Sim models f8f6f4 for E4M3/E5M2 (E2M1 declared) and leaves "
            "E2M3/E3M2 as a TODO; this profile applies the same step to them, a subnormal FP6 "
            "element aligned with its own format's minimum exponent (MMA-Sim's rule for every "
            "format). Not checked on hardware",
        ),
        Profile(
            "b200",
            "fp4",
            Step(products=64, fraction_bits=35, exact_group=16),
            "tcgen05.mma kind::mxf4nvf4 (MXFP4: E8M0 scales per 32 or 16; NVFP4: UE4M3 "
            "scales per 16): 16-product exact groups, 35 fraction bits (two-limb kernel)",
            MS,
            False,
            "from MMA-Sim's published model (nv_fused_dot_add_with_block_scale); "
            "not checked on hardware by this project",
        ),
    )
}

#: Input formats a device's tensor cores do not take although it has a profile for their
#: kind: (device, format name) -> why (``gemm`` and ``mma`` raise naming it).
UNSUPPORTED_INPUTS: dict[tuple[str, str], str] = {
    ("v100", "bfloat16"): "Volta's tensor cores take float16 only",
}


def check_inputs(device: str, kind: str, names: tuple[str, ...], who: str) -> None:
    """ValueError when ``device`` (canonical name) does not take one of the input formats
    ``names`` of ``kind``, listing the devices that do."""
    for name in names:
        why = UNSUPPORTED_INPUTS.get((device, name))
        if why is not None:
            have = sorted({p.device for p in PROFILES.values() if p.kind == kind and p.step}
                          - {d for d, n in UNSUPPORTED_INPUTS if n == name})  # fmt: skip
            raise ValueError(
                f"{who}: {device} has no {name} tensor-core instruction ({why}); devices "
                f"with one: {', '.join(have)}"
            )


DEVICE_ALIASES = {"hopper": "h100", "h800": "h100", "h200": "h100", "ampere": "a100",
                  "volta": "v100", "ada": "l40s", "blackwell": "b200"}  # fmt: skip


def devices() -> tuple[str, ...]:
    return tuple(sorted({p.device for p in PROFILES.values()}))


def get_profile(device: str, kind: str) -> Profile:
    """The profile of ``device`` (name or alias) for ``kind``; ValueError listing what exists."""
    dev = DEVICE_ALIASES.get(str(device).lower(), str(device).lower())
    p = PROFILES.get(f"{dev}/{kind}")
    if p is None and dev in devices():
        p = Profile(dev, kind, None, f"none ({dev} has no {kind} tensor-core instruction "
                    "modelled here)", "", False)  # fmt: skip
    if p is None:
        known = ", ".join(devices())
        aliases = ", ".join(f"{k}={v}" for k, v in sorted(DEVICE_ALIASES.items()))
        raise ValueError(f"unknown device {device!r}; known: {known} (aliases: {aliases})")
    if p.step is None:
        have = [q.device for q in PROFILES.values() if q.kind == kind and q.step is not None]
        raise ValueError(
            f"{dev} has no {kind} tensor-core GEMM ({p.instruction}); devices with one: "
            + ", ".join(sorted(have))
        )
    return p
