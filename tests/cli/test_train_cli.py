"""`jaxpod train` end to end, in subprocesses (each sets its own virtual device count)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from helpers.cli import TINY, assert_user_error, jaxpod

from jaxpod.run.metrics import read_metrics

pytestmark = pytest.mark.cli


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (["mesh.replica=2", "mesh.pipeline=2", "mesh.tensor=1"], ["devices=8", "mesh"]),
        (["model.layers=5"], ["model.layers=5", "mesh.pipeline=2"]),
        (["model.heads=3", "model.d_model=66"], ["mesh.tensor=2", "model.heads=3"]),
        (["model.d_ff=255"], ["mesh.tensor=2", "model.d_ff=255"]),
        (["model.vocab=257"], ["mesh.tensor=2", "model.vocab=257"]),
        (["train.global_batch=10", "train.grad_accum=null"], ["train.global_batch=10"]),
        (["model.layer=4"], ["model.layer", "model.layers"]),
        (["model.remat=fast"], ["model.remat", "fast"]),
        (["data.name=text-files", "data.path=/no/such/dir"], ["data.path", "/no/such/dir"]),
    ],
    ids=[
        "mesh-vs-devices",
        "layers-vs-pipeline",
        "heads-vs-tensor",
        "dff-vs-tensor",
        "vocab-vs-tensor",
        "global-batch",
        "unknown-key",
        "unknown-remat",
        "missing-data-path",
    ],
)
def test_bad_input_is_one_line_error(overrides, needles, tmp_path):
    proc = jaxpod("train", TINY, f"train.logdir={tmp_path / 'run'}", *overrides)
    assert_user_error(proc, *needles)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_yaml_that_does_not_parse(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  layers: [4\n")
    assert_user_error(jaxpod("train", str(bad)), "bad.yaml", "does not parse")


def test_data_path_without_text(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    proc = jaxpod("train", TINY, "data.name=text-files", f"data.path={empty}")
    assert_user_error(proc, "data.path")


def test_bad_override_syntax():
    assert_user_error(jaxpod("train", TINY, "mesh.tensor"), "CONFIG", "mesh.tensor")
    assert_user_error(jaxpod("train", TINY, "=2"), "=2", "KEY=VALUE")


def _losses(logdir: Path) -> tuple[np.ndarray, list[dict]]:
    records = read_metrics(logdir)
    train = [r for r in records if "loss" in r]
    return np.array([r["loss"] for r in train]), records


def test_same_losses_on_every_mesh_through_the_cli(tmp_path):
    """The same config on (1,1,1) and (2,2,2) with equal global batch trains identically."""
    common = ["train.steps=4", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1"]
    common += ["train.global_batch=16", "train.grad_accum=null", "optim.warmup_steps=0"]
    runs = {}
    for name, mesh in {"single": "1,1,1", "pod": "2,2,2"}.items():
        r, p, t = mesh.split(",")
        devices = int(r) * int(p) * int(t)
        micro = 16 // (int(r) * 4)  # grad_accum 4 on both meshes
        proc = jaxpod(
            "train",
            *common,
            TINY,  # overrides may come before or after the config
            f"devices={devices}",
            f"mesh.replica={r}",
            f"mesh.pipeline={p}",
            f"mesh.tensor={t}",
            f"train.micro_batch={micro}",
            f"train.logdir={tmp_path / name}",
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name], records = _losses(tmp_path / name)
        assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
        for key in ("step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s"):
            assert all(key in r for r in records if "loss" in r), key
        assert any("val_loss" in r for r in records)
        assert (tmp_path / name / "config.yaml").exists()
        assert list((tmp_path / name).glob("events.out.tfevents.*"))
        assert "mesh: replica" in proc.stdout and "global batch   16" in proc.stdout
        # no terminal: the phases it waits in are named, step lines carry elapsed and ETA
        assert "compiling      the train step ...\ncompiled       train step in" in proc.stdout
        assert re.search(r"step +4/4  loss .* tokens/s  elapsed \d+ s  eta 0 s\n", proc.stdout)
    # fp32, different reduction order across 8 devices; Adam over 4 steps: measured at most
    # 9.6e-8 relative; the bound is 1e-6, about 8 float32 ulps.
    np.testing.assert_allclose(runs["pod"], runs["single"], rtol=1e-6, atol=0)
    assert runs["pod"][-1] < runs["pod"][0]  # and it is actually training
