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
# # 02 · FP16 master weights, stochastic rounding, loss scaling and LARS
#
# The recipe that trained EfficientNet-B4 on IPU pods at global batch 6144 keeps **every weight in
# float16 — including the master copy the optimizer updates**. That halves weight and optimizer
# memory, which, in Graphcore's account of the recipe, is what lets B4 fit on 2 pipeline stages
# with the optimizer state on the device (jaxpod's planner agrees for the GC200: notebook 03).
# Three things make it work, and this notebook shows each one:
#
# 1. **Stochastic rounding** of the update, so that updates smaller than half a float16 ulp are not
#    lost (section 1–2).
# 2. **Loss scaling**, so that small gradients do not underflow in float16, with overflowing steps
#    skipped (section 3).
# 3. **LARS**, whose per-layer trust ratio `||w|| / ||g||` makes the step size of every layer
#    proportional to its weight norm — robust at large batch (section 4).
#
# Finally, the digits config trains a pipelined, G16, GroupNorm EfficientNet with all of it on 8
# virtual devices (section 5).

# %%
import os

import jaxpod  # imports no jax until an entry point needs it (docs/api.md)

jaxpod.use_virtual_cpu_devices(8)  # before importing jax: 8 devices, jaxpod's XLA flags
os.environ["JAX_PLATFORMS"] = "cpu"

import sys
from pathlib import Path

ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
sys.path.insert(0, str(ROOT))

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from jaxpod.optim.precision import stochastic_round

print(jax.__version__, jax.device_count(), "devices")

# %% [markdown]
# ## 1 · Stochastic vs round-to-nearest
#
# Between 1.0 and 2.0, float16 values are spaced `2**-10 ≈ 0.000977` apart. Take
# `x = 1 + 0.3 ulp`. Round-to-nearest always gives `1.0` (an error of 0.3 ulp, *always in the same
# direction*). Stochastic rounding gives `1 + 1 ulp` with probability 0.3 and `1.0` with
# probability 0.7: each result is further off, but the **expected value is exactly `x`**.

# %%
ulp = 2.0**-10
x = jnp.full((100_000,), 1.0 + 0.3 * ulp, jnp.float32)
nearest = x.astype(jnp.float16).astype(jnp.float32)
stoch = stochastic_round(x, jax.random.key(0), jnp.float16).astype(jnp.float32)

fig, axes = plt.subplots(1, 2, figsize=(11, 3.2))
for ax, values, title in [(axes[0], nearest, "round to nearest"), (axes[1], stoch, "stochastic")]:
    offsets = np.asarray((values - 1.0) / ulp)
    ax.hist(offsets, bins=np.arange(-0.25, 1.5, 0.5), rwidth=0.6)
    ax.axvline(0.3, color="red", ls="--", label="x = 1 + 0.3 ulp")
    ax.set(title=f"{title}: mean offset {offsets.mean():.4f} ulp", xlabel="result - 1 (ulp)")
    ax.legend()
plt.tight_layout()
print("mean error, nearest   :", float(jnp.mean(nearest - x)) / ulp, "ulp")
print("mean error, stochastic:", float(jnp.mean(stoch - x)) / ulp, "ulp")

# %% [markdown]
# Over many different values the picture is the same: round-to-nearest has errors in
# `[-0.5, 0.5]` ulp but biased for any fixed sub-ulp offset; stochastic rounding's error averages
# to zero for every value.

# %%
from jaxpod.figures.rounding import draw_errors, draw_stall, rounding_errors, stall

errors = rounding_errors(200_000, seed=1)
fig, ax = plt.subplots(figsize=(6, 3.4))
draw_errors(ax, errors)
plt.show()

# %% [markdown]
# ## 2 · Why it matters: float16 master weights stall without it
#
# A weight at 1.0 receives 1000 updates of `-1e-4` (a tenth of an ulp — a typical late-training
# step of `lr × grad`). With round-to-nearest every update is rounded away: **the weight never
# moves**. With stochastic rounding it follows the float32 trajectory on average. (These two
# figures are `jaxpod.figures.rounding`'s, the ones in `docs/figures/float16_rounding.png`.)

# %%
trajectories = stall(steps=1000, delta=-1e-4, seed=3)  # one lax.scan over the updates
fig, ax = plt.subplots(figsize=(7, 3.4))
draw_stall(ax, trajectories)
plt.show()
print({name: round(float(w[-1]), 5) for name, w in trajectories.items()})

# %% [markdown]
# ## 3 · Loss scaling and skipped steps
#
# Float16's smallest normal number is `6e-5`: many gradients are smaller, and would keep only a
# few bits as subnormals or, below about `6e-8`, become zero.
# The loss is multiplied by a **scale** before the backward pass (so are all gradients), and the
# gradients are divided by it, in float32, before the update. A **dynamic** scale doubles after
# `loss_scale_period` finite steps and halves when a gradient overflows; an overflowing step is
# **skipped**: weights and optimizer state stay bit-identical. Below, the policy's state machine
# (`jaxpod.optim.precision.update_loss_scale`, the function the train step calls) with overflows
# injected at steps 25 and 60 and a period of 10.

# %%
from jaxpod.config import PrecisionConfig
from jaxpod.optim.precision import init_loss_scale, update_loss_scale

pcfg = PrecisionConfig(
    params="float16", master="same-as-params", loss_scale="dynamic",
    loss_scale_init=1024.0, loss_scale_period=10,
)
state = init_loss_scale(pcfg)
scales, skipped = [], []
for step in range(100):
    finite = step not in (25, 60, 61)
    scales.append(float(state.scale))
    state = update_loss_scale(state, jnp.asarray(finite), pcfg)
    skipped.append(int(state.skipped))
fig, ax = plt.subplots(figsize=(8, 3.4))
ax.semilogy(scales, drawstyle="steps-post", label="loss scale")
for s in (25, 60, 61):
    ax.axvline(s, color="red", alpha=0.3)
ax.set(xlabel="step", ylabel="scale", title="dynamic loss scale (red: injected overflows)")
ax.legend()
print("skipped steps:", skipped[-1], " final scale:", scales[-1])

# %% [markdown]
# ## 4 · LARS trust ratios, layer by layer
#
# LARS scales each layer's step by `trust_coefficient × ||w|| / ||g||`: layers whose gradients are
# large relative to their weights take smaller steps. Biases and normalisation scales are masked
# out (no weight decay, no trust ratio). Here: one batch of digits through a small G16
# EfficientNet, the gradient of the mean cross-entropy, and the ratio for each conv/dense kernel.
# The network's weights are made by one jitted init, compiled as a program that runs once
# (`compile_once`, as jaxpod's engine makes its own): built eagerly, each weight's random
# init would be compiled on its own.

# %%
import optax
from flax import nnx

from jaxpod.engine.state import compile_once
from jaxpod.models.efficientnet import normalize
from jaxpod.data.images import load_images
from jaxpod.models.efficientnet import EfficientNet, count_params
from jaxpod.models.params import masks


def make_net():
    return EfficientNet("b0", g16=True, num_classes=10, width_mult=0.5, depth_mult=0.5,
                        rngs=nnx.Rngs(0))


digits = load_images("digits", image_size=32, seed=0)
images, labels = digits.train_batch(0, 0, 64, 64)
graphdef, state = nnx.split(nnx.eval_shape(make_net))  # the structure: shapes, no weights
params = compile_once(lambda: nnx.to_pure_dict(nnx.split(make_net())[1]), None)()
print(f"{count_params(params):,} parameters")


def loss_fn(p):
    logits = nnx.merge(graphdef, p)(normalize(jnp.asarray(images), jnp.float32))
    return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(labels)).mean()


grads = jax.jit(jax.grad(loss_fn))(params)
mask = masks(state).decay  # the parameters' roles: no trust ratio for biases and norms
names, ratios = [], []
for (path, w), g, m in zip(
    jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(grads), jax.tree.leaves(mask)
):
    if m:
        names.append(jax.tree_util.keystr(path).replace("['", "").replace("']", "."))
        ratios.append(float(np.linalg.norm(w) / (np.linalg.norm(g) + 1e-12)))  # on the host
plt.figure(figsize=(11, 3.6))
plt.bar(range(len(ratios)), ratios)
plt.yscale("log")
plt.xlabel("kernel (network order)")
plt.ylabel("||w|| / ||g||")
plt.title(f"LARS trust ratios of {len(ratios)} kernels (biases and norm scales masked)")
print("smallest:", names[int(np.argmin(ratios))], f"{min(ratios):.3g}")
print("largest: ", names[int(np.argmax(ratios))], f"{max(ratios):.3g}")

# %% [markdown]
# ## 5 · The digits run: the whole recipe, pipelined, on 8 devices
#
# `configs/efficientnet_digits.yaml`: EfficientNet-B0-G16 (width/depth ×0.5, GroupNorm with 4
# groups) split into 2 pipeline stages at block 4a, 4 replicas, LARS with polynomial decay,
# float16 weights *and* float16 master weights with stochastic rounding, dynamic loss scaling,
# images sent to the devices as uint8. The curves are the run record of the full run
# (`jaxpod train configs/efficientnet_digits.yaml`, its `metrics.jsonl` kept in
# `docs/results/`); the same command reproduces it exactly (seeded data, init and rounding).
# `tests/run/test_digits_training.py` runs the first 50 steps of it through the same training loop.

# %%
import json

record = ROOT / "docs" / "results" / "efficientnet_digits_metrics.jsonl"
records = [json.loads(line) for line in record.read_text().splitlines()]
train = [r for r in records if "loss" in r]
val = [r for r in records if "val_loss" in r]
fig, axes = plt.subplots(1, 3, figsize=(14, 3.4))
axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
axes[0].plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val")
axes[0].set(xlabel="step", ylabel="cross-entropy", title="loss")
axes[0].legend()
axes[1].plot([r["step"] for r in train], [r["accuracy"] for r in train], label="train batch")
axes[1].plot([r["step"] for r in val], [r["val_accuracy"] for r in val], "o-", label="val")
axes[1].set(xlabel="step", title="accuracy", ylim=(0, 1.02))
axes[1].legend()
axes[2].semilogy([r["step"] for r in train], [r["loss_scale"] for r in train],
                 drawstyle="steps-post")
axes[2].set(xlabel="step", title="dynamic loss scale")
plt.tight_layout()
print("final validation accuracy:", val[-1]["val_accuracy"], " skipped steps:",
      train[-1]["skipped_steps"])

# %% [markdown]
# The same recipe on one device (`devices=1 mesh.replica=1 mesh.pipeline=1
# model.pipeline_splits=[] train.grad_accum=8`: the same micro-batch of 8 and global batch of
# 64) learns the same way: the accuracy over steps, 8 devices against 1 (the one-device record is
# `docs/figures/data/digits_1device.json`, made by `python -m jaxpod.figures --refresh digits`;
# the 8-device one, `docs/results/efficientnet_digits_*`, was recorded at 0b8f596, 2026-11-24). The two runs part within the
# first logged steps (float16 sums in another order are other numbers) and meet again: both end
# at 97.9 % validation accuracy after 300 steps.

# %%
from jaxpod.figures.build import MissingData, digits_figure

try:
    digits_figure()
    plt.show()
except MissingData as err:
    print(err)
