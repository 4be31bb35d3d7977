"""GPT's Llama options train like the plain single-device model: grouped-query attention
(`model.kv_heads`), the SwiGLU MLP (`model.mlp`) and rotary positions (`model.positions`),
each alone and together, on tensor (1x1x2), pipeline with tensor (1x2x2) and replicas with
tensor (2x1x2) meshes, together with sequence parallelism and chunks, and streamed a matrix
at a time over RTS: one AdamW step's loss, gradients (its first moment, 0.1 g) and
updated parameters against the plain model's, to the equivalence lab's tolerances
(tests/helpers/lab.py), each option's config its own lab.

The tiny GPT has 4 heads; with 2 KV heads on 2 tensor shards each shard holds one KV head
and its two query heads. The reference reads every query head's KV head on one device, so a
pairing of query and KV heads that holds on a shard but not on the whole layer fails here:
query head h reading KV head h mod kv_heads (right on a shard of one KV head, wrong on one
device) moves the loss by 1e-3, a thousand times the tolerance. A layout that cut one KV head
across shards does not even run: `mesh.tensor` must divide `model.kv_heads`
(tests/config/test_transformer_rules.py).
"""

from __future__ import annotations

import pytest
from helpers.lab import (
    GRAD_TOL,
    LAB_PROCESS,
    Lab,
    adam_state,
    assert_loss_close,
    assert_params_close,
    assert_trees_close,
    mesh_id,
    update_bound,
)

pytestmark = LAB_PROCESS

GQA = ("model.kv_heads=2",)
SWIGLU = ("model.mlp=swiglu",)
ROPE = ("model.positions=rope",)
LLAMA = (*GQA, *SWIGLU, *ROPE, "model.rope_base=500000")
# all three with the sequence split over tensor and attended in chunks (RoPE's positions are
# the whole sequence's), and streamed a matrix at a time over RTS 2 (GQA's W_qkv one slot of
# a KV head at a time, SwiGLU's gate and up in panels of the hidden units)
LLAMA_SP = (*LLAMA, "model.sequence_parallel=true", "model.sequence_chunks=2")
LLAMA_MATRIX = (*LLAMA, "memory.rts=2", "memory.stream=matrix", "memory.mlp_panels=2")
LLAMA_MATRIX += ("model.remat=full",)
OPTIONS = {"gqa": GQA, "swiglu": SWIGLU, "rope": ROPE, "llama": LLAMA}
OPTIONS |= {"llama-sp-chunks": LLAMA_SP, "llama-matrix-rts2": LLAMA_MATRIX}
MESHES = [(1, 1, 2), (1, 2, 2), (2, 1, 2)]
# each option alone on the tensor mesh, all of them together on every mesh
CASES = [(name, (1, 1, 2)) for name in ("gqa", "swiglu", "rope")]
CASES += [("llama", shape) for shape in MESHES]
CASES += [("llama-sp-chunks", (1, 2, 2)), ("llama-matrix-rts2", (2, 1, 2))]
_LABS: dict = {}


def option_lab(tiny_cfg, mesh_for, name: str) -> Lab:
    """The equivalence lab of the tiny GPT with option `name`'s overrides (one per process).
    The plain reference (1x1x1) leaves out the `memory.` ones: they move bytes, not math."""

    def cfg(*more: str, mesh: tuple[int, int, int]):
        plain = mesh == (1, 1, 1)
        keep = [o for o in OPTIONS[name] if not (plain and o.startswith("memory."))]
        return tiny_cfg(*keep, *more, mesh=mesh)

    if name not in _LABS:
        _LABS[name] = Lab(cfg, mesh_for)
    return _LABS[name]


@pytest.mark.parametrize(("name", "shape"), CASES, ids=[f"{n}-{mesh_id(s)}" for n, s in CASES])
def test_option_step_matches_reference(tiny_cfg, mesh_for, name, shape):
    """One AdamW `train_step` on the mesh == one plain step: loss, AdamW's moments (0.1 g
    and 0.05 g^2) and every updated parameter."""
    lab = option_lab(tiny_cfg, mesh_for, name)
    new_state, metrics = lab.steps(shape, "adamw", 1)[0]
    ref = lab.ref_steps("adamw", 1)[0]
    lr = float(lab.ref_optimizer("adamw")[1](0))
    what = f"{name} {mesh_id(shape)}"
    assert_loss_close(metrics["loss"], ref["loss"], what)
    adam, ref_adam = adam_state(new_state.opt_state), adam_state(ref["opt_state"])
    assert_trees_close(adam.mu, ref_adam.mu, GRAD_TOL, f"{what} adam mu = 0.1 g")
    assert_trees_close(adam.nu, ref_adam.nu, 2 * GRAD_TOL, f"{what} adam nu = 0.05 g^2")
    bound = update_bound("adamw", ref["grads"], lr)
    assert_params_close(new_state.params, ref["params"], ref["old_params"], bound, what)
