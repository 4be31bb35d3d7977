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


def test_presets_figure_puts_xla_beside_the_plan_for_its_backend():
    """The TPU presets' planned bars stand beside XLA:TPU's bytes for the same preset (a
    changed preset's are left out); the GC200 presets have none beside them (no backend
    compiles for them); no title carries a commit hash."""
    import re

    import matplotlib.pyplot as plt

    from jaxpod.figures import data
    from jaxpod.figures.build import presets_figure

    name, stale = "bert_large_tpu_v5p", "llama3_8b_tpu_v5p"
    compiled = {
        "date": "2026-12-06",
        name: {"preset_digest": data.preset_digest(name), "device_total_bytes": 1_234_567_890},
        stale: {"preset_digest": "0" * 16, "device_total_bytes": 5_000_000_000},
    }
    fig = presets_figure(compiled)
    left, right = fig.axes
    beside = [b for b in left.patches if b.get_hatch() == "//"]
    assert [round(b.get_height() * 1e9) for b in beside] == [1_234_567_890]
    assert not [b for b in right.patches if b.get_hatch()]
    titles = " ".join(ax.get_title() for ax in fig.axes)
    assert not re.search(r"\b[0-9a-f]{7,}\b", titles) and "XLA:TPU" in left.get_title()
    plt.close(fig)
