"""The run configuration's shape: frozen dataclasses, one per YAML section, and `Config`.

Every enumerated choice is a `typing.Literal` annotation; `CHOICES` and `LIST_CHOICES` (what
the rules check and the tests enumerate) are read off those annotations, so an option is
written once. The dataclasses hold values only: reading YAML is `jaxpod.config.load`'s job,
checking them `jaxpod.config.rules`'s, how their sizes divide one another (the mesh, the
batch, the schedule, the heads) `jaxpod.config.divisibility`'s. Like the whole package, this
module never imports jax.

`devices` counts the devices of each process (all of them in a single process); `processes`
is not a YAML key but set by whoever loads the config (`load_config(..., processes=N)`, after
the runtime says how many processes there are): the mesh spans `total_devices`.
"""

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal

from jaxpod.config.kinds import KINDS, ModelKind

ModelName = Literal["gpt", "bert", "efficientnet"]  # = the keys of jaxpod.config.kinds.KINDS
Remat = Literal["none", "full", "minimal", "attention", "comms"]
Variant = Literal["b0", "b1", "b2", "b3", "b4"]
Norm = Literal["pre", "post"]
MlpKind = Literal["gelu", "swiglu"]
Positions = Literal["learned", "rope"]
OptimName = Literal["sgd", "adamw", "lamb", "lars"]
LrSchedule = Literal["constant", "cosine", "polynomial"]
TextData = Literal["stdlib-code", "synthetic", "text-files"]
ImageData = Literal["digits", "synthetic-imagenet", "image-folder"]
DataName = Literal[TextData, ImageData]  # nested Literals flatten: text names, then images
Dtype = Literal["float32", "float16", "bfloat16"]
Master = Literal["float32", "same-as-params"]
Moments = Literal["same-as-master", "float32"]
LossScale = Literal["none", "static", "dynamic"]
Device = Literal[
    "cpu",
    "ipu-gc200",
    "a100-40gb",
    "a100-80gb",
    "h100-80gb",
    "tpu-v4",
    "tpu-v5e",
    "tpu-v5p",
    "tpu-v6e",
]
Stream = Literal["layer", "matrix"]
Offload = Literal["optimizer", "params", "activations"]
# = jaxpod.parallel.schedules.KINDS
PipelineSchedule = Literal["gpipe", "circular", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v"]
# the schedules whose tables hold the backward ops, run stage by stage
STEPWISE: tuple[str, ...] = ("1f1b", "zb-h1", "interleaved-1f1b", "zb-v")
# the schedules that cut each stage's layers into virtual stages (chunks)
CHUNKED: tuple[str, ...] = ("circular", "interleaved-1f1b", "zb-v")
GradAllreduce = Literal["psum", "ring"]  # = the keys of jaxpod.parallel.replica.ALLREDUCE

DTYPES: tuple[str, ...] = typing.get_args(Dtype)
TEXT_DATA: tuple[str, ...] = typing.get_args(TextData)
IMAGE_DATA: tuple[str, ...] = typing.get_args(ImageData)


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh shape (replica, pipeline, tensor); replica=-1 fills from the device count."""

    replica: int = -1
    pipeline: int = 1
    tensor: int = 1

    @property
    def shape(self) -> tuple[int, int, int]:
        """(replica, pipeline, tensor)."""
        return (self.replica, self.pipeline, self.tensor)


@dataclass(frozen=True)
class ModelConfig:
    """Model hyperparameters: transformers (gpt, bert) use layers..norm, gpt also
    kv_heads..rope_base, bert mask_id; efficientnet uses variant..pipeline_splits (and
    remat)."""

    name: ModelName = "gpt"
    layers: int = 4
    d_model: int = 64
    heads: int = 4
    d_ff: int = 256
    seq_len: int = 64
    vocab: int = 256
    remat: Remat = "none"
    sequence_chunks: int = 1  # query chunks attended one at a time (divides seq_len)
    sequence_parallel: bool = False  # residual stream split over tensor along the sequence
    tie_embeddings: bool = True
    norm: Norm = "pre"  # bert: pre- or post-LayerNorm blocks
    kv_heads: int | None = None  # gpt: key/value heads (grouped-query attention); null: heads
    mlp: MlpKind = "gelu"  # gpt: gelu (W_in, W_out) or swiglu (gate and up of width d_ff)
    positions: Positions = "learned"  # gpt: a learned table, or rope (rotary q and k)
    rope_base: float = 10000.0  # positions=rope: the rotary base (Llama 3: 500000)
    # bert: the [MASK] token's id; null: the tokenizer's (256, after the byte values, with
    # data.tokenizer=bytes; 1 in the BPE jaxpod trains; set it for a tokenizer.json)
    mask_id: int | None = None
    variant: Variant = "b0"  # efficientnet compound-scaling preset
    g16: bool = False  # grouped (16 channels/group) instead of depthwise convs, expansion 4
    norm_groups: int = 4  # GroupNorm groups
    width_mult: float | None = None  # override the variant's width coefficient
    depth_mult: float | None = None  # override the variant's depth coefficient
    block_groups: int | None = None  # only the first N of the 7 block groups (null: all)
    image_size: int = 32
    num_classes: int = 10
    pipeline_splits: tuple[str, ...] = ()  # block names where stages 1.. start, e.g. [4a]

    @property
    def kv_head_count(self) -> int:
        """Key/value heads: `kv_heads`, or `heads` (multi-head attention) when null."""
        return self.kv_heads or self.heads


@dataclass(frozen=True)
class TrainConfig:
    """Loop, batch and logging settings; global_batch = micro_batch * mesh.replica * grad_accum."""

    steps: int = 100
    micro_batch: int = 4
    grad_accum: int | None = None
    global_batch: int | None = None
    # the step's grad_accum micro-batches fed in this many parts, one call of the compiled
    # step each, their gradients summed on the device between calls: the device holds one
    # part of the batch (a pod streams its micro-batches in)
    batch_parts: int = 1
    # micro-batches per GPipe pass (pipeline > 1): a call runs part_micro / pipeline_group
    # pipeline passes and sums their gradients; null: one pass of a call's micro-batches
    pipeline_group: int | None = None
    # the pipeline schedule (mesh.pipeline > 1): gpipe, circular (virtual_stages virtual
    # stages per stage, layers round-robin), 1f1b (backward interleaved: memory
    # independent of M), zb-h1 (1f1b with the backward split, weight gradients deferred),
    # interleaved-1f1b (1f1b over virtual_stages chunks) or zb-v (zb-h1 over two chunks in
    # a V)
    pipeline_schedule: PipelineSchedule = "gpipe"
    virtual_stages: int = 1  # circular, interleaved-1f1b, zb-v: chunks per pipeline stage
    skip_bubbles: bool = False  # gpipe/circular: a bubble tick skips its stage (lax.cond)
    seed: int = 0
    logdir: str = "runs/default"
    log_every: int = 10
    eval_every: int = 50  # 0 disables periodic eval (a fresh run's first and the final run)
    eval_batches: int = 4
    checkpoint_every: int = 0  # 0 saves only the final step (which is always saved)
    keep_checkpoints: int = 3  # newest checkpoints kept under <logdir>/checkpoints/
    profile_steps: tuple[int, ...] | None = None  # [start, stop): trace these steps


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and learning-rate schedule; grad_clip is a global-norm clip (0 disables)."""

    name: OptimName = "adamw"
    lr: float = 1e-3
    lr_schedule: LrSchedule = "cosine"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    momentum: float = 0.9
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    power: float = 1.0  # polynomial schedule: lr * (1 - progress) ** power after warm-up
    end_lr: float = 0.0  # polynomial schedule's final learning rate
    trust_coefficient: float = 0.001  # lars
    # the optimizer state's dtype: the master weights' (default) or float32 (Adam's second
    # moments of 16-bit masters underflow in float16)
    moments: Moments = "same-as-master"


@dataclass(frozen=True)
class DataConfig:
    """Dataset choice; path is required for text-files and image-folder, None otherwise."""

    name: DataName = "stdlib-code"
    path: str | None = None
    # text: `bytes` (ids are the 256 byte values), `bpe` (a byte-level BPE of model.vocab ids
    # trained on the corpus) or the path of a tokenizer.json (its ids fit in model.vocab);
    # BPE token files are written once under $XDG_CACHE_HOME/jaxpod/tokens (jaxpod.data.tokenized)
    tokenizer: str = "bytes"
    val_fraction: float = 0.05
    prefetch: int = 3  # batches (parts) read ahead into host memory by a thread (0: synchronous)
    workers: int = 4  # image-folder: threads that decode a batch's images (per process)


@dataclass(frozen=True)
class PrecisionConfig:
    """Mixed precision: weight, compute and master dtypes; loss scaling.

    `master=same-as-params` with 16-bit params keeps no float32 copy: updates are applied
    with stochastic rounding. A dynamic loss scale grows x2 after `loss_scale_period` finite
    steps and halves on overflow (the step is skipped)."""

    params: Dtype = "float32"
    compute: Dtype = "float32"
    master: Master = "float32"
    loss_scale: LossScale = "none"
    loss_scale_init: float = 32768.0
    loss_scale_period: int = 2000


@dataclass(frozen=True)
class MemoryConfig:
    """Where bytes live: device profile, replicated tensor sharding, host offload, phases."""

    device: Device = "cpu"
    rts: int = 1  # weights of each stage sharded over this many replicas
    rts_optimizer: int | None = None  # optimizer state sharded over this many (None: = rts)
    offload: tuple[Offload, ...] = ()
    phases: int = 1  # the layers of a stage run in this many phases, streamed from host
    stream: Stream = "layer"  # unit a weight is prepared (fetched/gathered) in
    mlp_panels: int = 1  # with stream=matrix: the MLP's matrices in this many panels
    vocab_slices: int = 1  # GPT: the token table used (and RTS-gathered) this many rows at a time
    device_budget: str | None = None  # e.g. 900MB, 16GiB: refuse mappings that exceed it


@dataclass(frozen=True)
class ParallelConfig:
    """The data-parallel gradient all-reduce: `psum` or a `ppermute` ring, one per gradient
    leaf (grad_bucket_bytes=0) or over leaves fused into flat buckets of at most that many."""

    grad_allreduce: GradAllreduce = "psum"
    grad_bucket_bytes: int = 0


@dataclass(frozen=True)
class Config:
    """The whole run configuration."""

    devices: int = 8  # devices of each process (virtual CPU devices on CPU)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    processes: int = 1  # set by the loader's caller (`ARGUMENTS`), never by YAML

    @property
    def devices_per_process(self) -> int:
        """The devices each process contributes (= `devices`)."""
        return self.devices

    @property
    def total_devices(self) -> int:
        """The devices the mesh spans: `devices * processes`."""
        return self.devices * self.processes

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step (resolved configs only)."""
        if self.train.global_batch is None:
            raise ValueError("config is not resolved; build it with load_config/config_from_dict")
        return self.train.global_batch

    @property
    def part_micro(self) -> int:
        """Micro-batches per call of the step: `grad_accum / train.batch_parts`."""
        return self.train.grad_accum // self.train.batch_parts

    @property
    def part_batch(self) -> int:
        """Examples per call of the step: `global_batch / train.batch_parts`."""
        return self.global_batch // self.train.batch_parts

    @property
    def pipeline_group(self) -> int:
        """Micro-batches per GPipe pass: `train.pipeline_group`, or all of a call's."""
        return self.train.pipeline_group or self.part_micro

    @property
    def pipeline_passes(self) -> int:
        """GPipe passes per call of the step: `part_micro / pipeline_group` (pipeline > 1)."""
        return self.part_micro // self.pipeline_group

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step: global_batch * model.seq_len."""
        return self.global_batch * self.model.seq_len

    @property
    def kind(self) -> ModelKind:
        """What kind of model `model.name` is (`jaxpod.config.kinds`)."""
        return KINDS[self.model.name]

    def warnings(self) -> list[str]:
        """Legal but risky settings, one line each (the CLI prints them)."""
        out = []
        if self.precision.params == "float16" and self.precision.loss_scale == "none":
            out.append(
                "precision.params=float16 with precision.loss_scale=none: small gradients "
                "underflow to zero in float16; set precision.loss_scale=dynamic"
            )
        if (
            self.precision.master == "same-as-params"
            and self.precision.params != "float32"
            and self.optim.name in ("adamw", "lamb")
            and self.optim.moments != "float32"
        ):
            out.append(
                f"optim.name={self.optim.name} with 16-bit master weights keeps its second "
                f"moments (g^2) in {self.precision.params}, where small values underflow; "
                "set optim.moments=float32, or prefer optim.name=lars or sgd"
            )
        if "activations" in self.memory.offload:
            out.append(
                "memory.offload includes activations: the TPU/GPU program places the saved "
                "activations on the host, the CPU one does not; the planner counts them on the "
                "host for the TPU profiles without a pipeline or under gpipe and circular "
                "(under the stepwise schedules one backward tick's, on the device as well), "
                "else on the device (`jaxpod plan` says why)"
            )
        return out


ARGUMENTS: tuple[str, ...] = ("processes",)  # Config fields the caller sets, not YAML keys
SECTIONS: dict[str, type] = {
    f.name: f.type for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.type)
}  # section name -> dataclass: mesh, model, train, optim, data, precision, memory


def _literal_args(tp: object) -> tuple[str, ...] | None:
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


def _choices(of_items: bool) -> dict[str, tuple[str, ...]]:
    """Dotted key -> options, for the Literal fields (`of_items`: the tuple-of-Literal ones)."""
    out = {}
    for section, cls in SECTIONS.items():
        for name, tp in typing.get_type_hints(cls).items():
            if of_items:
                is_tuple = typing.get_origin(tp) is tuple
                options = _literal_args(typing.get_args(tp)[0]) if is_tuple else None
            else:
                options = _literal_args(tp)
            if options is not None:
                out[f"{section}.{name}"] = options
    return out


CHOICES: dict[str, tuple[str, ...]] = _choices(of_items=False)  # e.g. model.remat -> (...)
LIST_CHOICES: dict[str, tuple[str, ...]] = _choices(of_items=True)  # every item one of these
