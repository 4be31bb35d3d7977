"""EfficientNet's work per image, piece by piece (stem, MBConv blocks, head): what the
step-time model for packed stages prices (`jaxpod.planner.step_time_conv`). Jax-free.

Each piece's forward is a list of matmul-like convolutions, each `(FLOPs, depth)` with
FLOPs 2 x multiply-adds and depth the contraction of one output (k² x input channels per
group), plus the bytes its memory-bound work reads and writes:

- the 1x1 expand and projection convs, the stem's and the head's convs, a grouped spatial
  conv (G16), the squeeze-excitation's two dense layers and the classifier: matmuls;
- a depthwise spatial conv (one channel a group): memory-bound, its operand read and its
  output written once (its k² taps come from cache);
- each GroupNorm reads its conv's output twice (statistics, normalisation) and writes once;
  each swish reads and writes once; the squeeze-excitation pools its input (one read) and
  gates it (a read and a write); a residual add reads two and writes one.

`balanced_splits` cuts the blocks into pipeline stages whose forward seconds are closest to
even (the largest stage smallest), the stem in the first stage and the head in the last.
"""

from __future__ import annotations

from jaxpod.config import Config
from jaxpod.config.efficientnet_specs import (
    IMAGE_CH,
    BlockSpec,
    model_block_specs,
    split_specs,
    stem_head_channels,
)

NORM_PASSES = 3  # GroupNorm: its input read twice, its output written once
SWISH_PASSES = 2
SE_PASSES = 3  # the pool reads the tensor; the gate reads it and writes its product
RESIDUAL_PASSES = 3


def _size(hw: int, stride: int) -> int:
    return -(-hw // stride)  # SAME padding


def _conv(hw: int, k: int, c_in: int, c_out: int, groups: int = 1) -> tuple[int, int]:
    """`(FLOPs, depth)` of a k x k conv producing `hw`² pixels of `c_out` channels."""
    depth = k * k * (c_in // groups)
    return 2 * hw * hw * depth * c_out, depth


def _block(s: BlockSpec, h_in: int, act: int) -> dict:
    """An MBConv block's forward on one image entering at `h_in` pixels a side."""
    h_out = _size(h_in, s.stride)
    mid_in, mid_out, n_out = h_in**2 * s.mid_ch, h_out**2 * s.mid_ch, h_out**2 * s.out_ch
    matmuls, memory = [], 0
    if s.expand != 1:
        matmuls.append(_conv(h_in, 1, s.in_ch, s.mid_ch))
        memory += (NORM_PASSES + SWISH_PASSES) * act * mid_in
    if s.group_size == 1 and s.feature_groups > 1:  # depthwise: read once, written once
        memory += act * (mid_in + mid_out)
        depthwise = 2 * h_out**2 * s.kernel**2 * s.mid_ch
    else:
        matmuls.append(_conv(h_out, s.kernel, s.mid_ch, s.mid_ch, s.feature_groups))
        depthwise = 0
    memory += (NORM_PASSES + SWISH_PASSES + SE_PASSES) * act * mid_out
    matmuls += [(2 * s.mid_ch * s.se_ch, s.mid_ch), (2 * s.se_ch * s.mid_ch, s.se_ch)]
    matmuls.append(_conv(h_out, 1, s.mid_ch, s.out_ch))
    memory += NORM_PASSES * act * n_out + (RESIDUAL_PASSES * act * n_out if s.residual else 0)
    return {"name": s.name, "matmuls": matmuls, "depthwise": depthwise, "memory": memory}


def pieces_work(cfg: Config, act: int) -> list[dict]:
    """Every piece's forward per image, in model order: `{"name", "matmuls": [(FLOPs,
    depth)], "depthwise": FLOPs done as memory-bound work, "memory": bytes}`; `act`: bytes
    of an activation in the compute dtype."""
    md, specs = cfg.model, model_block_specs(cfg.model)
    stem_ch, head_ch = stem_head_channels(md.variant, width_mult=md.width_mult)
    hw = _size(md.image_size, 2)
    stem_mem = (NORM_PASSES + SWISH_PASSES) * act * hw * hw * stem_ch
    out = [{"name": "stem", "matmuls": [_conv(hw, 3, IMAGE_CH, stem_ch)], "depthwise": 0}]
    out[0]["memory"] = stem_mem
    for s in specs:
        out.append(_block(s, hw, act))
        hw = _size(hw, s.stride)
    head = [_conv(hw, 1, specs[-1].out_ch, head_ch), (2 * head_ch * md.num_classes, head_ch)]
    head_mem = (NORM_PASSES + SWISH_PASSES + 1) * act * hw * hw * head_ch  # + the mean's read
    out.append({"name": "head", "matmuls": head, "depthwise": 0, "memory": head_mem})
    return out


def stages_work(cfg: Config, act: int, splits: tuple[str, ...] | None = None) -> list[list]:
    """`pieces_work` grouped into the pipeline stages of `splits` (default: the config's
    `model.pipeline_splits`): the stem in the first, the head in the last."""
    work = pieces_work(cfg, act)
    blocks = work[1:-1]
    splits = cfg.model.pipeline_splits if splits is None else splits
    cut = split_specs(model_block_specs(cfg.model), splits)
    out, i = [], 0
    for k, run in enumerate(cut):
        stage = ([work[0]] if k == 0 else []) + blocks[i : i + len(run)]
        out.append(stage + ([work[-1]] if k == len(cut) - 1 else []))
        i += len(run)
    return out


def balanced_splits(costs: list[float], names: list[str], stages: int) -> tuple[str, ...] | None:
    """The block names where stages 1.. start so that the costliest stage costs least:
    `costs` per piece in model order (stem, blocks, head), `names` the blocks'. Every stage
    after the first starts at a block (the first may hold the stem alone); None where there
    are fewer blocks than boundaries."""
    n = len(names)
    if stages == 1:
        return ()
    if stages - 1 > n:
        return None
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][j]: the least largest stage cost of the first j+1 pieces in k+1 stages, the
    # last ending at piece j; a stage after the first starts at a block (pieces 1..n)
    inf = float("inf")
    best = [[inf] * (n + 2) for _ in range(stages)]
    back = [[0] * (n + 2) for _ in range(stages)]
    for j in range(n + 2):
        best[0][j] = prefix[j + 1]
    for k in range(1, stages):
        for j in range(k + 1, n + 2):
            for i in range(k, j + 1):  # this stage is pieces i..j, i a block
                if i > n:
                    break
                cost = max(best[k - 1][i - 1], prefix[j + 1] - prefix[i])
                if cost < best[k][j]:
                    best[k][j], back[k][j] = cost, i
    starts, j = [], n + 1
    for k in range(stages - 1, 0, -1):
        i = back[k][j]
        starts.append(i)
        j = i - 1
    return tuple(names[i - 1] for i in reversed(starts))
