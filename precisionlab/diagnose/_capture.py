"""Every intercepted tensor of one training step of a variant, as host arrays.

:class:`Capture` re-runs a variant's loss (its policy, loss weight, loss scale, recipe and
high-precision layers) on a state and a batch with the interception layer, recording each
matmul's operands (``lhs``, ``rhs``), output (``out``) and output cotangent (``grad``, through a
``-0.0`` probe added to the output, whose gradient is the cotangent), the model's captured
activations (``act:pre``, ...) and the loss. Cotangents are divided by the variant's loss
weight and loss scale, so two variants' gradients are in the same units; :attr:`grad_scale`
keeps the factor (what the variant's compute dtype actually held is ``grad * grad_scale``).

Matmuls inside a scan over stacked layers (``scan_layers``, with or without ``remat_every``)
are captured per iteration, i.e. per layer, under the layer's name (``layer3:dot_general[1]
.out``, see :meth:`precisionlab.intercept.Site.layer`). Matmuls under a ``cond``/``switch``
are captured in the steps where their branch runs (an untaken branch's entry is left out of
that step's captures); matmuls inside a ``while_loop`` are not (reverse mode does not
differentiate through one; :attr:`Capture.uncaptured` names them, and compare says so).

Each matmul tensor also gets a :attr:`Tensor.match` name that does not depend on how the
layers were traced: ``LAYER:matmul[K].PART``, K the matmul's position among the layer's
matmuls in program order, so a scanned variant's tensors pair with an unrolled one's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab.intercept import Context, Emit, PerIteration, Site, intercept
from precisionlab.intercept import _boundary as boundary
from precisionlab.recipes import dot_general as recipe_dot
from precisionlab.train import TrainSetup
from precisionlab.train._recipe import TrainRecipe
from precisionlab.train._step import cast_compute

__all__ = ["Capture", "Tensor"]

_FLOATS = ("float16", "bfloat16", "float32", "float64")


@dataclasses.dataclass(frozen=True)
class Tensor:
    """Where a captured tensor lives: ``layer`` (the model's layer name), ``name`` (``"dot_general
    [3].grad"``, ``"act:pre"``, ``"loss"``), ``kind`` (``"operand"``, ``"output"``,
    ``"activation"``, ``"loss"``, ``"grad"``) and ``order`` (causal: forward in program order,
    then the loss, then cotangents in reverse). ``match``: the name that pairs it with another
    variant's tensor (``"layer3:matmul[1].grad"``: the layer's second matmul; the key for
    activations and the loss), the same whether the layers were unrolled or scanned."""

    layer: str
    name: str
    kind: str
    order: int
    match: str = ""

    @property
    def key(self) -> str:
        return f"{self.layer}:{self.name}"


class _Record:
    primitives = (boundary.DOT_GENERAL,)

    def __init__(self, recipe: TrainRecipe | None, selected: frozenset[str], rstate: Any) -> None:
        self.recipe, self.selected, self.rstate = recipe, selected, rstate

    def apply(
        self, ctx: Context, lhs: jax.Array, rhs: jax.Array, *, dimension_numbers: Any, **params: Any
    ) -> list | Emit:
        name = ctx.site.name
        if str(lhs.dtype) not in _FLOATS or str(rhs.dtype) not in _FLOATS:
            return ctx.original(lhs, rhs)
        if not _captured(ctx.site):
            return ctx.original(lhs, rhs)
        if self.recipe is not None and name in self.selected:
            out = recipe_dot(
                lhs, rhs, dimension_numbers,
                preferred_element_type=params.get("preferred_element_type"),
                recipe=self.recipe.recipe, state=(self.rstate or {}).get(name),
                key=jax.random.PRNGKey(ctx.site.index), weight="rhs",
            )  # fmt: skip
        else:
            out = ctx.original(lhs, rhs)[0]
        tensors = {"lhs": lhs, "rhs": rhs, "out": out}
        if ctx.state is not None:
            out = out + ctx.state.astype(out.dtype)
        return Emit([out], tensors)


def _captured(site: Site) -> bool:
    """Captured sites: at the top level, in calls, checkpoints, scans and conds (not inside a
    while loop, which reverse mode does not differentiate through)."""
    return boundary.WHILE not in site.within


def _probe(site: Site) -> jax.Array | PerIteration:
    zero = jnp.full((*site.lengths, *site.out_shapes[0]), -0.0, jnp.float32)
    return PerIteration(zero) if site.lengths else zero


def _iterations(site: Site) -> list[tuple[int, tuple[int, ...]]]:
    """(flat iteration, index into the loop axes) of each iteration of a captured site."""
    if not site.lengths:
        return [(0, ())]
    lengths = []
    for n in site.lengths:
        assert n is not None  # a while loop's (unknown) count: such sites are not captured
        lengths.append(n)
    return [
        (i, tuple(int(j) for j in np.unravel_index(i, lengths)))
        for i in range(int(np.prod(lengths)))
    ]


#: Where the built-in models' captured activations come in a layer (unknown names last).
_ACT_ORDER = ("input", "pre", "gelu_cubic", "attn_logits", "mlp_hidden", "out", "resid")


def _act_rank(key: str) -> tuple[int, str]:
    name = key.split("/")[-1]
    return (_ACT_ORDER.index(name) if name in _ACT_ORDER else len(_ACT_ORDER), key)


class Capture:
    """Captures of one variant (see the module docstring); ``capture(state, batch)`` gives
    ``{Tensor.key: float32 ndarray}``; :attr:`tensors` lists them in causal order."""

    def __init__(self, setup: TrainSetup):
        cfg, pol = setup.config, setup.policy
        if setup.model.remat:
            raise ValueError("diagnose runs models without remat (the numerics are the same)")
        # (site, iteration index, layer, position among the layer's matmuls) of each capture
        self._entries: list[tuple[Site, tuple[int, ...], str, int]] = []
        #: matmuls not captured (inside a while loop), by site name
        self.uncaptured: list[str] = []
        self.setup, self.policy = setup, pol
        self.compute_dtype = np.dtype(pol.compute_dtype)
        self.layers = setup.model.layer_names()
        self.loss_weight = float(cfg.loss_weight)
        self.fp32 = setup.options.fp32_params
        self.recipe = setup.options.recipe
        self._loss = setup.model.loss_fn(pol, capture=True)
        self.tensors: list[Tensor] = []
        self._fn = jax.jit(self._run)

    def _scaled(self, p: Any, batch: Any) -> tuple[jax.Array, Any]:
        loss, aux = self._loss(p, batch)
        return loss.astype(jnp.float32) * jnp.float32(self.loss_weight), aux

    def _run(
        self, params: Any, loss_scale: Any, rstate: Any, batch: Any
    ) -> tuple[jax.Array, Any, Any, dict[str, jax.Array], jax.Array]:
        pc = cast_compute(params, self.policy.compute_dtype, self.fp32)
        selected: frozenset = frozenset()
        if self.recipe is not None:  # the matmuls the variant's recipe replaces
            sel = intercept(
                self._scaled, _Record(None, selected, None),
                include=self.recipe.include, exclude=self.recipe.exclude,
            )  # fmt: skip
            selected = frozenset(s.name for s in sel.sites(pc, batch) if s.selected)

        inter = intercept(self._scaled, _Record(self.recipe, selected, rstate))
        all_sites = inter.sites(pc, batch)
        sites = [s for s in all_sites if _captured(s)]
        self.uncaptured = [s.name for s in all_sites if not _captured(s)]
        seen: dict[str, int] = {}
        self._entries = []
        for s in sites:
            for i, idx in _iterations(s):
                layer = s.layer(i if s.lengths else None, self.layers)
                self._entries.append((s, idx, layer, seen.get(layer, 0)))
                seen[layer] = seen.get(layer, 0) + 1
        probes = {s.name: _probe(s) for s in sites}

        def run(pr: Any, p: Any) -> tuple[jax.Array, tuple[jax.Array, Any, Any]]:
            (loss, aux), tensors = inter.call_with_aux(pr, p, batch)
            sink = {k: {**a.value, "valid": a.valid} for k, a in tensors.items()}
            return loss_scale.scale(loss), (loss, aux["activations"], sink)

        (_, (loss, acts, sink)), cts = jax.value_and_grad(run, has_aux=True)(probes, pc)
        unscale = jnp.float32(self.loss_weight) * loss_scale.loss_scale.astype(jnp.float32)
        grads = {
            k: (v.value if isinstance(v, PerIteration) else v) / unscale for k, v in cts.items()
        }
        return loss / jnp.float32(self.loss_weight), acts, sink, grads, unscale

    def __call__(self, state: Any, batch: Any) -> dict[str, np.ndarray]:
        loss, acts, sink, grads, unscale = jax.device_get(
            self._fn(state.params, state.loss_scale, state.recipe_state, batch)
        )
        self.grad_scale = float(unscale)
        if not self.tensors:
            self.tensors = self._order(acts, sink)
        out: dict[str, np.ndarray] = {"-:loss": np.asarray(loss, np.float32)}
        for s, idx, layer, _ in self._entries:
            if s.name in sink and not bool(np.asarray(sink[s.name]["valid"])[idx]):
                continue  # a cond branch that did not run this step: nothing to capture
            for part in ("lhs", "rhs", "out"):
                if s.name in sink:
                    x = sink[s.name][part][idx]
                    out[f"{layer}:{s.name}.{part}"] = np.asarray(x, np.float32)
            if s.name in grads:
                out[f"{layer}:{s.name}.grad"] = np.asarray(grads[s.name][idx], np.float32)
        for k, v in acts.items():
            out[f"{self._act_layer(k)}:act:{k.split('/')[-1]}"] = np.asarray(v, np.float32)
        return out

    def _act_layer(self, key: str) -> str:
        head = key.split("/")[0]
        return head if head in self.layers else self.layers[-1]

    def _order(self, acts: dict, sink: dict) -> list[Tensor]:
        fwd: list[Tensor] = []
        for layer in self.layers:
            for s, _, where, k in self._entries:
                if where == layer and s.name in sink:
                    kinds = (("lhs", "operand"), ("rhs", "operand"), ("out", "output"))
                    fwd += [
                        Tensor(layer, f"{s.name}.{p}", kd, 0, f"{layer}:matmul[{k}].{p}")
                        for p, kd in kinds
                    ]
            for k in sorted(acts, key=_act_rank):  # jit returns dicts in sorted key order
                if self._act_layer(k) == layer:
                    name = f"act:{k.split('/')[-1]}"
                    fwd.append(Tensor(layer, name, "activation", 0, f"{layer}:{name}"))
        fwd.append(Tensor("-", "loss", "loss", 0, "-:loss"))
        bwd = [
            Tensor(layer, f"{s.name}.grad", "grad", 0, f"{layer}:matmul[{k}].grad")
            for s, _, layer, k in reversed(self._entries)
            if s.name in sink
        ]
        return [dataclasses.replace(t, order=i) for i, t in enumerate(fwd + bwd)]
