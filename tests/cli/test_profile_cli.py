"""`jaxpod profile` and `train.profile_steps` end to end; the run record it leaves behind.

One `jaxpod profile` run (2 warm-up steps, 2 traced steps) is shared by the module: it checks
the trace, and the parts of the run record every run writes (eval.json, the HParams summary).
Its 4 steps make the train step the other CLI modules' tiny 4-step runs compile
(tests/cli/test_resume_cli.py): the session's compilation cache holds it once.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers.cli import TINY, assert_user_error, jaxpod

from jaxpod.run.metrics import read_metrics

pytestmark = pytest.mark.cli
FAST = ["train.eval_batches=1", "optim.warmup_steps=0"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    base = tmp_path_factory.mktemp("profile") / "tiny"
    # The config's logdir is overridden to `base`; `jaxpod profile` then writes into it as is.
    proc = jaxpod("profile", TINY, *FAST, f"train.logdir={base}", "--steps", "2", "--warmup", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return base, proc


def test_profile_writes_a_trace_of_the_steps(profiled):
    logdir, proc = profiled
    traces = list((logdir / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1, traces
    data = traces[0].read_bytes()
    assert len(data) > 0
    assert b"train" in data and b"step_num" in data  # the StepTraceAnnotation of each step
    assert f"profile        {traces[0]}" in proc.stdout
    assert f"open it        .venv/bin/jaxpod tensorboard {logdir}" in proc.stdout
    # 2 warm-up + 2 traced steps, every step logged, no periodic evaluation.
    records = read_metrics(logdir)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "val_loss" in r] == [0, 4]


def test_eval_record(profiled):
    logdir, _ = profiled
    record = json.loads((logdir / "eval.json").read_text())
    vals = {r["step"]: r["val_loss"] for r in read_metrics(logdir) if "val_loss" in r}
    train = [r for r in read_metrics(logdir) if "loss" in r]
    assert record["evals"] == [{"step": s, "val_loss": v} for s, v in vals.items()]
    assert record["final_val_loss"] == vals[4]
    assert record["final_loss"] == train[-1]["loss"]
    assert record["steps_trained"] == record["steps_total"] == 4
    mean = sum(r["tokens_per_s"] for r in train) / len(train)
    assert record["tokens_per_s_mean"] == pytest.approx(mean)
    assert not list(logdir.glob("*.tmp"))  # written atomically, nothing left over


def test_hparams_summary_is_readable_by_tensorboard(profiled):
    """The HParams plugin's own backend finds the run, its hparams and its metrics."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import backend_context, metadata

    logdir, _ = profiled
    root = str(logdir.parent)
    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(root)
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, root)
    hparams = backend_context.Context(
        base_plugin.TBContext(data_provider=provider, multiplexer=multiplexer, logdir=root)
    )
    request = context.RequestContext()
    found = hparams.hparams_metadata(request, "")
    (run,) = found
    info = metadata.parse_session_start_info_plugin_data(
        found[run][metadata.SESSION_START_INFO_TAG]
    )
    assert info.hparams["mesh.replica"].number_value == 2
    assert info.hparams["model.layers"].number_value == 4
    assert info.hparams["optim.lr"].number_value == pytest.approx(3e-3)
    assert info.hparams["optim.name"].string_value == "adamw"
    assert info.hparams["train.profile_steps"].string_value == "[3, 5]"
    assert info.hparams["processes"].number_value == 1

    experiment = hparams.experiment_from_metadata(
        request, "", True, found, hparams.hparams_from_data_provider(request, "", None)
    )
    assert {"mesh.replica", "model.layers", "optim.lr"} <= {h.name for h in experiment.hparam_infos}
    metrics = {(m.name.group, m.name.tag) for m in experiment.metric_infos}
    assert ("", "train/loss") in metrics and ("", "val/val_loss") in metrics


def test_profile_steps_beyond_the_run_is_refused(tmp_path):  # before jax starts: fast
    proc = jaxpod(
        "train", TINY, "train.steps=4", "train.profile_steps=[3,7]", f"train.logdir={tmp_path}"
    )
    assert_user_error(proc, "train.profile_steps=[3, 7]", "train.steps=4", "stop <= 5")
    assert not (tmp_path / "metrics.jsonl").exists()
