"""`jaxpod plan` and `jaxpod compile` through the CLI (subprocesses: each sets its devices)."""

from __future__ import annotations

import json

import pytest
from helpers import ROOT
from helpers.cli import assert_user_error, jaxpod

pytestmark = pytest.mark.cli

REQUIRED = (
    "devices replica pipeline tensor micro_batch grad_accum global_batch params "
    "weight_fraction_per_device bytes_per_device device_memory_bytes fits"
).split()
PER_DEVICE = "weights grads optimizer activations device_total host_total".split()


def test_plan_json_has_every_key():
    proc = jaxpod("plan", str(ROOT / "configs" / "demo.yaml"), "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert set(REQUIRED) <= set(plan)
    assert set(PER_DEVICE) <= set(plan["bytes_per_device"])
    assert (plan["devices"], plan["global_batch"]) == (8, 32)
    assert plan["weight_fraction_per_device"] == pytest.approx(1 / 4)  # t=2 x p=2


def test_plan_table_of_an_efficientnet_pod():
    proc = jaxpod("plan", str(ROOT / "configs" / "efficientnet_b4_g16_pod256.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert "256 = replica 128 x pipeline 2 x tensor 1" in proc.stdout
    assert "6144 = micro_batch 3 x replica 128 x grad_accum 16" in proc.stdout
    assert "19,325,576 params" in proc.stdout


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["memory.device=ipu9000"], ["memory.device", "ipu-gc200"]),
        (["memory.rts=3"], ["memory.rts=3", "mesh.replica"]),
        (["memory.phases=8"], ["memory.phases=8", "model.layers=4"]),
        (["memory.offload=[disk]"], ["memory.offload", "disk"]),
        (["model.pipeline_splits=[4a]"], ["model.pipeline_splits", "efficientnet"]),
        (["--jsn"], ["unrecognized arguments: --jsn", "see jaxpod --help"]),
        (["--chart", str(ROOT / "README.md" / "x.png")], ["--chart", "README.md is a file"]),
    ],
    ids=["profile", "rts", "phases", "offload", "splits", "flag", "chart-under-a-file"],
)
def test_plan_bad_input_is_one_line(args, needles):
    assert_user_error(jaxpod("plan", str(ROOT / "configs" / "demo.yaml"), *args), *needles)


CONFIG_ERRORS = [  # (a preset, or the text of a config file; overrides; the error's words)
    ("efficientnet_digits.yaml", ["model.pipeline_splits=[9z]"], "model.pipeline_splits=['9z']"),
    ("tiny.yaml", ["train.seed=-1"], "train.seed=-1 must be in [0, 2**32)"),
    ("tiny.yaml", ["train.micro_batch=100000000"], "train.micro_batch=100000000 makes"),
    ("train:\n  steps: 5\n  steps: 7\n", [], "key 'train.steps' is given twice (lines 2 and 3)"),
    ("memory:\n  mlp_panel: 2\n", [], "unknown config key 'memory.mlp_panel'; did you mean"),
]


@pytest.mark.parametrize(
    ("config", "overrides", "needle"),
    CONFIG_ERRORS,
    ids=["splits-unknown", "seed", "tokens-over-int32", "duplicate-key", "unknown-key"],
)
def test_plan_bad_config_is_one_line(tmp_path, config, overrides, needle):
    """A bad config file or value is one line and exit 2, a key given twice included."""
    path = ROOT / "configs" / config
    if not config.endswith(".yaml"):
        path = tmp_path / "c.yaml"
        path.write_text(config)
    assert_user_error(jaxpod("plan", str(path), *overrides), needle)


def test_compile_from_abstract_shapes():
    proc = jaxpod("compile", str(ROOT / "configs" / "tiny.yaml"), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["devices"] == 8 and out["global_batch"] == 16
    assert out["temp_bytes"] > 0 and out["argument_bytes"] >= out["state_bytes_per_device"] > 0


def test_compile_shows_each_phase_as_it_begins():
    """Without --json each stage is named on stderr as it begins (then its elapsed time every
    15 s without a terminal: tests/run/test_progress.py); a preset by name."""
    proc = jaxpod("compile", "tiny")
    assert proc.returncode == 0, proc.stderr
    phases = [line for line in proc.stderr.splitlines() if not line.endswith(" s")]
    assert phases == [
        "jaxpod: building the abstract state on 8 cpu devices ...",
        "jaxpod: lowering the train step ...",
        "jaxpod: compiling it with XLA:CPU ...",
    ], proc.stderr
    assert proc.stdout.startswith("mesh           8 cpu devices")
    # plan's decimal units; XLA's all-kinds arguments and the device's share labelled apart
    assert "MiB" not in proc.stdout and " MB" in proc.stdout
    assert "XLA's memory analysis: arguments" in proc.stdout and "\ndevice args " in proc.stdout


def test_train_over_the_device_budget_is_refused_before_running(tmp_path):
    logdir = tmp_path / "run"
    proc = jaxpod(
        "train",
        str(ROOT / "configs" / "tiny.yaml"),
        "memory.device_budget=1MB",
        f"train.logdir={logdir}",
    )
    assert_user_error(proc, "memory.device_budget=1MB: the plan needs", "per device", "weights")
    assert not logdir.exists()  # nothing was started, nothing written


def test_plan_for_a_target_is_the_plan_on_its_profile_and_chips():
    """`plan --target tpu-v5e:4x4` plans the config on 16 chips of the `tpu-v5e` profile:
    the same plan as naming both in the config; a mesh of another size is one line."""
    tiny = str(ROOT / "configs" / "tiny.yaml")
    proc = jaxpod("plan", tiny, "mesh.replica=-1", "--target", "tpu-v5e:4x4", "--json")
    assert proc.returncode == 0, proc.stderr
    named = jaxpod("plan", tiny, "mesh.replica=-1", "devices=16", "memory.device=tpu-v5e", "--json")
    assert named.returncode == 0, named.stderr
    targeted = json.loads(proc.stdout)
    assert (targeted["devices"], targeted["replica"]) == (16, 4)
    assert targeted == json.loads(named.stdout)
    assert_user_error(jaxpod("plan", tiny, "--target", "tpu-v5e:4x4"), "has 16 chips but the mesh")
    assert_user_error(
        jaxpod("plan", tiny, "memory.device=tpu-v4", "--target", "tpu-v5e:2x4"),
        "drop memory.device=",
    )
