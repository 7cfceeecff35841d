"""recipes' accumulate= takes hardware presets (precisionlab.hardware)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precisionlab import hardware as hw
from precisionlab.recipes import get_recipe, matmul


@pytest.mark.slow
def test_recipe_accumulate_hardware_preset_is_the_hardware_gemm():
    """Forward of a per-tensor current-scaling recipe with accumulate="h100-fast" equals
    hardware.gemm on the quantized operands (scales: fl32(acc * fl32(sa * sb)))."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 4)), jnp.float32)
    r = get_recipe("current", accumulate="h100-fast")
    y = matmul(x, w, recipe=r)
    plain = matmul(x, w, recipe=get_recipe("current"))
    # same quantization, different accumulation: close, and not all equal
    assert np.allclose(y, plain, rtol=1e-2, atol=1e-2)
    qx = r.quantize(x[None], "x")
    qw = r.quantize(w.T[None], "w")
    a = qx.elems[0].astype(jnp.float8_e4m3fn)
    b = qw.elems[0].astype(jnp.float8_e4m3fn).T
    ref = hw.gemm(a, b, "h100", "cublaslt", True) * (qx.row_inv[0] * qw.row_inv[0].T)
    assert np.array_equal(np.asarray(y).view(np.uint32), np.asarray(ref).view(np.uint32))
    g = jax.grad(lambda w: matmul(x, w, recipe=r).sum())(w)  # dgrad/wgrad run the model too
    assert np.isfinite(np.asarray(g)).all()


def test_recipe_accumulate_errors():
    with pytest.raises(ValueError, match="unknown hardware preset 'h99'; known: h100-cublaslt"):
        get_recipe("current", accumulate="h99")
    with pytest.raises(ValueError, match="'h100' is ambiguous; choose one of: 'h100-xla'"):
        get_recipe("current", accumulate="h100")
    with pytest.raises(ValueError, match="exclude each other"):
        get_recipe("current", accumulate="h100-cublaslt", accumulate_bits=14)
    with pytest.raises(ValueError, match="needs accumulate_bits"):
        get_recipe("current", accumulate="sequential")
    # block scales need a block-scaled MMA: refused when the recipe is made, naming b200
    with pytest.raises(ValueError, match=r"scales blocks of 32 .* h100 has none.*b200-cublaslt"):
        get_recipe("mxfp8", accumulate="h100-cublaslt")
