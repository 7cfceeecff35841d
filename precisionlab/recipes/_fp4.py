"""The published 4-bit (FP4) training recipes, each exact to its paper and its authors' code.

A recipe here owns the three GEMMs of a matmul (fprop ``y = x w^T``, dgrad ``dx = g w``,
wgrad ``dw = g^T x`` on ``(B, rows, K)`` operands, see :mod:`precisionlab.recipes._dot`): which
operand is quantized how, from which copy (the high-precision tensor or the forward's
quantized one), with which rotation and which rounding. :func:`precisionlab.recipes.dot_general`
hands such a recipe the canonical operands (:meth:`FP4Recipe.dot3`), so the existing recipes'
path is untouched.

Recipes (each docstring cites its source and states every choice the paper leaves open):
:class:`NvidiaFP4` (``nvidia_fp4``), :class:`TsengFP4` (``tseng_fp4``), :class:`Quartet`
(``quartet``), :class:`QuartetII` (``quartet2``), :class:`FourOverSix` (``four_over_six``),
:class:`TetraJet` (``tetrajet``), :class:`TetraJetV2` (``tetrajet_v2``),
:class:`FP4AllTheWay` (``fp4_all_the_way``); :func:`osci_reset`, TetraJet-v2's OsciReset,
is an optax transformation (it moves master weights, which no matmul can).

Common choices, stated once: only what a recipe quantizes is quantized (the attention products
and the LM head are the caller's to include or exclude); randomness (stochastic rounding,
random rotations) comes from the matmul's key, split per GEMM and operand, fresh every step;
the accumulation is float32 (``accumulate_bits`` emulates a narrower one; hardware presets are
refused: no device computes these recipes' rotated operands); a contraction or a row count
that is not a multiple of the blocks is an error unless ``pad`` (zeros fill the last block).
Rotation sizes that do not divide a contraction shrink to the largest power of two that does
(at least the block), stated per recipe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, ClassVar, Generic, NamedTuple, ParamSpec, Protocol, TypeAlias, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import Array, lax

from precisionlab.intercept import Site
from precisionlab.quant import fp4 as _fp4q
from precisionlab.quant.fp4 import FP4Block
from precisionlab.recipes import _scaling as S
from precisionlab.recipes._accumulate import batched_gemm
from precisionlab.recipes._recipes import Recipe

__all__ = [
    "FP4_RECIPES",
    "FP4AllTheWay",
    "FP4Recipe",
    "FP4Step",
    "FourOverSix",
    "NvidiaFP4",
    "Quartet",
    "QuartetII",
    "TetraJet",
    "TetraJetV2",
    "TsengFP4",
    "fp4_step_tap",
    "osci_reset",
    "replay_fp4_step",
]

FORMATS = ("nvfp4", "mxfp4")
_NV, _MX = 16, 32
_SR_HEADROOM = 6.0 * 16.0 / 17.0  # Quartet II's "unbiased" NVFP4 target: SR never clips


def _t(x: Array) -> Array:
    return jnp.swapaxes(x, -1, -2)


def _pow2_divisor(n: int, cap: int, floor: int) -> int:
    """The largest power of two <= cap dividing n (ValueError below ``floor``)."""
    p = cap
    while p > floor and n % p:
        p //= 2
    if n % p:
        raise ValueError(f"size {n} is not a multiple of {floor}")
    return p


# --- steps: the recipes' quantizers, rotations and GEMMs, reported to a tap -------------------
class FP4Step(NamedTuple):
    """One step of an FP4 recipe's GEMMs as a step tap (:func:`fp4_step_tap`) receives it while
    the GEMMs are traced: ``op`` (a quantizer or rotation of ``precisionlab.quant.fp4`` by
    name, ``"mxfp8"``, ``"bf16"`` or ``"gemm"``), ``static`` (its other arguments: JSON
    values), ``inputs`` and ``outputs`` (name -> array; a PRNG key as given). Replayed by
    :func:`replay_fp4_step`."""

    op: str
    static: dict[str, Any]
    inputs: dict[str, Any]
    outputs: dict[str, Any]


class _Taps(threading.local):
    stack: list[Callable[[FP4Step], None]]

    def __init__(self) -> None:
        self.stack = []


_TAPS_LOCAL = _Taps()  # per thread: another thread's trace reports nothing to this one's tap
_P = ParamSpec("_P")
_R = TypeVar("_R")
#: What an FP4 recipe saves from its forward for its backward (a tuple per recipe).
_Res = TypeVar("_Res")
#: An operand as an FP4 recipe's GEMM takes it: an FP4 block, or float32 values (BF16, MXFP8).
_Quantized: TypeAlias = FP4Block | Array
#: The kinds of a GEMM's (lhs, rhs) (see :mod:`precisionlab.recipes._dot`).
Kinds: TypeAlias = tuple[str, str]


@contextlib.contextmanager
def fp4_step_tap(tap: Callable[[FP4Step], None]) -> Iterator[None]:
    """While active, every step of an FP4 recipe's :meth:`~FP4Recipe.forward` and
    :meth:`~FP4Recipe.backward` traced in this thread is handed to ``tap`` in program order
    (trace time: the arrays are the trace's; the recorder of :mod:`precisionlab.verify` passes
    them out of its program). Recording also pins each GEMM's operands (an optimization
    barrier) and computes both branches of a ``cond`` (selecting one), so every step traced is
    one that ran."""
    _TAPS_LOCAL.stack.append(tap)
    try:
        yield
    finally:
        _TAPS_LOCAL.stack.pop()


def _tapping() -> bool:
    return bool(_TAPS_LOCAL.stack)


def _report(
    op: str, static: dict[str, Any], inputs: dict[str, Any], outputs: dict[str, Any]
) -> None:
    if _TAPS_LOCAL.stack:
        _TAPS_LOCAL.stack[-1](FP4Step(op, static, inputs, outputs))


def _outputs(out: Any) -> dict[str, Any]:
    if isinstance(out, FP4Block):
        return {k: v for k, v in out._asdict().items() if v is not None}
    return {"out": out}


def _tapped(name: str, f: Callable[_P, _R]) -> Callable[_P, _R]:
    """``f`` (the function ``name`` of :mod:`precisionlab.quant.fp4`) reporting each call as a
    step while a step tap is active."""

    def call(*args: _P.args, **kw: _P.kwargs) -> _R:
        out = f(*args, **kw)
        if _tapping():
            bound = inspect.signature(f).bind(*args, **kw)
            bound.apply_defaults()  # every choice stated, defaults included
            arrays = {k: v for k, v in bound.arguments.items()
                      if isinstance(v, (Array, np.ndarray))}  # fmt: skip
            static = {k: (v.item() if isinstance(v, np.generic) else v)
                      for k, v in bound.arguments.items() if k not in arrays}  # fmt: skip
            _report(name, static, arrays, _outputs(out))
        return out

    return call


class _TappedQuant:
    """The quantizers and rotations of :mod:`precisionlab.quant.fp4` the recipes call, each
    reported as a step (:func:`_tapped`)."""

    def __init__(self) -> None:
        self.nvfp4 = _tapped("nvfp4", _fp4q.nvfp4)
        self.mxfp4 = _tapped("mxfp4", _fp4q.mxfp4)
        self.quest = _tapped("quest", _fp4q.quest)
        self.ms_eden = _tapped("ms_eden", _fp4q.ms_eden)
        self.qema_nearest = _tapped("qema_nearest", _fp4q.qema_nearest)
        self.rotate = _tapped("rotate", _fp4q.rotate)
        self.random_signs = _tapped("random_signs", _fp4q.random_signs)


fp4 = _TappedQuant()
#: the functions of :mod:`precisionlab.quant.fp4` reported as steps (the attributes of ``fp4``)
_QUANT_STEPS: tuple[str, ...] = tuple(vars(fp4))


def _cond(
    pred: Array, true_fn: Callable[..., _R], false_fn: Callable[..., _R], *operands: Any
) -> _R:
    """``lax.cond``; while a step tap is active both branches run and one is selected (a
    step traced inside a branch could not leave it)."""
    if not _tapping():
        return lax.cond(pred, true_fn, false_fn, *operands)
    t, f = true_fn(*operands), false_fn(*operands)
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), t, f)


def _bf16(t: Array) -> Array:
    """``t`` rounded to bfloat16 (held in float32): a step."""
    out = t.astype(jnp.bfloat16).astype(jnp.float32)
    _report("bf16", {}, {"x": t}, {"out": out})
    return out


def _mm_values(recipe: Recipe, va: Array, fa: Array | None, vb: Array, fb: Array | None) -> Array:
    """``va vb^T`` (float32 accumulation or the sequential study model) times the factors."""
    acc = batched_gemm(va, vb, recipe.accumulate_bits, recipe.accumulate_rounding,
                       recipe.promote_every)  # fmt: skip
    for f in (fa, fb):
        if f is not None:
            acc = acc * f
    return acc


def replay_fp4_step(recipe: Recipe, op: str, inputs: dict[str, Any],
                    static: dict[str, Any]) -> dict[str, Array]:  # fmt: skip
    """The outputs of step ``op`` (an :class:`FP4Step`'s) recomputed from ``inputs`` and
    ``static`` with the same codecs (``"gemm"`` by ``recipe``'s accumulation). ValueError
    for an unknown op."""
    if op in _QUANT_STEPS:
        return _outputs(getattr(_fp4q, op)(**inputs, **static))
    if op == "mxfp8":
        return {"out": _mxfp8(inputs["t"])}
    if op == "bf16":
        return {"out": inputs["x"].astype(jnp.bfloat16).astype(jnp.float32)}
    if op == "gemm":
        g = inputs.get
        out = _mm_values(recipe, inputs["lhs"], g("lhs_factor"), inputs["rhs"], g("rhs_factor"))
        return {"out": out}
    allowed = ", ".join((*_QUANT_STEPS, "mxfp8", "bf16", "gemm"))
    raise ValueError(f"unknown FP4 recipe step {op!r}; known: {allowed}")


class _Operand(NamedTuple):
    """What a GEMM multiplies: ``values`` (float32) and a scalar factor applied to its output
    (NVFP4's per-tensor decode scale), or None."""

    values: Array
    factor: Array | None


def _as_operand(q: _Quantized) -> _Operand:
    if not isinstance(q, FP4Block):
        return _Operand(q.astype(jnp.float32), None)
    v = q.elems * q.scale
    if q.tensor_inv is None:
        return _Operand(v, None)
    if q.tensor_inv.size == 1:
        return _Operand(v, q.tensor_inv.reshape(()))
    return _Operand(v * q.tensor_inv, None)


class _Quantizer(Protocol):
    """A recipe's quantizer of a (B, R, K) operand along K, with the rounding as keyword."""

    def __call__(self, t: Array, *, rounding: str = ..., key: Array | None = ...) -> _Quantized: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class FP4Recipe(Recipe, Generic[_Res]):
    """Base of the FP4 recipes: the element format (``fmt``: ``"nvfp4"`` or ``"mxfp4"``,
    where the recipe defines both), ``pad``, the accumulator fields of :class:`Recipe`, and the
    custom-VJP plumbing (:meth:`dot3`). Subclasses write :meth:`forward` and :meth:`backward`
    (``_Res``: the type of what the forward saves for the backward). Every FP4 recipe's GEMMs
    need a PRNG key (stochastic rounding or random rotations).
    """

    name: ClassVar[str] = "fp4"
    formats: ClassVar[tuple[str, ...]] = FORMATS
    fmt: str = "nvfp4"
    pad: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fmt not in self.formats:
            raise ValueError(
                f"{self.name}: unknown fmt {self.fmt!r}; allowed: {', '.join(self.formats)}"
            )
        if self.accumulate not in (None, "sequential"):
            raise ValueError(
                f"{self.name}: accumulate={self.accumulate!r}: no hardware model computes this "
                "recipe's GEMMs (rotated or re-quantized operands); use accumulate_bits (the "
                "sequential study model) or None"
            )

    # --- what the rest of the library reads -------------------------------------------------
    @property
    def block(self) -> int:
        """Elements per scale block along the contraction (16 for NVFP4, 32 for MXFP4)."""
        return _NV if self.fmt == "nvfp4" else _MX

    def block_sizes(self, kind: str) -> tuple[int, ...]:
        return (self.block,)

    def two_d(self, kind: str) -> bool:
        return False

    def quantize(
        self, t: Array, kind: str, *, scale: Array | None = None, key: Array | None = None
    ) -> S.QOperand:
        """The forward quantization of an operand of ``kind`` (``x`` the fprop lhs, ``w`` its
        rhs, ``g`` the dgrad gradient), as the GEMM multiplies it (rotated where the recipe
        rotates): for telemetry and the recipe metrics."""
        q = self.fprop_operand(t.astype(jnp.float32), kind, key)
        if not isinstance(q, FP4Block):
            return S.QOperand(q, None, None)
        tinv = None if q.tensor_inv is None else jnp.broadcast_to(q.tensor_inv, q.elems.shape)
        return S.QOperand(q.elems, None if tinv is None else tinv[..., :1], q.scale)

    def fprop_operand(self, t: Array, kind: str, key: Array | None) -> _Quantized:
        """One operand as the recipe's forward (or, for ``g``, its dgrad) quantizes it."""
        raise NotImplementedError

    # --- helpers ---------------------------------------------------------------------------
    def _q(
        self,
        t: Array,
        *,
        rounding: str = "nearest_even",
        key: Array | None = None,
        two_d: bool = False,
        **kw: Any,
    ) -> FP4Block:
        """``t`` quantized in the recipe's format along its last axis (NVFP4 or MXFP4)."""
        if rounding == "stochastic" and key is None:
            raise ValueError(f"{self.name}: stochastic rounding needs a PRNG key")
        if self.fmt == "nvfp4":
            return fp4.nvfp4(t, two_d=two_d, rounding=rounding, key=key, **kw)
        return fp4.mxfp4(t, two_d=two_d, rounding=rounding, key=key, **kw)

    def _mm(self, a: _Quantized, b: _Quantized) -> Array:
        """``a b^T`` of two quantized (or plain) (B, R, K) operands, float32 accumulation
        (or the sequential study model), per-tensor factors applied to the output."""
        oa, ob = _as_operand(a), _as_operand(b)
        if not _tapping():
            return _mm_values(self, oa.values, oa.factor, ob.values, ob.factor)
        oa, ob = lax.optimization_barrier((oa, ob))  # the GEMM as in a program of its own
        acc = _mm_values(self, oa.values, oa.factor, ob.values, ob.factor)
        ins = {"lhs": oa.values, "lhs_factor": oa.factor, "rhs": ob.values,
               "rhs_factor": ob.factor}  # fmt: skip
        _report("gemm", {}, {k: v for k, v in ins.items() if v is not None}, {"out": acc})
        return acc

    def _stochastic_backward(
        self, quantize: _Quantizer, a: Array, b: Array, g: Array, key: Array | None
    ) -> tuple[Array, Array]:
        """dgrad ``g b`` and wgrad ``g^T a`` with all four operands quantized by
        ``quantize`` with stochastic rounding, each with its own key split from ``key``."""
        k1, k2, k3, k4 = self._keys(key, 4)
        sr = partial(quantize, rounding="stochastic")
        da = self._mm(sr(g, key=k1), sr(_t(b), key=k2))
        db = self._mm(sr(_t(g), key=k3), sr(_t(a), key=k4))
        return da, db

    def _key(self, key: Array | None) -> Array:
        """``key``; ValueError where there is none."""
        if key is None:
            raise ValueError(
                f"{self.name} rounds stochastically or rotates randomly and needs a PRNG "
                "key: pass key=... (the train step passes one)"
            )
        return key

    def _keys(self, key: Array | None, n: int) -> list[Array]:
        return list(jax.random.split(self._key(key), n))

    # --- the recipe --------------------------------------------------------------------------
    def forward(
        self, kinds: Kinds, a: Array, b: Array, state: dict | None, key: Array | None
    ) -> tuple[Array, _Res, Array | None]:
        """(fprop output (B, M, N), residuals for :meth:`backward`, observation or None)."""
        raise NotImplementedError

    def backward(self, kinds: Kinds, res: _Res, g: Array, key: Array | None) -> tuple[Array, Array]:
        """(da (B, M, K), db (B, N, K)) from the residuals and the output gradient."""
        raise NotImplementedError

    # --- state (recipes with per-matmul state override these) -------------------------------
    def site_state(self, site: Site, weight: str) -> dict[str, Array]:
        """Fresh state of one matmul (``{}``: none)."""
        return {}

    def update_site(self, state: dict, observed: Array | None) -> dict:
        """The state after a step that observed ``observed`` (the probe's cotangent)."""
        return state

    def dot3(
        self,
        kinds: Kinds,
        a3: Array,
        b3: Array,
        state: dict | None,
        key: Array | None,
        canon: Callable[[Array], Array] | None = None,
        run: Callable[..., Array] | None = None,
    ) -> Array:
        """The matmul on canonical operands: ``a3`` (B, M, K), ``b3`` (B, N, K), output
        (B, M, N) float32; ``state`` this matmul's state (weight-shaped leaves, put in the
        canonical layout by ``canon``) or None. ``run(recipe, kinds, a, b, state, key)``
        replaces the compiled custom-VJP matmul on the padded operands (a recorder's)."""
        if kinds == ("w", "x"):  # the weight is the lhs (w @ x): compute the transpose
            return _t(self.dot3(("x", "w"), b3, a3, state, key, canon, run))
        st = None
        if state and canon is not None:
            st = {k: (canon(v) if v.ndim else v) for k, v in state.items()}
        m, n, k = a3.shape[1], b3.shape[1], a3.shape[2]
        mult = self.block if self.pad else 1
        if not self.pad:
            for label, size in (("contraction", k), ("row", m), ("column", n)):
                if size % self.block:
                    raise ValueError(
                        f"{self.name}: the matmul's {label} size {size} is not a multiple of "
                        f"the block size {self.block} (every GEMM of the recipe contracts over "
                        "one of them); pass pad=True (zeros fill the last block) or use other "
                        "sizes"
                    )
        if mult > 1:
            a3, b3 = _pad3(a3, mult, (1, 2)), _pad3(b3, mult, (1, 2))
            if st is not None:
                st = {k_: (_pad3(v, mult, (1, 2)) if v.ndim == 3 else v) for k_, v in st.items()}
        out = (run or _dot3_jit)(self, kinds, a3.astype(jnp.float32), b3.astype(jnp.float32), st,
                                 key)  # fmt: skip
        return out[:, :m, :n]


def _rceil(fmt: str) -> dict[str, Any]:
    """Quantizer options scaling MXFP4 blocks by ``rceil`` (TE's MX rule, never saturating;
    NVFP4 has its own E4M3 scales)."""
    return {} if fmt == "nvfp4" else {"rule": "rceil"}


def _observed(recipe: FP4Recipe[Any], observed: Array | None) -> Array:
    """A stateful site's observation (the probe's cotangent); ValueError where it is missing."""
    if observed is None:
        raise ValueError(
            f"{recipe.name}: no observation for a matmul with state (pass update_state the "
            "observations value_and_grad returned)"
        )
    return observed


def _trust_mask(q: FP4Block) -> Array:
    """The trust mask of a QuEST-quantized operand (:func:`precisionlab.quant.fp4.quest`)."""
    if q.mask is None:
        raise ValueError("quest gave no trust mask")
    return q.mask


def _pad3(x: Array, mult: int, axes: tuple[int, ...]) -> Array:
    widths = [(0, 0)] * x.ndim
    for ax in axes:
        widths[ax] = (0, -x.shape[ax] % mult)
    return jnp.pad(x, widths) if any(w[1] for w in widths) else x


#: What the custom VJP saves: the recipe's residuals, the state, the observation, the key.
_Saved: TypeAlias = tuple[Any, dict | None, Array | None, Array | None]


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dot3(
    recipe: FP4Recipe[Any], kinds: Kinds, a: Array, b: Array, state: dict | None, key: Array | None
) -> Array:
    return recipe.forward(kinds, a, b, state, key)[0]


def _dot3_fwd(
    recipe: FP4Recipe[Any], kinds: Kinds, a: Array, b: Array, state: dict | None, key: Array | None
) -> tuple[Array, _Saved]:
    y, res, observed = recipe.forward(kinds, a, b, state, key)
    return y, (res, state, observed, key)


def _dot3_bwd(
    recipe: FP4Recipe[Any], kinds: Kinds, saved: _Saved, g: Array
) -> tuple[Array, Array, dict | None, None]:
    res, state, observed, key = saved
    da, db = recipe.backward(kinds, res, g.astype(jnp.float32), key)
    ct_state = None
    if state is not None:
        ct_state = {k: jnp.zeros_like(v) for k, v in state.items()}
        if observed is not None:
            ct_state["probe"] = observed.astype(state["probe"].dtype)
    return da, db, ct_state, None


_dot3.defvjp(_dot3_fwd, _dot3_bwd)
_dot3_jit = jax.jit(_dot3, static_argnums=(0, 1))


# --- NVIDIA ------------------------------------------------------------------------------------
class _NvidiaGemms(FP4Recipe[tuple[Array, Array, FP4Block]]):
    """NVIDIA's three GEMMs (:class:`NvidiaFP4`, and :class:`FourOverSix` with its own
    quantizer :meth:`_qf`). Not a dataclass: each recipe declares its fields."""

    hadamard_seed: int  # a field of each recipe

    def two_d(self, kind: str) -> bool:
        return kind == "w"

    def _qf(
        self,
        t: Array,
        two_d: bool = False,
        rounding: str = "nearest_even",
        key: Array | None = None,
    ) -> FP4Block:
        """``t`` quantized along its last axis in the recipe's format, with its options."""
        return self._q(t, two_d=two_d, rounding=rounding, key=key, **self._q_options())

    def _q_options(self) -> dict[str, Any]:
        """The recipe's options of the quantizer (:meth:`FP4Recipe._q`)."""
        raise NotImplementedError

    def fprop_operand(self, t: Array, kind: str, key: Array | None) -> _Quantized:
        if kind == "g":
            return self._qf(t, rounding="stochastic", key=key)
        return self._qf(t, two_d=kind == "w")

    def _signs(self) -> Array:
        h = S.hadamard_matrix(self.hadamard_seed, 16)  # diag(signs) H / 4
        return jnp.asarray(np.sign(h[:, 0]), jnp.float32)

    def forward(
        self, kinds: Kinds, a: Array, b: Array, state: dict | None, key: Array | None
    ) -> tuple[Array, tuple[Array, Array, FP4Block], None]:
        qa = self._qf(a)
        qb = self._qf(b, two_d=kinds[1] == "w")
        return self._mm(qa, qb), (a, b, qb), None

    def backward(
        self, kinds: Kinds, res: tuple[Array, Array, FP4Block], g: Array, key: Array | None
    ) -> tuple[Array, Array]:
        a, b, qb = res
        k1, k2 = self._keys(key, 2)
        gq = self._qf(g, rounding="stochastic", key=k1)
        if kinds[1] == "w":  # 2-D tiles: the transposed weight is the same quantized tensor
            bt = FP4Block(_t(qb.elems), _t(qb.scale), qb.tensor_inv)
        else:
            bt = self._qf(_t(b))
        da = self._mm(gq, bt)
        signs = self._signs()
        gt = self._qf(fp4.rotate(_t(g), signs), rounding="stochastic", key=k2)
        at = self._qf(fp4.rotate(_t(a), signs))
        return da, self._mm(gt, at)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NvidiaFP4(_NvidiaGemms):
    """NVIDIA's NVFP4 pretraining recipe (NVIDIA, "Pretraining Large Language Models with
    NVFP4", arXiv 2509.25149, sec. 4; TE's ``NVFP4BlockScaling``).

    - fprop: activations 1 x 16 blocks, weights 16 x 16 tiles (sec. 4.3, 2-D scaling, so the
      dgrad's transposed weight is the same quantized tensor), round to nearest;
    - dgrad: the output gradient 1 x 16, stochastic rounding (sec. 4.4); the weight as in
      fprop;
    - wgrad: both operands rotated by a 16 x 16 random Hadamard transform along the token
      axis (sec. 4.2: Wgrad inputs only, a single fixed random sign vector, from
      ``hadamard_seed``), the gradient rounded stochastically, the activation to nearest;
    - "a few layers in BF16" (sec. 4.1: about 16% of the linear layers, the last blocks) is a
      choice of matmuls, not of the quantizer: exclude them when applying the recipe (the
      tournament keeps the last block's MLP down projection in BF16, 1 of 8 linear layers).

    ``fmt="mxfp4"`` (the paper's sec. 5 comparison): the same structure with MXFP4 (32-element
    blocks, 32 x 32 weight tiles, E8M0 scales). Choice (the paper leaves the MXFP4 scale rule
    open): ``rceil`` (TE's MX rule, scales rounded up so that nothing saturates and stochastic
    rounding stays unbiased).
    """

    name: ClassVar[str] = "nvidia_fp4"
    hadamard_seed: int = 0

    def _q_options(self) -> dict[str, Any]:
        return _rceil(self.fmt)


# --- Tseng, Yu and Park -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class TsengFP4(FP4Recipe[tuple[Array, Array]]):
    """Tseng, Yu and Park, "Training LLMs with MXFP4" (arXiv 2502.20586, sec. 3-4; the
    authors' patches of microxcaling and Megatron-LM).

    - fprop: not quantized: BF16 operands (the Megatron-LM patch: BF16 forward, MXFP4 backward);
    - dgrad and wgrad: both operands rotated along the contraction by a random Hadamard
      transform of ``hadamard_size`` (the authors' default 64; fresh random signs per GEMM,
      the same for both operands), then MXFP4 with the OCP floor scale and the 3/4 pre-scale
      and stochastic rounding (``dither_scale``) on every operand.

    ``fmt="nvfp4"`` (not in the paper): the same backward with NVFP4 1 x 16 blocks, stochastic
    rounding, and Quartet II's target 6 * 16/17 in place of the 3/4 (the NVFP4 way to keep SR
    from clipping). A contraction the transform size does not divide gets the largest power of
    two that does (at least the block).
    """

    name: ClassVar[str] = "tseng_fp4"
    fmt: str = "mxfp4"
    hadamard_size: int = 64

    def _sr(self, t: Array, key: Array | None) -> FP4Block:
        if self.fmt == "nvfp4":
            return self._q(t, rounding="stochastic", key=key, val_max=_SR_HEADROOM)
        return self._q(t, rounding="stochastic", key=key, prescale=True)

    def fprop_operand(self, t: Array, kind: str, key: Array | None) -> _Quantized:
        if kind == "g":
            return self._sr(t, key)
        return _bf16(t)

    def forward(
        self, kinds: Kinds, a: Array, b: Array, state: dict | None, key: Array | None
    ) -> tuple[Array, tuple[Array, Array], None]:
        a16, b16 = _bf16(a), _bf16(b)
        return self._mm(a16, b16), (a16, b16), None

    def _rotated_pair(self, u: Array, v: Array, key: Array) -> tuple[FP4Block, FP4Block]:
        n = _pow2_divisor(u.shape[-1], self.hadamard_size, self.block)
        ks, ku, kv = jax.random.split(key, 3)
        signs = fp4.random_signs(ks, n)
        return self._sr(fp4.rotate(u, signs), ku), self._sr(fp4.rotate(v, signs), kv)

    def backward(
        self, kinds: Kinds, res: tuple[Array, Array], g: Array, key: Array | None
    ) -> tuple[Array, Array]:
        a, b = res
        k1, k2 = self._keys(key, 2)
        da = self._mm(*self._rotated_pair(g, _t(b), k1))
        db = self._mm(*self._rotated_pair(_t(g), _t(a), k2))
        return da, db


# --- Quartet -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Quartet(FP4Recipe[tuple[Array, Array, Array, Array]]):
    """Quartet (Castro et al., "Quartet: Native FP4 Training Can Be Optimal for Large Language
    Models", arXiv 2505.14669, sec. 4; the authors' ``QuestMXFP4Quantizer`` and backward
    scheme ``Q(E)Q(Wt)t_Q(Et)Q(Xt)t``). MXFP4 only.

    - fprop: activations and weights rotated along K by the (fixed) Hadamard transform of
      size 32, then QuEST (:func:`precisionlab.quant.fp4.quest`: power-of-two scale from the
      block's standard deviation, round to nearest, trust mask);
    - dgrad and wgrad: on the forward's quantized (rotated) operands: the output gradient and
      the weight (dgrad), the output gradient and the activation (wgrad), each rotated along
      the GEMM's contraction by the Hadamard transform of size 32 times random signs drawn
      once per backward (the reference re-randomizes ``H diag(s)``: signs applied after the
      transform, stated as found: it leaves the rounding error's distribution that of the
      fixed H), then MXFP4 with the 3/4 pre-scale and stochastic rounding (Tseng et al.'s
      quantizer, ``AlbertTsengQuantizer``);
    - the gradients of x and w: the rotated-domain gradients times the QuEST trust masks,
      rotated back by H^T.
    """

    name: ClassVar[str] = "quartet"
    formats: ClassVar[tuple[str, ...]] = ("mxfp4",)
    fmt: str = "mxfp4"
    hadamard_size: int = 32

    def _h(self, n: int) -> Array:
        return jnp.ones((_pow2_divisor(n, self.hadamard_size, _MX),), jnp.float32)

    def fprop_operand(self, t: Array, kind: str, key: Array | None) -> _Quantized:
        if kind == "g":
            return self._sr(t, key)
        return fp4.quest(fp4.rotate(t, self._h(t.shape[-1])))

    def _sr(self, t: Array, key: Array | None) -> FP4Block:
        return self._q(t, rounding="stochastic", key=key, prescale=True)

    def forward(
        self, kinds: Kinds, a: Array, b: Array, state: dict | None, key: Array | None
    ) -> tuple[Array, tuple[Array, Array, Array, Array], None]:
        ones = self._h(a.shape[-1])
        qa, qb = fp4.quest(fp4.rotate(a, ones)), fp4.quest(fp4.rotate(b, ones))
        va, vb = qa.values(), qb.values()
        return self._mm(va, vb), (va, vb, _trust_mask(qa), _trust_mask(qb)), None

    def _post_signed(self, t: Array, signs: Array) -> Array:
        """t rotated by ``H diag(signs)`` (the reference's order: signs after H)."""
        return fp4.rotate(t, jnp.ones_like(signs)) * jnp.tile(signs, t.shape[-1] // signs.size)

    def backward(
        self, kinds: Kinds, res: tuple[Array, Array, Array, Array], g: Array, key: Array | None
    ) -> tuple[Array, Array]:
        va, vb, ma, mb = res
        ks, k1, k2, k3, k4 = self._keys(key, 5)
        n = _pow2_divisor(g.shape[-1], self.hadamard_size, _MX)
        m = _pow2_divisor(g.shape[-2], self.hadamard_size, _MX)
        s_n = fp4.random_signs(jax.random.fold_in(ks, 0), n)
        s_m = fp4.random_signs(jax.random.fold_in(ks, 1), m) if m != n else s_n
        dva = self._mm(
            self._sr(self._post_signed(g, s_n), k1), self._sr(self._post_signed(_t(vb), s_n), k2)
        )
        dvb = self._mm(
            self._sr(self._post_signed(_t(g), s_m), k3),
            self._sr(self._post_signed(_t(va), s_m), k4),
        )
        ones = self._h(va.shape[-1])
        da = fp4.rotate(jnp.where(ma, dva, 0.0), ones, inverse=True)
        db = fp4.rotate(jnp.where(mb, dvb, 0.0), ones, inverse=True)
        return da, db


# --- Quartet II --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class QuartetII(FP4Recipe[tuple[Array, Array]]):
    """Quartet II (Panferov et al., arXiv 2601.22813; the authors' ``Quartet_II_fn`` with the
    setup of their sweep: rotation 128, no delayed amax, Four Over Six off). NVFP4 only.

    - fprop: activations and weights 1 x 16 NVFP4, round to nearest (``four_over_six``: the
      4-or-6 choice, an option of the paper, off in its main setup);
    - dgrad and wgrad: the output gradient and the forward's quantized weight (dgrad), the
      output gradient and the forward's quantized activation (wgrad), each rotated along the
      GEMM's contraction by a random Hadamard transform of ``hadamard_size`` (128; fresh signs
      once per backward, shared by both GEMMs), then MS-EDEN
      (:func:`precisionlab.quant.fp4.ms_eden`: RTN elements, the EDEN correction per rotation
      group folded into the E4M3 micro-scales, stochastically rounded), with the reference's
      backward target ``6 / (17/16 * 0.93)`` and E4M3 range 256.

    Choice: a contraction that 128 does not divide (64, 192 in the tournament's model) gets the
    largest power of two that does, at least 16; the MS-EDEN correction group is the rotation.
    """

    name: ClassVar[str] = "quartet2"
    formats: ClassVar[tuple[str, ...]] = ("nvfp4",)
    hadamard_size: int = 128
    four_over_six: bool = False

    def _fwd(self, t: Array) -> FP4Block:
        if self.four_over_six:
            return fp4.nvfp4(t, scale_max=256.0, four_over_six="mse")
        return fp4.nvfp4(t)

    def fprop_operand(self, t: Array, kind: str, key: Array | None) -> _Quantized:
        if kind == "g":
            n = _pow2_divisor(t.shape[-1], self.hadamard_size, _NV)
            return fp4.ms_eden(t, self._key(key), group=n)
        return self._fwd(t)

    def forward(
        self, kinds: Kinds, a: Array, b: Array, state: dict | None, key: Array | None
    ) -> tuple[Array, tuple[Array, Array], None]:
        va, vb = self._fwd(a).values(), self._fwd(b).values()
        return self._mm(va, vb), (va, vb), None

    def _eden_pair(self, u: Array, v: Array, signs: Array, key: Array) -> tuple[FP4Block, FP4Block]:
        k1, k2 = jax.random.split(key)
        n = signs.size
        return (
            fp4.ms_eden(fp4.rotate(u, signs), k1, group=n),
            fp4.ms_eden(fp4.rotate(v, signs), k2, group=n),
        )

    def backward(
        self, kinds: Kinds, res: tuple[Array, Array], g: Array, key: Array | None
    ) -> tuple[Array, Array]:
        va, vb = res
        ks, k1, k2 = self._keys(key, 3)
        base = fp4.random_signs(ks, self.hadamard_size)
        n = _pow2_divisor(g.shape[-1], self.hadamard_size, _NV)
        m = _pow2_divisor(g.shape[-2], self.hadamard_size, _NV)
        da = self._mm(*self._eden_pair(g, _t(vb), base[:n], k1))
        db = self._mm(*self._eden_pair(_t(g), _t(va), base[:m], k2))
        return da, db


# --- Four Over Six -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class FourOverSix(_NvidiaGemms):
    """Four Over Six (Cook et al., "Four Over Six: More Accurate NVFP4 Quantization with
    Adaptive Block Scaling", arXiv 2512.02010; the authors' ``fouroversix`` training config:
    ``scale_rule="mse"`` on every operand, ``weight_scale_2d``, stochastic gradients, the
    random Hadamard transform on the wgrad operands). NVFP4 only (the 1.5x between scaling to
    4 and to 6 needs E4M3 scales).

    NVIDIA's structure (:class:`NvidiaFP4`) with every quantization choosing, per block (16 x
    16 tile for weights), the scale mapping its amax to 6 or to 4 by the smaller squared error
    (``rule``), with the tensor's amax mapped to 256 (not 448) in E4M3 so that x1.5 fits.
    Choice: the 16 x 16 transform with NVIDIA's fixed signs (the authors' ``get_rht_matrix``).
    """

    name: ClassVar[str] = "four_over_six"
    formats: ClassVar[tuple[str, ...]] = ("nvfp4",)
    rule: str = "mse"
    hadamard_seed: int = 0

    def _check_fields(self) -> None:
        if self.rule not in ("mse", "mae", "abs_max"):
            raise ValueError(f"four_over_six: unknown rule {self.rule!r}; allowed: mse, mae, "
                             "abs_max")  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_fields()

    def _q_options(self) -> dict[str, Any]:
        return {"scale_max": 256.0, "four_over_six": self.rule}


# --- TetraJet ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class TetraJet(FP4Recipe[tuple[Array, Array]]):
    """TetraJet (Chen et al., "Oscillation-Reduced MXFP4 Training for Vision Transformers",
    arXiv 2502.20853, sec. 4-5; the authors' ``QuantLinear`` with ``--mxscale 1``), with Q-EMA.

    - fprop: activations and weights 1 x 32 MXFP4, round to nearest, scales
      ``2**ceil(log2(amax / 6))`` (``rceil``, the authors' "TetraJet" scale, never saturating);
      the weight rounded by Q-EMA (sec. 5.1: each element to the E2M1 neighbour nearer its
      exponential moving average; decay ``ema_decay``, 0.9972 in the authors' DeiT-S script;
      used once the average has ``ema_warmup`` (10) updates, as their ``ema_step >= 10``);
    - dgrad: the output gradient 1 x 32 along N, stochastic; the weight: the forward's
      quantized weight dequantized, transposed and re-quantized along N, stochastic;
    - wgrad: the output gradient along M, stochastic; the activation: the forward's quantized
      activation, transposed and re-quantized along M, stochastic.

    State per matmul: the EMA of the weight as the matmul sees it (compute dtype: a choice;
    the authors average the float32 master weight) and its update count, updated in every
    step's forward exactly as their post-step update (the average in step t includes the
    weight of step t). Without state (``state=None``) Q-EMA is off (plain RTN).
    ``fmt="nvfp4"``: the same with NVFP4 1 x 16 blocks (per-tensor global scales).
    Not implemented: Q-Ramping (the paper's optimizer change); the issue asks for Q-EMA.
    """

    name: ClassVar[str] = "tetrajet"
    fmt: str = "mxfp4"
    ema_decay: float = 0.9972
    ema_warmup: int = 10
    qema: bool = True

    @property
    def stateful(self) -> bool:  # type: ignore[override]  # per instance (qema), a class constant in Recipe
        return self.qema

    def _qf(self, t: Array, rounding: str = "nearest_even", key: Array | None = None) -> FP4Block:
        return self._q(t, rounding=rounding, key=key, **_rceil(self.fmt))

    def fprop_operand(self, t: Array, kind: str, key: Array | None) -> _Quantized:
        if kind == "g":
            return self._qf(t, rounding="stochastic", key=key)
        return self._qf(t)

    def site_state(self, site: Site, weight: str) -> dict[str, Array]:
        shapes = site.in_shapes
        w = 0 if weight == "lhs" else 1
        if not self.qema or weight == "none":
            return {}
        z = jnp.zeros(shapes[w], jnp.float32)
        return {"ema": z, "count": jnp.zeros((), jnp.float32), "probe": z}

    def update_site(self, state: dict, observed: Array | None) -> dict:
        if not state:
            return state
        return {**state, "ema": _observed(self, observed), "count": state["count"] + 1.0}

    def _weight(self, b: Array, state: dict | None) -> tuple[FP4Block, Array | None]:
        """The forward's quantized weight and the EMA it used (or None)."""
        q = self._qf(b)
        if not state:
            return q, None
        d = jnp.float32(self.ema_decay)
        first = state["count"] == 0
        ema = jnp.where(first, b, d * state["ema"] + (1 - d) * b)
        # the same scales; elements rounded to the neighbour nearer the EMA
        factor = q.scale if q.tensor_inv is None else q.scale * q.tensor_inv
        y = b / factor
        qe = fp4.qema_nearest(y, ema / factor)
        use = state["count"] >= self.ema_warmup
        return FP4Block(jnp.where(use, qe, q.elems), q.scale, q.tensor_inv), ema

    def forward(
        self, kinds: Kinds, a: Array, b: Array, state: dict | None, key: Array | None
    ) -> tuple[Array, tuple[Array, Array], Array | None]:
        qa = self._qf(a)
        if kinds[1] == "w":
            qb, ema = self._weight(b, state)
        else:
            qb, ema = self._qf(b), None
        va, vb = qa.values(), qb.values()
        return self._mm(va, vb), (va, vb), ema

    def backward(
        self, kinds: Kinds, res: tuple[Array, Array], g: Array, key: Array | None
    ) -> tuple[Array, Array]:
        va, vb = res
        return self._stochastic_backward(self._qf, va, vb, g, key)


# --- TetraJet-v2 -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class TetraJetV2(FP4Recipe[tuple[Array, Array, Array, Array | None]]):
    """TetraJet-v2 (Chen et al., "TetraJet-v2: Accurate NVFP4 Training for Large Language
    Models with Oscillation Suppression and Outlier Control", arXiv 2510.27527; the authors'
    ``NVFP4_TetraJetv2_MatMulFunc_BwdAllRHT16SQ`` and ``NVFP4_mix_MXFP8`` layers and configs).
    NVFP4 only.

    - unbiased double-block quantization: NVFP4 1 x 16 blocks whose E4M3 scales are relative to
      a float32 scale per 1 x 128 outer block along K (not per tensor);
    - fprop: activations and weights, round to nearest;
    - dgrad: the output gradient and the forward's quantized weight (dequantized, transposed),
      both rotated along N by a 16 x 16 random Hadamard transform (signs drawn per call), then
      stochastic rounding; wgrad: the output gradient and the forward's quantized activation,
      rotated along M (other signs), stochastic;
    - OutControl (``outlier_ratio`` > 0): the activation's input channels are ranked by their
      L2 norm summed over ``outlier_iters`` (50) steps from step ``outlier_start`` (the
      authors' 501 of 25,500: the tournament scales it to the same 2%); then the top
      ``round(ratio * K)`` channels (ratio 0.1) run the fprop and wgrad in MXFP8 (E4M3, 1 x 32)
      and the rest in NVFP4, each group ordered by decreasing norm (the reference's argsort),
      the dgrad in NVFP4 over all channels (the reference's layout);
    - OsciReset: :func:`osci_reset`, an optax transformation (it moves master weights).

    Choices: an outer block that does not divide a contraction (64, 192 in the tournament's
    model) becomes the largest power of two that does, at least 16; the OutControl state
    counts steps per matmul and combines micro-batches by max. Without state OutControl is off.
    """

    name: ClassVar[str] = "tetrajet_v2"
    formats: ClassVar[tuple[str, ...]] = ("nvfp4",)
    outer: int = 128
    hadamard_size: int = 16
    outlier_ratio: float = 0.1
    outlier_start: int = 501
    outlier_iters: int = 50

    @property
    def stateful(self) -> bool:  # type: ignore[override]  # per instance, a class constant in Recipe
        return self.outlier_ratio > 0

    def _q2(self, t: Array, rounding: str = "nearest_even", key: Array | None = None) -> FP4Block:
        o = _pow2_divisor(t.shape[-1], self.outer, _NV)
        return fp4.nvfp4(t, outer=o, rounding=rounding, key=key)

    def fprop_operand(self, t: Array, kind: str, key: Array | None) -> _Quantized:
        if kind == "g":
            return self._q2(t, rounding="stochastic", key=key)
        return self._q2(t)

    # -- OutControl state
    def site_state(self, site: Site, weight: str) -> dict[str, Array]:
        if not self.stateful or weight == "none":
            return {}
        w = 0 if weight == "lhs" else 1
        z = jnp.zeros(site.in_shapes[w], jnp.float32)
        return {"norm": z, "count": jnp.zeros((), jnp.float32), "probe": z}

    def update_site(self, state: dict, observed: Array | None) -> dict:
        if not state:
            return state
        c = state["count"]
        start, stop = self.outlier_start, self.outlier_start + self.outlier_iters
        recording = (c >= start) & (c < stop)
        norm = jnp.where(recording, state["norm"] + _observed(self, observed), state["norm"])
        return {**state, "norm": norm, "count": c + 1.0}

    def _split(self, k: int) -> int:
        return round(self.outlier_ratio * k)

    def forward(
        self, kinds: Kinds, a: Array, b: Array, state: dict | None, key: Array | None
    ) -> tuple[Array, tuple[Array, Array, Array, Array | None], Array | None]:
        k8 = self._split(a.shape[-1])
        if not state or kinds[1] != "w" or k8 == 0:
            va, vb = self._q2(a).values(), self._q2(b).values()
            return self._mm(va, vb), (va, vb, a, None), None
        # the channel norms over the tokens, broadcast like the (canonical) weight (B, N, K)
        observed = jnp.broadcast_to(jnp.sqrt(jnp.sum(a * a, axis=(0, 1))), b.shape)
        done = state["count"] >= self.outlier_start + self.outlier_iters
        # ranked once recorded (ties: lower index first): the top k8 run in MXFP8
        order = jnp.argsort(-state["norm"][0, 0], stable=True)

        def plain(a: Array, b: Array, order: Array) -> tuple[Array, Array, Array]:
            va, vb = self._q2(a).values(), self._q2(b).values()
            return self._mm(va, vb), va, vb

        def mixed(a: Array, b: Array, order: Array) -> tuple[Array, Array, Array]:
            k = a.shape[-1]
            inv = jnp.argsort(order)
            a8, b8 = jnp.take(a, order[:k8], axis=-1), jnp.take(b, order[:k8], axis=-1)
            a4, b4 = jnp.take(a, order[k8:], axis=-1), jnp.take(b, order[k8:], axis=-1)
            va4 = self._q2(_pad3(a4, _NV, (2,))).values()
            vb4 = self._q2(_pad3(b4, _NV, (2,))).values()
            va8, vb8 = _mxfp8(_pad3(a8, 32, (2,))), _mxfp8(_pad3(b8, 32, (2,)))
            y = self._mm(va4, vb4) + self._mm(va8, vb8)
            # the dequantized operands in the original channel order, for the backward
            va = jnp.take(jnp.concatenate([va8[..., :k8], va4[..., : k - k8]], -1), inv, axis=-1)
            vb = jnp.take(jnp.concatenate([vb8[..., :k8], vb4[..., : k - k8]], -1), inv, axis=-1)
            return y, va, vb

        y, va, vb = _cond(done, mixed, plain, a, b, order)
        return y, (va, vb, a, jnp.where(done, order, -1)), observed

    def backward(
        self,
        kinds: Kinds,
        res: tuple[Array, Array, Array, Array | None],
        g: Array,
        key: Array | None,
    ) -> tuple[Array, Array]:
        va, vb, a, order = res
        k1, k2, k3, k4, k5, k6, k7 = self._keys(key, 7)
        n = _pow2_divisor(g.shape[-1], self.hadamard_size, _NV)
        m = _pow2_divisor(g.shape[-2], self.hadamard_size, _NV)
        sx, sw = fp4.random_signs(k5, n), fp4.random_signs(k6, m)
        sr = partial(self._q2, rounding="stochastic")
        da = self._mm(sr(fp4.rotate(g, sx), key=k1), sr(fp4.rotate(_t(vb), sx), key=k2))
        db = self._mm(sr(fp4.rotate(_t(g), sw), key=k3), sr(fp4.rotate(_t(va), sw), key=k4))
        k8 = self._split(a.shape[-1])
        if order is None or k8 == 0:
            return da, db

        def outliers(db: Array) -> Array:
            # the outlier channels' weight gradient in MXFP8 (g^T and x^T along the tokens)
            idx = order[:k8]
            at8 = _pad3(_t(jnp.take(a, idx, axis=-1)), 32, (2,))
            gt8 = _pad3(_t(g), 32, (2,))
            db8 = self._mm(_mxfp8(gt8), _mxfp8(at8))  # (B, N, k8)
            return db.at[..., idx].set(db8)

        del k7
        return da, _cond(order[0] >= 0, outliers, lambda d: d, db)


def _mxfp8(t: Array) -> Array:
    """MXFP8 (E4M3 elements, 1 x 32 blocks, rceil scales): dequantized float32 values."""
    q, _ = S.mx_blocks(t, S.E4M3, 32, "rceil")
    out = q.block_values()
    _report("mxfp8", {}, {"t": t}, {"out": out})
    return out


# --- FP4 All the Way ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class FP4AllTheWay(FP4Recipe[tuple[Array, Array]]):
    """Chmiel, Fishman, Banner and Soudry, "FP4 All the Way: Fully Quantized Training of LLMs"
    (arXiv 2505.19115, sec. 3-4): NVFP4 (1 x 16 blocks, E4M3 scales, found best in sec. 3) for
    every operand of the three GEMMs; round to nearest in the forward (x, w), stochastic
    rounding in the backward (dgrad: g, w) and update (wgrad: g, x) GEMMs, each operand
    quantized from its high-precision tensor along the GEMM's contraction (choice: the paper
    does not reuse the forward's copies); no rotation. The paper's final quantization-aware
    fine-tuning phase (higher precision once the gradient norm falls below sqrt(3) times the
    quantization noise) is not part of the recipe: the tournament records that ratio instead
    (:mod:`precisionlab.train.gemm_stats`).

    ``fmt="mxfp4"`` (the paper's E8M0 comparison): 32-element blocks, OCP floor scales
    (choice: the OCP rule, with which stochastic rounding can clip a block's largest elements).
    """

    name: ClassVar[str] = "fp4_all_the_way"

    def fprop_operand(self, t: Array, kind: str, key: Array | None) -> _Quantized:
        if kind == "g":
            return self._q(t, rounding="stochastic", key=key)
        return self._q(t)

    def forward(
        self, kinds: Kinds, a: Array, b: Array, state: dict | None, key: Array | None
    ) -> tuple[Array, tuple[Array, Array], None]:
        return self._mm(self._q(a), self._q(b)), (a, b), None

    def backward(
        self, kinds: Kinds, res: tuple[Array, Array], g: Array, key: Array | None
    ) -> tuple[Array, Array]:
        a, b = res
        return self._stochastic_backward(self._q, a, b, g, key)


#: name -> (class, preset fields) of the FP4 recipes, merged into :data:`RECIPE_NAMES`.
FP4_RECIPES: dict[str, tuple[type[FP4Recipe[Any]], dict[str, Any]]] = {
    "nvidia_fp4": (NvidiaFP4, {}),
    "tseng_fp4": (TsengFP4, {}),
    "quartet": (Quartet, {}),
    "quartet2": (QuartetII, {}),
    "four_over_six": (FourOverSix, {}),
    "tetrajet": (TetraJet, {}),
    "tetrajet_v2": (TetraJetV2, {}),
    "fp4_all_the_way": (FP4AllTheWay, {}),
}


# --- OsciReset ---------------------------------------------------------------------------------
class OsciResetState(NamedTuple):
    """count: updates applied; prev: the params after the previous update; dist_w, dist_q:
    the summed |change| of the params and of their quantized values over the window."""

    count: Array  # type: ignore[assignment]  # a field named as tuple.count, optax's habit
    prev: Any
    dist_w: Any
    dist_q: Any


def osci_reset(
    quantize: Callable[[Array], Array],
    *,
    start: int,
    period: int = 200,
    track: int = 50,
    threshold: float = 8.0,
    mask: Any = None,
) -> optax.GradientTransformation:
    """TetraJet-v2's OsciReset (arXiv 2510.27527; the authors' ``distance_ratio`` detector and
    configs: period 200, 50 tracked steps, threshold 8, from 59% of training) as an optax
    transformation, chained after the optimizer.

    Every ``period`` updates (from update ``start`` on) it takes the params as a reference,
    then for ``track`` updates adds up, per element, the distance the master weight moved and
    the distance its quantized value ``quantize(w)`` moved; at the next update the elements
    whose quantized distance is at least ``threshold`` times their master distance
    (oscillating: the quantized value flips while the weight barely moves) are set to their
    quantized value (the centre of their bin). ``mask``: a pytree of bools like the params (or
    a function of the params returning one) choosing the weights (default: every leaf with two
    or more axes); ``quantize(w)``: the recipe's forward quantization of a weight, in the
    weight's own layout (:func:`forward_weight_quantizer`).
    """

    def flags(params: Any) -> list[bool]:
        m = mask(params) if callable(mask) else mask
        if m is None:
            return [jnp.ndim(p) >= 2 for p in jax.tree.leaves(params)]
        return [bool(f) for f in _leaves_up_to(params, m)]

    def init(params: Any) -> OsciResetState:
        f = flags(params)
        leaves, tree = jax.tree.flatten(params)
        z = [jnp.zeros_like(p) if on else jnp.zeros((), p.dtype)
             for p, on in zip(leaves, f, strict=True)]  # fmt: skip
        z = jax.tree.unflatten(tree, z)
        return OsciResetState(jnp.zeros((), jnp.int32), z, z, z)

    def update(
        updates: Any, state: OsciResetState, params: Any = None
    ) -> tuple[Any, OsciResetState]:
        if params is None:
            raise ValueError("osci_reset needs the params (optax passes them to update)")
        count = state.count + 1  # the update being applied is number `count`
        phase = count % period
        base = count - phase  # the update that took the current window's reference
        active = (base >= start) & (base > 0)
        snap = active & (phase == 0)
        tracking = active & (phase >= 1) & (phase <= track)
        reset = active & (phase == track + 1)

        def per_leaf(
            on: bool, p: Array, u: Array, prev: Array, dw: Array, dq: Array
        ) -> tuple[Array, Array, Array, Array]:
            if not on:
                return u, prev, dw, dq
            w = p + u
            qw, qprev = quantize(w), quantize(prev)
            dw = jnp.where(snap, 0.0, jnp.where(tracking, dw + jnp.abs(w - prev), dw))
            dq = jnp.where(snap, 0.0, jnp.where(tracking, dq + jnp.abs(qw - qprev), dq))
            ratio = jnp.where(dw > 0, dq / jnp.where(dw > 0, dw, 1.0), 0.0)
            w2 = jnp.where(reset & (ratio >= threshold), qw, w)
            return w2 - p, w2, dw, dq

        flat_p, tree = jax.tree.flatten(params)
        rest = [_leaves_up_to(params, t) for t in (updates, state.prev, state.dist_w, state.dist_q)]
        out = [per_leaf(on, *leaves) for on, *leaves in zip(flags(params), flat_p, *rest,
                                                             strict=True)]  # fmt: skip
        u2, prev, dw, dq = (jax.tree.unflatten(tree, [o[i] for o in out]) for i in range(4))
        return u2, OsciResetState(count, prev, dw, dq)

    return optax.GradientTransformation(init, update)


def _leaves_up_to(tree: Any, other: Any) -> list[Any]:
    """``other``'s subtrees at the leaves of ``tree``'s structure, in order."""
    treedef = jax.tree.structure(tree)
    return treedef.flatten_up_to(other)  # type: ignore[attr-defined]  # PyTreeDef: no stub


def forward_weight_quantizer(
    recipe: FP4Recipe[Any], contract_axis: int = 0
) -> Callable[[Array], Array]:
    """``w -> Q(w)``: the recipe's forward quantization of a 2-D weight contracted along
    ``contract_axis`` (0 for ``x @ w``), in the weight's own layout (for :func:`osci_reset`)."""

    def q(w: Array) -> Array:
        wt = jnp.moveaxis(w.astype(jnp.float32), contract_axis, -1)[None]
        v = _as_operand(recipe.fprop_operand(wt, "w", None))
        vals = v.values if v.factor is None else v.values * v.factor
        return jnp.moveaxis(vals[0], -1, contract_axis).astype(w.dtype)

    return q
