"""Run an experiment into a run directory; resume a killed one.

Units (variant x setting x seed) run one after another in this process. Each is isolated: an
exception is caught, its traceback written to the unit's ``error.log`` and its status set to
``failed``, and the run goes on; a diverging unit is a result, not an error. ``summary.json``
is rewritten atomically after every unit, so it is valid at any moment.

Ctrl-C (``KeyboardInterrupt``) marks the run ``interrupted`` and re-raises: the unit that was
running keeps status ``running`` and its checkpoints, and ``resume(run_dir)`` skips finished
units and continues unfinished ones from their last checkpoint.

In a multi-process run (:mod:`precisionlab.train._distributed`) process 0 runs the experiment as
above and is the only writer; it sends its plan (experiment, run directory, unit statuses) to
the other processes, which :func:`follow` it, training the same units from the same
checkpoints and writing nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from precisionlab import _io
from precisionlab._clock import phase
from precisionlab.experiments import _kinds as kinds
from precisionlab.experiments import _store as store
from precisionlab.experiments import _train_kind as train_kind
from precisionlab.experiments._config import (
    Experiment,
    Unit,
    experiment_from_document,
    load_experiment,
)
from precisionlab.experiments._summary import summarize_run, summarize_unit
from precisionlab.experiments._telemetry_views import telemetry_scalars
from precisionlab.experiments._timings import record_unit
from precisionlab.train import ProgressHook, train
from precisionlab.train import _distributed as distributed
from precisionlab.train._compose import program_key
from precisionlab.train._timing import LoopTimings, Stopwatch
from precisionlab.verify import RecordHook

__all__ = ["DONE", "config_hash", "follow", "resume", "run_file", "run_locked"]

#: Unit statuses that resume does not redo.
DONE = ("finished", "failed")

Printer = Callable[[str], None]


def _printer(quiet: bool) -> Printer:
    if quiet:
        return lambda _msg: None
    return lambda msg: print(msg, file=sys.stderr, flush=True)


def run_file(
    path: str | Path,
    *,
    out: str | Path | None = None,
    overrides: Sequence[str] = (),
    quiet: bool = False,
    timings: bool = False,
    force: bool = False,
    record_steps: Sequence[int] | None = None,
) -> Path:
    """Validate ``path`` (with ``--set`` overrides), then run it; returns the run directory.

    ``out`` is the run directory to create: it must not hold a run (ValueError naming
    ``--resume``), nor another run's files without its ``config.json`` (they cannot be told
    apart from this run's). By default a new ``runs/<name>-<timestamp>`` under the current
    directory; then an unfinished run of the same experiment there (interrupted, or left
    ``running`` by a process that died) is a ValueError naming it and ``--resume``, unless
    ``force``. The run's lock is taken before anything is written in the directory.
    ``timings``: write where the run's time went to ``timings.json`` (see
    :mod:`precisionlab.experiments._timings`).
    ``record_steps``: record these steps of each training unit into its ``verify/`` directory
    (:class:`precisionlab.verify.RecordHook`; the unit then runs one step per call).
    """
    with phase("plan"):  # read, validate and resolve the experiment
        experiment = load_experiment(path, overrides)
    if out is None:
        if not force:
            _refuse_unfinished(Path("runs"), experiment)
        run_dir = store.new_run_dir(Path("runs"), experiment.name)
    else:
        run_dir = Path(out)
    with store.locked_run(run_dir) as previous:
        _refuse_old_files(run_dir)
        _write_config(run_dir, experiment, overrides)
        return run_locked(
            experiment, run_dir, quiet=quiet, timings=timings, previous=previous,
            record_steps=record_steps,
        )  # fmt: skip


#: What a run writes in its directory, besides config.json: a directory holding any of these
#: holds (part of) a run.
RUN_FILES = ("run.json", "summary.json", "environment.json", "timings.json", "variants")


def _refuse_old_files(run_dir: Path) -> None:
    if (run_dir / "config.json").exists():
        raise ValueError(
            f"{run_dir} already holds a run; continue it with --resume {run_dir} "
            "or choose another --out"
        )
    old = [name for name in RUN_FILES if os.path.lexists(run_dir / name)]
    if old:
        raise ValueError(
            f"{run_dir} holds another run's files ({', '.join(old)}) but no config.json, so "
            "nothing proves which experiment made them; remove them or choose another --out"
        )


def _refuse_unfinished(root: Path, experiment: Experiment) -> None:
    """ValueError when ``root`` holds an unfinished run of ``experiment`` (the same resolved
    configuration): a plain re-run would otherwise start afresh beside it."""
    if not root.is_dir():
        return
    mine = config_hash(experiment.resolved)
    prefix = store.safe_name(experiment.name) + "-"
    for run_dir in sorted(root.iterdir(), reverse=True):
        if not run_dir.name.startswith(prefix) or not (run_dir / "config.json").is_file():
            continue
        try:
            saved = store.read_json(run_dir / "config.json")
            info = store.read_json(run_dir / "run.json") if (run_dir / "run.json").exists() else {}
        except ValueError:
            continue  # a damaged run is no one's to resume
        status = info.get("status")
        if status not in ("running", "interrupted") or config_hash(saved.get("resolved")) != mine:
            continue
        holder = store.lock_holder(run_dir)
        if status == "running" and holder is not None and holder[1]:
            state = f"is being run by process {holder[0]}"
        elif status == "running":
            pid = f"process {holder[0]}" if holder else "its process"
            state = f"was left running by {pid}, which has ended (killed?)"
        else:
            state = "was interrupted"
        raise ValueError(
            f"{run_dir} holds an unfinished run of this experiment ({state}): continue it with "
            f"`precisionlab run --resume {run_dir}`, or pass --force to start a new run"
        )


def config_hash(resolved: Any) -> str:
    """A short hash of a resolved configuration (JSON-able): what proves a recorded unit or
    run was made under the same configuration."""
    text = json.dumps(_io.to_jsonable(resolved), sort_keys=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _write_config(run_dir: Path, experiment: Experiment, overrides: Sequence[str]) -> None:
    store.write_json(
        run_dir / "config.json",
        {
            "source": experiment.source,
            "overrides": list(overrides),
            "document": experiment.document,
            "resolved": experiment.resolved,
            "config_hash": config_hash(experiment.resolved),
        },
    )


def resume(run_dir: str | Path, *, quiet: bool = False, timings: bool = False) -> Path:
    """Continue the run in ``run_dir``: finished units are kept, the others continue from their
    last checkpoint (or start over when they have none). A unit recorded under another
    configuration than the run's (its ``config_hash``) is a ValueError, never reused."""
    run_dir = Path(run_dir)
    config_path = run_dir / "config.json"
    if not config_path.exists():
        raise ValueError(f"{run_dir}: not a run directory (no config.json)")
    with store.locked_run(run_dir) as previous:
        saved = store.read_json(config_path)  # checked against its schema (runfiles)
        if "document" not in saved:
            raise ValueError(f"{config_path}: missing field 'document' (the experiment to resume)")
        experiment = experiment_from_document(
            saved["document"], saved.get("source", str(config_path)), default_name=run_dir.name
        )
        if "config_hash" in saved and saved["config_hash"] != config_hash(experiment.resolved):
            raise ValueError(
                f"{config_path}: its document no longer resolves to the recorded configuration "
                "(edited, or another precisionlab version's defaults); start a new run"
            )
        return run_locked(
            experiment, run_dir, quiet=quiet, resuming=True, timings=timings, previous=previous
        )


def run_locked(
    experiment: Experiment,
    run_dir: Path,
    *,
    previous: str | None,
    quiet: bool = False,
    resuming: bool = False,
    timings: bool = False,
    record_steps: Sequence[int] | None = None,
) -> Path:
    """Run (or continue) ``experiment`` in ``run_dir``, whose lock the caller holds
    (``with store.locked_run(run_dir) as previous``); returns ``run_dir``. ``previous``: the
    pid the lock file named before (a process that ended while the run said ``running``)."""
    say = _printer(quiet)
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").exists():
        _write_config(run_dir, experiment, ())
    run_json = run_dir / "run.json"
    run_info: dict[str, Any] = (
        store.read_json(run_json) if run_json.exists() else {"created": _now()}
    )
    if run_info.get("status") == "running" and previous and previous != str(os.getpid()):
        say(
            f"note: {run_dir} was left running by process {previous}, which has ended (killed?); "
            "continuing from the last checkpoints"
        )
        run_info["killed"] = [*run_info.get("killed", []), previous]
    run_info.update({"status": "running", "updated": _now(), "kind": experiment.kind})
    run_info["resumed"] = run_info.get("resumed", 0) + int(resuming)
    run_info["config_hash"] = config_hash(experiment.resolved)
    store.write_json(run_json, run_info)
    env_path = run_dir / "environment.json"
    with phase("environment"):  # JAX's backend starts here
        env = store.environment()
    if env_path.exists() and resuming:
        previous_env = store.read_json(env_path)
        previous_env.setdefault("resumed_with", []).append(env)
        env = previous_env
    store.write_json(env_path, env)
    _lead(experiment, run_dir)
    try:
        if experiment.kind == "train":
            _run_train(experiment, run_dir, say=say, quiet=quiet, timings=timings,
                       record_steps=record_steps)  # fmt: skip
        else:
            _run_other(experiment, run_dir, say=say, quiet=quiet)
    except KeyboardInterrupt:
        if experiment.kind == "train":
            summarize_run(run_dir, experiment)
        run_info.update({"status": "interrupted", "updated": _now()})
        store.write_json(run_json, run_info)
        say(f"interrupted: continue with `precisionlab run --resume {run_dir}`")
        raise
    run_info.update({"status": "finished", "updated": _now()})
    store.write_json(run_json, run_info)
    return run_dir


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# --- kinds other than train ------------------------------------------------------------


def _run_other(experiment: Experiment, run_dir: Path, *, say: Printer, quiet: bool) -> None:
    kind = experiment.kind
    summary_path = run_dir / "summary.json"
    mine = config_hash(experiment.resolved)
    if summary_path.exists():
        done = store.read_json(summary_path)
        if done.get("config_hash", mine) != mine:
            raise ValueError(f"{summary_path}: recorded under another configuration")
        if done.get("status") == "finished":
            say(f"{kind}: already finished")
            return
    module = kinds.load(kind)
    out_dir = store.makedirs(run_dir / kind)
    start = time.perf_counter()
    try:
        result = module.run(experiment.resolved[kind], out_dir, quiet=quiet)
        status, error = "finished", None
    except KeyboardInterrupt:
        raise
    except Exception as err:
        store.write_text(run_dir / "error.log", traceback.format_exc())
        status, error, result = "failed", f"{type(err).__name__}: {err}", None
        say(f"{kind}: failed: {error} (traceback in {run_dir / 'error.log'})")
    store.write_json(
        summary_path,
        {
            "kind": kind,
            "name": experiment.name,
            "status": status,
            "error": error,
            "wall_time_s": time.perf_counter() - start,
            "result": result,
            "config_hash": mine,
        },
    )


# --- the train kind --------------------------------------------------------------------


def _statuses(experiment: Experiment, run_dir: Path) -> list[dict[str, Any]]:
    """Each unit's ``status.json`` ({} when it has none); ValueError for a unit recorded under
    another configuration than its own (``config_hash``; a unit without one only in a run
    directory of a precisionlab that wrote none)."""
    if experiment.kind != "train":
        return []
    out = []
    hashed = _run_is_hashed(run_dir)
    for unit in experiment.units:
        status_path = run_dir / "variants" / unit.id / "status.json"
        status = store.read_json(status_path) if status_path.exists() else {}
        recorded = status.get("config_hash")
        if status and (recorded != config_hash(unit.params) if recorded or hashed else False):
            why = "another configuration" if recorded else "no configuration hash"
            raise ValueError(
                f"{status_path}: unit {unit.name!r} was recorded under {why}, not this run's; "
                "its results cannot be reused: start a new run (another --out)"
            )
        out.append(status)
    return out


def _run_is_hashed(run_dir: Path) -> bool:
    path = run_dir / "config.json"
    return path.exists() and "config_hash" in store.read_json(path)


def _run_train(
    experiment: Experiment, run_dir: Path, *, say: Printer, quiet: bool, timings: bool = False,
    record_steps: Sequence[int] | None = None,
) -> None:  # fmt: skip
    units = experiment.units
    statuses = _statuses(experiment, run_dir)
    bar = _overall_bar(experiment, statuses, quiet)
    pending = [i for i, s in enumerate(statuses) if s.get("status") not in DONE]
    ahead: _Precompile | None = None
    started: set[str | None] = set()
    try:
        for i, (unit, status) in enumerate(zip(units, statuses, strict=True)):
            unit_dir = run_dir / "variants" / unit.id
            if status.get("status") in DONE:
                say(f"[{i + 1}/{len(units)}] {unit.name}: {status['status']} earlier, kept")
                continue
            if ahead is not None:
                with phase("compile ahead (waited)"):
                    ahead.wait()  # it compiled this unit's programs: do not compile them twice
            started.add(_key(unit))
            later = [j for j in pending if j > i]
            # the next unit's programs, unless they are this unit's or an earlier one's
            if later and _key(units[later[0]]) not in started and record_steps is None:
                ahead = _Precompile.start(units[later[0]])
                started.add(_key(units[later[0]]))
            else:
                ahead = None
            say(f"[{i + 1}/{len(units)}] {unit.name}")
            hooks: tuple[ProgressHook, ...] = ()
            if bar is not None:
                bar.set_description(unit.name)
                hooks = (ProgressHook(bar, own=False),)
            loop = LoopTimings() if timings else None
            watch = Stopwatch()
            with phase("units"):
                _run_unit(unit, unit_dir, status, say=say, quiet=quiet, hooks=hooks, timings=loop,
                          record_steps=record_steps)  # fmt: skip
            if loop is not None:
                wall, cpu = watch.elapsed()
                record_unit(
                    run_dir,
                    unit.id,
                    unit.name,
                    {"wall_s": wall, "cpu_s": cpu, "loop": loop.to_dict()},
                )
            with phase("summaries"):
                summarize_run(run_dir, experiment)
    finally:
        if ahead is not None:  # not left compiling while the interpreter shuts down
            with phase("compile ahead (waited)"):
                ahead.wait()
        if bar is not None:
            bar.close()
    with phase("summaries"):
        summarize_run(run_dir, experiment)


def _key(unit: Unit) -> str | None:
    return None if unit.config is None else program_key(unit.config)


class _Precompile:
    """The next unit's programs compiled in a thread while the current unit trains (XLA
    compiles outside the Python lock). A failure here is ignored: the unit reports it when it
    runs. Not in a multi-process run (its processes compile in step)."""

    def __init__(self, thread: threading.Thread | None) -> None:
        self.thread = thread

    @classmethod
    def start(cls, unit: Unit) -> _Precompile:
        if unit.config is None or distributed.process_count() > 1:
            return cls(None)
        thread = threading.Thread(
            target=_precompile_quietly, args=(unit.config,), name=f"compile {unit.id}", daemon=True
        )
        thread.start()
        return cls(thread)

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()


def _precompile_quietly(config: Any) -> None:
    try:
        train_kind.precompile(config)
    except Exception:  # the unit itself reports what is wrong when it runs
        pass


def _overall_bar(experiment: Experiment, statuses: list[dict], quiet: bool) -> Any:
    """One progress bar for all the units (its ETA is the whole run's), labelled with the
    running unit's name; None when quiet or when no unit asks for one (``progress``; None:
    only when stderr is a terminal)."""
    units = experiment.units
    wanted = [u.config.progress for u in units if u.config is not None]
    show = any(sys.stderr.isatty() if p is None else p for p in wanted)
    if quiet or not show:
        return None

    total = sum(u.config.steps for u in units)
    done = sum(
        u.config.steps for u, s in zip(units, statuses, strict=True) if s.get("status") in DONE
    )
    return tqdm(total=total, initial=done, leave=False, dynamic_ncols=True)


def _run_unit(
    unit: Unit,
    unit_dir: Path,
    status: dict,
    *,
    say: Printer,
    quiet: bool,
    hooks: tuple = (),
    timings: LoopTimings | None = None,
    record_steps: Sequence[int] | None = None,
) -> None:
    store.makedirs(unit_dir)  # no link followed below the run directory
    status_path = unit_dir / "status.json"
    resuming = bool(status)
    status.update({"status": "running", "name": unit.name, "started": _now()})
    status["config_hash"] = config_hash(unit.params)
    status.setdefault("wall_time_s", 0.0)
    store.write_json(status_path, status)
    metrics_path = unit_dir / "metrics.jsonl"
    hist_path = unit_dir / "hist.jsonl"
    tel_path = unit_dir / "telemetry.jsonl"
    if not resuming:
        metrics_path.unlink(missing_ok=True)
        hist_path.unlink(missing_ok=True)
        tel_path.unlink(missing_ok=True)
    writer: store.JsonlWriter | None = None
    hist_writer: store.JsonlWriter | None = None
    tel_writer: store.JsonlWriter | None = None
    board = store.tensorboard_writer(unit_dir / "tb")

    def on_step(row: dict[str, Any]) -> None:
        nonlocal writer, hist_writer, tel_writer
        if writer is None:
            # A resumed unit restarts at its last checkpoint: drop rows recorded after it,
            # and a line torn by a kill, before appending.
            step = int(row.get("step", 0))
            for path in (metrics_path, hist_path, tel_path):
                store.resume_jsonl(path, step)
            writer = store.JsonlWriter(metrics_path)
            hist_writer = store.JsonlWriter(hist_path)
        writer.write(row)
        if board is not None:
            for key, value in row.items():
                if isinstance(value, int | float) and key != "step":
                    board.add_scalar(key, float(value), int(row.get("step", 0)))

    def on_hist(row: dict[str, Any]) -> None:
        assert hist_writer is not None, "histograms come after their step's metrics"
        hist_writer.write(row)

    def on_telemetry(rows: list[dict[str, Any]]) -> None:
        nonlocal tel_writer
        assert writer is not None, "telemetry comes after its step's metrics"
        if tel_writer is None:  # opened at the first rows: no file when telemetry is off
            tel_writer = store.JsonlWriter(tel_path)
        for row in rows:
            tel_writer.write(row)
        if board is not None:
            telemetry_scalars(board, rows)

    start = time.perf_counter()
    fatal = None
    config = unit.config
    try:
        if record_steps is not None:  # a hook records them; each step starts a call
            config = dataclasses.replace(config, chunk_steps=1)
            hooks = (*hooks, RecordHook.for_config(config, unit_dir / "verify", record_steps))
        result = train_kind.run_unit(
            config,
            unit_dir,
            on_step=on_step,
            on_hist=on_hist,
            on_telemetry=on_telemetry,
            resume=resuming,
            quiet=True,  # the run's own bar (``hooks``) shows the progress
            label=unit.name,
            hooks=hooks,
            **({} if timings is None else {"timings": timings}),
        )
        status.update({"status": "finished", "result": result, "error": None})
    except KeyboardInterrupt:
        status["wall_time_s"] += time.perf_counter() - start
        store.write_json(status_path, status)
        raise
    except Exception as err:
        if distributed.lost_peer(err):  # not the unit's failure: keep it running (resumable)
            status["wall_time_s"] += time.perf_counter() - start
            store.write_json(status_path, status)
            raise
        store.write_text(unit_dir / "error.log", traceback.format_exc())
        status.update({"status": "failed", "error": f"{type(err).__name__}: {err}"})
        say(f"  failed: {status['error']} (traceback in {unit_dir / 'error.log'})")
        # several processes: the others cannot go on alone (see follow); end the run
        fatal = err if distributed.process_count() > 1 else None
    finally:
        for w in (writer, hist_writer, tel_writer):
            if w is not None:
                w.close()
        if board is not None:
            board.close()
    status["wall_time_s"] += time.perf_counter() - start
    status["ended"] = _now()
    status["summary"] = summarize_unit(unit, unit_dir, status)
    store.write_json(status_path, status)
    if fatal is not None:
        raise fatal


# --- multi-process runs ----------------------------------------------------------------


def _lead(experiment: Experiment, run_dir: Path) -> None:
    """In a multi-process run, send process 0's plan (experiment, run directory, unit
    statuses) to the other processes (:func:`follow`); nothing to do in a single process."""
    if distributed.process_count() > 1:
        print(f"process 0: run directory: {run_dir}", file=sys.stderr, flush=True)
        distributed.broadcast_json(
            {
                "run_dir": str(run_dir),
                "source": experiment.source,
                "document": experiment.document,
                "resolved": experiment.resolved,
                "units": [u.id for u in experiment.units],
                "statuses": _statuses(experiment, run_dir),
            }
        )
        _check_kind(experiment)


def follow(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Path:
    """Run a process other than 0 of a multi-process run: train the units process 0 trains,
    from process 0's plan and checkpoints, writing nothing; returns process 0's run directory.

    ``path`` and ``overrides`` (None for ``--resume``) are this process's experiment: it must
    resolve to process 0's (ValueError otherwise). A unit that fails ends the run (the
    processes would otherwise wait for each other in different collectives).
    """
    mine = None if path is None else load_experiment(path, overrides)
    plan = distributed.broadcast_json(None)
    index = distributed.process_index()
    if mine is not None and json.dumps(mine.resolved) != json.dumps(plan["resolved"]):
        raise ValueError(
            f"process {index} resolved {mine.source} differently than process 0: start every "
            "process with the same experiment file and --set options"
        )
    print(f"process {index}: run directory: {plan['run_dir']}", file=sys.stderr, flush=True)
    experiment = experiment_from_document(
        plan["document"], plan["source"], default_name=Path(plan["run_dir"]).name
    )
    _check_kind(experiment)
    if [u.id for u in experiment.units] != plan["units"]:  # the units and their order
        raise ValueError(f"process {index} rebuilt other units than process 0's: a bug")
    if experiment.kind == "train":
        for unit, status in zip(experiment.units, plan["statuses"], strict=True):
            if status.get("status") in DONE:
                continue
            unit_dir = Path(plan["run_dir"]) / "variants" / unit.id
            ckpt = unit_dir / "checkpoints" if unit.config.checkpoint_interval else None
            # writes nothing: checkpoints come from process 0 (distributed.restore_checkpoint)
            train(unit.config, checkpoint_dir=ckpt, resume=bool(status), quiet=True)
    return Path(plan["run_dir"])


def _check_kind(experiment: Experiment) -> None:
    # every process raises this after the plan is sent, so none waits for the others
    if experiment.kind != "train":
        raise ValueError(
            f"several processes run train experiments only; {experiment.source} is a "
            f"{experiment.kind!r} experiment: run it in one process"
        )
