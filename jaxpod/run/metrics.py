"""The run record: `metrics.jsonl` (one JSON object per logged step) and TensorBoard events.

Writes happen on a background thread so the training loop never waits for the disk. Every
write is checked (`jaxpod.run.record`): the first that fails is kept as `MetricsWriter.failure`
and the records from then on as `unwritten`, so the loop can stop and save them in a checkpoint.
The TensorBoard events are written with TensorBoard's protos and record framing (no
TensorFlow needed): scalars under `train/...` and `val/...`, the resolved config as a
text summary, and the run's hyperparameters (the flattened config) as an HParams
`session_start_info` summary, which TensorBoard's HParams tab reads to put runs side by side
(it infers the experiment, hence the metrics `train/loss`, `val/val_loss`, ..., from the runs).
`eval.json` holds the evaluation results, written atomically when the run ends.
"""

from __future__ import annotations

import json
import math
import os
import queue
import socket
import threading
import time
from itertools import count
from pathlib import Path

import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tensorboard.plugins.hparams import plugin_data_pb2
from tensorboard.plugins.text import metadata as text_metadata

from jaxpod.config import Config
from jaxpod.run.record import AppendFile, RecordWriteError, event_record, write_atomic

METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.json"
WRITER = "jaxpod"  # the writer its event files name in their first event
HParamValue = bool | int | float | str


def _scalar_event(step: int, values: dict[str, float], prefix: str) -> event_pb2.Event:
    summary = summary_pb2.Summary(
        value=[
            summary_pb2.Summary.Value(tag=f"{prefix}/{k}", simple_value=float(v))
            for k, v in values.items()
            if isinstance(v, int | float) and k != "step"
        ]
    )
    return event_pb2.Event(wall_time=time.time(), step=step, summary=summary)


def _text_event(tag: str, text: str) -> event_pb2.Event:
    tensor = tensor_pb2.TensorProto(
        dtype="DT_STRING",
        string_val=[text.encode()],
        tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[]),
    )
    meta = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name=text_metadata.PLUGIN_NAME,
            content=text_metadata.create_summary_metadata("", "").plugin_data.content,
        )
    )
    value = summary_pb2.Summary.Value(tag=tag, metadata=meta, tensor=tensor)
    return event_pb2.Event(
        wall_time=time.time(), step=0, summary=summary_pb2.Summary(value=[value])
    )


def flat_hparams(nested: dict, prefix: str = "") -> dict[str, HParamValue]:
    """`{"mesh.replica": 2, "optim.lr": 0.003, ...}` of a nested config dict.

    Lists become their string form (the HParams tab has no list type); `None` values are left
    out (a key that is null in one run and a string in another would have no single type).
    """
    out: dict[str, HParamValue] = {}
    for key, value in nested.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_hparams(value, name + "."))
        elif isinstance(value, list | tuple):
            out[name] = str(list(value))
        elif value is not None:
            out[name] = value
    return out


def hparams_event(hparams: dict[str, HParamValue], group: str = "") -> event_pb2.Event:
    """An HParams-plugin `session_start_info` summary (what `hp.hparams()` writes, sans TF)."""
    info = plugin_data_pb2.SessionStartInfo(group_name=group, start_time_secs=time.time())
    for name, value in hparams.items():
        if isinstance(value, bool):
            info.hparams[name].bool_value = value
        elif isinstance(value, int | float):
            info.hparams[name].number_value = value
        else:
            info.hparams[name].string_value = str(value)
    meta = hparams_metadata.create_summary_metadata(
        plugin_data_pb2.HParamsPluginData(session_start_info=info)
    )
    value = summary_pb2.Summary.Value(
        tag=hparams_metadata.SESSION_START_INFO_TAG,
        metadata=meta,
        tensor=hparams_metadata.NULL_TENSOR,
    )
    return event_pb2.Event(
        wall_time=time.time(), step=0, summary=summary_pb2.Summary(value=[value])
    )


def write_json_atomic(path: str | Path, data: object) -> None:
    """Write `data` as JSON to `path` through a temporary file renamed into place
    (`RecordWriteError` if it fails, no temporary file left)."""
    write_atomic(path, json.dumps(_clean_tree(data), indent=2) + "\n")


def _clean_tree(data):
    if isinstance(data, dict):
        return {str(k): _clean_tree(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [_clean_tree(v) for v in data]
    return _clean(data)


def _clean(value):
    """JSON-safe: floats stay floats, NaN/inf become strings (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


_EVENT_FILES = count()


def _events_name() -> str:
    """A new event file's name, as TensorBoard's own writer names it."""
    stamp, host = f"{int(time.time()):010d}", socket.gethostname()
    return f"events.out.tfevents.{stamp}.{host}.{os.getpid()}.{next(_EVENT_FILES)}"


class MetricsWriter:
    """Append-only writer of `<logdir>/metrics.jsonl` and a TensorBoard event file.

    `write(record, prefix)`: `record` must hold `step`; numeric values become scalars
    `<prefix>/<key>` in TensorBoard. A record is in both files or in neither. After the
    first failed write (`failure`, a `RecordWriteError`) nothing more is written and the
    records are kept in `unwritten` (`(prefix, record)` pairs); `sync()` waits until every
    record handed over so far is written or kept. Call `close()` (or use as a context manager).
    """

    def __init__(self, logdir: str | Path, enabled: bool = True):
        self.logdir = Path(logdir)
        self.enabled = enabled
        self.failure: RecordWriteError | None = None
        self.unwritten: list[tuple[str, dict]] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        if enabled:
            self.logdir.mkdir(parents=True, exist_ok=True)
            self._jsonl = AppendFile(self.logdir / METRICS_FILE)
            self._events = AppendFile(self.logdir / _events_name())
            version = event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2")
            version.source_metadata.writer = WRITER
            self._events.append(event_record(version.SerializeToString()))
            self._thread = threading.Thread(target=self._drain, daemon=True)
            self._thread.start()

    def _drain(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._handle(*item)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _handle(self, kind: str, payload) -> None:
        if self.failure is None:
            try:
                self._write(kind, payload)
                return
            except RecordWriteError as exc:
                self.failure = exc
        if kind == "record":  # after the failure: kept, for the checkpoint
            record, prefix = payload
            self.unwritten.append((prefix, record))

    def _write(self, kind: str, payload) -> None:
        if kind == "record":
            record, prefix = payload
            line = json.dumps({k: _clean(v) for k, v in record.items()}) + "\n"
            size = self._jsonl.size()
            self._jsonl.append(line.encode())
            event = _scalar_event(int(record["step"]), record, prefix)
        else:
            size, event = None, (hparams_event if kind == "hparams" else _text_event)(*payload)
        try:
            self._events.append(event_record(event.SerializeToString()))
        except RecordWriteError:
            if size is not None:
                self._jsonl.cut(size)  # in neither file
            raise

    def write(self, record: dict, prefix: str = "train") -> None:
        if self.enabled:
            self._queue.put(("record", (record, prefix)))

    def text(self, tag: str, text: str) -> None:
        if self.enabled:
            self._queue.put(("text", (tag, text)))

    def hparams(self, hparams: dict[str, HParamValue], group: str = "") -> None:
        """Record the run's hyperparameters for TensorBoard's HParams tab (once per run)."""
        if self.enabled:
            self._queue.put(("hparams", (hparams, group)))

    def sync(self) -> None:
        """Wait until every record handed over so far is written (or kept in `unwritten`)."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._events.close()
            self._jsonl.close()
            self._thread = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(logdir: str | Path) -> list[dict]:
    """All records of `<logdir>/metrics.jsonl`, in order."""
    path = Path(logdir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_eval_record(logdir: Path, cfg: Config, unit: str = "tokens") -> dict:
    """Write `<logdir>/eval.json` (atomically) from the run's `metrics.jsonl`; return it.

    Holds every evaluation (`evals`: step, val_loss[, val_accuracy]), the final validation
    and training loss (and accuracy for classifiers), the steps trained and configured, and
    the mean `<unit>_per_s` (tokens or images) of the logged steps.
    """
    records = read_metrics(logdir)
    evals = [
        {k: v for k, v in r.items() if k in ("step", "val_loss", "val_accuracy")}
        for r in records
        if "val_loss" in r
    ]
    train = [r for r in records if "loss" in r]
    rate = f"{unit}_per_s"
    speeds = [r[rate] for r in train if isinstance(r.get(rate), float)]
    record = {
        "steps_trained": max((r["step"] for r in records), default=0),
        "steps_total": cfg.train.steps,
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "final_loss": train[-1]["loss"] if train else None,
        f"{rate}_mean": float(np.mean(speeds)) if speeds else None,
        "evals": evals,
    }
    if evals and "val_accuracy" in evals[-1]:
        record["final_val_accuracy"] = evals[-1]["val_accuracy"]
    write_json_atomic(logdir / EVAL_FILE, record)
    return record
