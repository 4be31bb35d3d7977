"""Resuming honestly (`jaxpod.run.resume`), jax-free: which config changes are refused, how the
record is cut back to the checkpoint, refilled and kept free of duplicate TensorBoard steps
(end to end: tests/cli/test_resume_cli.py)."""

from __future__ import annotations

import json

import pytest
from helpers import make_tiny_cfg

from jaxpod.config import config_to_dict
from jaxpod.errors import UserError
from jaxpod.run.metrics import MetricsWriter, read_metrics
from jaxpod.run.resume import (
    check_changes,
    earlier_record,
    keep_config,
    keep_records_upto,
    lost_records,
    records_upto,
    trim_events,
)


def _dict(*overrides: str) -> dict:
    return config_to_dict(make_tiny_cfg(*overrides))


@pytest.mark.parametrize(
    "override, key",
    [
        ("optim.lr=0.001", "optim.lr"),
        ("train.steps=40", "train.steps"),
        ("optim.lr_schedule=constant", "optim.lr_schedule"),
        ("data.name=synthetic", "data.name"),
        ("train.global_batch=32", "train.global_batch"),
    ],
)
def test_changes_that_move_the_results_are_refused(override, key):
    extra = ["train.grad_accum=null"] if key == "train.global_batch" else []
    with pytest.raises(UserError) as err:
        check_changes(_dict(), _dict(override, *extra), 4, "runs/x (step 4)")
    line = str(err.value)
    assert line.startswith("runs/x (step 4) was trained to step 4 with another config (")
    assert f"{key} " in line and f"--allow-changes {key}" in line and "\n" not in line


def test_the_diff_names_old_and_new_values_and_allow_accepts_them():
    old, new = _dict(), _dict("optim.lr=0.001", "train.steps=40")
    with pytest.raises(UserError, match=r"optim.lr 0.003 -> 0.001, train.steps 20 -> 40\)"):
        check_changes(old, new, 4, "x")
    changes = check_changes(old, new, 4, "x", allow=["optim", "train.steps"])
    assert [c[0] for c in changes] == ["optim.lr", "train.steps"]
    assert check_changes(old, new, 4, "x", allow=["all"])


def test_how_a_step_runs_may_change_freely():
    new = _dict("mesh.replica=1", "mesh.tensor=4", "train.grad_accum=8")  # global batch 16
    changes = check_changes(_dict(), new, 4, "x")
    assert {c[0] for c in changes} == {"mesh.replica", "mesh.tensor", "train.grad_accum"}


def test_long_values_are_cut_in_the_message():
    with pytest.raises(UserError) as err:
        check_changes(_dict(), _dict("data.name=text-files", f"data.path={'p' * 5000}"), 4, "x")
    assert len(str(err.value)) < 400


def test_old_config_is_kept(tmp_path):
    (tmp_path / "config.yaml").write_text("old")
    assert keep_config(tmp_path, 4) == tmp_path / "config.until-4.yaml"
    assert (tmp_path / "config.until-4.yaml").read_text() == "old"


def _record(logdir, steps, val_at=()):
    with MetricsWriter(logdir) as writer:
        for step in steps:
            writer.write({"step": step, "loss": float(step)})
            if step in val_at:
                writer.write({"step": step, "val_loss": 1.0}, prefix="val")


def test_records_after_the_checkpoint_go_and_lost_ones_come_back(tmp_path):
    _record(tmp_path, [1, 2, 3, 4, 5], val_at=(2, 4))
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "lo')  # cut short by a kill
    keep_records_upto(tmp_path, 4)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 2, 3, 4, 4]
    kept = [["train", {"step": 4, "loss": 4.0}], ["val", {"step": 4, "val_loss": 1.0}]]
    assert lost_records(tmp_path, kept) == []
    keep_records_upto(tmp_path, 3)
    assert [list(r) for r in lost_records(tmp_path, kept)] == kept


def test_event_files_drop_the_steps_that_are_redone(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _record(tmp_path, [1, 2, 3, 4, 5, 6])
    assert trim_events(tmp_path, 4) == 2
    _record(tmp_path, [5, 6])  # the resumed run's own event file
    files = sorted(tmp_path.glob("events.out.tfevents.*"))
    assert len(files) == 2
    steps = []
    for path in files:
        acc = EventAccumulator(str(path))
        acc.Reload()
        steps += [e.step for e in acc.Scalars("train/loss")]
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]


def test_a_fresh_start_names_the_record_it_replaces(tmp_path):
    assert earlier_record(tmp_path) is None
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 7, "loss": 1.0}) + "\n")
    assert earlier_record(tmp_path) == (
        "the record of an earlier run (to step 7, no checkpoint to resume from)"
    )


@pytest.mark.parametrize("last", ['{"step": "x"}', '{"loss": 1.0}', "[]", '{"step": 6, "lo'])
def test_a_damaged_last_line_is_left_out_saying_so(tmp_path, last):
    _record(tmp_path, [1, 2, 3])
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(last + "\n")
    text, note = records_upto(tmp_path, 2)
    assert [json.loads(line)["step"] for line in text.splitlines()] == [1, 2]
    assert note.startswith(f"the last line of {tmp_path}/metrics.jsonl is damaged (")


def test_a_damaged_line_before_the_last_is_refused_changing_nothing(tmp_path):
    _record(tmp_path, [1])
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": "x"}\n{"step": 2, "loss": 2.0}\n')
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(UserError, match=r"metrics.jsonl line 2 is damaged \({\"step\": \"x\"}"):
        keep_records_upto(tmp_path, 2)
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert earlier_record(tmp_path) == (
        "the record of an earlier run (to step 2, no checkpoint to resume from)"
    )
