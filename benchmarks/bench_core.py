"""Core-engine benchmarks: prints tables and writes JSON. Never asserts a time.

    python benchmarks/bench_core.py [--only a,b,c,d] [--repeats N] [--out FILE]

(a) step time of each 8-device mesh over the single-device step (same global batch)
(b) executed / useful FLOPs of the pipelined step (XLA cost analysis) vs (M + S - 1) / M
(c) compile time at 12 vs 48 layers (scan over layers: should barely grow)
(d) model FLOP/s of a mid-size GPT on 8 devices over this machine's f32 matmul rate

Every measurement runs in a fresh subprocess, since the virtual device count is fixed when
jax starts; ratios are only ever taken between numbers measured in the same run.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    loss_and_grads_flops,
    options,
    run_parts,
    run_worker,
    serve_worker,
    table,
    tiny_on_mesh,
    write_report,
)

TINY = ["model.layers=4", "model.d_model=64", "model.heads=4", "model.d_ff=256", "model.seq_len=64"]
MID = ["model.layers=8", "model.d_model=512", "model.heads=8", "model.d_ff=2048"]
MID += ["model.seq_len=256", "train.global_batch=16", "train.grad_accum=null"]
MESHES_8 = [(8, 1, 1), (4, 2, 1), (4, 1, 2), (2, 2, 2), (2, 1, 4), (1, 2, 4), (1, 4, 2), (2, 4, 1)]


# ----------------------------------------------------------------------------- worker side
def _worker(job: dict) -> dict:
    """Runs inside a subprocess whose XLA_FLAGS already hold the device count."""
    import jax
    import numpy as np

    from jaxpod.engine import abstract_engine, build_engine

    if job["kind"] == "matmul":
        n = job["n"]
        a = jax.device_put(np.random.default_rng(0).standard_normal((n, n), np.float32))
        f = jax.jit(lambda x: x @ x).lower(a).compile()
        f(a).block_until_ready()
        times = []
        for _ in range(job["repeats"]):
            t0 = time.perf_counter()
            f(a).block_until_ready()
            times.append(time.perf_counter() - t0)
        return {"flops_per_s": 2 * n**3 / float(np.median(times))}

    cfg, mesh = tiny_on_mesh(job["mesh"], ["optim.warmup_steps=0", *job["overrides"]])
    shape = (cfg.train.global_batch, cfg.model.seq_len + 1)
    out = {"global_batch": cfg.train.global_batch, "grad_accum": cfg.train.grad_accum}

    if job["kind"] == "flops":
        engine, state = abstract_engine(cfg, mesh, unroll=True)
        out["flops_per_device"] = loss_and_grads_flops(engine, state, shape)
        out["flops_total"] = out["flops_per_device"] * mesh.size
        return out

    t0 = time.perf_counter()
    engine, state = build_engine(cfg, mesh)
    tokens = np.random.default_rng(0).integers(0, 256, shape).astype(np.int32)
    tokens = jax.device_put((tokens,), engine.batch_sharding)
    step = engine.train_step.lower(state, tokens).compile()
    out["compile_s"] = time.perf_counter() - t0
    if job["kind"] == "compile":
        return out
    for _ in range(3):  # warm-up
        state, metrics = step(state, tokens)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(job["repeats"]):
        t0 = time.perf_counter()
        state, metrics = step(state, tokens)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    out["step_s"] = float(np.median(times))
    out["step_s_min"] = float(np.min(times))
    out["tokens_per_step"] = cfg.tokens_per_step
    out["params"] = sum(x.size for x in jax.tree.leaves(state.params))
    return out


def run(job: dict) -> dict:
    devices = job.get("devices") or job["mesh"][0] * job["mesh"][1] * job["mesh"][2]
    return run_worker(__file__, job, devices)


# ----------------------------------------------------------------------------- the four parts


def bench_a(repeats: int, batches=(32, 128)) -> tuple[dict, str]:
    """Step time of each 8-device mesh over the 1-device step, tiny config (remat `comms`),
    grad_accum 4 on every mesh (the same micro-batch structure), for two global batches."""
    results = {g: {} for g in batches}
    for g in batches:
        for mesh in [(1, 1, 1), *MESHES_8]:
            job = {"kind": "step", "mesh": mesh, "repeats": repeats}
            job["overrides"] = [*TINY, "model.remat=comms", f"train.global_batch={g}"]
            job["overrides"] += ["train.grad_accum=4", f"train.micro_batch={g // (mesh[0] * 4)}"]
            results[g]["x".join(map(str, mesh))] = run(job)
    rows = []
    for m in results[batches[0]]:
        row = [m]
        for g in batches:
            r, base = results[g][m], results[g]["1x1x1"]["step_s"]
            row += [f"{r['step_s'] * 1e3:.1f}", f"{r['step_s'] / base:.2f}x"]
        rows.append(row)
    header = ["mesh (r x p x t)"]
    for g in batches:
        header += [f"ms @ batch {g}", f"vs 1 dev @ {g}"]
    return results, table("(a) tiny GPT (4 layers, d 64, seq 64), step time", header, rows)


def bench_b() -> tuple[dict, str]:
    """Executed/useful FLOPs of a 4-stage pipeline for several micro-batch counts M."""
    model = ["model.layers=8", "model.d_model=512", "model.heads=8", "model.d_ff=2048"]
    results, rows = {}, []
    for m in (1, 2, 4, 8, 16):
        common = [*model, "train.micro_batch=2", f"train.grad_accum={m}"]
        useful = run({"kind": "flops", "mesh": (1, 1, 1), "overrides": common})["flops_total"]
        executed = run({"kind": "flops", "mesh": (1, 4, 1), "overrides": common})["flops_total"]
        theory = (m + 4 - 1) / m
        ratio = executed / useful
        results[m] = {"useful": useful, "executed": executed, "ratio": ratio, "theory": theory}
        rows.append([m, f"{useful:.3e}", f"{executed:.3e}", f"{ratio:.3f}", f"{theory:.3f}"])
        rows[-1].append(f"{100 * (ratio / theory - 1):+.1f}%")
    header = ["M", "useful FLOPs (1 dev)", "executed (4 stages)", "ratio", "(M+S-1)/M", "diff"]
    return results, table("(b) GPipe S=4: executed / useful FLOPs", header, rows)


def bench_c() -> tuple[dict, str]:
    results = {}
    for layers in (12, 48):
        job = {"kind": "compile", "mesh": (2, 2, 2), "overrides": [*TINY, f"model.layers={layers}"]}
        results[layers] = run(job)["compile_s"]
    rows = [[k, f"{v:.1f}"] for k, v in results.items()]
    rows.append(["48 / 12", f"{results[48] / results[12]:.2f}x"])
    return results, table("(c) compile (+init) time on 2x2x2", ["layers", "seconds"], rows)


def bench_d(repeats: int) -> tuple[dict, str]:
    matmul = run({"kind": "matmul", "devices": 8, "n": 2048, "repeats": repeats})["flops_per_s"]
    results, rows = {"matmul_flops_per_s": matmul}, []
    for mesh, remat in [((8, 1, 1), "comms"), ((4, 1, 2), "comms"), ((2, 2, 2), "comms")]:
        micro = 16 // (mesh[0] * (4 if mesh[1] > 1 else 1))  # a pipeline gets 4 micro-batches
        job = {"kind": "step", "mesh": mesh, "repeats": repeats}
        job["overrides"] = [*MID, f"train.micro_batch={micro}", f"model.remat={remat}"]
        r = run(job)
        d, L, T = 512, 8, 256
        # 6 N per token for the weight matmuls + attention (QK^T and PV, fwd + bwd): 12 L T d.
        matmul_params = L * (4 * d * d + 2 * d * 2048) + 256 * d  # + output projection
        per_token = 6 * matmul_params + 12 * L * T * d
        model_flops = per_token * r["tokens_per_step"] / r["step_s"]
        r.update(model_flops_per_s=model_flops, fraction_of_matmul=model_flops / matmul)
        results["x".join(map(str, mesh))] = r
        rows.append(
            ["x".join(map(str, mesh)), f"{r['step_s'] * 1e3:.0f}", f"{model_flops / 1e9:.1f}"]
        )
        rows[-1].append(f"{100 * model_flops / matmul:.0f}%")
    title = f"(d) GPT 8 x d512, seq 256, batch 16; f32 matmul rate {matmul / 1e9:.1f} GFLOP/s"
    return results, table(title, ["mesh", "step ms", "model GFLOP/s", "of matmul"], rows)


def main() -> None:
    args = options(__doc__, only="a,b,c,d", repeats=20, out="core.json").parse_args()
    if serve_worker(args, _worker):
        return
    parts = {
        "a": lambda: bench_a(args.repeats),
        "b": bench_b,
        "c": bench_c,
        "d": lambda: bench_d(max(3, args.repeats // 4)),
    }
    write_report(run_parts(parts, args.only), args.out)


if __name__ == "__main__":
    main()
