"""Where `memory.offload=[activations]` puts the saved values, by schedule.

`host_saved` turns one layer's offloaded bytes (`activations.offloaded_per_layer`) into the
host memory they take and the bytes they take off the device's saved values, as XLA:TPU's
compiled program holds them (tests/target/test_offload_tpu.py, test_offload_stepwise_tpu.py):

- without a pipeline, and under gpipe and circular (one forward scan, differentiated as a
  whole), the saved values of every tick's layers are stacked in host memory until their
  backward: all of them leave the device;
- the stepwise schedules (1f1b, zb-h1, interleaved-1f1b, zb-v) recompute a stage's forward
  inside its backward tick and run its vjp there: the tick writes each of its layers' saved
  values to host memory and reads them back before the tick ends. The host holds one tick's
  (the L / (S V) layers of a virtual stage, one buffer per value stacked over them); the
  device total is left as it is (XLA:TPU's HBM moves either way with no rule found, -7.2
  to +3.0 MB on the probes of docs/memory.md).
"""

from __future__ import annotations

from jaxpod.config.schema import STEPWISE, Config


def host_saved(cfg: Config, pipe: dict, per_layer: int) -> tuple[int, int]:
    """`(host, lifted)`: bytes of saved values in host memory and bytes of them no longer
    held with the device's saved values, given one layer's offloaded bytes `per_layer` and
    the schedule's terms `pipe` (`activations._pipeline_terms`: `ticks`,
    `layers_per_stage`)."""
    per_tick = pipe["layers_per_stage"] // cfg.train.virtual_stages
    if cfg.mesh.pipeline > 1 and cfg.train.pipeline_schedule in STEPWISE:
        return per_tick * per_layer, 0
    host = pipe["ticks"] * per_tick * per_layer
    return host, host
