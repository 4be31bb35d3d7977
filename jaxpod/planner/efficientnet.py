"""EfficientNet's activation bytes, from the packed-stage program's structure. Jax-free.

The step (`jaxpod.engine.packed`) runs each pipeline stage as one remat unit on a float32
carry `[mb, A]` (A: the largest per-image tensor crossing a stage boundary, the input image
included), switched by `lax.switch` per tick. Per device it holds:

- `stage_work`: one stage's backward for one micro-batch: every tensor XLA keeps for it in
  its pieces (`pieces`: per MBConv block the input, the expand and spatial ConvNorms, the
  SE-gated tensor, the projection's norm; stem and head likewise) at each piece's spatial
  size and width; conv operands and outputs widened on XLA:CPU, the norm's values float32,
  the swish's in the compute dtype. The stage is one remat unit, so remat `full` and `none`
  hold the same set while the stage's backward runs.
- `grad_rows`: the stage's parameter gradient is one padded row `[n_max]` per leaf (the
  transpose of `StagePacking.unpack`'s slices). With float32 rows XLA:CPU sums them in one
  fused add, and the pads it cannot fuse into it (one per conv kernel, one per norm) are all
  live at its end; with 16-bit rows, or pipelined without remat, it adds them one by one.
- `carries`: float32 `[mb, A]` buffers of the schedule: at the backward's peak GPipe keeps
  every tick's input (the checkpoint's residual) and every tick output's cotangent (the
  transpose of the scan's collected rows); the embedded micro-batches are dead by then
  (the forward ticks consumed them). 1F1B keeps its two ring buffers.
- `update_work`: the update on whole rows (`PackedStages._stage_update`): float32 copies
  of the row, and with 16-bit rows the stochastic rounding's random bits.
"""

from __future__ import annotations

from jaxpod.config import Config
from jaxpod.models.efficientnet_specs import (
    IMAGE_CH,
    block_specs,
    split_specs,
    stem_head_channels,
)

F32 = 4
# Per output element, what XLA keeps of a ConvNorm for its backward (buffer assignments of the
# calibration rows): the conv output (`wide` bytes; the norm's and swish's inputs are
# recomputed from it in the backward's fusions), the centred and the normalised values
# (float32: `GroupNorm` computes in float32) and, with swish, the sigmoid (an elementwise
# value of the compute dtype, `act` bytes, never widened). The affine output and the square's
# derivative are not kept: fusions recompute them.
NORM_F32_SAVES = 2  # centred, normalised
# A conv's operand is kept once, where the conv reads it (`wide` bytes: XLA:CPU convolves in
# float32): the image, a block's input, the expand's swish output, the SE-gated tensor.
# The spatial swish output is kept in the compute dtype (the SE's mean and gate read it).


def _convnorm(wide: int, act: int, swish: bool) -> int:
    return wide + NORM_F32_SAVES * F32 + (act if swish else 0)


# One padded gradient row is live per conv kernel and per norm (its scale and bias grads
# come out of one reduction), plus the fused sum's own output.
SUM_OUTPUT_ROWS = 1
# Summed one by one: the running sum and the next padded row.
RUNNING_SUM_ROWS = 2
# Stochastic rounding draws one uint32 per element with threefry2x32: its two lanes, the two
# lanes of the previous round group and their loop copies are live together (6 rows), beside
# the float32 update row and the unscaled gradient row.
SR_BIT_ROWS = 6
UPDATE_F32_ROWS = 2
# Without a pipeline, XLA:CPU schedules the stochastic rounding's random bits (they depend on
# the key, not on the gradient) before the backward: both threefry lanes of every 16-bit row
# it rounds (the weights row, the 16-bit optimizer rows) are live at the backward's peak.
SR_LANES = 2


def _size(hw: int, stride: int) -> int:
    return -(-hw // stride)  # SAME padding


def pieces(cfg: Config, wide: int = F32, act: int = F32) -> list[list[dict]]:
    """Per pipeline stage, its pieces: `{"residuals": saved bytes per image, "convs", "norms",
    "in", "out": elements per image of its input and output}`. `wide`: bytes of a conv's
    operand or output; `act`: bytes of an elementwise value of the compute dtype."""
    md = cfg.model
    specs = block_specs(md.variant, g16=md.g16, width_mult=md.width_mult, depth_mult=md.depth_mult)
    stem_ch, head_ch = stem_head_channels(md.variant, width_mult=md.width_mult)
    hw = md.image_size
    stem_hw = _size(hw, 2)
    image = hw * hw * IMAGE_CH
    stem = {  # its swish output is the first block's input, kept there
        "residuals": image * wide + _convnorm(wide, act, True) * stem_hw**2 * stem_ch,
        "convs": 1,
        "norms": 1,
        "in": image,
        "out": stem_hw**2 * stem_ch,
    }
    hw, blocks = stem_hw, []
    for s in specs:
        h_in, h_out = hw, _size(hw, s.stride)
        saved = h_in**2 * s.in_ch * wide  # the block input (the first conv's operand)
        if s.expand != 1:  # expand ConvNorm, and its swish output (the spatial conv's operand)
            saved += (_convnorm(wide, act, True) + wide) * h_in**2 * s.mid_ch
        saved += _convnorm(wide, act, True) * h_out**2 * s.mid_ch  # spatial ConvNorm
        saved += act * h_out**2 * s.mid_ch  # its swish output, read by the SE
        saved += wide * h_out**2 * s.mid_ch  # the SE-gated tensor (the projection's operand)
        saved += _convnorm(wide, act, False) * h_out**2 * s.out_ch  # projection ConvNorm
        convs = 3 if s.expand != 1 else 2
        blocks.append({
            "residuals": saved, "convs": convs, "norms": convs,
            "in": h_in**2 * s.in_ch, "out": h_out**2 * s.out_ch, "name": s.name,
        })  # fmt: skip
        hw = h_out
    last = specs[-1].out_ch
    head = {  # its swish output only feeds the mean: not kept
        "residuals": hw**2 * last * wide
        + _convnorm(wide, act, True) * hw**2 * head_ch
        + head_ch * F32,
        "convs": 1,
        "norms": 1,
        "in": hw**2 * last,
        "out": md.num_classes,
    }
    runs = split_specs(specs, md.pipeline_splits)
    out, i = [], 0
    for k, run in enumerate(runs):
        stage = ([stem] if k == 0 else []) + blocks[i : i + len(run)]
        stage += [head] if k == len(runs) - 1 else []
        out.append(stage)
        i += len(run)
    return out


def carry_size(stages: list[list[dict]]) -> int:
    """A: the largest per-image tensor entering or leaving a stage (the carry's width)."""
    return max(max(s[0]["in"], s[-1]["out"]) for s in stages)


def activation_bytes(
    cfg: Config, cb: int, act: int, row_elements: int, grad_bytes: int, sr_rows: int = 0
) -> dict:
    """Activation bytes per device (the breakdown `bytes.activation_bytes` reports), plus the
    packed update's working set (`update_work`). `cb`: bytes of a conv's operand or output
    (the compute dtype's, or 4 on a device that widens 16-bit); `act`: the compute dtype's
    bytes; `row_elements`: the packed row's length n_max; `grad_bytes`: a gradient's bytes;
    `sr_rows`: how many rows of that length the update rounds stochastically."""
    mesh, tr = cfg.mesh, cfg.train
    stages = pieces(cfg, cb, act)
    mb, S = tr.micro_batch, mesh.pipeline
    micro = cfg.pipeline_group
    row_bytes = row_elements * grad_bytes
    fused_sum = grad_bytes == F32 and (S == 1 or cfg.model.remat != "none")
    saved = [sum(p["residuals"] for p in st) * mb for st in stages]
    # Pipelined without remat, the stage's `lax.switch` is linearized as a whole: every branch
    # returns the union of all branches' residuals (zeros for the stages not taken), so a
    # device holds every other stage's residual set beside its own.
    union = S > 1 and cfg.model.remat == "none"
    stage_work = grad_rows = 0
    for k, st in enumerate(stages):
        others = sum(saved) - saved[k] if union else 0
        # the stage's backward walks its pieces in reverse: at piece i the residuals of
        # pieces 0..i are live, and (fused sum) the padded gradient rows of pieces i..end
        for i in range(len(st)):
            work = others + sum(p["residuals"] for p in st[: i + 1]) * mb
            rows = sum(p["convs"] + p["norms"] for p in st[i:]) + SUM_OUTPUT_ROWS
            rows = rows if fused_sum else RUNNING_SUM_ROWS
            if work + rows * row_bytes > stage_work + grad_rows:
                stage_work, grad_rows = work, rows * row_bytes
    carry = mb * carry_size(stages) * F32
    if S == 1:
        ticks, carries = 1, 0
    elif tr.pipeline_schedule == "1f1b":
        ticks = 2 * micro + 2 * S - 2
        carries = (2 * S + 2) * carry  # two ring buffers of S, the two values sent
    else:
        ticks = micro + S - 1
        carries = 2 * ticks * carry  # tick inputs, tick outputs' cotangents
    early_bits = SR_LANES * sr_rows * row_elements * F32 if S == 1 else 0
    total = carries + stage_work + grad_rows + early_bits
    update_work = UPDATE_F32_ROWS * row_elements * F32
    if cfg.precision.params != "float32":
        update_work += SR_BIT_ROWS * row_elements * F32
    return {
        "saved": carries,
        "pipeline_buffers": carries,
        "head": 0,
        "layer_work": stage_work,
        "grad_rows": grad_rows,
        "sr_bits": int(early_bits),
        "update_work": int(update_work),
        "ticks": ticks,
        "total": int(total),
        "estimated": False,
    }
