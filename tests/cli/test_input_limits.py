"""What the CLI reads before jax starts, and how it refuses: bounded YAML (no alias bombs),
empty configs, unbounded values, the host's RAM, the run directory in the way, `jaxpod runs`
and `jaxpod tensorboard` on odd input, and every documented command line parses."""

from __future__ import annotations

import re
import shlex

import pytest
from helpers import ROOT
from helpers.cli import TINY, assert_user_error, cli_env, jaxpod, without_jax

from jaxpod.config import load_config
from jaxpod.errors import ConfigError

# ~400 bytes of nested aliases that stand for 10^9 list items: anything that walks or prints
# the value (a config check, `jaxpod runs` formatting model.layers) spins at gigabytes.
BOMB = "x0: &a0 [1,1,1,1,1,1,1,1,1,1]\n" + "".join(
    f"x{i}: &a{i} [{','.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9)
)
BOMB += "devices: 8\nmodel: {name: gpt, layers: *a8, d_model: 64}\n"


def test_aliases_are_refused_before_they_expand(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    # refused at the first alias it meets (expanded, the bomb is 10**9 list items)
    with pytest.raises(ConfigError, match=r"alias \*a0 at line 2: aliases are not supported"):
        load_config(path)
    with pytest.raises(ConfigError, match="aliases are not supported"):
        load_config(None, ["train.logdir=[&a [1,1], *a]"])


def test_an_empty_config_is_refused(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# every key commented out\n")
    with pytest.raises(ConfigError, match="is empty .or only comments., which would train every"):
        load_config(path, allow_empty=False)
    assert load_config(path) == load_config(None)  # the library's default: {} is no keys


def test_values_in_messages_are_bounded():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["model.layers=" + "x" * 100_000])
    assert len(str(err.value)) < 200


def test_warmup_longer_than_the_run_is_named():
    from jaxpod.config.rules import warnings

    assert warnings(load_config(TINY)) == []
    (line,) = warnings(load_config(TINY, ["train.steps=4"]))
    assert line.startswith("optim.warmup_steps=5 is more than train.steps=4, so the warm-up")


def _documented_commands() -> list[str]:
    """Every single-line `jaxpod ...` command in README.md and docs/*.md."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in page.read_text().splitlines():
            line = line.split(" #")[0].strip().rstrip("&").strip()
            if re.match(
                r"(\.venv/bin/)?jaxpod (train|profile|plan|compile|runs|tensorboard) ", line
            ):
                if not line.endswith("\\"):
                    found.append(line)
    return found


def test_documented_commands_parse():
    from jaxpod.cli import _parse

    commands = _documented_commands()
    assert any("--warmup 2 --steps 2 optim.warmup_steps=0" in c for c in commands)
    for command in commands:
        args = _parse(shlex.split(command)[1:])
        if hasattr(args, "items"):
            assert [i for i in args.items if "=" not in i], command  # one CONFIG


@pytest.mark.cli
def test_train_refuses_a_model_the_host_ram_cannot_hold(tmp_path):
    proc = jaxpod("train", TINY, "model.d_model=1000000", f"train.logdir={tmp_path}/run")
    assert_user_error(proc, "virtual CPU devices need ~", "of host RAM", "use fewer devices")
    assert not (tmp_path / "run").exists()
    plan = jaxpod("plan", TINY, "model.d_model=1000000")
    assert plan.returncode == 0, plan.stderr
    assert "jaxpod: warning: `jaxpod train` would refuse this: devices=8" in plan.stderr
    # a plan for a pod's devices is about the pod, not this host: no warning
    pod = jaxpod("plan", str(ROOT / "configs" / "gpt3_175b_pod256.yaml"))
    assert pod.returncode == 0 and "warning" not in pod.stderr, pod.stderr


@pytest.mark.cli
@pytest.mark.parametrize("inside", ["", "/sub"], ids=["is-a-file", "under-a-file"])
def test_logdir_in_the_way_is_one_line_before_jax(tmp_path, inside):
    (tmp_path / "f").write_text("x")
    env = without_jax(tmp_path)  # jax never starts: importing it would fail the run
    proc = jaxpod("train", TINY, f"train.logdir={tmp_path}/f{inside}", env=env)
    assert_user_error(proc, "is a file, not a directory; pick another train.logdir")
    assert (tmp_path / "f").read_text() == "x"


@pytest.mark.cli
def test_alias_bomb_and_empty_config_through_the_cli(tmp_path):
    (tmp_path / "bomb.yaml").write_text(BOMB)
    (tmp_path / "empty.yaml").write_text("")
    assert_user_error(jaxpod("plan", str(tmp_path / "bomb.yaml"), timeout=30), "aliases")
    assert_user_error(jaxpod("train", str(tmp_path / "empty.yaml"), timeout=30), "is empty")
    run = tmp_path / "runs" / "bombed"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(BOMB)
    proc = jaxpod("runs", str(tmp_path / "runs"), timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1].split()[:3] == ["bombed", "-", "-"]  # unread: no guess


@pytest.mark.cli
def test_runs_reads_damaged_bytes_and_names_a_file(tmp_path):
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "config.yaml").write_bytes(b"model: {name: gpt, layers: 4, d_model: 64} # \xff\n")
    (run / "metrics.jsonl").write_bytes(b'{"step": 3, "loss": 1.5}\n\xfe\n')
    proc = jaxpod("runs", str(tmp_path / "runs"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1].split()[:5] == ["r", "gpt", "4x64", "-", "3/-"]
    assert_user_error(jaxpod("runs", str(run / "config.yaml")), "is a file; pass a directory")


@pytest.mark.cli
def test_tensorboard_never_creates_a_mistyped_logdir(tmp_path):
    proc = jaxpod("tensorboard", str(tmp_path / "rnus"), env=cli_env())
    assert_user_error(proc, f"LOGDIR {tmp_path}/rnus is not a directory")
    assert not (tmp_path / "rnus").exists()
