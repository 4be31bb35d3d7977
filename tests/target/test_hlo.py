"""What an optimized HLO module says per chip (`jaxpod.target.hlo`): collectives, host<->device
transfers, their overlap with compute, and how often each runs.

The unit tests read small modules made of lines XLA:TPU wrote for jaxpod's train step
(trimmed: fewer operands, shorter metadata); the `slow` ones compile the tiny preset's step
for a TPU v5p 2x2x2 slice (libtpu, no TPU attached) and check the counts against what the
config and the abstract state say they must be.
"""

# ruff: noqa: E501  (the HLO lines are XLA's, kept whole)

from __future__ import annotations

import math
import re

import pytest

from jaxpod.target.hlo import async_overlap, collectives, shape_bytes, transfers
from jaxpod.target.hlo_runs import runs, trip_count
from jaxpod.target.hlo_text import memory_space, parse, split_tuple

F32, BF16 = 4, 2
ACTIVATION = 2 * 64 * 64 * F32  # f32[2,64,64]: one micro-batch's rows on a chip

# A pipeline tick loop as XLA:TPU writes it: no known_trip_count; a counter from copy(0)
# while < 5, stepped by 1; in the body the stage-to-stage send (an async pair) and a
# tensor-axis all-reduce; after the loop a combined (tuple) all-reduce and an all-gather.
# Computations holding nothing counted (the reductions' `to_apply`) are left out here.
LOOP = """\
HloModule jit_train_step, is_scheduled=true, entry_computation_layout={(f32[2,64,64]{2,1,0:T(8,128)})->f32[2,64,64]{2,1,0:T(8,128)}}

%fused_computation.83.clone.1 (param_0.1: f32[2,64,64]) -> f32[2,64,64] {
  %param_0.1 = f32[2,64,64]{2,1,0:T(8,128)} parameter(0)
  ROOT %negate.1 = f32[2,64,64]{2,1,0:T(8,128)} negate(%param_0.1)
}

%wide.region_13.13_spmd (wide.param.3: (s32[], f32[2,64,64])) -> pred[] {
  %constant.668.clone.1 = s32[]{:T(128)} constant(5), metadata={op_name="jit(train_step)/shard_map" stack_frame_id=188}
  %wide.param.3 = (s32[]{:T(128)}, f32[2,64,64]{2,1,0:T(8,128)}) parameter(0)
  %get-tuple-element.4510 = s32[]{:T(128)} get-tuple-element(%wide.param.3), index=0
  ROOT %lt.132 = pred[]{:T(512)} compare(%get-tuple-element.4510, %constant.668.clone.1), direction=LT, metadata={op_name="jit(train_step)/shard_map/jvp()/while/cond/lt" stack_frame_id=319}
}

%wide.region_4.12_spmd.sunk (wide.param.4: (s32[], f32[2,64,64])) -> (s32[], f32[2,64,64]) {
  %constant.734.clone..sunk = s32[]{:T(128)} constant(1)
  %wide.param.4 = (s32[]{:T(128)}, f32[2,64,64]{2,1,0:T(8,128)}) parameter(0)
  %get-tuple-element.5479 = s32[]{:T(128)} get-tuple-element(%wide.param.4), index=0
  %get-tuple-element.5187 = f32[2,64,64]{2,1,0:T(8,128)} get-tuple-element(%wide.param.4), index=1
  %add.1397 = s32[]{:T(128)} add(%get-tuple-element.5479, %constant.734.clone..sunk), metadata={op_name="jit(train_step)/shard_map/while/body/add" stack_frame_id=337}
  %collective-permute-start.1 = (f32[2,64,64]{2,1,0:T(8,128)S(1)}, f32[2,64,64]{2,1,0:T(8,128)}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%get-tuple-element.5187), channel_id=1, source_target_pairs={{0,2},{1,3},{4,6},{5,7}}, metadata={op_name="jit(train_step)/shard_map/jvp()/while/body/closed_call/ppermute" stack_frame_id=480}, backend_config={"flag_configs":[],"barrier_config":{"barrier_type":"CUSTOM","id":"5"},"scoped_memory_configs":[],"used_scoped_memory_configs":[]}
  %fusion.463 = f32[2,64,64]{2,1,0:T(8,128)} fusion(%get-tuple-element.5187), kind=kOutput, calls=%fused_computation.83.clone.1, metadata={op_name="jit(train_step)/shard_map/jvp()/while/body/closed_call/while/body/closed_call/dot_general" stack_frame_id=456}
  %collective-permute-done.1 = f32[2,64,64]{2,1,0:T(8,128)} collective-permute-done(%collective-permute-start.1), metadata={op_name="jit(train_step)/shard_map/jvp()/while/body/closed_call/ppermute" stack_frame_id=480}
  %psum_invariant.220 = f32[2,64,64]{2,1,0:T(8,128)} all-reduce(%fusion.463), channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, use_global_device_ids=true, to_apply=%region_0.1, metadata={op_name="jit(train_step)/shard_map/jvp()/while/body/closed_call/while/body/closed_call/psum_invariant" stack_frame_id=511}
  ROOT %tuple.388 = (s32[]{:T(128)}, f32[2,64,64]{2,1,0:T(8,128)}) tuple(%add.1397, %psum_invariant.220)
}

ENTRY %main.128_spmd (param.33: f32[2,64,64], param.34: f32[256,64], param.35: f32[64], param.36: f32[64,64]) -> (f32[2,64,64], f32[512,64], (f32[64], f32[64,64])) {
  %param.33 = f32[2,64,64]{2,1,0:T(8,128)} parameter(0), sharding={replicated}
  %param.34 = f32[256,64]{0,1:T(8,128)} parameter(1), sharding={replicated}
  %param.35 = f32[64]{0:T(128)} parameter(2), sharding={replicated}
  %param.36 = f32[64,64]{1,0:T(8,128)} parameter(3), sharding={replicated}
  %constant.737.clone = s32[]{:T(128)} constant(0)
  %copy.356 = s32[]{:T(128)} copy(%constant.737.clone), backend_config={"flag_configs":[],"scoped_memory_configs":[],"used_scoped_memory_configs":[],"aliasing_operands":{"lists":[]}}
  %tuple.412 = (s32[]{:T(128)}, f32[2,64,64]{2,1,0:T(8,128)}) tuple(%copy.356, %param.33)
  %while.290 = (s32[]{:T(128)}, f32[2,64,64]{2,1,0:T(8,128)}) while(%tuple.412), condition=%wide.region_13.13_spmd, body=%wide.region_4.12_spmd.sunk, metadata={op_name="jit(train_step)/shard_map/jvp()/while/body/closed_call/while" stack_frame_id=313}
  %get-tuple-element.1 = f32[2,64,64]{2,1,0:T(8,128)} get-tuple-element(%while.290), index=1
  %all_gather.3 = f32[512,64]{0,1:T(8,128)} all-gather(%param.34), channel_id=1, replica_groups={{0,2},{1,3},{4,6},{5,7}}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(train_step)/shard_map/transpose(jvp())/all_gather" stack_frame_id=537}
  %all-reduce.64 = (f32[64]{0:T(128)}, f32[64,64]{1,0:T(8,128)}) all-reduce(%param.35, %param.36), channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}, use_global_device_ids=true, to_apply=%region_0.1, metadata={op_name="jit(train_step)/shard_map/psum_invariant" stack_frame_id=541}
  ROOT %tuple.1 = (f32[2,64,64]{2,1,0:T(8,128)}, f32[512,64]{0,1:T(8,128)}, (f32[64]{0:T(128)}, f32[64,64]{1,0:T(8,128)})) tuple(%get-tuple-element.1, %all_gather.3, %all-reduce.64)
}
"""

TUPLE_ALL_REDUCE = (64 + 64 * 64) * F32


def row(tally: dict[str, int]) -> tuple[int, int, int, int]:
    """`(count, bytes, executed, executed_bytes)` of one kind's tally."""
    return tally["count"], tally["bytes"], tally["executed"], tally["executed_bytes"]


def test_shapes_bytes_are_logical_unless_padded_and_tuples_split_at_the_top():
    assert shape_bytes("bf16[2,64]{1,0:T(8,128)(2,1)}") == 2 * 64 * BF16
    assert shape_bytes("bf16[2,64]{1,0:T(8,128)(2,1)}", padded=True) == 8 * 128 * BF16
    assert shape_bytes("f32[2,64]{1,0:T(2,128)S(5)}", padded=True) == 2 * 128 * F32
    # layout {2,0,1}: dims in memory [3, 2, 32]; the tile pads the minor two, 2 -> 2, 32 -> 128
    assert shape_bytes("f32[2,3,32]{2,0,1:T(2,128)}") == 2 * 3 * 32 * F32
    assert shape_bytes("f32[2,3,32]{2,0,1:T(2,128)}", padded=True) == 3 * 2 * 128 * F32
    assert shape_bytes("f32[128,64]{0,1:T(8,128)}", padded=True) == 128 * 64 * F32
    assert shape_bytes("s32[]{:T(128)}") == 4
    assert shape_bytes("s32[]{:T(128)}", padded=True) == 128 * 4  # a scalar fills a tile row
    assert shape_bytes("pred[5]{0:T(512)(128)(4,1)}", padded=True) == 512
    assert shape_bytes("(f32[2,64]{1,0:T(2,128)}, u32[]{:S(2)})") == 2 * 64 * F32 + 4
    assert shape_bytes("s4[3]") == 2 and shape_bytes("f8e4m3fn[4,4]") == 16
    shape = "(f32[2,64]{1,0:T(2,128)}, /*index=1*/(s32[], f32[3]{0}), u32[]{:S(2)})"
    assert split_tuple(shape) == ["f32[2,64]{1,0:T(2,128)}", "(s32[], f32[3]{0})", "u32[]{:S(2)}"]
    assert memory_space("f32[2,64]{1,0:T(2,128)S(5)}") == 5
    assert memory_space("f32[2,64]{1,0:T(2,128)}") == 0


def test_the_module_parses_into_computations_in_schedule_order():
    module = parse(LOOP)
    assert module.entry == "main.128_spmd"
    body = [i.opcode for i in module.computations["wide.region_4.12_spmd.sunk"].instructions]
    assert body[5:8] == ["collective-permute-start", "fusion", "collective-permute-done"]
    start = module.instructions["collective-permute-start.1"]
    assert start.operands == ("get-tuple-element.5187",)
    assert start.element(1) == "f32[2,64,64]{2,1,0:T(8,128)}"
    calls = dict(module.instructions["while.290"].calls())
    assert calls == {"condition": "wide.region_13.13_spmd", "body": "wide.region_4.12_spmd.sunk"}


def test_a_tpu_loops_trip_count_is_read_from_its_counter():
    module = parse(LOOP)
    assert trip_count(module, module.instructions["while.290"]) == 5
    counts = runs(module)
    assert counts["main.128_spmd"] == 1
    assert counts["wide.region_4.12_spmd.sunk"] == 5
    assert counts["wide.region_13.13_spmd"] == 6  # the condition runs once more
    assert counts["fused_computation.83.clone.1"] == 5


def test_collectives_count_once_and_run_trip_count_times_in_a_loop():
    found = collectives(LOOP)
    kinds = {"all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all"}
    assert set(found) == kinds
    assert row(found["collective-permute"]) == (1, ACTIVATION, 5, 5 * ACTIVATION)
    both = ACTIVATION + TUPLE_ALL_REDUCE
    assert row(found["all-reduce"]) == (2, both, 5 + 1, 5 * ACTIVATION + TUPLE_ALL_REDUCE)
    gathered = 512 * 64 * F32  # the gathered result, not the f32[256,64] operand
    assert row(found["all-gather"]) == (1, gathered, 1, gathered)
    assert row(found["reduce-scatter"]) == row(found["all-to-all"]) == (0, 0, 0, 0)


def test_a_recorded_trip_count_is_used_and_an_unknown_one_counts_once():
    recorded = LOOP.replace(
        "stack_frame_id=313}", 'stack_frame_id=313}, backend_config={"known_trip_count":{"n":"7"}}'
    )
    assert collectives(recorded)["collective-permute"]["executed"] == 7
    unknown = LOOP.replace("tuple(%copy.356, %param.33)", "tuple(%param.33, %param.33)")
    assert trip_count(parse(unknown), parse(unknown).instructions["while.290"]) is None
    assert collectives(unknown)["collective-permute"]["executed"] == 1


BRANCHES = """\
%region_92.94_spmd (p.1: f32[2,64]) -> f32[2,64] {
  %p.1 = f32[2,64]{1,0:T(2,128)} parameter(0)
  ROOT %all-reduce.61 = f32[2,64]{1,0:T(2,128)} all-reduce(%p.1), channel_id=7, replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=2,'axis_3'=2], device_ids=([2,4]T(1,0)) {'axis_2'}, use_global_device_ids=true, to_apply=%region_0.1, metadata={op_name="jit(train_step)/cond/branch_1_fun/reduce_sum" stack_frame_id=184}
}

%region_93.111_spmd (p.2: f32[2,64]) -> f32[2,64] {
  %p.2 = f32[2,64]{1,0:T(2,128)} parameter(0)
  ROOT %all-reduce.62 = f32[2,64]{1,0:T(2,128)} all-reduce(%p.2), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%region_0.1
}

ENTRY %main (param.1: s32[], param.2: f32[2,64]) -> f32[2,64] {
  %param.1 = s32[]{:T(128)} parameter(0)
  %param.2 = f32[2,64]{1,0:T(2,128)} parameter(1)
  ROOT %conditional = f32[2,64]{1,0:T(2,128)} conditional(%param.1, %param.2, %param.2), branch_computations={%region_92.94_spmd, %region_93.111_spmd}
}
"""


def test_each_branch_of_a_conditional_counts_once_per_run():
    branches = 2 * (2 * 64 * F32)
    assert row(collectives(BRANCHES)["all-reduce"]) == (2, branches, 2, branches)


# An all-gather fused with compute (libtpu's async collective fusion): the start's
# computation holds it, a continuation fusion and the done repeat it.
ASYNC_FUSION = """\
%fused_computation.504 (param_0.1763: bf16[1,1024,1024]) -> (bf16[1,1024,1024], bf16[1,1024,2048], s32[2], u32[]) {
  %param_0.1763 = bf16[1,1024,1024]{2,1,0:T(8,128)(2,1)} parameter(0)
  %all-gather.184 = bf16[1,1024,2048]{2,1,0:T(8,128)(2,1)} all-gather(%param_0.1763), channel_id=81, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={2}, use_global_device_ids=true, frontend_attributes={chain_id="2"}
  ROOT %custom-call.39 = (bf16[1,1024,1024]{2,1,0:T(8,128)(2,1)}, bf16[1,1024,2048]{2,1,0:T(8,128)(2,1)}, s32[2]{0:S(4)}, u32[]{:S(2)}) custom-call(%all-gather.184), custom_call_target="AsyncCollectiveStart"
}

%async_collective_fusion.455 (param_0.1768: bf16[1,1024,1024], param_1.1933: bf16[1,1024,2048], param_9.107: f32[2,64]) -> (f32[2,64], bf16[1,1024,1024], bf16[1,1024,2048]) {
  %param_9.107 = f32[2,64]{1,0:T(2,128)} parameter(2)
  %negate.1 = f32[2,64]{1,0:T(2,128)} negate(%param_9.107)
  %param_0.1768 = bf16[1,1024,1024]{2,1,0:T(8,128)(2,1)} parameter(0)
  %param_1.1933 = bf16[1,1024,2048]{2,1,0:T(8,128)(2,1)} parameter(1)
  %all-gather.186 = bf16[1,1024,2048]{2,1,0:T(8,128)(2,1)} all-gather(%param_0.1768), channel_id=81, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={2}, use_global_device_ids=true, frontend_attributes={chain_id="2"}
  ROOT %tuple.401 = (f32[2,64]{1,0:T(2,128)}, bf16[1,1024,1024]{2,1,0:T(8,128)(2,1)}, bf16[1,1024,2048]{2,1,0:T(8,128)(2,1)}) tuple(%negate.1, %param_0.1768, %all-gather.186)
}

%fused_computation.508 (param_0.1786: bf16[1,1024,1024], param_1.1944: bf16[1,1024,2048]) -> bf16[1,1024,2048] {
  %param_0.1786 = bf16[1,1024,1024]{2,1,0:T(8,128)(2,1)} parameter(0)
  %param_1.1944 = bf16[1,1024,2048]{2,1,0:T(8,128)(2,1)} parameter(1)
  %all-gather.192 = bf16[1,1024,2048]{2,1,0:T(8,128)(2,1)} all-gather(%param_0.1786), channel_id=81, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={2}, use_global_device_ids=true
  ROOT %custom-call.41 = bf16[1,1024,2048]{2,1,0:T(8,128)(2,1)} custom-call(%param_0.1786, %param_1.1944, %all-gather.192), custom_call_target="AsyncCollectiveDone"
}

ENTRY %main (param.1: bf16[1,1024,1024], param.2: f32[2,64]) -> bf16[1,1024,2048] {
  %param.1 = bf16[1,1024,1024]{2,1,0:T(8,128)(2,1)} parameter(0)
  %param.2 = f32[2,64]{1,0:T(2,128)} parameter(1)
  %async-collective-start.2 = (bf16[1,1024,1024]{2,1,0:T(8,128)(2,1)}, bf16[1,1024,2048]{2,1,0:T(8,128)(2,1)}, s32[2]{0:S(4)}, u32[]{:S(2)}) fusion(%param.1), kind=kCustom, output_to_operand_aliasing={{0}: (0, {})}, calls=%fused_computation.504
  %get-tuple-element.5993 = bf16[1,1024,1024]{2,1,0:T(8,128)(2,1)} get-tuple-element(%async-collective-start.2), index=0
  %get-tuple-element.5994 = bf16[1,1024,2048]{2,1,0:T(8,128)(2,1)} get-tuple-element(%async-collective-start.2), index=1
  %fusion.455 = (f32[2,64]{1,0:T(2,128)}, bf16[1,1024,1024]{2,1,0:T(8,128)(2,1)}, bf16[1,1024,2048]{2,1,0:T(8,128)(2,1)}) fusion(%get-tuple-element.5993, %get-tuple-element.5994, %param.2), kind=kOutput, calls=%async_collective_fusion.455, backend_config={"flag_configs":[],"continuation_config":{"output_tuple_original_start":"0","output_tuple_original_end":"0","operand_original_start":"10","operand_original_end":"15"}}
  %get-tuple-element.6030 = bf16[1,1024,1024]{2,1,0:T(8,128)(2,1)} get-tuple-element(%fusion.455), index=1
  %get-tuple-element.6031 = bf16[1,1024,2048]{2,1,0:T(8,128)(2,1)} get-tuple-element(%fusion.455), index=2
  ROOT %async-collective-done.2 = bf16[1,1024,2048]{2,1,0:T(8,128)(2,1)} fusion(%get-tuple-element.6030, %get-tuple-element.6031), kind=kCustom, output_to_operand_aliasing={{}: (1, {})}, calls=%fused_computation.508
}
"""

# XLA:TPU's all-reduce-scatter fusion: an all-reduce whose result the root dynamic-slices.
ALL_REDUCE_SCATTER = """\
%all-reduce-scatter.5 (input.5: bf16[512,32000]) -> bf16[128,32000] {
  %input.5 = bf16[512,32000]{1,0:T(8,128)(2,1)} parameter(0)
  %all-reduce.96 = bf16[512,32000]{1,0:T(8,128)(2,1)} all-reduce(%input.5), channel_id=5, replica_groups={{0,1,2,3}}, to_apply=%add, frontend_attributes={from-cross-replica-sharding="true"}
  %partition-id.1 = u32[] partition-id()
  %constant.128 = u32[] constant(128)
  %multiply.222 = u32[] multiply(%partition-id.1, %constant.128)
  %constant.718 = u32[] constant(0)
  ROOT %dynamic-slice.111 = bf16[128,32000]{1,0:T(8,128)(2,1)} dynamic-slice(%all-reduce.96, %multiply.222, %constant.718), dynamic_slice_sizes={128,32000}
}

ENTRY %main (param.1: bf16[512,32000]) -> bf16[128,32000] {
  %param.1 = bf16[512,32000]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %fusion.12 = bf16[128,32000]{1,0:T(8,128)(2,1)} fusion(%param.1), kind=kCustom, calls=%all-reduce-scatter.5
}
"""


def test_an_async_collective_fusion_counts_its_all_gather_once():
    gathered = 1024 * 2048 * BF16
    assert row(collectives(ASYNC_FUSION)["all-gather"]) == (1, gathered, 1, gathered)


def test_an_all_reduce_scatter_fusion_is_a_reduce_scatter_of_its_operand():
    found = collectives(ALL_REDUCE_SCATTER)
    operand = 512 * 32000 * BF16
    assert row(found["reduce-scatter"]) == (1, operand, 1, operand)
    assert found["all-reduce"]["count"] == 0


# Offloaded parameters as XLA:TPU moves them: a host-resident (S(5)) parameter fetched by an
# async copy, a VMEM (S(1)) prefetch of a device array, the new value written back to host
# (the fusions' computations left out).
OFFLOAD = """\
ENTRY %main.128_spmd (param.39: f32[2,64], param.34: f32[2,64]) -> (f32[2,64], f32[2,64]) {
  %param.39 = f32[2,64]{1,0:T(2,128)S(5)} parameter(0), sharding={devices=[2,1,4]<=[2,2,2]T(1,0,2) last_tile_dim_replicate}, metadata={op_name="state.params[\\'layers\\'][\\'ln1\\'][\\'scale\\']"}
  %param.34 = f32[2,64]{1,0:T(2,128)} parameter(1)
  %copy-start.2 = (f32[2,64]{1,0:T(2,128)}, f32[2,64]{1,0:T(2,128)S(5)}, u32[]{:S(2)}) copy-start(%param.39)
  %copy-start.9 = (f32[2,64]{1,0:T(2,128)S(1)}, f32[2,64]{1,0:T(2,128)}, u32[]{:S(2)}) copy-start(%param.34)
  %fusion.1 = f32[2,64]{1,0:T(2,128)} fusion(%param.34), kind=kLoop, calls=%fused_computation.1
  %custom-call.368 = f32[2,64]{1,0:T(2,128)S(5)} custom-call(), custom_call_target="AllocateBuffer"
  %copy-done.2 = f32[2,64]{1,0:T(2,128)} copy-done(%copy-start.2)
  %copy-done.9 = f32[2,64]{1,0:T(2,128)S(1)} copy-done(%copy-start.9)
  %add_fusion = f32[2,64]{1,0:T(2,128)} fusion(%copy-done.2, %copy-done.9), kind=kLoop, calls=%fused_computation.2
  %copy-start.46 = (f32[2,64]{1,0:T(2,128)S(5)}, f32[2,64]{1,0:T(2,128)}, u32[]{:S(2)}) copy-start(%add_fusion)
  %copy-done.46 = f32[2,64]{1,0:T(2,128)S(5)} copy-done(%copy-start.46)
  ROOT %tuple = (f32[2,64]{1,0:T(2,128)S(5)}, f32[2,64]{1,0:T(2,128)}) tuple(%copy-done.46, %fusion.1)
}
"""

ROW = 2 * 64 * F32


def test_host_copies_count_vmem_prefetches_do_not_and_overlap_counts_compute():
    """One fusion runs while the parameter comes in (the AllocateBuffer and the VMEM copy
    are not compute); the write-back is waited for at once."""
    found = transfers(OFFLOAD)
    assert row(found["to_device"]) == row(found["to_host"]) == (1, ROW, 1, ROW)
    assert async_overlap(OFFLOAD) == [
        {"name": "copy-start.2", "computation": "main.128_spmd", "bytes": ROW, "between": 1}
    ]
    assert [c["between"] for c in async_overlap(OFFLOAD, "to_host")] == [0]


# Offloaded activations (remat policy `comms`) as XLA:TPU writes them: the saved value
# written into a host buffer by an async dynamic-update-slice, then a host computation (its
# `called_computation`, left out here: a dynamic-update-slice of that buffer into the stack,
# `execution_thread="host"`) that reads the device-resident stack of saved values and
# writes it.
ACTIVATIONS = """\
ENTRY %main (param.1: f32[5,2,2,64,64], param.2: f32[1,1,2,64,64], param.3: s32[]) -> f32[5,2,2,64,64] {
  %param.1 = f32[5,2,2,64,64]{4,3,2,1,0:T(8,128)} parameter(0)
  %param.2 = f32[1,1,2,64,64]{4,3,2,1,0:T(8,128)} parameter(1)
  %param.3 = s32[]{:T(128)} parameter(2)
  %constant.644 = s32[]{:T(128)} constant(0)
  %custom-call.368 = f32[1,2,2,64,64]{4,3,2,1,0:T(8,128)S(5)} custom-call(), custom_call_target="AllocateBuffer"
  %dynamic-update-slice-start = ((f32[1,2,2,64,64]{4,3,2,1,0:T(8,128)S(5)}, f32[1,1,2,64,64]{4,3,2,1,0:T(8,128)}, s32[]{:T(128)}, s32[]{:T(128)}, s32[]{:T(128)}, /*index=5*/s32[]{:T(128)}, s32[]{:T(128)}), f32[1,2,2,64,64]{4,3,2,1,0:T(8,128)S(5)}, u32[]{:S(2)}) dynamic-update-slice-start(%custom-call.368, %param.2, %constant.644, %constant.644, %constant.644, /*index=5*/%constant.644, %constant.644)
  %dynamic-update-slice-done = f32[1,2,2,64,64]{4,3,2,1,0:T(8,128)S(5)} dynamic-update-slice-done(%dynamic-update-slice-start)
  %host-call.1.cloned.1.call-start.2 = ((f32[5,2,2,64,64]{4,3,2,1,0:T(8,128)}, f32[1,2,2,64,64]{4,3,2,1,0:T(8,128)S(5)}, s32[]{:T(128)}), f32[5,2,2,64,64]{4,3,2,1,0:T(8,128)}, u32[]{:S(2)}) custom-call-start(%param.1, %dynamic-update-slice-done, %param.3), async_execution_thread="host", custom_call_target="HostExecute", called_computations={%called_computation.clone.1}, backend_config={"flag_configs":[],"scoped_memory_configs":[],"device_type":"DEVICE_TYPE_HOST","used_scoped_memory_configs":[]}
  ROOT %host-call.1.cloned.1.call-done.2 = f32[5,2,2,64,64]{4,3,2,1,0:T(8,128)} custom-call-done(%host-call.1.cloned.1.call-start.2)
}
"""


def test_host_writes_and_a_host_computations_device_reads_and_writes_count():
    found = transfers(ACTIVATIONS)
    update, stack = 2 * 64 * 64 * F32, 5 * 2 * 2 * 64 * 64 * F32
    # to the host: the update, the stack and the s32 index the host computation reads
    assert (found["to_host"]["count"], found["to_host"]["bytes"]) == (3, update + stack + 4)
    assert (found["to_device"]["count"], found["to_device"]["bytes"]) == (1, stack)


# --- compiled programs: the tiny preset's train step for a TPU v5p 2x2x2 slice ----------------

TARGET = "tpu-v5p:2x2x2"
HOST = "pinned_host"


@pytest.fixture(scope="module")
def compile_tiny():
    """`compile_tiny(*overrides) -> (cfg, abstract state, optimized HLO text)`, each compiled
    once per module."""
    from helpers import make_tiny_cfg

    from jaxpod.inspect.compile import abstract_inputs
    from jaxpod.target.devices import target_devices, torus_mesh
    from jaxpod.target.spec import parse_target

    devices = target_devices(parse_target(TARGET))
    done = {}

    def compile_(*overrides: str):
        if overrides not in done:
            cfg = make_tiny_cfg(*overrides)
            shape = (cfg.mesh.replica, cfg.mesh.pipeline, cfg.mesh.tensor)
            engine, state, batch = abstract_inputs(cfg, torus_mesh(shape, devices))
            lowered = engine.train_step.lower(*engine.updating_arguments(state, batch))
            done[overrides] = cfg, state, lowered.compile().as_text()
        return done[overrides]

    return compile_


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_pipeline_sends_one_activation_each_way_per_tick(compile_tiny, schedule):
    """Two collective-permutes in the program (the forward's send of activations to the
    next stage, the backward's of their gradients to the previous), each run once per tick
    of its loop: GPipe's backward is its forward scan transposed, so 2 x its ticks; 1F1B's
    table holds both each tick, so 2 x its ticks too."""
    import numpy as np

    from jaxpod.parallel.schedules import make_schedule

    cfg, _, text = compile_tiny(f"train.pipeline_schedule={schedule}")
    ticks = make_schedule(schedule, cfg.mesh.pipeline, cfg.train.grad_accum).ticks
    rows = cfg.train.micro_batch * cfg.model.seq_len * cfg.model.d_model
    activation = rows * np.dtype(cfg.precision.compute).itemsize
    found = collectives(text)
    sends = row(found["collective-permute"])
    assert sends == (2, 2 * activation, 2 * ticks, 2 * ticks * activation)
    assert found["all-reduce"]["count"] > 0
    assert found["all-reduce"]["executed"] > found["all-reduce"]["count"]  # some in loops
    if schedule == "gpipe":
        assert found["all-gather"]["count"] > 0
    assert row(transfers(text)["to_device"]) == row(transfers(text)["to_host"]) == (0, 0, 0, 0)


def _per_chip(tree, kind: str | None = None) -> tuple[int, int]:
    """`(leaves, bytes per chip)` of an abstract tree's leaves in memory kind `kind` (None:
    all of them), from their shardings' shard shapes."""
    import jax

    leaves = [x for x in jax.tree.leaves(tree) if kind in (None, x.sharding.memory_kind)]
    nbytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)
    return len(leaves), nbytes


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [("memory.offload=[params,optimizer]",), ("memory.offload=[params]", "memory.phases=2")],
    ids=["params-optimizer", "params-phases2"],
)
def test_offloaded_state_moves_in_and_out_once_per_step(compile_tiny, overrides):
    """Pipelined (the tiny preset's 2x2x2 mesh): every host-resident leaf (`pinned_host`)
    comes to the device once (a stage's stack before the ticks, which the update reuses) and
    its new value goes back once, and nothing else crosses: the gradients are made and
    stay in device memory (`jaxpod.parallel.offload.value_and_grad`). All in the entry
    computation, once per step; each fetch an async copy with its done."""
    _, state, text = compile_tiny(*overrides)
    ops, moved = _per_chip(state, HOST)
    assert ops > 0
    found = transfers(text)
    assert row(found["to_device"]) == row(found["to_host"]) == (ops, moved, ops, moved)
    fetches = async_overlap(text)
    assert (len(fetches), sum(f["bytes"] for f in fetches)) == (ops, moved)
    assert {f["computation"] for f in fetches} == {parse(text).entry}


@pytest.mark.slow
def test_offloaded_activations_under_full_remat_move_nothing(compile_tiny):
    """`model.remat=full` saves no value for the backward, so there is none to offload."""
    _, _, text = compile_tiny("memory.offload=[activations]", "model.remat=full")
    assert row(transfers(text)["to_device"]) == row(transfers(text)["to_host"]) == (0, 0, 0, 0)


@pytest.mark.slow
def test_derived_trip_counts_equal_the_ones_xla_cpu_records(tiny_cfg, mesh_for):
    """XLA:CPU records each loop's trip count; read from the loop instead (as on TPU), every
    loop of the tiny step gives the same count."""
    from jaxpod.inspect.compile import abstract_inputs

    cfg = tiny_cfg()
    engine, state, batch = abstract_inputs(cfg, mesh_for(cfg))
    text = engine.train_step.lower(*engine.updating_arguments(state, batch)).compile().as_text()
    recorded, derived = parse(text), parse(re.sub(r'"known_trip_count":\{[^}]*\}', "", text))
    loops = [i.name for i in recorded.instructions.values() if i.opcode == "while"]
    assert loops
    for name in loops:
        expected = trip_count(recorded, recorded.instructions[name])
        assert expected is not None
        assert trip_count(derived, derived.instructions[name]) == expected
