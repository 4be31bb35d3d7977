"""The checks before training (`jaxpod.run.preflight`): once, in order, one line each, nothing
touched by a refusal; the planner reached through them alone. jax-free, in process (through
the CLI: tests/cli/test_plan_cli.py, test_profile_cli.py, test_input_limits.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT, make_tiny_cfg

from jaxpod.errors import UserError
from jaxpod.run import preflight as preflight_module
from jaxpod.run.logdir import LOCK_FILE
from jaxpod.run.preflight import preflight


def test_cleared_holds_the_lock_until_it_is_left(tmp_path):
    cfg = make_tiny_cfg(f"train.logdir={tmp_path / 'run'}")
    with preflight(cfg) as cleared:
        assert cleared.cfg is cfg
        assert (tmp_path / "run" / LOCK_FILE).is_file()
    assert not (tmp_path / "run").exists()  # created by the claim, left empty: removed


def test_only_process_0_claims_the_run_directory(tmp_path):
    cfg = make_tiny_cfg(f"train.logdir={tmp_path / 'run'}")
    assert preflight(cfg, processes=2, process=1).lock is None
    assert not (tmp_path / "run").exists()


def test_the_budget_is_refused_before_the_run_directory_is_touched(tmp_path):
    cfg = make_tiny_cfg("memory.device_budget=1MB", f"train.logdir={tmp_path / 'run'}")
    with pytest.raises(UserError, match=r"memory.device_budget=1MB: the plan needs .* per device"):
        preflight(cfg)
    assert not (tmp_path / "run").exists()


def test_profile_steps_are_checked_first(tmp_path):
    overrides = ["train.steps=4", "train.profile_steps=[3,7]", "memory.device_budget=1MB"]
    cfg = make_tiny_cfg(*overrides, f"train.logdir={tmp_path / 'run'}")
    with pytest.raises(UserError, match=r"train.profile_steps=\[3, 7\] .* stop <= 5"):
        preflight(cfg)


def test_host_ram_is_checked_for_one_process_only(tmp_path, monkeypatch):
    """Virtual devices share this host's RAM only when one process holds them all."""
    asked = []
    monkeypatch.setattr(preflight_module, "check_host_ram", asked.append)
    cfg = make_tiny_cfg(f"train.logdir={tmp_path / 'run'}")
    preflight(cfg, processes=2, process=1)
    assert asked == []
    preflight(cfg).lock.release()
    assert asked == [cfg]


def test_the_loop_refuses_the_preflight_of_another_config(tmp_path):
    from jaxpod.run.loop import run_training

    cfg = make_tiny_cfg(f"train.logdir={tmp_path / 'run'}")
    with preflight(make_tiny_cfg(f"train.logdir={tmp_path / 'other'}")) as cleared:
        with pytest.raises(ValueError, match="preflight of another config"):
            run_training(cfg, cleared=cleared)
    assert not (tmp_path / "run").exists()


def test_the_loop_imports_no_planner_and_preflight_no_jax():
    code = (
        "import sys\n"
        "import jaxpod.run.preflight\n"
        "assert 'jax' not in sys.modules, 'preflight imported jax'\n"
        "import jaxpod.run.loop\n"
        "bad = [m for m in sys.modules if m.startswith('jaxpod.planner')]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
