"""The planner's activation terms for transformer pipeline schedules (instant, no compile):
what autodiff's backward tick scan holds, term by term, as read off XLA:CPU's buffer
assignment (`benchmarks/xla_peak.py`)."""

from __future__ import annotations

import pytest

from jaxpod.config import ModelConfig, load_config
from jaxpod.planner.activations import activation_bytes
from jaxpod.planner.counts import layer_params
from jaxpod.planner.profiles import get_profile

CPU = get_profile("cpu")  # float32 activations: 4 bytes a scalar
MB, T, D, F, V = 2, 128, 256, 1024, 256  # bench_schedules' GPT (vocab: configs/tiny.yaml)
BENCH = [f"model.d_model={D}", f"model.d_ff={F}", f"model.seq_len={T}", f"model.vocab={V}"]
BENCH += ["model.heads=4", "model.remat=full", f"train.micro_batch={MB}"]
CIRCULAR = ["train.pipeline_schedule=circular", "train.virtual_stages=2"]


def acts(*overrides, layers=8, stages=4, micro=4):
    cfg = load_config(
        None,
        [f"devices={stages}", "mesh.replica=1", f"mesh.pipeline={stages}", "mesh.tensor=1"]
        + [f"model.layers={layers}", f"train.grad_accum={micro}", *BENCH, *overrides],
    )
    return activation_bytes(cfg, CPU)


def test_circular_grows_per_micro_batch_by_what_its_backward_ticks_hold():
    """Circular with V = 2 on 4 stages, one-layer virtual stages (remat full: a layer saves
    its input): each micro-batch adds V ticks, each a saved layer input and a row of the collected
    outputs' cotangent; a row of the embedded micro-batches' cotangent; and mb·T/S tokens of
    the head's kept operands (the final LN's input, output and output's cotangent, and the
    float32 logits' cotangent): 1.57 MB per micro-batch. XLA:CPU's cells grow by 1.64 MB
    (90.8 - 64.5 MB over M = 16 to 32): its scheduler also keeps these ticks' logits to the
    end of the backward (the loss value's target logit is picked after it), 0.07 MB per
    micro-batch the planner does not count (GPipe's program picks it before)."""
    btd = MB * T * D * 4
    head = MB * T // 4 * (3 * D * 4 + V * 4)
    per_micro = 2 * (btd + btd) + btd + head
    a, b = acts(*CIRCULAR, micro=16), acts(*CIRCULAR, micro=32)
    assert a["head_kept"] + a["layer_work"] > a["head"]  # the backward's peak, not the head's
    assert b["total"] - a["total"] == 16 * per_micro
    assert per_micro / 1e6 == pytest.approx(1.57, abs=0.01)


def test_gpipe_holds_one_row_of_output_cotangent_per_tick():
    """GPipe: M + S - 1 ticks, each the stage's saved layer inputs and one cotangent row;
    plus the embedded micro-batches' cotangent and the head's kept operands per micro-batch."""
    btd = MB * T * D * 4
    per_micro = 2 * btd + btd + btd + MB * T // 4 * (3 * D * 4 + V * 4)
    assert acts(micro=32)["total"] - acts(micro=16)["total"] == 16 * per_micro


@pytest.mark.parametrize(
    "layers, extra, stack",
    [(8, [], 2), (8, CIRCULAR, 0), (16, CIRCULAR, 4), (4, [], 0)],
    ids=[
        "gpipe-2-layer-stage",
        "circular-1-layer-virtual-stages",
        "circular-2-layer-virtual-stages",
        "gpipe-1-layer-stage",
    ],
)
def test_a_layer_scan_in_the_tick_carries_the_whole_stage_gradient(layers, extra, stack):
    """With more than one layer a tick, the transposed layer scan carries the gradient of
    the stage's whole stack (the tick's layers are a dynamic slice of it): circular with
    2-layer virtual stages of a 4-layer stage holds 4 layers' gradients, one-layer ticks hold
    none."""
    sharded, replicated = layer_params(ModelConfig(d_model=D, heads=4, d_ff=F))
    assert acts(*extra, layers=layers)["tick_grads"] == stack * (sharded + replicated) * 4


def test_1f1b_does_not_grow_with_micro_batches():
    one_f = ["train.pipeline_schedule=1f1b"]
    assert acts(*one_f, micro=32)["total"] == acts(*one_f, micro=4)["total"]
    assert acts(*one_f)["head_kept"] == acts(*one_f)["tick_grads"] == 0
