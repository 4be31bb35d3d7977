"""`jaxpod.run.profiling` in process: the overrides `jaxpod profile` runs a config with."""

from __future__ import annotations

import pytest
from helpers.cli import TINY

from jaxpod.errors import ConfigError


def test_profile_overrides(tmp_path):
    from jaxpod.run.profiling import profile_overrides

    config = tmp_path / "c.yaml"
    config.write_text(f"train: {{logdir: {tmp_path / 'run'}}}\n")
    (tmp_path / "run-profile" / "checkpoints" / "3").mkdir(parents=True)
    got = profile_overrides(str(config), ["mesh.tensor=1"], steps=3, warmup=2)
    assert not (tmp_path / "run-profile" / "checkpoints").exists()  # never resumes
    assert got == [
        "mesh.tensor=1",
        "train.steps=5",
        "train.profile_steps=[3,6]",
        "train.eval_every=0",
        "train.log_every=1",
        f"train.logdir={tmp_path / 'run'}-profile",
    ]
    user = [f"train.logdir={tmp_path / 'run-profile'}"]
    assert profile_overrides(TINY, user, steps=1, warmup=0)[-1] == user[0]  # used as given
    (tmp_path / "run-profile" / "checkpoints").mkdir()
    with pytest.raises(ConfigError, match="holds checkpoints"):
        profile_overrides(TINY, user, steps=3, warmup=2)
