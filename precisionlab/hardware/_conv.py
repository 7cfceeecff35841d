"""Convolutions as implicit GEMMs: ``lax.conv_general_dilated`` computed as a GEMM over patches.

A convolution with kernel spatial sizes ``(k_1, ..., k_d)`` is, per group, the GEMM

    ``y[m, o] = sum_k P[m, k] W[o, k]``

where a row ``m`` of the patch matrix ``P`` is one output position ``(n, s_1, ..., s_d)``
(batch, then the output's spatial dims, row-major) and ``k`` runs over the window. **The K
order is ``(k_1, ..., k_d, C_in)`` row-major: the input channel fastest**, then the last
kernel spatial dim (``kw``), then the first (``kh``): K = (kh, kw, C_in) for a 2-D
convolution. It is the channels-last ("NHWC" / "KRSC") implicit-GEMM order of cuDNN's and
CUTLASS's tensor-core convolutions, so a block of 32 consecutive K elements (MX) holds 32
input channels of one kernel tap when ``C_in >= 32``. The same order serves the recipes (the
scaled axis of both operands is this K), ``emulate``'s matmul models and
:func:`conv_general_dilated` below.

Groups: ``feature_group_count = G`` splits the input channels and the output features into G
consecutive groups, ``batch_group_count = G`` the input batch and the output features; each
group is one GEMM of the batch (leading) axis ``G``. The patches are gathered exactly (pad
and strided slices, no arithmetic), so an infinite or NaN input stays in the patches that
hold it and nowhere else.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from precisionlab.hardware._gemm import BATCHED_GEMM_DIMS, dot_general

__all__ = ["ConvGemm", "conv_gemm", "conv_general_dilated"]


def _pairs(x: Any, d: int, what: str) -> tuple[int, ...]:
    if x is None:
        return (1,) * d
    out = tuple(int(v) for v in x)
    if len(out) != d:
        raise ValueError(f"{what} needs {d} entries (one per spatial dim), got {x!r}")
    return out


@dataclasses.dataclass(frozen=True)
class ConvGemm:
    """How one convolution maps to a batched GEMM (static: shapes and parameters only).

    ``patches(lhs)``: (G, M, K); ``kernel(rhs)``: (G, O_g, K); ``output(y)`` takes the GEMM's
    (G, M, O_g) result back to the convolution's output layout. G is the group count
    (feature or batch groups, 1 for a plain convolution), M the output positions of a group
    (batch times output spatial size), K the window (kernel taps times input channels of a
    group, in the order of the module docstring), O_g the output features of a group.
    """

    lhs_spec: tuple[int, ...]
    rhs_spec: tuple[int, ...]
    out_spec: tuple[int, ...]
    strides: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    lhs_dilation: tuple[int, ...]
    rhs_dilation: tuple[int, ...]
    feature_groups: int
    batch_groups: int
    batch: int  # lhs batch size
    channels: int  # lhs feature size
    features: int  # rhs output features
    kernel: tuple[int, ...]  # kernel spatial sizes
    out_spatial: tuple[int, ...]

    @property
    def groups(self) -> int:
        """G: the GEMMs of the batch (feature or batch groups; 1 for a plain convolution)."""
        return self.feature_groups * self.batch_groups

    @property
    def m(self) -> int:
        """Rows of a group's patch matrix: output batch times output spatial positions."""
        return self.batch // self.batch_groups * math.prod(self.out_spatial)

    @property
    def k(self) -> int:
        """The contraction: kernel taps times the input channels of a group."""
        return math.prod(self.kernel) * (self.channels // self.feature_groups)

    @property
    def n(self) -> int:
        """Output features of a group (the GEMM's N)."""
        return self.features // self.groups

    def flops(self) -> int:
        """2 G M N K: the multiply-adds of the convolution, counted as two FLOPs each."""
        return 2 * self.groups * self.m * self.n * self.k

    def patches(self, lhs: jax.Array) -> jax.Array:
        """(G, M, K) patches of ``lhs`` (in its own dtype; zeros where the window reads
        padding)."""
        x = jnp.transpose(lhs, (self.lhs_spec[0], *self.lhs_spec[2:], self.lhs_spec[1]))
        inner = zip(self.padding, self.lhs_dilation, strict=True)
        cfg = [(0, 0, 0), *((lo, hi, ld - 1) for (lo, hi), ld in inner), (0, 0, 0)]
        xp = lax.pad(x, jnp.zeros((), x.dtype), cfg)
        taps = []
        for tap in itertools.product(*(range(k) for k in self.kernel)):
            start = [0, *(t * r for t, r in zip(tap, self.rhs_dilation, strict=True)), 0]
            limit = [
                xp.shape[0],
                *(s + (o - 1) * st + 1 if o else s for s, o, st in
                  zip(start[1:-1], self.out_spatial, self.strides, strict=True)),
                xp.shape[-1],
            ]  # fmt: skip
            taps.append(lax.slice(xp, start, limit, (1, *self.strides, 1)))
        p = jnp.stack(taps, axis=-2)  # (N, *out, T, C)
        n, c, t = self.batch, self.channels, len(taps)
        out = tuple(self.out_spatial)
        if self.feature_groups > 1:
            g = self.feature_groups
            p = p.reshape(n, *out, t, g, c // g)
            p = jnp.moveaxis(p, -2, 0)  # (G, N, *out, T, Cg)
            return p.reshape(g, self.m, self.k)
        g = self.batch_groups  # batch group j: the j-th consecutive block of input batches
        p = p.reshape(g, n // g, *out, t, c)
        return p.reshape(g, self.m, self.k)

    def kernel_rows(self, rhs: jax.Array) -> jax.Array:
        """(G, O_g, K): each output feature's window weights, in the patches' K order."""
        w = jnp.transpose(rhs, (self.rhs_spec[0], *self.rhs_spec[2:], self.rhs_spec[1]))
        return w.reshape(self.groups, self.n, self.k)

    def output(self, y: jax.Array) -> jax.Array:
        """The GEMM's (G, M, O_g) result in the convolution's output layout."""
        g, out = self.groups, tuple(self.out_spatial)
        y = y.reshape(g, self.batch // self.batch_groups, *out, self.n)
        y = jnp.moveaxis(y, 0, -2)  # (N', *out, G, O_g): features group-major
        y = y.reshape(self.batch // self.batch_groups, *out, self.features)
        nd = y.ndim
        perm = [0] * nd
        perm[self.out_spec[0]] = 0
        perm[self.out_spec[1]] = nd - 1
        for i, dim in enumerate(self.out_spec[2:]):
            perm[dim] = 1 + i
        return jnp.transpose(y, perm)

    def gemm_output(self, out: jax.Array) -> jax.Array:
        """The convolution's output (or its gradient) in the GEMM's (G, M, O_g) layout: the
        inverse of :meth:`output`."""
        sp = self.out_spec
        y = jnp.transpose(out, (sp[0], *sp[2:], sp[1]))  # (N', *out, G * O_g)
        y = y.reshape(*y.shape[:-1], self.groups, self.n)
        return jnp.moveaxis(y, -2, 0).reshape(self.groups, self.m, self.n)

    def output_shape(self) -> tuple[int, ...]:
        """The convolution's output shape (as ``lax.conv_general_dilated`` gives it)."""
        shape = [0] * (2 + len(self.kernel))
        shape[self.out_spec[0]] = self.batch // self.batch_groups
        shape[self.out_spec[1]] = self.features
        for i, dim in enumerate(self.out_spec[2:]):
            shape[dim] = self.out_spatial[i]
        return tuple(shape)


def _out_size(size: int, lo: int, hi: int, ld: int, k: int, rd: int, st: int) -> int:
    dilated = (size - 1) * ld + 1 if size else 0
    eff = (k - 1) * rd + 1
    padded = dilated + lo + hi
    return (padded - eff) // st + 1 if padded >= eff else 0


def conv_gemm(
    lhs_shape: Sequence[int],
    rhs_shape: Sequence[int],
    *,
    window_strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
) -> ConvGemm:
    """The :class:`ConvGemm` of a ``lax.conv_general_dilated`` call with these shapes and
    parameters (the same arguments, strings for ``padding`` and ``dimension_numbers``
    included). ValueError for sizes the convolution itself refuses."""
    lhs_shape, rhs_shape = tuple(int(s) for s in lhs_shape), tuple(int(s) for s in rhs_shape)
    if len(lhs_shape) != len(rhs_shape) or len(lhs_shape) < 3:
        raise ValueError(f"conv operands need the same rank >= 3, got {lhs_shape} and {rhs_shape}")
    dn = lax.conv_dimension_numbers(lhs_shape, rhs_shape, dimension_numbers)
    d = len(lhs_shape) - 2
    strides = _pairs(window_strides, d, "window_strides")
    ld = _pairs(lhs_dilation, d, "lhs_dilation")
    rd = _pairs(rhs_dilation, d, "rhs_dilation")
    kernel = tuple(rhs_shape[i] for i in dn.rhs_spec[2:])
    in_sp = tuple(lhs_shape[i] for i in dn.lhs_spec[2:])
    if isinstance(padding, str):
        if any(v != 1 for v in ld):
            raise ValueError("string padding with lhs_dilation: pass the padding pairs")
        eff = tuple((k - 1) * r + 1 for k, r in zip(kernel, rd, strict=True))
        pads = tuple(
            (int(lo), int(hi)) for lo, hi in lax.padtype_to_pads(in_sp, eff, strides, padding)
        )
    else:
        pads = tuple((int(lo), int(hi)) for lo, hi in padding)
    if len(pads) != d:
        raise ValueError(f"padding needs {d} (low, high) pairs, got {padding!r}")
    fg, bg = int(feature_group_count), int(batch_group_count)
    n, c = lhs_shape[dn.lhs_spec[0]], lhs_shape[dn.lhs_spec[1]]
    o, ci = rhs_shape[dn.rhs_spec[0]], rhs_shape[dn.rhs_spec[1]]
    if fg < 1 or bg < 1 or (fg > 1 and bg > 1):
        raise ValueError(f"feature_group_count {fg} and batch_group_count {bg}: one may be > 1")
    if c % fg or c // fg != ci or o % (fg * bg) or n % bg:
        raise ValueError(
            f"conv shapes {lhs_shape} x {rhs_shape} do not fit feature_group_count {fg} and "
            f"batch_group_count {bg}"
        )
    out_sp = tuple(
        _out_size(s, lo, hi, a, k, b, st)
        for s, (lo, hi), a, k, b, st in zip(in_sp, pads, ld, kernel, rd, strides, strict=True)
    )
    return ConvGemm(
        tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec), strides, pads, ld, rd,
        fg, bg, n, c, o, kernel, out_sp,
    )  # fmt: skip


def from_params(lhs_shape: Sequence[int], rhs_shape: Sequence[int], params: dict) -> ConvGemm:
    """The :class:`ConvGemm` of a ``conv_general_dilated`` equation's parameters."""
    return conv_gemm(
        lhs_shape, rhs_shape, window_strides=params["window_strides"],
        padding=params["padding"], lhs_dilation=params.get("lhs_dilation"),
        rhs_dilation=params.get("rhs_dilation"), dimension_numbers=params["dimension_numbers"],
        feature_group_count=params.get("feature_group_count", 1),
        batch_group_count=params.get("batch_group_count", 1),
    )  # fmt: skip


def conv_general_dilated(
    lhs: jax.Array, rhs: jax.Array, window_strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]], lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None, dimension_numbers: Any = None,
    feature_group_count: int = 1, batch_group_count: int = 1, *, preset: str | None = None,
    out_dtype: Any = jnp.float32, **gemm_kwargs: Any,
) -> jax.Array:  # fmt: skip
    """``lax.conv_general_dilated`` as a device's tensor cores compute it: the implicit GEMM
    over the patches (K order: kernel taps, then input channels fastest; see the module
    docstring) computed by :func:`~precisionlab.hardware.dot_general` with ``preset`` (or
    ``device``/``library``/``fast_accumulation``/overrides in ``gemm_kwargs``). Operands are
    8- or 16-bit, as for ``dot_general``; ``out_dtype`` as there."""
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    plan = conv_gemm(
        lhs.shape, rhs.shape, window_strides=window_strides, padding=padding,
        lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers, feature_group_count=feature_group_count,
        batch_group_count=batch_group_count,
    )  # fmt: skip
    dn = BATCHED_GEMM_DIMS
    y = dot_general(
        plan.patches(lhs), plan.kernel_rows(rhs), dn, preset=preset, out_dtype=out_dtype,
        **gemm_kwargs,
    )  # fmt: skip
    return plan.output(y)
