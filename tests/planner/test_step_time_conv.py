"""The step-time model for packed stages (EfficientNet): its FLOPs per image against a hand
derivation and against the convolutions and dots of the model's own lowered program, the
cut into balanced stages against brute force, lockstep pricing (the slowest stage sets the
tick), `estimate --json` of the POD16 preset, and a search of it that returns a fitting
mapping."""

from __future__ import annotations

import itertools
import json
import math
import re

import pytest

from jaxpod.cli import main
from jaxpod.config import MAX_PLANNED_DEVICES, load_config
from jaxpod.config.efficientnet_specs import flops_per_image
from jaxpod.inspect.estimate import estimate_config
from jaxpod.inspect.search import search
from jaxpod.planner.conv_work import pieces_work
from jaxpod.planner.plan import plan
from jaxpod.planner.speed import get_speed
from jaxpod.planner.step_time_conv import estimate_packed, split_choices, stage_seconds

POD16 = "configs/efficientnet_b4_g16_pod16.yaml"
GC200 = get_speed("ipu-gc200")
ONE = ["devices=1", "mesh.replica=1", "mesh.pipeline=1", "model.pipeline_splits=[]"]
ONE += ["train.pipeline_schedule=gpipe", "train.grad_accum=8", "train.batch_parts=1"]


def _cfg(*more: str):
    return load_config(POD16, [*ONE, *more])


def _flops(piece: dict) -> int:
    return sum(f for f, _ in piece["matmuls"]) + piece["depthwise"]


def test_one_block_net_by_hand():
    """B0 cut to its first block group at 32 pixels, 10 classes, depthwise: the stem a 3x3
    conv 3->32 at 16x16; block 1a (no expansion) a depthwise 3x3 on 32 channels, the SE
    32->8->32, a 1x1 projection 32->16; the head a 1x1 16->1280 and the classifier."""
    more = ["model.variant=b0", "model.g16=false", "model.block_groups=1", "model.image_size=32"]
    stem, block, head = pieces_work(_cfg(*more, "model.num_classes=10"), 2)
    assert stem["matmuls"] == [(2 * 16 * 16 * 27 * 32, 27)]
    assert block["depthwise"] == 2 * 16 * 16 * 9 * 32  # memory-bound, not a matmul
    assert block["matmuls"] == [(2 * 32 * 8, 32), (2 * 8 * 32, 8), (2 * 16 * 16 * 32 * 16, 32)]
    assert head["matmuls"] == [(2 * 16 * 16 * 16 * 1280, 16), (2 * 1280 * 10, 1280)]
    # per image: the depthwise conv's operand and output once (2 bytes each), its norm and
    # swish (5 passes), the SE (3), the projection's norm (3); no residual (32 -> 16)
    assert block["memory"] == 2 * (2 * 16 * 16 * 32 + (5 + 3) * 16 * 16 * 32 + 3 * 16 * 16 * 16)


@pytest.mark.parametrize("variant", ["b0", "b4"])
@pytest.mark.parametrize("g16", ["false", "true"])
def test_the_pieces_flops_are_flops_per_image(variant, g16):
    """Summed over the pieces, `flops_per_image`'s count (tests/models: the published B0)."""
    cfg = _cfg(f"model.variant={variant}", f"model.g16={g16}")
    md = cfg.model
    total = sum(_flops(p) for p in pieces_work(cfg, 2))
    assert total == flops_per_image(variant, md.image_size, md.num_classes, g16=g16 == "true")


def _lowered_flops(text: str) -> int:
    """2 x multiply-adds of every convolution and dot in a StableHLO module's text: a conv's
    output elements times its kernel's elements per output channel (`[k, k, i, o]`), a dot's
    output elements times its contraction."""
    total = 0
    shapes = r"\(tensor<([\dx]+)x\w+>, tensor<([\dx]+)x\w+>\) -> tensor<([\dx]+)x\w+>"
    dims = lambda s: [int(d) for d in s.split("x")]
    for line in text.splitlines():
        m = re.search(shapes, line)
        if "stablehlo.convolution" in line:
            kernel, out = dims(m.group(2)), dims(m.group(3))
            total += 2 * math.prod(out) * math.prod(kernel[:-1])
        elif "stablehlo.dot_general" in line:
            lhs, out = dims(m.group(1)), dims(m.group(3))
            contract = re.search(r"contracting_dims = \[(\d+)\]", line).group(1)
            total += 2 * math.prod(out) * lhs[int(contract)]
    return total


@pytest.mark.parametrize("g16", [False, True])
def test_the_flops_are_the_lowered_programs(g16):
    """The tiny B0 (width 0.25, depth 0.1, 10 classes, 32 pixels) as jaxpod builds it,
    lowered for one image: its convolutions and dots do the pieces' FLOPs."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxpod.models.efficientnet import EfficientNet

    shape = dict(num_classes=10, width_mult=0.25, depth_mult=0.1, g16=g16)
    net = nnx.eval_shape(lambda: EfficientNet("b0", splits=[], rngs=nnx.Rngs(0), **shape))
    graphdef, state = nnx.split(net)
    image = jax.ShapeDtypeStruct((1, 32, 32, 3), jnp.float32)
    text = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, image).as_text()
    more = [f"model.{k}={str(v).lower()}" for k, v in shape.items()]
    cfg = _cfg("model.variant=b0", "model.image_size=32", *more)
    assert _lowered_flops(text) == sum(_flops(p) for p in pieces_work(cfg, 2)) > 0


def test_the_balanced_cut_is_brute_forces():
    """B0's 16 blocks in 2 and 3 stages: no cut has a cheaper costliest stage."""
    cfg = _cfg("model.variant=b0")
    names = [p["name"] for p in pieces_work(cfg, 2)[1:-1]]
    for stages in (2, 3):
        (best,) = split_choices(cfg, GC200, stages)
        worst = lambda cut: max(sum(s) for s in stage_seconds(cfg, GC200, cut))
        brute = min(worst(c) for c in itertools.combinations(names, stages - 1))
        assert worst(best) == pytest.approx(brute)
        assert worst(best) < worst(tuple(names[: stages - 1]))  # not any cut


def test_lockstep_prices_the_slowest_stage():
    """Two stages cut at 4a (the preset's) and at 7a: the busy time is the costlier stage's
    forward and backward with full recompute (4 forwards) over a replica's images."""
    for cut in ("4a", "7a"):
        cfg = load_config(POD16, [f"model.pipeline_splits=[{cut}]"])
        e = estimate_packed(cfg, GC200)
        images = cfg.global_batch / cfg.mesh.replica
        slowest = max(sum(s) for s in stage_seconds(cfg, GC200)) * 4 * images
        assert e["matmul_s"] + e["memory_s"] == pytest.approx(slowest)
        assert e["stage_s"] == pytest.approx(
            [sum(s) * 4 * images for s in stage_seconds(cfg, GC200)]
        )
        parts = e["matmul_s"] + e["memory_s"] + e["pipeline_exposed_s"] + e["bubble_s"]
        assert e["step_s"] == pytest.approx(parts + e["data_exposed_s"] + e["update_s"])


def test_recompute_adds_a_forward():
    none = estimate_packed(_cfg("model.remat=none"), GC200)
    full = estimate_packed(_cfg("model.remat=full"), GC200)
    assert full["matmul_s"] == pytest.approx(none["matmul_s"] * 4 / 3)
    assert none["bubble_s"] == none["pipeline_s"] == none["data_s"] == 0


def test_estimate_cli_of_the_pod16_preset(capsys, in_process_cli):
    main(["estimate", POD16, "--target", "ipu-gc200:16", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["mapping"] == "replica 8 x pipeline 2 x tensor 1"
    keys = {"step_time_s", "images_per_s", "model_flops_per_device_s", "mfu", "breakdown"}
    assert keys <= set(out) and "tokens_per_s" not in out
    assert out["images_per_s"] == pytest.approx(6144 / out["step_time_s"])
    assert len(out["breakdown"]["stage_s"]) == 2
    assert 0 < out["mfu"] < 1


def test_search_on_pod16_returns_a_fitting_mapping():
    """Every ranked mapping plans to fit and estimates alone as ranked; the preset's own cut
    (4a) is among the cuts tried for two stages."""
    found = search(POD16, [], "ipu-gc200", 16, None)
    assert found["fitting"] == len(found["top"]) > 0
    tried = {o for m in found["top"] for o in m["overrides"] if "pipeline_splits" in o}
    assert "model.pipeline_splits=[4a]" in tried
    for m in found["top"][:3]:
        on = ["devices=16", "memory.device=ipu-gc200", *m["overrides"]]
        cfg = load_config(POD16, on, max_devices=MAX_PLANNED_DEVICES)
        assert plan(cfg, advice=False)["fits"]
        alone = estimate_config(cfg, "ipu-gc200")["step_time_s"]
        assert alone == pytest.approx(m["estimate"]["step_time_s"])


@pytest.mark.parametrize(
    "config",
    [POD16, "configs/bert_large_pod16.yaml", "configs/gpt3_175b_pod256.yaml"],
)
def test_the_seeds_three_models_are_estimated(config):
    """No model kind is refused: each seed's preset on its own pod gets a step time."""
    cfg = load_config(config, [])
    r = estimate_config(cfg, cfg.memory.device)
    assert r["step_time_s"] > 0 and 0 < r["mfu"] < 1
