"""EfficientNet (jaxpod.models.efficientnet): published parameter counts and FLOPs, the G16
variant, GroupNorm against numpy, stage splitting against the whole net, dtypes, the input
normalization.

Parameter counts use `nnx.eval_shape` (nothing materialised), and the specs' own count
(`stage_params`, what the planner reads) is checked against them. The forward tests share one tiny
net (width 0.25, depth 0.1: 7 blocks, 32x32 inputs), initialised once per module by one jitted init.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpod.config.efficientnet_specs import stage_params
from jaxpod.models.efficientnet import (
    MEAN_RGB,
    STD_RGB,
    EfficientNet,
    GroupNorm,
    block_specs,
    build_stages,
    count_params,
    flops_per_image,
    norm_groups,
    normalize,
    restage,
    stage_io_shapes,
    stem_head_channels,
)

TINY = dict(num_classes=10, width_mult=0.25, depth_mult=0.1)
SPLITS = ["3a", "6a"]


def _abstract(variant: str, **kw) -> EfficientNet:
    return nnx.eval_shape(lambda: EfficientNet(variant, rngs=nnx.Rngs(0), **kw))


def _pieces(stages) -> list[nnx.Module]:
    """stem, blocks..., head of a list of stages, in network order."""
    return [stages[0].stem, *(b for s in stages for b in s.blocks), stages[-1].head]


@pytest.fixture(scope="module")
def nets():
    """(whole, split): the tiny net with `splits=[]` and `splits=SPLITS`, same seed."""
    from jaxpod.engine.state import compile_once

    make = lambda: (
        EfficientNet("b0", splits=[], rngs=nnx.Rngs(0), **TINY),
        EfficientNet("b0", splits=SPLITS, rngs=nnx.Rngs(0), **TINY),
    )
    graphdef, _ = nnx.split(nnx.eval_shape(make))
    # one jitted init, compiled as a program that runs once (as the engine's state init): the
    # same values as `nnx.jit(make)()`, bit for bit, in half its compile
    return nnx.merge(graphdef, compile_once(lambda: nnx.split(make())[1], None)())


@pytest.fixture(scope="module")
def images():
    return jax.random.normal(jax.random.key(1), (2, 32, 32, 3), jnp.float32)


@pytest.fixture(scope="module")
def logits(nets, images):
    whole, _ = nets
    return nnx.jit(lambda m, x: m(x))(whole, images)


# ------------------------------------------------------------------------- counts, specs


@pytest.mark.parametrize("variant, published", [("b0", 5_288_548), ("b4", 19_341_616)])
def test_param_count_matches_published(variant, published):
    n = count_params(_abstract(variant))
    assert abs(n - published) <= 0.02 * published, n
    assert n == published  # GroupNorm scale/bias sit exactly where BatchNorm's gamma/beta were


@pytest.mark.parametrize(
    "variant, standard, pinned", [("b0", 5_288_548, 5_913_796), ("b4", 19_341_616, 19_325_576)]
)
def test_g16_param_count(variant, standard, pinned):
    # G16 makes two opposite changes: the spatial conv gets 16x the weights per channel
    # (k*k*16 instead of k*k), while expansion 6 -> 4 shrinks the 1x1 expand/project convs
    # and the spatial width by a third. The published G16 nets stay close to the standard size
    # (B0 +12 %, B4 -0.1 % here); +-25 % catches a missing half (e.g. no 6 -> 4).
    n = count_params(_abstract(variant, g16=True))
    assert n == pinned
    assert abs(n - standard) <= 0.25 * standard


@pytest.mark.parametrize(
    "variant, kw",
    [
        ("b0", {}),
        ("b4", dict(g16=True, splits=["4a"])),
        ("b2", dict(splits=["2a", "5a"], num_classes=10)),
        ("b3", dict(g16=True, width_mult=0.5, depth_mult=0.2, splits=["3a", "6a"])),
        ("b1", dict(width_mult=0.25, depth_mult=0.1, num_classes=10, splits=["7a"])),
        ("b0", dict(width_mult=0.25, depth_mult=0.2, block_groups=3, splits=["3a"])),
    ],
)
def test_stage_params_count_the_built_stages(variant, kw):
    """The planner's count from the specs (jax-free) equals the modules' parameters, stage by
    stage."""
    stages = nnx.eval_shape(lambda: nnx.List(build_stages(variant, rngs=nnx.Rngs(0), **kw)))
    assert stage_params(variant, **kw) == [count_params(stage) for stage in stages]


def test_flops_b0_matches_published():
    # Published "0.39B FLOPs" for B0 are multiply-adds; flops_per_image counts 2 x MACs.
    flops = flops_per_image("b0", 224)
    assert abs(flops - 2 * 0.39e9) <= 0.10 * 2 * 0.39e9, flops
    assert flops_per_image("b0", 224, g16=True) > flops  # grouped convs cost more than depthwise


def test_block_names_and_scaling():
    b0 = block_specs("b0")
    assert [s.name for s in b0] == [
        "1a",
        "2a",
        "2b",
        "3a",
        "3b",
        "4a",
        "4b",
        "4c",
        "5a",
        "5b",
        "5c",
        "6a",
        "6b",
        "6c",
        "6d",
        "7a",
    ]
    assert len(block_specs("b4")) == 32
    assert stem_head_channels("b4") == (48, 1792)
    assert [s.residual for s in b0[:3]] == [False, False, True]
    assert all(s.group_size == 1 and s.expand in (1, 6) for s in b0)
    assert block_specs("b0", block_groups=3) == b0[:5]  # the first groups, unchanged


def test_g16_grouped_conv_kernel_shapes():
    net = _abstract("b0", g16=True)
    blocks = [b for s in net.stages for b in s.blocks]
    for block in blocks:
        spec, kernel = block.spec, block.spatial.conv.kernel
        assert spec.expand in (1, 4)
        assert spec.feature_groups * spec.group_size == spec.mid_ch
        assert kernel.shape == (spec.kernel, spec.kernel, spec.group_size, spec.mid_ch)
        assert block.spatial.conv.feature_group_count == spec.feature_groups
    block = blocks[3]  # "3a": 24 in, expand 4 -> 96 channels, 6 groups of 16
    assert block.spec.name == "3a"
    assert block.spatial.conv.kernel.shape == (5, 5, 16, 96)
    assert block.spec.feature_groups == 96 // 16
    # standard: depthwise, one channel per group
    std = [b for s in _abstract("b0").stages for b in s.blocks][3]
    assert std.spatial.conv.kernel.shape == (5, 5, 1, 144)


# ------------------------------------------------------------------------- GroupNorm


def _numpy_group_norm(x, groups, scale, bias, eps):
    b, h, w, c = x.shape
    g = x.reshape(b, h, w, groups, c // groups).astype(np.float64)
    mean = g.mean(axis=(1, 2, 4), keepdims=True)
    var = g.var(axis=(1, 2, 4), keepdims=True)
    return ((g - mean) / np.sqrt(var + eps)).reshape(x.shape) * scale + bias


@pytest.mark.parametrize("channels, groups, used", [(12, 4, 4), (10, 4, 2), (3, 4, 3)])
def test_group_norm_matches_numpy(channels, groups, used):
    assert norm_groups(channels, groups) == used
    rng = np.random.default_rng(0)
    x = rng.normal(2.0, 3.0, (2, 5, 4, channels)).astype(np.float32)
    norm = GroupNorm(channels, groups)
    norm.scale[...] = jnp.asarray(rng.normal(size=channels), jnp.float32)
    norm.bias[...] = jnp.asarray(rng.normal(size=channels), jnp.float32)
    got = norm(jnp.asarray(x))
    want = _numpy_group_norm(x, used, np.asarray(norm.scale[...]), np.asarray(norm.bias[...]), 1e-5)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert norm(jnp.asarray(x, jnp.float16)).dtype == jnp.float16


# ------------------------------------------------------------------------- stages


def test_params_do_not_depend_on_splits(nets):
    whole, split = nets
    assert len(whole.stages) == 1 and len(split.stages) == 3
    assert [s.block_names[0] for s in split.stages[1:]] == SPLITS
    for a, b in zip(_pieces(whole.stages), _pieces(split.stages), strict=True):
        jax.tree.map(np.testing.assert_array_equal, nnx.state(a), nnx.state(b))


def test_stages_compute_the_whole_net(nets, images, logits):
    _, split = nets

    def chain(stages, x):
        for stage in stages:
            x = stage(x)
        return x

    staged = nnx.jit(chain)(list(split.stages), images)
    np.testing.assert_allclose(np.asarray(staged), np.asarray(logits), rtol=1e-6, atol=1e-6)


def test_restage_shares_parameters(nets):
    whole, _ = nets
    stages = restage(whole.stages, ["4a"])
    assert [s.block_names for s in stages] == [["1a", "2a", "3a"], ["4a", "5a", "6a", "7a"]]
    assert stages[0].stem is whole.stages[0].stem and stages[1].head is whole.stages[0].head
    assert stages[1].blocks[0] is whole.stages[0].blocks[3]
    assert stages[0].head is None and stages[1].stem is None


@pytest.mark.parametrize("splits", [["4z"], ["4a", "3a"], ["4a", "4a"]])
def test_bad_split_raises(splits):
    with pytest.raises(ValueError, match="valid block names: 1a, 2a, 2b, 3a") as err:
        build_stages("b0", splits=splits, rngs=nnx.Rngs(0))
    assert "\n" not in str(err.value)


def test_output_shape_and_dtype(logits):
    assert logits.shape == (2, 10) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()


def test_stage_io_shapes(nets):
    _, split = nets
    io = stage_io_shapes(split.stages, batch=2, image_size=32)
    assert [(i.shape, o.shape) for i, o in io] == [
        ((2, 32, 32, 3), (2, 8, 8, 8)),  # stem + 1a, 2a: stride 4, 2a has 24 * 0.25 -> 8 ch
        ((2, 8, 8, 8), (2, 2, 2, 32)),  # 3a..5a: stride 4, 112 * 0.25 -> 32 ch
        ((2, 2, 2, 32), (2, 10)),
    ]
    assert io[-1][1].dtype == jnp.float32
    # any size >= 32 works, with abstract (never materialised) stages too
    abstract = nnx.eval_shape(lambda: build_stages("b0", splits=["4a"], rngs=nnx.Rngs(0), **TINY))
    io = stage_io_shapes(abstract, batch=1, image_size=40)
    assert io[0][1].shape == (1, 5, 5, 16) and io[1][1].shape == (1, 10)


def test_float16_compute_close_to_float32(nets, images, logits):
    # Same parameters (float32), convs/matmuls in float16; norms, pool, classifier in float32.
    # float16 keeps ~3 significant digits; through 7 blocks the logits (|max| ~ 4.5) drift by
    # ~0.02, so allow 0.1 absolute + 2 % relative.
    whole, _ = nets
    half = nnx.eval_shape(lambda: EfficientNet("b0", dtype=jnp.float16, rngs=nnx.Rngs(0), **TINY))
    nnx.update(half, nnx.state(whole))
    out = nnx.jit(lambda m, x: m(x))(half, images)
    assert out.dtype == jnp.float32 and np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(logits), rtol=0.02, atol=0.1)


# ------------------------------------------------------------------------- normalize


def test_normalize_matches_numpy():
    import jax.numpy as jnp

    x = np.random.default_rng(0).integers(0, 256, size=(2, 5, 5, 3), dtype=np.uint8)
    expect = (x.astype(np.float64) - np.array(MEAN_RGB)) / np.array(STD_RGB)
    np.testing.assert_allclose(np.asarray(MEAN_RGB) / 255, (0.485, 0.456, 0.406))
    np.testing.assert_allclose(np.asarray(STD_RGB) / 255, (0.229, 0.224, 0.225))
    out = normalize(jnp.asarray(x), jnp.float32)
    assert out.dtype == jnp.float32 and out.shape == x.shape
    np.testing.assert_allclose(np.asarray(out), expect, rtol=1e-5, atol=1e-5)
    half = normalize(jnp.asarray(x), jnp.bfloat16)
    assert half.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(half, dtype=np.float32), expect, rtol=1e-2, atol=2e-2)
