"""`jaxpod.figures`: the charts read the tables and plans the code uses, and render the same
bytes twice; `jaxpod plan --chart` writes its chart (in process: the planner needs no jax)."""

from __future__ import annotations

import hashlib

import matplotlib
import numpy as np
import pytest
from helpers import ROOT

from jaxpod import cli
from jaxpod.config import load_config
from jaxpod.figures import save
from jaxpod.figures.memory import stack
from jaxpod.figures.schedule import full_step, schedules_figure
from jaxpod.parallel.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    KINDS,
    make_schedule,
)
from jaxpod.planner.plan import plan

matplotlib.use("Agg")
PRESETS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("kind", KINDS)
def test_full_step_runs_every_forward_and_backward_once(kind):
    table = make_schedule(kind, 4, 8, 2 if kind in ("circular", "interleaved-1f1b") else 1)
    op, micro, chunk = full_step(table)
    backward = (BACKWARD_INPUT, BACKWARD_WEIGHT) if kind.startswith("zb") else (BACKWARD,)
    for s in range(4):
        for o in (FORWARD, *backward):
            mine = op[:, s] == o
            done = sorted(zip(micro[mine, s].tolist(), chunk[mine, s].tolist(), strict=True))
            assert done == [(m, c) for m in range(8) for c in range(table.virtual)]
    if not table.explicit_backward:  # the forward table itself, then its transpose
        np.testing.assert_array_equal(op[: table.ticks], table.op)
        assert (op[table.ticks :] != FORWARD).all()


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_stack_sums_to_the_device_total(path):
    p = plan(load_config(path))
    parts = stack(p)
    assert sum(parts.values()) == p["bytes_per_device"]["device_total"]
    assert min(parts.values()) >= 0


def _digest(fig, path) -> str:
    save(fig, path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_schedule_chart_is_deterministic(tmp_path):
    import matplotlib.pyplot as plt

    first = _digest(schedules_figure(2, 4), tmp_path / "a.png")
    second = _digest(schedules_figure(2, 4), tmp_path / "b.png")
    plt.close("all")
    assert first == second


def test_plan_chart(tmp_path, capsys, in_process_cli):
    out = tmp_path / "charts" / "plan.png"
    cli.main(["plan", str(ROOT / "configs" / "tiny.yaml"), "--json", "--chart", str(out)])
    assert out.read_bytes().startswith(b"\x89PNG")
    assert "chart written to" in capsys.readouterr().err


def test_plan_chart_names_a_picture(capsys, in_process_cli):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", str(ROOT / "configs" / "tiny.yaml"), "--chart", "plan.txt"])
    assert exit_.value.code == 2
    assert "name a .png, .svg or .pdf file" in capsys.readouterr().err
