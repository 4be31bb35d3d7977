"""The planner: analytic reference mappings, suggestions and budgets (instant; the byte model
against XLA's compiled memory is tests/planner/test_plan_vs_xla.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT

from jaxpod.config import load_config
from jaxpod.errors import UserError
from jaxpod.models.efficientnet import flops_per_image
from jaxpod.planner.plan import (
    check_budget,
    efficientnet_stage_params,
    format_plan,
    param_layout,
    plan,
)

REQUIRED = (
    "devices replica pipeline tensor micro_batch grad_accum global_batch params "
    "weight_fraction_per_device bytes_per_device device_memory_bytes fits"
).split()
BERT_LARGE = [
    "model.name=bert",
    "model.layers=24",
    "model.d_model=1024",
    "model.heads=16",
    "model.d_ff=4096",
    "model.seq_len=512",
    "model.vocab=30528",
]
GPT3 = [
    "model.layers=96",
    "model.d_model=12288",
    "model.heads=96",
    "model.d_ff=49152",
    "model.seq_len=2048",
    "model.vocab=50304",
]
FP16_LAMB = [
    "precision.params=float16",
    "precision.compute=float16",
    "precision.master=same-as-params",
    "precision.loss_scale=dynamic",
    "optim.name=lamb",
]


def cfg_of(*overrides):
    return load_config(None, list(overrides))


# ----------------------------------------------------------------------------- analytic
@pytest.mark.parametrize(
    "preset", ["gpt3_175b_pod256", "bert_large_pod16", "efficientnet_b4_g16_pod16"]
)
def test_a_plan_imports_no_jax(preset):
    """The planner answers without starting jax (the CLI checks a budget before it does)."""
    code = (
        "import sys\n"
        "from jaxpod.config import load_config\n"
        "from jaxpod.planner import format_plan, plan\n"
        f"format_plan(plan(load_config('configs/{preset}.yaml', [])))\n"
        "bad = [m for m in ('jax', 'jaxlib', 'flax', 'optax') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_gpt3_175b_pod256_mapping():
    cfg = cfg_of(
        *GPT3,
        "devices=256",
        "mesh.pipeline=8",
        "mesh.tensor=8",
        "mesh.replica=4",
        "train.micro_batch=1",
        "train.grad_accum=16",
        "memory.device=ipu-gc200",
    )
    p = plan(cfg)
    assert abs(p["params"] - 175e9) / 175e9 < 0.01
    assert (p["devices"], p["replica"], p["pipeline"], p["tensor"]) == (256, 4, 8, 8)
    assert p["global_batch"] == 1 * 4 * 16
    assert p["weight_fraction_per_device"] == pytest.approx(1 / 64)
    assert not p["fits"]  # fp32 weights + adamw: tens of GB per device


def test_bert_large_pod16_mapping():
    cfg = cfg_of(
        *BERT_LARGE,
        "devices=16",
        "mesh.pipeline=4",
        "mesh.replica=4",
        "train.micro_batch=2",
        "train.grad_accum=8",
        "memory.device=ipu-gc200",
    )
    p = plan(cfg)
    assert abs(p["params"] - 335e6) / 335e6 < 0.02
    assert (p["devices"], p["replica"], p["pipeline"], p["tensor"]) == (16, 4, 4, 1)
    assert p["global_batch"] == 2 * 4 * 8
    assert p["weight_fraction_per_device"] == pytest.approx(1 / 4)
    assert set(REQUIRED) <= set(p)
    assert set(p["bytes_per_device"]) >= {
        "weights",
        "grads",
        "optimizer",
        "activations",
        "device_total",
        "host_total",
    }
    json.dumps(p)


def test_bert_large_pipeline8_fits_gc200_with_optimizer_state():
    """Pipeline 8 x replica 2: model and optimizer state in in-processor memory (no offload):
    FP16 weights as master (stochastic rounding), LAMB moments in FP16, micro-batch 1, GA 4,
    full recomputation."""
    cfg = cfg_of(
        *BERT_LARGE,
        *FP16_LAMB,
        "devices=16",
        "mesh.pipeline=8",
        "mesh.replica=2",
        "train.micro_batch=1",
        "train.grad_accum=4",
        "model.remat=full",
        "memory.device=ipu-gc200",
    )
    p = plan(cfg)
    b = p["bytes_per_device"]
    assert p["fits"] and not p["offload"]
    assert b["optimizer"] > 0 and b["host_total"] == 0
    assert b["device_total"] <= 900e6
    assert p["weight_fraction_per_device"] == pytest.approx(1 / 8)
    # the same model at fp32 master + adamw does not fit
    fp32 = cfg_of(
        *BERT_LARGE,
        "devices=16",
        "mesh.pipeline=8",
        "mesh.replica=2",
        "train.micro_batch=1",
        "train.grad_accum=4",
        "model.remat=full",
        "memory.device=ipu-gc200",
    )
    assert not plan(fp32)["fits"]


def test_rts_and_offload_move_bytes():
    base = [
        *BERT_LARGE,
        "devices=16",
        "mesh.pipeline=4",
        "mesh.replica=4",
        "model.remat=full",
        "memory.device=ipu-gc200",
    ]
    p1 = plan(cfg_of(*base))["bytes_per_device"]
    p4 = plan(cfg_of(*base, "memory.rts=4", "memory.rts_optimizer=4"))["bytes_per_device"]
    assert p4["weights"] == pytest.approx(p1["weights"] / 4, rel=1e-6)
    assert p4["optimizer"] == pytest.approx(p1["optimizer"] / 4, rel=1e-6)
    off = plan(cfg_of(*base, "memory.offload=[optimizer]"))["bytes_per_device"]
    # the optimizer state rests on the host, but the update moves it to the device whole
    assert off["optimizer"] == 0 and off["host_total"] == p1["optimizer"]
    assert off["peak"] == "update" and off["moved_in"] == p1["optimizer"]
    assert off["device_total"] >= off["weights"] + off["moved_in"] + off["updates"]
    # host-resident layers are on the device for the whole step (the CPU lowering fetches no
    # piece of them; its per-phase / per-matrix transfers lower to nothing): no
    # credit, whatever the phases or the stream (matrix streaming's own credit, a smaller
    # working set, is the same with the weights on the device)
    for extra in (["memory.phases=6"], ["memory.stream=matrix", "memory.mlp_panels=4"]):
        ph = plan(cfg_of(*base, "memory.offload=[params]", *extra))["bytes_per_device"]
        on = plan(cfg_of(*base, *extra))["bytes_per_device"]
        assert ph["weights"] == on["weights"] and ph["device_total"] >= on["device_total"]
        assert ph["arguments"] < on["arguments"]  # what rests on the device between steps
    # and the report says so, on the weights row
    (row,) = [
        r
        for r in format_plan(plan(cfg_of(*base, "memory.offload=[params]"))).splitlines()
        if r.startswith("weights ")
    ]
    assert "host-resident, counted on the device all step (CPU fetches no piece)" in row
    assert "host-resident" not in format_plan(plan(cfg_of(*base)))


def test_not_fitting_plan_suggests_and_budget_refuses():
    cfg = cfg_of(
        *BERT_LARGE, "devices=16", "mesh.pipeline=4", "mesh.replica=4", "memory.device_budget=900MB"
    )
    p = plan(cfg)
    assert not p["fits"] and "suggestion" in p
    with pytest.raises(UserError) as err:
        check_budget(cfg, p)
    assert "\n" not in str(err.value) and "900MB" in str(err.value)
    # nothing alone fits BERT-Large in 900 MB here: the changes are offered as lowering it
    assert p["suggestion"].startswith("no single change fits 900.00 MB; these lower")
    assert str(err.value).endswith(p["suggestion"])
    check_budget(cfg_of("memory.device_budget=16GiB"))  # the tiny default fits: no error
    text = format_plan(p)
    assert "planner, cpu: DOES NOT FIT" in text and "MB" in text


def test_efficientnet_takes_an_injected_param_count():
    cfg = cfg_of(
        "model.name=efficientnet",
        "data.name=synthetic-imagenet",
        "devices=2",
        "mesh.pipeline=2",
        "mesh.replica=1",
        "model.pipeline_splits=[4a]",
    )
    p = plan(cfg, params_override=1_234_567)
    assert p["params"] == 1_234_567  # activations come from the real stages' structure
    assert not p["activations_breakdown"]["estimated"]


def test_a_batch_in_parts_holds_one_part_and_the_summed_gradients():
    """`train.batch_parts`=k: the inputs are a k-th of the batch's, and the earlier parts'
    summed gradients (one gradient copy, in the gradients' dtype) are an argument beside them;
    nothing else changes. EfficientNet-B4 G16 on a POD16 in one call does not fit a GC200
    (the whole 333 MB batch is an argument); the planner suggests the fewest parts that fit."""
    path = ROOT / "configs" / "efficientnet_b4_g16_pod16.yaml"
    whole = plan(load_config(path, ["train.batch_parts=1"]))
    b1 = whole["bytes_per_device"]
    assert b1["inputs"] == 256 * 3 * 380 * 380 * 3 and b1["grad_sum"] == 0
    assert not whole["fits"] and "train.batch_parts=4 (894.25 MB)" in whole["suggestion"]
    parts = plan(load_config(path))  # the preset: 8 parts
    b8 = parts["bytes_per_device"]
    assert parts["fits"] and parts["batch_parts"] == 8 and parts["pipeline_group"] == 32
    assert b8["inputs"] * 8 == b1["inputs"]
    assert b8["grad_sum"] == b1["weights"] == 2 * parts["params_per_device"]  # float16 rows
    assert b8["device_total"] == b1["device_total"] - b1["inputs"] + b8["inputs"] + b8["grad_sum"]
    assert b8["arguments"] == b1["arguments"] - b1["inputs"] + b8["inputs"] + b8["grad_sum"]


PODS = [(16, 8, 256), (64, 32, 64), (128, 64, 32), (256, 128, 16)]


@pytest.mark.parametrize(("pod", "replica", "grad_accum"), PODS)
def test_efficientnet_b4_g16_pod_presets(pod, replica, grad_accum):

    cfg = load_config(ROOT / "configs" / f"efficientnet_b4_g16_pod{pod}.yaml")
    p = plan(cfg)
    stages = efficientnet_stage_params(cfg)  # exact, from the block specs
    assert p["params"] == sum(stages) == 19_325_576  # B4 G16, pinned in test_efficientnet
    assert p["params_per_device"] == max(stages)  # the split at 4a puts most weights on stage 1
    assert (p["devices"], p["replica"], p["pipeline"], p["tensor"]) == (pod, replica, 2, 1)
    assert (p["micro_batch"], p["grad_accum"], p["global_batch"]) == (3, grad_accum, 6144)
    assert p["dtype_bytes"] == {"params": 2, "compute": 2, "master": 2}  # FP16 master weights
    assert p["bytes_per_device"]["weights"] == 2 * max(stages)
    assert p["bytes_per_device"]["optimizer"] == 2 * max(stages)  # LARS momentum, float16
    assert p["flops_per_example"] == flops_per_image("b4", 380, 1000, g16=True)


def test_a_smaller_gpipe_pass_shrinks_the_carries():
    """EfficientNet-B4 G16 on a POD16 in one call and one GPipe pass (the preset runs 1F1B in
    8 parts): 256 micro-batches, 257 ticks of saved stage inputs, do not fit a GC200 (the
    planner suggests 1F1B). A smaller `train.pipeline_group` shrinks the GPipe carries (every
    tick's input and its output's cotangent, and with replicas the collected tick outputs:
    3 (M + 1) of them, plus the two slices of the tick being differentiated) by
    (3·17 + 2) / (3·257 + 2)."""

    path = ROOT / "configs" / "efficientnet_b4_g16_pod16.yaml"
    gpipe = ["train.pipeline_schedule=gpipe", "train.batch_parts=1"]
    p = plan(load_config(path, gpipe))
    assert not p["fits"] and "train.pipeline_schedule=1f1b" in p["suggestion"]
    q = plan(load_config(path, [*gpipe, "train.pipeline_group=16"]))
    assert q["pipeline_group"] == 16
    ratio = q["activations_breakdown"]["saved"] / p["activations_breakdown"]["saved"]
    assert ratio == pytest.approx(53 / 773, rel=1e-3)


def test_param_layout_matches_the_model():
    """The formula's count equals the GPT's own parameter count (no weights: eval_shape)."""
    import jax
    from helpers import model_params_and_specs

    cfg = cfg_of("model.layers=2", "model.tie_embeddings=false")
    params, _ = model_params_and_specs(cfg)
    assert param_layout(cfg)["total"] == sum(x.size for x in jax.tree.leaves(params))


@pytest.mark.parametrize("sp", [False, True])
def test_param_layout_per_device_matches_the_specs(sp):
    """Per device on pipeline 2 x tensor 4, the formula's `local` count equals what the model's
    partition specs leave on one device (with sequence parallelism the position table is split
    over tensor along T too: 3,072 of its 4,096 values leave each device)."""
    import math

    import jax
    from helpers import model_params_and_specs

    cfg = cfg_of("devices=8", "mesh.pipeline=2", "mesh.tensor=4", f"model.sequence_parallel={sp}")
    params, specs = model_params_and_specs(cfg)
    sizes = {"pipeline": 2, "tensor": 4}
    split = lambda spec: math.prod(sizes.get(a, 1) for e in spec if e for a in jax.tree.leaves(e))
    held = jax.tree.map(lambda x, s: x.size // split(s), params, specs)
    assert param_layout(cfg)["local"] == sum(jax.tree.leaves(held))
    assert jax.tree.map(lambda x, s: split(s), params["wpe"], specs["wpe"]) == (4 if sp else 1)


def test_suggestions_name_sequence_parallelism_and_chunks_with_their_bytes():
    """GPT-3 without sequence parallelism or chunks: both are suggested, each with the device
    total it would give, and each really is smaller than the plan's."""
    from jaxpod.config import load_config, parse_bytes

    path = ROOT / "configs" / "gpt3_175b_pod256.yaml"
    cfg = load_config(path, ["model.sequence_parallel=false", "model.sequence_chunks=1"])
    p = plan(cfg)
    total = p["bytes_per_device"]["device_total"]
    for knob in ("model.sequence_parallel=true", "model.sequence_chunks=8"):
        shown = p["suggestion"].split(f"{knob} (")[1].split(")")[0]
        assert parse_bytes(shown.replace(" ", "")) < total


def test_suggestion_streams_with_the_fewest_mlp_panels_that_fit():
    """GPT-3 POD256 in a device budget between the totals with 3 and 4 MLP panels: the
    suggestion is the fewest panels that fit (4), with matrix streaming turned on if it is off;
    in a budget below every total, the fewest panels with the smallest total. With the token
    table whole, the fewest table blocks that fit. Budgets come from the plan's own totals."""
    from jaxpod.config import load_config

    path = ROOT / "configs" / "gpt3_175b_pod256.yaml"

    def total(*overrides):
        return plan(load_config(path, list(overrides)))["bytes_per_device"]["device_total"]

    panels = {k: total(f"memory.mlp_panels={k}") for k in (2, 3, 4, 8, 16)}
    assert panels[2] > panels[3] > panels[4] > panels[8] == panels[16]  # 8: the RTS gather's
    between = f"memory.device_budget={(panels[3] + panels[4]) // 2}B"
    below = f"memory.device_budget={panels[8] // 2}B"
    tables = {k: total("memory.vocab_slices=" + str(k)) for k in (1, 3, 4)}
    table_budget = f"memory.device_budget={(tables[3] + tables[4]) // 2}B"
    layer = ["memory.stream=layer", "memory.mlp_panels=1", between]
    for overrides, knob, fits in (
        (layer, "memory.stream=matrix memory.mlp_panels=4", True),
        (["memory.mlp_panels=2", between], "memory.mlp_panels=4", True),
        (["memory.mlp_panels=4", below], "memory.mlp_panels=8", False),
        (["memory.vocab_slices=1", table_budget], "memory.vocab_slices=4", True),
    ):
        p = plan(load_config(path, overrides))
        # a change that fits is offered "to fit"; one that does not, as lowering the total
        shown = f"try: {knob} (" if fits else f"these lower the device total: {knob} ("
        assert not p["fits"] and shown in p["suggestion"], p["suggestion"]
        chosen = dict(item.split("=") for item in knob.split())
        trial = plan(load_config(path, [*overrides, *(f"{k}={v}" for k, v in chosen.items())]))
        assert trial["fits"] == fits


def test_virtual_devices_schedule_for_memory_unless_xla_flags_say_otherwise(monkeypatch):
    """`use_virtual_cpu_devices` replaces the device count, keeps other flags, and adds XLA's
    memory-minimising CPU scheduler unless the user chose a scheduler (GPT-3 POD256 holds
    about 2.7x the temporaries under the default concurrency scheduler)."""
    import os

    from jaxpod.platform import MEMORY_SCHEDULER, use_virtual_cpu_devices

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=3 --xla_dump_to=d")
    use_virtual_cpu_devices(16)
    flags = os.environ["XLA_FLAGS"].split()
    assert sorted(flags) == sorted(
        ["--xla_dump_to=d", "--xla_force_host_platform_device_count=16", MEMORY_SCHEDULER]
    )
    chosen = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
    monkeypatch.setenv("XLA_FLAGS", chosen)
    use_virtual_cpu_devices(4)
    assert os.environ["XLA_FLAGS"].split() == [chosen, "--xla_force_host_platform_device_count=4"]


def test_stored_bytes_follow_the_device_profile():
    """Saved activations are counted as the backend stores them: XLA:CPU (`cpu`) widens both
    16-bit dtypes in its arithmetic but keeps bfloat16 values in float32 buffers and float16 in
    float16; a pod profile stores the compute dtype (test_plan_vs_xla checks both on XLA:CPU)."""
    from jaxpod.planner.activations import activation_bytes, compute_bytes, stored_bytes
    from jaxpod.planner.profiles import get_profile

    cpu, ipu = get_profile("cpu"), get_profile("ipu-gc200")
    for dtype, on_cpu in [("float32", 4), ("float16", 2), ("bfloat16", 4)]:
        cfg = cfg_of(f"precision.compute={dtype}", "model.remat=full")
        assert compute_bytes(cfg, cpu) == 4
        assert stored_bytes(cfg, cpu) == on_cpu
        assert stored_bytes(cfg, ipu) == (4 if dtype == "float32" else 2)
    bf16 = cfg_of("precision.compute=bfloat16", "model.remat=full")
    f16 = cfg_of("precision.compute=float16", "model.remat=full")
    assert activation_bytes(bf16, cpu)["saved"] == 2 * activation_bytes(f16, cpu)["saved"]
    assert activation_bytes(bf16, ipu)["saved"] == activation_bytes(f16, ipu)["saved"]


def test_a_depthwise_efficientnet_plans_its_dense_gradient_kernel():
    """On the cpu profile a depthwise convolution's weight gradient is a dense [k, k, C, C]
    float32 kernel: the largest (5x5, 576 channels: 33,177,600 bytes) is in its stage's
    backward. G16 convolutions have none; a profile without the flag counts none."""
    import dataclasses

    from jaxpod.planner.activations import activation_bytes
    from jaxpod.planner.efficientnet import pieces
    from jaxpod.planner.profiles import get_profile

    digits = ROOT / "configs" / "efficientnet_digits.yaml"
    one = ["devices=1", "mesh.replica=1", "mesh.pipeline=1", "model.pipeline_splits=[]"]
    one += ["train.grad_accum=1"]
    depthwise = load_config(digits, [*one, "model.g16=false"])
    dense = [p.get("dense_grad", 0) for p in pieces(depthwise)[0]]
    assert max(dense) == 5 * 5 * 576 * 576 * 4
    assert not any(p.get("dense_grad", 0) for p in pieces(load_config(digits, one))[0])
    cpu = get_profile("cpu")
    plain = dataclasses.replace(cpu, dense_depthwise_grads=False)
    work = [activation_bytes(depthwise, p)["layer_work"] for p in (cpu, plain)]
    assert work[0] - work[1] == max(dense)
