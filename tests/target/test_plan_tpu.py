"""The planner's stored bytes against XLA:TPU's program (no TPU attached): with 16-bit weights
and float32 masters the state holds the masters only, on the device or, offloaded (or the
layer stack in phases), on the host; the 16-bit copy the forward casts is a temporary of the
step."""

from __future__ import annotations

import pytest
from helpers import make_tiny_cfg

pytestmark = pytest.mark.slow

MESH = (2, 2, 2)
# weights dominate (d 512, 16 tokens), 16-bit weights with float32 masters
BF16 = ["model.d_model=512", "model.d_ff=2048", "model.seq_len=16", "train.micro_batch=1"]
BF16 += ["precision.params=bfloat16", "precision.compute=bfloat16", "precision.master=float32"]
# the state's scalars the planner leaves out: the step, the optimizer's and loss scale's counts
SCALARS = 64


# each way state rests on the host: offloaded, or (the layer stack only) in phases
HOST = {"device": [], "offloaded": ["memory.offload=[params,optimizer]"]}
HOST["phases"] = ["memory.phases=2"]


@pytest.fixture(scope="module", params=list(HOST))
def case(request):
    from jaxpod.inspect.compile import compile_for_target
    from jaxpod.target.spec import parse_target

    more = HOST[request.param]
    cfg = make_tiny_cfg(*BF16, *more, mesh=MESH)
    return cfg, compile_for_target(cfg, parse_target("tpu-v5p:2x2x2"))


def test_the_state_holds_the_float32_masters_only(case):
    cfg, r = case
    planned = r["planned_device_argument_bytes"] + r.get("planned_host_bytes", 0)
    compiled = r["device_argument_bytes"] + r["host_argument_bytes"]
    assert abs(planned - compiled) <= SCALARS


def test_offloaded_masters_are_the_host_arguments(case):
    """The planner's host bytes (its credit for offload and phases) are XLA:TPU's host
    arguments, and the device keeps no more than the planner's device arguments."""
    cfg, r = case
    if not cfg.memory.offload and cfg.memory.phases == 1:
        assert r["host_argument_bytes"] == 0
        return
    assert r["host_argument_bytes"] == r["planned_host_bytes"] > 0
    assert r["device_argument_bytes"] <= SCALARS + r["planned_device_argument_bytes"]
