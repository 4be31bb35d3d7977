"""The training loop: data -> jitted step -> metrics, with evaluation and a progress bar.

The loop dispatches step N+1 before it reads step N's metrics to the host, so the device
queue never runs dry while Python formats numbers.

With several processes (`jaxpod.distributed`) every process runs this same loop on its own
devices of one global mesh; only process 0 writes the run record and prints.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from jaxpod.checkpoint import Checkpointer
from jaxpod.config import Config, config_to_dict, dump_yaml
from jaxpod.data import TokenDataset, load_dataset
from jaxpod.errors import UserError
from jaxpod.mapping import describe, format_mapping
from jaxpod.mesh import make_mesh, select_devices
from jaxpod.metrics import (
    EVAL_FILE,
    METRICS_FILE,
    MetricsWriter,
    flat_hparams,
    read_metrics,
    write_json_atomic,
)
from jaxpod.profiling import StepProfiler, check_profile_steps
from jaxpod.train import Engine, TrainState, build_engine


@dataclass
class RunResult:
    """What a finished run returns (the full record is in `logdir`)."""

    logdir: Path
    state: TrainState
    losses: list[float]  # training loss of every step this run took (after a resume: the rest)
    val_losses: dict[int, float]  # step -> validation loss
    mapping: dict
    trace: Path | None = None  # the profile written by train.profile_steps, if any


def global_tokens(ds: TokenDataset, engine: Engine, cfg: Config, step: int, val: bool = False):
    """The global batch `tokens[G, T+1]` of `step`, assembled from per-device row slices.

    Each device's callback reads only the rows of its replica, and jax calls it only for
    this process's (addressable) devices: with several processes each one reads just its own
    rows and the global array is assembled without moving data between processes (what
    `jax.make_array_from_process_local_data` does, with no host-side concatenation).
    """
    g = cfg.train.global_batch
    read = ds.val_rows if val else ds.train_rows
    return jax.make_array_from_callback(
        (g, cfg.model.seq_len + 1),
        engine.batch_sharding,
        lambda idx: read(step, idx[0].start or 0, idx[0].stop or g, g),
    )


def evaluate(ds: TokenDataset, engine: Engine, cfg: Config, params) -> float:
    """Mean validation loss over `train.eval_batches` fixed validation batches."""
    losses = [
        engine.eval_loss(params, global_tokens(ds, engine, cfg, b, val=True))
        for b in range(cfg.train.eval_batches)
    ]
    return float(np.mean(jax.device_get(losses)))


def _prepare_logdir(logdir: Path) -> None:
    """Start a fresh record in `logdir` (replacing an earlier run's metrics, events, evals)."""
    logdir.mkdir(parents=True, exist_ok=True)
    for old in [logdir / METRICS_FILE, logdir / EVAL_FILE, *logdir.glob("events.out.tfevents.*")]:
        old.unlink(missing_ok=True)


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):  # e.g. a line cut short by a killed run
        return float("inf")


def _keep_metrics_upto(logdir: Path, step: int) -> None:
    """Drop the `metrics.jsonl` records after `step` (a resumed run redoes those steps)."""
    path = logdir / METRICS_FILE
    if path.exists():
        lines = path.read_text().splitlines(keepends=True)
        kept = [ln if ln.endswith("\n") else ln + "\n" for ln in lines if _step_of(ln) <= step]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)


def run_training(cfg: Config, *, quiet: bool = False) -> RunResult:
    """Train `cfg` and leave the run record in `cfg.train.logdir`.

    If `<logdir>/checkpoints/` holds a complete checkpoint, resume from the newest one (same
    losses as an uninterrupted run); otherwise start fresh, replacing an earlier record.
    `cfg.devices` counts the devices of each process (`jaxpod.distributed`); the mesh spans
    those of every process. Only process 0 writes files and prints.
    """
    check_profile_steps(cfg.train.profile_steps, cfg.train.steps)
    main = jax.process_index() == 0
    quiet = quiet or not main
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    ds = load_dataset(
        cfg.data.name,
        seq_len=cfg.model.seq_len,
        seed=cfg.train.seed,
        path=cfg.data.path,
        val_fraction=cfg.data.val_fraction,
    )
    mesh = make_mesh(cfg.mesh, select_devices(cfg.devices * jax.process_count()))
    engine, state = build_engine(cfg, mesh)
    mapping = describe(cfg, mesh, state.params, state.opt_state)
    say(format_mapping(mapping))
    say(f"data           {ds.describe()}")

    logdir = Path(cfg.train.logdir)
    ckpt = Checkpointer(logdir, cfg.train.keep_checkpoints)
    start = ckpt.latest_step() or 0
    if start:  # refuses (UserError) a mismatched or damaged checkpoint before touching logdir
        try:
            state = ckpt.restore(start, engine, state, cfg.train.seed)
        except UserError:
            ckpt.close()
            raise
        if start >= cfg.train.steps:
            ckpt.close()
            say(f"complete       {ckpt.shown / str(start)} is at step {start}; nothing to do")
            _say_where(say, logdir)
            return RunResult(logdir, state, [], {}, mapping)
        say(f"resumed        from step {start} ({ckpt.shown / str(start)})")
        if main:
            _keep_metrics_upto(logdir, start)
    elif main:
        _prepare_logdir(logdir)
    if main:
        (logdir / "config.yaml").write_text(dump_yaml(cfg))
        mapping_record = {**mapping, "processes": jax.process_count()}
        (logdir / "mapping.json").write_text(json.dumps(mapping_record, indent=2))

    t0 = time.perf_counter()
    first = global_tokens(ds, engine, cfg, 0)
    engine.train_step.lower(state, first).compile()
    say(f"compiled       train step in {time.perf_counter() - t0:.1f} s")

    losses, val_losses = [], {}
    profiler = StepProfiler(logdir, cfg.train.profile_steps, enabled=main)
    # The writer closes last: it waits for the last checkpoint to commit, then flushes.
    with MetricsWriter(logdir, enabled=main) as writer, ckpt:
        writer.text("config", "```\n" + dump_yaml(cfg) + "\n```")
        writer.text("mapping", "```\n" + format_mapping(mapping) + "\n```")
        writer.hparams({**flat_hparams(config_to_dict(cfg)), "processes": jax.process_count()})
        if not start:
            val_losses[0] = evaluate(ds, engine, cfg, state.params)
            writer.write({"step": 0, "val_loss": val_losses[0]}, prefix="val")
            say(f"step {0:>6}  val_loss {val_losses[0]:.4f}")
        try:
            state, losses = _train_steps(
                cfg, ds, engine, state, writer, val_losses, say, quiet, ckpt, profiler
            )
        finally:
            profiler.stop()  # an interrupted run still leaves a readable trace
    if main:
        write_eval_record(logdir, cfg)
    if profiler.trace is not None:
        say(f"profile        {profiler.trace} ({profiler.trace.stat().st_size:,} bytes)")
    _say_where(say, logdir)
    return RunResult(logdir, state, losses, val_losses, mapping, profiler.trace)


def write_eval_record(logdir: Path, cfg: Config) -> dict:
    """Write `<logdir>/eval.json` (atomically) from the run's `metrics.jsonl`; return it.

    Holds every evaluation (`evals`: step, val_loss), the final validation and training loss,
    the steps trained and configured, and the mean tokens/s of the logged steps.
    """
    records = read_metrics(logdir)
    evals = [{"step": r["step"], "val_loss": r["val_loss"]} for r in records if "val_loss" in r]
    train = [r for r in records if "loss" in r]
    speeds = [r["tokens_per_s"] for r in train if isinstance(r.get("tokens_per_s"), float)]
    record = {
        "steps_trained": max((r["step"] for r in records), default=0),
        "steps_total": cfg.train.steps,
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "final_loss": train[-1]["loss"] if train else None,
        "tokens_per_s_mean": float(np.mean(speeds)) if speeds else None,
        "evals": evals,
    }
    write_json_atomic(logdir / EVAL_FILE, record)
    return record


def _say_where(say, logdir: Path) -> None:
    say(f"logs           {logdir}/ ({METRICS_FILE}, {EVAL_FILE}, TensorBoard events, config.yaml)")
    say(
        f"tensorboard    make tensorboard LOGDIR={logdir.parent}   "
        f"(or: .venv/bin/jaxpod tensorboard {logdir.parent})"
    )


def _train_steps(cfg, ds, engine, state, writer, val_losses, say, quiet, ckpt, profiler):
    """The step loop proper, from `state.step` + 1. Returns the final state and the losses."""
    steps, log_every, eval_every = cfg.train.steps, cfg.train.log_every, cfg.train.eval_every
    every = cfg.train.checkpoint_every
    start = int(state.step)
    hide = quiet or not sys.stderr.isatty()
    bar = tqdm(total=steps, initial=start, unit="step", disable=hide, file=sys.stderr)
    # With a live progress bar, lines go above it; otherwise (CI, pipes) plain log lines.
    log = say if bar.disable else bar.write
    step_losses = []
    pending = []  # (step, metrics on device) not yet read to the host
    last_time, last_step = time.perf_counter(), start

    def flush(upto_done: bool) -> None:
        nonlocal last_time, last_step
        while pending and (upto_done or len(pending) > 1):
            step, metrics = pending.pop(0)
            host = {k: float(v) for k, v in jax.device_get(metrics).items()}
            step_losses.append(host["loss"])
            if step % log_every and step != steps:
                continue
            now = time.perf_counter()
            step_time = (now - last_time) / (step - last_step)
            last_time, last_step = now, step
            record = {"step": step, **host, "step_time_s": step_time}
            record["tokens_per_s"] = cfg.tokens_per_step / step_time
            writer.write(record)
            bar.set_postfix(loss=f"{host['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
            if bar.disable:
                log(
                    f"step {step:>6}/{steps}  loss {host['loss']:.4f}  "
                    f"lr {host['lr']:.2e}  {record['tokens_per_s']:,.0f} tok/s"
                )

    for step in range(start + 1, steps + 1):
        with profiler.step(step):
            state, metrics = engine.train_step(state, global_tokens(ds, engine, cfg, step - 1))
        pending.append((step, metrics))
        if profiler.stops_after(step):
            flush(upto_done=True)  # waits for the last traced step: it is whole in the trace
            profiler.stop((state, metrics))
            last_time, last_step = time.perf_counter(), step  # writing the trace is not a step
        flush(upto_done=False)  # reads step N-1 while step N runs
        bar.update(1)
        if (eval_every and step % eval_every == 0) or step == steps:
            flush(upto_done=True)
            val_losses[step] = evaluate(ds, engine, cfg, state.params)
            writer.write({"step": step, "val_loss": val_losses[step]}, prefix="val")
            log(f"step {step:>6}  val_loss {val_losses[step]:.4f}")
            # Steps up to `step` are all read (flushed above): time the next ones from here,
            # so evaluation is not charged to them.
            last_time, last_step = time.perf_counter(), step
        if (every and step % every == 0) or step == steps:
            ckpt.save(step, state, cfg.train.seed)  # async: returns once off-device
    flush(upto_done=True)
    bar.close()
    return state, step_losses
