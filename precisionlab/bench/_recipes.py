"""``precisionlab bench recipes``: a transformer step under each matmul recipe, as ratios.

Times one forward+backward step (``jax.value_and_grad`` of the loss, jitted) of a small
decoder-only transformer written here in plain JAX, with every matmul (projections, MLP,
attention products, logits) quantized by each recipe through ``precisionlab.recipes.apply``,
against the same step with the ``bf16`` and ``fp32`` reference recipes (same code path,
no quantization) and the plain float32 step without interception (``plain``), in
alternating rounds. Peak memory is XLA's estimate for the compiled step (``memory_analysis()``:
arguments + outputs + temporaries - aliased). Block recipes run with ``pad=True`` (the
attention head size need not be a multiple of the block).

Where the bench's own time went (tracing and lowering, compiling, timing, and the programs
loaded from JAX's persistent compilation cache) is printed under the table. The cache is on
by default, as for ``precisionlab run`` (``--cache-dir``, ``--no-cache``): compiling the
recipes' programs is most of a first run's time, and a rerun loads them (the same
executables, so the same step times).

``--accumulator`` prints instead the relative error of an emulated m-bit accumulator against
float64, for K from 512 to 16384, with and without promotion to float32 every 128 products.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from precisionlab import recipes as R
from precisionlab._text import UsageError, split_list
from precisionlab.bench._output import cpu_name, print_result, rows_text
from precisionlab.bench._timing import positive_int, repeats_int, time_interleaved
from precisionlab.recipes import RECIPE_NAMES, FP4Recipe, accumulate, get_recipe
from precisionlab.train._compile_cache import OFF, enable_compilation_cache
from precisionlab.train._timing import CompileMeter

HELP = "transformer step time and peak memory under each matmul recipe vs bf16/fp32 (ratios)"

DEFAULT_RECIPES = (
    "plain", "fp32", "bf16", "current", "delayed", "rowwise", "rowwise_with_gw_hp", "blockwise",
    "mxfp8", "mxfp4", "nvfp4",
)  # fmt: skip
_PADDED = ("blockwise", "mxfp8", "mxfp6", "mxfp4", "nvfp4")
_TARGET = {"current": 1.5, "delayed": 1.5, "rowwise": 1.5, "rowwise_with_gw_hp": 1.5}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipes", help=f"comma-separated (default: {','.join(DEFAULT_RECIPES)})")
    add_model_arguments(
        parser, ModelSize(batch=8, seq=128, d_model=256, layers=2, heads=4, vocab=512)
    )
    parser.add_argument("--repeats", type=repeats_int, default=5, help="timed rounds (best of)")
    parser.add_argument(
        "--accumulator", action="store_true",
        help="print the accumulator error-vs-K table instead of step times",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--cache-dir", metavar="DIR",
        help="JAX's persistent compilation cache (default $PRECISIONLAB_CACHE_DIR, else "
        "~/.cache/precisionlab/jax): a rerun loads the recipes' programs instead of compiling",
    )  # fmt: skip
    parser.add_argument(
        "--no-cache", action="store_true", help="no persistent compilation cache for this run"
    )


# --- model ---------------------------------------------------------------------------------
class ModelSize(NamedTuple):
    """The size of this module's transformer LM and of its batch (counts): ``batch``
    sequences of ``seq`` tokens, width ``d_model``, ``layers`` blocks of ``heads`` attention
    heads, a ``vocab``-token vocabulary. Each is the option of the same name (``--d-model``)."""

    batch: int
    seq: int
    d_model: int
    layers: int
    heads: int
    vocab: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelSize:
        """The size the options of :func:`add_model_arguments` give."""
        return cls(*(getattr(args, field) for field in cls._fields))

    def inputs(self) -> tuple[dict, jax.Array]:
        """The model's float32 parameters (key 0) and a batch of int32 tokens (key 1)."""
        params = init_params(
            jax.random.key(0), d=self.d_model, layers=self.layers, vocab=self.vocab, seq=self.seq
        )
        tokens = jax.random.randint(
            jax.random.key(1), (self.batch, self.seq), 0, self.vocab, jnp.int32
        )
        return params, tokens


#: What each :class:`ModelSize` option counts, for its help.
_SIZE_HELP = {
    "batch": "sequences per step",
    "seq": "tokens per sequence",
    "d_model": "model width",
    "layers": "transformer blocks",
    "heads": "attention heads",
    "vocab": "vocabulary",
}


def add_model_arguments(parser: argparse.ArgumentParser, defaults: ModelSize) -> None:
    """The options that size this module's transformer LM and its batch (``--batch``,
    ``--seq``, ``--d-model``, ``--layers``, ``--heads``, ``--vocab``), with these defaults."""
    for field, default in defaults._asdict().items():
        parser.add_argument(
            "--" + field.replace("_", "-"),
            type=positive_int,
            default=default,
            help=f"{_SIZE_HELP[field]} (default {default})",
        )


def init_params(key: jax.Array, *, d: int, layers: int, vocab: int, seq: int) -> dict:
    """float32 parameters of a pre-LayerNorm decoder (4x MLP, learned positions)."""
    ks = iter(jax.random.split(key, 4 + 4 * layers))

    def dense(i: int, o: int) -> jax.Array:
        return jax.random.normal(next(ks), (i, o), jnp.float32) / np.sqrt(i)

    blocks = [
        {"qkv": dense(d, 3 * d), "out": dense(d, d), "up": dense(d, 4 * d), "down": dense(4 * d, d)}
        for _ in range(layers)
    ]
    return {
        "embed": jax.random.normal(next(ks), (vocab, d), jnp.float32) * 0.02,
        "pos": jax.random.normal(next(ks), (seq, d), jnp.float32) * 0.02,
        "blocks": blocks,
        "head": dense(d, vocab),
    }


def _norm(x: jax.Array) -> jax.Array:
    mu = jnp.mean(x, -1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(jnp.var(x, -1, keepdims=True) + 1e-5)


def loss_fn(params: dict, tokens: jax.Array, *, heads: int) -> jax.Array:
    """Next-token cross-entropy (float32 scalar) of int32 tokens (B, T)."""
    b, t = tokens.shape
    x = params["embed"][tokens] + params["pos"][:t]
    d = x.shape[-1]
    mask = jnp.tril(jnp.ones((t, t), bool))
    for blk in params["blocks"]:
        q, k, v = jnp.split(_norm(x) @ blk["qkv"], 3, axis=-1)
        q, k, v = (z.reshape(b, t, heads, d // heads) for z in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
        x = x + y @ blk["out"]
        x = x + jax.nn.gelu(_norm(x) @ blk["up"]) @ blk["down"]
    logits = _norm(x) @ params["head"]
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


# --- measurement ---------------------------------------------------------------------------
def _peak_bytes(compiled: jax.stages.Compiled) -> int | None:
    m = compiled.memory_analysis()
    if m is None:
        return None
    return int(
        m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )  # fmt: skip


PLAIN = "plain"  # the loss differentiated as written: no interception, float32


def _step(name: str, heads: int) -> tuple[jax.stages.Wrapped, Any]:
    if name == PLAIN:
        vg = jax.value_and_grad(lambda p, tok: loss_fn(p, tok, heads=heads))

        class _Plain:
            def init_state(self, *a: Any) -> dict:
                return {}

            def sites(self, *a: Any) -> list:
                return []

        return jax.jit(lambda st, p, tok, key: vg(p, tok)), _Plain()

    kw = {"pad": True} if name in _PADDED else {}
    f = R.apply(lambda p, tok: loss_fn(p, tok, heads=heads), R.get_recipe(name, **kw))
    rvg = f.value_and_grad()
    return jax.jit(lambda st, p, tok, key: rvg(st, p, tok, key=key)), f


def _compile_workers() -> int:
    """Threads that compile at once: ``PRECISIONLAB_COMPILE_THREADS``, else the CPU count."""
    env = os.environ.get("PRECISIONLAB_COMPILE_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else os.cpu_count() or 1


def measure(
    names: Sequence[str], size: ModelSize, *, repeats: int, phases: dict | None = None
) -> list[dict]:
    """One row per recipe for the model of ``size`` (see the module docstring). ``phases``, if
    given, receives the
    seconds of tracing and lowering (``trace_s``, the first programs compiling meanwhile), of
    the wait for the rest of compilation (``compile_s``) and of timing (``timing_s``), and the
    ``programs`` compiled or loaded with the ``cache_hits`` among them."""
    clock = time.perf_counter()
    params, tokens = size.inputs()
    key = jax.random.key(2)
    fns, peaks, matched, states, pending = {}, {}, {}, {}, {}
    # Tracing holds the Python lock, so the recipes are traced one at a time; XLA compiles
    # outside it, so each program compiles in a thread (side by side with the next traces).
    with CompileMeter() as meter, ThreadPoolExecutor(max_workers=_compile_workers()) as pool:
        for name in names:
            step, f = _step(name, size.heads)
            states[name] = f.init_state(params, tokens)
            pending[name] = pool.submit(step.lower(states[name], params, tokens, key).compile)
            matched[name] = sum(s.selected for s in f.sites(params, tokens))
        traced = time.perf_counter()
        done = {name: job.result() for name, job in pending.items()}
    compiled_at = time.perf_counter()
    for name, compiled in done.items():
        peaks[name] = _peak_bytes(compiled)
        fns[name] = lambda c=compiled, s=states[name]: c(s, params, tokens, key)
    t = time_interleaved(fns, repeats=repeats)
    if phases is not None:
        phases.update(
            trace_s=traced - clock, compile_s=compiled_at - traced,
            timing_s=time.perf_counter() - compiled_at, programs=meter.programs,
            cache_hits=meter.cache_hits,
        )  # fmt: skip
    bf16 = t["bf16"].best if "bf16" in t else None
    fp32 = t["fp32"].best if "fp32" in t else None
    mem16 = peaks.get("bf16")
    out = []
    for name in names:
        peak = peaks[name]
        row = {
            "recipe": name,
            "matmuls": matched[name],
            "step_ms": t[name].best * 1e3,
            "vs_bf16": t[name].best / bf16 if bf16 else None,
            "vs_fp32": t[name].best / fp32 if fp32 else None,
            "peak_mib": peak / 2**20 if peak is not None else None,
            "peak_vs_bf16": peak / mem16 if (peak and mem16) else None,
        }
        row["time_target"] = None if name in ("bf16", "fp32", PLAIN) else _target(name)
        out.append(row)
    return out


def _target(name: str) -> float:
    """The step time a recipe should stay within, as a multiple of bf16's: 1.5 for the
    per-tensor and per-row FP8 recipes, 3 for the published FP4 training recipes (the FP4
    tournament's bound), 2 for the others."""
    if isinstance(get_recipe(name), FP4Recipe):
        return 3.0
    return _TARGET.get(name, 2.0)


def accumulator_table(
    ks: Sequence[int] = (512, 1024, 2048, 4096, 8192, 16384), bits: int = 14, promote: int = 128,
    rows: int = 16, seed: int = 0,
) -> list[dict]:  # fmt: skip
    """Relative error ||C_m - C||_F / ||C||_F of a ``bits``-bit accumulator against float64
    for (rows x K) @ (K x rows) products of E4M3-rounded standard normals, per rounding mode
    and with/without promotion every ``promote`` products."""
    rng = np.random.default_rng(seed)
    out = []
    for k in ks:
        a = rng.standard_normal((1, rows, k)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
        b = rng.standard_normal((1, rows, k)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
        a, b = a.astype(np.float32), b.astype(np.float32)
        exact = np.einsum("bmk,bnk->bmn", a.astype(np.float64), b.astype(np.float64))
        row: dict[str, float] = {"K": k}
        for mode in ("nearest_even", "toward_zero"):
            for every in (None, promote):
                got = np.asarray(accumulate(jnp.asarray(a), jnp.asarray(b), bits, mode, every))
                err = np.linalg.norm(got - exact) / np.linalg.norm(exact)
                row[f"{mode}{'' if every is None else f'+promote{every}'}"] = float(err)
        f32 = np.einsum("bmk,bnk->bmn", a, b, dtype=np.float32)
        row["float32"] = float(np.linalg.norm(f32 - exact) / np.linalg.norm(exact))
        out.append(row)
    return out


# --- CLI -----------------------------------------------------------------------------------
def _accumulator_text(rows: list[dict]) -> str:
    cols = [c for c in rows[0] if c != "K"]
    return "\n".join(
        [
            "relative error (Frobenius) of a 14-bit accumulator vs float64, E4M3 x E4M3 inputs",
            f"{'K':>6} " + " ".join(f"{c:>26}" for c in cols),
            *(f"{r['K']:>6} " + " ".join(f"{r[c]:>26.2e}" for c in cols) for r in rows),
        ]
    )


#: Most elements of one of the benchmark's tensors: past int32 indexing, and 8 GiB of float32.
_ELEMENTS_MAX = 2**31 - 1


def _check_sizes(args: argparse.Namespace) -> None:
    """UsageError when the flags ask for a tensor past :data:`_ELEMENTS_MAX` elements (a random
    init of over 2**64 bits, or an XLA shape overflow, was a traceback or an abort)."""
    b, t, d, v = args.batch, args.seq, args.d_model, args.vocab
    sizes = {
        "params (--layers x 12 x --d-model^2 + (2 x --vocab + --seq) x --d-model)": (
            args.layers * 12 * d * d + (2 * v + t) * d
        ),
        "activations (--batch x --seq x max(4 x --d-model, --vocab))": b * t * max(4 * d, v),
        "attention scores (--batch x --heads x --seq^2)": b * args.heads * t * t,
    }
    for what, n in sizes.items():
        if n > _ELEMENTS_MAX:
            raise UsageError(f"{what} = {n:,} elements; at most {_ELEMENTS_MAX:,} (2**31 - 1)")


def _render(rows: list[dict], args: argparse.Namespace, phases: dict, cache: Path | None) -> str:
    """:func:`measure`'s rows as a table under a heading naming the model and the machine, and
    where the bench's time went (``phases``; ``cache``: the compilation cache's directory)."""
    heading = (
        f"transformer step (fwd+bwd), {args.layers} layers, d={args.d_model}, batch "
        f"{args.batch}x{args.seq}, {jax.devices()[0].platform} ({cpu_name()}), best of "
        f"{args.repeats}, alternating"
    )
    head = (
        f"{'recipe':<20} {'matmuls':>7} {'step ms':>9} {'vs bf16':>8} {'vs fp32':>8} "
        f"{'peak MiB':>9} {'mem vs bf16':>11}"
    )

    def fmt(v: float | None, spec: str) -> str:
        return format(v, spec) if v is not None else "-"

    lines = [
        f"{r['recipe']:<20} {r['matmuls']:>7} {r['step_ms']:>9.1f} "
        f"{fmt(r['vs_bf16'], '>7.2f')}x {fmt(r['vs_fp32'], '>7.2f')}x "
        f"{fmt(r['peak_mib'], '>9.1f')} {fmt(r['peak_vs_bf16'], '>10.2f')}x"
        for r in rows
    ]
    p = phases
    bench_time = (  # two lines: the page's column is 100 wide
        f"bench time: tracing and lowering {p['trace_s']:.1f} s, then compiling "
        f"{p['compile_s']:.1f} s more, timing {p['timing_s']:.1f} s\n"
        f"  ({_compile_workers()} threads; {p['cache_hits']} of {p['programs']} programs "
        f"loaded from the cache{'' if cache is None else f' {cache}'})"
    )
    return "\n".join([heading, rows_text(head, lines), "", bench_time])


def run(args: argparse.Namespace) -> int:
    names = list(DEFAULT_RECIPES) if args.recipes is None else split_list(args.recipes)
    bad = [n for n in names if n not in (*RECIPE_NAMES, PLAIN)]
    allowed = f"allowed: {PLAIN}, {', '.join(RECIPE_NAMES)}"
    if not names:
        raise UsageError(f"--recipes: name at least one recipe; {allowed}")
    if bad:
        raise UsageError(f"unknown recipe {bad[0]!r}; {allowed}")
    if args.accumulator:
        if args.recipes is not None:  # the table is the recipes' shared accumulator model
            raise UsageError("--accumulator prints one table for every recipe; drop --recipes")
        print_result(accumulator_table(), args, _accumulator_text, indent=1)
        return 0
    _check_sizes(args)
    if args.d_model % args.heads:
        raise UsageError(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    if args.no_cache and args.cache_dir:
        raise UsageError("give either --cache-dir DIR or --no-cache, not both")

    cache = enable_compilation_cache(OFF if args.no_cache else args.cache_dir)
    phases: dict = {}
    rows = measure(names, ModelSize.from_args(args), repeats=args.repeats, phases=phases)
    print_result(rows, args, lambda r: _render(r, args, phases, cache), indent=1)
    return 0
