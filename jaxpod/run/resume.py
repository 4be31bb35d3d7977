"""Resuming honestly: the config may change only where the results cannot; each step recorded once.

A checkpoint keeps the config that trained it. On resume the new config is compared with it:
keys that only change *how* the same steps run (the mesh and devices with the same global
batch, remat, pipeline schedule, memory layout, logging and checkpoint cadence: `FREE`) may
change; any other difference (train.steps and optim.* move the learning rate of every later
step, data.*, train.global_batch and precision.* change what is computed) is refused in one
line listing the keys, unless the user allows them (`--allow-changes KEY,...` or `all`). When
anything changed, the old `config.yaml` is kept as `config.until-<step>.yaml`.

The record is made consistent with the checkpoint resumed from: `metrics.jsonl` keeps the
records up to its step (the later ones are redone), the records of that step kept in the
checkpoint are written again if the record lost them (a kill right after the commit), and
TensorBoard event files drop the summaries of the steps that will be redone, so every step
appears once. A fresh start replaces an earlier jaxpod run's record, and only jaxpod's files: in
a directory shared with other files (`--logdir-exists ok`, remembered in `mapping.json`) only
the event files jaxpod wrote and neither profile traces nor anything else. jax-free.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Collection, Iterable
from pathlib import Path

from jaxpod.errors import UserError
from jaxpod.run.logdir import LOCK_FILE, MAPPING, is_run
from jaxpod.run.metrics import EVAL_FILE, METRICS_FILE, WRITER
from jaxpod.run.profiling import PROFILE_DIR
from jaxpod.run.record import event_record, write_atomic

FREE = (
    "devices",
    "mesh.",
    "memory.",
    "model.remat",
    "model.sequence_chunks",
    "model.sequence_parallel",
    "train.micro_batch",
    "train.grad_accum",
    "train.batch_parts",
    "train.pipeline_group",
    "train.pipeline_schedule",
    "train.virtual_stages",
    "train.skip_bubbles",
    "train.logdir",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.profile_steps",
    "data.prefetch",
    "data.workers",
)  # keys (or prefixes ending in '.') that may change on resume without --allow-changes
EVENTS_GLOB = "events.out.tfevents.*"


def _flat(nested: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _is_free(key: str) -> bool:
    return any(key == f or (f.endswith(".") and key.startswith(f)) for f in FREE)


def _short(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."


def config_changes(saved: dict, new: dict) -> list[tuple[str, object, object]]:
    """(key, saved value, new value) of every dotted key that differs, in key order."""
    old, now = _flat(saved), _flat(new)
    return [
        (k, old.get(k), now.get(k)) for k in sorted(set(old) | set(now)) if old.get(k) != now.get(k)
    ]


def check_changes(
    saved: dict, new: dict, step: int, where: str, allow: Collection[str] = ()
) -> list[tuple[str, object, object]]:
    """The config changes since checkpoint `step` (saved at `where`); one-line `UserError` if
    any of them is neither `FREE` nor in `allow` (dotted keys, section prefixes like `optim`,
    or `all`)."""
    changes = config_changes(saved, new)
    allowed = lambda k: "all" in allow or any(k == a or k.startswith(a + ".") for a in allow)  # noqa: E731
    refused = [c for c in changes if not _is_free(c[0]) and not allowed(c[0])]
    if refused:
        shown = ", ".join(f"{k} {_short(a)} -> {_short(b)}" for k, a, b in refused[:6])
        more = f" and {len(refused) - 6} more" if len(refused) > 6 else ""
        keys = ",".join(k for k, _, _ in refused)
        raise UserError(
            f"{where} was trained to step {step} with another config ({shown}{more}); "
            f"resume with the same values, or accept the change with --allow-changes {keys} "
            "(the old config is kept as config.until-<step>.yaml), or use a fresh train.logdir"
        )
    return changes


def keep_config(logdir: Path, step: int) -> Path | None:
    """Keep the current `config.yaml` as `config.until-<step>.yaml` (the config that trained
    the steps up to `step`) before a resume with another config rewrites it."""
    current, kept = logdir / "config.yaml", logdir / f"config.until-{step}.yaml"
    if not current.is_file():
        return None
    if kept.exists():  # resumed from the same step twice: keep the first config seen there
        current.unlink()
    else:
        current.replace(kept)
    return kept


def _step_of(line: str) -> int | None:
    """The step of a record line; None if the line is no record with a step (damaged)."""
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError, IndexError):  # e.g. cut short by a killed run
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def records_upto(logdir: Path, step: int) -> tuple[str | None, str | None]:
    """`(text, note)`: the `metrics.jsonl` records up to `step` (None: no such file), and a
    note if its last line is damaged (cut short, or no record with a step) and left out. A
    damaged line before the last is a one-line `UserError`: nothing is changed by reading."""
    path = logdir / METRICS_FILE
    if not path.exists():
        return None, None
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    kept, note = [], None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        at = _step_of(line)
        if at is None and number == len(lines):
            note = f"the last line of {path} is damaged ({_short(line)}): left out"
        elif at is None:
            raise UserError(
                f"{path} line {number} is damaged ({_short(line)}: no record with a step); "
                "repair or delete that line, then run the same command to resume"
            )
        elif at <= step:
            kept.append(line + "\n")
    return "".join(kept), note


def keep_records_upto(logdir: Path, step: int, text: str | None = None) -> None:
    """Drop the `metrics.jsonl` records after `step` (a resumed run redoes those steps):
    keep `text` (`records_upto`'s, computed here if not given)."""
    if text is None:
        text, _ = records_upto(logdir, step)
    if text is not None:
        write_atomic(logdir / METRICS_FILE, text)


def _kind(record: dict) -> str:
    return "val" if "val_loss" in record else "train"


def lost_records(logdir: Path, records: Iterable[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """The (prefix, record) pairs kept in a checkpoint that `metrics.jsonl` lacks."""
    have = set()
    path = logdir / METRICS_FILE
    if path.exists():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
                have.add((record["step"], _kind(record)))
            except (ValueError, KeyError, TypeError):
                continue
    return [(p, r) for p, r in records if (r.get("step"), _kind(r)) not in have]


def trim_events(logdir: Path, step: int) -> int:
    """Drop the summaries of steps after `step` from the TensorBoard event files (rewritten
    in place, atomically); returns how many were dropped."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto import event_pb2

    dropped = 0
    for path in sorted(logdir.glob(EVENTS_GLOB)):
        try:
            raw = list(RawEventFileLoader(str(path)).Load())
        except Exception:  # noqa: S112 - an unreadable file is left as it is
            continue
        keep = []
        for data in raw:
            event = event_pb2.Event.FromString(data)
            if event.HasField("summary") and event.step > step:
                continue
            keep.append(data)
        if len(keep) == len(raw):
            continue
        dropped += len(raw) - len(keep)
        write_atomic(path, b"".join(event_record(data) for data in keep))
    return dropped


def earlier_record(logdir: Path) -> str | None:
    """What a fresh start in `logdir` replaces ("the record of N steps"), or None."""
    path = logdir / METRICS_FILE
    if not path.is_file():
        return None
    steps = [s for s in map(_step_of, path.read_text(errors="replace").splitlines()) if s]
    if not steps:
        return None
    return f"the record of an earlier run (to step {max(steps)}, no checkpoint to resume from)"


def check_saved_config(saved: object, where: str) -> dict:
    """The saved config as a dict; one-line `UserError` if there is none to compare with."""
    if not isinstance(saved, dict):
        raise UserError(
            f"{where} keeps no config to compare the new one with; use a fresh train.logdir"
        )
    return saved


def is_shared(logdir: Path) -> bool:
    """True if the run in `logdir` shares it with files that are not jaxpod's (its
    `mapping.json` says so)."""
    try:
        mapping = json.loads((logdir / MAPPING).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(mapping, dict) and mapping.get("shared_directory") is True


def start_fresh(logdir: Path, say) -> bool:
    """Start a fresh record in `logdir`, replacing an earlier jaxpod run's (saying so), and
    only jaxpod's files; returns True if the directory holds files that are not jaxpod's."""
    logdir.mkdir(parents=True, exist_ok=True)
    if not is_run(logdir):
        return any(p.name != LOCK_FILE for p in logdir.iterdir())
    shared = is_shared(logdir)
    earlier = earlier_record(logdir)
    if earlier:
        say(f"fresh start    replacing {earlier} in {logdir}")
    events = [e for e in sorted(logdir.glob(EVENTS_GLOB)) if not shared or _ours(e)]
    for old in [logdir / METRICS_FILE, logdir / EVAL_FILE, *events]:
        old.unlink(missing_ok=True)
    if not shared:
        shutil.rmtree(logdir / PROFILE_DIR, ignore_errors=True)
    return shared


def _ours(events: Path) -> bool:
    """True if the event file `events` was written by jaxpod (its first event says so)."""
    from tensorboard.compat.proto import event_pb2

    try:
        with open(events, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            f.read(4)
            first = event_pb2.Event.FromString(f.read(min(length, 4096)))
    except Exception:  # noqa: BLE001 - unreadable (protobuf raises its own errors): not ours
        return False
    return first.source_metadata.writer == WRITER
