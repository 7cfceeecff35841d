"""Attribution: which layer injects the gap between two stacks, by activation patching.

Stack ``a`` runs once and its layer outputs are kept. Then stack ``b`` runs once per layer l
with l's output replaced by a's (everything before l is then a's, everything after is b's
computing on it), and the RMS gap of a against that patched b is measured. Patching later
layers removes more of the gap; what one layer adds to the share removed, over the layer
before it, is what that layer injects (by its own computation, given equal inputs). The last
layer (the logits) removes all of it: a check of the patching itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from precisionlab._text import table
from precisionlab.consistency._gap import Gap, gap_from_logits
from precisionlab.consistency._run import Runner
from precisionlab.consistency._stack import Stack, parse_stack

__all__ = ["Attribution", "LayerShare", "attribute"]


@dataclasses.dataclass(frozen=True)
class LayerShare:
    """One layer: ``rms_nats``, the RMS gap with its output patched from a; ``removed``, the
    share of the unpatched RMS gap that patching it removes (1 - rms / base); ``injected``,
    ``removed`` minus the previous layer's (the first layer's: its own ``removed``)."""

    layer: str
    rms_nats: float
    removed: float
    injected: float


@dataclasses.dataclass(frozen=True)
class Attribution:
    """Per-layer shares of the gap of ``a`` against ``b`` (``layers`` in program order;
    ``base`` the unpatched gap)."""

    a: Stack
    b: Stack
    base: Gap
    layers: tuple[LayerShare, ...]

    def ranked(self) -> tuple[LayerShare, ...]:
        """The layers, the largest ``injected`` first."""
        return tuple(sorted(self.layers, key=lambda r: -r.injected))

    def to_dict(self) -> dict[str, Any]:
        """Plain values: ``a``, ``b``, ``base_rms_nats`` and ``layers`` (program order)."""
        return {
            "a": self.a.label,
            "b": self.b.label,
            "base_rms_nats": self.base.rms_nats,
            "layers": [dataclasses.asdict(r) for r in self.layers],
        }

    def text(self) -> str:
        """The ranked table."""
        rows = [
            [i + 1, r.layer, f"{r.injected:+.1%}", f"{r.removed:.1%}", f"{r.rms_nats:.3g}"]
            for i, r in enumerate(self.ranked())
        ]
        head = (
            f"{self.a.label} vs {self.b.label}: RMS gap {self.base.rms_nats:.3g} nats\n"
            "patching each layer's output from the first stack:"
        )
        cols = ["rank", "layer", "injected", "removed when patched", "RMS after (nats)"]
        return head + "\n" + table(rows, cols)


def attribute(
    model: Any,
    params: Any,
    tokens: Any,
    a: Any,
    b: Any,
    *,
    layers: Any = None,
    runner: Runner | None = None,
) -> Attribution:
    """Which layer injects the gap of stack ``a`` against stack ``b`` (see the module
    docstring).

    Args:
      model: an :class:`~precisionlab.consistency._lm.LM` with layers, or a built-in
        Transformer.
      params, tokens, a, b: as :func:`~precisionlab.consistency.logprob_gap`.
      layers: the layers to patch, in program order (default: all of the model's).
      runner: a :class:`~precisionlab.consistency.Runner` to reuse compiled programs.
    """
    sa, sb = parse_stack(a), parse_stack(b)
    run = runner if runner is not None else Runner(model, params)
    if runner is not None and runner.params is not params:
        raise ValueError("runner was made for other params; pass the same params object or "
                         "no runner")  # fmt: skip
    names = tuple(run.lm.layers)
    if not names:
        raise ValueError("attribution needs a model with layers to patch (an LM such as "
                         "TransformerLM); a plain logits_fn has none")  # fmt: skip
    chosen = names if layers is None else tuple(layers)
    unknown = [x for x in chosen if x not in names]
    if unknown:
        raise ValueError(f"unknown layer {unknown[0]!r}; layers: {', '.join(names)}")
    chosen = tuple(x for x in names if x in chosen)  # program order
    ra = run.run(sa, tokens)
    rb = run.run(sb, tokens)
    base = gap_from_logits(tokens, ra.logits, rb.logits, sa, sb)
    rows, prev = [], 0.0
    for name in chosen:
        patched = run.run(sb, tokens, patch={name: ra.acts[name]})
        g = gap_from_logits(tokens, ra.logits, patched.logits, sa, sb)
        removed = 1.0 - g.rms_nats / base.rms_nats if base.rms_nats > 0 else float("nan")
        rows.append(LayerShare(name, g.rms_nats, removed, removed - prev))
        prev = removed
    return Attribution(sa, sb, base, tuple(rows))
