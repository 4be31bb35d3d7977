"""The step-time model: how long one optimizer step of a transformer mapping takes. Jax-free.

A `Workload` is a model shape and its mapping (tensor t, pipeline p, data d, context c, V
virtual stages, micro-batches, recompute, sharding). `estimate(work, speed)` adds, per
device: the matmul FLOPs (forward, backward, the recomputed forward) at the device's peak
times its achievable efficiency, discounted when the local matrices are narrow; the
memory-bound work (norms, activations, softmax, the update) at HBM bandwidth; every
collective with the ring algorithm on the link it crosses (tensor all-reduces inside the
fast domain, pipeline sends, the data-parallel gradient reduction or ZeRO/FSDP gathers),
exposed unless the mapping overlaps it with compute; and the pipeline bubble of the
schedule's own table (`jaxpod.parallel.schedule_time`). Figures per step, in seconds.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from jaxpod.parallel.schedule_time import lockstep_time, mpmd_time, work
from jaxpod.parallel.schedules import make_schedule
from jaxpod.planner.speed import Speed

# the local width (hidden or MLP units on one tensor device) at which a matmul reaches half
# of the achievable efficiency's shortfall: narrower matrices stream weights more than they
# compute (a fixed property of the model, not fitted)
HALF_WIDTH = 256
# bytes an elementwise op moves per hidden unit of a token and layer, forward (reads and
# writes of the norms, residual adds, biases, the MLP activation): counted from the layer
ELEMENTWISE_PER_HIDDEN = 24
ELEMENTWISE_PER_FFN = 6
# rotary position embedding: each query and key element read and written once in 16 bits
# (the cos/sin tables, [seq, head width], stay in cache)
ROPE_PER_QK = 4
# the optimizer update reads and writes each parameter's master, two moments and gradient
UPDATE_BYTES_PER_PARAM = 32
LINK_EFFICIENCY = 0.7  # the fraction of a link's nominal bandwidth a ring collective reaches


@dataclass(frozen=True)
class Workload:
    """A transformer training step and its mapping. `kv_heads` (grouped-query attention),
    `gated` (a three-matrix MLP), `rope` (rotary positions: queries and keys rotated in
    every layer, memory-bound); `sharding`: "dp" (gradients all-reduced), "zero1"
    (optimizer sharded: reduce-scatter + all-gather), "zero2", "zero3" (FSDP: weights
    gathered before use); `overlap`: data-parallel and tensor collectives hidden under
    compute; `flash`: attention computes the causal half only, its softmax fused."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int
    global_batch: int
    micro_batch: int
    t: int = 1
    p: int = 1
    d: int = 1
    c: int = 1
    virtual: int = 1
    kv_heads: int | None = None
    gated: bool = False
    rope: bool = False
    recompute: str = "none"  # none | selective | full
    sequence_parallel: bool = False
    sharding: str = "dp"
    overlap: bool = False
    flash: bool = False
    schedule: str = "1f1b"
    lockstep: bool = False  # one SPMD program (jaxpod): a pipeline tick lasts its slowest op
    dtype: str = "bfloat16"
    grad_bytes: int = 4

    @property
    def devices(self) -> int:
        return self.t * self.p * self.d * self.c

    @property
    def micro_batches(self) -> int:
        """Micro-batches each pipeline runs per step."""
        return max(self.global_batch // (self.micro_batch * self.d), 1)


def layer_flops(w: Workload) -> tuple[float, float]:
    """Forward FLOPs per token of one layer: `(matmuls with weights, attention's two)`."""
    h, kv = w.hidden, (w.kv_heads or w.heads) / w.heads * w.hidden
    weights = 2 * (h * (h + 2 * kv) + h * h) + 2 * h * w.ffn * (3 if w.gated else 2)
    attention = 4 * w.seq * h * (0.5 if w.flash else 1.0)
    return weights, attention


def params(w: Workload) -> float:
    """Parameters of the model (embedding tied to the output projection)."""
    h, kv = w.hidden, (w.kv_heads or w.heads) / w.heads * w.hidden
    per_layer = h * (h + 2 * kv) + h * h + h * w.ffn * (3 if w.gated else 2)
    return w.layers * per_layer + w.vocab * h


def compute_seconds(w: Workload, speed: Speed) -> dict:
    """Matmul and memory-bound seconds per step of one device, before the bubble."""
    tokens = w.global_batch * w.seq / (w.d * w.c)  # per pipeline, per context shard
    weights, attention = layer_flops(w)
    recompute = {"none": 0.0, "selective": attention, "full": weights + attention}[w.recompute]
    per_token = w.layers * (3 * (weights + attention) + recompute) + 3 * 2 * w.hidden * w.vocab
    flops = tokens * per_token / (w.t * w.p)
    local = min(w.hidden, w.ffn) / w.t
    eff = speed.compute_efficiency * local / (local + HALF_WIDTH)
    matmul = flops / (speed.flops[w.dtype] * eff)
    elem = ELEMENTWISE_PER_HIDDEN * w.hidden + ELEMENTWISE_PER_FFN * w.ffn / w.t
    if w.rope:
        kv = (w.kv_heads or w.heads) / w.heads * w.hidden
        elem += ROPE_PER_QK * (w.hidden + kv) / w.t
    if not w.flash:  # the softmax's [heads, seq] scores read and written, fwd and bwd
        elem += 8 * w.heads / w.t * w.seq
    passes = 3 + (1 if w.recompute == "full" else 0)
    memory = tokens * w.layers / w.p * elem * passes / speed.hbm_bandwidth
    shards = w.d * w.c if w.sharding in ("zero1", "zero2", "zero3") else 1
    update = params(w) / (w.t * w.p * shards) * UPDATE_BYTES_PER_PARAM / speed.hbm_bandwidth
    return {"matmul": matmul, "memory": memory, "update": update}


def ring_seconds(nbytes: float, n: int, link: float, latency: float, *, all_reduce: bool):
    """A ring all-reduce (2(n-1)/n of the bytes) or a reduce-scatter / all-gather ((n-1)/n)
    over `n` devices, each sending at `link` bytes/s."""
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1) if all_reduce else n - 1
    return steps / n * nbytes / (link * LINK_EFFICIENCY) + steps * latency


def link_for(speed: Speed, span: int) -> float:
    """The bandwidth a collective over `span` consecutive devices runs at."""
    return speed.fast_link if span <= speed.fast_group else speed.slow_link


def data_seconds(nbytes: float, w: Workload, speed: Speed, *, all_reduce: bool) -> float:
    """A collective over the data axis (d·c devices, the mesh's outermost): inside each fast
    domain a ring over its members, then across domains a ring over the domains of the
    shard each member holds (the hierarchical, bandwidth-optimal form)."""
    n = w.d * w.c
    domains = min(n, max(1, w.devices // speed.fast_group))
    inside = n // domains
    lat = speed.link_latency
    t = ring_seconds(nbytes, inside, speed.fast_link, lat, all_reduce=all_reduce)
    return t + ring_seconds(nbytes / inside, domains, speed.slow_link, lat, all_reduce=all_reduce)


def comm_seconds(w: Workload, speed: Speed) -> dict:
    """Collective seconds per step of one device, by kind, before overlap."""
    act = w.micro_batch * w.seq / w.c * w.hidden * 2  # one micro-batch's [b, s, h] in 16 bits
    per_layer = 4 + (2 if w.recompute == "full" else 0)  # all-reduces: fwd 2, bwd 2, recompute
    tp_link = link_for(speed, w.t)
    tensor = (
        w.layers
        / w.p
        * per_layer
        * w.micro_batches
        * ring_seconds(act, w.t, tp_link, speed.link_latency, all_reduce=True)
    )
    pipe_link = link_for(speed, w.t * w.p)
    sends = 2 * w.micro_batches * w.virtual if w.p > 1 else 0
    pipeline = sends * (act / w.t) / (pipe_link * LINK_EFFICIENCY)
    grads = params(w) / (w.t * w.p) * w.grad_bytes
    data = data_seconds(grads, w, speed, all_reduce=True)
    if w.sharding == "zero3":  # weights gathered forward and backward (and for recompute)
        gathers = 2 + (1 if w.recompute == "full" else 0)
        weights = params(w) / (w.t * w.p) * 2
        data = data_seconds(grads, w, speed, all_reduce=False)
        data += gathers * data_seconds(weights, w, speed, all_reduce=False)
    return {"tensor": tensor, "pipeline": pipeline, "data": data}


def bubble_factor(w: Workload) -> float:
    """Step time over busy time of the mapping's pipeline schedule, from its table."""
    if w.p == 1:
        return 1.0
    full = w.recompute == "full"
    return schedule_bubble(w.schedule, w.p, w.micro_batches, w.virtual, w.lockstep, full)


@functools.lru_cache(maxsize=4096)
def schedule_bubble(kind: str, p: int, m: int, virtual: int, lockstep: bool, full: bool) -> float:
    """`bubble_factor` of one schedule table (cached: a search prices many mappings). In
    lockstep (jaxpod's program) the time is the table's with each op as the executor runs it
    — a stage-by-stage schedule's backward ops (a whole backward, B) recompute their stage
    from its kept input, whatever the remat policy; W does not — over the work the matmul
    time counts: 3 forwards' worth a micro-batch, 4 with full recompute."""
    if virtual > 1 and kind == "1f1b":
        kind = "interleaved-1f1b"
    if kind in ("interleaved-1f1b", "circular") and m % p:
        m = math.ceil(m / p) * p
    table = make_schedule(kind, p, m, virtual)
    if not lockstep:
        return mpmd_time(table) / work(table)
    time = lockstep_time(table, table.explicit_backward or full)
    return time / (table.micro * virtual * (4 if full else 3))


def estimate(w: Workload, speed: Speed) -> dict:
    """Seconds per step and its breakdown: compute (matmul, memory-bound, update), exposed
    communication by kind, and the pipeline bubble."""
    comp = compute_seconds(w, speed)
    comm = comm_seconds(w, speed)
    busy = comp["matmul"] + comp["memory"]
    exposed = dict(comm)
    # jaxpod's TPU program waits for every all-reduce at once (`jaxpod.target.overlap`;
    # docs/estimate.md): only a run that states its overlap gets this credit
    if w.overlap:  # hidden under the backward (about two thirds of the compute)
        exposed["data"] = max(0.0, comm["data"] - 2 / 3 * busy)
        exposed["tensor"] = max(0.0, comm["tensor"] - 1 / 3 * busy)
    elif w.sharding == "zero3":  # FSDP prefetches the next layer's weights under compute
        exposed["data"] = max(0.0, comm["data"] - busy)
    stage = (busy + exposed["tensor"] + exposed["pipeline"]) * bubble_factor(w)
    total = stage + exposed["data"] + comp["update"]
    return {
        "step_s": total,
        "matmul_s": comp["matmul"],
        "memory_s": comp["memory"],
        "update_s": comp["update"],
        "bubble_s": stage - (busy + exposed["tensor"] + exposed["pipeline"]),
        **{f"{k}_exposed_s": v for k, v in exposed.items()},
        **{f"{k}_s": v for k, v in comm.items()},
    }
