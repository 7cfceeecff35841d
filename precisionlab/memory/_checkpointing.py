"""The ``checkpointing`` experiment kind: activation checkpointing and gradient accumulation
measured on the built-in models' real train step, beside the estimator's figure.

For each model (a ``[train]`` table, run with ``scan_layers = true``) the train step is built
as :func:`precisionlab.train.train` builds it, compiled with its state donated, and XLA's
``memory_analysis().temp_size_in_bytes`` read (peak temporary bytes, decided before anything
runs: deterministic), then the step is timed (best of ``repeats`` on this machine):

- vs the checkpoint interval K (``remat_every``; 0 = no checkpointing is always measured);
- vs micro-batches M (gradient accumulation, no checkpointing).

The estimate beside each point is the estimator's checkpointing model: ``ceil(N/K)`` boundary
tensors (a group's input) plus K layers' saved activations (one group recomputed at a time),
N x layer without checkpointing; plus the step's other temporaries (float32 gradients, the
compute copy of the params, the micro-batch accumulator, logits and their float32 softmax). A
transformer layer's saved activations are the transformer-block count of
:func:`~precisionlab.memory._estimate.layer_activation_bytes` (what :func:`estimate` counts);
an MLP layer's three ``batch x width`` tensors (see :func:`~precisionlab.memory._builtin.
activation_bytes`).

A ``[checkpointing]`` table (all keys optional)::

    [checkpointing]
    remat_every = [1, 2, 4, 6, 8, 16, 32]   # K (capped at the stacked layer count)
    remat_policy = "nothing_saveable"
    microbatches = [1, 2, 4, 8]              # each must divide the model's batch_size
    repeats = 3                              # timed steps per point (best of); 0: no timing
    plots = true
    [checkpointing.models.transformer]       # name -> a [train] table; default: DEFAULT_MODELS
    model = "transformer"
    ...

``run`` writes ``rows.jsonl`` (one object per measured point, flushed as produced),
``checkpointing.json`` (the summary), ``summary.txt`` (the tables) and one PNG per model.
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from precisionlab import _io
from precisionlab._schema import Field, validate_table, with_docs
from precisionlab._text import table as text_table
from precisionlab.memory._builtin import example_batch, param_count, transformer_spec
from precisionlab.memory._estimate import layer_activation_bytes
from precisionlab.train import TrainConfig, build, build_step
from precisionlab.train._layers import remat_policy

__all__ = [
    "DEFAULT_MODELS",
    "FIELDS",
    "KIND",
    "checkpointed_bytes",
    "layer_bytes",
    "measure_point",
    "run",
    "validate",
]

KIND = "checkpointing"

#: Two 32-layer models: a transformer (a layer keeps ~45 boundary-sized tensors: the least
#: memory is at small K) and a wide-batch MLP (a layer keeps about two: least near sqrt(N)).
DEFAULT_MODELS: dict[str, dict[str, Any]] = {
    "transformer": {
        "model": "transformer",
        "model_kwargs": {"depth": 32, "d_model": 64, "heads": 4},
        "data": "markov",
        "data_kwargs": {"seq_len": 64},
        "batch_size": 8,
    },
    "mlp": {
        "model": "mlp",
        "model_kwargs": {"depth": 33, "width": 64},
        "data": "teacher",
        "batch_size": 2048,
    },
}

FIELDS: dict[str, Field] = {
    "remat_every": Field(list, [1, 2, 4, 6, 8, 16, 32], item=int),
    "remat_policy": Field(str, "nothing_saveable"),
    "microbatches": Field(list, [1, 2, 4, 8], item=int),
    "repeats": Field(int, 3, low=0, high=1000, why="1000 timed steps"),
    "plots": Field(bool, True),
    "models": Field(dict, {}, doc="name -> a [train] table"),
}
FIELDS = with_docs(
    FIELDS,
    {
        "remat_every": "checkpoint intervals K measured (capped at the stacked layer count)",
        "remat_policy": "what a checkpointed group saves",
        "microbatches": "micro-batch counts measured (each must divide the model's batch_size)",
        "repeats": "timed steps per point (best of); 0: no timing",
        "plots": "write one PNG per model",
    },
)


def _config(table: dict[str, Any], where: str, **overrides: Any) -> Any:
    return TrainConfig.from_dict({**table, "steps": 1, "scan_layers": True, **overrides}, where)


def validate(section: dict, where: str) -> dict:
    """The ``[checkpointing]`` table with defaults filled in; ValueError naming ``where`` and the
    key for an unknown key, a bad value, a bad ``[train]`` table, a K < 1 or an M that does not
    divide a model's batch size."""
    out = validate_table(section, FIELDS, where)
    try:
        remat_policy(out["remat_policy"])
    except ValueError as err:
        raise ValueError(f"{where}.remat_policy: {err}") from None
    models = out["models"] or copy.deepcopy(DEFAULT_MODELS)
    for i, k in enumerate(out["remat_every"]):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"{where}.remat_every[{i}]: expected an int >= 1, got {k!r}")
    if not out["microbatches"]:
        out["microbatches"] = [1]
    for name, table in models.items():
        if not isinstance(table, dict):
            raise ValueError(f"{where}.models.{name}: expected a [train] table, got {table!r}")
        cfg = _config(table, f"{where}.models.{name}")
        for i, m in enumerate(out["microbatches"]):
            if isinstance(m, bool) or not isinstance(m, int) or m < 1 or cfg.batch_size % m:
                raise ValueError(
                    f"{where}.microbatches[{i}]: expected an int >= 1 dividing "
                    f"{name}'s batch_size={cfg.batch_size}, got {m!r}"
                )
    out["models"] = models
    out["remat_every"] = list(out["remat_every"])
    out["microbatches"] = list(out["microbatches"])
    return out


def checkpointed_bytes(n_layers: int, boundary: int, layer: int, k: int) -> int:
    """Activation bytes of N layers checkpointed every K (0: off), the estimator's model:
    ``ceil(N/K) * boundary + K * layer`` (``N * layer`` without checkpointing)."""
    if not k:
        return n_layers * layer
    k = min(k, n_layers)
    return math.ceil(n_layers / k) * boundary + k * layer


def layer_bytes(model: Any, micro: int, policy: Any) -> tuple[int, int]:
    """(boundary, saved) bytes of one stacked layer for ``micro`` examples: the layer's input,
    and what the estimator counts it saves for the backward pass."""
    e = np.dtype(policy.compute_dtype).itemsize
    if model.name == "transformer":
        return layer_activation_bytes(
            transformer_spec(model), batch=micro, seq=model.seq_len, dtype=policy.compute_dtype
        )
    return micro * model.width * e, 3 * micro * model.width * e


def _estimate(setup: Any, k: int, m: int) -> dict[str, int]:
    model, policy = setup.model, setup.policy
    micro = setup.config.batch_size // m
    n_stacked = model.depth if model.name == "transformer" else model.depth - 1
    boundary, layer = layer_bytes(model, micro, policy)
    acts = checkpointed_bytes(n_stacked, boundary, layer, k)
    if model.name == "mlp":
        acts += layer  # the first layer (in_dim -> width) runs unrolled, outside the scan
    n = param_count(model)
    e = np.dtype(policy.compute_dtype).itemsize
    mixed = policy.compute_dtype != policy.param_dtype
    per_example = model.seq_len * model.vocab_size if model.name == "transformer" else 1
    classes = 1 if model.name == "transformer" else model.num_classes
    logits = micro * per_example * classes * (e + 4)
    other = 4 * n + (n * e if mixed else 0) + (4 * n if m > 1 else 0) + logits
    return {"activations": acts, "other": other, "total": acts + other, "n_stacked": n_stacked}


def measure_point(table: dict[str, Any], *, remat_every: int, microbatches: int = 1,
                  remat_policy: str = "nothing_saveable", repeats: int = 0,
                  where: str = "train") -> dict[str, Any]:  # fmt: skip
    """Build, compile and (``repeats`` > 0) time the train step of the ``[train]`` ``table``
    with ``scan_layers``, ``remat_every`` and ``microbatches``; returns ``measured_temp``
    (XLA's temp_size_in_bytes), ``estimated_temp`` / ``estimated_activations`` (bytes),
    ``step_s`` (best of ``repeats``, None without) and ``compile_s``."""
    cfg = _config(
        table,
        where,
        remat_every=remat_every,
        remat_policy=remat_policy,
        microbatches=microbatches,
    )
    setup = build(cfg)
    fn, state, _ = build_step(setup.loss_fn, setup.params, setup.optimizer, setup.options)
    batch = example_batch(setup.model, cfg.batch_size)
    jitted = jax.jit(fn, donate_argnums=0)
    start = time.perf_counter()
    compiled = jitted.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    stats = compiled.memory_analysis()
    if stats is None:  # a backend that reports no buffer assignment
        raise ValueError(f"XLA gives no memory analysis on {jax.default_backend()}")
    temp = int(stats.temp_size_in_bytes)
    step_s = None
    if repeats:
        # Donation consumes the state: each call feeds the next (the first is a warm-up).
        state = jax.tree_util.tree_map(lambda a: a.copy(), state)
        state = jax.block_until_ready(compiled(state, batch)[0])
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            state = jax.block_until_ready(compiled(state, batch)[0])
            times.append(time.perf_counter() - t0)
        step_s = min(times)
    est = _estimate(setup, remat_every, microbatches)
    return {
        "measured_temp": temp,
        "estimated_temp": est["total"],
        "estimated_activations": est["activations"],
        "estimated_other": est["other"],
        "n_layers": est["n_stacked"],
        "step_s": step_s,
        "compile_s": compile_s,
        "backend": jax.default_backend(),
    }


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def run(section: dict, out_dir: Path, *, quiet: bool = False) -> dict:
    """Run the sweeps of a ``[checkpointing]`` table; returns the JSON-able summary."""
    cfg = validate(section, "checkpointing")
    out_dir = Path(out_dir)
    _io.makedirs(out_dir)
    say = (lambda *_: None) if quiet else print
    rows_file = _io.JsonlWriter(out_dir / "rows.jsonl")
    results: dict[str, Any] = {}
    texts = []
    try:
        for name, table in cfg["models"].items():
            where = f"checkpointing.models.{name}"
            rows = []
            n = None
            points = [("checkpoint", 0, 1)]
            points += [("microbatches", 0, m) for m in cfg["microbatches"] if m > 1]
            for sweep, k, m in points + [("checkpoint", k, 1) for k in cfg["remat_every"]]:
                if n is not None and k > n:
                    continue  # K beyond the stacked layers is K = N (measured if listed)
                got = measure_point(
                    table,
                    remat_every=k,
                    microbatches=m,
                    remat_policy=cfg["remat_policy"],
                    repeats=cfg["repeats"],
                    where=where,
                )
                n = got["n_layers"]
                row = {"model": name, "sweep": sweep, "k": k, "microbatches": m, **got}
                rows_file.write(row)
                rows.append(row)
                step = "" if got["step_s"] is None else f", {got['step_s'] * 1e3:.1f} ms/step"
                say(
                    f"{name} K={k or 'none':>4} M={m}: temp {_mib(got['measured_temp'])} MiB "
                    f"(estimate {_mib(got['estimated_temp'])} MiB){step}"
                )
            assert n is not None  # the first point always runs and sets it
            results[name] = _model_summary(rows, n)
            texts.append(_text(name, rows, results[name]))
    finally:
        rows_file.close()
    files = ["rows.jsonl", "checkpointing.json", "summary.txt"]
    _io.write_text(out_dir / "summary.txt", "\n\n".join(texts) + "\n")
    if cfg["plots"]:
        for name, res in results.items():
            files.append(_plot(name, res, out_dir))
    summary = {
        "kind": KIND,
        "remat_policy": cfg["remat_policy"],
        "models": results,
        "files": files,
    }
    _io.write_json(out_dir / "checkpointing.json", summary)
    return summary


def _model_summary(rows: list[dict[str, Any]], n: int) -> dict[str, Any]:
    ck = [r for r in rows if r["sweep"] == "checkpoint" and r["k"]]
    none = next(r for r in rows if r["sweep"] == "checkpoint" and not r["k"])
    micro = [none] + [r for r in rows if r["sweep"] == "microbatches"]
    est_best = min(range(1, n + 1), key=lambda k: (checkpointed_bytes(n, 1, 1, k), k))
    return {
        "n_layers": n,
        "sqrt_n": math.sqrt(n),
        "measured_best_k": min(ck, key=lambda r: (r["measured_temp"], r["k"]))["k"] if ck else None,
        "estimated_best_k": min(ck, key=lambda r: (r["estimated_temp"], r["k"]))["k"]
        if ck
        else None,
        "textbook_best_k": est_best,
        "none": _keep(none),
        "checkpoint": [_keep(r) for r in ck],
        "microbatches": [_keep(r) for r in micro],
    }


def _keep(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("k", "microbatches", "measured_temp", "estimated_temp", "estimated_activations",
            "step_s")  # fmt: skip
    return {k: r[k] for k in keys}


def _text(name: str, rows: list[dict[str, Any]], res: dict[str, Any]) -> str:
    base = res["none"]

    def line(label: str, r: dict[str, Any]) -> list[str]:
        t = "-" if r["step_s"] is None else f"{r['step_s'] * 1e3:.1f}"
        rel = "-" if base["step_s"] is None or r["step_s"] is None else (
            f"{r['step_s'] / base['step_s']:.2f}"
        )  # fmt: skip
        return [label, _mib(r["measured_temp"]), _mib(r["estimated_temp"]),
                f"{r['measured_temp'] / base['measured_temp']:.2f}", t, rel]  # fmt: skip

    head = ["K", "measured MiB", "estimate MiB", "vs none", "ms/step", "time vs none"]
    ck = [line("none", base)] + [line(str(r["k"]), r) for r in res["checkpoint"]]
    mb = [line(str(r["microbatches"]), r) for r in res["microbatches"]]
    return (
        # two heading lines: each fits the docs' 100-column code blocks
        f"{name}: {res['n_layers']} scanned layers; peak temporaries vs checkpoint interval K\n"
        f"(sqrt(N) = {res['sqrt_n']:.1f}; least measured at K = {res['measured_best_k']}, "
        f"estimated at K = {res['estimated_best_k']})\n"
        + text_table(ck, head)
        + f"\n\n{name}: peak temporaries vs micro-batches M (no checkpointing)\n"
        + text_table(mb, ["M", *head[1:]])
    )


def _plot(name: str, res: dict[str, Any], out_dir: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ck, none, mb = res["checkpoint"], res["none"], res["microbatches"]
    # page-wide (7.5 in at 110 dpi: 825 px, the docs' content width), panels stacked, legends
    # at 9 pt: readable where the memory guide shows it
    fig, axes = plt.subplots(3, 1, figsize=(7.5, 3 * 2.9))
    ax = axes[0]
    ks = [r["k"] for r in ck]
    ax.plot(ks, [r["measured_temp"] / 2**20 for r in ck], "o-", label="measured (XLA temp)")
    ax.plot(ks, [r["estimated_temp"] / 2**20 for r in ck], "s--", label="estimate")
    ax.axhline(none["measured_temp"] / 2**20, color="gray", ls=":", label="measured, no ckpt")
    ax.axhline(none["estimated_temp"] / 2**20, color="gray", ls="-.", lw=0.8,
               label="estimate, no ckpt")  # fmt: skip
    ax.axvline(
        res["sqrt_n"], color="k", ls="--", lw=0.8, label=f"K = sqrt(N) = {res['sqrt_n']:.1f}"
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel(f"checkpoint every K layers (N = {res['n_layers']})")
    ax.set_ylabel("peak temporaries (MiB)")
    ax.set_title(f"{name}: memory vs K")
    ax.legend(fontsize=9)
    ax = axes[1]
    if none["step_s"] is not None:
        ax.plot(ks, [r["step_s"] * 1e3 for r in ck], "o-", label="checkpointed")
        ax.axhline(none["step_s"] * 1e3, color="gray", ls=":", label="no checkpointing")
        ax.axvline(res["sqrt_n"], color="k", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.legend(fontsize=9)
    ax.set_xlabel("checkpoint every K layers")
    ax.set_ylabel("step time (ms, best of repeats)")
    ax.set_title(f"{name}: step time vs K ({jax.default_backend()})")
    ax = axes[2]
    ms = [r["microbatches"] for r in mb]
    ax.plot(ms, [r["measured_temp"] / 2**20 for r in mb], "o-", label="measured (XLA temp)")
    ax.plot(ms, [r["estimated_temp"] / 2**20 for r in mb], "s--", label="estimate")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("micro-batches M (gradient accumulation)")
    ax.set_ylabel("peak temporaries (MiB)")
    ax.set_title(f"{name}: memory vs micro-batches")
    ax.legend(fontsize=9)
    fig.tight_layout()
    file = f"checkpointing_{name}.png"
    _io.save_figure(fig, out_dir / file, dpi=110)
    plt.close(fig)
    return file
