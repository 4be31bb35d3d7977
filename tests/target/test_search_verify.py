"""`jaxpod search --verify`: the mappings it compiles for the TPU topology are the ones it
ranked — each compiled program's HBM bytes are what `jaxpod compile` gives that mapping alone,
and its plan is the one the search ranked by (XLA:TPU through libtpu, no TPU attached)."""

from __future__ import annotations

import json

import pytest

from jaxpod.cli import main

pytestmark = pytest.mark.slow

TARGET = "tpu-v5p:2x2x2"


def test_verified_mappings_are_the_ranked_ones(capsys, in_process_cli):
    main(["search", "tiny", "--target", TARGET, "--top", "2", "--verify", "--json"])
    found = json.loads(capsys.readouterr().out)
    assert len(found["top"]) == 2
    for entry in found["top"]:
        compiled = entry["compiled"]
        assert compiled["planned_device_total_bytes"] == entry["plan_bytes"]["device_total"]
        shown = [o for o in entry["overrides"] if not o.endswith("=null")]
        main(["compile", "tiny", *shown, "--target", TARGET, "--json"])
        alone = json.loads(capsys.readouterr().out)
        assert compiled["device_total_bytes"] == alone["device_total_bytes"] > 0
        ratio = alone["planned_device_total_bytes"] / alone["device_total_bytes"]
        assert compiled["planned_ratio"] == pytest.approx(ratio)
