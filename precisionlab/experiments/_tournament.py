"""The ``tournament`` experiment kind: every published 4-bit training recipe, side by side.

Each entry (a recipe, on each of its formats) trains the same small language model from each
seed, against the ``bf16`` baseline and the FP8 references; the run records every step's loss,
an evaluation every ``eval_every`` steps (the recipe's own forward: the model as trained) and
the gradient statistics per GEMM every ``stats_every`` steps
(:mod:`precisionlab.train.gemm_stats`), then writes ``tournament.json``, ``report.md`` and
plots (:mod:`precisionlab.experiments._tournament_report`). A ``[tournament]`` table::

    [tournament]
    seeds = [0, 1, 2]
    eval_every = 34            # steps between evaluations (the tokens-to-match resolution)
    eval_batches = 4
    stats_every = 68           # steps between gradient statistics (a multiple of eval_every)
    checkpoint_every = 136     # a killed unit resumes from its last checkpoint
    match_fraction = 0.5       # the target loss of tokens_to_match: the baseline's mean eval
                               # loss at this fraction of training
    baseline = "bf16"
    layers = "linear"          # the matmuls recipes replace: the blocks' dense layers
                               # ("linear": attention products and LM head stay in the
                               # policy's dtype, as in every paper), or "all"
    [tournament.train]         # the TrainConfig every unit shares (model, data, steps, ...)
    [[tournament.entry]]       # one per recipe
    name = "nvidia_fp4"        # a recipe name, or "bf16"
    formats = ["nvfp4", "mxfp4"]
    fields = {}                # the recipe's fields
    bf16_last = 1              # keep the last N replaced matmuls in BF16 (NVIDIA sec. 4.1)
    osci_reset = {}            # TetraJet-v2's OsciReset (recipes.osci_reset) settings

Resumable: finished units are kept (``units/<id>/result.json``), a unit that was running
continues from its last checkpoint, and the summary is rewritten from the units' files.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precisionlab._schema import ConfigError, Field, validate_table, with_docs
from precisionlab.experiments import _store as store
from precisionlab.experiments import _tournament_report as report
from precisionlab.mixed._policy import cast_floating
from precisionlab.recipes import (
    RECIPE_NAMES,
    FP4Recipe,
    apply,
    forward_weight_quantizer,
    get_recipe,
    osci_reset,
)
from precisionlab.train import (
    CallbackHook,
    LoopExtras,
    TrainConfig,
    build,
    latest_checkpoint,
    train_loop,
)
from precisionlab.train._config import TRAIN_FIELDS
from precisionlab.train._hooks import StepEnd
from precisionlab.train._step import normalize_loss_fn
from precisionlab.train.gemm_stats import GemmStatsHook

__all__ = [
    "ENTRY_FIELDS",
    "FIELDS",
    "KIND",
    "OSCI_FIELDS",
    "Unit",
    "linear_sites",
    "plan",
    "run",
    "run_unit",
    "validate",
]

KIND = "tournament"
REFERENCE = "bf16"  # an entry without a recipe: the policy's compute dtype

#: ``[[tournament.entry]]`` keys.
ENTRY_FIELDS: dict[str, Field] = with_docs(
    {
        "name": Field(str),
        "formats": Field(list, [], item=str),
        "fields": Field(dict, {}),
        "bf16_last": Field(int, 0, low=0, high=1 << 16),
        "osci_reset": Field(dict, {}),
        "outlier_start_fraction": Field(float, -1.0),
    },
    {
        "name": "a recipe name (precisionlab.recipes.RECIPE_NAMES) or 'bf16' (no recipe)",
        "formats": "the FP4 formats to run it on ([]: the recipe's default)",
        "fields": "the recipe's fields",
        "bf16_last": "keep the last N replaced matmuls in the policy's dtype",
        "osci_reset": "OsciReset: start (fraction of steps), period, track, threshold",
        "outlier_start_fraction": "TetraJet-v2 OutControl's start as a fraction of the steps "
        "(-1: the recipe's outlier_start)",
    },
)
#: ``osci_reset = {...}`` of an entry (TetraJet-v2's OsciReset, :func:`recipes.osci_reset`).
OSCI_FIELDS: dict[str, Field] = with_docs(
    {
        "start": Field(float, 0.59, low=0.0, high=1.0),
        "period": Field(int, 200, low=2, high=1 << 30),
        "track": Field(int, 50, low=1, high=1 << 30),
        "threshold": Field(float, 8.0, above=0.0),
    },
    {
        "start": "the first reset window, as a fraction of the steps (the authors' 59%)",
        "period": "updates between reset windows",
        "track": "updates whose distances a window adds up",
        "threshold": "quantized distance over master distance that resets an element",
    },
)

#: ``[tournament]`` keys.
FIELDS: dict[str, Field] = with_docs(
    {
        "seeds": Field(list, [0, 1, 2], item=int, low=0, high=2**31 - 1),
        "eval_every": Field(int, 34, low=1, high=2**31 - 1),
        "eval_batches": Field(int, 4, low=1, high=1 << 16),
        "stats_every": Field(int, 68, low=0, high=2**31 - 1),
        "checkpoint_every": Field(int, 136, low=0, high=2**31 - 1),
        "match_fraction": Field(float, 0.5, above=0.0, high=1.0),
        "baseline": Field(str, REFERENCE),
        "layers": Field(str, "linear", choices=("linear", "all")),
        "plots": Field(bool, True),
        "train": Field(dict, {}),
        "entry": Field(list, [], item=dict),
    },
    {
        "seeds": "every entry runs from each seed (at least 3 for the confidence intervals)",
        "eval_every": "steps between evaluations",
        "eval_batches": "evaluation batches (held-out data, the same for every unit)",
        "stats_every": "steps between gradient statistics per GEMM (0: none)",
        "checkpoint_every": "steps between checkpoints (0: none; a killed unit restarts)",
        "match_fraction": "tokens_to_match's target: the baseline's loss at this fraction",
        "baseline": "the entry the gaps are measured against",
        "layers": "which matmuls the recipes replace",
        "plots": "write PNG plots",
        "train": "the TrainConfig table every unit shares",
        "entry": "the recipes ([[tournament.entry]] tables)",
    },
)


@dataclasses.dataclass(frozen=True)
class Unit:
    """One training run: an entry on one format from one seed."""

    id: str
    variant: str  # "<name>" or "<name>-<fmt>": what the report ranks
    entry: dict[str, Any]
    fmt: str | None
    seed: int


def _entry(table: Any, where: str) -> dict[str, Any]:
    e = validate_table(table, ENTRY_FIELDS, where)
    name = e["name"]
    if name != REFERENCE and name not in RECIPE_NAMES:
        raise ConfigError(
            f"{where}.name: unknown recipe {name!r}; allowed: {REFERENCE}, "
            f"{', '.join(RECIPE_NAMES)}"
        )
    if name == REFERENCE and (e["formats"] or e["fields"]):
        raise ConfigError(f"{where}: the {REFERENCE} reference takes no formats or fields")
    try:
        recipe = None if name == REFERENCE else get_recipe(name, **e["fields"])
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{where}.fields: {str(err).splitlines()[0]}") from None
    if e["formats"]:
        if not isinstance(recipe, FP4Recipe):
            raise ConfigError(f"{where}.formats: only the FP4 recipes take formats, not {name!r}")
        for f in e["formats"]:
            if f not in recipe.formats:
                raise ConfigError(
                    f"{where}.formats: {name} runs on {', '.join(recipe.formats)}, not {f!r}"
                )
    if e["osci_reset"]:
        e["osci_reset"] = validate_table(e["osci_reset"], OSCI_FIELDS, f"{where}.osci_reset")
    return e


def validate(section: dict, where: str) -> dict:
    """The ``[tournament]`` table with defaults filled in (ConfigError naming the key)."""
    out = validate_table(section, FIELDS, where)
    if len(out["seeds"]) != len(set(out["seeds"])) or not out["seeds"]:
        raise ConfigError(f"{where}.seeds: give distinct seeds (3 or more for intervals)")
    train = dict(out["train"])
    for key in ("seed", "recipe"):
        if key in train:
            raise ConfigError(f"{where}.train.{key}: set by the tournament (seeds, entries)")
    try:
        cfg = TrainConfig.from_dict({**train, "progress": False}, f"{where}.train")
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err).splitlines()[0]) from None
    out["train"] = {k: v for k, v in cfg.to_dict().items() if k in train}
    if out["stats_every"] and out["stats_every"] % out["eval_every"]:
        raise ConfigError(f"{where}.stats_every: must be a multiple of eval_every")
    entries = [_entry(t, f"{where}.entry[{i}]") for i, t in enumerate(out["entry"])]
    if out["baseline"] not in {e["name"] for e in entries}:
        raise ConfigError(f"{where}.baseline: {out['baseline']!r} is not an entry")
    out["entry"] = entries
    ids = [u.variant for u in plan(out)]
    dup = {v for v in ids if ids.count(v) > len(out["seeds"])}
    if dup:
        raise ConfigError(f"{where}.entry: variants named twice: {sorted(dup)}")
    return out


def plan(section: dict) -> list[Unit]:
    """The units of a validated section: seed by seed, and within a seed entry by entry,
    format by format (so a run stopped early has every variant from the first seeds)."""
    units = []
    for s in section["seeds"]:
        for e in section["entry"]:
            for fmt in e["formats"] or [None]:
                variant = e["name"] if fmt is None else f"{e['name']}-{fmt}"
                units.append(Unit(f"{variant}-s{s}", variant, e, fmt, s))
    return units


# --- one unit -------------------------------------------------------------------------------
def linear_sites(cfg: TrainConfig) -> tuple[list[int], list[str]]:
    """Positions and names of the model's dense layers among its matmuls: a 2-D right operand
    (a weight) outside the LM head (scope ``unembed``); the attention products are excluded."""
    setup = build(dataclasses.replace(cfg, recipe=None) if cfg.recipe is not None else cfg)
    batch = next(iter(setup.data.batches(2, seed=0, start=0)))
    pc = cast_floating(setup.params, setup.policy.compute_dtype)
    sites = apply(normalize_loss_fn(setup.loss_fn), "bf16").sites(pc, batch)
    pos, names = [], []
    for i, s in enumerate(sites):
        if len(s.in_shapes[1]) == 2 and "unembed" not in s.scope.split("/"):
            pos.append(i)
            names.append(f"{s.layer()}/{s.name}")
    return pos, names


def _config(section: dict, unit: Unit, include: list[int] | None) -> TrainConfig:
    table = {**section["train"], "seed": unit.seed, "progress": False}
    e = unit.entry
    if e["name"] != REFERENCE:
        rec: dict[str, Any] = {"name": e["name"], **e["fields"]}
        if unit.fmt is not None:
            rec["fmt"] = unit.fmt
        steps = int(table.get("steps", TRAIN_FIELDS["steps"].default))
        if e["outlier_start_fraction"] >= 0:
            rec["outlier_start"] = round(e["outlier_start_fraction"] * steps)
        if include is not None:
            inc = include[: len(include) - e["bf16_last"]] if e["bf16_last"] else include
            rec["include"] = inc
        table["recipe"] = rec
    return TrainConfig.from_dict(table, f"tournament unit {unit.id}")


_EVALS: dict[str, Callable] = {}


def _eval_fn(setup: Any, key: str) -> Callable[[Any], float]:
    """``f(state) -> mean eval loss``: the model as trained (the recipe's forward, its state),
    on the setup's evaluation batches; jitted once per program key."""
    rec = setup.options.recipe
    policy = setup.policy
    f = normalize_loss_fn(setup.loss_fn)
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *setup.eval_batches)
    if key not in _EVALS:
        applied = None if rec is None else rec.apply(f)

        @jax.jit
        def run(params: Any, rstate: Any, stacked: Any) -> jax.Array:
            pc = cast_floating(params, policy.compute_dtype)
            k = jax.random.PRNGKey(0x5EED)

            def one(batch: Any) -> jax.Array:
                if applied is None:
                    return f(pc, batch)[0].astype(jnp.float32)
                return applied(pc, batch, state=rstate, key=k)[0].astype(jnp.float32)

            return jnp.mean(jax.lax.map(one, stacked))

        _EVALS[key] = run
    program = _EVALS[key]
    return lambda state: float(program(state.params, state.recipe_state, stacked))


class _UnitHook:
    """Evaluations (every ``eval_every`` steps) and gradient statistics (every
    ``stats_every``) of one unit, appended to its JSONL files as they are made."""

    def __init__(
        self,
        evaluate: Callable[[Any], float],
        stats: GemmStatsHook | None,
        eval_every: int,
        tokens_per_step: int,
        files: dict[str, Any],
    ) -> None:
        self.evaluate, self.stats, self.eval_every = evaluate, stats, eval_every
        self.tokens_per_step, self.files = tokens_per_step, files

    def on_step(self, end: StepEnd) -> None:
        if end.state is None or (end.step % self.eval_every and not end.last):
            return
        loss = self.evaluate(end.state)
        self.files["evals"].write(
            {"step": end.step, "tokens": end.step * self.tokens_per_step, "eval_loss": loss}
        )
        if self.stats is not None and end.step % self.stats.interval == 0:
            for row in self.stats.measure(end.state, end.step):
                self.files["stats"].write(row)

    def close(self) -> None:
        pass


def _optimizer(setup: Any, entry: dict, steps: int) -> Any:
    """The run's optimizer factory, with TetraJet-v2's OsciReset chained after it when the
    entry asks for it."""
    o = entry["osci_reset"]
    factory = setup.optimizer_factory
    if not o:
        return factory
    rec = setup.options.recipe.recipe
    q = forward_weight_quantizer(rec, contract_axis=0)

    def weights(path: Any, leaf: Any) -> bool:
        # the replaced dense layers' weights: 2-D, in a block
        return jnp.ndim(leaf) == 2 and "blocks" in jax.tree_util.keystr(path)

    mask = jax.tree_util.tree_map_with_path(weights, setup.params)

    def make(values: Any) -> Any:
        reset = osci_reset(
            q, start=round(o["start"] * steps), period=o["period"], track=o["track"],
            threshold=o["threshold"], mask=mask,
        )  # fmt: skip
        return optax.chain(factory(values), reset)

    return make


def run_unit(section: dict, unit: Unit, unit_dir: Path, include: list[int] | None) -> dict:
    """Train one unit into ``unit_dir`` (resuming from its checkpoints); returns its result."""
    cfg = _config(section, unit, include)
    setup = build(cfg)
    steps = cfg.steps
    tokens_per_step = cfg.batch_size * _seq_len(setup)
    loop = dataclasses.replace(
        setup.loop, eval_interval=0, checkpoint_interval=section["checkpoint_every"],
        chunk_steps=math.gcd(section["eval_every"], steps),
    )  # fmt: skip
    key = setup.program_key + ("+osci" if unit.entry["osci_reset"] else "")
    ckpt = unit_dir / "checkpoints"
    files = {n: unit_dir / f"{n}.jsonl" for n in ("metrics", "evals", "stats")}
    start = _checkpoint_step(ckpt)
    for p in files.values():
        store.resume_jsonl(p, start + 1)
    writers = {n: store.JsonlWriter(p) for n, p in files.items()}
    stats = None
    if section["stats_every"] and setup.options.recipe is not None:
        data, bs, seed = setup.data, cfg.batch_size, cfg.seed
        stats = GemmStatsHook(
            setup.loss_fn, setup.options.recipe, setup.policy,
            lambda s: data.batch(s, bs, seed=seed), section["stats_every"], lambda rows: None,
            cache_key=("tournament-stats", key),
        )  # fmt: skip
    hook = _UnitHook(_eval_fn(setup, key), stats, section["eval_every"], tokens_per_step, writers)

    def on_step(m: dict) -> None:
        writers["metrics"].write({"step": m["step"], "loss": _num(m["loss"])})

    t0, c0 = time.perf_counter(), time.process_time()
    try:
        loop = dataclasses.replace(
            loop, checkpoint_dir=ckpt if loop.checkpoint_interval else None, resume=True,
            progress=False,
        )  # fmt: skip
        result = train_loop(
            loss_fn=setup.loss_fn, params=setup.params,
            optimizer=_optimizer(setup, unit.entry, steps),
            batches=lambda s: setup.data.batches(cfg.batch_size, seed=cfg.seed, start=s),
            options=setup.options, loop=loop, hooks=[CallbackHook(on_step), hook],
            extras=LoopExtras(values=setup.values, program_key=key, lr_schedule=setup.schedule),
        )  # fmt: skip
    finally:
        for w in writers.values():
            w.close()
    evals = store.read_jsonl(files["evals"])
    return {
        "id": unit.id,
        "variant": unit.variant,
        "recipe": unit.entry["name"],
        "fmt": unit.fmt,
        "seed": unit.seed,
        "steps": result.steps_done,
        "tokens": result.steps_done * tokens_per_step,
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "final_train_loss": _num(result.final_loss),
        "diverged": bool(result.diverged),
        "wall_s": time.perf_counter() - t0,
        "cpu_s": time.process_time() - c0,
        "resumed_from": start,
        "params": int(sum(np.size(x) for x in jax.tree.leaves(setup.params))),
    }


def _num(v: Any) -> float | None:
    v = float(v)
    return v if math.isfinite(v) else None


def _seq_len(setup: Any) -> int:
    return int(getattr(setup.model, "seq_len", 1))


def _checkpoint_step(ckpt: Path) -> int:
    found = latest_checkpoint(ckpt) if ckpt.exists() else None
    if found is None:
        return 0
    return int(store.read_json(Path(found) / "meta.json").get("step", 0))


# --- the kind -------------------------------------------------------------------------------
def run(section: dict, out_dir: Path, *, quiet: bool = False) -> dict:
    """Run (or continue) the tournament into ``out_dir``; returns the summary."""
    out_dir = Path(out_dir)
    say = (lambda _m: None) if quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    units = plan(section)
    base = TrainConfig.from_dict({**section["train"], "progress": False}, "tournament.train")
    include = None
    if section["layers"] == "linear":
        include, names = linear_sites(base)
        store.write_json(out_dir / "layers.json", {"positions": include, "names": names})
    t_start = time.perf_counter()
    for i, unit in enumerate(units):
        udir = store.makedirs(out_dir / "units" / unit.id)
        done = udir / "result.json"
        if done.exists():
            say(f"[{i + 1}/{len(units)}] {unit.id}: done earlier, kept")
            continue
        say(f"[{i + 1}/{len(units)}] {unit.id}")
        try:
            result = run_unit(section, unit, udir, include)
        except KeyboardInterrupt:
            raise
        except Exception as err:  # the unit's failure, not the tournament's: the next one runs
            store.write_text(udir / "error.log", traceback.format_exc())
            say(f"  failed: {type(err).__name__}: {err} (traceback in {udir / 'error.log'}; "
                "a resume retries it)")  # fmt: skip
            continue
        (udir / "error.log").unlink(missing_ok=True)
        store.write_json(done, result)
        say(f"  final eval loss {result['final_eval_loss']}, {result['wall_s']:.0f} s wall, "
            f"{result['cpu_s']:.0f} s CPU")  # fmt: skip
    summary = report.write(section, units, out_dir, plots=section["plots"])
    summary["wall_time_s_this_call"] = time.perf_counter() - t_start
    return summary
