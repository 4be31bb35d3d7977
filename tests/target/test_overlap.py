"""Which collectives overlap compute (`jaxpod.target.overlap`), read from small modules made of
lines XLA:TPU wrote for jaxpod's train step (trimmed: fewer operands and tuple elements,
no metadata or backend configs).
"""

# ruff: noqa: E501  (the HLO lines are XLA's, kept whole)

from __future__ import annotations

from jaxpod.target.overlap import collective_overlap

# A layer as XLA:TPU writes it under tensor parallelism: a matmul, then the tensor-axis
# all-reduce of its partial sums, synchronous; then libtpu's async collective fusion of a
# sequence-parallel all-gather, whose continuation fusion computes a matmul (a convolution)
# while the gather runs, and its done; then an all-reduce-start/-done pair with nothing
# between (waited for at once).
MODULE = """\
HloModule jit_train_step, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%fused_matmul (param_0.1: bf16[2,512,256], param_1.1: bf16[256,1024]) -> f32[2,512,1024] {
  %param_0.1 = bf16[2,512,256]{2,1,0:T(8,128)(2,1)} parameter(0)
  %param_1.1 = bf16[256,1024]{1,0:T(8,128)(2,1)} parameter(1)
  ROOT %convolution.1 = f32[2,512,1024]{2,1,0:T(8,128)} convolution(%param_0.1, %param_1.1), dim_labels=b0f_io->b0f
}

%fused_computation.401 (param_0.1338: bf16[2,128,1024]) -> (bf16[2,128,1024], bf16[2,512,1024], s32[2], u32[]) {
  %param_0.1338 = bf16[2,128,1024]{2,1,0:T(8,128)(2,1)S(1)} parameter(0)
  %all-gather.184 = bf16[2,512,1024]{2,1,0:T(8,128)(2,1)S(1)} all-gather(%param_0.1338), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={1}, use_global_device_ids=true
  ROOT %custom-call.39 = (bf16[2,128,1024]{2,1,0:T(8,128)(2,1)S(1)}, bf16[2,512,1024]{2,1,0:T(8,128)(2,1)S(1)}, s32[2]{0:S(4)}, u32[]{:S(2)}) custom-call(%all-gather.184), custom_call_target="AsyncCollectiveStart"
}

%async_collective_fusion.326 (param_0.1: bf16[2,128,1024], param_1.1: bf16[2,512,1024], param_2.1: bf16[2,512,256], param_3.1: bf16[256,1024]) -> (f32[2,512,1024], bf16[2,128,1024], bf16[2,512,1024]) {
  %param_0.1 = bf16[2,128,1024]{2,1,0:T(8,128)(2,1)S(1)} parameter(0)
  %param_1.1 = bf16[2,512,1024]{2,1,0:T(8,128)(2,1)S(1)} parameter(1)
  %param_2.1 = bf16[2,512,256]{2,1,0:T(8,128)(2,1)} parameter(2)
  %param_3.1 = bf16[256,1024]{1,0:T(8,128)(2,1)} parameter(3)
  %convolution.2 = f32[2,512,1024]{2,1,0:T(8,128)} convolution(%param_2.1, %param_3.1), dim_labels=b0f_io->b0f
  ROOT %tuple.1 = (f32[2,512,1024]{2,1,0:T(8,128)}, bf16[2,128,1024]{2,1,0:T(8,128)(2,1)S(1)}, bf16[2,512,1024]{2,1,0:T(8,128)(2,1)S(1)}) tuple(%convolution.2, %param_0.1, %param_1.1)
}

%fused_computation.405 (param_0.1786: bf16[2,128,1024], param_1.1944: bf16[2,512,1024]) -> bf16[2,512,1024] {
  %param_0.1786 = bf16[2,128,1024]{2,1,0:T(8,128)(2,1)S(1)} parameter(0)
  %param_1.1944 = bf16[2,512,1024]{2,1,0:T(8,128)(2,1)S(1)} parameter(1)
  %all-gather.192 = bf16[2,512,1024]{2,1,0:T(8,128)(2,1)S(1)} all-gather(%param_0.1786), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={1}, use_global_device_ids=true
  ROOT %custom-call.41 = bf16[2,512,1024]{2,1,0:T(8,128)(2,1)S(1)} custom-call(%param_0.1786, %param_1.1944, %all-gather.192), custom_call_target="AsyncCollectiveDone"
}

ENTRY %main (param.1: bf16[2,512,256], param.2: bf16[256,1024], param.3: bf16[2,128,1024]) -> f32[2,512,1024] {
  %param.1 = bf16[2,512,256]{2,1,0:T(8,128)(2,1)} parameter(0)
  %param.2 = bf16[256,1024]{1,0:T(8,128)(2,1)} parameter(1)
  %param.3 = bf16[2,128,1024]{2,1,0:T(8,128)(2,1)S(1)} parameter(2)
  %fusion.1 = f32[2,512,1024]{2,1,0:T(8,128)} fusion(%param.1, %param.2), kind=kOutput, calls=%fused_matmul
  %psum_invariant.234 = f32[2,512,1024]{2,1,0:T(8,128)S(1)} all-reduce(%fusion.1), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %async-collective-start = (bf16[2,128,1024]{2,1,0:T(8,128)(2,1)S(1)}, bf16[2,512,1024]{2,1,0:T(8,128)(2,1)S(1)}, s32[2]{0:S(4)}, u32[]{:S(2)}) fusion(%param.3), kind=kCustom, output_to_operand_aliasing={{0}: (0, {})}, calls=%fused_computation.401
  %get-tuple-element.2995 = bf16[2,128,1024]{2,1,0:T(8,128)(2,1)S(1)} get-tuple-element(%async-collective-start), index=0
  %get-tuple-element.2996 = bf16[2,512,1024]{2,1,0:T(8,128)(2,1)S(1)} get-tuple-element(%async-collective-start), index=1
  %fusion.326 = (f32[2,512,1024]{2,1,0:T(8,128)}, bf16[2,128,1024]{2,1,0:T(8,128)(2,1)S(1)}, bf16[2,512,1024]{2,1,0:T(8,128)(2,1)S(1)}) fusion(%get-tuple-element.2995, %get-tuple-element.2996, %param.1, %param.2), kind=kOutput, calls=%async_collective_fusion.326, backend_config={"flag_configs":[],"continuation_config":{"output_tuple_original_start":"0","output_tuple_original_end":"0","operand_original_start":"2","operand_original_end":"4"}}
  %get-tuple-element.3032 = bf16[2,128,1024]{2,1,0:T(8,128)(2,1)S(1)} get-tuple-element(%fusion.326), index=1
  %get-tuple-element.3033 = bf16[2,512,1024]{2,1,0:T(8,128)(2,1)S(1)} get-tuple-element(%fusion.326), index=2
  %async-collective-done = bf16[2,512,1024]{2,1,0:T(8,128)(2,1)S(1)} fusion(%get-tuple-element.3032, %get-tuple-element.3033), kind=kCustom, output_to_operand_aliasing={{}: (1, {})}, calls=%fused_computation.405
  %all-reduce-start.1 = f32[2,512,1024]{2,1,0:T(8,128)} all-reduce-start(%psum_invariant.234), channel_id=3, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
  %all-reduce-done.1 = f32[2,512,1024]{2,1,0:T(8,128)} all-reduce-done(%all-reduce-start.1)
  ROOT %fusion.2 = f32[2,512,1024]{2,1,0:T(8,128)} fusion(%all-reduce-done.1, %param.1, %param.2), kind=kOutput, calls=%fused_matmul
}
"""

ACTIVATION = 2 * 512 * 1024 * 4  # f32[2,512,1024]: the all-reduced partial sums
SHARD = 2 * 128 * 1024 * 2  # bf16[2,128,1024]: one chip's quarter of the sequence


def test_each_collective_once_at_its_start_with_the_matmuls_before_its_done():
    found = collective_overlap(MODULE)
    assert [(c["kind"], c["asynchronous"], c["matmuls"], c["bytes"]) for c in found] == [
        ("all-reduce", False, 0, ACTIVATION),
        ("all-gather", True, 1, SHARD),
        ("all-reduce", True, 0, ACTIVATION),
    ]
    assert {c["computation"] for c in found} == {"main"}
    assert {c["runs"] for c in found} == {1}
