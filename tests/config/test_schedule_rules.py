"""The pipeline schedule's config rules: one line naming the field and the fix (no jax)."""

from __future__ import annotations

import pytest

from jaxpod.config import CHOICES, ConfigError, load_config

TINY = "configs/tiny.yaml"  # 4 layers on a 2x2x2 mesh, grad_accum 4


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(TINY, list(overrides))
    message = str(err.value)
    assert "\n" not in message
    return message


def test_the_schedule_choices_are_the_executors():
    """The config's Literal lists exactly the schedules `jaxpod.parallel.schedules` builds."""
    from jaxpod.parallel.schedules import KINDS

    assert CHOICES["train.pipeline_schedule"] == KINDS


def test_valid_schedules_load():
    cfg = load_config(TINY, ["train.pipeline_schedule=circular", "train.virtual_stages=2"])
    assert (cfg.train.pipeline_schedule, cfg.train.virtual_stages) == ("circular", 2)
    assert load_config(TINY, ["train.pipeline_schedule=1f1b"]).train.pipeline_schedule == "1f1b"
    # zb-v runs the head on the last stage per micro-batch, in training and in evaluation: a
    # pass's tokens need not split over the stages; gpipe's spread head needs it, and so does
    # 1f1b's evaluation, a GPipe pass
    odd = ["model.seq_len=63", "train.micro_batch=1", "train.grad_accum=1"]
    zb_v = ["train.pipeline_schedule=zb-v", "train.virtual_stages=2"]
    assert load_config(TINY, [*odd, *zb_v]).train.pipeline_schedule == "zb-v"
    assert "output tokens per pipeline pass" in refused(*odd)
    assert "output tokens of an evaluation pass" in refused(*odd, "train.pipeline_schedule=1f1b")


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["train.virtual_stages=2"], "train.virtual_stages=2 splits each pipeline stage"),
        (["train.pipeline_schedule=circular"], "needs train.virtual_stages >= 2"),
        (
            ["train.pipeline_schedule=circular", "train.virtual_stages=4"],
            "model.layers=4 does not divide into mesh.pipeline*train.virtual_stages = 2*4 = 8",
        ),
        (
            ["train.pipeline_schedule=circular", "train.virtual_stages=2", "train.grad_accum=3"],
            "train.grad_accum=3 micro-batches per pass is not a multiple of mesh.pipeline=2",
        ),
        (
            [
                "train.pipeline_schedule=circular",
                "train.virtual_stages=2",
                "train.pipeline_group=1",
            ],
            "train.pipeline_group=1 micro-batches per pass is not a multiple",
        ),
        (
            ["train.pipeline_schedule=1f1b", "mesh.pipeline=1", "mesh.replica=4"],
            "but mesh.pipeline=1; set mesh.pipeline > 1 or train.pipeline_schedule=gpipe",
        ),
        (
            [
                "model.layers=8",
                "memory.phases=2",
                "memory.offload=[params]",
                "train.pipeline_schedule=circular",
                "train.virtual_stages=4",
            ],
            "memory.phases=2 does not divide the 1 layers of a virtual stage",
        ),
        (["train.pipeline_schedule=zigzag"], "train.pipeline_schedule='zigzag' is not one of"),
        (["train.virtual_stages=0"], "train.virtual_stages=0 must be >= 1"),
    ],
)
def test_bad_schedules_are_refused_in_one_line(overrides, needle):
    assert needle in refused(*overrides)


@pytest.mark.parametrize("kind", ["circular", "interleaved-1f1b", "zb-v"])
def test_chunked_schedules_need_stacked_layers(kind):
    vision = [
        "model.name=efficientnet",
        "data.name=digits",
        "mesh.tensor=1",
        "mesh.replica=4",
        "model.pipeline_splits=[4a]",
    ]
    message = refused(*vision, f"train.pipeline_schedule={kind}", "train.virtual_stages=2")
    assert "model.name=efficientnet has heterogeneous stages: use gpipe, 1f1b or zb-h1" in message
    for ok in ("1f1b", "zb-h1"):
        assert load_config(TINY, [*vision, f"train.pipeline_schedule={ok}"])


def test_zb_v_runs_two_chunks():
    message = refused("mesh.pipeline=2", "train.pipeline_schedule=zb-v", "train.virtual_stages=4")
    assert "set train.virtual_stages=2 (not 4)" in message
