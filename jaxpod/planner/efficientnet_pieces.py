"""EfficientNet's pieces (stem, MBConv blocks, head) and the bytes each holds per image.

`pieces(cfg, wide, act)` lists, per pipeline stage, what each piece keeps alive at the
moments `jaxpod.planner.efficientnet` models: its weight-gradient inputs and cotangents (the
stem stage's peak), its forward values (another stage's peak), what autodiff saves without
remat, and the sizes of its input, output and kernels. The terms are read off the buffer
assignment of the program jaxpod compiles (`benchmarks/xla_peak.py`); why each is what it
is: docs/memory.md, "The planner's byte model". On a device that pads arrays to tiles
(`DeviceProfile.tile`, XLA:TPU) every image-shaped value counts its padded elements
(`jaxpod.planner.tiles`): channels minor, GroupNorm's group-shaped values a group's channels
minor. Jax-free.
"""

from __future__ import annotations

from jaxpod.config import Config
from jaxpod.config.efficientnet_specs import (
    IMAGE_CH,
    BlockSpec,
    model_block_specs,
    norm_groups,
    split_specs,
    stem_head_channels,
)
from jaxpod.planner.tiles import Tile, group_elements, image_elements

F32 = 4  # GroupNorm computes in float32: its centred values are float32 on every device
# The stem's norm backward, running at the weight-gradient peak: beside its conv output,
# centred values and swish, its output's cotangent and two float32 temporaries of the norm's
# backward (the cotangent scaled by the normalised values, and their group sums broadcast).
STEM_BACKWARD_TEMPS = 2
# The head's backward as it starts (the forward-values peak): two float32 temporaries of its
# norm's backward, beside the classifier's kernel gradient (float32 [head_ch, classes]).
HEAD_BACKWARD_TEMPS = 2
# Without remat a ConvNorm's backward reads what autodiff saved: the centred and normalised
# values (float32, group-shaped), the normalised values times the scale (float32) and, in the
# compute dtype, the affine output and with swish its sigmoid, the sigmoid's derivative factor
# and the swish output (the next conv's operand).
SAVED_NORM_F32 = 3
SAVED_GROUP_F32 = 2  # of them, the group-shaped ones (`[.., G, C/G]`)
SAVED_SWISH_ACT = 4
SAVED_PLAIN_ACT = 1


def _size(hw: int, stride: int) -> int:
    return -(-hw // stride)  # SAME padding


class _Sizes:
    """Elements per image of the values of `channels` at `hw` pixels a side: `image` as a
    convolution's activation `[H, W, C]`, `grouped` as a GroupNorm's group-shaped value; both
    padded to `tile` (None: logical)."""

    def __init__(self, tile: Tile | None, groups: int):
        self.tile, self.groups = tile, groups

    def image(self, hw: int, channels: int) -> int:
        return image_elements(self.tile, hw, channels)

    def grouped(self, hw: int, channels: int) -> int:
        return group_elements(self.tile, hw, channels, norm_groups(channels, self.groups))


def _saved_convnorm(act: int, swish: bool, n: int, grouped: int) -> int:
    """Bytes per image autodiff saves for a ConvNorm's backward without remat: `n` elements
    per output value, `grouped` per group-shaped one."""
    f32 = SAVED_GROUP_F32 * grouped + (SAVED_NORM_F32 - SAVED_GROUP_F32) * n
    return f32 * F32 + (SAVED_SWISH_ACT if swish else SAVED_PLAIN_ACT) * act * n


def _saved_values(hw: int, channels: int, swish: bool) -> list[tuple[str, int, int, int]]:
    """The values `_saved_convnorm` counts, as `(kind, pixels a side, channels, count)`:
    kind "group" (float32, group-shaped), "f32" or "act" (the compute dtype)."""
    acts = SAVED_SWISH_ACT if swish else SAVED_PLAIN_ACT
    f32 = SAVED_NORM_F32 - SAVED_GROUP_F32
    return [("group", hw, channels, SAVED_GROUP_F32), ("f32", hw, channels, f32)] + [
        ("act", hw, channels, acts)
    ]


def _stem_piece(cfg: Config, wide: int, act: int, sz: _Sizes) -> dict:
    """The stem's piece (a stride-2 ConvNorm with swish on the image): its conv output,
    centred values and swish, and (its backward running) its output's cotangent and the norm
    backward's temporaries; the image, when a stage's input, is in `carries` or sliced out of
    the carry (`weight_grad_inputs`, its `image` elements)."""
    md = cfg.model
    stem_ch, _ = stem_head_channels(md.variant, width_mult=md.width_mult)
    hw, out_hw = md.image_size, _size(md.image_size, 2)
    image, stem_out = sz.image(hw, IMAGE_CH), sz.image(out_hw, stem_ch)
    stem_values = (wide + act) * stem_out + F32 * sz.grouped(out_hw, stem_ch)
    stem_cot = (1 + STEM_BACKWARD_TEMPS) * wide * stem_out
    return {
        "kept": stem_values + stem_cot,
        "cot": stem_cot,
        "forward": stem_values,
        # without remat: the image (the stem's operand, compute dtype) and its ConvNorm's
        "saved": act * image + _saved_convnorm(act, True, stem_out, sz.grouped(out_hw, stem_ch)),
        "kernels": 0,  # (the stem's stage is never a forward-values stage)
        "saved_values": [("act", hw, IMAGE_CH, 1)] + _saved_values(out_hw, stem_ch, True),
        "convs": 1,
        "norms": 1,
        "image": image,
        "in": hw * hw * IMAGE_CH,
        "out": out_hw**2 * stem_ch,
        "name": "stem",
    }


def _block_grad_inputs(s: BlockSpec, sizes: tuple, wide: int, act: int) -> tuple[int, int]:
    """`(kept, cot)`: bytes per image an MBConv block (spec `s`, `sizes` its elements per
    image `(n_in, mid_in, mid_out, n_out)`) holds at the weight-gradient peak, and the
    cotangents among them.

    A plain conv (the 1x1 expand and projection, a spatial conv of one group) keeps its
    operand widened and its conv output's cotangent (read by both its data and its weight
    gradient); a grouped spatial conv reads its operand in the compute dtype (the expand's
    swish) and recomputes its output's cotangent."""
    n_in, mid_in, mid_out, n_out = sizes
    plain = s.feature_groups == 1  # the spatial conv is a plain conv (not grouped)
    kept = cot = 0
    if s.expand != 1:
        kept += wide * n_in  # the block input, widened: the expand's operand
        # expand conv output and its swish; its output's cotangent (the spatial's data
        # gradient) and its conv output's cotangent
        kept += (wide + act) * mid_in
        cot += 2 * wide * mid_in
    elif plain:
        kept += wide * n_in  # the block input, widened: the spatial conv's operand
    # spatial conv output, its swish, the SE-gated tensor (the projection's operand,
    # widened); the SE-gated tensor's cotangent (the projection's data gradient)
    kept += (2 * wide + act) * mid_out
    cot += wide * mid_out + (wide * mid_out if plain else 0)
    # projection conv output; its conv output's cotangent. The block output's cotangent
    # (the next piece's data gradient) is counted by `weight_grad_inputs`.
    kept += wide * n_out
    cot += wide * n_out
    kept += cot
    # the SE's [mb, mid] vectors: pooled, reduced and gated, float32 and compute dtype
    kept += (3 * wide + 2 * act) * s.mid_ch
    return kept, cot


def _block_forward(s: BlockSpec, sizes: tuple, grouped: tuple, wide: int, act: int) -> int:
    """Bytes per image of an MBConv block's forward values (the forward-values peak): per
    ConvNorm its conv output and centred values (float32, group-shaped: `grouped`, the
    elements of the expand's, the spatial's and the projection's), per swish its output in
    the compute dtype; each conv's operand once (the block input widened for the expand; the
    SE-gated tensor in the compute dtype and widened)."""
    n_in, mid_in, mid_out, n_out = sizes
    g_mid_in, g_mid_out, g_out = grouped
    plain = s.feature_groups == 1
    fwd = wide * n_in if (s.expand != 1 or plain) else 0
    if s.expand != 1:
        fwd += (wide + act) * mid_in + F32 * g_mid_in
    fwd += (wide + act) * mid_out + F32 * g_mid_out + (act + wide) * mid_out
    fwd += wide * n_out + F32 * g_out
    fwd += (wide + act) * s.mid_ch  # the SE's pooled vector and its gate
    return fwd


def _block_saved_values(s: BlockSpec, h_in: int, h_out: int) -> list[tuple]:
    """An MBConv block's saved values without remat (`_saved_values`): its ConvNorms' and
    the SE-gated tensor."""
    values = _saved_values(h_in, s.mid_ch, True) if s.expand != 1 else []
    values += _saved_values(h_out, s.mid_ch, True) + _saved_values(h_out, s.out_ch, False)
    return values + [("act", h_out, s.mid_ch, 1)]


def _block_piece(s: BlockSpec, h_in: int, wide: int, act: int, sz: _Sizes) -> dict:
    """An MBConv block's piece (spec `s`, input `h_in` pixels a side): its weight-gradient
    inputs (`_block_grad_inputs`), forward values (`_block_forward`), what autodiff saves
    without remat, its kernels and sizes (`sz`: elements per image, padded or not)."""
    h_out = _size(h_in, s.stride)
    sizes = (
        sz.image(h_in, s.in_ch),
        sz.image(h_in, s.mid_ch),
        sz.image(h_out, s.mid_ch),
        sz.image(h_out, s.out_ch),
    )
    grouped = (sz.grouped(h_in, s.mid_ch), sz.grouped(h_out, s.mid_ch))
    grouped += (sz.grouped(h_out, s.out_ch),)
    n_in, mid_in, mid_out, n_out = sizes
    plain = s.feature_groups == 1
    kept, cot = _block_grad_inputs(s, sizes, wide, act)
    # Without remat: each ConvNorm's saved values, and the SE-gated tensor
    saved = _saved_convnorm(act, True, mid_in, grouped[0]) * (s.expand != 1)
    saved += _saved_convnorm(act, True, mid_out, grouped[1])
    saved += _saved_convnorm(act, False, n_out, grouped[2]) + act * mid_out
    kernels = s.in_ch * s.mid_ch * (s.expand != 1) + s.mid_ch * s.out_ch
    kernels += 2 * s.mid_ch * s.se_ch  # SE reduce and expand
    # a depthwise spatial conv's weight gradient, on a device that computes it from a
    # dense [k, k, C, C] float32 kernel (XLA:CPU: `DeviceProfile.dense_depthwise_grads`)
    dense = s.kernel**2 * s.mid_ch**2 * F32 if s.group_size == 1 and not plain else 0
    # a grouped spatial conv's sizes, its copies' (`jaxpod.planner.grouped_convs`)
    grouped_conv = (h_in, h_out, s.mid_ch, s.group_size) if s.group_size > 1 else None
    return {
        "kept": kept,
        "cot": cot,
        "forward": _block_forward(s, sizes, grouped, wide, act),
        "saved": saved,
        "kernels": kernels,
        "dense_grad": dense,
        "grouped_conv": None if plain else grouped_conv,
        "saved_values": _block_saved_values(s, h_in, h_out),
        "out_cot": n_out,
        "residual": s.residual,
        "convs": 3 if s.expand != 1 else 2,
        "norms": 3 if s.expand != 1 else 2,
        "in": h_in**2 * s.in_ch,
        "out": h_out**2 * s.out_ch,
        "name": s.name,
    }


def _head_piece(cfg: Config, last: int, hw: int, wide: int, act: int, sz: _Sizes) -> dict:
    """The head's piece (a 1x1 ConvNorm with swish from the last block's `last` channels at
    `hw` pixels a side, the mean, the classifier)."""
    md = cfg.model
    _, head_ch = stem_head_channels(md.variant, width_mult=md.width_mult)
    head_in, head_out = sz.image(hw, last), sz.image(hw, head_ch)
    head_grouped = sz.grouped(hw, head_ch)
    forward = (wide + act + HEAD_BACKWARD_TEMPS * wide) * head_out + F32 * head_grouped
    return {
        # its operand widened, its conv output, swish and conv output's cotangent (its
        # output's cotangent is the mean's, a [mb, head_ch] vector)
        "kept": wide * head_in + (2 * wide + act) * head_out,
        "cot": wide * head_out,
        "saved": _saved_convnorm(act, True, head_out, head_grouped),
        "saved_values": _saved_values(hw, head_ch, True),
        # its operand widened, conv output, centred values, swish; its backward starting:
        # the norm backward's temporaries and the classifier's kernel gradient (per step)
        "forward": wide * head_in + forward,
        "kernels": last * head_ch,
        "classifier_grad": head_ch * md.num_classes * F32,
        "in_out": head_out,
        "convs": 1,
        "norms": 1,
        "in": hw**2 * last,
        "out": md.num_classes,
        "name": "head",
    }


def pieces(
    cfg: Config, wide: int = F32, act: int = F32, tile: Tile | None = None
) -> list[list[dict]]:
    """Per pipeline stage, its pieces (stem, MBConv blocks, head), each
    `{"kept": bytes per image live at the weight-gradient peak, "forward": bytes per image
    live at the forward-values peak, "kernels": elements of its 1x1 and dense kernels,
    "convs", "norms", "in", "out": elements per image of its input and output}`; a block
    also has `"out_cot"` (elements of its output's cotangent), the stem `"image"` (elements
    of the input image) and `"residual"`, the head
    `"classifier_grad"` (bytes).
    `wide`: bytes of a conv's operand or output (XLA:CPU convolves 16-bit in float32);
    `act`: bytes of an elementwise value of the compute dtype (the swish, the SE's gate);
    `tile`: the device's array tile (`DeviceProfile.tile`), which the byte terms are padded
    to ("in" and "out" stay logical: the carry is a flat `[mb, A]` row)."""
    md = cfg.model
    specs = model_block_specs(md)
    sz = _Sizes(tile, md.norm_groups)
    hw, blocks = _size(md.image_size, 2), []
    for s in specs:
        blocks.append(_block_piece(s, hw, wide, act, sz))
        hw = _size(hw, s.stride)
    stem = _stem_piece(cfg, wide, act, sz)
    head = _head_piece(cfg, specs[-1].out_ch, hw, wide, act, sz)
    runs = split_specs(specs, md.pipeline_splits)
    out, i = [], 0
    for k, run in enumerate(runs):
        stage = ([stem] if k == 0 else []) + blocks[i : i + len(run)]
        stage += [head] if k == len(runs) - 1 else []
        out.append(stage)
        i += len(run)
    return out
