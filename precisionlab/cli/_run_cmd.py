"""``precisionlab run``: run an experiment file into a run directory, or resume one.

With ``--coordinator HOST:PORT --num-processes P --process-id I`` (or the environment variables
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``) the process joins a
multi-process run (:mod:`precisionlab.train._distributed`); it then trains in a child process
(see :mod:`precisionlab.cli._supervise`), so that the runtime's abort when another process dies
becomes one error line.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from precisionlab.cli._common import (
    Flag,
    UsageError,
    add_flags,
    check_out_dir,
    switch,
    terminating_like_ctrl_c,
)

if TYPE_CHECKING:
    from pathlib import Path

HELP = "run an experiment (TOML) into a run directory; --resume DIR continues a killed run"

#: The multi-process flags: key -> (the environment variable read when the flag is not given
#: (the first is JAX's own), metavar, help).
_PROCESS_FLAGS = {
    "coordinator": ("JAX_COORDINATOR_ADDRESS", "HOST:PORT", "address process 0 listens on"),
    "num_processes": ("JAX_NUM_PROCESSES", "P", "number of processes"),
    "process_id": ("JAX_PROCESS_ID", "I", "this process's index, 0..P-1"),
}
ENV = {key: env for key, (env, _, _) in _PROCESS_FLAGS.items()}
#: check_processes's integer arguments, in its order -> the flags that give them
_FLAG_OF = {
    "num_processes": "--num-processes",
    "process_id": "--process-id",
    "timeout_s": "--timeout",
}


#: run's options, in --help's order (the multi-process group follows).
_FLAGS = (
    Flag("config", "experiment file (TOML)", nargs="?"),
    Flag("--resume", "continue the run in DIR", metavar="DIR"),
    Flag("--out", "new or empty run directory (default runs/NAME-TIME)", metavar="DIR"),
    switch(
        "--force",
        "let --out name a directory that holds other files (a run in it is still kept), "
        "or start a new run although an unfinished one of the same experiment is under runs/",
    ),
    Flag(
        "--set",
        "override a key of the file, e.g. train.steps=50 or variant.fp16-static.lr=0.01",
        metavar="KEY.PATH=VALUE",
        default=[],
        action="append",
        dest="overrides",
    ),
    switch(
        "--deterministic",
        "matmuls and sums in a fixed order, so that a train experiment's numbers are the "
        "same bits on any CPU (at a cost; sets train.deterministic = true)",
    ),
    switch("--quiet", "no progress output"),
    switch(
        "--forecast",
        "record the divergence predictors and print the forecaster's alarm when it "
        "fires (sets train.predictors.live = true)",
    ),
    switch("--no-report", "skip report.md and plots"),
    switch(
        "--timings",
        "write where each variant's time went (compile, first step, steady step, host "
        "syncs, report) to timings.json in the run directory and print a table",
    ),
    Flag(
        "--record-steps",
        "record these steps of each variant for `precisionlab verify` (into "
        "variants/ID/verify/step_N; the variant then runs one step per compiled call)",
        metavar="N[,N...]",
    ),
    Flag(
        "--cache-dir",
        "JAX's persistent compilation cache (default $PRECISIONLAB_CACHE_DIR, else "
        "~/.cache/precisionlab/jax): a rerun or resume loads its programs instead of compiling",
        metavar="DIR",
    ),
    switch("--no-cache", "no persistent compilation cache for this run"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, _FLAGS)
    group = parser.add_argument_group(
        "multi-process training (all three, or none; or "
        + ", ".join(f"${env}" for env in ENV.values())
        + ")"
    )
    for key, (_, metavar, text) in _PROCESS_FLAGS.items():
        group.add_argument(_flag(key), metavar=metavar, help=text)
    group.add_argument(
        "--timeout",
        metavar="SECONDS",
        default="60",
        help="wait at most this long for the processes to connect, and for a silent process "
        "before the run fails (default 60)",
    )


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _int(text: str, name: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise UsageError(f"{name} must be an integer, got {text!r}") from None


def distributed_spec(args: argparse.Namespace) -> tuple[str, int, int, int] | None:
    """``(coordinator, num_processes, process_id, timeout_s)`` from the flags (else the
    environment), or None for a single-process run; UsageError for a partial or bad spec."""
    from precisionlab._text import check_processes

    given = {}
    for key, env in ENV.items():
        value = getattr(args, key, None)
        given[key] = value if value is not None else os.environ.get(env) or None
    missing = [_flag(k) for k, v in given.items() if v is None]
    if len(missing) == len(given):
        return None
    if missing:
        raise UsageError(
            f"multi-process training needs --coordinator, --num-processes and --process-id "
            f"(or {', '.join(ENV.values())}); missing: {', '.join(missing)}"
        )
    values = {**given, "timeout_s": args.timeout}
    n_processes, process_id, timeout_s = (_int(values[k], flag) for k, flag in _FLAG_OF.items())
    spec = (str(values["coordinator"]), n_processes, process_id, timeout_s)
    try:
        check_processes(*spec)
    except ValueError as err:
        message = str(err)
        for key, flag in _FLAG_OF.items():
            message = message.replace(key, flag)
        raise UsageError(message) from None
    return spec


def _check_args(args: argparse.Namespace) -> None:
    if args.resume and args.config:
        raise UsageError("give either CONFIG or --resume DIR, not both")
    new_only = (
        args.overrides or args.out or getattr(args, "deterministic", False)
        or getattr(args, "forecast", False)
    )  # fmt: skip
    if args.resume and new_only:
        raise UsageError(
            "--set, --out, --deterministic and --forecast apply to a new run, not to --resume"
        )
    if not args.resume and not args.config:
        raise UsageError("give an experiment file (CONFIG) or --resume DIR")
    # an existing directory's files (report.md, summary.json) are never replaced unasked
    check_out_dir(args.out, new=not args.force, force_hint=True)
    if args.no_cache and args.cache_dir:
        raise UsageError("give either --cache-dir DIR or --no-cache, not both")
    if getattr(args, "record_steps", None) is not None:
        if args.resume:
            raise UsageError("--record-steps applies to a new run, not to --resume")
        from precisionlab.verify._hook import parse_steps

        try:
            args.record_steps = parse_steps(args.record_steps)
        except ValueError as err:
            raise UsageError(f"--record-steps: {err}") from None


def _cache(args: argparse.Namespace) -> None:
    from precisionlab.train._compile_cache import OFF, enable_compilation_cache

    where = enable_compilation_cache(OFF if args.no_cache else args.cache_dir)
    # the report's telemetry figures are kept beside the compiled programs (by content)
    args.figure_cache = None if where is None else where / "figures"


def _train(args: argparse.Namespace) -> Path:
    from precisionlab._clock import phase

    with phase("imports"):  # JAX, the trainer, the runner
        from precisionlab.experiments import _runner as runner
    with phase("compilation cache"):
        _cache(args)
    timings = getattr(args, "timings", False)
    if args.resume:
        return runner.resume(args.resume, quiet=args.quiet, timings=timings)
    overrides = list(args.overrides)
    if getattr(args, "deterministic", False):
        overrides.append("train.deterministic=true")
    if getattr(args, "forecast", False):  # predictors on, and the live forecaster
        overrides.append("train.predictors.live=true")
    return runner.run_file(
        args.config, out=args.out, overrides=overrides, quiet=args.quiet, timings=timings,
        force=bool(getattr(args, "force", False)),
        record_steps=getattr(args, "record_steps", None),
    )  # fmt: skip


def _finish(args: argparse.Namespace, run_dir: Path) -> int:
    from precisionlab._clock import phase
    from precisionlab.experiments._summary import failed_units
    from precisionlab.experiments._timings import FILE, record_phases, record_report, timings_table
    from precisionlab.train._timing import Stopwatch

    failed = failed_units(run_dir)
    timings = getattr(args, "timings", False)
    if args.no_report:
        print(run_dir)
    else:
        watch = Stopwatch()
        with phase("report"):
            from precisionlab.experiments import _report as report

            path, table = report.write_report(
                run_dir, figure_cache=getattr(args, "figure_cache", None)
            )
        if timings:
            record_report(run_dir, *watch.elapsed())
        print(table)
        print(f"\nrun directory: {run_dir}\nreport: {path}")
    if timings:
        record_phases(run_dir)  # the whole process so far, by phase
        print(f"\ntimings ({run_dir / FILE}):\n{timings_table(run_dir)}")
    if failed:
        sys.stderr.write(f"{failed} variant(s) failed: see their error.log\n")
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    spec = distributed_spec(args)
    if spec is None:
        if getattr(args, "timings", False):
            from precisionlab import _clock

            _clock.start()  # timings.json accounts for the process from its start
        with terminating_like_ctrl_c():
            return _finish(args, _train(args))
    from precisionlab.cli import _supervise

    if os.environ.get(_supervise.CHILD_ENV) == "1":
        return _supervise.child(args, spec, _train, _finish)
    return _supervise.supervise(args, spec)
