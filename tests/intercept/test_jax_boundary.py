"""The JAX boundary (precisionlab.intercept._boundary): one contract test per higher-order
primitive (a tiny jaxpr, read by its adapter), replays of the parameters jax 0.11.2 recorded
(tests/data/jaxpr_params_jax_0.11.2.json), the loud failure inside an unknown higher-order
primitive, both bind-parameter protocols, and the version check."""

from __future__ import annotations

import ast
import json
import pathlib
import re

import jax
import jax.extend as jex
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.interpreters import mlir

from precisionlab.emulate import emulate
from precisionlab.intercept import _boundary as boundary
from precisionlab.intercept import intercept

DATA = json.loads(
    (pathlib.Path(__file__).parents[1] / "data" / "jaxpr_params_jax_0.11.2.json").read_text()
)
X = jnp.arange(8, dtype=jnp.float32).reshape(2, 4) / 8
W = jnp.arange(16, dtype=jnp.float32).reshape(4, 4) / 16


def _eqn(fn, *args, prim_kind: str):
    """The first equation of ``fn``'s jaxpr whose primitive is of ``prim_kind``."""
    for eqn in jax.make_jaxpr(fn)(*args).jaxpr.eqns:
        if boundary.kind(eqn.primitive) == prim_kind:
            return eqn
    raise AssertionError(f"no {prim_kind} equation")


def _n_invars(prog) -> int:
    return len(boundary.open_jaxpr(prog)[0].invars)


# --- contract tests: one per higher-order primitive -----------------------------------------
def test_scan_adapter_reads_the_operand_split():
    def f(c0, ws, k):
        def body(c, w):
            return jnp.tanh(c @ w) * k, c.sum()

        return jax.lax.scan(body, c0, ws, reverse=True)

    ws = jnp.stack([W, W, W])
    eqn = _eqn(f, X, ws, jnp.float32(2), prim_kind="scan")
    split = boundary.scan_split(eqn.params)
    # operands: consts (k), carry (c0), xs (ws); the body takes them in that order
    assert (split.n_consts, split.n_carry, split.length, split.reverse) == (1, 1, 3, True)
    assert len(eqn.invars) == split.n_consts + split.n_carry + 1
    assert eqn.invars[split.n_consts].aval.shape == X.shape
    assert _n_invars(split.jaxpr) == len(eqn.invars)
    assert boundary.loop_length(eqn) == 3


def test_while_adapter_reads_consts_and_programs():
    def f(x, w, limit):
        return jax.lax.while_loop(lambda c: c[0] < limit, lambda c: (c[0] + 1, c[1] @ w), (0, x))

    eqn = _eqn(f, X, W, jnp.int32(3), prim_kind="while")
    parts = boundary.while_parts(eqn.params)
    assert (parts.cond_nconsts, parts.body_nconsts) == (1, 1)
    assert _n_invars(parts.body_jaxpr) == 1 + 2 and _n_invars(parts.cond_jaxpr) == 1 + 2
    subs = boundary.subprograms(eqn)
    assert subs[boundary.while_body_index(eqn.params)] is parts.body_jaxpr
    assert boundary.loop_length(eqn) is None


@pytest.mark.parametrize("n_branches", [2, 3])
def test_cond_and_switch_adapter_reads_the_branches(n_branches):
    fns = [lambda x: x @ W, lambda x: -x, lambda x: x * 2][:n_branches]

    def f(i, x):
        return jax.lax.switch(i, fns, x) if n_branches == 3 else jax.lax.cond(i > 0, *fns, x)

    eqn = _eqn(f, jnp.int32(1), X, prim_kind="cond")
    branches = boundary.cond_branches(eqn.params)
    assert len(branches) == n_branches
    assert boundary.subprograms(eqn) == list(branches)
    assert all(_n_invars(b) == len(eqn.invars) - 1 for b in branches)  # operand 0: the index


def test_checkpoint_adapter_reads_program_and_options():
    policy = jax.checkpoint_policies.nothing_saveable
    f = jax.checkpoint(lambda x: jnp.sin(x @ W), prevent_cse=False, policy=policy)
    eqn = _eqn(f, X, prim_kind="checkpoint")
    prog, prevent_cse, got_policy = boundary.checkpoint_parts(eqn.params)
    assert prevent_cse is False and got_policy is policy
    assert _n_invars(prog) == len(eqn.invars)


def test_jit_adapter_reads_program_and_name():
    def outer(x):
        return jax.jit(inner_fn)(x)

    def inner_fn(x):
        return x @ W

    eqn = _eqn(outer, X, prim_kind="jit")
    assert boundary.call_name(eqn) == "inner_fn"
    assert _n_invars(boundary.call_program(eqn)) == len(eqn.invars)


def test_closed_call_adapter_and_the_bind_protocol():
    prog = jax.make_jaxpr(lambda y: y @ W)(X)
    call_p = jex.core.primitives.closed_call_p  # named eval_jaxpr at JAX's head: same object
    eqn = _eqn(lambda x: boundary.bind(call_p, {"call_jaxpr": prog}, x), X, prim_kind="call")
    inner = boundary.open_jaxpr(boundary.call_program(eqn))[0]
    assert len(inner.invars) == len(eqn.invars)  # tracing made W an operand of the call
    assert [e.primitive.name for e in inner.eqns] == ["dot_general"]
    assert boundary.call_name(eqn) == ""
    np.testing.assert_array_equal(boundary.bind(call_p, {"call_jaxpr": prog}, X)[0], X @ W)


def test_custom_jvp_and_custom_vjp_adapters_read_the_primal_program():
    @jax.custom_jvp
    def cj(x):
        return jnp.sin(x @ W)

    cj.defjvp(lambda p, t: (cj(p[0]), t[0]))

    @jax.custom_vjp
    def cv(x):
        return x @ W * 2

    cv.defvjp(lambda x: (cv(x), None), lambda _, g: (g,))
    for fn, k in ((cj, "custom_jvp"), (cv, "custom_vjp")):
        eqn = _eqn(fn, X, prim_kind=k)
        assert _n_invars(boundary.call_program(eqn)) == len(eqn.invars)
        prims = [e.primitive.name for e in boundary.open_jaxpr(boundary.call_program(eqn))[0].eqns]
        assert "dot_general" in prims


def test_combiners_are_operations_not_constructs():
    jaxpr = jax.make_jaxpr(lambda x: jax.lax.reduce(x, 0.0, lambda a, b: a + 2 * b, (0,)))(X)
    (red,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "reduce"]
    assert boundary.is_combiner(red) and boundary.subprograms(red) == []
    assert boundary.kind(red.primitive) is None


# --- replay of jax 0.11.2's recorded parameters ---------------------------------------------
class _FlatTreeLike:
    """What jax >= 0.11 puts in ``ft_in``: a flat tree whose ``unpack()`` gives the groups and
    whose ``len()`` counts leaves (its repr is the recorded tuple text)."""

    def __init__(self, tree):
        self.tree = tree

    def unpack(self):
        return tuple(_FlatTreeLike(t) for t in self.tree)

    def __len__(self):
        def count(t):
            return sum(count(x) for x in t) if isinstance(t, tuple) else 1

        return count(self.tree)


# The two scans of the recorded program (jaxpr_text): ``scan[...] b a`` (carry b, xs a) and
# ``scan[...] a 0:i32[] bv`` (const a, carry (counter, bv), no xs).
EXPECTED_SPLITS = [(0, 1), (1, 2)]


@pytest.mark.parametrize("i", [0, 1])
@pytest.mark.parametrize("form", ["recorded", "flattree"])
def test_replay_scan_ft_in_from_jax_0_11_2(i, form):
    rec = DATA["scans_in_jaxpr_text"][i]
    ft = ast.literal_eval(rec["ft_in"])
    params = {
        "ft_in": ft if form == "recorded" else _FlatTreeLike(ft),
        "ft_out": ast.literal_eval(rec["ft_out"]),
        "length": rec["length"], "reverse": False, "unroll": 1, "jaxpr": None,
    }  # fmt: skip
    split = boundary.scan_split(params)
    assert (split.n_consts, split.n_carry) == EXPECTED_SPLITS[i]
    n_xs = len(ft[2])
    assert split.n_consts + split.n_carry + n_xs == len(rec["body_invars"])
    assert split.length == rec["length"]
    if i == 1:  # the fori_loop counter is the first carry
        assert rec["body_invars"][split.n_consts].endswith(":i32[]")


def test_replay_first_recorded_scan_params_and_no_num_consts():
    params = DATA["primitive_params"]["scan"]
    assert "num_consts" not in params and "ft_in" in params
    keys = ("ft_in", "length", "reverse", "unroll")
    split = boundary.scan_split({**{k: ast.literal_eval(params[k]) for k in keys}, "jaxpr": None})
    assert (split.n_consts, split.n_carry, split.length, split.reverse) == (0, 1, 3, False)


def test_replay_every_recorded_higher_order_primitive_has_a_kind():
    recorded = DATA["primitive_params"]
    with_programs = sorted(
        name for name, params in recorded.items()
        if any(str(v).lstrip("(").startswith("{ lambda") for v in params.values())
    )  # fmt: skip
    assert with_programs == sorted(
        ["scan", "remat2", "cond", "while", "jit", "custom_vjp_call", "custom_jvp_call"]
    )
    by_name = {
        p.name: p
        for m in (jex.core.primitives, jax.lax)
        for p in vars(m).values()
        if isinstance(p, jex.core.Primitive)
    }
    for name in with_programs:
        # a primitive this JAX does not export (jit before 0.7) is known by its name
        prim = by_name.get(name) or jex.core.Primitive(name)
        kind = boundary.kind(prim)
        assert kind is not None, name
        programs = [k for k, v in recorded[name].items() if v.lstrip("(").startswith("{ lambda")]
        if kind in boundary.CALLS:  # call_program needs exactly one program parameter
            assert len(programs) == 1, (name, programs)
    # scan's split is in ft_in/ft_out now; the other constructs keep the keys the adapters read
    assert {"ft_in", "ft_out", "length", "reverse", "unroll", "jaxpr"} == set(recorded["scan"])
    assert {"cond_nconsts", "body_nconsts", "cond_jaxpr", "body_jaxpr"} <= set(recorded["while"])
    assert {"jaxpr", "prevent_cse", "policy"} <= set(recorded["remat2"])
    assert "branches" in recorded["cond"]


class _OneMinusSquare:
    """A stand-in for jax 0.11.2's ``one_minus_square`` (recorded with no parameters, in the
    gradient of tanh): a primitive emulate has no rule of its own for."""

    prim = jex.core.Primitive("one_minus_square")
    prim.def_impl(lambda x: 1 - x * x)
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(prim, mlir.lower_fun(lambda x: 1 - x * x, multiple_results=False))


def test_replay_one_minus_square_is_rounded_by_the_generic_rule():
    assert DATA["primitive_params"]["one_minus_square"] == {}
    x = jnp.array([1.0039062, 0.3, 0.7777, 1e-3], jnp.float32)
    em = emulate(lambda v: _OneMinusSquare.prim.bind(v), "c=bf16")
    assert [s.primitive for s in em.sites(x)] == ["one_minus_square"]
    got = np.asarray(jax.jit(em)(x))
    xb = np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float64)  # operand rounded
    want = (1 - xb * xb).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, np.asarray(1 - x * x))  # it was rounded


# --- an unknown higher-order primitive fails loudly -----------------------------------------
_hop = jex.core.Primitive("mystery_call")
_hop.multiple_results = True
_hop.def_impl(lambda *a, program: boundary.jaxpr_as_fun(*boundary.open_jaxpr(program))(*a))
_hop.def_abstract_eval(lambda *a, program: program.out_avals)


def _with_mystery(x):
    prog = jax.make_jaxpr(lambda v: jnp.tanh(v @ W))(x)
    return _hop.bind(x, program=prog)[0] + 1


class _Double:
    primitives = ("dot_general",)

    def apply(self, ctx, lhs, rhs, **params):
        return [o * 2 for o in ctx.original(lhs, rhs)]


def test_selected_matmul_inside_an_unknown_primitive_raises_naming_everything():
    f = intercept(_with_mystery, _Double())
    (site,) = f.sites(X)  # listed, with the primitive it sits in
    assert site.within == ("mystery_call",)
    with pytest.raises(boundary.UnsupportedPrimitive) as err:
        f(X)
    msg = str(err.value)
    assert "dot_general[0]" in msg and "'mystery_call'" in msg
    assert f"jax {jax.__version__}" in msg and "exclude" in msg and "\n" not in msg
    # the advice works: excluded, it runs as the program did
    kept = intercept(_with_mystery, _Double(), exclude="dot_general[0]")
    np.testing.assert_allclose(kept(X), _with_mystery(X), rtol=1e-6)


def test_emulate_refuses_an_unknown_primitive_by_name():
    with pytest.raises(boundary.UnsupportedPrimitive, match="mystery_call"):
        emulate(_with_mystery, "c=bf16")(X)


# --- bind protocols, plain rewrite, version ---------------------------------------------------
class _TupleBindPrimitive(jex.core.Primitive):
    """A primitive with the pre-0.9.2 protocol: ``get_bind_params`` returns (subfuns, params)."""

    def get_bind_params(self, params):
        return [], dict(params)


def test_bind_accepts_both_get_bind_params_forms():
    old = _TupleBindPrimitive("scale_old")
    new = jex.core.Primitive("scale_new")
    for p in (old, new):
        p.def_impl(lambda x, factor: x * factor)
        p.def_abstract_eval(lambda x, factor: jax.core.ShapedArray(x.shape, x.dtype))
        assert boundary.bind(p, {"factor": 3.0}, X)[0].tolist() == (X * 3).tolist()


def test_split_leaves_passes_arrays_and_closes_over_the_rest():
    """The arrays of positional and keyword arguments become the arguments of the split
    function (flattening order); numbers and functions stay constants; ``dynamic`` chooses."""

    def fn(w, cfg, *, x, act):
        return act(x @ w) * cfg["scale"]

    args, kwargs = (W, {"scale": 2.0}), {"x": X, "act": jnp.tanh}
    flat, values = boundary.split_leaves(fn, args, kwargs)
    assert [v is a for v, a in zip(values, (W, X), strict=True)] == [True, True]
    np.testing.assert_array_equal(flat(W * 0, X), jnp.zeros((2, 4)))
    np.testing.assert_array_equal(flat(*values), fn(*args, **kwargs))
    flat2, values2 = boundary.split_leaves(fn, args, kwargs, lambda v: isinstance(v, float))
    assert values2 == [2.0] and float(flat2(0.5)[0, 1]) == float(jnp.tanh(X @ W)[0, 1] * 0.5)


class _PlainDouble(_Double):
    emits = False


def test_plain_rule_rewrites_loops_by_type_without_adapters(monkeypatch):
    def f(x, ws):
        y, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)
        y = jax.checkpoint(lambda v: v @ W)(y)
        return jax.lax.cond(y.sum() > 0, lambda v: v @ W, lambda v: -v, y)

    ws = jnp.stack([W, W])

    def want(x):
        for w in ws:
            x = jnp.tanh(2 * (x @ w))
        x = 2 * (x @ W)
        return 2 * (x @ W) if x.sum() > 0 else -x

    def forbidden(*a, **k):
        raise AssertionError("a per-primitive adapter ran")

    for name in ("scan_split", "while_parts", "cond_branches", "checkpoint_parts"):
        monkeypatch.setattr(boundary, name, forbidden)
    g = intercept(f, _PlainDouble())
    np.testing.assert_allclose(g(X, ws), want(X), rtol=1e-5)
    prims = {e.primitive.name for e in jax.make_jaxpr(g)(X, ws).jaxpr.eqns}
    assert {"scan", "cond"} <= prims  # the primitives were bound again, not inlined


def test_unsupported_jax_version_says_the_range_in_one_line(monkeypatch):
    with pytest.raises(RuntimeError) as err:
        boundary.check_version("0.4.30")
    msg = str(err.value)
    assert "\n" not in msg and f">= {boundary.LOWEST}" in msg and "0.4.30" in msg
    boundary.check_version(boundary.LOWEST)  # the floor itself is accepted
    boundary.check_version(jax.__version__)
    # the first use of the library says it
    monkeypatch.setattr(jax, "__version__", "0.4.1")
    with pytest.raises(RuntimeError, match=re.escape(f"jax >= {boundary.LOWEST}")):
        intercept(lambda x: x @ W, _Double())(X)


def test_declared_floor_matches_pyproject_and_this_jax():
    import tomllib

    pyproject = pathlib.Path(__file__).parents[2] / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    assert f"jax>={boundary.LOWEST}" in deps and f"jaxlib>={boundary.LOWEST}" in deps
    version = tuple(int(p) for p in re.findall(r"\d+", jax.__version__)[:3])
    assert version >= tuple(int(p) for p in boundary.LOWEST.split("."))


def test_matmul_in_a_while_condition_is_replaced_or_refused_never_skipped():
    def f(x):
        return jax.lax.while_loop(lambda c: (c @ W).sum() < 10, lambda c: c * 1.5 + 0.1, x)

    def want(x, factor):
        while (factor * (x @ W)).sum() < 10:
            x = x * 1.5 + 0.1
        return x

    assert not np.allclose(want(X, 2.0), want(X, 1.0))  # the replacement changes the result
    np.testing.assert_allclose(intercept(f, _PlainDouble())(X), want(X, 2.0), rtol=1e-6)
    with pytest.raises(NotImplementedError, match=r"dot_general\[0\] sits in a while_loop's"):
        intercept(f, _Double())(X)


# --- primitive names are spelled only in the boundary module --------------------------------
PACKAGE = pathlib.Path(__file__).parent.parent / "precisionlab"
#: Attributes that hold a primitive (``eqn.primitive``), its name (``site.primitive``), the
#: names a rule acts on or lists (``primitives``, ``candidates``) or a site's enclosing
#: constructs (``within``, ``loops``).
_CARRIERS = frozenset({"primitive", "primitives", "candidates", "within", "loops"})
#: (module, literal): why a primitive's name may be spelled there. Empty: none is needed.
ALLOWED: dict[tuple[str, str], str] = {}


def _literals(node) -> list:
    """The string constants of a literal, of a tuple/list/set literal (or ``frozenset(...)``
    of one) and of a dict literal's keys."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
        return _literals(node.args[0]) if node.func.id in ("frozenset", "set", "tuple") else []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [c for e in node.elts for c in _literals(e)]
    if isinstance(node, ast.Dict):
        return [c for k in node.keys if k is not None for c in _literals(k)]
    return []


def _holds_primitive(node, names: set[str]) -> bool:
    """Whether an expression holds a primitive, a primitive's name or a site's constructs:
    ``eqn.primitive``, ``eqn.primitive.name``, ``site.within``, ``boundary.kind(...)``, a
    variable assigned one of those (``names``)."""
    if isinstance(node, ast.Attribute):
        return node.attr in _CARRIERS or (
            node.attr == "name" and _holds_primitive(node.value, names)
        )
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "kind":
            return isinstance(f.value, ast.Name) and f.value.id == "boundary"
        if isinstance(f, ast.Name) and f.id in ("set", "frozenset", "tuple", "str"):
            return any(_holds_primitive(a, names) for a in node.args)
    return False


def _assigned_primitives(nodes: list) -> set[str]:
    """The variables of a scope that hold a primitive or its name (to a fixed point)."""
    names: set[str] = set()
    while True:
        before = len(names)
        for node in nodes:
            pairs = []
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    v = node.value
                    if isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple):
                        pairs += list(zip(t.elts, v.elts, strict=False))
                    else:
                        pairs.append((t, v))
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                pairs.append((node.target, node.value))
            elif isinstance(node, (ast.For, ast.comprehension)):
                pairs.append((node.target, node.iter))
            names |= {
                t.id for t, v in pairs if isinstance(t, ast.Name) and _holds_primitive(v, names)
            }
        if len(names) == before:
            return names


def primitive_name_uses(source: str, primitive_names) -> list[tuple[int, str, str]]:
    """(line, literal, how) for every string equal to a primitive's name that ``source``
    compares with a primitive's name, declares as a rule's ``primitives``/``candidates``, or
    assigns as a table of primitive names (at least two names, 80% of its entries)."""
    nodes = list(ast.walk(ast.parse(source)))
    held = _assigned_primitives(nodes)  # by name, module-wide: a name means one thing here
    out = set()
    for node in nodes:
        if (  # a site's name matched by its primitive: name.startswith("dot_general[")
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")
        ):
            for c in (c for a in node.args for c in _literals(a)):
                if c.value.rstrip("[") in primitive_names:
                    out.add((c.lineno, c.value, "a site's name matched by its primitive"))
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if any(_holds_primitive(s, held) for s in sides):
            for c in (c for s in sides for c in _literals(s)):
                if c.value in primitive_names:
                    out.add((c.lineno, c.value, "compared with a primitive's name"))
    for node in nodes:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        target_names = {getattr(t, "id", None) or getattr(t, "attr", None) for t in targets}
        lits = _literals(node.value)
        hits = [c for c in lits if c.value in primitive_names]
        if target_names & {"primitives", "candidates"}:
            out |= {(c.lineno, c.value, "a rule's primitives") for c in hits}
        elif len(hits) >= 2 and len(hits) >= 0.8 * len(lits):
            out |= {(c.lineno, c.value, "a table of primitive names") for c in hits}
    return sorted(out)


@pytest.fixture(scope="module")
def primitive_names():
    # every primitive of this JAX (the modules that define them are loaded by then) and the
    # construct kinds a site's ``within`` holds
    import precisionlab.emulate  # noqa: F401  (loads the JAX modules a program can use)

    return boundary.primitive_names() | set(boundary.KINDS)


def test_the_checker_finds_each_way_of_spelling_a_primitive_name(primitive_names):
    source = (
        "def f(eqn, site):\n"
        "    name = eqn.primitive.name\n"
        "    if name in ('mul', 'div'):\n"  # 2: through a variable
        "        return eqn.primitive.name == 'tanh'\n"  # 1: directly
        "    return 'while' not in site.within\n"  # 1: a construct kind
        "class Rule:\n"
        "    primitives = ('dot_general',)\n"  # 1: a rule's selection
        "_TABLE = frozenset({'exp', 'log', 'sin', 'cos', 'gone_p'})\n"  # 4 (and one gone)
        "MODES = ('floor', 'ceil', 'rceil', 'even')\n"  # not a table of primitives
        "def g(how, site):\n"
        "    return how == 'max' or site.startswith('exp[')\n"  # 1: a site's name; 'max' not
    )
    got = [(line, lit) for line, lit, _ in primitive_name_uses(source, primitive_names)]
    assert got == [(3, "div"), (3, "mul"), (4, "tanh"), (5, "while"), (7, "dot_general"),
                   (8, "cos"), (8, "exp"), (8, "log"), (8, "sin"), (11, "exp[")]  # fmt: skip


def test_primitive_names_are_spelled_only_in_the_boundary_module(primitive_names):
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE.parent).as_posix()
        if module == "precisionlab/intercept/_boundary.py":
            continue
        for line, lit, how in primitive_name_uses(path.read_text(), primitive_names):
            if (module, lit) not in ALLOWED:
                found.append(f"{module}:{line}: {lit!r} ({how})")
    assert not found, "use precisionlab.intercept._boundary's names:\n" + "\n".join(found)


def _kind_examples() -> list:
    """The higher-order primitives of a program with one construct of each kind."""

    @jax.custom_jvp
    def cj(x):
        return jnp.sin(x)

    cj.defjvp(lambda p, t: (cj(p[0]), t[0]))

    @jax.custom_vjp
    def cv(x):
        return x * 2

    cv.defvjp(lambda x: (cv(x), None), lambda _, g: (g,))
    call_p = jex.core.primitives.closed_call_p
    prog = jax.make_jaxpr(lambda y: y * 3)(X)

    def f(x):
        x = jax.jit(lambda v: v + 1)(x) + cj(x) + cv(x)
        x = boundary.bind(call_p, {"call_jaxpr": prog}, x)[0]
        x = jax.checkpoint(jnp.tanh)(x)
        x = jax.lax.scan(lambda c, _: (c * 2, None), x, None, length=2)[0]
        x = jax.lax.while_loop(lambda c: c.sum() < 100, lambda c: c * 2, x)
        return jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x)

    return [e.primitive for e in jax.make_jaxpr(f)(X).jaxpr.eqns if boundary.subprograms(e)]


#: Names in the vocabulary that a supported JAX (jax 0.6.2 up to 0.11) may lack: primitives
#: added, renamed or removed within that range (``copy`` was ``copy_p``, ``ragged_dot`` became
#: ``ragged_dot_general``, ``mesh_cast``, ``reshard``, ``pvary`` and ``split`` came with the
#: sharding and splitting work). Any other name must be a primitive of the JAX running.
OTHER_VERSIONS = {"copy", "copy_p", "mesh_cast", "reshard", "pvary", "split", "ragged_dot",
                  "ragged_dot_general"}  # fmt: skip


def test_the_vocabulary_names_primitives_of_this_jax(primitive_names):
    single = [boundary.DOT_GENERAL, boundary.CONV, *boundary.ARITHMETIC, boundary.REDUCE_SUM,
              boundary.CONVERT, boundary.LOGISTIC, boundary.TANH, boundary.ERF, boundary.EXP,
              boundary.INTEGER_POW]  # fmt: skip
    groups = [boundary.PRODUCTS, boundary.RAGGED_PRODUCTS, boundary.POWERS, boundary.ROOTS,
              boundary.EXPONENTIALS, boundary.LOGARITHMS, boundary.TRANSCENDENTAL,
              boundary.VIEWS, boundary.EXACT]  # fmt: skip
    assert set(single) <= primitive_names
    missing = {n for g in groups for n in g} - primitive_names
    assert missing <= OTHER_VERSIONS, missing
    # the kinds are those kind() returns, and each is a construct of this JAX
    assert set(boundary.KINDS) == {boundary.kind(p) for p in _kind_examples()}
    assert boundary.CALLS | set(boundary.LOOPS) | boundary.CONDITIONAL <= set(boundary.KINDS)
    # each function is the one its primitive computes: the name is lax's function's primitive
    x = np.array([0.5, 0.25, 1.5], np.float32)
    for name, f in boundary.TRANSCENDENTAL.items():
        fn = getattr(jax.lax, name)
        (eqn,) = jax.make_jaxpr(fn)(x).jaxpr.eqns
        assert eqn.primitive.name == name
        with np.errstate(invalid="ignore"):  # NaN outside the domain (acosh(0.5)), as jax's
            want = f(x.astype(np.float64))
        np.testing.assert_allclose(want, fn(x), rtol=1e-5, err_msg=name)
