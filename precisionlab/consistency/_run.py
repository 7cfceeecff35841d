"""Running one :class:`~precisionlab.consistency.Stack` on a model: its logits, and (for an
:class:`~precisionlab.consistency._lm.LM` with layers) every layer's output, with any layer's
output patched from another run.

:class:`Runner` compiles each (stack, shape) program once and reuses it: a gap, the
attribution's patched runs and a batch-size sweep of one stack share their programs. Programs
with layers always take a patch (every flag false: nothing replaced) and return every layer's
output, so one program serves all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab.consistency._lm import LM, as_lm
from precisionlab.consistency._stack import Stack, parse_stack
from precisionlab.emulate import emulate
from precisionlab.mixed._policy import cast_floating

__all__ = ["Result", "Runner"]


@dataclasses.dataclass(frozen=True)
class Result:
    """One stack's run: ``logits`` [B, T, V] (numpy, the stack's output dtype) and ``acts``
    (layer -> output [B, T, ...], numpy; empty for a model without layers)."""

    stack: Stack
    logits: np.ndarray
    acts: dict[str, np.ndarray]


def _computes_in(fn: Callable, args: Sequence[Any], dtype: Any) -> bool:
    """Whether any operation of the program of ``fn(*args)`` returns a value of ``dtype``
    (its inputs having it is not enough: a model may convert them to float32 first)."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    want = np.dtype(dtype)

    def walk(jx: Any) -> bool:
        for eqn in jx.eqns:
            for v in eqn.outvars:
                if getattr(getattr(v, "aval", None), "dtype", None) == want:
                    return True
            for p in eqn.params.values():
                inner = getattr(p, "jaxpr", None)
                if inner is not None and walk(getattr(inner, "jaxpr", inner)):
                    return True
        return False

    return walk(jaxpr.jaxpr)


class Runner:
    """Runs stacks of one model on one set of params, caching compiled programs.

    Args:
      model: a ``logits_fn(params, tokens)``, an :class:`~precisionlab.consistency._lm.LM`
        or a built-in Transformer (see :func:`~precisionlab.consistency._lm.as_lm`).
      params: the model's (float32) params.
    """

    def __init__(self, model: Any, params: Any):
        self.lm: LM = as_lm(model)
        self.params = params
        self._programs: dict[Any, Any] = {}

    # --- programs -----------------------------------------------------------------------
    def _wrap(self, fn: Callable, stack: Stack) -> Callable:
        """``fn`` jitted natively, or emulated on ``stack.hardware`` and jitted."""
        if stack.hardware == "native":
            return jax.jit(fn)
        return jax.jit(emulate(fn, stack.policy, hardware=stack.hardware))

    def _full(self, stack: Stack) -> Callable:
        key = ("full", stack.policy, stack.hardware, stack.lm_head_fp32)
        if key not in self._programs:
            lm, pol = self.lm, stack.policy
            if lm.takes_policy:

                def fn(params: Any, tokens: jax.Array, patch: Any) -> Any:
                    return lm.logits(params, tokens, pol, lm_head_fp32=stack.lm_head_fp32,
                                     patch=patch, capture=bool(lm.layers))  # fmt: skip
            else:
                lm.taps(lm_head_fp32=stack.lm_head_fp32)  # a model with no float32 head: raises

                def fn(params: Any, tokens: jax.Array, patch: Any) -> Any:
                    return lm.logits(params, tokens, pol), {}

            self._programs[key] = self._wrap(fn, stack)
        return self._programs[key]

    def _step(self, stack: Stack) -> Callable:
        key = ("decode", stack.policy, stack.hardware, stack.lm_head_fp32, stack.kv_block)
        if key not in self._programs:
            lm, pol = self.lm, stack.policy

            def fn(params: Any, cache: Any, token: jax.Array, pos: jax.Array, patch: Any) -> Any:
                return lm.decode(params, cache, token, pos, pol, kv_block=stack.kv_block,
                                 lm_head_fp32=stack.lm_head_fp32, patch=patch,
                                 capture=bool(lm.layers))  # fmt: skip

            self._programs[key] = self._wrap(fn, stack)
        return self._programs[key]

    def _params_for(self, stack: Stack) -> Any:
        """The params as the program takes them: float32 for a model that applies the policy
        itself or under emulate; cast to the compute dtype for a plain function run natively
        (checked to compute in it: a model that casts back to float32 would silently not)."""
        if self.lm.takes_policy or stack.hardware != "native":
            return self.params
        key = ("cast", stack.policy.compute_dtype)
        if key not in self._programs:
            self._programs[key] = cast_floating(self.params, stack.policy.compute_dtype)
        return self._programs[key]

    def _check_native_dtype(self, stack: Stack, tokens: jax.Array) -> None:
        if self.lm.takes_policy or stack.hardware != "native":
            return
        cd = np.dtype(stack.policy.compute_dtype)
        key = ("checked", cd, tokens.shape)
        if key in self._programs or cd == np.dtype(np.float32):
            return
        lm = self.lm
        if not _computes_in(lambda p, t: lm.logits(p, t, stack.policy),
                            (self._params_for(stack), tokens), cd):  # fmt: skip
            raise ValueError(
                f"logits_fn computes no value in {cd.name} when given {cd.name} params, so a "
                f"native {stack.format} stack would run it in float32; run it under a GPU "
                "model (hardware='h100-xla', which rounds every operation to the policy's "
                "format) or pass a model that follows its params' dtype"
            )
        self._programs[key] = True

    # --- running ------------------------------------------------------------------------
    def _patch(self, patch: dict[str, np.ndarray] | None, rows: slice, pos: int | None,
               shapes: dict[str, Any]) -> dict:  # fmt: skip
        """Every layer of the program: (flag, value) with the patched one's flag true."""
        out = {}
        for name in self.lm.layers:
            if patch is not None and name in patch:
                v = np.asarray(patch[name])[rows]
                v = v if pos is None else v[:, pos]
                out[name] = (jnp.asarray(True), jnp.asarray(v))
            else:
                out[name] = (jnp.asarray(False), jnp.zeros(shapes[name].shape,
                                                           shapes[name].dtype))  # fmt: skip
        return out

    def _shapes(self, stack: Stack, tokens: jax.Array, decode: bool) -> dict[str, Any]:
        """The layers' output shapes (and dtypes) of one call of the stack's program."""
        key = ("shapes", decode, stack.policy, stack.lm_head_fp32, tokens.shape)
        if key in self._programs:
            return self._programs[key]
        lm, pol = self.lm, stack.policy
        if not lm.layers:
            shapes: dict[str, Any] = {}
        elif decode:
            b = tokens.shape[0]
            cache = jax.eval_shape(lambda p: lm.init_cache(p, b, tokens.shape[1], pol),
                                   self.params)  # fmt: skip
            _, _, shapes = jax.eval_shape(
                lambda p, c, t: lm.decode(p, c, t, jnp.int32(0), pol, kv_block=stack.kv_block,
                                          lm_head_fp32=stack.lm_head_fp32, capture=True),
                self.params, cache, tokens[:, 0],
            )  # fmt: skip
        else:
            _, shapes = jax.eval_shape(
                lambda p, t: lm.logits(p, t, pol, lm_head_fp32=stack.lm_head_fp32,
                                       capture=True), self.params, tokens)  # fmt: skip
        self._programs[key] = shapes
        return shapes

    def run(self, stack: Any, tokens: Any, *, patch: dict[str, np.ndarray] | None = None
            ) -> Result:  # fmt: skip
        """The logits (and layer outputs) of ``stack`` on int32 ``tokens`` [B, T].

        ``patch``: layer -> output [B, T, ...] to put in place of the stack's own (another
        stack's captured ``acts``); the layers must be among the model's ``layers``.
        """
        stack = parse_stack(stack)
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be an int array [B, T]; got {tokens.dtype}"
                             f"{list(tokens.shape)}")  # fmt: skip
        tokens = tokens.astype(jnp.int32)
        if patch:
            unknown = [k for k in patch if k not in self.lm.layers]
            if unknown:
                raise ValueError(f"cannot patch {unknown[0]!r}: the model's layers are "
                                 f"{', '.join(self.lm.layers) or 'none'}")  # fmt: skip
        n = tokens.shape[0]
        bs = stack.batch_size or n
        if n % bs:
            raise ValueError(f"Stack.batch_size={bs} must divide the {n} rows")
        if stack.mode == "decode" and not self.lm.decodes:
            raise ValueError(
                "mode='decode' needs a model with a KV cache (an LM with init_cache and "
                "decode, such as TransformerLM for the built-in transformer); a plain "
                "logits_fn supports mode='full'"
            )
        logits, acts = [], []
        for start in range(0, n, bs):
            rows = slice(start, start + bs)
            chunk = tokens[rows]
            if stack.mode == "full":
                lg, ac = self._run_full(stack, chunk, patch, rows)
            else:
                lg, ac = self._run_decode(stack, chunk, patch, rows)
            logits.append(lg)
            acts.append(ac)
        cat = {k: np.concatenate([a[k] for a in acts]) for k in acts[0]}
        return Result(stack, np.concatenate(logits), cat)

    def _run_full(
        self, stack: Stack, tokens: jax.Array, patch: dict[str, np.ndarray] | None, rows: slice
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        self._check_native_dtype(stack, tokens)
        fn = self._full(stack)
        shapes = self._shapes(stack, tokens, False)
        lg, acts = fn(self._params_for(stack), tokens, self._patch(patch, rows, None, shapes))
        return np.asarray(lg), {k: np.asarray(v) for k, v in acts.items()}

    def _run_decode(
        self, stack: Stack, tokens: jax.Array, patch: dict[str, np.ndarray] | None, rows: slice
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        fn = self._step(stack)
        b, t = tokens.shape
        shapes = self._shapes(stack, tokens, True)
        cache = self.lm.init_cache(self.params, b, t, stack.policy)
        logits, acts = [], []
        for pos in range(t):
            lg, cache, ac = fn(self.params, cache, tokens[:, pos], jnp.int32(pos),
                               self._patch(patch, rows, pos, shapes))  # fmt: skip
            logits.append(np.asarray(lg))
            acts.append({k: np.asarray(v) for k, v in ac.items()})
        stacked = {k: np.stack([a[k] for a in acts], axis=1) for k in acts[0]}
        return np.stack(logits, axis=1), stacked
