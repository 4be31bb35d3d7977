"""EfficientNet B0..B4 in Flax NNX, with GroupNorm and the G16 variant. Math only: no mesh.

The network is a sequence of *pieces*: the stem (3x3/2 conv, norm, swish), the MBConv blocks
named like the reference (`"1a"`, `"2a"`, `"2b"`, `"3a"`, ...: stage number, one letter per
repeat), and the head (1x1 conv, norm, swish, global average pool, classifier). A pipeline cuts
that sequence at block names: `build_stages(..., splits=["4a"])` gives two `Stage`s, stem..3b
and 4a..head. Parameters are drawn from `rngs` piece by piece in network order, so for one seed
they do not depend on `splits`; `restage` regroups existing pieces (sharing their parameters)
under other splits. `EfficientNet` is just `stages` called in order, so the whole net and its
stages compute the same function with the same parameters by construction.

Differences from the reference (TF "efficientnet_model.py"), all deliberate:
- GroupNorm (per-channel affine, `groups` groups, default 4) instead of BatchNorm everywhere;
  its `scale`/`bias` take BatchNorm's gamma/beta place, so parameter counts are unchanged.
  When `groups` does not divide a channel count, that norm uses the largest divisor of the
  channel count that is <= `groups` (`norm_groups`).
- No dropout, no stochastic depth: the forward is deterministic.
- `g16=True` (Graphcore's "G16" EfficientNet): every depthwise spatial conv becomes a grouped
  conv with 16 channels per group and expansion ratio 6 becomes 4 (1 stays 1). If the
  conv's channel count is not divisible by 16 (or is below 16), the group size is the largest
  divisor of the channel count that is <= 16 (a plain full conv when channels <= 16 and
  channels divides itself only, e.g. 8 channels -> one group of 8). See `g16_group_size`.

Layout is NHWC. `dtype` is the compute dtype of convs and matmuls; norm statistics, the global
pool and the classifier run in float32, and the logits are float32.
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# variant -> (width coefficient, depth coefficient, resolution)
VARIANTS: dict[str, tuple[float, float, int]] = {
    "b0": (1.0, 1.0, 224),
    "b1": (1.0, 1.1, 240),
    "b2": (1.1, 1.2, 260),
    "b3": (1.2, 1.4, 300),
    "b4": (1.4, 1.8, 380),
}

# B0 stages: (expand, kernel, stride, in_ch, out_ch, repeats); squeeze-excitation ratio 0.25.
BASE_BLOCKS: tuple[tuple[int, int, int, int, int, int], ...] = (
    (1, 3, 1, 32, 16, 1),
    (6, 3, 2, 16, 24, 2),
    (6, 5, 2, 24, 40, 2),
    (6, 3, 2, 40, 80, 3),
    (6, 5, 1, 80, 112, 3),
    (6, 5, 2, 112, 192, 4),
    (6, 3, 1, 192, 320, 1),
)
STEM_CH = 32
HEAD_CH = 1280
SE_RATIO = 0.25
G16_GROUP_SIZE = 16
G16_EXPAND = 4  # expansion 6 -> 4 in the G16 variant
IMAGE_CH = 3
F32 = jnp.float32


def round_filters(filters: int, width: float, divisor: int = 8) -> int:
    """Channels scaled by `width`, rounded to a multiple of `divisor`, never more than 10 %
    below `filters * width` (the reference rule)."""
    scaled = filters * width
    rounded = max(divisor, int(scaled + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * scaled:
        rounded += divisor
    return int(rounded)


def round_repeats(repeats: int, depth: float) -> int:
    """Block repeats scaled by `depth`: `ceil(depth * repeats)`."""
    return int(math.ceil(depth * repeats))


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of `n` that is <= `limit` (>= 1)."""
    return max(d for d in range(1, min(n, max(limit, 1)) + 1) if n % d == 0)


def norm_groups(channels: int, groups: int) -> int:
    """GroupNorm group count used for `channels`: `groups` if it divides `channels`, else the
    largest divisor of `channels` that is <= `groups`."""
    return largest_divisor_at_most(channels, groups)


def g16_group_size(channels: int) -> int:
    """Channels per group of a G16 spatial conv: 16 if it divides `channels`, else the largest
    divisor of `channels` that is <= 16 (so `channels < 16` gives a single full group)."""
    return largest_divisor_at_most(channels, G16_GROUP_SIZE)


@dataclass(frozen=True)
class BlockSpec:
    """One MBConv block. `group_size` is the channels per group of the spatial conv (1 =
    depthwise); `expand` the expansion ratio of the (optional, `expand > 1`) 1x1 conv."""

    name: str
    in_ch: int
    out_ch: int
    kernel: int
    stride: int
    expand: int
    group_size: int

    @property
    def mid_ch(self) -> int:
        """Channels of the expanded activation (the spatial conv's width)."""
        return self.in_ch * self.expand

    @property
    def feature_groups(self) -> int:
        """`feature_group_count` of the spatial conv."""
        return self.mid_ch // self.group_size

    @property
    def se_ch(self) -> int:
        """Squeeze-excitation bottleneck width: `max(1, int(in_ch * 0.25))`."""
        return max(1, int(self.in_ch * SE_RATIO))

    @property
    def residual(self) -> bool:
        """Identity skip connection (stride 1 and `in_ch == out_ch`)."""
        return self.stride == 1 and self.in_ch == self.out_ch


def _variant(variant: str) -> tuple[float, float, int]:
    if variant not in VARIANTS:
        raise ValueError(f"unknown EfficientNet variant {variant!r}; valid: {', '.join(VARIANTS)}")
    return VARIANTS[variant]


def _coefficients(variant: str, width_mult: float | None, depth_mult: float | None):
    width, depth, _ = _variant(variant)
    return (width if width_mult is None else width_mult), (
        depth if depth_mult is None else depth_mult
    )


def stem_head_channels(variant: str, *, width_mult: float | None = None) -> tuple[int, int]:
    """`(stem_ch, head_ch)`: output channels of the stem conv and of the head 1x1 conv."""
    width, _ = _coefficients(variant, width_mult, None)
    return round_filters(STEM_CH, width), round_filters(HEAD_CH, width)


def default_image_size(variant: str) -> int:
    """The variant's published training resolution (any size >= 32 works)."""
    return _variant(variant)[2]


def block_specs(
    variant: str,
    *,
    g16: bool = False,
    width_mult: float | None = None,
    depth_mult: float | None = None,
) -> list[BlockSpec]:
    """The MBConv blocks of `variant` in order; `width_mult`/`depth_mult` override its
    compound-scaling coefficients. The first block of a stage has the stage's stride and input
    width; its repeats have stride 1 and `in_ch == out_ch`."""
    width, depth = _coefficients(variant, width_mult, depth_mult)
    specs = []
    for stage, (expand, kernel, stride, c_in, c_out, repeats) in enumerate(BASE_BLOCKS, 1):
        c_in, c_out = round_filters(c_in, width), round_filters(c_out, width)
        if g16 and expand == 6:
            expand = G16_EXPAND
        for i in range(round_repeats(repeats, depth)):
            in_ch = c_in if i == 0 else c_out
            group_size = g16_group_size(in_ch * expand) if g16 else 1
            specs.append(
                BlockSpec(
                    name=f"{stage}{string.ascii_lowercase[i]}",
                    in_ch=in_ch,
                    out_ch=c_out,
                    kernel=kernel,
                    stride=stride if i == 0 else 1,
                    expand=expand,
                    group_size=group_size,
                )
            )
    return specs


def split_specs(specs: Sequence[BlockSpec], splits: Sequence[str]) -> list[list[BlockSpec]]:
    """Cut `specs` before each block named in `splits` (strictly increasing): `len(splits)+1`
    runs (a run may be empty: `splits=["1a"]` makes stage 0 the stem alone).

    Raises ValueError naming the valid block names for an unknown or out-of-order split."""
    names = [s.name for s in specs]
    valid = f"valid block names: {', '.join(names)}"
    cuts = []
    for name in splits:
        if name not in names:
            raise ValueError(f"unknown split block {name!r}; {valid}")
        cut = names.index(name)
        if cuts and cut <= cuts[-1]:
            raise ValueError(f"splits must be strictly increasing, got {list(splits)}; {valid}")
        cuts.append(cut)
    bounds = [0, *cuts, len(specs)]
    return [list(specs[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


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
        kernel_metadata={"axes": (None, None, None, None)},
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
        kernel_metadata={"axes": (None, None)},
        bias_metadata={"axes": (None,)},
        rngs=rngs,
    )


class GroupNorm(nnx.Module):
    """GroupNorm over NHWC `x[B, ..., C] -> [B, ..., C]` (same dtype as `x`): each sample's
    `C` channels are cut into `norm_groups(C, groups)` groups, each normalised over its
    channels and all spatial positions, in float32; then per-channel `scale[C]`, `bias[C]`."""

    def __init__(self, channels: int, groups: int, *, eps: float = 1e-5, param_dtype=F32):
        self.groups = norm_groups(channels, groups)
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((channels,), param_dtype), axes=(None,))
        self.bias = nnx.Param(jnp.zeros((channels,), param_dtype), axes=(None,))

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
        self, in_ch, out_ch, kernel, stride=1, *, feature_groups=1, act=True, groups, dtype,
        param_dtype, rngs,
    ):  # fmt: skip
        self.conv = _conv(
            in_ch, out_ch, kernel, stride, feature_groups=feature_groups, dtype=dtype,
            param_dtype=param_dtype, rngs=rngs,
        )  # fmt: skip
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
            head_ch, num_classes, init=_uniform_fan_out(num_classes), dtype=F32,
            param_dtype=param_dtype, rngs=rngs,
        )  # fmt: skip

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
    dtype=F32,
    param_dtype=F32,
    rngs: nnx.Rngs,
) -> list[Stage]:
    """`len(splits) + 1` consecutive `Stage`s of the network; each name in `splits` is the
    first block of a new stage (`[]` = one stage, the whole net). Parameters are drawn in
    network order, so they are the same for every `splits` given the same `rngs` seed."""
    specs = block_specs(variant, g16=g16, width_mult=width_mult, depth_mult=depth_mult)
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
        dtype=F32,
        param_dtype=F32,
        rngs: nnx.Rngs,
    ):
        self.stages = nnx.List(
            build_stages(
                variant, splits=splits, num_classes=num_classes, g16=g16, groups=groups,
                width_mult=width_mult, depth_mult=depth_mult, dtype=dtype,
                param_dtype=param_dtype, rngs=rngs,
            )
        )  # fmt: skip

    def __call__(self, x: jax.Array) -> jax.Array:
        for stage in self.stages:
            x = stage(x)
        return x


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


def flops_per_image(
    variant: str = "b0",
    image_size: int | None = None,
    num_classes: int = 1000,
    *,
    g16: bool = False,
    width_mult: float | None = None,
    depth_mult: float | None = None,
) -> int:
    """Forward FLOPs of one image, counted as 2 x multiply-adds of every conv and dense layer
    (stem, expand, spatial, squeeze-excitation, project, head, classifier). Norms,
    activations, pools, the SE gating multiply and residual adds are not counted. (Published
    "0.39B FLOPs" for B0 are multiply-adds, i.e. ~0.78e9 here.) `image_size` defaults to the
    variant's resolution."""
    size = default_image_size(variant) if image_size is None else image_size
    specs = block_specs(variant, g16=g16, width_mult=width_mult, depth_mult=depth_mult)
    stem_ch, head_ch = stem_head_channels(variant, width_mult=width_mult)

    def conv(hw: int, k: int, c_in: int, c_out: int, groups: int = 1) -> int:
        return 2 * hw * hw * k * k * (c_in // groups) * c_out

    hw = -(-size // 2)
    total = conv(hw, 3, IMAGE_CH, stem_ch)
    for s in specs:
        if s.expand != 1:
            total += conv(hw, 1, s.in_ch, s.mid_ch)
        hw = -(-hw // s.stride)
        total += conv(hw, s.kernel, s.mid_ch, s.mid_ch, s.feature_groups)
        total += 2 * 2 * s.mid_ch * s.se_ch
        total += conv(hw, 1, s.mid_ch, s.out_ch)
    total += conv(hw, 1, specs[-1].out_ch, head_ch) + 2 * head_ch * num_classes
    return int(total)
