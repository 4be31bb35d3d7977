"""Warnings for settings that are legal but do nothing, or less than they say."""

from __future__ import annotations

from helpers import make_tiny_cfg

from jaxpod.config.rules import warnings


def test_skip_bubbles_where_there_are_none_to_skip_is_named():
    (none,) = warnings(make_tiny_cfg("train.skip_bubbles=true", mesh=(4, 1, 2)))
    assert none.startswith("train.skip_bubbles=true does nothing with mesh.pipeline=1")
    (unused,) = warnings(make_tiny_cfg("train.skip_bubbles=true", "train.pipeline_schedule=1f1b"))
    assert unused.startswith("train.skip_bubbles=true is not used by 1f1b training")
    assert warnings(make_tiny_cfg("train.skip_bubbles=true")) == []  # gpipe on 2 stages
