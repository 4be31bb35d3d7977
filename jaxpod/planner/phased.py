"""The host-resident layer stack a phase at a time: what the device holds of it with
`memory.phases=K` on a backend whose program moves one phase in at a time.

Without a pipeline, XLA:TPU fetches each phase's `L/K` layers of every stacked matrix for
the phase's passes, and the update (`jaxpod.optim.phased`) brings in one phase's stacked
matrices and their moments, updates them and writes them back before the next
(`DeviceProfile.updates_in_phases`; in compiled programs tests/target/test_offload_tpu.py
finds the fetches, test_phases_tpu.py what the update's peak holds). So the device holds
one phase of the host-resident stack at any moment, and the update holds one phase of the
state it moves in and of its new params, besides the non-layer leaves (its first part) and
the gradients, all made on the device before it. With a pipeline nothing is credited: a
stage holds its whole stack for the ticks, and the update moves it whole. Jax-free.
"""

from __future__ import annotations

from jaxpod.config import Config
from jaxpod.planner.profiles import DeviceProfile


def held_phases(cfg: Config, profile: DeviceProfile) -> int:
    """How many phases the device holds the host-resident layer stack by: `memory.phases`
    on a profile that `updates_in_phases`, without a pipeline, for a stacked family; else 1
    (the whole stack)."""
    if not profile.updates_in_phases or cfg.mesh.pipeline > 1 or cfg.kind.stages != "stacked":
        return 1
    return cfg.memory.phases


def one_phase(layout: dict, phases: int) -> float:
    """The share of a whole-model state (the weights, their moments, the new params) that
    one part of the update holds: the non-layer leaves and `1/phases` of the layer stack."""
    layers = layout["local_layers"] / max(layout["local"], 1)
    return 1 - layers + layers / phases


def stack_credit(layout: dict, master: float, phases: int) -> float:
    """Bytes of the host-resident layer stack's master weights (`master`: every weight's)
    not on the device at once: all but one phase of them."""
    return master * layout["local_layers"] / max(layout["local"], 1) * (1 - 1 / phases)
