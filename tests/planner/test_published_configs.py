"""Each published run as a jaxpod config (`benchmarks/published_configs.py`): the config's
step-time workload, taken through `jaxpod estimate`'s path, is the row's workload written
from the file field by field, or differs only where `DIFFERENCES` says why and prices the
same; the rows jaxpod cannot express say why. So `bench_published.py`'s predictions are the
configs'. Jax-free: nothing compiles."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from jaxpod.planner.speed import get_speed
from jaxpod.planner.step_time import estimate

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    """`bench_published`, imported as the script runs it (its folder on the path)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))
        module = importlib.import_module("bench_published")
    if not module.CSV.exists():
        pytest.skip(f"{module.CSV} is not here")
    return module


@pytest.fixture(scope="module")
def configs(bench):
    return importlib.import_module("published_configs")


def test_every_config_is_its_row(bench, configs):
    """Field by field equal, or a listed difference with the same step time."""
    checked = 0
    table, _ = bench.rows()
    for line, row in table:
        direct = bench.workload(row)
        if direct is None:
            continue
        config = configs.config_workload(row, direct)
        if isinstance(config, str):
            continue
        checked += 1
        differ = configs.differences(config, direct)
        assert set(differ) <= set(configs.DIFFERENCES), (line, differ)
        speed = get_speed(bench.chip_of(row))
        assert estimate(config, speed) == estimate(direct, speed), (line, differ)
        same = dataclasses.replace(config, **{k: getattr(direct, k) for k in differ})
        assert same == direct, line
    assert checked >= 80  # every row but the context-parallel ones and the batchless


def test_the_mapping_is_the_files(bench, configs):
    """The loaded config's mesh, batch and remat are the CSV's columns, read here anew."""
    from jaxpod.config import MAX_PLANNED_DEVICES, load_config

    for _, row in bench.rows()[0]:
        overrides = configs.config_overrides(row)
        if isinstance(overrides, str):
            continue
        cfg = load_config(configs.PRESET, overrides, max_devices=MAX_PLANNED_DEVICES)
        t, p, d = (int(row[k]) for k in ("t", "p", "d"))
        assert cfg.mesh.shape == (d, p, t)
        assert cfg.total_devices == int(row["n_devices"])
        assert cfg.global_batch == int(row["global_batch"])
        assert cfg.train.virtual_stages == int(row["vpp"] or 1)
        recompute = (row["recompute"].replace("remat_policy=", "") or "none").split()[0]
        assert cfg.model.remat == {"full": "full", "none": "none"}[recompute]
        assert cfg.model.layers == int(row["layers"]) and cfg.model.vocab == int(row["vocab"])


def test_rows_that_are_no_config_say_why(bench, configs):
    """Exactly the rows with context parallelism or without a batch are no config."""
    for _, row in bench.rows()[0]:
        reason = configs.config_overrides(row)
        cp = re.search(r"CP=(\d+)", row["notes"])
        batchless = not row["global_batch"] and not row["micro_batch"]
        expected = batchless or (cp is not None and int(cp.group(1)) > 1)
        assert isinstance(reason, str) == expected, row["source"]
        if isinstance(reason, str):
            assert "\n" not in reason
            assert ("CP=" in reason) != batchless


def test_a_shape_jaxpod_refuses_is_a_reason(bench, configs):
    """A row whose heads do not split over its tensor width is no config, and the reason is
    jaxpod's own one-line error, naming the field."""
    table, _ = bench.rows()
    row = next(r for _, r in table if r["source"] == "MLM20" and r["t"] == "2")
    row = {**row, "heads": "15"}  # 15 heads over tensor 2
    reason = configs.config_workload(row, bench.workload(row))
    assert isinstance(reason, str) and reason.startswith("jaxpod refuses the config")
    assert "model.heads" in reason and "\n" not in reason
