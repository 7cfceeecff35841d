"""``diagnose --autoswitch``: train a recipe variant, switching each matmul to high precision
on the fly when its quantization goes bad (Transformer Engine's precision-debug defaults: an
underflow above 5% or a quantization MSE above 1e-4).

:class:`AutoSwitchRecipe` is a :class:`~precisionlab.train._recipe.TrainRecipe` whose state (a
field of the train state, threaded through ``jit`` like delayed scaling's) holds, per matmul,
a ``switched`` flag, the step it switched at, a step counter and the last statistics. Each
step every replaced matmul computes both the recipe's product and the high-precision one
(the policy's compute dtype) and selects with the flag (``jnp.where``: both GEMMs run, a
diagnostic's price), and measures with the recipe's own quantizers, on the fly:

- ``underflow``: the fraction of an operand's finite nonzero elements that quantize to zero;
- ``mse``: the mean squared error of the dequantized copy (absolute, as TE's),

for the forward operands (``x``, ``w``) and the output cotangent (``g``, through a zero probe
added to the output). A convolution counts as a matmul: it is measured on the GEMM the recipe
runs for it (the patches, the kernel rows, and the output gradient with each group's output
channels along the contraction; ``precisionlab.hardware.ConvGemm``), its ``g`` statistics
computed in its backward pass. After the step (``update_state``) a matmul whose any
statistic exceeds its threshold is switched for every later step; a skipped step changes no
flag. Statistics of micro-batches combine by max.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab.diagnose._options import check_counts
from precisionlab.experiments._config import Unit
from precisionlab.hardware._conv import ConvGemm
from precisionlab.hardware._conv import from_params as conv_plan
from precisionlab.intercept import Context, Intercepted, Site, intercept
from precisionlab.intercept import _boundary as boundary
from precisionlab.mixed import filter_value_and_grad
from precisionlab.recipes import WEIGHT_OPERANDS, AppliedRecipe, Recipe
from precisionlab.recipes import dot_general as recipe_dot
from precisionlab.recipes._conv import conv_site
from precisionlab.train import build, train
from precisionlab.train._recipe import TrainRecipe

__all__ = ["STAT_NAMES", "AutoSwitchRecipe", "SwitchOptions", "SwitchResult", "autoswitch"]

#: The statistics kept per matmul, in order: per operand kind (activation ``x``, weight ``w``,
#: output gradient ``g``) its underflow fraction and mean squared error, the thresholds'
#: order (``[underflow, mse] * 3``).
STAT_NAMES: tuple[str, ...] = tuple(
    f"{kind}_{stat}" for kind in ("x", "w", "g") for stat in ("underflow", "mse")
)
_FLOATS = ("float16", "bfloat16", "float32", "float64")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwitchOptions:
    """underflow: fraction in [0, 1]; mse: absolute mean squared error >= 0 (switch when
    exceeded). steps: steps to run (None: the variant's)."""

    underflow: float = 0.05
    mse: float = 1e-4
    steps: int | None = None

    def __post_init__(self) -> None:
        u, m = self.underflow, self.mse
        if isinstance(u, bool) or not isinstance(u, int | float) or not 0 <= u <= 1:
            raise ValueError(f"underflow threshold must be a fraction in [0, 1], got {u!r}")
        if isinstance(m, bool) or not isinstance(m, int | float) or not 0 <= m < math.inf:
            raise ValueError(f"mse threshold must be a number >= 0, got {m!r}")
        check_counts(self, optional=("steps",))


def _pad(t: jax.Array, recipe: Recipe, kind: str) -> jax.Array:
    for blk in recipe.block_sizes(kind):
        widths = [(0, 0)] * t.ndim
        widths[-1] = (0, -t.shape[-1] % blk)
        if recipe.two_d(kind):
            widths[-2] = (0, -t.shape[-2] % blk)
        t = jnp.pad(t, widths)
    return t


def _qstats(recipe: Recipe, t: jax.Array, kind: str, key: jax.Array | None) -> jax.Array:
    """(underflow fraction, mse) of a float32 (1, R, K) tensor quantized as ``kind``."""
    t = jax.lax.stop_gradient(t.astype(jnp.float32))
    n = t.size
    tp = _pad(t, recipe, kind)
    q = recipe.quantize(tp, kind, key=key).dequantize()
    q = q[..., : t.shape[-2], : t.shape[-1]]
    fin = jnp.isfinite(t)
    nz = fin & (t != 0)
    under = jnp.sum(nz & (q == 0)) / jnp.maximum(jnp.sum(nz), 1)
    err = jnp.where(fin & jnp.isfinite(q), (t - q) ** 2, 0.0)
    return jnp.stack([under.astype(jnp.float32), (jnp.sum(err) / n).astype(jnp.float32)])


def _rows(x: jax.Array, contract: Sequence[int], batch: Sequence[int]) -> jax.Array:
    """(1, rows, K): the contraction axes last, everything else flattened into rows."""
    free = [d for d in range(x.ndim) if d not in contract and d not in batch]
    k = math.prod(x.shape[d] for d in contract)
    return jnp.transpose(x, (*batch, *free, *contract)).reshape(1, -1, k)


class _SwitchRule:
    primitives = boundary.PRODUCTS
    # what it could act on but does not (a grouped matmul has no scaling rule): listed by the
    # report and warned about once, never silently skipped
    candidates = boundary.RAGGED_PRODUCTS
    label = "autoswitch"

    def __init__(self, recipe: Recipe, weight: str, sink: dict) -> None:
        self.recipe, self.weight, self.sink = recipe, weight, sink

    def declines(self, site: Site) -> str | None:
        """A matmul inside a loop has one state for all its iterations, which this rule does
        not keep: it stays in high precision, listed and warned about (never silently)."""
        return f"inside {site.loops[0]} (no per-iteration switch state)" if site.loops else None

    def apply(self, ctx: Context, lhs: jax.Array, rhs: jax.Array, **params: Any) -> list:
        st = ctx.state
        if st is None or str(lhs.dtype) not in _FLOATS or str(rhs.dtype) not in _FLOATS:
            return ctx.original(lhs, rhs)
        key = jax.random.PRNGKey(ctx.site.index)
        hp = ctx.original(lhs, rhs)[0]
        plan = None
        if ctx.site.primitive == boundary.CONV:
            # the GEMM over the patches, as the recipe computes it; distinct from the key of
            # the matmul of the same index (indices count per primitive)
            key = jax.random.fold_in(key, 1)
            plan = conv_plan(lhs.shape, rhs.shape, params)
            q = conv_site(lhs, rhs, params, self.recipe, self.weight, None, key)
            operands = (plan.patches(lhs), plan.kernel_rows(rhs))
        else:
            dn = params["dimension_numbers"]
            q = recipe_dot(
                lhs, rhs, dn, preferred_element_type=params.get("preferred_element_type"),
                recipe=self.recipe, key=key, weight=self.weight,
            )  # fmt: skip
            (lc, rc), (lb, rb) = dn
            operands = (_rows(lhs, lc, lb), _rows(rhs, rc, rb))
        out = jnp.where(st["switched"] > 0, hp, q.astype(hp.dtype))
        kinds = WEIGHT_OPERANDS[self.weight]
        pair = [_qstats(self.recipe, t, k, key) for t, k in zip(operands, kinds, strict=True)]
        if self.weight == "lhs":  # STAT_NAMES: the activation ("x") first, the weight ("w")
            pair.reverse()
        self.sink[ctx.site.name] = jnp.concatenate(pair)
        if plan is None:
            return [out + st["probe"].astype(hp.dtype)]
        return [_g_tap(self.recipe, plan, out, st["g_stats"])]


def _g_tap(recipe: Recipe, plan: ConvGemm, y: jax.Array, probe: jax.Array) -> jax.Array:
    """``y`` unchanged; the cotangent of ``probe`` (float32 (2,)) is the (underflow, mse) of
    ``y``'s cotangent (a convolution's output gradient) quantized as the recipe's ``g``, laid
    out as the convolution's GEMM reads it: (G, M, O_g)."""

    @jax.custom_vjp
    def tap(y: jax.Array, probe: jax.Array) -> jax.Array:
        return y

    def fwd(y: jax.Array, probe: jax.Array) -> tuple[jax.Array, None]:
        return y, None

    def bwd(_: None, ct: jax.Array) -> tuple[jax.Array, jax.Array]:
        return ct, _qstats(recipe, plan.gemm_output(ct), "g", jax.random.PRNGKey(0))

    tap.defvjp(fwd, bwd)
    return tap(y, probe)


class _Switched:
    """What the train step needs from a recipe: an :class:`~precisionlab.recipes.AppliedRecipe`."""

    def __init__(self, fn: Callable, spec: AutoSwitchRecipe) -> None:
        self.fn, self.spec = fn, spec

    def _intercepted(self, sink: dict) -> Intercepted:
        rule = _SwitchRule(self.spec.recipe, self.spec.weight, sink)
        # attention's products (two activations) out by default, as in recipes.apply
        return intercept(
            self.fn, rule, include=self.spec.include, exclude=self.spec.exclude,
            numbering="primitive", default=self.spec.selects,
        )  # fmt: skip

    def sites(self, *args: Any, **kwargs: Any) -> list[Site]:
        return self._intercepted({}).sites(*args, **kwargs)

    def skipped(self, *args: Any, **kwargs: Any) -> list[Site]:
        """What it leaves in high precision although a recipe acts on it (a matmul inside a
        loop, a grouped matmul), each with ``Site.skipped`` saying why."""
        return self._intercepted({}).skipped(*args, **kwargs)

    def init_state(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        state = {}
        for s in self.sites(*args, **kwargs):
            if s.selected and not s.loops and s.dtype in _FLOATS:
                # the output gradient's statistics: a matmul's from the cotangent of a zero
                # probe added to its output; a convolution's straight from its backward pass
                # (its GEMM reads the gradient in another layout), through a (2,) probe
                probe = (
                    {"g_stats": jnp.zeros((2,), jnp.float32)}
                    if s.primitive == boundary.CONV
                    else {"probe": jnp.zeros(s.out_shapes[0], jnp.float32)}
                )
                state[s.name] = {
                    "switched": jnp.zeros((), jnp.float32),
                    "switch_step": jnp.full((), -1.0, jnp.float32),
                    "t": jnp.zeros((), jnp.float32),
                    **probe,
                    "last": jnp.zeros((len(STAT_NAMES),), jnp.float32),
                    "trip": jnp.zeros((len(STAT_NAMES),), jnp.float32),
                }
        return state

    def value_and_grad(
        self, argnums: int | Sequence[int] = 0, has_aux: bool = False
    ) -> Callable[..., tuple[Any, Any, dict]]:
        if argnums != 0:
            raise ValueError("autoswitch differentiates the first argument only")

        def f(
            state: dict[str, Any], *args: Any, key: jax.Array | None = None, **kwargs: Any
        ) -> tuple[Any, Any, dict[str, jax.Array]]:
            def run(st: Any, p: Any, *rest: Any) -> tuple[Any, tuple[Any, dict]]:
                sink: dict = {}
                out = self._intercepted(sink).call_with_state(st, p, *rest, key=key, **kwargs)
                value, aux = out if has_aux else (out, None)
                return value, (aux, sink)

            # each device's own statistics inside shard_map; an Equinox model's non-array
            # leaves pass through (gradient None)
            state = boundary.match_varying(state, boundary.tree_varying_axes((args, kwargs)))
            vg = filter_value_and_grad(run, argnums=(0, 1), has_aux=True)
            (value, (aux, sink)), (gst, gp) = vg(state, *args)
            observed = {}
            for name in state:
                if "g_stats" in gst[name]:
                    gs = gst[name]["g_stats"]
                else:
                    ct = gst[name]["probe"]
                    g = ct.reshape(1, -1, ct.shape[-1]) if ct.ndim else ct.reshape(1, 1, 1)
                    gs = _qstats(self.spec.recipe, g, "g", jax.random.PRNGKey(0))
                observed[name] = jnp.concatenate([sink[name], gs])
            return ((value, aux) if has_aux else value), gp, observed

        return f

    def update_state(self, state: dict, observed: dict, *, skip: Any = False) -> dict:
        thr = jnp.asarray([self.spec.underflow, self.spec.mse] * 3, jnp.float32)
        new = {}
        for name, st in state.items():
            o = observed[name]
            trip = jnp.any(o > thr)
            was = st["switched"] > 0
            t = st["t"] + 1
            changed = {
                "switched": (was | trip).astype(jnp.float32),
                "switch_step": jnp.where(~was & trip, t, st["switch_step"]),
                "trip": jnp.where(~was & trip, o, st["trip"]),
                "last": o,
            }
            kept = {k: jnp.where(skip, st[k], v) for k, v in changed.items()}
            new[name] = {**st, **kept, "t": t}
        return new


@dataclasses.dataclass(frozen=True)
class AutoSwitchRecipe(TrainRecipe):
    """A TrainRecipe whose matmuls switch to high precision when ``underflow`` or ``mse``
    is exceeded (see the module docstring); stateful. ``weight``: which matmul operand is the
    weight (``"rhs"``: ``x @ w``; ``"lhs"``: Equinox's ``w @ x``), as in ``recipes.apply``."""

    underflow: float = 0.05
    mse: float = 1e-4
    weight: str = "rhs"

    @property
    def stateful(self) -> bool:
        return True

    def apply(self, fn: Any) -> AppliedRecipe:
        if self.recipe.stateful:
            raise ValueError(
                f"autoswitch needs a stateless recipe; {self.recipe.name!r} keeps its own state"
            )
        return _Switched(fn, self)


@dataclasses.dataclass
class SwitchResult:
    """variant; steps_done; final_loss; sites: per matmul ``{site, layer, shape, switched
    (bool), step (1-based step after which it switched, or None), trip (STAT_NAMES of that
    step, or None), stats (the last step's STAT_NAMES)}``; thresholds; losses per step."""

    variant: str
    recipe: str
    underflow: float
    mse: float
    steps_done: int
    final_loss: float
    sites: list[dict[str, Any]]
    losses: list[float]

    @property
    def switched_sites(self) -> list[str]:
        """The names of the matmuls that switched (``recipes.apply(..., exclude=...)``)."""
        return [s["site"] for s in self.sites if s["switched"]]


def autoswitch(
    unit: Unit, options: SwitchOptions = SwitchOptions(), *, say: Callable[[str], None] = print
) -> SwitchResult:
    """Train ``unit`` (a variant with a recipe) with :class:`AutoSwitchRecipe`."""
    cfg = unit.config
    rec = cfg.precision.recipe
    if rec is None:
        raise ValueError(
            f"variant {unit.name!r} has no recipe: --autoswitch switches a recipe's matmuls "
            "to high precision"
        )
    spec = AutoSwitchRecipe(
        rec.recipe, rec.include, rec.exclude, underflow=options.underflow, mse=options.mse
    )
    changes: dict[str, Any] = {"recipe": spec, "hist_interval": 0, "checkpoint_interval": 0}
    if options.steps is not None:
        changes["steps"] = options.steps
    config = dataclasses.replace(cfg, remat=False, **changes)
    result = train(config, quiet=True)
    setup = build(config)
    example = next(iter(setup.data.batches(config.batch_size, seed=config.seed)))
    params = jax.tree.map(lambda p: p.astype(setup.policy.compute_dtype), setup.params)
    sites = {s.name: s for s in spec.apply(setup.loss_fn).sites(params, example)}
    layers = setup.model.layer_names()
    rows = []
    for name, st in jax.device_get(result.state.recipe_state).items():
        s = sites[name]
        layer = s.layer(names=layers)
        switched = bool(st["switched"] > 0)
        rows.append(
            {
                "site": name,
                "layer": layer,
                "shape": " x ".join(str(list(x)) for x in s.in_shapes),
                "switched": switched,
                "step": int(st["switch_step"]) if switched else None,
                "stats": dict(zip(STAT_NAMES, map(float, np.asarray(st["last"])), strict=True)),
                "trip": dict(zip(STAT_NAMES, map(float, np.asarray(st["trip"])), strict=True))
                if switched
                else None,
            }
        )
        if switched:
            say(f"{name} ({layer}) switched to high precision after step {rows[-1]['step']}")
    return SwitchResult(
        variant=unit.name,
        recipe=rec.recipe.name,
        underflow=options.underflow,
        mse=options.mse,
        steps_done=result.steps_done,
        final_loss=float(result.final_loss),
        sites=rows,
        losses=[float(m["loss"]) for m in result.metrics],
    )
