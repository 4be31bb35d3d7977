"""Pipeline schedules measured: step time, executed FLOPs and compiled memory against M.

    python benchmarks/bench_schedules.py [--only time,flops,memory] [--repeats N] [--out FILE]
        [--flops-meshes 1x4x1,2x2x2] [--kinds 1f1b,zb-h1,zb-v] [--micro 4,8,16]
        [--remat full]

(time)   step time (wall, and the process's CPU time) of every schedule (V = 2 where
         chunked) on 1x4x1 and 2x2x2, M = 4, 8, 16 micro-batches (`--micro`), gpipe and
         circular also with `train.skip_bubbles` (lax.cond on a tick's liveness)
(flops)  executed / useful FLOPs of the train step's loss and gradients (XLA's cost analysis
         of the unrolled program over the single-device program on the same global batch)
         against each schedule's theory, on the `--flops-meshes` (default 1x4x1)
(memory) XLA's compiled device total (device-resident arguments + temporaries) against M on
         1x4x1, beside the planner's prediction for the same step, for the `--kinds`, under
         the `--remat` policy (default `full`, the other parts' policy)

Each measurement runs in a fresh subprocess (the virtual device count is fixed when jax
starts); ratios are taken between numbers of the same run. Prints tables, writes JSON.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    GPT_D256,
    loss_and_grads_flops,
    options,
    run_parts,
    run_worker,
    serve_worker,
    table,
    time_steps,
    tiny_on_mesh,
    write_report,
)

from jaxpod.parallel.schedules import make_schedule  # noqa: E402

MODEL = [*GPT_D256, "model.remat=full"]
SCHEDULES = {
    "gpipe": [],
    "circular": ["train.pipeline_schedule=circular", "train.virtual_stages=2"],
    "1f1b": ["train.pipeline_schedule=1f1b"],
    "zb-h1": ["train.pipeline_schedule=zb-h1"],
    "interleaved-1f1b": ["train.pipeline_schedule=interleaved-1f1b", "train.virtual_stages=2"],
    "zb-v": ["train.pipeline_schedule=zb-v", "train.virtual_stages=2"],
}
MESHES = [(1, 4, 1), (2, 2, 2)]
LAYERS, D_MODEL, D_FF, SEQ = 8, 256, 1024, 128  # GPT_D256's
VOCAB = 256  # configs/tiny.yaml's
# a GPT_D256 layer's forward matmul FLOPs per token, halved: its weights (4d² + 2d·d_ff) and
# the two weightless attention matmuls (scores, their average over values: 2·seq·d)
PER_TOKEN = 4 * D_MODEL**2 + 2 * D_MODEL * D_FF + 2 * SEQ * D_MODEL


def weight_share(d_model: int = D_MODEL, d_ff: int = D_FF, seq: int = SEQ) -> float:
    """The weight matmuls' share of a GPT layer's forward FLOPs (multi-head attention, a
    two-matmul MLP): per token 2P with P = 4d² + 2d·d_ff weights against 4·seq·d for the
    two attention matmuls (scores and their average over values, no weight)."""
    weights = 4 * d_model**2 + 2 * d_model * d_ff
    return weights / (weights + 2 * seq * d_model)


def tick_costs(stages: int, v: int) -> dict[int, float]:
    """A stepwise tick's cost in stage forwards under remat `full`, per op code: the forward
    1; the whole backward 3 (recomputation and both gradients); ZB's W the weight matmuls'
    `x.T @ dy` alone, w = `weight_share`, and B the rest, 3 - w (the input-gradient chain
    holds the whole backward of the weightless attention matmuls). A backward never
    recomputes its chunk's last matmul (the MLP's down projection: its output feeds only the
    chunk's output, whose value the backward does not need): V·δ less a stage, V chunks of
    it, δ that matmul's share of a stage's forward."""
    w = weight_share()
    skip = v * D_MODEL * D_FF / (LAYERS // stages * PER_TOKEN)
    return {1: 1.0, 2: 3.0 - skip, 3: 3.0 - w - skip, 4: w}


def useful_work() -> float:
    """The one-device step's work per micro-batch in forwards of the layers (the same in a
    stage's share of it, per device): 4 under remat `full` (forward, recomputation, both
    gradients), less λ, the down projections no layer's backward recomputes (each layer is
    a remat unit, its last matmul's output read only by the residual add: λ = d·d_ff over
    `PER_TOKEN`), plus the head's three matmuls (its forward and both gradients, d·V a token
    each) against the layers' forward."""
    return 4 - D_MODEL * D_FF / PER_TOKEN + 3 * D_MODEL * VOCAB / (LAYERS * PER_TOKEN)


MICRO = [4, 8, 16]


def _worker(job: dict) -> dict:
    """Runs inside a subprocess whose XLA_FLAGS already hold the device count."""
    import time

    import jax
    import numpy as np

    from jaxpod.engine import abstract_engine, build_engine
    from jaxpod.inspect.compile import compile_step
    from jaxpod.planner import plan

    cfg, mesh = tiny_on_mesh(job["mesh"], [*MODEL, *job["overrides"]])
    shape = (cfg.global_batch, cfg.model.seq_len + 1)
    if job["kind"] == "flops":
        engine, state = abstract_engine(cfg, mesh, unroll=True)
        return {"flops_total": loss_and_grads_flops(engine, state, shape) * mesh.size}
    if job["kind"] == "memory":
        compiled = compile_step(cfg, mesh)
        planned = plan(cfg)["bytes_per_device"]["device_total"]
        return {"compiled": compiled["device_total_bytes"], "planned": planned}
    engine, state = build_engine(cfg, mesh)
    tokens = np.random.default_rng(0).integers(0, 256, shape).astype(np.int32)
    batch = jax.device_put((tokens,), engine.batch_sharding)
    step = engine.train_step.lower(state, batch).compile()
    state, _, _ = time_steps(step, state, batch, 0)  # the warm-up steps
    cpu = time.process_time()
    _, _, times = time_steps(step, state, batch, job["repeats"], warmup=0)
    cpu = (time.process_time() - cpu) / job["repeats"]
    return {"step_s": float(np.median(times)), "step_s_min": float(np.min(times)), "cpu_s": cpu}


def run(job: dict) -> dict:
    r, p, t = job["mesh"]
    return run_worker(__file__, job, r * p * t)


def theory(kind: str, stages: int, micro: int) -> float:
    """Executed / useful FLOPs of the layers as XLA's cost analysis counts them (M micro-
    batches per replica). gpipe and circular compute a stage (a chunk) on every tick, bubbles
    included: (V·M + S - 1) / (V·M). 1f1b runs 2(M + S - 1) ticks, one op each; the cost
    analysis charges a `lax.switch` its dearest branch, the backward (the stage's forward,
    recomputation shared, and its backward: 3 - δ forwards' worth, `tick_costs`), against
    the one-device step's work per micro-batch (`useful_work`): 2(M + S - 1)(3 - δ) / (M·u).
    The other stepwise kinds likewise from their tables' ticks (a chunk's tick 1/V)."""
    v = 2 if kind in ("circular", "interleaved-1f1b", "zb-v") else 1
    table = make_schedule(kind, stages, micro, v)
    if table.explicit_backward:  # every tick charged its dearest branch, a chunk 1/V
        cost = tick_costs(stages, v)
        dearest = max(cost[int(o)] for o in np.unique(table.op) if o)
        return table.ticks * dearest / (v * micro * useful_work())
    return (v * micro + stages - 1) / (v * micro)


def bench_time(repeats: int, micros: list[int]) -> tuple[dict, str]:
    """Each schedule's median wall time of a step and, in parentheses, the process's CPU
    time a step (all its threads, the timed steps' mean): the host is shared, and CPU time
    moves less with its load than wall time does."""
    results, rows = {}, []
    for mesh in MESHES:
        m_id = "x".join(map(str, mesh))
        for kind, extra in SCHEDULES.items():
            for skip in [False, True] if kind in ("gpipe", "circular") else [False]:
                name = kind + (" + skip" if skip else "")
                row = [m_id, name]
                for micro in micros:
                    over = [*extra, f"train.grad_accum={micro}"]
                    over += [f"train.skip_bubbles={str(skip).lower()}"]
                    r = run({"kind": "time", "mesh": mesh, "overrides": over, "repeats": repeats})
                    results[f"{m_id} {name} M={micro}"] = r
                    row.append(f"{r['step_s'] * 1e3:.0f} ({r['cpu_s'] * 1e3:.0f})")
                rows.append(row)
    header = ["mesh", "schedule", *[f"ms @ M={m}" for m in micros]]
    return results, table("(time) step time, GPT 8 x d256, seq 128, micro-batch 2", header, rows)


def bench_flops(meshes: list[tuple[int, ...]], kinds: list[str]) -> tuple[dict, str]:
    """Executed / useful FLOPs of `kinds` on each of `meshes`, M = 4 and 8 micro-batches per
    replica: useful is the one-device program on the same global batch (R·M micro-batches)."""
    results, rows = {}, []
    for r, stages, t in meshes:
        m_id = f"{r}x{stages}x{t}"
        for micro in (4, 8):
            one = {"kind": "flops", "mesh": (1, 1, 1)}
            one["overrides"] = [f"train.grad_accum={r * micro}"]
            useful = run(one)["flops_total"]
            for kind in kinds:
                over = [*SCHEDULES[kind], f"train.grad_accum={micro}"]
                job = {"kind": "flops", "mesh": (r, stages, t), "overrides": over}
                ratio, want = run(job)["flops_total"] / useful, theory(kind, stages, micro)
                results[f"{m_id} {kind} M={micro}"] = {"ratio": ratio, "theory": want}
                row = [m_id, kind, micro, f"{ratio:.3f}", f"{want:.3f}", f"{ratio / want - 1:+.1%}"]
                rows.append(row)
    header = ["mesh", "schedule", "M", "executed/useful", "theory", "difference"]
    return results, table("(flops) executed / useful FLOPs", header, rows)


def bench_memory(kinds: list[str], remat: str = "full") -> tuple[dict, str]:
    """XLA's device total of each of `kinds` on 1x4x1 against M under the `remat` policy,
    beside the planner's; the keys name the policy where it is not `full`."""
    results, rows = {}, []
    mesh, tag = (1, 4, 1), "" if remat == "full" else f" remat={remat}"
    for kind in kinds:
        extra, row = [*SCHEDULES[kind], f"model.remat={remat}"], [kind]
        for micro in (4, 8, 16, 32):
            r = run(
                {"kind": "memory", "mesh": mesh, "overrides": [*extra, f"train.grad_accum={micro}"]}
            )
            results[f"{kind}{tag} M={micro}"] = r
            row.append(f"{r['compiled'] / 1e6:.1f} ({r['planned'] / 1e6:.1f})")
        rows.append(row)
    header = ["schedule", *[f"MB @ M={m}" for m in (4, 8, 16, 32)]]
    title = f"(memory) XLA's device total per device on 1x4x1, remat {remat} (planner's in ())"
    return results, table(title, header, rows)


def main() -> None:
    args = options(
        __doc__,
        only="time,flops,memory",
        only_help="the parts to run",
        repeats=10,
        out="schedules.json",
    )
    args.add_argument("--flops-meshes", default="1x4x1", help="(flops) meshes, e.g. 1x4x1,2x2x2")
    micros = ",".join(map(str, MICRO))
    args.add_argument("--micro", default=micros, help="(time) micro-batch counts")
    kinds = ",".join(SCHEDULES)
    args.add_argument("--kinds", default=kinds, help="(flops, memory) schedules to run")
    args.add_argument("--remat", default="full", help="(memory) model.remat policy")
    args = args.parse_args()
    if serve_worker(args, _worker):
        return
    meshes = [tuple(int(n) for n in m.split("x")) for m in args.flops_meshes.split(",")]
    kinds = args.kinds.split(",")
    flops = lambda: bench_flops(meshes, kinds)  # noqa: E731
    memory = lambda: bench_memory(kinds, args.remat)  # noqa: E731
    parts = {
        "time": lambda: bench_time(args.repeats, [int(m) for m in args.micro.split(",")]),
        "flops": flops,
        "memory": memory,
    }
    write_report(run_parts(parts, args.only), args.out)


if __name__ == "__main__":
    main()
