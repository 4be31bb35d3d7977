"""Device memory profiles for the planner: how many bytes a device holds, and how many more it
can stream from (host DRAM / IPU streaming memory). Jax-free.

The numbers are per device. `device_bytes` is the fast memory the step's arrays must fit in;
`streaming_bytes` is the slower memory that offloaded state (`memory.offload`) and phased
weights live in. A backend's known differences from the target are explicit properties, not
fitted constants: XLA:CPU computes 16-bit dtypes in float32 (`widens_16bit`), keeps bfloat16
values between its computations in float32 buffers (`stores_in_float32`), casts 16-bit
weights from float32 masters one layer at a time (`casts_in_layer_loops`) and both memory
kinds in one RAM, so its update reads host-resident optimizer state in place
(`shares_host_memory`: nothing is moved in; measured in docs/memory.md). XLA:TPU pads
every array to its tiles (`tile`: `jaxpod.planner.tiles`), converts float32 layer matrices
to bfloat16 for its matmuls (`converts_matrices`), fuses a recomputed layer into its
backward's matmuls (`fuses_recomputation`), computes a float32 loss head's gradient at
once (`head_grads_at_once`) and adds the non-layer gradients into their accumulator
(`accumulates_in_place`), which the TPU profiles name (tests/target/test_fusion_tpu.py and
test_sequence_parallel_tpu.py find them in compiled programs), places the values a
remat policy saves in host memory when `memory.offload` names activations
(`offloads_activations`; XLA:CPU ignores the placement), without a pipeline holds the
host-resident layer stack and the update's state a phase at a time (`updates_in_phases`:
test_offload_tpu.py, test_phases_tpu.py), holds a grouped conv's operand and output
cotangent in its grouped layout (`grouped_conv_copies`), lays the stem's stage's saved
GroupNorm values out width-minor (`stem_groups_width_minor`, `jaxpod.planner.switch_union`)
and on v5e and v6e keeps some temporaries in VMEM (`vmem_heap`, `jaxpod.planner.vmem`).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxpod.planner.tiles import Tile

GB = 10**9
GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator's two memory levels, in bytes per device, and how it runs a step."""

    name: str
    device_bytes: int
    streaming_bytes: int
    description: str
    widens_16bit: bool = False  # float16/bfloat16 activations are computed in float32
    # 16-bit compute dtypes whose values are stored in float32 buffers between computations
    # (XLA:CPU converts bfloat16 ops to float32 whole; float16 is widened inside fusions only)
    stores_in_float32: tuple[str, ...] = ()
    shares_host_memory: bool = False  # host memory kinds are device memory: no moved-in copy
    # with float32 masters a stacked layer's 16-bit weights are cast one layer at a time inside
    # the layer loops (packed rows leaf by leaf in each tick's stage): no whole 16-bit (or
    # widened) stack or row is stored, and the gradients, the loops' carries and the
    # accumulator, are float32 (XLA:CPU, benchmarks/xla_peak.py; XLA:TPU's stacked layers,
    # tests/target/test_masters_tpu.py; its packed rows not read)
    casts_in_layer_loops: bool = False
    # a depthwise conv's weight gradient is computed from a dense [k, k, C, C] float32 kernel
    # (XLA:CPU; benchmarks/xla_peak.py), which the planner counts in its stage's backward
    dense_depthwise_grads: bool = False
    # an RTS weight gradient is copied into the transposed layout (in the gradients' dtype)
    # before its reduce-scatter, both alive in the layer's backward (XLA:CPU; xla_peak.py)
    transposes_scattered_grads: bool = False
    chips_per_host: int = 1  # devices sharing one host's streaming memory
    # the tile arrays are laid out in, their two minor dimensions padded to it (XLA:TPU);
    # None: arrays take their logical bytes
    tile: Tile | None = None
    # float32 matmuls at default precision take one bfloat16 pass: the stacked layer matrices
    # (W_qkv, W_o, W_in, W_out) are converted to bfloat16 once, whole, before the layer loops,
    # and the copies held through the step; with RTS each layer's shards are converted and
    # all-gathered in bfloat16 (XLA:TPU, float32 params and compute)
    converts_matrices: bool = False
    # a recomputed layer's backward holds the recomputed probabilities and hidden units (and a
    # bfloat16 copy of those) beside three residual rows (whole-sequence ones with sequence
    # parallelism), not autodiff's whole saved set (XLA:TPU fuses the recomputation into the
    # matmuls: `jaxpod.planner.layer`)
    fuses_recomputation: bool = False
    # the remat policy's saved values live in host memory with memory.offload=[activations]
    # (XLA:TPU's host temporaries, tests/target/test_offload_tpu.py). XLA:CPU drops the
    # placement; jax lowers it for GPU too, but no XLA:GPU program is read here: False
    offloads_activations: bool = False
    # with float32 compute GPT's loss head computes its table's gradient with the logits'
    # cotangent, before the layers' backward: no operand of it, and no gathered table, waits;
    # the softmax is fused, one logits value; with sequence parallelism GPT's and BERT's,
    # bfloat16 too (XLA:TPU; `_head_kept`, `fused_head`)
    head_grads_at_once: bool = False
    # the gradients of the parameters outside the layer stack (the token and position tables,
    # the norms) are added into the micro-batch accumulator where computed: one copy at the
    # layers' backward, where the stack's gradient has two; with RTS the whole gradient,
    # reduce-scattered after the micro-batches (XLA:TPU; `_state_bytes`)
    accumulates_in_place: bool = False
    # the on-chip VMEM that XLA:TPU's memory-space assignment fills with the step's
    # temporaries (its capacity less the kernels' scoped VMEM): part of them is not in HBM at
    # the peak (`jaxpod.planner.vmem`); 0 where the programs keep temporaries in HBM
    vmem_heap: int = 0
    # without a pipeline, in `memory.phases` K, the host-resident layer stack is on the device
    # a phase at a time: each phase's L/K layers fetched for its passes, and the update brings
    # in one phase's stacked matrices and their moments, updates them and writes them back
    # before the next (XLA:TPU; `jaxpod.planner.phased`)
    updates_in_phases: bool = False
    # a grouped convolution's operand and its output's cotangent are copied into its layout
    # `[B, H, W, groups, group size]`, the micro-batch second-minor, padded to the tile, and
    # held until its weight gradient (XLA:TPU; `jaxpod.planner.grouped_convs`)
    grouped_conv_copies: bool = False
    # pipelined without remat, the GroupNorm values the stem's stage saves, float32
    # `[mb, H, W, G, C/G]`, are laid out width-minor: W padded to the lanes, not the group's
    # channels (XLA:TPU, read on EfficientNet-B4 G16 only;
    # `jaxpod.planner.switch_union.width_minor_read`)
    stem_groups_width_minor: bool = False


# what XLA:TPU's programs do, the same on every TPU generation read (tests/target/)
XLA_TPU = dict(
    tile=Tile(),
    casts_in_layer_loops=True,
    converts_matrices=True,
    fuses_recomputation=True,
    offloads_activations=True,
    head_grads_at_once=True,
    accumulates_in_place=True,
    updates_in_phases=True,
    grouped_conv_copies=True,
    stem_groups_width_minor=True,
)

PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        DeviceProfile(
            "cpu",
            16 * GiB,
            16 * GiB,
            "virtual XLA CPU device: a nominal 16 GiB each (the machine's RAM is shared by all "
            "virtual devices, so no per-device figure is real); host memory is the same RAM; "
            "16-bit compute runs in float32",
            widens_16bit=True,
            stores_in_float32=("bfloat16",),
            shares_host_memory=True,
            casts_in_layer_loops=True,
            dense_depthwise_grads=True,
            transposes_scattered_grads=True,
        ),
        DeviceProfile(
            "ipu-gc200",
            900 * 10**6,
            64 * GB,
            "Graphcore GC200 IPU: ~900 MB in-processor SRAM; 64 GB streaming memory per IPU "
            "(256 GB of DDR per 4-IPU M2000)",
        ),
        DeviceProfile(
            "a100-40gb",
            40 * GiB,
            1024 * GiB // 8,
            "NVIDIA A100 SXM4 40 GB HBM2; streaming = host DRAM, 1 TiB per 8-GPU DGX A100",
            chips_per_host=8,
        ),
        DeviceProfile(
            "a100-80gb",
            80 * GiB,
            2048 * GiB // 8,
            "NVIDIA A100 SXM4 80 GB HBM2e; streaming = host DRAM, 2 TiB per 8-GPU DGX A100 (80 GB)",
            chips_per_host=8,
        ),
        DeviceProfile(
            "h100-80gb",
            80 * GiB,
            256 * GiB,
            "NVIDIA H100 SXM 80 GB HBM3; streaming = host DRAM, nominal 256 GiB per GPU "
            "(2 TiB per 8-GPU node)",
            chips_per_host=8,
        ),
        DeviceProfile(
            "tpu-v4",
            32 * GiB,
            407 * GB // 4,
            "Google TPU v4: 32 GiB HBM per chip, 3-D torus; streaming = host DRAM, 407 GB per "
            "4-chip host (nominal, the TPU VM's)",
            chips_per_host=4,
            **XLA_TPU,
        ),
        DeviceProfile(
            "tpu-v5e",
            16 * GiB,
            512 * GiB // 8,
            "Google TPU v5e: 16 GiB HBM per chip, 2-D torus; streaming = host DRAM, 512 GiB "
            "per 8-chip host",
            chips_per_host=8,
            vmem_heap=112 * MiB,  # 128 MiB of VMEM (jax's pallas tpu_info), 16 scoped
            **XLA_TPU,
        ),
        DeviceProfile(
            "tpu-v5p",
            95 * GiB,
            448 * GB // 4,
            "Google TPU v5p: 95 GiB HBM per chip, 3-D torus; streaming = host DRAM, 448 GB per "
            "4-chip host (nominal, the TPU VM's)",
            chips_per_host=4,
            **XLA_TPU,
        ),
        DeviceProfile(
            "tpu-v6e",
            32 * GiB,
            1536 * GiB // 8,
            "Google TPU v6e (Trillium): 32 GiB HBM per chip, 2-D torus; streaming = host DRAM, "
            "1536 GiB per 8-chip host",
            chips_per_host=8,
            vmem_heap=96 * MiB,  # 128 MiB of VMEM (jax's pallas tpu_info), 32 scoped
            **XLA_TPU,
        ),
    )
}


def get_profile(name: str) -> DeviceProfile:
    """The profile called `name` (one of `PROFILES`); KeyError names the choices."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(
            f"unknown device profile {name!r}; choose from {', '.join(PROFILES)}"
        ) from None
