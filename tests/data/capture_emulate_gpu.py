"""Capture, on a GPU, what emulate's model still takes on trust (run: python THIS.py OUT.npz).

Not a test: a GPU session runs it and copies the arrays it needs into tests/data/. It saves:
- ``un_{fn}_{f16,bf16}``: XLA GPU's result of each unary function on every 16-bit code
  (checks emulate's correctly rounded tables and its sigmoid expansion);
- ``red_{f16,bf16}_{n}_x`` / ``red_*``: a reduce_sum typed in the 16-bit format (as autodiff
  emits for a bias gradient) over n values, and its compiled HLO in ``hlo.json``;
- ``mlp_*``: the float16 MLP of capture_probe1.py with each matmul's float32 accumulator
  (``preferred_element_type=float32``) and float16 result, forward and backward, and the
  compiled HLO of the forward and gradient (the Triton schedule a GEMM model needs).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

UNARY = {
    "exp": jnp.exp, "log": jnp.log, "tanh": jnp.tanh, "sigmoid": jax.nn.sigmoid,
    "erf": jax.scipy.special.erf, "sin": jnp.sin, "expm1": jnp.expm1, "log1p": jnp.log1p,
    "rsqrt": jax.lax.rsqrt,
}  # fmt: skip


def main(out: str) -> None:
    save: dict[str, np.ndarray] = {}
    hlo: dict[str, str] = {"jax": jax.__version__, "devices": str(jax.devices())}
    for name, dt in (("f16", np.float16), ("bf16", ml_dtypes.bfloat16)):
        codes = jnp.asarray(np.arange(65536, dtype=np.uint16).view(dt))
        for fn_name, fn in UNARY.items():
            save[f"un_{fn_name}_{name}"] = np.asarray(jax.jit(fn)(codes)).view(np.uint16)
        rng = np.random.default_rng(23)
        for n in (128, 4096):
            x = jnp.asarray(rng.standard_normal((64, n)).astype(dt))
            f = jax.jit(lambda v: jax.lax.reduce(v, jnp.zeros((), v.dtype), jax.lax.add, (1,)))
            save[f"red_{name}_{n}_x"] = np.asarray(x).view(np.uint16)
            save[f"red_{name}_{n}"] = np.asarray(f(x)).view(np.uint16)
            hlo[f"red_{name}_{n}"] = f.lower(x).compile().as_text()
    k = jax.random.split(jax.random.key(0), 3)
    p = {
        "w1": (jax.random.normal(k[0], (256, 512)) / 16).astype(jnp.float16),
        "w2": (jax.random.normal(k[1], (512, 128)) / 22).astype(jnp.float16),
    }
    xb = (jax.random.normal(k[2], (128, 256)) * 4).astype(jnp.float16)

    def mlp(p, x):
        return jax.nn.log_softmax(jax.nn.gelu(x @ p["w1"]) @ p["w2"])

    def loss(p, x):
        return -jnp.mean(mlp(p, x)[:, 0])

    def acc(a, b):
        dims = (((1,), (0,)), ((), ()))
        return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

    q = jax.jit(lambda x, w: x @ w)(xb, p["w1"])
    h = jax.jit(jax.nn.gelu)(q)
    save["mlp_q"] = np.asarray(q).view(np.uint16)
    save["mlp_q_f32"] = np.asarray(jax.jit(acc)(xb, p["w1"]))
    save["mlp_z"] = np.asarray(jax.jit(lambda h, w: h @ w)(h, p["w2"])).view(np.uint16)
    save["mlp_z_f32"] = np.asarray(jax.jit(acc)(h, p["w2"]))
    grads = jax.jit(jax.grad(loss))(p, xb)
    save["mlp_grad_w1"] = np.asarray(grads["w1"]).view(np.uint16)
    save["mlp_grad_w2"] = np.asarray(grads["w2"]).view(np.uint16)
    hlo["mlp_forward"] = jax.jit(mlp).lower(p, xb).compile().as_text()
    hlo["mlp_grad"] = jax.jit(jax.grad(loss)).lower(p, xb).compile().as_text()
    np.savez_compressed(out, **save)
    with open(out + ".hlo.json", "w") as fh:
        json.dump(hlo, fh)


if __name__ == "__main__":
    main(sys.argv[1])
