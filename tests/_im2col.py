"""A 2-D convolution's GEMM operands made by hand, for oracles that must not use the code under
test (:class:`precisionlab.hardware.ConvGemm`): NCHW input, OIHW kernel, NCHW output, feature
groups; K = (kernel taps, then the group's input channels fastest). Beside them, the rowwise
recipe's E4M3 quantization recounted with ml_dtypes, which the oracles measure them with."""

from __future__ import annotations

import numpy as np


def out_size(size: int, k: int, stride: int, pad: tuple[int, int]) -> int:
    return (size + pad[0] + pad[1] - k) // stride + 1


def patches(x: np.ndarray, kernel: tuple[int, int], strides, pads, groups: int) -> np.ndarray:
    """(G, M, K): one row per output position (batch, row, column), its window in K order."""
    n, c, h, w = x.shape
    (kh, kw), cg = kernel, c // groups
    ho, wo = out_size(h, kh, strides[0], pads[0]), out_size(w, kw, strides[1], pads[1])
    xp = np.pad(x, ((0, 0), (0, 0), pads[0], pads[1]))
    rows = np.empty((groups, n * ho * wo, kh * kw * cg), x.dtype)
    for g in range(groups):
        m = 0
        for b in range(n):
            for i in range(ho):
                for j in range(wo):
                    r0, c0 = i * strides[0], j * strides[1]
                    win = xp[b, g * cg : (g + 1) * cg, r0 : r0 + kh, c0 : c0 + kw]
                    rows[g, m] = win.transpose(1, 2, 0).reshape(-1)  # taps, then channels
                    m += 1
    return rows


def kernel_rows(k: np.ndarray, groups: int) -> np.ndarray:
    """(G, O_g, K): each output channel's window weights in the patches' K order."""
    o = k.shape[0]
    return k.transpose(0, 2, 3, 1).reshape(groups, o // groups, -1)


def gemm_output(y: np.ndarray, groups: int) -> np.ndarray:
    """(G, M, O_g): an NCHW output (or its gradient) with each group's channels as columns."""
    n, o, ho, wo = y.shape
    return y.transpose(0, 2, 3, 1).reshape(n * ho * wo, groups, o // groups).transpose(1, 0, 2)


def rowwise_e4m3(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rowwise recipe's quantization of float32 rows (..., K), recounted with ml_dtypes:
    per row a power-of-two scale 2**floor(log2(448 / max(amax, 1e-12))), E4M3 elements cast
    saturating. Returns float64 (rows, element values, scales (..., 1)); dequantized:
    elements / scales."""
    import ml_dtypes

    rows = rows.astype(np.float64)
    amax = np.maximum(np.abs(rows).max(axis=-1, keepdims=True), 1e-12)
    scale = 2.0 ** np.floor(np.log2(448.0 / amax))
    elems = np.clip(rows * scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return rows, elems, scale
