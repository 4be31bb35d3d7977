"""The training loop: data -> jitted step -> metrics, with evaluation and a progress bar.

The loop dispatches step N+1 before it reads step N's metrics to the host, so the device
queue never runs dry while Python formats numbers.

Around the loop (`jaxpod.run.preflight`, `resume`, `interrupt`): the checks before training run
once (budget, host RAM, the lock), a resume is refused if the config changed where results would;
a non-finite loss or parameter norm stops the run before a checkpoint of it is written; Ctrl-C
saves the current step and stops. A step's records are read and written before its checkpoint
is saved, and kept in it, so the record is never missing a checkpointed step. A write of the
record that fails (a full disk) stops the run the same way, its checkpoint keeping every record
the files lack, and ends in one line naming the file and the reason.

With several processes (`jaxpod.run.distributed`) every process runs this same loop on its own
devices of one global mesh; only process 0 writes the run record, holds the lock and prints.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import jax
from tqdm import tqdm

from jaxpod.config import Config, config_to_dict, dump_yaml
from jaxpod.data.feed import DeviceFeed
from jaxpod.data.prefetch import Prefetcher
from jaxpod.data.store import is_url
from jaxpod.engine import TrainState
from jaxpod.errors import UserError
from jaxpod.parallel.mesh import mesh_for
from jaxpod.run.checkpoint import Checkpointer
from jaxpod.run.distributed import from_process_0, is_main_process
from jaxpod.run.hostmem import is_oom, oom_error
from jaxpod.run.interrupt import Interrupted, StopRequests
from jaxpod.run.mapping import describe, format_mapping
from jaxpod.run.metrics import (
    EVAL_FILE,
    METRICS_FILE,
    MetricsWriter,
    flat_hparams,
    write_eval_record,
)
from jaxpod.run.preflight import Cleared, preflight
from jaxpod.run.profiling import StepProfiler
from jaxpod.run.progress import Phase
from jaxpod.run.record import RecordWriteError, write_atomic
from jaxpod.run.resume import (
    check_changes,
    check_saved_config,
    is_shared,
    keep_config,
    keep_records_upto,
    lost_records,
    records_upto,
    start_fresh,
    trim_events,
)
from jaxpod.run.steplog import StepLog
from jaxpod.run.tasks import Task, build_task
from jaxpod.target.spec import check_platform_compiles


@dataclass
class RunResult:
    """What a finished run returns (the full record is in `logdir`)."""

    logdir: Path
    state: TrainState
    losses: list[float]  # training loss of every step this run took (after a resume: the rest)
    val_losses: dict[int, float]  # step -> validation loss
    mapping: dict
    trace: Path | None = None  # the profile written by train.profile_steps, if any


def run_training(
    cfg: Config,
    *,
    quiet: bool = False,
    allow_changes: Collection[str] = (),
    cleared: Cleared | None = None,
    foreign_ok: bool = False,
) -> RunResult:
    """Train `cfg` and leave the run record in `cfg.train.logdir`.

    If `<logdir>/checkpoints/` holds a complete checkpoint, resume from the newest one (same
    losses as an uninterrupted run); otherwise start fresh, replacing an earlier record.
    A resume whose config differs in keys outside `jaxpod.run.resume.FREE` is refused unless
    they are in `allow_changes` (dotted keys, sections, or "all"). `cfg.devices` counts the
    devices of each process (`jaxpod.run.distributed`); the mesh spans those of every process.
    Only process 0 writes files, holds the logdir's lock and prints. A SIGINT/SIGTERM during
    the steps saves the current step and raises `Interrupted`. `cleared`: `preflight(cfg)`
    where the caller ran it (the CLI, before jax starts); otherwise the loop runs it first
    (`foreign_ok`: the run directory may hold files that are not jaxpod's, never touched).
    """
    if cleared is None:
        processes, process = jax.process_count(), jax.process_index()
        agree = from_process_0 if processes > 1 else None
        cleared = preflight(
            cfg, processes=processes, process=process, foreign_ok=foreign_ok, agree=agree
        )
    elif cleared.cfg is not cfg:
        raise ValueError("`cleared` is the preflight of another config")
    main = is_main_process()
    with cleared:  # releases the run directory's lock
        try:
            return _run(cfg, quiet or not main, main, allow_changes, cleared)
        except Exception as exc:
            if is_oom(exc) and not isinstance(exc, UserError):  # a full disk is no OOM
                raise oom_error(exc, cfg) from None
            raise


def _run(
    cfg: Config, quiet: bool, main: bool, allow_changes: Collection[str], cleared: Cleared
) -> RunResult:
    """The run top to bottom: build, open the record (resume or fresh start), compile, train,
    close the record. A resume of a finished run returns at once, writing nothing. The record
    goes to `cleared.logdir` (a URL's local copy, pushed to the store as checkpoints commit)."""
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    shown = None if quiet else sys.stdout  # where a long phase shows its elapsed time
    mesh = mesh_for(cfg)
    check_platform_compiles(mesh.devices.flat[0].platform, "these devices", cfg)
    logdir = cleared.logdir
    pushed = cleared.remote.push if cleared.remote is not None and main else None
    ckpt = Checkpointer(logdir, cfg.train.keep_checkpoints, pushed, cleared.barrier())
    start = ckpt.latest_step() or 0
    with Phase("building       the model, its state and the data", shown):
        task, state = _build(cfg, mesh, ckpt, start)
    mapping = describe(cfg, mesh, state, task.per_step, task.unit, task.engine.stages.params_count)
    say(format_mapping(mapping))
    say(f"data           {task.dataset.describe()}")

    kept_records: list = []
    if start:  # refuses (UserError) a mismatched or damaged checkpoint before touching logdir
        state, kept_records, changes = _restore(cfg, ckpt, start, task, state, allow_changes)
        if start >= cfg.train.steps:  # nothing is written: the record stays as it is
            ckpt.close()
            say(f"complete       {ckpt.shown / str(start)} is at step {start}; nothing to do")
            if main and (logdir / METRICS_FILE).is_file() and not (logdir / EVAL_FILE).exists():
                write_eval_record(logdir, cfg, task.unit)  # its writing failed at the end
            _say_where(say, cfg.train.logdir)
            return RunResult(logdir, state, [], {}, mapping)
        _resume_record(logdir, start, changes, ckpt, say, main)
    shared = (start_fresh(logdir, say) if not start else is_shared(logdir)) if main else False
    if main:
        _write_setup(logdir, cfg, {**mapping, **({"shared_directory": True} if shared else {})})

    t0 = time.perf_counter()
    with Phase("compiling      the train step", shown):
        _compile(task.engine, state, task.batch(0))
    say(f"compiled       train step in {time.perf_counter() - t0:.1f} s")

    losses, val_losses = [], {}
    profiler = StepProfiler(logdir, cfg.train.profile_steps, enabled=main)
    stop = StopRequests(enabled=jax.process_count() == 1)
    # The writer closes last: it waits for the last checkpoint to commit, then flushes.
    with stop, MetricsWriter(logdir, enabled=main) as metrics_writer, _Unsaved(ckpt, stop):
        writer = _Recorder(metrics_writer)
        _write_header(writer, cfg, mapping, lost_records(logdir, kept_records) if main else [])
        if not start:
            _evaluate(task, state, 0, writer, val_losses, say)
        try:
            stop.arm()
            state, losses = _train_steps(
                cfg, task, state, writer, val_losses, say, quiet, ckpt, profiler, stop
            )
        finally:
            profiler.stop()  # an interrupted run still leaves a readable trace
    _close_record(cfg, task, state, ckpt, profiler, stop, say, main)
    _say_where(say, cfg.train.logdir)
    return RunResult(logdir, state, losses, val_losses, mapping, profiler.trace)


def _build(cfg: Config, mesh, ckpt: Checkpointer, start: int) -> tuple[Task, TrainState]:
    """The task and its state; for a resume (`start` > 0) the state's shapes and shardings
    only, which the checkpoint is read straight into. Closes `ckpt` if building fails."""
    try:
        return build_task(cfg, mesh, initialise=not start)
    except BaseException:
        ckpt.close()
        raise


def _restore(
    cfg: Config, ckpt: Checkpointer, start: int, task: Task, state, allow_changes
) -> tuple[TrainState, list, list]:
    """`(state, records, changed keys)` of checkpoint `start`, its config checked first so a
    change is refused (UserError) naming its keys, not an array; a refusal closes `ckpt`."""
    try:
        meta = ckpt.meta(start)
        where = f"{Path(cfg.train.logdir)} (checkpoint {start})"
        saved = check_saved_config(meta["config"], where)
        changes = check_changes(saved, config_to_dict(cfg), start, where, allow_changes)
        state = ckpt.restore(start, task.engine, state, cfg.train.seed, meta)
    except UserError:
        ckpt.close()
        raise
    return state, meta["records"], changes


def _resume_record(logdir: Path, start: int, changes: list, ckpt, say, main: bool) -> None:
    """Say where the run resumes and what changed; process 0 cuts the record back to `start`
    and keeps the earlier config if it changed, once the record is read and checked (a damaged
    line is refused before anything changes; a damaged last line is left out, saying so)."""
    kept, note = records_upto(logdir, start) if main else (None, None)
    say(f"resumed        from step {start} ({ckpt.shown / str(start)})")
    if changes:
        say(f"changed        {', '.join(k for k, _, _ in changes)} since step {start}")
    if note:
        say(f"trimmed        {note}")
    if main:
        if changes:
            keep_config(logdir, start)
        keep_records_upto(logdir, start, kept)
        trim_events(logdir, start)  # the steps after `start` are redone: shown once


def _write_setup(logdir: Path, cfg: Config, mapping: dict) -> None:
    """`config.yaml` and `mapping.json` (with the process count): what was trained, where."""
    write_atomic(logdir / "config.yaml", dump_yaml(cfg))
    mapping_record = {**mapping, "processes": jax.process_count()}
    write_atomic(logdir / "mapping.json", json.dumps(mapping_record, indent=2))


def _write_header(writer: _Recorder, cfg: Config, mapping: dict, lost: list) -> None:
    """Config, mapping and hyperparameters for TensorBoard, then the `lost` records (kept in
    the checkpoint, missing from the metrics file) written as they were."""
    writer.text("config", "```\n" + dump_yaml(cfg) + "\n```")
    writer.text("mapping", "```\n" + format_mapping(mapping) + "\n```")
    writer.hparams({**flat_hparams(config_to_dict(cfg)), "processes": jax.process_count()})
    for prefix, record in lost:
        writer.writer.write(record, prefix)  # lost by a kill right after the commit


def _close_record(cfg: Config, task: Task, state, ckpt, profiler, stop, say, main) -> None:
    """After the steps: the evaluation record, the trace's name, and `Interrupted` if a stop
    was requested (its step is saved by then)."""
    logdir = ckpt.logdir
    step = int(state.step)
    if stop.failure is not None:
        raise stop.failure.stopped(step, ckpt.shown / str(step))
    if main:
        try:
            write_eval_record(logdir, cfg, task.unit)
        except RecordWriteError as exc:
            raise UserError(
                f"{exc} at the end of the run; every step is saved (in {ckpt.shown / str(step)}): "
                f"{exc.fix}, then run the same command to write it"
            ) from None
    if profiler.trace is not None:
        say(f"profile        {profiler.trace} ({profiler.trace.stat().st_size:,} bytes)")
    if stop.requested is not None:
        saved = f"saved {ckpt.shown / str(step)} and the record up to it"
        if step >= cfg.train.steps:  # during the final save: nothing is left to resume
            raise Interrupted(
                stop.requested,
                f"interrupted at the last step, {step}: {saved}; the run is complete",
            )
        raise Interrupted(
            stop.requested, f"interrupted at step {step}: {saved}; run the same command to resume"
        )


def _save(cfg, task: Task, state, step: int, writer, steplog, ckpt, config, stop) -> None:
    """Save checkpoint `step` once its metrics are read, checked and written (or, after a
    failed write of the record, kept in it: every record the files lack)."""
    steplog.flush()
    writer.sync()
    stop.failure = writer.failure
    records = writer.of(step) if stop.failure is None else writer.unwritten
    if stop.failure is not None and jax.process_count() > 1:  # the others cannot save alone:
        raise stop.failure.stopped(step, None)  # the runtime stops them when this one exits
    order = task.engine.stages.layer_order  # how its stacked layers are stored
    try:
        ckpt.save(step, state, cfg.train.seed, config=config, records=records, layer_order=order)
    except UserError:
        if stop.failure is None:
            raise
        raise stop.failure.stopped(step, None) from None


class _Unsaved:
    """`with _Unsaved(ckpt, stop):` the checkpointer's block; after a failed write of the
    record, a checkpoint that cannot be committed is reported as that failure's."""

    def __init__(self, ckpt: Checkpointer, stop: StopRequests):
        self.ckpt, self.stop = ckpt, stop

    def __enter__(self) -> Checkpointer:
        return self.ckpt.__enter__()

    def __exit__(self, kind, value, tb) -> None:
        try:
            self.ckpt.__exit__(kind, value, tb)
        except UserError:
            if kind is not None or self.stop.failure is None:
                raise
            raise self.stop.failure.stopped(self.ckpt.saved_step, None) from None


def _compile(engine, state, part) -> None:
    """Compile the step's programs ahead of the first step (with `train.batch_parts` > 1 the
    first part's, a middle part's and the last part's)."""
    args = engine.updating_arguments(state, part)
    if engine.first_part_step is not None:
        engine.first_part_step.lower(state, part).compile()
        if engine.stages.cfg.train.batch_parts > 2:
            engine.accumulate_step.lower(*args).compile()  # the same arguments
    engine.train_step.lower(*args).compile()


class _Recorder:
    """The metrics writer, remembering the newest step's records (kept in its checkpoint)."""

    def __init__(self, writer: MetricsWriter):
        self.writer, self.step, self.records = writer, None, []

    def write(self, record: dict, prefix: str = "train") -> None:
        if record["step"] != self.step:
            self.step, self.records = record["step"], []
        self.records.append([prefix, record])
        self.writer.write(record, prefix)

    def of(self, step: int) -> list:
        return list(self.records) if self.step == step else []

    def __getattr__(self, name: str):
        return getattr(self.writer, name)


def _say_where(say, logdir: str) -> None:
    parent = logdir.rstrip("/").rpartition("/")[0] if is_url(logdir) else Path(logdir).parent
    say(f"logs           {logdir}/ ({METRICS_FILE}, {EVAL_FILE}, TensorBoard events, config.yaml)")
    say(
        f"tensorboard    make tensorboard LOGDIR={parent}   "
        f"(or: .venv/bin/jaxpod tensorboard {parent})"
    )


def _evaluate(task: Task, state, step: int, writer, val_losses: dict, log) -> None:
    """Evaluate, record under `val/`, and print one line."""
    results = task.evaluate(state.params)
    val_losses[step] = results["val_loss"]
    writer.write({"step": step, **results}, prefix="val")
    log(f"step {step:>6}  " + "  ".join(f"{k} {v:.4f}" for k, v in results.items()))


def _train_steps(cfg, task: Task, state, writer, val_losses, say, quiet, ckpt, profiler, stop):
    """The step loop proper, from `state.step` + 1. Returns the final state and the losses.

    Batches (or their `train.batch_parts` parts) are read into host memory `data.prefetch`
    items ahead by a background thread (the reads overlap the running step); each is copied to
    the device once the call before it is done (`DeviceFeed`: one part on the device).
    Before a checkpoint is saved every metric up to its step is read, checked and written; a
    stop request (`stop.requested`) saves the current step and ends the loop."""
    steps, eval_every, every = cfg.train.steps, cfg.train.eval_every, cfg.train.checkpoint_every
    start = int(state.step)
    hide = quiet or not sys.stderr.isatty()
    bar = tqdm(total=steps, initial=start, unit="step", disable=hide, file=sys.stderr)
    # With a live progress bar, lines go above it; otherwise (CI, pipes) plain log lines.
    log = say if bar.disable else bar.write
    steplog = StepLog(cfg, task, writer, bar, log, start, ckpt)
    config = config_to_dict(cfg)
    k = cfg.train.batch_parts  # the prefetcher's items are parts of batches
    part = lambda i: task.read(i // k, part=i % k)  # noqa: E731
    with Prefetcher(part, start * k, steps * k, depth=cfg.data.prefetch) as parts:
        feed = DeviceFeed(parts)
        for step in range(start + 1, steps + 1):
            with profiler.step(step):
                state, metrics = task.engine.run_step(state, feed, feed.dispatched)
            steplog.push(step, metrics)
            if profiler.stops_after(step):
                steplog.flush()  # waits for the last traced step: it is whole in the trace
                profiler.stop((state, metrics))
                steplog.restart_timing(step)  # writing the trace is not a step
            bar.update(1)
            if (eval_every and step % eval_every == 0) or step == steps:
                steplog.flush()
                _evaluate(task, state, step, writer, val_losses, log)
                steplog.restart_timing(step)  # evaluation is not charged to the next steps
            stop.failure = writer.failure
            if (every and step % every == 0) or step == steps or stop.ends_run:
                _save(cfg, task, state, step, writer, steplog, ckpt, config, stop)
            if stop.ends_run:
                break  # async save: committed when the checkpointer closes
    steplog.flush()
    bar.close()
    return state, steplog.losses
