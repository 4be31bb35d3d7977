# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 · Memory planning: where every byte of a pod mapping lives
#
# `jaxpod plan` is analytic and instant: from a config it computes, per device, the bytes of
# weights, gradients, optimizer state and activations, which of them stay on the device and which
# live in host (IPU *streaming*) memory, and whether the mapping fits the device profile. This
# notebook draws those numbers for the reference mappings (section 1), shows what replicated
# tensor sharding (RTS), phases and finer gathers change (section 2), and runs a tiny GPT whose
# layer weights rest in host memory, with the measured bytes by memory kind and a trace of what
# XLA executes on CPU (section 3).
#
# The planner credits only what the compiled step does (`tests/planner/test_transfers.py` finds
# each transfer in the lowered program); `jaxpod compile` prints XLA's bytes beside the
# planner's for the compiling backend, and `docs/memory.md` has its accuracy on a held-out set.

# %%
import os

import jaxpod  # imports no jax until an entry point needs it (docs/api.md)

jaxpod.use_virtual_cpu_devices(8)  # before importing jax: 8 devices, jaxpod's XLA flags
os.environ["JAX_PLATFORMS"] = "cpu"

import sys
from pathlib import Path

ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
sys.path.insert(0, str(ROOT))

import matplotlib.pyplot as plt
import numpy as np

from jaxpod import format_plan, load_config, plan
from jaxpod.planner.report import format_bytes

CONFIGS = ROOT / "configs"

# %% [markdown]
# ## 1 · The reference mappings
#
# Four presets, all planned against the `ipu-gc200` profile (900 MB of in-processor memory and
# 64 GB of streaming memory per IPU):
#
# | preset | model | mesh (replica × pipeline × tensor) |
# |---|---|---|
# | `bert_large_pod16` | BERT-Large, seq 128, RTS 4, LAMB state resting in streaming memory | 4 × 4 × 1 |
# | `bert_large_pod16_pipeline8` | BERT-Large, seq 512, RTS 2, everything on chip | 2 × 8 × 1 |
# | `gpt3_175b_pod256` | GPT-3 175B, RTS 4, layers and LAMB state resting in streaming memory | 4 × 8 × 8 |
# | `efficientnet_b4_g16_pod16` | EfficientNet-B4 G16, 380², FP16 + LARS | 8 × 2 × 1 |
#
# (and the POD64, POD128 and POD256 versions of the EfficientNet preset). The device total is the
# resident state (weights, optimizer, RTS-gathered copy, batch) plus the larger of two peaks: the
# backward pass (gradients + activations) or the optimizer update (the update's working set and
# the gradients it reads). The bars stack the resident parts and the parts of whichever peak is
# larger (`jaxpod.figures.memory`, the chart `jaxpod plan --chart` draws). On the left, the
# TPU presets: each plan for its `tpu-*` profile, and hatched beside it XLA:TPU's compiled HBM
# per chip of the same step (`jaxpod compile PRESET --target SLICE --json`, cached in
# `docs/figures/data/compiled_tpu.json`: full-size presets take minutes to compile). On the
# right, the GC200 presets, the planner's alone: no XLA backend compiles for an IPU. Below the
# chart, the host (streaming) memory each GC200 plan uses.

# %%
from jaxpod.figures.build import presets_figure
from jaxpod.figures.data import PRESETS
from jaxpod.figures.memory import draw_bytes


def bars(ax, plans, title):  # the planner's stack, and the bytes in host memory beside it
    host = {name: p["bytes_per_device"]["host_total"] for name, p in plans.items()}
    draw_bytes(ax, plans, host, "host / streaming memory", title)


def table(plans, *parts):  # one line per plan: the named entries of its bytes_per_device
    for name, p in plans.items():
        b = p["bytes_per_device"]
        cols = "  ".join(f"{part} {format_bytes(b[part]):>9}" for part in parts)
        print(f"{name.replace(chr(10), ' '):<20} {cols}")


presets_figure()
plt.show()
plans = {name: plan(load_config(CONFIGS / f"{name}.yaml")) for name in PRESETS}
for name, p in plans.items():
    b = p["bytes_per_device"]
    print(f"{name:<28} params {p['params'] / 1e6:>10,.1f} M  "
          f"1/{round(1 / p['weight_fraction_per_device'])} per device  "
          f"device {format_bytes(b['device_total']):>9}  host {format_bytes(b['host_total']):>9}"
          f"  fits {p['fits']}")

# %% [markdown]
# The planner says the two BERT-Large mappings fit: on 4 stages with RTS 4 and the float32 LAMB
# moments resting in streaming memory (moved to the device whole for the update), on 8 stages
# with RTS 2 and everything on chip. The EfficientNet-B4 presets run 1F1B (a stage holds at most
# 2 micro-batches' inputs) and fit; POD16 feeds its batch of 768 uint8 images (333 MB) in 8 parts
# (`train.batch_parts`), so a device holds 96 of them and the summed gradients. **The planner
# says GPT-3 does not fit a GC200** (`ipu-gc200` profile): it counts a stage's host-resident
# layers on the device for the whole step, as the CPU program holds them (it fetches no piece
# of them), and the LAMB state moved to the device whole for the update, as the TPU/GPU
# program does (docs/memory.md, "Which program the planner counts"). The planner's full table
# for the GPT-3 preset:

# %%
print(format_plan(plans["gpt3_175b_pod256"]))

# %% [markdown]
# Why, in the planner's terms: a device stores 1/256 of the model's float16 weights (699.84 M
# parameters, 1.40 GB), and the planner counts all of them (plus their gradients) on the device
# because the CPU lowering fetches no piece of them (the TPU/GPU lowering fetches them phase by
# phase, uncredited: docs/memory.md, "Which program the planner counts"); it counts the float32
# LAMB state (5.6 GB) moved in whole for the update. What the gathers do earn: at tensor 8 one layer's
# weights are `12·d²/8 × 2 B ≈ 453 MB` once all-gathered over the RTS group, so the preset runs
# each layer matrix by matrix (`memory.stream=matrix`, the MLP in `memory.mlp_panels=8` panels)
# and gathers one panel at a time, and uses the token table in 16 slices of rows, one at a time
# (`memory.vocab_slices=16`). Fitting a GC200 would take the pod's phased execution (one
# phase's weights on the device at a time) and an update streamed layer by layer (neither is
# credited: the CPU program has no transfer inside the step, and jaxpod has no streamed
# update). On the planner's `h100-80gb` profile the same mapping fits:

# %%
for device in ("ipu-gc200", "tpu-v5e", "h100-80gb"):
    p = plan(load_config(CONFIGS / "gpt3_175b_pod256.yaml", [f"memory.device={device}"]))
    print(f"{device:<10} device total {format_bytes(p['bytes_per_device']['device_total'])} "
          f"of {format_bytes(p['device_memory_bytes'])}: fits {p['fits']}")

# %% [markdown]
# ## 2 · What RTS and phases change
#
# **Replicated tensor sharding** (`memory.rts = k`) splits each stage's weights over `k` replicas
# and all-gathers them just before use; `memory.rts_optimizer` splits the optimizer state the same
# way (it is only touched by the update, so it never needs gathering). Below: BERT-Large on 4
# stages × 4 replicas with everything on the device. The weights and LAMB state shrink by `k`,
# but the gathered working copy of the stage's weights is added back while it runs.
#
# **Phases** (`memory.phases = K`, with `memory.offload=[params]`) run the stage's layers as `K`
# scans. The CPU lowering has no transfer inside the step (XLA:CPU reads the host-resident
# stack in place), so the planner counts the stack whole and gives every `K` the same bytes
# (the TPU/GPU lowering fetches phase by phase, uncredited). Below: GPT-3 175B on its POD256 mesh,
# layer by layer, for every divisor `K` of its 12 layers per stage: the bars are equal.

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
bert = CONFIGS / "bert_large_pod16.yaml"
rts_plans = {
    f"rts {k}\nrts_opt {k}": plan(load_config(bert, [
        "memory.offload=[]", f"memory.rts={k}", f"memory.rts_optimizer={k}"]))
    for k in (1, 2, 4)
}
rts_plans["rts 1\nrts_opt 4"] = plan(load_config(bert, [
    "memory.offload=[]", "memory.rts=1", "memory.rts_optimizer=4"]))
bars(axes[0], rts_plans, "BERT-Large p4 x r4, nothing offloaded: RTS")
gpt3 = CONFIGS / "gpt3_175b_pod256.yaml"
LAYER_BY_LAYER = ["memory.stream=layer", "memory.mlp_panels=1"]
phase_plans = {
    f"K={k}": plan(load_config(gpt3, [f"memory.phases={k}", *LAYER_BY_LAYER]))
    for k in (1, 2, 3, 4, 6, 12)
}
bars(axes[1], phase_plans, "GPT-3 175B p8 x t8 x r4: phases")
plt.tight_layout()
table({**rts_plans, **phase_plans}, "weights", "optimizer", "gathered", "device_total",
      "host_total")

# %% [markdown]
# With nothing offloaded, the planner counts 1.57 GB for BERT-Large on 4 stages; `rts 4` brings
# it to 510 MB: the weights, the optimizer state and the gradients (reduce-scattered layer by
# layer as the backward pass leaves them) all shrink by 4, and only the all-gathered working copy
# of one layer and the embeddings is paid back. `rts_optimizer` alone shrinks only the LAMB state.
# For GPT-3, the phases change no byte the planner counts (it counts the stack whole on the
# device, as the CPU program holds it).
#
# **Gathering finer than a layer** (`memory.stream=matrix`): with RTS, each layer runs as steps
# of one weight matrix each — queries, keys, values, `W_o`, and the MLP in `memory.mlp_panels`
# panels of hidden units — and a step all-gathers only its panel (cut from the local shard
# before the gather; its gradient reduce-scattered as the step's backward pass produces it,
# `tests/planner/test_transfers.py` finds the panel-sized gathers). The price: the backward
# pass recomputes the layer's forward once more, and `k` MLP panels move the MLP's activations
# over the tensor axis `k` times. Past 8 panels nothing changes: `W_o` and a third of `W_qkv`
# are as large as an MLP panel. The last unit is the token table's (`memory.vocab_slices`,
# right): gathered whole, or one slice of rows at a time.

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
stream_plans = {"layer": plan(load_config(gpt3, ["memory.stream=layer", "memory.mlp_panels=1"]))}
for k in (1, 2, 4, 8):
    stream_plans[f"matrix\nmlp_panels {k}"] = plan(load_config(gpt3, [f"memory.mlp_panels={k}"]))
bars(axes[0], stream_plans, "GPT-3 175B p8 x t8 x r4: streaming unit")
vocab_plans = {
    f"vocab_slices {k}": plan(load_config(gpt3, [f"memory.vocab_slices={k}"])) for k in (1, 4, 16)
}
bars(axes[1], vocab_plans, "GPT-3 175B: the token table's unit")
plt.tight_layout()
table({**stream_plans, **vocab_plans}, "weights", "grads", "gathered", "activations",
      "device_total")

# %% [markdown]
# ## 3 · An offloaded run: bytes by memory kind, and the trace
#
# A tiny GPT (4 layers, d 64, the `tiny.yaml` preset) on 2 × 2 × 2 = 8 virtual devices, with its
# weights resting in host memory (`memory.offload=[params]`, JAX's `pinned_host` memory kind) and each
# stage's 2 layers run in `memory.phases=2` phases. `jaxpod.run.mapping.bytes_per_device`
# measures the live arrays of the state by memory kind on every device; XLA reports the
# temporary bytes of the compiled step.

# %%
import time

import jax

from jaxpod.engine import build_engine
from jaxpod.parallel import offload
from jaxpod.run.mapping import bytes_per_device, most_on_one_device

TINY = CONFIGS / "tiny.yaml"
OVERRIDES = ["train.grad_accum=2", "model.remat=full"]
OFFLOADED = ["memory.phases=2", "memory.offload=[params]"]

t0 = time.perf_counter()
cfg_plain = load_config(TINY, OVERRIDES)
cfg = load_config(TINY, OVERRIDES + OFFLOADED)
mesh = jaxpod.mesh_for(cfg)
_, state_plain = build_engine(cfg_plain, mesh)
engine, state = build_engine(cfg, mesh)


def tokens(step):
    rng = np.random.default_rng(step)
    batch = rng.integers(0, 256, (cfg.global_batch, cfg.model.seq_len + 1), np.int32)
    return jax.device_put((batch,), engine.batch_sharding)


lowered = engine.train_step.lower(state, tokens(0))
compiled = lowered.compile()
print(f"built and compiled in {time.perf_counter() - t0:.1f} s")
held = {"plain": bytes_per_device(state_plain), "offload params, phases 2":
        bytes_per_device(state)}
for name, per_device in held.items():
    print(f"{name:<26} device 0: {per_device[0]}")
print(f"XLA temp bytes of the offloaded step: {compiled.memory_analysis().temp_size_in_bytes:,}")

# %%
fig, ax = plt.subplots(figsize=(8, 3.2))
devices = sorted(held["plain"])
for j, (name, per_device) in enumerate(held.items()):
    x = np.arange(len(devices)) + (j - 0.5) * 0.38
    dev = [per_device[d].get(offload.DEVICE, 0) / 1e3 for d in devices]
    host = [per_device[d].get(offload.HOST, 0) / 1e3 for d in devices]
    ax.bar(x, dev, 0.36, color=f"C{j}", label=f"{name}: device")
    ax.bar(x, host, 0.36, bottom=dev, color=f"C{j}", alpha=0.35, hatch="//",
           label=f"{name}: pinned_host")
ax.set_xticks(np.arange(len(devices)), [f"dev {d}" for d in devices])
ax.set(ylabel="KB of live state", title="measured: live state per device by memory kind")
ax.legend(fontsize=7)
plt.tight_layout()

# %% [markdown]
# The offloaded run's weights moved, byte for byte, from `device` to `pinned_host`; the optimizer
# state (AdamW moments) stayed on the device. Now a trace of two training steps with
# `jax.profiler`, read back with `jax.profiler.ProfileData`. Be clear about what it shows: on the
# CPU backend "device" and "pinned_host" are both host RAM, every virtual device's program runs
# on a shared thread pool, and the CPU lowering drops the transfers of host weights inside
# the step (jax lowers them for TPU and GPU only): XLA reads the host weights in place. The phase structure is in the program (K scans, each
# phase a checkpoint that does not save its fetched weights) but per-phase streaming is not what
# this backend executes. The timeline colours the XLA operations on each thread: data movement
# (copies, slices, dynamic-update-slices), collectives (all-reduce, collective-permute, …) and
# waiting at collective rendezvous, and compute.

# %%
import tempfile

from jax.profiler import ProfileData

state, _ = engine.train_step(state, tokens(0))  # warm up: the traced steps are steady state
jax.block_until_ready(state)
trace_dir = tempfile.mkdtemp(prefix="jaxpod-trace-")
jax.profiler.start_trace(trace_dir)
for step in (1, 2):
    state, metrics = engine.train_step(state, tokens(step))
jax.block_until_ready(metrics)
jax.profiler.stop_trace()
xplane = sorted(Path(trace_dir).rglob("*.xplane.pb"))[-1]
profile = ProfileData.from_file(str(xplane))

RUNTIME = ("Rendezvous", "InvokeRendezvous", "Wait", "Threadpool", "ThunkExecutor", "$",
           "end:", "Common", "Handle", "Allocate", "PjRt", "Execute")
KINDS = {
    "data movement": ("copy", "slice", "dynamic-update-slice", "transpose", "bitcast"),
    "collective": ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
                   "all-to-all", "ppermute"),
}


def kind(name):
    if name.startswith(("Rendezvous", "Wait for rendezvous")):
        return "rendezvous wait"
    for k, keys in KINDS.items():
        if any(key in name for key in keys):
            return k
    return "compute"


rows = []
for plane in profile.planes:
    for line in plane.lines:
        if not line.name.startswith(("tf_XLA",)):
            continue
        events = [(e.name, e.start_ns, e.duration_ns) for e in line.events]
        events = [e for e in events
                  if e[0].startswith("Rendezvous") or not e[0].startswith(RUNTIME)]
        if events:
            rows.append(events)
t_min = min(e[1] for row in rows for e in row)
colors = {"compute": "C0", "data movement": "C1", "collective": "C2", "rendezvous wait": "C7"}
totals = dict.fromkeys(colors, 0.0)
fig, ax = plt.subplots(figsize=(12, 3.8))
for i, row in enumerate(rows):  # one broken_barh per thread and kind: thousands of ops
    spans = {k: [] for k in colors}
    for name, start, dur in row:
        k = kind(name)
        totals[k] += dur
        spans[k].append(((start - t_min) / 1e6, max(dur, 1e3) / 1e6))
    for k, xranges in spans.items():
        ax.broken_barh(xranges, (i - 0.4, 0.8), color=colors[k])
for k, c in colors.items():
    ax.bar(0, 0, color=c, label=k)
ax.set(xlabel="ms since the first traced op", ylabel="XLA thread",
       title="two traced train steps of the offloaded tiny GPT (8 virtual CPU devices)")
ax.legend(fontsize=8, loc="upper right")
plt.tight_layout()
busy = sum(totals.values())
print("share of traced op time:", {k: f"{v / busy:.0%}" for k, v in totals.items()})

# %% [markdown]
# Where the state lives is visible in the lowered step: the state arguments carry their memory
# kinds, and the results' `annotate_device_placement`s return the new weights to `pinned_host`
# and the rest to the device. On CPU there is no placement inside the step (no transfer); the
# same step lowered for TPU (`lowering_platforms`, read, not compiled) fetches the weights
# phase by phase inside it. The compiled step's temporaries hold the weights read in place,
# the activations and the gradients:

# %%
def count(placed, kind):
    """How many of the (memory kind, type) `placed` go to `kind`."""
    return sum(n for (k, _), n in placed.items() if k == kind)


lowered_tpu = engine.train_step.trace(state, tokens(0)).lower(lowering_platforms=("tpu",))
for platform, text in [("cpu", lowered.as_text()), ("tpu", lowered_tpu.as_text())]:
    transfers, results = offload.placements(text)  # inside the step; on the returned state
    print(f"{platform}: inside the step {count(transfers, 'device')} to device, "
          f"{count(transfers, 'pinned_host')} to host; results {count(results, 'device')} "
          f"to device, {count(results, 'pinned_host')} to host")
mem = compiled.memory_analysis()
print(f"compiled step, per device: arguments {mem.argument_size_in_bytes:,} B, "
      f"temporaries {mem.temp_size_in_bytes:,} B, host arguments "
      f"{getattr(mem, 'host_argument_size_in_bytes', 'n/a')}")
p = plan(cfg)
measured = most_on_one_device(state) + mem.temp_size_in_bytes
print(f"planner for the same config: device {p['bytes_per_device']['device_total']:,} B, "
      f"host {p['bytes_per_device']['host_total']:,} B;  measured device-resident state + "
      f"XLA temporaries {measured:,} B")
