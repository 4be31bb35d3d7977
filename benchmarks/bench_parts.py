"""A batch fed in parts (`train.batch_parts`) measured: step time and compiled memory against k.

    python benchmarks/bench_parts.py [--only time,memory] [--repeats N] [--out FILE]

(time)   the optimizer step's time (`Engine.run_step`: k calls, each on grad_accum / k
         micro-batches) of a GPT (8 x d256, seq 128, micro-batch 2, remat full, 16
         micro-batches a step) on 1x4x1 under 1F1B and on 2x2x1 under GPipe, k = 1, 2, 4, 8:
         what the extra pipeline fills and drains and the per-part gradient reductions cost
(memory) XLA's compiled device total of the call that updates (device-resident arguments +
         temporaries: a part of the batch and the summed gradients among the arguments)
         beside the planner's prediction for the same program, and the arguments alone

Each measurement runs in a fresh subprocess (the virtual device count is fixed when jax
starts); ratios are taken between numbers of the same run. Prints tables, writes JSON.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    GPT_D256,
    options,
    run_parts,
    run_worker,
    serve_worker,
    table,
    tiny_on_mesh,
    write_report,
)

MODEL = [*GPT_D256, "model.remat=full", "train.grad_accum=16"]
CASES = {
    "1x4x1 1f1b": ((1, 4, 1), ["train.pipeline_schedule=1f1b"]),
    "2x2x1 gpipe": ((2, 2, 1), []),
}
PARTS = [1, 2, 4, 8]


def _worker(job: dict) -> dict:
    """Runs inside a subprocess whose XLA_FLAGS already hold the device count."""
    import jax
    import numpy as np

    from jaxpod.engine import build_engine
    from jaxpod.inspect.compile import compile_step
    from jaxpod.planner import plan

    cfg, mesh = tiny_on_mesh(job["mesh"], [*MODEL, *job["overrides"]])
    if job["kind"] == "memory":
        compiled = compile_step(cfg, mesh)
        planned = plan(cfg)["bytes_per_device"]
        return {
            "compiled": compiled["device_total_bytes"],
            "compiled_arguments": compiled["device_argument_bytes"],
            "planned": planned["device_total"],
            "planned_arguments": planned["arguments"],
        }
    engine, state = build_engine(cfg, mesh)
    shape = (cfg.global_batch, cfg.model.seq_len + 1)
    tokens = np.random.default_rng(0).integers(0, 256, shape).astype(np.int32)
    n = cfg.part_batch
    parts = [
        jax.device_put((tokens[i * n : (i + 1) * n],), engine.batch_sharding)
        for i in range(cfg.train.batch_parts)
    ]
    for _ in range(2):  # compile and warm up
        state, metrics = engine.run_step(state, parts)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(job["repeats"]):
        t0 = time.perf_counter()
        state, metrics = engine.run_step(state, parts)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return {"step_s": float(np.median(times)), "step_s_min": float(np.min(times))}


def run(job: dict) -> dict:
    r, p, t = job["mesh"]
    return run_worker(__file__, job, r * p * t)


def bench_time(repeats: int) -> tuple[dict, str]:
    results, rows = {}, []
    for name, (mesh, extra) in CASES.items():
        row, base = [name], None
        for k in PARTS:
            over = [*extra, f"train.batch_parts={k}"]
            res = run({"kind": "time", "mesh": mesh, "overrides": over, "repeats": repeats})
            results[f"{name} k={k}"] = res
            base = base or res["step_s"]
            row.append(f"{res['step_s'] * 1e3:.0f} ({res['step_s'] / base:.2f}x)")
        rows.append(row)
    header = ["mesh, schedule", *[f"ms @ k={k}" for k in PARTS]]
    title = "(time) optimizer step, GPT 8 x d256, seq 128, 16 micro-batches of 2"
    return results, table(title, header, rows)


def bench_memory() -> tuple[dict, str]:
    results, rows = {}, []
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    for name, (mesh, extra) in CASES.items():
        for k in PARTS:
            res = run(
                {"kind": "memory", "mesh": mesh, "overrides": [*extra, f"train.batch_parts={k}"]}
            )
            results[f"{name} k={k}"] = res
            ratio = f"{res['planned'] / res['compiled']:.2f}"
            rows.append(
                [
                    name,
                    k,
                    mib(res["compiled_arguments"]),
                    mib(res["planned_arguments"]),
                    mib(res["compiled"]),
                    mib(res["planned"]),
                    ratio,
                ]
            )
    header = [
        "mesh, schedule",
        "k",
        "XLA args MiB",
        "planned args",
        "XLA total MiB",
        "planned",
        "planned / XLA",
    ]
    return results, table("(memory) the updating call's device bytes", header, rows)


def main() -> None:
    ap = options(
        __doc__, only="time,memory", only_help="parts: time, memory", repeats=8, out="parts.json"
    )
    args = ap.parse_args()
    if serve_worker(args, _worker):
        return
    parts = {"time": lambda: bench_time(args.repeats), "memory": bench_memory}
    write_report(run_parts(parts, args.only), args.out)


if __name__ == "__main__":
    main()
