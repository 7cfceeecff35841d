"""One adapter per library (and per backend): which formats and rounding modes it claims, and
its native conversion of a source array into a format, as codes.

An adapter whose library is not installed reports why (``unavailable``) and is skipped;
``support(fmt, source)`` says why a format or source is out of its reach.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from precisionlab.bits import encode
from precisionlab.bits._rounding import Rounding
from precisionlab.conformance._exact import MODES, values_to_codes
from precisionlab.formats import FloatFormat, Specials

__all__ = ["LIBRARIES", "Adapter", "Claim", "Output", "Unsupported", "adapters_for"]


class Unsupported(Exception):
    """Raised by ``convert`` when the library turns out not to support a conversion (found
    only by trying it, as with XLA's per-backend types); the runner reports the message."""


class Claim(NamedTuple):
    """A rounding behaviour a library claims for a conversion."""

    mode: Rounding
    saturate: bool = False


class Output(NamedTuple):
    """A library's result: codes (int64, -1 where it returned no code of the format), and the
    message of an exception it raised for some inputs (those get code -1), if any."""

    codes: np.ndarray
    raised: np.ndarray | None = None  # bool per input
    error: str | None = None
    values: np.ndarray | None = None  # float64, for libraries that return values


NEAREST = (Claim(Rounding.NEAREST_EVEN),)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _import(name: str) -> ModuleType | None:
    """The module, or None when it is not installed (tests hide modules by patching this)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _bits_of(out: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    uint = {1: np.uint8, 2: np.uint16, 4: np.uint32}[out.dtype.itemsize]
    return (out.view(uint).astype(np.int64)) & ((1 << fmt.bits) - 1)


class Adapter:
    """Base: subclasses set ``lib``/``name`` and implement the conversion."""

    lib = ""
    name = ""
    dist: str | None = None
    max_inputs: int | None = None  # slow scalar libraries run on a deterministic sample

    def unavailable(self) -> str | None:
        return None

    def version(self) -> str | None:
        return _version(self.dist) if self.dist else None

    def support(self, fmt: FloatFormat, source: str) -> str | None:
        """None if the library converts ``source`` into ``fmt``, else why not."""
        return None

    def claims(self, fmt: FloatFormat) -> tuple[Claim, ...]:
        return NEAREST

    def convert(self, x: np.ndarray, fmt: FloatFormat, claim: Claim) -> Output:
        raise NotImplementedError


class MlDtypes(Adapter):
    lib = name = dist = "ml_dtypes"

    def support(self, fmt: FloatFormat, source: str) -> str | None:
        if fmt.name in ("float16", "float32", "float64"):
            return "numpy's own type (see the numpy row)"
        if getattr(ml_dtypes, fmt.name, None) is None:
            return f"ml_dtypes {ml_dtypes.__version__} has no {fmt.name}"
        return None

    def convert(self, x: np.ndarray, fmt: FloatFormat, claim: Claim) -> Output:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            out = x.astype(getattr(ml_dtypes, fmt.name))
        return Output(_bits_of(out, fmt))


class Numpy(Adapter):
    lib = name = dist = "numpy"

    def support(self, fmt: FloatFormat, source: str) -> str | None:
        if fmt.name not in ("float16", "float32"):
            return "numpy has no such type (ml_dtypes adds it)"
        if source not in ("float32", "float64"):
            return "numpy has no such source type"
        return None

    def convert(self, x: np.ndarray, fmt: FloatFormat, claim: Claim) -> Output:
        with np.errstate(all="ignore"):
            out = x.astype(np.dtype(fmt.name))
        return Output(_bits_of(out, fmt))


_JAX_BACKENDS = ("cpu", "gpu", "tpu")


class Xla(Adapter):
    """``astype`` under ``jax.jit``: XLA's native convert on one backend."""

    lib = "xla"
    dist = "jaxlib"

    def __init__(self, platform: str) -> None:
        self.platform = platform
        self.name = f"xla:{platform}"
        self._fns: dict = {}

    def _device(self) -> jax.Device:
        return jax.devices(self.platform)[0]

    def _target(self, fmt: FloatFormat) -> Any:
        return getattr(jnp, fmt.name, None)

    def support(self, fmt: FloatFormat, source: str) -> str | None:
        if self._target(fmt) is None:
            return f"jax.numpy has no {fmt.name}"
        return None  # whether this backend converts it shows when convert() tries

    def convert(self, x: np.ndarray, fmt: FloatFormat, claim: Claim) -> Output:
        key = (fmt.name, x.dtype.name)
        with jax.enable_x64(x.dtype == np.float64):
            if key not in self._fns:
                target = self._target(fmt)
                self._fns[key] = jax.jit(lambda a: a.astype(target))  # runs where its input is
            xd = jax.device_put(x, self._device())
            if xd.dtype != x.dtype:
                raise RuntimeError(f"jax changed the input dtype {x.dtype} to {xd.dtype}")
            try:
                out = np.asarray(self._fns[key](xd))
            except Exception as err:  # what XLA raises for a type it lacks varies by version
                first = str(err).splitlines()[0][:120]
                raise Unsupported(f"XLA on {self.platform} cannot convert: {first}") from err
        return Output(_bits_of(out, fmt))


# gfloat's format objects for ours.
_GFLOAT = {
    "float32": "format_info_binary32",
    "float16": "format_info_binary16",
    "bfloat16": "format_info_bfloat16",
    "float8_e5m2": "format_info_ocp_e5m2",
    "float8_e4m3fn": "format_info_ocp_e4m3",
    "float6_e2m3fn": "format_info_ocp_e2m3",
    "float6_e3m2fn": "format_info_ocp_e3m2",
    "float4_e2m1fn": "format_info_ocp_e2m1",
    "float8_e8m0fnu": "format_info_ocp_e8m0",
}
_GFLOAT_MODES = {
    Rounding.NEAREST_EVEN: "TiesToEven",
    Rounding.NEAREST_AWAY: "TiesToAway",
    Rounding.TOWARD_ZERO: "TowardZero",
    Rounding.UP: "TowardPositive",
    Rounding.DOWN: "TowardNegative",
}


class Gfloat(Adapter):
    """gfloat's vectorized ``round_ndarray`` (numpy)."""

    lib = name = dist = "gfloat"

    def unavailable(self) -> str | None:
        return None if _import("gfloat") is not None else "gfloat is not installed"

    def support(self, fmt: FloatFormat, source: str) -> str | None:
        if fmt.name not in _GFLOAT:
            return "gfloat has no such format"
        if source not in ("float32", "float64"):
            return "gfloat rounds float32/float64 arrays"
        return None

    def claims(self, fmt: FloatFormat) -> tuple[Claim, ...]:
        return tuple(Claim(mode) for mode in _GFLOAT_MODES)

    def _args(self, fmt: FloatFormat, claim: Claim) -> tuple[Any, Any, Any, bool]:
        gfloat = _import("gfloat")
        assert gfloat is not None  # convert runs where unavailable() found it
        fi = getattr(importlib.import_module("gfloat.formats"), _GFLOAT[fmt.name])
        # Without inf or NaN gfloat raises on overflow unless it saturates, which is what
        # such formats do anyway (and what the reference does).
        sat = fmt.specials is Specials.NONE
        return gfloat, fi, getattr(gfloat.RoundMode, _GFLOAT_MODES[claim.mode]), sat

    def convert(self, x: np.ndarray, fmt: FloatFormat, claim: Claim) -> Output:
        gfloat, fi, rnd, sat = self._args(fmt, claim)
        with np.errstate(all="ignore"):
            out = np.asarray(gfloat.round_ndarray(fi, x, rnd, sat=sat), dtype=np.float64)
        return Output(values_to_codes(out, fmt), values=out)


class GfloatScalar(Gfloat):
    """gfloat's scalar ``round_float`` (pure Python + numpy), on a sample: it is slow."""

    name = "gfloat.round_float"
    max_inputs = 1000

    def convert(self, x: np.ndarray, fmt: FloatFormat, claim: Claim) -> Output:
        gfloat, fi, rnd, sat = self._args(fmt, claim)
        values = np.empty(len(x), dtype=np.float64)
        raised = np.zeros(len(x), dtype=bool)
        error = None
        with np.errstate(all="ignore"):
            for i, v in enumerate(x.tolist()):
                try:
                    values[i] = gfloat.round_float(fi, v, rnd, sat=sat)
                except ValueError as err:
                    values[i], raised[i] = np.nan, True
                    error = error or f"ValueError: {err}"
        codes = np.where(raised, -1, values_to_codes(values, fmt))
        return Output(codes, raised if raised.any() else None, error, values)


_TORCH_TYPES = (
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)


class Torch(Adapter):
    """``Tensor.to(dtype)`` on one torch device."""

    lib = "torch"
    dist = "torch"

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.name = f"torch:{device}"

    def unavailable(self) -> str | None:
        return None if _import("torch") is not None else "torch is not installed"

    def support(self, fmt: FloatFormat, source: str) -> str | None:
        torch = _import("torch")
        if fmt.name not in _TORCH_TYPES or getattr(torch, fmt.name, None) is None:
            return "torch has no such dtype"
        return None

    def convert(self, x: np.ndarray, fmt: FloatFormat, claim: Claim) -> Output:
        torch = _import("torch")
        assert torch is not None  # convert runs where unavailable() found it
        if x.dtype.name == "bfloat16":
            t = torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(x.copy())
        out = t.to(self.device).to(getattr(torch, fmt.name)).cpu()
        raw = out.view(torch.uint8 if fmt.bits <= 8 else torch.int16).numpy()
        return Output(raw.astype(np.int64) & ((1 << fmt.bits) - 1))


class Precisionlab(Adapter):
    """precisionlab's own JAX codec (``bits.encode``): every deterministic mode (opt-in: it
    compiles one program per format, source and mode)."""

    lib = name = dist = "precisionlab"

    def claims(self, fmt: FloatFormat) -> tuple[Claim, ...]:
        return tuple(Claim(mode) for mode in MODES)

    def convert(self, x: np.ndarray, fmt: FloatFormat, claim: Claim) -> Output:
        with jax.enable_x64(x.dtype == np.float64):
            codes = np.asarray(encode(x, fmt, rounding=claim.mode))
        return Output(codes.astype(np.int64))


def _xla_adapters() -> list[Adapter]:
    jax = _import("jax")
    assert jax is not None  # a required dependency (only optional ones are ever missing)
    out: list[Adapter] = []
    for platform in _JAX_BACKENDS:
        try:
            if jax.devices(platform):
                out.append(Xla(platform))
        except RuntimeError:  # no such backend here
            continue
    return out


def _torch_adapters() -> list[Adapter]:
    torch = _import("torch")
    if torch is None:
        return [Torch("cpu")]
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return [Torch(d) for d in devices]


#: Library name (as ``--libs`` takes it) -> the adapters it expands to.
LIBRARIES: dict[str, Callable[[], list[Adapter]]] = {
    "ml_dtypes": lambda: [MlDtypes()],
    "xla": _xla_adapters,
    "numpy": lambda: [Numpy()],
    "gfloat": lambda: [Gfloat(), GfloatScalar()],
    "torch": _torch_adapters,
    "precisionlab": lambda: [Precisionlab()],
}


def adapters_for(libs: list[str]) -> list[Adapter]:
    """Adapters for library names (validated; ``ValueError`` lists the allowed ones)."""
    out: list[Adapter] = []
    for lib in libs:
        if lib not in LIBRARIES:
            raise ValueError(f"unknown library {lib!r}; allowed: {', '.join(LIBRARIES)}")
        out.extend(LIBRARIES[lib]())
    return out
