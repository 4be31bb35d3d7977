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
    for kind in ("1f1b", "zb-h1"):
        cfg = make_tiny_cfg("train.skip_bubbles=true", f"train.pipeline_schedule={kind}")
        (unused,) = warnings(cfg)
        assert unused.startswith(f"train.skip_bubbles=true is not used by {kind} training")
    assert warnings(make_tiny_cfg("train.skip_bubbles=true")) == []  # gpipe on 2 stages


def test_phases_without_offloaded_params_say_where_the_stack_lives():
    (phases,) = warnings(make_tiny_cfg("memory.phases=2", mesh=(2, 1, 2)))
    assert phases.startswith("memory.phases=2 keeps the layer stack in host memory")
    offloaded = make_tiny_cfg("memory.phases=2", "memory.offload=[params]", mesh=(2, 1, 2))
    assert warnings(offloaded) == []


def test_more_steps_than_a_step_counter_holds_is_one_line():
    for steps in ("99999999999999999999", str(2**31)):
        with pytest.raises(ConfigError, match=rf"train.steps={steps} is more than a step counter"):
            make_tiny_cfg(f"train.steps={steps}")
    assert make_tiny_cfg(f"train.steps={2**31 - 1}").train.steps == 2**31 - 1
