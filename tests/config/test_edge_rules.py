"""Rules and warnings at the edges: a step count no step counter holds is refused (it passed,
then overflowed in the prefetcher); settings that are legal but do nothing are named."""

from __future__ import annotations

import pytest
from helpers import make_tiny_cfg

from jaxpod.config import ConfigError
from jaxpod.config.rules import warnings


def test_skip_bubbles_where_there_are_none_to_skip_is_named():
    (none,) = warnings(make_tiny_cfg("train.skip_bubbles=true", mesh=(4, 1, 2)))
    assert none.startswith("train.skip_bubbles=true does nothing with mesh.pipeline=1")
    (unused,) = warnings(make_tiny_cfg("train.skip_bubbles=true", "train.pipeline_schedule=1f1b"))
    assert unused.startswith("train.skip_bubbles=true is not used by 1f1b training")
    assert warnings(make_tiny_cfg("train.skip_bubbles=true")) == []  # gpipe on 2 stages


def test_more_steps_than_a_step_counter_holds_is_one_line():
    for steps in ("99999999999999999999", str(2**31)):
        with pytest.raises(ConfigError, match=rf"train.steps={steps} is more than a step counter"):
            make_tiny_cfg(f"train.steps={steps}")
    assert make_tiny_cfg(f"train.steps={2**31 - 1}").train.steps == 2**31 - 1
