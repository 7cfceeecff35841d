"""Order discovery: the summation tree of a black-box reduction or GEMM, revealed with
FPRev's masking-value probes (Xie et al., "FPRev: Revealing the Order of Floating-Point
Summation", USENIX ATC'25).

A probe sets input i to a large value +M, input j to -M and every other input to a small
value s, so that M + (any partial sum of s) rounds back to M. Every s summed into a partial
sum that holds M (or -M) is lost; where +M and -M meet they cancel exactly, and the s summed
outside that node survive. The result is therefore ``s * (n - size)``, where ``size`` is the
number of inputs under the lowest node joining i and j: one probe gives the size of the
lowest common ancestor of two leaves. A multi-input node (a tensor-core step that adds 16
products and an accumulator at once, aligned to the largest and truncated) loses its small
inputs too, so such nodes are revealed as nodes with more than two children.

:func:`reveal` rebuilds the tree from leaf 0 outwards: the probes (r, j) of one leaf r against
the others sort them by the node where they join r's path to the root; each group is a
sibling subtree, rebuilt the same way from its middle leaf. A sequential sum takes about 2n
probes, a pairwise one O(n log n): far fewer than the n(n - 1)/2 of every pair. The
result is checked (every node's size must match what its probes said) so that a black box
that is not a tree of rounded additions is refused rather than misread.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from precisionlab import hardware

__all__ = [
    "Tree",
    "blocked_tree",
    "masking_values",
    "pairwise_tree",
    "reveal",
    "schedule_tree",
    "sequential_tree",
]

Node = int | tuple  # a leaf index, or a tuple of children (canonical: sorted by first leaf)


def _first(node: Node) -> int:
    return node if isinstance(node, int) else _first(node[0])


def _canon(node: Any) -> Node:
    if isinstance(node, int | np.integer):
        return int(node)
    kids = [_canon(c) for c in node]
    flat: list[Node] = []
    for c in kids:  # a node of one child is that child
        flat.append(c)
    if len(flat) == 1:
        return flat[0]
    return tuple(sorted(flat, key=_first))


def _leaves(node: Node) -> list[int]:
    return [node] if isinstance(node, int) else [x for c in node for x in _leaves(c)]


@dataclasses.dataclass(frozen=True)
class Tree:
    """A summation tree over inputs ``0..n-1``: ``root`` is a leaf index or a tuple of
    children; children are sorted by their first leaf (a sum's operands commute, so probes
    cannot see their order). Two trees are equal when they sum the same way.

    Attributes:
      root: the canonical nested tuple.
      probes: how many black-box calls revealed it (0 for a tree built from a model).
    """

    root: Node
    probes: int = dataclasses.field(default=0, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", _canon(self.root))

    @property
    def n(self) -> int:
        """The number of inputs."""
        return len(_leaves(self.root))

    def text(self, width: int = 100) -> str:
        """The tree as nested sums: ``(0 + 1)`` a rounded addition, ``seq[0..7]`` a
        sequential chain over consecutive inputs, ``{0..15}`` one fused addition of more
        than two operands (a tensor-core step), ``steps[0..63 by 16]`` a chain of fused
        steps each adding 16 consecutive inputs to the running sum, ``chain(A, B, C)`` a
        left-deep chain of subtrees (``((A + B) + C)``). Longer than ``width``: one node
        per line, indented."""
        flat = _fmt(self.root)
        if len(flat) <= width:
            return flat
        return "\n".join(_lines(self.root, 0, width))

    def evaluate(self, values: Any, dtype: Any = np.float32) -> float:
        """The sum of ``values`` [n] in this order, each addition rounded to ``dtype`` (a
        numpy or ml_dtypes dtype; the values are first cast to it); a node of more than two
        operands adds them exactly (``math.fsum``) and rounds once. A revealed tree of
        rounded additions reproduces the black box's result bit for bit."""
        dt = np.dtype(dtype)
        x = np.asarray(values).astype(dt)
        if x.shape != (self.n,):
            raise ValueError(f"values must have shape ({self.n},); got {x.shape}")

        def ev(node: Node) -> Any:
            if isinstance(node, int):
                return x[node]
            parts = [ev(c) for c in node]
            if len(parts) == 2:
                return np.asarray(parts[0] + parts[1], dt)[()]
            return np.asarray(math.fsum(float(p) for p in parts)).astype(dt)[()]

        return float(ev(self.root))

    def to_json(self) -> Any:
        """The root as nested lists (a leaf is its index)."""

        def conv(node: Node) -> Any:
            return node if isinstance(node, int) else [conv(c) for c in node]

        return conv(self.root)

    def diff(self, other: Tree) -> str | None:
        """None if the trees are equal, else where they first differ: the smallest sum this
        tree computes that the other does not (as :meth:`Tree.text` writes it)."""
        if self.root == other.root:
            return None
        theirs = set(_subtrees(other.root))
        for node in sorted(_subtrees(self.root), key=lambda x: len(_leaves(x))):
            if node not in theirs:
                return _fmt(node)
        return _fmt(self.root)


def _subtrees(node: Node) -> list[Node]:
    if isinstance(node, int):
        return []
    out: list[Node] = [node]
    for c in node:
        out += _subtrees(c)
    return out


def _seq_run(node: Node) -> tuple[int, int] | None:
    """(first, last) when ``node`` is the sequential sum of consecutive leaves."""
    if isinstance(node, int) or len(node) != 2:
        return None
    a, b = node
    if isinstance(a, int) and isinstance(b, int):
        return (a, b) if b == a + 1 else None
    inner, leaf = (a, b) if isinstance(b, int) else (b, a)
    if not isinstance(leaf, int):
        return None
    run = _seq_run(inner)
    return (run[0], leaf) if run and leaf == run[1] + 1 else None


def _atomic(node: Node) -> bool:
    """A leaf, or a node :func:`_fmt` writes as one term (``seq[..]``, ``steps[..]``)."""
    return isinstance(node, int) or bool(_seq_run(node)) or bool(_steps_run(node))


def _chain(node: Node) -> list[Node] | None:
    """The operands of a left-deep chain ``((A + B) + C) + ...`` of three or more: at each
    addition the running sum holds more inputs than the operand added to it."""
    parts: list[Node] = []
    cur: Node | None = node
    steps = 0
    while isinstance(cur, tuple) and not _atomic(cur) and len(cur) == 2:
        a, b = cur
        la, lb = len(_leaves(a)), len(_leaves(b))
        if la == lb or (_atomic(a) and _atomic(b)):
            if parts:  # the chain starts with A + B
                parts += [b, a]
                cur = None
            break
        inner, last = (a, b) if la > lb else (b, a)
        parts.append(last)
        steps += 1
        cur = inner
    if cur is not None:
        parts.append(cur)
    if len(parts) >= 3 and (steps >= 2 or all(_atomic(p) for p in parts)):
        return list(reversed(parts))
    return None


def _is_run(kids: Sequence[Node]) -> bool:
    ints = [c for c in kids if isinstance(c, int)]
    return len(ints) == len(kids) and ints == list(range(ints[0], ints[0] + len(ints)))


def _steps_run(node: Node) -> tuple[int, int, int] | None:
    """(first, last, w) when ``node`` is a chain of fused steps, each adding ``w``
    consecutive inputs to the running sum: ``{...{{0..w-1}, w..2w-1}, ...}``."""
    if isinstance(node, int) or len(node) < 3:
        return None
    if _is_run(node):
        return (node[0], node[-1], len(node))
    inner, rest = node[0], node[1:]
    if not _is_run(rest):
        return None
    below = _steps_run(inner)
    if below is None or below[2] != len(rest) or rest[0] != below[1] + 1:
        return None
    return (below[0], rest[-1], below[2])


def _fmt(node: Node) -> str:
    if isinstance(node, int):
        return str(node)
    run = _seq_run(node)
    if run and run[1] - run[0] >= 2:
        return f"seq[{run[0]}..{run[1]}]"
    steps = _steps_run(node)
    if steps and steps[1] - steps[0] + 1 > steps[2]:
        return f"steps[{steps[0]}..{steps[1]} by {steps[2]}]"
    if len(node) > 2:
        kids = node
        if all(isinstance(c, int) for c in kids) and list(kids) == list(
            range(kids[0], kids[0] + len(kids))
        ):
            return f"{{{kids[0]}..{kids[-1]}}}"
        return "{" + ", ".join(_fmt(c) for c in kids) + "}"
    chain = _chain(node)
    if chain:
        return "chain(" + ", ".join(_fmt(c) for c in chain) + ")"
    return f"({_fmt(node[0])} + {_fmt(node[1])})"


def _lines(node: Node, depth: int, width: int) -> list[str]:
    pad = "  " * depth
    text = _fmt(node)
    if isinstance(node, int) or len(pad + text) <= width:
        return [pad + text]
    chain = _chain(node)
    kids = chain if chain else list(node)
    what = "chain" if chain else ("sum" if len(node) == 2 else f"fused {len(node)}")
    leaves = _leaves(node)
    out = [f"{pad}{what} of {len(kids)} over {len(leaves)} inputs [{min(leaves)}..{max(leaves)}]:"]
    for c in kids:
        out += _lines(c, depth + 1, width)
    return out


# --- reference trees ------------------------------------------------------------------


def sequential_tree(n: int, start: int = 0) -> Tree:
    """``((x0 + x1) + x2) + ...``: a loop."""
    node: Node = start
    for i in range(start + 1, start + n):
        node = (node, i)
    return Tree(node)


def pairwise_tree(n: int, start: int = 0) -> Tree:
    """Recursive halving: ``sum(x[:h]) + sum(x[h:])`` with ``h = n // 2``."""

    def build(lo: int, hi: int) -> Node:
        if hi - lo == 1:
            return lo
        h = lo + (hi - lo) // 2
        return (build(lo, h), build(h, hi))

    return Tree(build(start, start + n))


def blocked_tree(n: int, width: int, outer: str = "sequential") -> Tree:
    """Split-K: slices of ``width`` consecutive inputs, each summed sequentially, then the
    slice sums added ``outer``: ``"sequential"`` or ``"pairwise"``."""
    if outer not in ("sequential", "pairwise"):
        raise ValueError(f"outer must be 'sequential' or 'pairwise', got {outer!r}")
    slices = [sequential_tree(min(width, n - s), s).root for s in range(0, n, width)]
    if outer == "sequential":
        node: Node = slices[0]
        for s in slices[1:]:
            node = (node, s)
        return Tree(node)

    def build(lo: int, hi: int) -> Node:
        if hi - lo == 1:
            return slices[lo]
        h = lo + (hi - lo) // 2
        return (build(lo, h), build(h, hi))

    return Tree(build(0, len(slices)))


def schedule_tree(preset: str, k: int, dtype: str = "float16") -> Tree:
    """The summation tree a :mod:`precisionlab.hardware` preset's model computes for one
    output of a GEMM of contraction length ``k`` with ``dtype`` operands: each tensor-core
    step one node over its products and the accumulator coming in, chained; restarts added
    in float32 in order; split-K slices summed in the schedule's order (the model's own
    rules: :func:`precisionlab.hardware.resolve`)."""
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    kw = hardware.preset(preset)
    kind = "fp8" if "float8" in dtype else "16bit"
    res = hardware.resolve(kw["device"], kw["library"], kw["fast_accumulation"], kind, {}, k)
    step, sch = res.step, res.schedule
    w = step.products
    order = list(range(k))
    if sch.k_order == "fp8_pairs":
        kp = -(-k // 32) * 32
        idx = np.arange(kp).reshape(kp // 32, 8, 2, 2).transpose(0, 2, 1, 3).reshape(kp)
        order = [int(i) for i in idx]
    else:
        kp = k
    block = sch.restart_every
    unit = block or w
    split = sch.split_k if (sch.split_k and k >= sch.split_k_min_k) else None
    slice_w = split or unit * max(1, math.ceil(kp / unit))
    nslices = max(1, math.ceil(kp / slice_w))
    kp = nslices * slice_w
    order += list(range(k, kp))  # padding (dropped below)
    block_w = block or slice_w

    def real(ks: Sequence[int]) -> list[int]:
        return [x for x in ks if x < k]

    slices: list[Node | None] = []
    for s in range(nslices):
        total: Node | None = None
        for b0 in range(s * slice_w, (s + 1) * slice_w, block_w):
            acc: Node | None = None
            for s0 in range(b0, b0 + block_w, w):
                leaves = real(order[s0 : s0 + w])
                parts = ([acc] if acc is not None else []) + leaves
                acc = None if not parts else (parts[0] if len(parts) == 1 else tuple(parts))
            if acc is not None:
                total = acc if total is None else (total, acc)
        slices.append(total)
    live = [x for x in slices if x is not None]
    if sch.split_order == "sequential" or len(slices) == 1:
        node: Node | None = None
        for x in live:
            node = x if node is None else (node, x)
        assert node is not None  # k >= 1: the first slice holds input 0
        return Tree(node)
    bits = sch.split_order
    assert not isinstance(bits, str)  # Schedule takes no other string than "sequential"
    # butterfly: for each bit in order, slice i (bit clear) meets slice i + 2**bit
    groups: dict[int, Node | None] = dict(enumerate(slices))
    for bit in bits:
        new: dict[int, Node | None] = {}
        for i, v in groups.items():
            if i & (1 << bit):
                continue
            u = groups.get(i | (1 << bit))
            new[i] = v if u is None else (u if v is None else (v, u))
        groups = new
    (root,) = groups.values()
    assert root is not None  # k >= 1: the first slice holds input 0
    return Tree(root)


# --- the probes -------------------------------------------------------------------------

#: (large, small) probe values by input dtype: M + (any count of s up to the bound) rounds to
#: M, and counts of s add exactly, in the dtype and in float32 accumulation.
_VALUES = {
    "float32": (2.0**60, 1.0),
    "float64": (2.0**100, 1.0),
    "bfloat16": (2.0**60, 1.0),
    "float16": (2.0**15, 2.0**-24),
}


def masking_values(dtype: str) -> tuple[float, float]:
    """The (large, small) probe values for inputs of ``dtype`` (``float32``, ``float64``,
    ``bfloat16``, ``float16``). Counts of the small value stay exact up to 2^24 inputs in
    float32 accumulation (``bfloat16`` accumulation: 256; ``float16``: 2048)."""
    if dtype not in _VALUES:
        raise ValueError(f"no probe values for {dtype!r}; supported: {', '.join(_VALUES)}")
    return _VALUES[dtype]


def reveal(fn: Callable[[np.ndarray], float], n: int, *, large: float, small: float,
           max_probes: int | None = None) -> Tree:  # fmt: skip
    """The summation tree of the black box ``fn`` over ``n`` inputs.

    Args:
      fn: takes a float64 numpy vector [n] of probe values (the caller puts them into the
        black box's inputs, exactly) and returns the black box's sum as a float.
      n: the number of inputs (>= 2).
      large, small: the masking values (:func:`masking_values`).
      max_probes: stop with ValueError past this many calls (default n * (n - 1) / 2).

    Returns:
      The :class:`Tree`, its ``probes`` the number of calls made. ValueError when the answers
      are not those of a tree of rounded additions.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"n must be an int >= 2; got {n!r}")
    limit = max_probes if max_probes is not None else n * (n - 1) // 2
    cache: dict[tuple[int, int], int] = {}

    def lca(i: int, j: int) -> int:
        key = (min(i, j), max(i, j))
        if key not in cache:
            if len(cache) >= limit:
                raise ValueError(f"order discovery needed more than {limit} probes")
            x = np.full(n, small, np.float64)
            x[i], x[j] = large, -large
            got = float(fn(x))
            count = got / small
            if (
                not math.isfinite(count)
                or abs(count - round(count)) > 1e-6
                or not (0 <= round(count) <= n - 2)
            ):
                raise ValueError(
                    f"probe ({i}, {j}) returned {got!r}, not a whole number of small values "
                    f"({small}) between 0 and {n - 2}: the black box does not sum its inputs "
                    "as a tree of rounded additions (or the probe values do not fit its "
                    "formats)"
                )
            cache[key] = n - round(count)
        return cache[key]

    def build(group: list[int], top: int | None) -> list[Node]:
        """The subtrees whose leaves are ``group``: one or more children of a node of size
        ``top`` (None: the whole tree)."""
        if len(group) == 1:
            return [group[0]]
        r = group[len(group) // 2]
        sizes = {j: lca(r, j) for j in group if j != r}
        rest = [j for j in group if j != r and top is not None and sizes[j] == top]
        mine = [j for j in group if j != r and j not in rest]
        node: Node = r
        size = 1
        for s in sorted({sizes[j] for j in mine}):
            members = [j for j in mine if sizes[j] == s]
            kids = build(members, s)
            node = (node, *kids)
            size += len(members)
            if size != s:
                raise ValueError(
                    f"inconsistent probes: the node joining input {r} and {members[0]} holds "
                    f"{size} inputs by the probes of its parts, {s} by its own; not a tree of "
                    "rounded additions"
                )
        return [node] + (build(rest, top) if rest else [])

    trees = build(list(range(n)), None)
    if len(trees) != 1:
        raise ValueError("inconsistent probes: the inputs do not join into one tree")
    return Tree(trees[0], probes=len(cache))
