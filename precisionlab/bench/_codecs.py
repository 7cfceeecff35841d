"""``precisionlab bench codecs``: throughput of precisionlab's jitted encode/decode against
ml_dtypes ``astype`` (numpy ``rint`` + ``clip`` for integers) and gfloat, in one run.

Two modes. The default (chunked) measures the conversion itself; ``--whole-array`` measures
what a user meets: one call on the whole array, ``precisionlab.encode(x, fmt)`` and a jitted
``encode`` alike, against ml_dtypes' ``x.astype(dtype)``, every call returning a fresh array
(so page faults on fresh output pages count; their number per call is reported).

All engines see the same float32 inputs: magnitudes log-uniform over 2^-30 .. 2^20 with
random signs, so the narrow formats' subnormal, normal and overflow paths all run. Each
engine processes the input in chunks (default 2^22 elements): a fresh multi-megabyte output
buffer per call costs page faults on CPU, and chunk-sized buffers are recycled by the
allocators. gfloat, a pure-numpy reference that is orders of magnitude slower, runs on a
smaller slice (``--gfloat-size``); rates are per element, so the ratio is still meaningful.

Rates are reported as elements/s, as ratios to the peers, and as a fraction of this
machine's copy bandwidth (bytes read + written per element, against the faster of a numpy
memcpy and a jitted XLA copy, both into preallocated buffers). The engines and the copies
run interleaved, one call each per round, best of ``--repeats`` rounds, so
ratios compare runs under the same load. Every precisionlab result is also checked
code-for-code against the peer.

A third reference, "XLA floor", is a jitted kernel with the codec's memory traffic and a
single operation per element (the float32 bits truncated to the code's width; a code
zero-extended to float32's width), run the same way (chunks into donated buffers, or whole
arrays with fresh outputs) and timed alongside: what any XLA conversion of these shapes
reaches on this machine and load. "of floor" is precisionlab's rate over it (the jitted
call's in the whole-array mode): near 100%, the conversion's arithmetic is not what bounds
it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from precisionlab import _io
from precisionlab._alloc import apply_malloc_tuning, malloc_tuning
from precisionlab._text import UsageError, split_list, table
from precisionlab.bench._output import cpu_name
from precisionlab.bench._timing import (
    Timing,
    copy_kernel,
    minor_faults,
    repeats_int,
    time_call,
    time_interleaved,
    xla_copy_kernel,
)
from precisionlab.bits import decode, encode
from precisionlab.formats import FloatFormat, Format, IntFormat, get_format

HELP = "encode/decode throughput vs ml_dtypes and gfloat, as ratios and % of copy bandwidth"

DEFAULT_FORMATS = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "int8")
LOW, HIGH = -30, 20  # input magnitudes span 2**LOW .. 2**HIGH

# gfloat's format objects for our formats (gfloat's int8 is the scaled MX type: no peer).
_GFLOAT_NAMES = {
    "bfloat16": "format_info_bfloat16",
    "float16": "format_info_binary16",
    "float8_e4m3fn": "format_info_ocp_e4m3",
    "float8_e5m2": "format_info_ocp_e5m2",
    "float6_e2m3fn": "format_info_ocp_e2m3",
    "float6_e3m2fn": "format_info_ocp_e3m2",
    "float4_e2m1fn": "format_info_ocp_e2m1",
}


#: Most elements a codec bench takes: 4 GiB of float32 input (its outputs and the peers' come
#: on top).
SIZE_MAX = 1 << 30


def _size(text: str) -> int:
    """``16777216``, ``2^24``, ``2**24`` or ``16M`` (binary multiples K, M, G) -> an int in
    [1, :data:`SIZE_MAX`]."""
    s = text.strip().lower().replace("_", "")
    match = re.fullmatch(r"2(?:\^|\*\*)(\d{1,4})", s)
    try:
        if match:
            value = 1 << int(match.group(1))
        elif s and s[-1] in "kmg":
            value = int(s[:-1]) << {"k": 10, "m": 20, "g": 30}[s[-1]]
        else:
            value = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (e.g. 16777216, 2^24, 16M)"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be >= 1, got {text!r}")
    if value > SIZE_MAX:
        raise argparse.ArgumentTypeError(f"size must be <= 2^30, got {text[:40]!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=_size, default=1 << 24, help="elements (default 2^24)")
    parser.add_argument("--repeats", type=repeats_int, default=5, help="timed runs, best kept")
    parser.add_argument(
        "--formats",
        default=",".join(DEFAULT_FORMATS),
        help="comma-separated formats (default: bf16, fp16, e4m3fn, e5m2, e2m1, int8)",
    )
    parser.add_argument(
        "--chunk", type=_size, default=1 << 22, help="elements per call (default 2^22)"
    )
    parser.add_argument(
        "--gfloat-size",
        type=_size,
        default=1 << 16,
        help="elements for gfloat, which is slow (default 2^16; capped at --size)",
    )
    parser.add_argument(
        "--whole-array",
        action="store_true",
        help="one call on the whole array, as users call it (fresh outputs), instead of chunks",
    )
    parser.add_argument(
        "--malloc-tuning",
        action="store_true",
        help="apply precisionlab's opt-in glibc malloc settings first (see precisionlab._alloc)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--markdown", action="store_true", help="print the table as markdown (for the docs)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="also write rows to OUT.jsonl as they are measured and the full JSON to OUT",
    )


def make_inputs(size: int, seed: int = 0) -> np.ndarray:
    """float32[size]: magnitudes log-uniform over [2**LOW, 2**HIGH], random signs."""
    rng = np.random.default_rng(seed)
    magnitude = np.exp2(rng.uniform(LOW, HIGH, size))
    sign = np.where(rng.random(size) < 0.5, -1.0, 1.0)
    return (sign * magnitude).astype(np.float32)


# --- engines --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Engine:
    """A codec bound to its inputs: ``encode()`` converts the float32 input chunks and
    returns the code chunks, ``decode()`` converts the code chunks back to float32.

    Output buffers are allocated once and rewritten by every call (precisionlab through
    buffer donation, numpy peers through ``out=``/``np.copyto``), so the timings measure
    conversion, not page faults on fresh output pages. Returned chunks are the engine's own
    buffers: copy them before the next call.
    """

    name: str
    encode: Callable[[], list]
    decode: Callable[[], list]


def _chunked_engine(
    name: str,
    encode_fn: Callable[..., jax.Array],
    decode_fn: Callable[..., jax.Array],
    fmt: Format,
    xs: list[jax.Array],
    codes: list[jax.Array],
) -> Engine:
    """``encode_fn`` (float32 -> code) and ``decode_fn`` (code -> float32), jitted, over
    device chunks ``xs`` and ``codes``, writing into donated output buffers of their shapes."""
    # The donated argument is never read: it only hands its buffer over to the output.
    # keep_unused, or jit prunes it and the output gets a fresh buffer (page faults).
    enc = jax.jit(lambda x, out: encode_fn(x), donate_argnums=1, keep_unused=True)
    dec = jax.jit(lambda c, out: decode_fn(c), donate_argnums=1, keep_unused=True)
    enc_out = [jnp.zeros(x.shape, fmt.code_dtype) for x in xs]
    dec_out = [jnp.zeros(c.shape, jnp.float32) for c in codes]

    def run_encode() -> list:
        for i, x in enumerate(xs):
            enc_out[i] = enc(x, enc_out[i])
        return list(enc_out)

    def run_decode() -> list:
        for i, c in enumerate(codes):
            dec_out[i] = dec(c, dec_out[i])
        return list(dec_out)

    return Engine(name, run_encode, run_decode)


def precisionlab_engine(fmt: Format, xs: list[jax.Array], codes: list[jax.Array]) -> Engine:
    """precisionlab's jitted encode/decode over device chunks ``xs`` (float32) and
    ``codes``, writing into donated output buffers of the same shapes."""
    return _chunked_engine(
        "precisionlab",
        lambda x: encode(x, fmt),
        lambda c: decode(c, fmt, dtype=jnp.float32),
        fmt, xs, codes,
    )  # fmt: skip


def _floor_encode(x: jax.Array, fmt: Format) -> jax.Array:
    """float32 in, a code of ``fmt``'s width out, one operation: the bits truncated."""
    return jax.lax.bitcast_convert_type(x, jnp.uint32).astype(fmt.code_dtype)


def _floor_decode(c: jax.Array) -> jax.Array:
    """A code in, float32 out, one operation: the code zero-extended (a bit pattern)."""
    return jax.lax.bitcast_convert_type(c.astype(jnp.uint32), jnp.float32)


def floor_engine(fmt: Format, xs: list[jax.Array], codes: list[jax.Array]) -> Engine:
    """The XLA floor of :func:`precisionlab_engine`: the same chunks and donated buffers,
    one operation per element (no valid conversion; a bound, not a peer)."""
    return _chunked_engine(
        "xla floor", lambda x: _floor_encode(x, fmt), _floor_decode, fmt, xs, codes
    )


def _ml_dtype(fmt: Format) -> np.dtype | None:
    if isinstance(fmt, IntFormat):
        return None
    if fmt.name in ("float32", "float16"):
        return np.dtype(fmt.name)
    dtype = getattr(ml_dtypes, fmt.name, None)
    return None if dtype is None else np.dtype(dtype)


def peer_engine(fmt: Format, xs: list[np.ndarray], codes: list[np.ndarray]) -> Engine | None:
    """ml_dtypes' cast (the loop behind ``astype``) for floats; numpy ``rint`` + ``clip``
    for 8-bit ints, since ml_dtypes' integer casts truncate and wrap around instead of
    rounding and saturating. ``codes`` are unsigned codes of ``fmt``."""
    if isinstance(fmt, IntFormat):
        if fmt.bits != 8:
            return None
        store = np.dtype(np.int8 if fmt.signed else np.uint8)
        tmp = [np.empty_like(x) for x in xs]
        enc_out = [np.empty(x.shape, store) for x in xs]

        def int_encode() -> list:
            for x, t, out in zip(xs, tmp, enc_out, strict=True):
                np.rint(x, out=t)
                np.clip(t, fmt.min, fmt.max, out=t)
                np.copyto(out, t, casting="unsafe")
            return enc_out

        return Engine("numpy", int_encode, _cast_decoder(codes, store))
    dtype = _ml_dtype(fmt)
    if dtype is None:
        return None
    enc_out = [np.empty(x.shape, dtype) for x in xs]

    def cast_encode() -> list:
        with np.errstate(over="ignore"):  # overflow to inf/NaN is the format's convention
            for x, out in zip(xs, enc_out, strict=True):
                np.copyto(out, x, casting="unsafe")
        return enc_out

    # numpy's own float16 has no ml_dtypes counterpart: the peer there is numpy's cast.
    name = "numpy" if fmt.name in ("float16", "float32") else "ml_dtypes"
    return Engine(name, cast_encode, _cast_decoder(codes, dtype))


def _cast_decoder(codes: list[np.ndarray], dtype: np.dtype) -> Callable[[], list]:
    """The peers' decode: each chunk of unsigned ``codes`` viewed as ``dtype`` and cast to
    float32 into a preallocated buffer."""
    dec_out = [np.empty(c.shape, np.float32) for c in codes]

    def cast_decode() -> list:
        for c, out in zip(codes, dec_out, strict=True):
            np.copyto(out, c.view(dtype), casting="unsafe")
        return dec_out

    return cast_decode


def precisionlab_whole_array(fmt: Format, x: jax.Array, codes: jax.Array) -> dict:
    """The public calls and jitted whole-array calls on device arrays ``x`` (float32) and
    ``codes``, each returning a fresh array: name -> zero-argument callable."""
    jit_encode = jax.jit(lambda v: encode(v, fmt))
    jit_decode = jax.jit(lambda c: decode(c, fmt, dtype=jnp.float32))
    floor_encode = jax.jit(lambda v: _floor_encode(v, fmt))
    floor_decode = jax.jit(_floor_decode)
    return {
        "encode": lambda: encode(x, fmt),
        "jit_encode": lambda: jit_encode(x),
        "floor_encode": lambda: floor_encode(x),
        "decode": lambda: decode(codes, fmt, dtype=jnp.float32),
        "jit_decode": lambda: jit_decode(codes),
        "floor_decode": lambda: floor_decode(codes),
    }


def peer_whole_array(fmt: Format, x: np.ndarray, codes: np.ndarray) -> Engine | None:
    """The peers of :func:`peer_engine` as a user calls them: ``x.astype(dtype)`` and
    ``codes.view(dtype).astype(np.float32)``, a fresh array per call."""
    if isinstance(fmt, IntFormat):
        if fmt.bits != 8:
            return None
        store = np.dtype(np.int8 if fmt.signed else np.uint8)

        def int_encode() -> list:
            t = np.rint(x)
            np.clip(t, fmt.min, fmt.max, out=t)
            return [t.astype(store)]

        return Engine("numpy", int_encode, lambda: [codes.view(store).astype(np.float32)])
    dtype = _ml_dtype(fmt)
    if dtype is None:
        return None

    def cast_encode() -> list:
        with np.errstate(over="ignore"):  # overflow to inf/NaN is the format's convention
            return [x.astype(dtype)]

    name = "numpy" if fmt.name in ("float16", "float32") else "ml_dtypes"
    return Engine(name, cast_encode, lambda: [codes.view(dtype).astype(np.float32)])


def gfloat_engine(fmt: Format, x: np.ndarray, codes: np.ndarray) -> Engine | None:
    """gfloat's numpy codec (round_ndarray + encode_ndarray, decode_ndarray), if installed
    and it knows the format (its int8 is the scaled MX type, not a plain integer)."""
    try:
        import gfloat
        import gfloat.formats
    except ImportError:
        return None
    attr = _GFLOAT_NAMES.get(fmt.name)
    if attr is None:
        return None
    fi = getattr(gfloat.formats, attr)
    # gfloat raises on overflow for formats without inf/NaN unless asked to saturate, which
    # is what those formats do anyway.
    sat = isinstance(fmt, FloatFormat) and not fmt.has_inf and not fmt.has_nan
    return Engine(
        "gfloat",
        lambda: [gfloat.encode_ndarray(fi, gfloat.round_ndarray(fi, x, sat=sat))],
        lambda: [gfloat.decode_ndarray(fi, codes).astype(np.float32)],
    )


def _as_codes(fmt: Format, chunks: list) -> np.ndarray:
    """Concatenated output of an encoder as unsigned codes of ``fmt`` (uint64)."""
    out = np.concatenate([np.asarray(c) for c in chunks])
    if out.dtype.kind in "fV" or out.dtype.itemsize * 8 == fmt.bits:
        out = out.view(np.dtype(f"uint{out.dtype.itemsize * 8}"))
    mask = (1 << fmt.bits) - 1
    return out.astype(np.uint64) & np.uint64(mask)


def _as_values(chunks: list) -> np.ndarray:
    return np.concatenate([np.asarray(c) for c in chunks]).astype(np.float32)


def _split(x: np.ndarray, chunk: int) -> list[np.ndarray]:
    return [x[i : i + chunk] for i in range(0, x.size, chunk)]


def _mismatches(ours: np.ndarray, theirs: np.ndarray) -> int:
    """Elements that differ (bit patterns for floats, NaN matching any NaN)."""
    if ours.dtype.kind == "f":
        same = (ours.view(np.uint32) == theirs.view(np.uint32)) | (
            np.isnan(ours) & np.isnan(theirs)
        )
        return int(np.count_nonzero(~same))
    return int(np.count_nonzero(ours != theirs))


# --- measuring --------------------------------------------------------------------------------
@dataclass
class Row:
    """One measured (format, op): rates in elements/s; None where an engine is missing."""

    format: str
    op: str  # "encode" or "decode"
    precisionlab: float
    peer_name: str | None
    peer: float | None
    ratio_peer: float | None
    gfloat: float | None
    ratio_gfloat: float | None
    bytes_per_element: int
    copy_fraction: float
    mismatches: int | None  # codes (encode) or values (decode) that differ from the peer
    mode: str = "chunked"  # or "whole-array": then precisionlab is the public call's rate
    jit: float | None = None  # whole-array: a jitted whole-array call's rate
    ratio_jit_peer: float | None = None
    faults: int | None = None  # whole-array: minor page faults in one call (public, jit, peer)
    jit_faults: int | None = None
    peer_faults: int | None = None
    floor: float | None = None  # the XLA floor kernel's rate (one op per element, same bytes)
    floor_fraction: float | None = None  # precisionlab's (whole-array: jit's) rate over floor


def _code_bytes(fmt: Format) -> int:
    return np.dtype(fmt.code_dtype).itemsize


def _copy_kernels() -> tuple[dict[str, Callable], Callable[[dict[str, Timing]], float]]:
    """The two plain copies timed alongside a codec (``copy``, ``xla_copy``), and the copy
    bandwidth (bytes/s, read + written: the faster of the two) from their timings."""
    copy, moved = copy_kernel()
    xla_copy, xla_moved = xla_copy_kernel()

    def bandwidth(t: dict[str, Timing]) -> float:
        return max(t["copy"].rate(moved), t["xla_copy"].rate(xla_moved))

    return {"copy": copy, "xla_copy": xla_copy}, bandwidth


def _peer_mismatches(
    fmt: Format, codes: np.ndarray, decode: Callable[[], list], peer: Engine | None
) -> dict[str, int | None]:
    """Per op, the codes (``encode``: ``codes`` against the peer's) or values (``decode``:
    precisionlab's decoded chunks, ``decode()``, against the peer's) that differ; None
    without a peer."""
    if peer is None:
        return {"encode": None, "decode": None}
    theirs = _as_codes(fmt, peer.encode()).astype(codes.dtype)
    return {
        "encode": _mismatches(codes, theirs),
        "decode": _mismatches(_as_values(decode()), _as_values(peer.decode())),
    }


class _Measured(NamedTuple):
    """One format's timings ``t`` of ``n`` elements each, the copy bandwidth measured
    alongside (bytes/s), the peer and the mismatches against it per op."""

    fmt: Format
    t: dict[str, Timing]
    n: int
    bandwidth: float
    peer: Engine | None
    mismatches: dict[str, int | None]

    def row(self, op: str, *, floor_of: str, **fields: Any) -> Row:
        """The :class:`Row` of ``op``: precisionlab's rate (``t[op]``), the peer's
        (``t["peer_" + op]``), their ratio, the copy fraction, the floor (``t["floor_" + op]``;
        ``floor_of`` names the timing set against it), plus the mode's own ``fields``."""
        t, n = self.t, self.n
        ours = t[op].rate(n)
        floor = t[f"floor_{op}"].rate(n)
        peer_rate = None if self.peer is None else t[f"peer_{op}"].rate(n)
        bpe = 4 + _code_bytes(self.fmt)  # float32 in + code out, or code in + float32 out
        shared: dict[str, Any] = dict(
            format=self.fmt.name,
            op=op,
            precisionlab=ours,
            peer_name=None if self.peer is None else self.peer.name,
            peer=peer_rate,
            ratio_peer=None if peer_rate is None else ours / peer_rate,
            gfloat=None,
            ratio_gfloat=None,
            bytes_per_element=bpe,
            copy_fraction=ours * bpe / self.bandwidth,
            mismatches=self.mismatches[op],
            floor=floor,
            floor_fraction=t[floor_of].rate(n) / floor,
        )
        return Row(**{**shared, **fields})


def bench_whole_array(fmt: Format, x: np.ndarray, *, repeats: int) -> tuple[list[Row], float]:
    """Time whole-array encode and decode of ``fmt`` on ``x`` (float32) as users call them:
    precisionlab's public and jitted calls, the peer's ``astype`` and two plain copies
    (into preallocated buffers: the roofline) interleaved, one call each per round. Returns
    the rows and the copy bandwidth (bytes/s, read + written) measured alongside."""
    n = x.size
    x_dev = jax.device_put(x)
    codes = _as_codes(fmt, [encode(x_dev, fmt)]).astype(fmt.code_dtype)
    codes_dev = jax.device_put(codes)
    fns = precisionlab_whole_array(fmt, x_dev, codes_dev)
    peer = peer_whole_array(fmt, x, codes)
    copies, bandwidth_of = _copy_kernels()
    fns |= copies
    mismatch = _peer_mismatches(fmt, codes, lambda: [fns["decode"]()], peer)
    if peer is not None:
        fns |= {"peer_encode": peer.encode, "peer_decode": peer.decode}
    t = time_interleaved(fns, repeats=repeats)
    faults = {
        name: minor_faults(fn)
        for name, fn in fns.items()
        if "copy" not in name and "floor" not in name
    }
    measured = _Measured(fmt, t, n, bandwidth_of(t), peer, mismatch)
    rows = []
    for op in ("encode", "decode"):
        jit_rate = t[f"jit_{op}"].rate(n)
        peer_rate = None if peer is None else t[f"peer_{op}"].rate(n)
        rows.append(
            measured.row(
                op,
                floor_of=f"jit_{op}",
                mode="whole-array",
                jit=jit_rate,
                ratio_jit_peer=None if peer_rate is None else jit_rate / peer_rate,
                faults=faults[op],
                jit_faults=faults[f"jit_{op}"],
                peer_faults=None if peer is None else faults[f"peer_{op}"],
            )
        )
    return rows, measured.bandwidth


def bench_format(
    fmt: Format,
    x: np.ndarray,
    *,
    chunk: int,
    repeats: int,
    gfloat_size: int,
) -> tuple[list[Row], float]:
    """Time encode and decode of ``fmt`` on ``x`` (float32) for every engine.

    precisionlab, its peer and two plain copies run interleaved, one call each per round, so
    the ratios and the copy-bandwidth fraction compare runs under the same machine load. Returns
    the rows and the copy bandwidth (bytes/s, read + written) measured alongside.
    """
    n = x.size
    host_x = _split(x, chunk)
    dev_x = [jax.device_put(c) for c in host_x]
    # Codes to decode: precisionlab's own, checked against the peer's below.
    first = precisionlab_engine(fmt, dev_x, [])
    codes = _as_codes(fmt, first.encode()).astype(fmt.code_dtype)
    host_codes = _split(codes, chunk)
    ours_codes = [jax.device_put(c) for c in host_codes]
    ours = precisionlab_engine(fmt, dev_x, ours_codes)
    peer = peer_engine(fmt, host_x, host_codes)
    copies, bandwidth_of = _copy_kernels()
    floor = floor_engine(fmt, dev_x, ours_codes)
    fns = {"encode": ours.encode, "decode": ours.decode, **copies}
    fns |= {"floor_encode": floor.encode, "floor_decode": floor.decode}
    mismatch = _peer_mismatches(fmt, codes, ours.decode, peer)
    if peer is not None:
        fns |= {"peer_encode": peer.encode, "peer_decode": peer.decode}
    t = time_interleaved(fns, repeats=repeats)
    bandwidth = bandwidth_of(t)

    m = min(gfloat_size, n)
    gf = gfloat_engine(fmt, x[:m], codes[:m])
    gf_rate: dict[str, float | None] = {"encode": None, "decode": None}
    if gf is not None:
        g_reps = min(repeats, 3)
        gf_rate["encode"] = time_call(gf.encode, repeats=g_reps).rate(m)
        gf_rate["decode"] = time_call(gf.decode, repeats=g_reps).rate(m)

    measured = _Measured(fmt, t, n, bandwidth, peer, mismatch)
    rows = []
    for op in ("encode", "decode"):
        g = gf_rate[op]
        ratio = None if g is None else t[op].rate(n) / g
        rows.append(measured.row(op, floor_of=op, gfloat=g, ratio_gfloat=ratio))
    return rows, bandwidth


def machine() -> dict:
    """Where the numbers were measured."""
    cpu = cpu_name()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "jax": jax.__version__,
        "ml_dtypes": ml_dtypes.__version__,
        "python": platform.python_version(),
        # glibc malloc settings applied in this process (see precisionlab._alloc).
        "malloc_tuning": malloc_tuning(),
        # Other processes share the cores: the 1-minute load average says how busy they were.
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def _write_json_atomic(path: Path, payload: dict) -> None:
    _io.write_json(path, payload)


def _m(rate: float | None) -> str:
    return "-" if rate is None else f"{rate / 1e6:,.0f}"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:,.1f}x"


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def _table(body: list[list[str]], headers: list[str], align: str, markdown: bool) -> str:
    """``body`` under ``headers`` as aligned plain text or a markdown table (``align``: ``l``
    or ``r`` per column)."""
    if not markdown:
        return table(body, headers, align=align)
    rule = "|" + "".join("---|" if a == "l" else "--:|" for a in align)
    head, *rows = ("| " + " | ".join(row) + " |" for row in [headers, *body])
    return "\n".join([head, rule, *rows])


def render_whole_array(rows: list[Row], markdown: bool = False) -> str:
    """The whole-array results table, aligned plain text or a markdown table."""
    body = [
        [
            r.format,
            r.op,
            _m(r.precisionlab),
            _m(r.jit),
            r.peer_name or "-",
            _m(r.peer),
            _x(r.ratio_peer),
            _x(r.ratio_jit_peer),
            f"{100 * r.copy_fraction:.0f}%",
            _pct(r.floor_fraction),
            " / ".join(
                "-" if f is None else str(f) for f in (r.faults, r.jit_faults, r.peer_faults)
            ),
            "-" if r.mismatches is None else str(r.mismatches),
        ]
        for r in rows
    ]
    headers = ["format", "op", "public M/s", "jit M/s", "peer", "peer M/s", "public vs peer"]
    headers += ["jit vs peer", "of copy bw", "jit of floor", "faults/call", "mismatches"]
    return _table(body, headers, "llrrlrrrrrrr", markdown)


def render(rows: list[Row], markdown: bool = False) -> str:
    """The results table, aligned plain text or a markdown table."""
    if rows and rows[0].mode == "whole-array":
        return render_whole_array(rows, markdown)
    body = [
        [
            r.format,
            r.op,
            _m(r.precisionlab),
            r.peer_name or "-",
            _m(r.peer),
            _x(r.ratio_peer),
            _m(r.gfloat),
            _x(r.ratio_gfloat),
            f"{100 * r.copy_fraction:.0f}%",
            _pct(r.floor_fraction),
            "-" if r.mismatches is None else str(r.mismatches),
        ]
        for r in rows
    ]
    headers = ["format", "op", "precisionlab M/s", "peer", "peer M/s", "vs peer"]
    headers += ["gfloat M/s", "vs gfloat", "of copy bw", "of floor", "mismatches"]
    return _table(body, headers, "llrlrrrrrrr", markdown)


# The targets on CPU: (description, threshold, values of a row, formats it covers).
_NARROW = ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn")


def _ratio(field: str) -> Callable[[Row], list]:
    return lambda r: [getattr(r, field)]


def _both_ratios(r: Row) -> list:
    return [r.ratio_peer, r.ratio_jit_peer]


def _narrow_float(name: str) -> bool:
    fmt = get_format(name)
    return isinstance(fmt, FloatFormat) and fmt.bits <= 8


#: A target's rows: those of these formats, of formats a predicate accepts, or all (None).
_Covers = tuple[str, ...] | Callable[[str], bool] | None
_TARGETS: dict[str, list[tuple[str, float, Callable[[Row], list], _Covers]]] = {
    "chunked": [
        ("bf16/fp16 >= 2x peer", 2.0, _ratio("ratio_peer"), ("bfloat16", "float16")),
        ("fp8/fp4 >= 10x ml_dtypes", 10.0, _ratio("ratio_peer"), _NARROW),
        ("all >= 100x gfloat", 100.0, _ratio("ratio_gfloat"), None),
        ("all >= 70% of copy bandwidth", 0.7, _ratio("copy_fraction"), None),
    ],
    # For the public and the jitted call alike.
    "whole-array": [
        ("bf16 >= 1.0x ml_dtypes", 1.0, _both_ratios, ("bfloat16",)),
        ("fp16 >= 2x numpy", 2.0, _both_ratios, ("float16",)),
        ("8/6/4-bit floats >= 10x ml_dtypes", 10.0, _both_ratios, _narrow_float),
    ],
}


def targets(rows: list[Row]) -> list[dict]:
    """Each target for the rows' mode with the worst measured value among the
    rows it covers and whether it is met (rows without the peer are left out)."""
    mode = rows[0].mode if rows else "chunked"
    out = []
    for name, threshold, values_of, formats in _TARGETS[mode]:
        if formats is None:
            covered = rows
        elif callable(formats):
            covered = [r for r in rows if formats(r.format)]
        else:
            covered = [r for r in rows if r.format in formats]
        values = [(v, f"{r.format} {r.op}") for r in covered for v in values_of(r) if v is not None]
        if not values:
            continue
        worst, where = min(values)
        met = sum(v >= threshold for v, _ in values)
        out.append(
            {"target": name, "met": met, "of": len(values), "worst": worst, "worst_at": where}
        )
    return out


def _render_targets(found: list[dict], mode: str = "chunked") -> str:
    lines = []
    for t in found:
        worst = t["worst"]
        shown = f"{100 * worst:.0f}%" if "bandwidth" in t["target"] else f"{worst:,.1f}x"
        lines.append(
            f"  {t['target']:<34} met by {t['met']} of {t['of']}; worst {shown} ({t['worst_at']})"
        )
    what = "public and jitted calls" if mode == "whole-array" else "chunked encode"
    return f"targets ({what}):\n" + "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    formats = [get_format(name) for name in split_list(args.formats)]
    if not formats:
        raise UsageError("--formats needs at least one format")
    wide = [f.name for f in formats if isinstance(f, FloatFormat) and f.mantissa_bits > 23]
    if wide:
        raise UsageError(f"the benchmark encodes float32 inputs; {', '.join(wide)} is wider")
    if args.malloc_tuning:
        apply_malloc_tuning()  # before the first computation, so XLA's threads see it
    x = make_inputs(args.size)
    info = machine()
    whole = args.whole_array
    mode = "whole-array" if whole else "chunked"
    if not args.json:
        if whole:
            print(
                f"{args.size:,} float32 inputs, |x| in 2^{LOW}..2^{HIGH}, one call on the whole "
                f"array (fresh outputs), best of {args.repeats}; malloc tuning: "
                f"{info['malloc_tuning'] or 'none'}"
            )
        else:
            print(
                f"{args.size:,} float32 inputs, |x| in 2^{LOW}..2^{HIGH}, chunks of "
                f"{args.chunk:,}, best of {args.repeats}; gfloat on the first "
                f"{min(args.gfloat_size, args.size):,}"
            )
        load = info["load_average_1min"]
        print(
            f"machine: {info['cpu']}, {info['cores']} cores, jax {info['jax']} on "
            f"{info['backend']}" + ("" if load is None else f", load average {load:.1f}")
        )
    jsonl = None
    if args.out is not None:
        # appended through the same rules as every write: no link, device or hard link
        jsonl = _io.JsonlWriter(args.out.with_suffix(".jsonl"))
    rows: list[Row] = []
    bandwidths: dict[str, float] = {}
    try:
        for fmt in formats:
            if whole:
                new, bandwidths[fmt.name] = bench_whole_array(fmt, x, repeats=args.repeats)
            else:
                new, bandwidths[fmt.name] = bench_format(
                    fmt, x, chunk=args.chunk, repeats=args.repeats, gfloat_size=args.gfloat_size
                )
            rows += new
            if jsonl is not None:
                for row in new:
                    jsonl.write(asdict(row))
            if not args.json:
                print(f"  measured {fmt.name}", file=sys.stderr, flush=True)
    finally:
        if jsonl is not None:
            jsonl.close()
    payload = {
        "benchmark": "codecs",
        "mode": mode,
        "size": args.size,
        "chunk": None if whole else args.chunk,
        "repeats": args.repeats,
        "gfloat_size": None if whole else min(args.gfloat_size, args.size),
        "input": f"float32, |x| log-uniform in [2^{LOW}, 2^{HIGH}], random signs",
        "copy_bandwidth_bytes_per_s": max(bandwidths.values()),
        "copy_bandwidth_per_format": bandwidths,
        "machine": info,
        "rows": [asdict(r) for r in rows],
        "targets": targets(rows),
    }
    if args.out is not None:
        _write_json_atomic(args.out, payload)
    if args.json:
        print(json.dumps(payload, indent=2))
        return 0
    low, high = min(bandwidths.values()), max(bandwidths.values())
    print(
        f"copy bandwidth (read + write), measured alongside each format: {low / 1e9:.1f} to "
        f"{high / 1e9:.1f} GB/s"
    )
    print(render(rows, markdown=args.markdown))
    print(_render_targets(payload["targets"], mode))
    if whole:
        print(
            "M/s: million elements per second (best of the repeats); public: precisionlab.encode"
            "/decode; jit: a jitted whole-array call;\nvs peer: precisionlab's rate over the "
            "peer's astype; of copy bw: the public call's bytes read + written per second over "
            "a plain copy's\ninto a preallocated buffer; jit of floor: the jitted call's rate "
            "over a one-operation XLA kernel\nwith the same bytes in and out (fresh outputs); "
            "faults/call: minor page faults in one "
            "call (public / jit / peer); mismatches: against the peer."
        )
        return 0
    print(
        "M/s: million elements per second (best of the repeats); vs peer / vs gfloat: "
        "precisionlab's rate over theirs;\nof copy bw: precisionlab's bytes read + written per "
        "second over a plain copy's\n(numpy or XLA, the faster, timed alongside); of floor: "
        "precisionlab's rate over a one-operation XLA kernel\nwith the same bytes in and out, "
        "timed alongside; mismatches: codes (encode) or values (decode) differing from the peer."
    )
    return 0
