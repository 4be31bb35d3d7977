"""`configs/efficientnet_digits.yaml` through the training loop (`jaxpod.run.loop`): the digits
run learns. The train step it compiles is the one tests/engine/test_packed_engine.py's
overflow test compiles (the loss scale is state, not program): both run in one process
(`TINY_EFFICIENTNET`), and the compilation cache serves the second.
"""

from __future__ import annotations

import pytest
from helpers import DIGITS_STEPS, TINY_EFFICIENTNET, digits_cfg


@pytest.mark.long_run
@pytest.mark.xdist_group(TINY_EFFICIENTNET)
def test_digits_config_trains(mesh_for, tmp_path):
    """`configs/efficientnet_digits.yaml` through the training loop, shortened to 50 of its 300
    steps (seeded data, init and rounding): validation accuracy at least 3x chance (10 %).
    The full run reaches >= 90 % (`jaxpod train configs/efficientnet_digits.yaml`)."""
    import json

    from jaxpod.run.loop import run_training

    cfg = digits_cfg(
        DIGITS_STEPS, "train.eval_every=0", "train.log_every=25", f"train.logdir={tmp_path}"
    )
    result = run_training(cfg, quiet=True)
    record = json.loads((tmp_path / "eval.json").read_text())
    assert record["final_val_accuracy"] > 0.3, record  # chance is 0.1
    assert record["steps_trained"] == 50 and record["images_per_s_mean"] > 0
    assert result.losses[-1] < result.losses[0] - 0.5
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if "loss" in m]
    assert {"accuracy", "loss_scale", "skipped_steps", "images_per_s"} <= set(train[-1])
