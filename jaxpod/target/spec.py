"""What `--target` names: the accelerators a program is compiled for, jax-free.

    tpu-v5p:2x2x4     TPU v5p, a 2x2x4 torus of 16 chips (Cloud's accelerator type v5p-32)
    tpu-v4:2x2x2      TPU v4, 8 chips, one device per chip (megacore, as a TPU VM runs it)
    tpu-v5e:4x4       TPU v5e, a 4x4 torus of 16 chips (v5litepod-16)
    tpu-v6e:16x16     TPU v6e, 256 chips
    h100:8            NVIDIA H100 SXM 80 GB, 8 GPUs on one host (NVLink)

The topology after the colon is the physical shape jax's `get_topology_desc` takes (chips per
torus axis); its product is the chip count, which must equal the mesh's device count. Cloud's
accelerator types count TensorCores for v4 and v5p (two per chip: v5p-32 is 16 chips) and
chips for v5e and v6e; jaxpod always counts chips, one jax device each.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from jaxpod.errors import UserError


@dataclass(frozen=True)
class Generation:
    """One kind of accelerator a target may name: its planner profile, jax platform, torus
    rank, and the extra arguments jax's topology description needs for it."""

    name: str  # as written in a target: "v5p", "h100"
    profile: str  # `jaxpod.planner.profiles` name
    platform: str  # jax platform: "tpu" or "cuda"
    torus_rank: int  # physical axes of the topology (0: no torus, GPUs on NVLink)
    topology_kwargs: dict = field(default_factory=dict)


GENERATIONS: dict[str, Generation] = {
    g.name: g
    for g in (
        Generation("v4", "tpu-v4", "tpu", 3, {"chip_config_name": "megacore"}),
        Generation("v5e", "tpu-v5e", "tpu", 2),
        Generation("v5p", "tpu-v5p", "tpu", 3),
        Generation("v6e", "tpu-v6e", "tpu", 2),
        Generation("h100", "h100-80gb", "cuda", 0),
    )
}

EXAMPLES = "tpu-v5p:2x2x4, tpu-v5e:4x4, tpu-v4:2x2x2, tpu-v6e:4x4 or h100:8"
_TPU = re.compile(r"^tpu-(v4|v5e|v5p|v6e):(\d+(?:x\d+)*)$")
_GPU = re.compile(r"^(h100):(\d+)$")


@dataclass(frozen=True)
class Target:
    """A parsed `--target`: the generation and the chips per physical axis."""

    text: str
    generation: Generation
    shape: tuple[int, ...]

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    @property
    def topology_name(self) -> str:
        """The name jax's `get_topology_desc` takes: `v5p:2x2x4`."""
        return f"{self.generation.name}:{'x'.join(map(str, self.shape))}"

    @property
    def profile(self) -> str:
        return self.generation.profile

    @property
    def platform(self) -> str:
        return self.generation.platform


def parse_target(text: str) -> Target:
    """`Target` of `--target TEXT`; a `UserError` (one line, with examples) if it names none."""
    tpu, gpu = _TPU.match(text.strip()), _GPU.match(text.strip())
    if gpu:
        count = int(gpu.group(2))
        if not 1 <= count <= 8:
            raise UserError(f"--target {text}: name 1 to 8 GPUs of one host, e.g. h100:8")
        return Target(text, GENERATIONS[gpu.group(1)], (count,))
    if not tpu:
        raise UserError(f"--target {text} names no target; write one like {EXAMPLES}")
    generation = GENERATIONS[tpu.group(1)]
    shape = tuple(int(n) for n in tpu.group(2).split("x"))
    if len(shape) != generation.torus_rank or min(shape) < 1:
        axes = "x".join("N" * generation.torus_rank)
        raise UserError(
            f"--target {text}: TPU {generation.name} is a {generation.torus_rank}-D torus; "
            f"give {generation.torus_rank} axis sizes, tpu-{generation.name}:{axes}"
        )
    return Target(text, generation, shape)


def check_mesh_fits(target: Target, mesh_devices: int) -> None:
    """One line if the mesh's device count is not the target's chip count."""
    if mesh_devices != target.chips:
        raise UserError(
            f"--target {target.text} has {target.chips} chips but the mesh has {mesh_devices} "
            "devices; name a topology of that many chips or change mesh.* (mesh.replica=-1 "
            "fills from the target)"
        )


def check_compiles(target: Target, cfg) -> None:
    """One line for a valid config that `target`'s compiler is known to reject
    (`check_platform_compiles`)."""
    check_platform_compiles(target.platform, target.text, cfg)


def check_platform_compiles(platform: str, where: str, cfg) -> None:
    """One line for a valid config that the `platform` ("tpu", "cpu", ...) compiler is known
    to reject: XLA:TPU (libtpu 0.0.42) with the saved activations offloaded under gpipe or
    circular skipping their bubbles (a skipped bubble's `lax.cond` returns the saved values in
    host memory and the tick scan's stack of them fails XLA's host offloading:
    docs/memory.md). `where` names the devices in the message."""
    t = cfg.train
    offloads = "activations" in cfg.memory.offload and cfg.model.remat != "full"
    if platform == "tpu" and offloads and cfg.mesh.pipeline > 1 and t.skip_bubbles:
        raise UserError(
            f"train.skip_bubbles=true with memory.offload=[activations] under "
            f"{t.pipeline_schedule}: XLA:TPU cannot compile it for {where} (the skipped "
            "bubble's saved values come out of its lax.cond in host memory); set "
            "train.skip_bubbles=false, which offloads them, or model.remat=full"
        )
