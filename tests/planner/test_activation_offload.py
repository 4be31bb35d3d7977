"""The planner's credit for `memory.offload=[activations]`: on a profile whose backend places
the remat policy's saved values in host memory (`DeviceProfile.offloads_activations`, the
TPU profiles), each layer's saved values less its input move from the device total to the
host total, without a pipeline and under gpipe and circular; the stepwise tables' backward
tick offloads its own and reads them back: host memory, no device credit. The bytes are
checked against the shapes the policies save here, against XLA:TPU's compiled program in
tests/target/test_offload_tpu.py (instant)."""

from __future__ import annotations

import pytest
from helpers import make_tiny_cfg

from jaxpod.planner.plan import format_plan, plan

# the saved activations outweigh the state (as tests/target/test_offload_tpu.py's ACTIVE)
ACTIVE = ("model.d_model=256", "model.heads=2", "model.d_ff=1024", "model.seq_len=256")
ACTIVE += ("train.micro_batch=4",)
FLAT = (4, 1, 2)
OFFLOAD = "memory.offload=[activations]"


def _plan(*overrides: str, device: str = "tpu-v5p", mesh=FLAT) -> dict:
    return plan(make_tiny_cfg(*ACTIVE, *overrides, f"memory.device={device}", mesh=mesh))


def saved_per_layer(cfg, remat: str) -> int:
    """Bytes of what `remat`'s policy saves of one layer besides its input, float32, from the
    shapes the layer makes on one of t tensor devices: `minimal` the weight matmuls' outputs
    (q, k, v; W_o's [b, T, D]; W_in's [b, T, F/t]), `attention` q, k, v and the attention
    output, `comms` the attention's all-reduced sum (the MLP's is no residual)."""
    md, t = cfg.model, cfg.mesh.tensor
    rows = cfg.train.micro_batch * md.seq_len
    qkv = (md.d_model + 2 * md.kv_head_count * (md.d_model // md.heads)) // t
    columns = {
        "minimal": qkv + md.d_model + md.d_ff // t,
        "attention": qkv + md.d_model // t,
        "comms": md.d_model,
    }[remat]
    return rows * columns * 4


@pytest.mark.parametrize("remat", ["minimal", "attention", "comms"])
def test_saved_values_move_to_the_host(remat):
    """Without a pipeline one micro-batch's layers are in flight: the host holds every
    layer's saved values; the device total (peak at the layers' backward) falls by all but
    the one layer whose backward reads its own back."""
    kept, offloaded = _plan(f"model.remat={remat}"), _plan(OFFLOAD, f"model.remat={remat}")
    cfg = make_tiny_cfg(*ACTIVE, mesh=FLAT)
    per_layer = saved_per_layer(cfg, remat)
    host = cfg.model.layers * per_layer
    acts = offloaded["activations_breakdown"]
    assert (acts["host"], acts["host_why"]) == (host, "")
    assert acts["saved"] - acts["saved_on_device"] == host
    b, k = offloaded["bytes_per_device"], kept["bytes_per_device"]
    assert b["peak"] == k["peak"] == "backward"
    assert k["device_total"] - b["device_total"] == host - per_layer
    assert b["host_total"] - k["host_total"] == host
    assert "in host memory" in format_plan(offloaded)


PIPELINED = (2, 2, 2)
CIRCULAR = ("train.pipeline_schedule=circular", "train.virtual_stages=2")


@pytest.mark.parametrize("remat", ["minimal", "attention", "comms"])
@pytest.mark.parametrize("schedule", [(), CIRCULAR], ids=["gpipe", "circular"])
def test_every_tick_saves_to_the_host(remat, schedule):
    """gpipe and circular: every tick of the forward tick scan saves its layers' values (V M
    + S - 1 ticks of L / (S V) layers), all of them in host memory; the device total falls
    by all but one layer's."""
    overrides = (*schedule, f"model.remat={remat}")
    kept = _plan(*overrides, mesh=PIPELINED)
    offloaded = _plan(OFFLOAD, *overrides, mesh=PIPELINED)
    cfg = make_tiny_cfg(*ACTIVE, *schedule, mesh=PIPELINED)
    stages, virtual = cfg.mesh.pipeline, cfg.train.virtual_stages
    ticks = virtual * cfg.pipeline_group + stages - 1
    per_layer = saved_per_layer(cfg, remat)
    host = ticks * cfg.model.layers // (stages * virtual) * per_layer
    acts = offloaded["activations_breakdown"]
    assert (acts["host"], acts["host_why"], acts["ticks"]) == (host, "", ticks)
    b, k = offloaded["bytes_per_device"], kept["bytes_per_device"]
    assert k["device_total"] - b["device_total"] == host - per_layer
    assert b["host_total"] - k["host_total"] == host


STEPWISE = {
    "1f1b": ("train.pipeline_schedule=1f1b",),
    "zb-h1": ("train.pipeline_schedule=zb-h1",),
    "interleaved-1f1b": ("train.pipeline_schedule=interleaved-1f1b", "train.virtual_stages=2"),
    "zb-v": ("train.pipeline_schedule=zb-v", "train.virtual_stages=2"),
}


@pytest.mark.parametrize("remat", ["minimal", "comms"])
@pytest.mark.parametrize("schedule", list(STEPWISE))
def test_a_backward_tick_offloads_its_own(schedule, remat):
    """The stepwise tables recompute a stage inside its backward tick: the host holds one
    tick's saved values (L / (S V) layers'), written and read back within the tick; the
    device total stays what it is without the offload, the host total grows by them."""
    overrides = (*STEPWISE[schedule], f"model.remat={remat}")
    kept = _plan(*overrides, mesh=PIPELINED)
    offloaded = _plan(OFFLOAD, *overrides, mesh=PIPELINED)
    cfg = make_tiny_cfg(*ACTIVE, *overrides, mesh=PIPELINED)
    per_tick = cfg.model.layers // (cfg.mesh.pipeline * cfg.train.virtual_stages)
    host = per_tick * saved_per_layer(cfg, remat)
    acts = offloaded["activations_breakdown"]
    assert (acts["host"], acts["host_why"]) == (host, "")
    assert acts["saved_on_device"] == acts["saved"] == kept["activations_breakdown"]["saved"]
    b, k = offloaded["bytes_per_device"], kept["bytes_per_device"]
    assert b["device_total"] == k["device_total"]
    assert b["host_total"] - k["host_total"] == host
    assert "in host memory (one backward tick's" in format_plan(offloaded)


@pytest.mark.parametrize(
    ("overrides", "device", "mesh", "why"),
    [
        (["model.remat=minimal"], "cpu", FLAT, "cpu"),
        (["model.remat=minimal"], "a100-80gb", FLAT, "a100-80gb"),
        (["train.skip_bubbles=true"], "tpu-v5p", PIPELINED, "XLA:TPU rejects"),
        (["model.remat=full"], "tpu-v5p", FLAT, "remat full"),
    ],
    ids=["cpu", "gpu", "skip-bubbles", "full"],
)
def test_no_credit_where_the_program_keeps_them(overrides, device, mesh, why):
    """No credit where the backend keeps the saved values on the device (XLA:CPU drops the
    placement; no XLA:GPU program is read), where XLA:TPU rejects the program (gpipe
    skipping its bubbles: `jaxpod compile --target` refuses it) or where nothing
    offloadable is saved (remat full): the plan is the plan without the offload, and says
    why."""
    kept = _plan(*overrides, device=device, mesh=mesh)
    offloaded = _plan(OFFLOAD, *overrides, device=device, mesh=mesh)
    assert offloaded["bytes_per_device"] == kept["bytes_per_device"]
    assert offloaded["activations_breakdown"]["host"] == 0
    assert why in offloaded["activations_breakdown"]["host_why"]
    assert "not offloaded" in format_plan(offloaded)
