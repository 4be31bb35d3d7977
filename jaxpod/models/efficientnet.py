"""EfficientNet B0..B4 in Flax NNX, with GroupNorm and the G16 variant. Math only: no mesh.

The network is a sequence of *pieces*: the stem (3x3/2 conv, norm, swish), the MBConv blocks
named like the reference (`"1a"`, `"2a"`, `"2b"`, ...: block group and repeat;
`jaxpod.config.efficientnet_specs`), and the head (1x1 conv, norm, swish, global average
pool, classifier). A pipeline cuts the sequence at block names: `build_stages(...,
splits=["4a"])` gives two `Stage`s, stem..3b and 4a..head. Parameters are drawn piece by
piece in network order, so for one seed they do not depend on `splits`; `restage` regroups
existing pieces (sharing their parameters). `EfficientNet` calls the stages in order, so the
whole net and its stages compute the same function with the same parameters.

Deliberate differences from the reference (TF "efficientnet_model.py"):
- GroupNorm (`groups` groups, default 4, per-channel affine) instead of BatchNorm
  everywhere; its `scale`/`bias` take gamma/beta's place, so parameter counts are
  unchanged. Where `groups` does not divide the channels, the largest divisor <= `groups`
  (`norm_groups`).
- No dropout, no stochastic depth: the forward is deterministic.
- `g16=True` (Graphcore's G16): every depthwise spatial conv becomes a grouped conv with 16
  channels per group, and expansion ratio 6 becomes 4 (1 stays 1). Where 16 does not divide
  the channels, the group size is the largest divisor <= 16 (`g16_group_size`; e.g. 8
  channels -> one group of 8, a plain conv).

Layout is NHWC. `dtype` is the compute dtype of convs and matmuls; norm statistics, the
global pool and the classifier run in float32, and the logits are float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpod.config.efficientnet_specs import (  # noqa: F401 (re-exported)
    BASE_BLOCK_GROUPS,
    IMAGE_CH,
    VARIANTS,
    BlockSpec,
    block_specs,
    default_image_size,
    flops_per_image,
    g16_group_size,
    norm_groups,
    split_specs,
    stem_head_channels,
)
from jaxpod.config.kinds import KINDS
from jaxpod.models.family import Family
from jaxpod.models.params import NO_DECAY, metadata, param

F32 = jnp.float32


def _fan_out_normal(fan_out: int):
    """Initializer `normal(0, sqrt(2 / fan_out))` (the reference conv initializer)."""

    def init(key, shape, dtype=F32):
        return (math.sqrt(2.0 / fan_out) * jax.random.normal(key, shape, F32)).astype(dtype)

    return init


def _uniform_fan_out(fan_out: int):
    """Initializer `uniform(-1/sqrt(fan_out), 1/sqrt(fan_out))` (the reference dense init)."""

    def init(key, shape, dtype=F32):
        limit = 1.0 / math.sqrt(fan_out)
        return jax.random.uniform(key, shape, F32, -limit, limit).astype(dtype)

    return init


def _conv(in_ch, out_ch, kernel, stride, *, feature_groups, dtype, param_dtype, rngs) -> nnx.Conv:
    """Bias-free SAME conv, kernel `[k, k, in_ch / groups, out_ch]`, fan-out normal init where
    fan-out is `k * k * out_ch / groups` (for depthwise, `k * k`, as in the reference)."""
    return nnx.Conv(
        in_ch,
        out_ch,
        (kernel, kernel),
        strides=stride,
        padding="SAME",
        feature_group_count=feature_groups,
        use_bias=False,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=_fan_out_normal(kernel * kernel * out_ch // feature_groups),
        kernel_metadata=metadata(axes=(None, None, None, None)),
        rngs=rngs,
    )


def _dense(in_f, out_f, *, init, dtype, param_dtype, rngs) -> nnx.Linear:
    """Dense with bias, kernel `[in_f, out_f]`, zero bias."""
    return nnx.Linear(
        in_f,
        out_f,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=init,
        kernel_metadata=metadata(axes=(None, None)),
        bias_metadata=metadata(NO_DECAY, axes=(None,)),
        rngs=rngs,
    )


class GroupNorm(nnx.Module):
    """GroupNorm over NHWC `x[B, ..., C] -> [B, ..., C]` (same dtype as `x`): each sample's
    `C` channels are cut into `norm_groups(C, groups)` groups, each normalised over its
    channels and all spatial positions, in float32; then per-channel `scale[C]`, `bias[C]`."""

    def __init__(self, channels: int, groups: int, *, eps: float = 1e-5, param_dtype=F32):
        self.groups = norm_groups(channels, groups)
        self.eps = eps
        self.scale = param(jnp.ones((channels,), param_dtype), (None,), NO_DECAY)
        self.bias = param(jnp.zeros((channels,), param_dtype), (None,), NO_DECAY)

    def __call__(self, x: jax.Array) -> jax.Array:
        c = x.shape[-1]
        g = x.astype(F32).reshape(*x.shape[:-1], self.groups, c // self.groups)
        axes = (*range(1, g.ndim - 2), g.ndim - 1)  # spatial dims and channels-in-group
        mean = jnp.mean(g, axis=axes, keepdims=True)
        var = jnp.mean(jnp.square(g - mean), axis=axes, keepdims=True)
        y = ((g - mean) * jax.lax.rsqrt(var + self.eps)).reshape(x.shape)
        return (y * self.scale[...].astype(F32) + self.bias[...].astype(F32)).astype(x.dtype)


class ConvNorm(nnx.Module):
    """Conv (no bias) -> GroupNorm -> optional swish: `x[B, H, W, in_ch] -> [B, H/s, W/s,
    out_ch]` (SAME padding, spatial size `ceil(H / stride)`)."""

    def __init__(
        self,
        in_ch,
        out_ch,
        kernel,
        stride=1,
        *,
        feature_groups=1,
        act=True,
        groups,
        dtype,
        param_dtype,
        rngs,
    ):
        self.conv = _conv(
            in_ch,
            out_ch,
            kernel,
            stride,
            feature_groups=feature_groups,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.norm = GroupNorm(out_ch, groups, param_dtype=param_dtype)
        self.act = act

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.norm(self.conv(x))
        return jax.nn.silu(y) if self.act else y


class MBConv(nnx.Module):
    """Mobile inverted bottleneck: [1x1 expand] -> k x k spatial (depthwise or grouped) ->
    squeeze-excitation -> 1x1 project [+ x]. `x[B, H, W, in_ch] -> [B, H/s, W/s, out_ch]`."""

    def __init__(self, spec: BlockSpec, *, groups: int, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(groups=groups, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        mid = spec.mid_ch
        self.spec = spec
        self.expand = ConvNorm(spec.in_ch, mid, 1, **kw) if spec.expand != 1 else None
        self.spatial = ConvNorm(
            mid, mid, spec.kernel, spec.stride, feature_groups=spec.feature_groups, **kw
        )
        dense = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.se_reduce = _dense(mid, spec.se_ch, init=_fan_out_normal(spec.se_ch), **dense)
        self.se_expand = _dense(spec.se_ch, mid, init=_fan_out_normal(mid), **dense)
        self.project = ConvNorm(mid, spec.out_ch, 1, act=False, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x if self.expand is None else self.expand(x)
        h = self.spatial(h)
        s = jnp.mean(h.astype(F32), axis=(1, 2))  # [B, mid] squeeze
        s = jax.nn.sigmoid(self.se_expand(jax.nn.silu(self.se_reduce(s))))
        h = self.project(h * s[:, None, None, :].astype(h.dtype))
        return h + x.astype(h.dtype) if self.spec.residual else h


class Head(nnx.Module):
    """1x1 conv -> GroupNorm -> swish -> global average pool -> classifier (float32):
    `x[B, h, w, in_ch] -> logits[B, num_classes]` float32."""

    def __init__(self, in_ch, head_ch, num_classes, *, groups, dtype, param_dtype, rngs):
        self.conv = ConvNorm(
            in_ch, head_ch, 1, groups=groups, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.classifier = _dense(
            head_ch,
            num_classes,
            init=_uniform_fan_out(num_classes),
            dtype=F32,
            param_dtype=param_dtype,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        pooled = jnp.mean(self.conv(x).astype(F32), axis=(1, 2))
        return self.classifier(pooled).astype(F32)


class Stage(nnx.Module):
    """A run of consecutive pieces: optional stem, blocks, optional head (stage 0 has the stem,
    the last stage the head). `x[B, H, W, 3]` float images (stage 0) or the previous stage's
    activation `[B, h, w, c]` -> the next activation, or logits `[B, num_classes]` float32 for
    the last stage."""

    def __init__(self, stem: ConvNorm | None, blocks: Sequence[MBConv], head: Head | None):
        self.stem = stem
        self.blocks = nnx.List(list(blocks))
        self.head = head

    @property
    def block_names(self) -> list[str]:
        return [b.spec.name for b in self.blocks]

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.stem is not None:
            x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x if self.head is None else self.head(x)


def restage(stages: Sequence[Stage], splits: Sequence[str]) -> list[Stage]:
    """The pieces of `stages` regrouped at `splits` (same module objects: parameters shared)."""
    blocks = [b for s in stages for b in s.blocks]
    runs = split_specs([b.spec for b in blocks], splits)
    out, i = [], 0
    for k, run in enumerate(runs):
        stem = stages[0].stem if k == 0 else None
        head = stages[-1].head if k == len(runs) - 1 else None
        out.append(Stage(stem, blocks[i : i + len(run)], head))
        i += len(run)
    return out


def build_stages(
    variant: str = "b0",
    *,
    splits: Sequence[str] = (),
    num_classes: int = 1000,
    g16: bool = False,
    groups: int = 4,
    width_mult: float | None = None,
    depth_mult: float | None = None,
    block_groups: int | None = None,
    dtype=F32,
    param_dtype=F32,
    rngs: nnx.Rngs,
) -> list[Stage]:
    """`len(splits) + 1` consecutive `Stage`s of the network; each name in `splits` is the
    first block of a new stage (`[]` = one stage, the whole net). Parameters are drawn in
    network order, so they are the same for every `splits` given the same `rngs` seed."""
    specs = block_specs(
        variant, g16=g16, width_mult=width_mult, depth_mult=depth_mult, block_groups=block_groups
    )
    split_specs(specs, splits)  # validate before allocating anything
    stem_ch, head_ch = stem_head_channels(variant, width_mult=width_mult)
    kw = dict(groups=groups, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    stem = ConvNorm(IMAGE_CH, stem_ch, 3, 2, **kw)
    blocks = [MBConv(spec, **kw) for spec in specs]
    head = Head(specs[-1].out_ch, head_ch, num_classes, **kw)
    return restage([Stage(stem, blocks, head)], splits)


class EfficientNet(nnx.Module):
    """The whole network as one module: `stages` (from `build_stages`) applied in order.
    `x[B, H, W, 3]` normalised images (H, W >= 32) -> logits `[B, num_classes]` float32.
    Pipeline stage k is `model.stages[k]`; other cuts of the same parameters: `restage`."""

    def __init__(
        self,
        variant: str = "b0",
        *,
        splits: Sequence[str] = (),
        num_classes: int = 1000,
        g16: bool = False,
        groups: int = 4,
        width_mult: float | None = None,
        depth_mult: float | None = None,
        block_groups: int | None = None,
        dtype=F32,
        param_dtype=F32,
        rngs: nnx.Rngs,
    ):
        self.stages = nnx.List(
            build_stages(
                variant,
                splits=splits,
                num_classes=num_classes,
                g16=g16,
                groups=groups,
                width_mult=width_mult,
                depth_mult=depth_mult,
                block_groups=block_groups,
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=rngs,
            )
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        for stage in self.stages:
            x = stage(x)
        return x


# ImageNet per-channel statistics (RGB), on the 0..255 scale of the uint8 pixels.
MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def normalize(images: jax.Array, dtype) -> jax.Array:
    """uint8 RGB images [..., 3] -> (x - ImageNet mean) / ImageNet std per channel, in `dtype`.

    Called on the device, inside the jitted step: the host sends uint8 pixels, 1/4 of the bytes
    of float32 (1/2 of bfloat16). The arithmetic is done in float32, then cast to `dtype`.
    """
    mean = jnp.asarray(MEAN_RGB, dtype=jnp.float32)
    inv_std = 1.0 / jnp.asarray(STD_RGB, dtype=jnp.float32)
    return ((images.astype(jnp.float32) - mean) * inv_std).astype(dtype)


def count_params(tree) -> int:
    """Number of parameter scalars in a module (its `nnx.Param`s), a state, or any pytree of
    arrays / `ShapeDtypeStruct`s (e.g. from `nnx.eval_shape`)."""
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree, nnx.Param)
    return int(sum(math.prod(np.shape(x)) for x in jax.tree.leaves(tree)))


def stage_io_shapes(
    stages: Sequence[Stage], batch: int, image_size: int
) -> list[tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]]:
    """`(input, output)` shape/dtype of each stage for `[batch, image_size, image_size, 3]`
    float32 images (via `jax.eval_shape`: nothing is computed; abstract stages from
    `nnx.eval_shape` work too). Stage k's output is stage k+1's input."""
    x = jax.ShapeDtypeStruct((batch, image_size, image_size, IMAGE_CH), F32)
    out = []
    for stage in stages:
        graphdef, state = nnx.split(stage)
        y = jax.eval_shape(lambda s, a, g=graphdef: nnx.merge(g, s)(a), state, x)
        out.append((x, y))
        x = y
    return out


def _stages_of(md, *, rngs: nnx.Rngs, dtype=F32, param_dtype=F32) -> list:
    """The pipeline stages of the model config `md` (`build_stages` of its fields)."""
    return build_stages(
        md.variant,
        splits=list(md.pipeline_splits),
        num_classes=md.num_classes,
        g16=md.g16,
        groups=md.norm_groups,
        width_mult=md.width_mult,
        depth_mult=md.depth_mult,
        block_groups=md.block_groups,
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
    )


FAMILY = Family(KINDS["efficientnet"], _stages_of, prepare_inputs=normalize)
