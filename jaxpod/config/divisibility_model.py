"""The divisibility rules of the model over the mesh, of where the bytes live (RTS groups,
MLP panels, token-table slices, phases) and of the batch (parts, pipeline passes): part of
the one table `jaxpod.config.divisibility.RULES`, in the order validation reports them.
Each rule names the fields it reads (`rule(...)`) and returns its one-line message, or None.
"""

from __future__ import annotations

from jaxpod.config.rule_sizes import Sizes, call_micro, collector, kind_of, micro_name, pass_micro

RULES, rule = collector()


# ------------------------------------------------------------------ the model over the mesh
@rule("model.name", "model.d_model", "model.heads")
def _heads_split_width(v: Sizes) -> str | None:
    d, heads = v["model.d_model"], v["model.heads"]
    if kind_of(v).stages != "packed" and d % heads:
        return (
            f"model.d_model={d} is not divisible by model.heads={heads}; "
            "choose model.heads that divides model.d_model"
        )
    return None


@rule("model.name", "model.seq_len", "model.sequence_chunks")
def _chunks_split_sequence(v: Sizes) -> str | None:
    seq, chunks = v["model.seq_len"], v["model.sequence_chunks"]
    if kind_of(v).data == "tokens" and seq % chunks:
        return (
            f"model.sequence_chunks={chunks} does not divide model.seq_len={seq}; use a "
            f"divisor of {seq}"
        )
    return None


@rule("model.name", "model.sequence_parallel", "model.seq_len", "mesh.tensor")
def _tensor_splits_sequence(v: Sizes) -> str | None:
    seq, t = v["model.seq_len"], v["mesh.tensor"]
    if kind_of(v).data == "tokens" and v["model.sequence_parallel"] and seq % t:
        return (
            f"model.sequence_parallel=true splits model.seq_len={seq} over mesh.tensor={t}, "
            f"which does not divide it; use a multiple of {t} or model.sequence_parallel=false"
        )
    return None


@rule("model.name", "model.layers", "mesh.pipeline")
def _stages_split_layers(v: Sizes) -> str | None:
    layers, p = v["model.layers"], v["mesh.pipeline"]
    if kind_of(v).stages == "stacked" and layers % p:
        return (
            f"model.layers={layers} does not divide into mesh.pipeline={p} stages; use a "
            f"multiple of {p}"
        )
    return None


def _tensor_splits(name: str) -> None:
    """The rule that mesh.tensor divides `model.<name>` (tensor-parallel models)."""

    @rule("model.name", f"model.{name}", "mesh.tensor")
    def check(v: Sizes) -> str | None:
        value, t = v[f"model.{name}"], v["mesh.tensor"]
        if kind_of(v).tensor_parallel and value % t:
            return (
                f"mesh.tensor={t} does not divide model.{name}={value}; use a mesh.tensor "
                f"that divides it or a multiple of {t}"
            )
        return None


for _name in ("heads", "d_ff", "vocab"):
    _tensor_splits(_name)


@rule("model.name", "model.heads", "model.kv_heads", "mesh.tensor")
def _kv_heads_split(v: Sizes) -> str | None:
    heads, t = v["model.heads"], v["mesh.tensor"]
    kv = v["model.kv_heads"] or heads
    if kind_of(v).stages != "stacked":
        return None
    if heads % kv:
        return (
            f"model.kv_heads={kv} does not divide model.heads={heads}; choose a divisor of "
            f"{heads} (each KV head serves heads/kv_heads query heads)"
        )
    if kind_of(v).tensor_parallel and kv % t:
        return (
            f"mesh.tensor={t} does not divide model.kv_heads={kv}; each tensor shard holds "
            f"whole KV heads: use a mesh.tensor that divides {kv} or more model.kv_heads"
        )
    return None


# ------------------------------------------------------------------ where the bytes live
def _rts_divides(key: str) -> None:
    """The rule that the RTS group size `key` divides the replicas."""

    @rule(key, "mesh.replica")
    def check(v: Sizes) -> str | None:
        value, r = v[key], v["mesh.replica"]
        if value is not None and r % value:
            return f"{key}={value} does not divide mesh.replica={r}; use a divisor of {r}"
        return None


for _key in ("memory.rts", "memory.rts_optimizer"):
    _rts_divides(_key)


@rule("memory.rts", "memory.rts_optimizer")
def _rts_groups_nest(v: Sizes) -> str | None:
    rts = v["memory.rts"]
    opt = rts if v["memory.rts_optimizer"] is None else v["memory.rts_optimizer"]
    if max(rts, opt) % min(rts, opt):
        return (
            f"memory.rts={rts} and memory.rts_optimizer={opt} must divide one another "
            "(weights and optimizer state are split over nested groups of replicas)"
        )
    return None


@rule("memory.mlp_panels", "model.d_ff", "mesh.tensor")
def _panels_split_mlp(v: Sizes) -> str | None:
    panels, local = v["memory.mlp_panels"], v["model.d_ff"] // v["mesh.tensor"]
    if local % panels:
        return (
            f"memory.mlp_panels={panels} does not divide the {local} hidden units per tensor "
            "shard (model.d_ff/mesh.tensor); use a divisor of it"
        )
    return None


@rule("memory.vocab_slices", "model.vocab", "mesh.tensor")
def _slices_split_table(v: Sizes) -> str | None:
    slices, local = v["memory.vocab_slices"], v["model.vocab"] // v["mesh.tensor"]
    if local % slices:
        return (
            f"memory.vocab_slices={slices} does not divide the {local} table rows per tensor "
            "shard (model.vocab/mesh.tensor); use a divisor of it"
        )
    return None


@rule("memory.phases", "model.layers", "mesh.pipeline")
def _phases_split_stage(v: Sizes) -> str | None:
    phases, per_stage = v["memory.phases"], v["model.layers"] // v["mesh.pipeline"]
    if per_stage % phases:
        return (
            f"memory.phases={phases} does not divide the {per_stage} layers of each pipeline "
            f"stage (model.layers/mesh.pipeline); use a divisor of {per_stage}"
        )
    return None


# ------------------------------------------------------------------ the batch
@rule("train.grad_accum", "train.batch_parts")
def _parts_split_accumulation(v: Sizes) -> str | None:
    accum, parts = v["train.grad_accum"], v["train.batch_parts"]
    if accum % parts:
        return (
            f"train.batch_parts={parts} does not divide train.grad_accum={accum} "
            f"micro-batches; use a divisor of {accum}"
        )
    return None


@rule("train.grad_accum", "train.batch_parts", "train.pipeline_group")
def _passes_split_call(v: Sizes) -> str | None:
    micro, group = call_micro(v), pass_micro(v)
    if micro % group:
        return (
            f"train.pipeline_group={group} does not divide {micro_name(v, False)}={micro}; "
            f"use a divisor of {micro}"
        )
    return None
