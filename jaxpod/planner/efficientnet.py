"""EfficientNet's activation bytes, from the packed-stage program's structure. Jax-free.

The step (`jaxpod.engine.packed`) runs each pipeline stage as one remat unit on a float32
carry `[mb, A]` (A: the largest per-image tensor crossing a stage boundary), switched by
`lax.switch` per tick. What a device holds is read off the buffer assignment of the program
jaxpod compiles (`benchmarks/xla_peak.py`, the memory-minimising scheduler); why each term
is what it is: docs/memory.md, "The planner's byte model". What each piece (stem, MBConv
blocks, head) holds per image is `jaxpod.planner.efficientnet_pieces`; here, per device:

- `stage_work`: one stage's backward for one micro-batch. Its peak follows the order of the
  stage's packed gradient row (last leaf first): the stem's stage peaks at the stem's norm
  backward with every weight gradient's inputs live (`weight_grad_inputs`); any other stage
  as its backward starts, with the recomputed forward's values (`forward_values`). Pipelined
  without remat every branch of the switch returns all stages' residuals, one per type and
  slot (`jaxpod.planner.switch_union`).
- `grad_rows`: pipelined without remat, the row the gradients accumulate in beside the
  backward; otherwise nothing beside the stage's work: the row is one `concatenate` of the
  leaves' gradients (`StagePacking.unpack`) after the activations are dead, a moment of its
  own holding its operands and the row (`ROW_CONCAT_ROWS`).
- `carries`: the schedule's float32 `[mb, A]` buffers (GPipe: every tick's input and its
  output's cotangent, with replicas also the collected outputs; 1F1B: two ring buffers).
- `update_work`: the update on whole rows: float32 copies of the row and, with 16-bit rows,
  the stochastic rounding's random bits; with float32 optimizer rows the new state's row, and
  with float32 rows (nothing rounded) the new moments' leaves beside it at their concatenate.
"""

from __future__ import annotations

from jaxpod.config import Config
from jaxpod.parallel.schedules import STEPWISE
from jaxpod.planner.efficientnet_pieces import F32, HEAD_BACKWARD_TEMPS, pieces
from jaxpod.planner.grouped_convs import grouped_conv_bytes
from jaxpod.planner.switch_union import union_saved, width_minor_read
from jaxpod.planner.tiles import Tile

# Pipelined without remat the gradient row is built beside the backward, a leaf at a time
# into the accumulated row (the planner's `grads`): one more row is live, the float32 row
# being added or, 16-bit, the row updated in place (`dynamic-update-slice`).
RUNNING_SUM_ROWS = 1
# Otherwise a micro-batch's gradient row is one concatenate as the stage's backward ends: its
# operands (the leaves' gradients, a shorter stage's with a block of zeros padding them to
# n_max) and the row are live together, two rows in the gradients' dtype.
ROW_CONCAT_ROWS = 2
# The update's float32 rows: the unscaled gradient row (live from the backward's end through
# the update) and the update row (`pack_row(updates)`, then the new float32 weights).
UPDATE_F32_ROWS = 2
# Stochastic rounding draws one uint32 per element with threefry2x32: its two lanes for the
# row being rounded and their two copies in the rounding loop are live together (4 rows).
SR_BIT_ROWS = 4
# The optimizer's 16-bit moments are one row (one buffer per dtype, `jaxpod.parallel.packing`)
# of `moments * n_max`, rounded in one go after its bits are drawn: at its rounding XLA:CPU
# holds, per element, the two uint32 lanes, the row in float32 and the new moments' float32
# leaves (the update direction reads them after), as float32 words, and the rounded row.
MOMENT_ROUNDING_WORDS = 4
# Nothing rounded (float32 master rows), XLA:CPU joins the update's leaves into its row (beside
# the new moments' leaves: `UPDATE_F32_ROWS` and the state's row), adds it to the masters into
# the new weights' row, then joins the new moments: their leaves and row live together beside
# the new weights' row. Beside both, the float32 gradient row the update reads
# (`grads_update`). Read on the digits preset with float32 masters, AdamW and LAMB.
NEW_WEIGHTS_ROWS = 1


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
        total += wide * stage[0]["image"]
    return total


def data_gradients(stage: list[dict], wide: int, act: int) -> int:
    """Bytes per image of the cotangents among `weight_grad_inputs`: what the stem stage's
    backward adds, data gradients first, to values already saved (remat `none`)."""
    return sum(p["cot"] for p in stage) + _output_cotangents(stage, wide, act)


def forward_values(stage: list[dict]) -> int:
    """Bytes per image live at another stage's peak (its backward starting): every piece's
    forward values."""
    return sum(p["forward"] for p in stage)


def _schedule_carries(cfg: Config, carry: int) -> tuple[int, int]:
    """`(ticks, carries)`: the schedule's ticks and the bytes of its float32 `[mb, A]`
    buffers (`carry` bytes each): none without a pipeline; 1F1B two ring buffers; GPipe every
    tick's input and its output's cotangent, with replicas also the collected outputs."""
    mesh, tr = cfg.mesh, cfg.train
    S, micro = mesh.pipeline, cfg.pipeline_group
    if S == 1:
        return 1, 0
    if tr.pipeline_schedule in STEPWISE:
        # two ring buffers of S, the two values sent
        return 2 * micro + 2 * S - 2, (2 * S + 2) * carry
    ticks = micro + S - 1
    # tick inputs, tick outputs' cotangents; the differentiated tick's input and cotangent
    carries = (2 * ticks + 2) * carry
    if mesh.replica > 1:
        # the scan's collected tick outputs (the last stage's logits, padded to A): the
        # loss reads them, and with replicas XLA:CPU schedules the loss's all-reduce after
        # the update, so they stay live through the backward
        carries += ticks * carry
    return ticks, carries


def _stage_works(
    cfg: Config,
    stages: list[list[dict]],
    cb: int,
    act: int,
    widened: bool,
    dense: bool,
    grouped: Tile | None = None,
) -> list[int]:
    """Bytes of each stage's backward for one micro-batch: the stem's stage at its
    weight-gradient peak (`weight_grad_inputs`; with `grouped`, the tile of a device that
    holds grouped convs' copies, those: `grouped_conv_bytes`), any other as its backward
    starts (its `forward_values`, its kernels in float32 where `widened`, the classifier's
    gradient); with `dense` (the device builds a depthwise conv's weight gradient from a
    dense kernel) the largest such kernel of the stage."""
    mb, pipelined = cfg.train.micro_batch, cfg.mesh.pipeline > 1
    works = []
    for st in stages:
        if st[0]["name"] == "stem":
            work = weight_grad_inputs(st, cb, act, pipelined) * mb
            work += grouped_conv_bytes(st, mb, act, grouped) if grouped else 0
        else:
            work = forward_values(st) * mb
            work += sum(p["kernels"] for p in st) * F32 if widened else 0
            work += st[-1].get("classifier_grad", 0)
        if dense:
            work += max(p.get("dense_grad", 0) for p in st)
        works.append(work)
    return works


def _switch_union(
    cfg: Config,
    stages: list[list[dict]],
    cb: int,
    act: int,
    params: list[int],
    pb: int,
    tile: Tile | None = None,
    wide_groups: bool = False,
) -> int:
    """Bytes of the largest stage's backward pipelined without remat (`params`: each stage's
    parameter count, `pb` bytes each). The stage's `lax.switch` is linearized as a whole:
    every branch returns the union of all branches' residuals (zeros for the stages not
    taken), live through the backward ticks: per type the most values any stage saves
    (`union_saved`; `wide_groups`: the stem's stage's group-shaped ones laid out
    width-minor, priced so where that was read, `width_minor_read`) and every stage's
    weights (the unpacked leaves, in the params dtype).
    Beside them the stage's own backward: the stem's stage its data gradients, another its
    last piece's starting backward."""
    mb = cfg.train.micro_batch
    wide = wide_groups and width_minor_read(cfg)
    union = union_saved(stages, mb, act, tile, cfg.model.norm_groups, wide)
    union += sum(params) * pb
    stage_work = 0
    for st in stages:
        if st[0]["name"] == "stem":
            own = data_gradients(st, cb, act) * mb
        else:
            own = st[-1].get("classifier_grad", 0)
            if st[-1]["name"] == "head":
                own += HEAD_BACKWARD_TEMPS * cb * st[-1]["in_out"] * mb
        stage_work = max(stage_work, union + own)
    return stage_work


def _update_work(row_elements: int, sr_moments: int, f32_moments: int, sr_bytes: int) -> int:
    """Bytes of the packed update's working set on whole rows of `row_elements`: float32
    copies of the row and, with 16-bit rows, the weights' row's random bits, or where larger
    the rounding of the optimizer's 16-bit row of `sr_moments` moments (`sr_bytes` each);
    with float32 optimizer rows (`f32_moments` of them, whatever the weights' dtype) the new
    optimizer state's row; nothing rounded, the larger of the update's and the moments'
    concatenates (`NEW_WEIGHTS_ROWS`)."""
    update_work = UPDATE_F32_ROWS * row_elements * F32
    state_row = f32_moments * row_elements * F32  # float32 optimizer rows are not rounded
    if not sr_bytes:
        joining = NEW_WEIGHTS_ROWS * row_elements * F32 + 2 * state_row
        return max(update_work + state_row, joining)
    update_work += SR_BIT_ROWS * row_elements * F32  # rounded one row after another
    moment_row = sr_moments * row_elements  # beside the unscaled gradient row
    rounding = moment_row * (MOMENT_ROUNDING_WORDS * F32 + sr_bytes) + row_elements * F32
    return max(update_work, rounding) + state_row


def activation_bytes(
    cfg: Config,
    cb: int,
    act: int,
    row_elements: int,
    grad_bytes: int,
    sr_moments: int = 0,
    sr_bytes: int = 0,
    param_bytes: int = F32,
    stage_params: list[int] | None = None,
    moments: int = 0,
    dense_depthwise: bool = False,
    tile: Tile | None = None,
    grouped_copies: bool = False,
    wide_groups: bool = False,
) -> dict:
    """Activation bytes per device (the breakdown `bytes.activation_bytes` reports), plus the
    packed update's working set (`update_work`). `cb`: bytes of a conv's operand or output
    (the compute dtype's, or 4 on a device that widens 16-bit); `act`: the compute dtype's
    bytes; `row_elements`: the packed row's length n_max; `grad_bytes`: a gradient's bytes;
    `sr_moments`: the optimizer's moments the update rounds stochastically and `sr_bytes`
    the rounded rows' element bytes (0: nothing rounded);
    `param_bytes`: a weight's bytes (kernels narrower than `cb` are held widened);
    `stage_params`: each stage's parameter count (autodiff saves the weights without remat;
    default: every stage's row full); `moments`: the optimizer's float32 state rows
    whose new leaves are not the update's;
    `dense_depthwise`: the device builds a depthwise conv's weight gradient from a dense
    [k, k, C, C] float32 kernel, live in its stage's backward (read on 1- and 2-stage probes
    of the digits config with `model.g16=false`, benchmarks/xla_peak.py); `tile`: the
    device's array tile, the pieces' values padded to it (`DeviceProfile.tile`);
    `grouped_copies`: the device holds grouped convs' copies in their tiled layout
    (`DeviceProfile.grouped_conv_copies`); `wide_groups`: the stem's stage's saved
    group-shaped values are laid out width-minor (`DeviceProfile.stem_groups_width_minor`)."""
    stages = pieces(cfg, cb, act, tile)
    S = cfg.mesh.pipeline
    ticks, carries = _schedule_carries(cfg, cfg.train.micro_batch * carry_size(stages) * F32)
    if S > 1 and cfg.model.remat == "none":
        params = stage_params or [row_elements] * S
        stage_work = _switch_union(cfg, stages, cb, act, params, param_bytes, tile, wide_groups)
        # the gradient row, accumulated beside the backward
        grad_rows = RUNNING_SUM_ROWS * (row_elements * grad_bytes)
    else:
        widened = cb > param_bytes  # 16-bit kernels convolved in float32 on this device
        grouped = tile if grouped_copies else None
        works = _stage_works(cfg, stages, cb, act, widened, dense_depthwise, grouped)
        stage_work = max(works)
        stage_work = max(stage_work, ROW_CONCAT_ROWS * row_elements * grad_bytes)
        grad_rows = 0
    return {
        "saved": carries,
        "pipeline_buffers": carries,
        "head": 0,
        "layer_work": int(stage_work),
        "grad_rows": int(grad_rows),
        "sr_bits": 0,
        "update_work": int(_update_work(row_elements, sr_moments, moments, sr_bytes)),
        "ticks": ticks,
        "total": int(carries + stage_work + grad_rows),
        "estimated": False,
    }
