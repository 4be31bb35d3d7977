"""EfficientNet's activation bytes, from the packed-stage program's structure. Jax-free.

The step (`jaxpod.engine.packed`) runs each pipeline stage as one remat unit on a float32
carry `[mb, A]` (A: the largest per-image tensor crossing a stage boundary), switched by
`lax.switch` per tick. What a device holds is read off the buffer assignment of the program
jaxpod compiles (`benchmarks/xla_peak.py`, the memory-minimising scheduler); why each term
is what it is: docs/memory.md, "The planner's byte model". Per device:

- `stage_work`: one stage's backward for one micro-batch. Its peak follows the order of the
  stage's packed gradient row (last leaf first): the stem's stage peaks at the stem's norm
  backward with every weight gradient's inputs live (`weight_grad_inputs`); any other stage
  as its backward starts, with the recomputed forward's values (`forward_values`). Pipelined
  without remat every branch of the switch saves the union of all stages' residuals.
- `grad_rows`: pipelined without remat, the row the gradients accumulate in beside the
  backward; otherwise nothing beside the stage's work (the row is one `concatenate` of the
  leaves' gradients, `StagePacking.unpack`, after the activations are dead).
- `carries`: the schedule's float32 `[mb, A]` buffers (GPipe: every tick's input and its
  output's cotangent, with replicas also the collected outputs; 1F1B: two ring buffers).
- `update_work`: the update on whole rows: float32 copies of the row and, with 16-bit rows,
  the stochastic rounding's random bits; with float32 rows the new optimizer state's leaves.
"""

from __future__ import annotations

from jaxpod.config import Config
from jaxpod.models.efficientnet_specs import (
    IMAGE_CH,
    block_specs,
    split_specs,
    stem_head_channels,
)

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
SAVED_SWISH_ACT = 4
SAVED_PLAIN_ACT = 1
# Pipelined without remat the gradient row is built beside the backward, a leaf at a time
# into the accumulated row (the planner's `grads`): one more row is live, the float32 row
# being added or, 16-bit, the row updated in place (`dynamic-update-slice`).
RUNNING_SUM_ROWS = 1
# The update's float32 rows: the unscaled gradient row (live from the backward's end through
# the update) and the update row (`pack_row(updates)`, then the new float32 weights).
UPDATE_F32_ROWS = 2
# Stochastic rounding draws one uint32 per element with threefry2x32: its two lanes for the
# row being rounded and their two copies in the rounding loop are live together (4 rows).
SR_BIT_ROWS = 4


def _size(hw: int, stride: int) -> int:
    return -(-hw // stride)  # SAME padding


def _saved_convnorm(act: int, swish: bool) -> int:
    """Bytes per output element autodiff saves for a ConvNorm's backward without remat."""
    return SAVED_NORM_F32 * F32 + (SAVED_SWISH_ACT if swish else SAVED_PLAIN_ACT) * act


def pieces(cfg: Config, wide: int = F32, act: int = F32) -> list[list[dict]]:
    """Per pipeline stage, its pieces (stem, MBConv blocks, head), each
    `{"kept": bytes per image live at the weight-gradient peak, "forward": bytes per image
    live at the forward-values peak, "kernels": elements of its 1x1 and dense kernels,
    "convs", "norms", "in", "out": elements per image of its input and output}`; a block
    also has `"out_cot"` (elements of its output's cotangent) and `"residual"`, the head
    `"classifier_grad"` (bytes).
    `wide`: bytes of a conv's operand or output (XLA:CPU convolves 16-bit in float32);
    `act`: bytes of an elementwise value of the compute dtype (the swish, the SE's gate)."""
    md = cfg.model
    specs = block_specs(
        md.variant,
        g16=md.g16,
        width_mult=md.width_mult,
        depth_mult=md.depth_mult,
        block_groups=md.block_groups,
    )
    stem_ch, head_ch = stem_head_channels(md.variant, width_mult=md.width_mult)
    hw = md.image_size
    stem_hw = _size(hw, 2)
    image, stem_out = hw * hw * IMAGE_CH, stem_hw**2 * stem_ch
    # its conv output, centred values and swish, and (its backward running) its output's
    # cotangent and the norm backward's temporaries; the image, when a stage's input, in
    # `carries` or sliced out of the carry (below)
    stem_values = wide + F32 + act
    stem_cot = (1 + STEM_BACKWARD_TEMPS) * wide * stem_out
    stem = {
        "kept": stem_values * stem_out + stem_cot,
        "cot": stem_cot,
        "forward": stem_values * stem_out,
        # without remat: the image (the stem's operand, compute dtype) and its ConvNorm's
        "saved": act * image + _saved_convnorm(act, True) * stem_out,
        "kernels": 0,  # (the stem's stage is never a forward-values stage)
        "convs": 1,
        "norms": 1,
        "in": image,
        "out": stem_out,
        "name": "stem",
    }
    hw, blocks = stem_hw, []
    for s in specs:
        h_in, h_out = hw, _size(hw, s.stride)
        n_in, mid_in, mid_out, n_out = (
            h_in**2 * s.in_ch,
            h_in**2 * s.mid_ch,
            h_out**2 * s.mid_ch,
            h_out**2 * s.out_ch,
        )
        plain = s.feature_groups == 1  # the spatial conv is a plain conv (not grouped)
        # Weight-gradient inputs. A plain conv (the 1x1 expand and projection, a spatial conv
        # of one group) keeps its operand widened and its conv output's cotangent (read by
        # both its data and its weight gradient); a grouped spatial conv reads its operand in
        # the compute dtype (the expand's swish) and recomputes its output's cotangent.
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
        # Forward values: per ConvNorm its conv output and centred values (float32), per
        # swish its output in the compute dtype; each conv's operand once (the block input
        # widened for the expand; the SE-gated tensor in the compute dtype and widened)
        fwd = wide * n_in if (s.expand != 1 or plain) else 0
        if s.expand != 1:
            fwd += (wide + F32 + act) * mid_in
        fwd += (wide + F32 + act) * mid_out + (act + wide) * mid_out
        fwd += (wide + F32) * n_out
        fwd += (wide + act) * s.mid_ch  # the SE's pooled vector and its gate
        # Without remat: each ConvNorm's saved values, and the SE-gated tensor
        saved = _saved_convnorm(act, True) * (mid_in * (s.expand != 1) + mid_out)
        saved += _saved_convnorm(act, False) * n_out + act * mid_out
        kernels = s.in_ch * s.mid_ch * (s.expand != 1) + s.mid_ch * s.out_ch
        kernels += 2 * s.mid_ch * s.se_ch  # SE reduce and expand
        # a depthwise spatial conv's weight gradient, on a device that computes it from a
        # dense [k, k, C, C] float32 kernel (XLA:CPU: `DeviceProfile.dense_depthwise_grads`)
        dense = s.kernel**2 * s.mid_ch**2 * F32 if s.group_size == 1 and not plain else 0
        blocks.append(
            {
                "kept": kept,
                "cot": cot,
                "forward": fwd,
                "saved": saved,
                "kernels": kernels,
                "dense_grad": dense,
                "out_cot": n_out,
                "residual": s.residual,
                "convs": 3 if s.expand != 1 else 2,
                "norms": 3 if s.expand != 1 else 2,
                "in": n_in,
                "out": n_out,
                "name": s.name,
            }
        )
        hw = h_out
    last = specs[-1].out_ch
    head_in, head_out = hw**2 * last, hw**2 * head_ch
    head = {
        # its operand widened, its conv output, swish and conv output's cotangent (its
        # output's cotangent is the mean's, a [mb, head_ch] vector)
        "kept": wide * head_in + (2 * wide + act) * head_out,
        "cot": wide * head_out,
        "saved": _saved_convnorm(act, True) * head_out,
        # its operand widened, conv output, centred values, swish; its backward starting:
        # the norm backward's temporaries and the classifier's kernel gradient (per step)
        "forward": wide * head_in + (wide + F32 + act + HEAD_BACKWARD_TEMPS * wide) * head_out,
        "kernels": last * head_ch,
        "classifier_grad": head_ch * md.num_classes * F32,
        "in_out": head_out,
        "convs": 1,
        "norms": 1,
        "in": head_in,
        "out": md.num_classes,
        "name": "head",
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


def _output_cotangents(stage: list[dict], wide: int, act: int) -> int:
    """Bytes per image of the blocks' output cotangents held at the stem stage's peak: the
    next piece's data gradient (float32 on XLA:CPU), or where a block and the next are both
    residual the skip connection's sum in the compute dtype; none for the stage's last piece
    (its output cotangent is the carry's) nor the stem (counted with its backward)."""
    total = 0
    for p, nxt in zip(stage, stage[1:], strict=False):
        if "out_cot" in p:
            total += (act if p["residual"] and nxt.get("residual") else wide) * p["out_cot"]
    return total


def weight_grad_inputs(stage: list[dict], wide: int, act: int, pipelined: bool) -> int:
    """Bytes per image live at the stem stage's peak: every piece's weight-gradient inputs,
    the blocks' output cotangents and, pipelined, the image sliced out of the float32 carry
    (without a pipeline the uint8 batch's conversion is fused into the stem's convolutions)."""
    total = sum(p["kept"] for p in stage) + _output_cotangents(stage, wide, act)
    if pipelined and stage[0]["name"] == "stem":
        total += wide * stage[0]["in"]
    return total


def data_gradients(stage: list[dict], wide: int, act: int) -> int:
    """Bytes per image of the cotangents among `weight_grad_inputs`: what the stem stage's
    backward adds, data gradients first, to values already saved (remat `none`)."""
    return sum(p["cot"] for p in stage) + _output_cotangents(stage, wide, act)


def forward_values(stage: list[dict]) -> int:
    """Bytes per image live at another stage's peak (its backward starting): every piece's
    forward values."""
    return sum(p["forward"] for p in stage)


def activation_bytes(
    cfg: Config,
    cb: int,
    act: int,
    row_elements: int,
    grad_bytes: int,
    sr_rows: int = 0,
    param_bytes: int = F32,
    stage_params: list[int] | None = None,
    moments: int = 0,
    dense_depthwise: bool = False,
) -> dict:
    """Activation bytes per device (the breakdown `bytes.activation_bytes` reports), plus the
    packed update's working set (`update_work`). `cb`: bytes of a conv's operand or output
    (the compute dtype's, or 4 on a device that widens 16-bit); `act`: the compute dtype's
    bytes; `row_elements`: the packed row's length n_max; `grad_bytes`: a gradient's bytes;
    `sr_rows`: how many rows of that length the update rounds stochastically;
    `param_bytes`: a weight's bytes (kernels narrower than `cb` are held widened);
    `stage_params`: each stage's parameter count (autodiff saves the weights without remat;
    default: every stage's row full); `moments`: the optimizer's state rows;
    `dense_depthwise`: the device builds a depthwise conv's weight gradient from a dense
    [k, k, C, C] float32 kernel, live in its stage's backward (read on 1- and 2-stage probes
    of the digits config with `model.g16=false`, benchmarks/xla_peak.py)."""
    mesh, tr, md = cfg.mesh, cfg.train, cfg.model
    stages = pieces(cfg, cb, act)
    mb, S = tr.micro_batch, mesh.pipeline
    micro = cfg.pipeline_group
    row_bytes = row_elements * grad_bytes
    carry = mb * carry_size(stages) * F32
    if S == 1:
        ticks, carries = 1, 0
    elif tr.pipeline_schedule == "1f1b":
        ticks = 2 * micro + 2 * S - 2
        carries = (2 * S + 2) * carry  # two ring buffers of S, the two values sent
    else:
        ticks = micro + S - 1
        # tick inputs, tick outputs' cotangents; the differentiated tick's input and cotangent
        carries = (2 * ticks + 2) * carry
        if mesh.replica > 1:
            # the scan's collected tick outputs (the last stage's logits, padded to A): the
            # loss reads them, and with replicas XLA:CPU schedules the loss's all-reduce after
            # the update, so they stay live through the backward
            carries += ticks * carry
    widened = cb > param_bytes  # 16-bit kernels convolved in float32 on this device
    works = []
    for st in stages:
        if st[0]["name"] == "stem":
            work = weight_grad_inputs(st, cb, act, S > 1) * mb
        else:
            work = forward_values(st) * mb
            work += sum(p["kernels"] for p in st) * F32 if widened else 0
            work += st[-1].get("classifier_grad", 0)
        if dense_depthwise:
            work += max(p.get("dense_grad", 0) for p in st)
        works.append(work)
    if S > 1 and md.remat == "none":
        # Pipelined without remat, the stage's `lax.switch` is linearized as a whole: every
        # branch returns the union of all branches' residuals (zeros for the stages not
        # taken), live through the backward ticks: every stage's saved values and weights
        # (the unpacked leaves, in the params dtype). Beside them the stage's own backward:
        # the stem's stage its data gradients, another its last piece's starting backward.
        params = stage_params or [row_elements] * S
        union = sum(sum(p["saved"] for p in st) for st in stages) * mb
        union += sum(params) * param_bytes
        rows = RUNNING_SUM_ROWS * row_bytes
        stage_work = grad_rows = 0
        for st in stages:
            if st[0]["name"] == "stem":
                own = data_gradients(st, cb, act) * mb
            else:
                own = st[-1].get("classifier_grad", 0)
                if st[-1]["name"] == "head":
                    own += HEAD_BACKWARD_TEMPS * cb * st[-1]["in_out"] * mb
            stage_work, grad_rows = max((stage_work, grad_rows), (union + own, rows))
    else:
        stage_work, grad_rows = max(works), 0
    total = carries + stage_work + grad_rows
    update_work = UPDATE_F32_ROWS * row_elements * F32
    if sr_rows:  # the rows are rounded one after another: one row's bits are live
        update_work += SR_BIT_ROWS * row_elements * F32
    else:  # float32 rows: the new optimizer state's leaves wait for their row's concatenate
        update_work += moments * row_elements * F32
    return {
        "saved": carries,
        "pipeline_buffers": carries,
        "head": 0,
        "layer_work": int(stage_work),
        "grad_rows": int(grad_rows),
        "sr_bits": 0,
        "update_work": int(update_work),
        "ticks": ticks,
        "total": int(total),
        "estimated": False,
    }
