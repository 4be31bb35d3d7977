"""One transformer layer's activation bytes: what it saves, what its backward holds.

`layer_sets(cfg, cb, sb)` counts, for one micro-batch on one device, the values autodiff
saves of a layer without remat, what each remat policy keeps, and the working set of the
layer's backward (its recomputation under remat), from the layer's tensor sizes under tensor
and sequence parallelism and sequence chunks. `jaxpod.planner.activations` multiplies them
by the layers and pipeline ticks a device holds. Analytic, no jax.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxpod.config import Config


class _Rows(NamedTuple):
    """Elements of one layer's tensors for one micro-batch on one device (`_layer_rows`)."""

    btd: int  # a [b, T, D] row
    btf: int  # the MLP's hidden units, [b, T, F/t]
    res: int  # a residual-stream row: [b, T/t, D] with sequence parallelism, else btd
    gathered: int  # sequence parallelism's all-gathered inputs, 2 [b, T, D] (t > 1)
    kept_scores: int  # the attention scores [b, H/t, T, T] autodiff saves (none in chunks)
    kept_hidden: int  # the MLP's hidden units autodiff saves (none in chunks)
    chunk_scores: int  # one query chunk's scores
    qkvo: int  # queries, keys, values and the attention output, [b, T, (2D + 2 KVD)/t]
    gated: bool  # a SwiGLU MLP: W_in's output is the gate and the up projection, 2 btf


def _layer_rows(cfg: Config) -> _Rows:
    """The sizes of one layer's tensors (`_Rows`), which the saved values and the backward
    working set are counted in: they follow from the micro-batch, the shapes, tensor and
    sequence parallelism and the sequence chunks."""
    md, t = cfg.model, cfg.mesh.tensor
    b, s, d, f, h = cfg.train.micro_batch, md.seq_len, md.d_model, md.d_ff, md.heads
    btd, btf, scores = b * s * d, b * s * f // t, b * (h // t) * s * s
    # grouped-query attention: keys and values are kv_heads/heads of the queries' width
    qkvo = (2 * btd + 2 * b * s * md.kv_head_count * (d // h)) // t
    # With sequence_chunks = C > 1 each query chunk and each MLP token chunk is a checkpoint:
    # scores and MLP hidden activations are never saved, one query chunk's scores are alive.
    # The MLP's token chunks earn credit in the backward working set only with RTS (the
    # layer's weights all-gathered inside its remat unit): without it XLA holds the whole
    # sequence's hidden units anyway (read with benchmarks/xla_peak.py).
    # The loss head's logits shrink by C. The chunks are sliced from their input and their
    # outputs written in place (`map_chunks`): no stacked copies.
    chunked = md.sequence_chunks > 1
    # Sequence parallelism: residual-stream tensors are [b, T/t, D]; attention and the MLP
    # each all-gather their input to [b, T, D] (and the row-parallel matmul output is
    # full-length before its reduce-scatter).
    res = btd // t if md.sequence_parallel else btd
    gathered = 2 * btd if md.sequence_parallel and t > 1 else 0
    kept_scores, kept_hidden = (0, 0) if chunked else (scores, btf)
    chunk_scores = scores // md.sequence_chunks
    gated = md.mlp == "swiglu"
    return _Rows(btd, btf, res, gathered, kept_scores, kept_hidden, chunk_scores, qkvo, gated)


def _autodiff_saved(cfg: Config, r: _Rows, cb: int) -> int:
    """Bytes of what autodiff saves of one layer without remat (`cb` bytes a scalar): the
    policy `none` keeps all of it."""
    # LN1/LN2: 4 [b,T,D] each; q, k, v, attention output (`qkvo`; RoPE's rotation is linear,
    # so its backward keeps nothing more); masked scores, exp, probabilities [b,H/t,T,T] (+ the
    # boolean mask, 1 byte); GELU MLP: 6 [b,T,F/t]; SwiGLU too: gate and up, sigmoid(gate)
    # and its derivative (sigmoid's JVP rule), silu(gate), the product (a 1x1x1 probe, d 128,
    # F 512: XLA 50.7 MB, 48.1 planned with 5 of them, 50.2 with 6).
    every = (8 * r.res + r.gathered + r.qkvo + 6 * r.kept_hidden) * cb
    every += (3 * cb + 1) * r.kept_scores
    return every


def _converted_saved(cfg: Config, r: _Rows) -> int | None:
    """Bytes of what autodiff saves of one layer without remat on a backend that multiplies
    float32 in one bfloat16 pass (`DeviceProfile.converts_matrices`), or None where that
    program was not read (16-bit compute, sequence parallelism or chunks, SwiGLU).

    XLA:TPU saves the bfloat16 operands its matmuls read beside the float32 values the
    elementwise backward needs: in float32 six [b, T, D] rows (the norms'), five hidden-unit
    rows [b, T, F/t] and the probabilities [b, H/t, T, T]; in bfloat16 both norms' outputs
    [b, T, D], q, k, v and the attention output (`qkvo`), the hidden units and the
    probabilities (tests/target/test_saved_tpu.py)."""
    md = cfg.model
    read = cfg.precision.compute == "float32" and md.mlp != "swiglu"
    if not read or md.sequence_parallel or md.sequence_chunks > 1:
        return None
    f32 = 6 * r.btd + 5 * r.kept_hidden + r.kept_scores
    bf16 = 2 * r.btd + r.qkvo + r.kept_hidden + r.kept_scores
    return 4 * f32 + 2 * bf16


def _policy_scalars(cfg: Config, r: _Rows) -> dict:
    """Scalars of one layer each remat policy keeps (its input included), by policy name."""
    t = cfg.mesh.tensor
    # The attention psum's output is saved; the MLP psum's output is not (the residual add's
    # backward needs no inputs, so autodiff drops it as a residual).
    psums = r.res if t > 1 else 0
    qkv = r.qkvo - r.btd // t  # W_qkv's output: q, k, v (the attention output is D/t)
    return {
        "full": r.res,
        "minimal": r.res + qkv + r.btd + (2 if r.gated else 1) * r.btf,
        "attention": r.res + r.qkvo,
        "comms": r.res + psums,
    }


def _recomputed(cfg: Config, r: _Rows, cb: int, attention_work: int) -> tuple[int, int, int]:
    """Bytes alive at the peak of a recomputed layer's attention and MLP halves, and the MLP's
    input values alone: `(attention, mlp_in, mlp)` (the backward working set's terms)."""
    md = cfg.model
    # Alive together at the peak of a recomputed layer's backward (the GELU's backward, in
    # every remat-full program read with benchmarks/xla_peak.py): of the attention, the scores
    # and the probabilities kept for its backward (exp is fused into them; the causal mask is
    # one [T, T]); of the MLP, the pre-activation, the GELU's tanh, the cotangents of the
    # GELU's output and of its input, 4 hidden-sized (the GELU's output is dead by then);
    # SwiGLU's gate and up, sigmoid(gate), the product's cotangent and the cotangents of gate
    # and up, 6.
    attention = (4 * r.res + r.gathered // 2 + r.qkvo) * cb + 2 * cb * r.kept_scores
    attention += attention_work
    mlp_in = (4 * r.res + r.gathered // 2) * cb
    # the recomputed MLP's hidden units: the whole sequence's, or with RTS (the weights
    # gathered inside the layer) one token chunk's (measured)
    chunked = md.sequence_chunks > 1
    hidden = r.btf // md.sequence_chunks if chunked and cfg.memory.rts > 1 else r.btf
    return attention, mlp_in, mlp_in + (6 if r.gated else 4) * hidden * cb


def _backward_work(cfg: Config, r: _Rows, cb: int, kept: int, fused: bool = False) -> int:
    """Bytes of one layer's backward working set beyond its saved input (`kept`: what the
    policy keeps besides the input, in compute bytes `cb`).

    Recomputing one layer: everything it would have saved (`_autodiff_saved`, split into its
    attention and MLP halves, `_recomputed`), less what the policy keeps. memory.stream=matrix
    recomputes one step at a time: the attention half, or one of the k MLP panels (1/k of the
    hidden units, and the panel's partial sums [b, T, D]), plus the steps' inputs (x, q, k, v,
    o, x1, y). XLA realises that smaller working set without tensor parallelism only: with
    t > 1 it holds the layer's working set plus the steps' inputs (measured on 1x2x4 and 1x1x4,
    with and without sequence parallelism and chunks, with benchmarks/xla_peak.py), so that is
    counted."""
    md, t, mem = cfg.model, cfg.mesh.tensor, cfg.memory
    chunked = md.sequence_chunks > 1
    # a chunk's masked scores, exp, probabilities and two gradients (and the mask); fused into
    # the backward's matmuls (XLA:TPU) at most three in the compute dtype
    per_score = 3 * cb if fused else 5 * cb + 1
    attention_work = per_score * r.chunk_scores if chunked else 0
    if md.remat == "none":  # backward temporaries: score/prob grads, MLP hidden grad(s)
        hidden = (2 if r.gated else 1) * r.btf
        return (2 * r.kept_scores + hidden + 2 * r.btd) * cb + attention_work
    attention, mlp_in, mlp = _recomputed(cfg, r, cb, attention_work)
    step_inputs = (3 * r.res + r.qkvo) * cb  # x, q, k, v, o, x1, y: kept per layer
    if mem.stream == "matrix" and t == 1:
        mlp_panel = mlp_in + r.btd * cb + 6 * r.btf // mem.mlp_panels * cb
        return max(max(attention, mlp_panel) + step_inputs - kept, 0)
    work = max(attention + mlp - attention_work - kept, 0) + attention_work
    if mem.stream == "matrix":  # no credit under tensor parallelism (measured)
        work += step_inputs
    return work


def _fused_work(cfg: Config, r: _Rows, cb: int, kept: int) -> int | None:
    """Bytes of a recomputed layer's backward working set on a backend that fuses the
    recomputation into the backward's matmuls (`DeviceProfile.fuses_recomputation`), or None
    where that program was not read (policies other than full and attention, float16
    compute, sequence chunks, matrix streaming).

    XLA:TPU holds at the peak the recomputed probabilities [b, H/t, T, T] and hidden units
    [b, T, F/t] in the compute dtype, a bfloat16 copy of the hidden units for W_out's
    matmul, and three residual rows [b, T, D] in the compute dtype and a bfloat16 one (the
    layer's input, the cotangent, a psum's output or queries' and keys' copies), less what the
    policy keeps (tests/target/test_fusion_tpu.py). With sequence parallelism those rows are
    the whole sequence's too (the all-gathered inputs, the row-parallel outputs before their
    reduce-scatter), beside the gathered inputs, not [b, T/t, D] rows."""
    md = cfg.model
    if md.remat not in ("full", "attention") or cfg.precision.compute == "float16":
        return None  # the programs read: these policies, float32 and bfloat16 compute
    if md.sequence_chunks > 1 or cfg.memory.stream == "matrix":
        return None
    hidden = (2 if r.gated else 1) * r.btf
    rows = (3 * cb + 2) * r.btd + cb * r.gathered // 2
    return max(cb * r.kept_scores + (cb + 2) * hidden + rows - kept, 0)


def layer_sets(cfg: Config, cb: int, sb: int, fused: bool = False, converted: bool = False) -> dict:
    """Bytes of one layer's residuals for one micro-batch on one device (`cb` bytes a scalar):
    `all` (what autodiff saves without remat; `converted`: the backend's matmuls read
    bfloat16 copies, `_converted_saved`), `saved` (what the remat policy keeps, layer
    input included), `work` (one layer's backward working set; `fused`: the backend fuses a
    recomputed layer into its backward, `_fused_work`), `btd` (one [b, T, D] row of the
    residual stream, as stored), `split` (what ZB's B keeps for W: `_split_kept`) and
    `split_operands` (of it, the uses' operands: `_split_operands`)."""
    r = _layer_rows(cfg)
    every = (_converted_saved(cfg, r) if converted else None) or _autodiff_saved(cfg, r, cb)
    remat = cfg.model.remat
    # What a policy keeps is stored in the compute dtype (`sb` bytes a scalar, `stored_bytes`):
    # a backend that widens float16 arithmetic (`cb` = 4) widens it inside its fused
    # computations, not in the buffers between them (XLA:CPU's GPT-3 POD256 program keeps its
    # saved layer inputs and the pipeline's rows in float16); XLA:CPU stores bfloat16 in float32.
    if remat == "none":
        saved, kept = every, every - r.res * cb
    else:
        scalars = _policy_scalars(cfg, r)[remat]
        saved, kept = scalars * sb, (scalars - r.res) * cb
    fused_work = _fused_work(cfg, r, cb, kept) if fused else None
    work = _backward_work(cfg, r, cb, kept, fused) if fused_work is None else fused_work
    split, operands = _split_kept(cfg, r) * sb, _split_operands(cfg, r) * sb
    out = {"all": every, "saved": saved, "work": work, "btd": r.res * sb, "split": split}
    return out | {"split_operands": operands}


def _split_kept(cfg: Config, r: _Rows) -> int:
    """Scalars of one layer B keeps for its W (`jaxpod.parallel.weight_split`): the operands
    of its weights' uses (both LNs' normalised rows, residual rows; the inputs of W_qkv and
    W_in, [b, T, D] (all-gathered under sequence parallelism); W_o's, the heads' outputs
    [b, T, D/t]; W_out's, [b, T, F/t]) and the cotangents at their outputs (both LNs',
    W_qkv's q, k, v, W_in's hidden units; W_o's and W_out's twice: the matmul's partial sums
    [b, T, D], read by their reduction over `tensor`, and the bias added after it, a residual
    row, each a use) (tests/parallel/test_weight_split_held.py)."""
    t = cfg.mesh.tensor
    qkv = r.qkvo - r.btd // t
    rows = 6 * r.res + 4 * r.btd + r.btd // t
    return rows + qkv + (3 if r.gated else 2) * r.btf


def _split_operands(cfg: Config, r: _Rows) -> int:
    """Scalars of `_split_kept` that are its uses' operands: both LNs' normalised rows, the
    inputs of W_qkv and W_in, W_o's [b, T, D/t] and W_out's [b, T, F/t]. Without remat the
    layer's residuals hold them too (`jaxpod.planner.stepwise_bytes`)."""
    return 2 * r.res + 2 * r.btd + r.btd // cfg.mesh.tensor + r.btf
