"""Order discovery (FPRev's probes) against reductions whose order is known: a sequential
loop, pairwise halving, a fixed split-K, and the hardware models' own schedules; the revealed
order of XLA's reduce reproduces its results bit for bit."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precisionlab import hardware
from precisionlab.consistency import (
    Tree,
    blocked_tree,
    masking_values,
    pairwise_tree,
    reveal,
    schedule_tree,
    sequential_tree,
)

F32 = np.float32


def loop(x):
    s = F32(x[0])
    for v in x[1:]:
        s = F32(s + F32(v))
    return float(s)


def halves(x):
    x = [F32(v) for v in x]

    def r(lo, hi):
        if hi - lo == 1:
            return x[lo]
        h = lo + (hi - lo) // 2
        return F32(r(lo, h) + r(h, hi))

    return float(r(0, len(x)))


def split8(x):
    return loop([loop(x[s : s + 8]) for s in range(0, len(x), 8)])


LARGE, SMALL = masking_values("float32")


@pytest.mark.parametrize("n", [2, 3, 5, 16, 33, 64])
def test_known_orders_are_revealed(n):
    for fn, want in ((loop, sequential_tree(n)), (halves, pairwise_tree(n)),
                     (split8, blocked_tree(n, 8))):  # fmt: skip
        got = reveal(fn, n, large=LARGE, small=SMALL)
        assert got == want, (fn.__name__, got.text(), want.text())
        assert got.probes <= n * (n - 1) // 2
        if n >= 16:  # far fewer than every pair
            assert got.probes < n * (n - 1) // 4, (fn.__name__, got.probes)
    assert reveal(loop, n, large=LARGE, small=SMALL).probes <= 2 * n


def test_the_reference_trees_are_what_they_say():
    assert sequential_tree(4).root == (((0, 1), 2), 3)
    assert pairwise_tree(4).root == ((0, 1), (2, 3))
    assert pairwise_tree(5).root == ((0, 1), (2, (3, 4)))
    assert blocked_tree(5, 2).root == (((0, 1), (2, 3)), 4)
    assert blocked_tree(8, 2, "pairwise").root == (((0, 1), (2, 3)), ((4, 5), (6, 7)))
    assert Tree((3, (1, 0), 2)) == Tree(((0, 1), 2, 3))  # operands commute
    assert sequential_tree(5).text() == "seq[0..4]"
    assert pairwise_tree(7).text() == "((0 + (1 + 2)) + ((3 + 4) + (5 + 6)))"
    assert blocked_tree(24, 8).text() == "chain(seq[0..7], seq[8..15], seq[16..23])"
    assert Tree(((tuple(range(4)), 4, 5, 6, 7), 8, 9, 10, 11)).text() == "steps[0..11 by 4]"
    assert sequential_tree(3).diff(sequential_tree(3)) is None
    assert sequential_tree(3).diff(Tree((0, (1, 2)))) == "(0 + 1)"
    assert pairwise_tree(4).to_json() == [[0, 1], [2, 3]]
    text = pairwise_tree(64).text(width=40)
    assert text.splitlines()[0] == "sum of 2 over 64 inputs [0..63]:"


def test_the_evaluation_of_a_tree_is_its_order():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(33) * np.exp(3 * rng.standard_normal(33))).astype(F32)
    assert sequential_tree(33).evaluate(x) == loop(x)
    assert pairwise_tree(33).evaluate(x) == halves(x)
    y = np.ones(33, F32)
    y[0] = 2.0**24  # a loop loses every 1 (ties to even), halving keeps them
    assert sequential_tree(33).evaluate(y) == 2.0**24
    assert pairwise_tree(33).evaluate(y) == 2.0**24 + 32
    with pytest.raises(ValueError, match="shape"):
        sequential_tree(3).evaluate(x)


@pytest.mark.parametrize("n", [16, 100])
def test_xla_reduce_order_reproduces_its_results(n):
    f = jax.jit(jnp.sum)
    tree = reveal(lambda x: float(f(jnp.asarray(x, jnp.float32))), n, large=LARGE, small=SMALL)
    rng = np.random.default_rng(n)
    for _ in range(10):
        x = (rng.standard_normal(n) * np.exp(3 * rng.standard_normal(n))).astype(F32)
        assert tree.evaluate(x) == float(f(x))


@pytest.mark.parametrize(("preset", "k", "dtype"), [
    ("h100-xla", 100, "float16"),     # two 64-wide slices (the last partial), in order
    ("h100-cublaslt", 48, "bfloat16"),  # one chain of 16-product steps
    ("a100", 24, "float16"),          # 8-product steps
])  # fmt: skip
def test_the_hardware_models_reveal_their_schedules(preset, k, dtype):
    large, small = masking_values(dtype)
    g = jax.jit(lambda a, b: hardware.gemm(a, b, **hardware.preset(preset)))
    ones = jnp.ones((k, 1), dtype)

    def fn(x):
        return float(g(jnp.asarray(x, dtype)[None, :], ones)[0, 0])

    got = reveal(fn, k, large=large, small=small)
    assert got == schedule_tree(preset, k, dtype), got.text()


def test_schedule_tree_refuses_a_contraction_without_inputs():
    # mypy found it: with k < 1 no slice holds an input, and Tree(None) failed inside with
    # "'NoneType' object is not iterable"; now a ValueError names k
    for k in (0, -4, 2.0, True):
        with pytest.raises(ValueError, match="k must be a positive int"):
            schedule_tree("h100-xla", k)


def test_schedule_trees_by_hand():
    assert schedule_tree("h100-xla", 48).text() == "steps[0..47 by 16]"
    assert schedule_tree("h100-xla", 256).text() == (
        "chain(steps[0..63 by 16], steps[64..127 by 16], steps[128..191 by 16], "
        "steps[192..255 by 16])"
    )
    # K = 4096: 128-wide slices summed by halves, slice i meeting slice i + 16 first
    top = schedule_tree("h100-xla", 4096, "bfloat16").root
    assert Tree(top[0][0][0][0]).text() == "(steps[0..127 by 16] + steps[2048..2175 by 16])"
    assert Tree(top[1][1][1][1]).text() == "(steps[1920..2047 by 16] + steps[3968..4095 by 16])"
    assert schedule_tree("a100", 16).text() == "steps[0..15 by 8]"


def test_black_boxes_that_are_not_trees_are_refused():
    with pytest.raises(ValueError, match="not a whole number"):
        reveal(lambda x: 0.5, 8, large=LARGE, small=SMALL)
    with pytest.raises(ValueError, match="inconsistent probes"):
        reveal(lambda x: math.fsum(x), 8, large=LARGE, small=SMALL)  # exact: no tree
    with pytest.raises(ValueError, match="more than 3 probes"):
        reveal(loop, 8, large=LARGE, small=SMALL, max_probes=3)
    with pytest.raises(ValueError, match="n must be"):
        reveal(loop, 1, large=LARGE, small=SMALL)
    with pytest.raises(ValueError, match="no probe values"):
        masking_values("int8")
