"""The step-time model (`jaxpod.planner.step_time`) and `jaxpod estimate`: each term checked
against its own formula on small workloads, not against a fitted total."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers import make_tiny_cfg

from jaxpod.cli import main
from jaxpod.inspect.estimate import estimate_config, parse_estimate_target, workload_of
from jaxpod.parallel.schedule_time import lockstep_time, mpmd_time, work
from jaxpod.parallel.schedules import make_schedule
from jaxpod.planner.speed import get_speed
from jaxpod.planner.step_time import (
    LINK_EFFICIENCY,
    ROPE_PER_QK,
    Workload,
    bubble_factor,
    compute_seconds,
    data_seconds,
    estimate,
    layer_flops,
    ring_seconds,
)

A100 = get_speed("a100-80gb")
GPT = Workload(
    layers=24,
    hidden=2048,
    heads=16,
    seq=2048,
    vocab=51200,
    ffn=8192,
    global_batch=64,
    micro_batch=2,
    t=1,
    p=1,
    d=1,
)


def test_a_ring_sends_its_share_of_the_bytes():
    """All-reduce: 2(n-1)/n of the bytes at the link's bandwidth (times its efficiency), plus
    a latency per step; reduce-scatter half of that; one device: nothing."""
    nbytes, link = 8e9, 100e9
    got = ring_seconds(nbytes, 4, link, 0.0, all_reduce=True)
    assert got == pytest.approx(2 * 3 / 4 * nbytes / (link * LINK_EFFICIENCY))
    assert ring_seconds(nbytes, 4, link, 0.0, all_reduce=False) == pytest.approx(got / 2)
    assert ring_seconds(nbytes, 1, link, 1.0, all_reduce=True) == 0.0


def test_the_data_axis_crosses_the_slow_link_only_between_domains():
    """Inside one node the data ring is NVLink's; across 16 nodes of 8 the slow ring carries
    1/8 of the bytes, each node's members holding a shard of them."""
    node = dataclasses.replace(GPT, d=8)
    pod = dataclasses.replace(GPT, d=128)
    fast = ring_seconds(1e9, 8, A100.fast_link, A100.link_latency, all_reduce=True)
    assert data_seconds(1e9, node, A100, all_reduce=True) == pytest.approx(fast)
    slow = ring_seconds(1e9 / 8, 16, A100.slow_link, A100.link_latency, all_reduce=True)
    assert data_seconds(1e9, pod, A100, all_reduce=True) == pytest.approx(fast + slow)


def test_compute_follows_the_tokens_and_full_recompute_adds_a_forward():
    one = compute_seconds(GPT, A100)["matmul"]
    two = compute_seconds(dataclasses.replace(GPT, global_batch=128), A100)["matmul"]
    assert two == pytest.approx(2 * one)
    full = compute_seconds(dataclasses.replace(GPT, recompute="full"), A100)["matmul"]
    weights, attention = layer_flops(GPT)
    layers = GPT.layers * (weights + attention)
    head = 6 * GPT.hidden * GPT.vocab
    assert full / one == pytest.approx((4 * layers + head) / (3 * layers + head))


def test_rotary_positions_add_memory_bound_work_on_queries_and_keys():
    """RoPE rotates each query and key element of every token and layer once a pass (forward,
    backward's two): with grouped-query attention the keys are narrower, and the matmuls are
    unchanged."""
    w = dataclasses.replace(GPT, t=2, kv_heads=4)
    plain, rope = compute_seconds(w, A100), compute_seconds(dataclasses.replace(w, rope=True), A100)
    assert rope["matmul"] == plain["matmul"]
    tokens = GPT.global_batch * GPT.seq
    qk = GPT.hidden + GPT.hidden * 4 // GPT.heads  # queries, and 4 of 16 heads' keys
    extra = tokens * GPT.layers * ROPE_PER_QK * qk / 2 * 3 / A100.hbm_bandwidth
    assert rope["memory"] - plain["memory"] == pytest.approx(extra)


def test_a_config_with_rotary_positions_is_estimated_with_them():
    rope = make_tiny_cfg("model.positions=rope")
    assert workload_of(rope).rope and not workload_of(make_tiny_cfg()).rope


def test_the_bubble_is_the_schedules_own_table():
    """The MPMD ideal (published runs), and lockstep (jaxpod's SPMD program) with each op as
    the executor runs it: 1F1B's backward recomputes its stage (3 units), over the 3 units a
    micro-batch the matmul time counts."""
    w = dataclasses.replace(GPT, p=4, global_batch=16, micro_batch=2)  # 8 micro-batches
    table = make_schedule("1f1b", 4, 8)
    assert bubble_factor(w) == pytest.approx(mpmd_time(table) / work(table))
    spmd = dataclasses.replace(w, lockstep=True)
    assert bubble_factor(spmd) == pytest.approx(lockstep_time(table, True) / (8 * 3))
    assert bubble_factor(spmd) > bubble_factor(w) > 1.0
    gpipe = dataclasses.replace(spmd, schedule="gpipe")  # no recompute: its ticks, 3 units
    assert bubble_factor(gpipe) == pytest.approx((8 + 3) / 8)


def test_the_estimate_adds_its_parts():
    w = dataclasses.replace(GPT, t=2, p=2, d=2, global_batch=32)
    e = estimate(w, A100)
    stage = e["matmul_s"] + e["memory_s"] + e["tensor_exposed_s"] + e["pipeline_exposed_s"]
    assert e["step_s"] == pytest.approx(stage + e["bubble_s"] + e["data_exposed_s"] + e["update_s"])


def test_estimate_a_config_on_a_pod():
    """A 2x2x2 tiny config filled to 64 A100s: 16 replicas, the batch with them."""
    cfg = make_tiny_cfg("devices=64", "mesh.replica=-1", "mesh.pipeline=2", "mesh.tensor=2")
    assert parse_estimate_target("a100-80gb:64") == ("a100-80gb", 64)
    assert parse_estimate_target("tpu-v5p:4x4x4") == ("tpu-v5p", 64)
    r = estimate_config(cfg, "a100-80gb")
    assert r["mapping"] == "replica 16 x pipeline 2 x tensor 2"
    assert r["global_batch"] == 16 * cfg.train.micro_batch * cfg.train.grad_accum
    assert r["tokens_per_s"] == pytest.approx(r["global_batch"] * 64 / r["step_time_s"])
    assert 0 < r["mfu"] < 1


def test_estimate_cli(capsys, in_process_cli):
    main(
        ["estimate", "configs/tiny.yaml", "mesh.replica=-1", "--target", "h100-80gb:1024", "--json"]
    )
    out = json.loads(capsys.readouterr().out)
    assert out["mapping"] == "replica 256 x pipeline 2 x tensor 2"  # past train's 256 devices
    keys = {"step_time_s", "tokens_per_s", "model_flops_per_device_s", "mfu", "breakdown"}
    assert keys <= set(out)
    for bad in (["--target", "h100-80gb:9"], ["--target", "nope:4"]):
        with pytest.raises(SystemExit) as exit_:
            main(["estimate", "configs/tiny.yaml", *bad])
        assert exit_.value.code == 2
        assert "jaxpod: error: " in capsys.readouterr().err
