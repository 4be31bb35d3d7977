"""The gradient all-reduce options measured: step time and collectives of the train step.

    python benchmarks/bench_collectives.py [--repeats N] [--only 1x8,2x4] [--out FILE]

GPT (8 layers, d_model 256, seq 128, micro-batch 2) on 8 data-parallel replicas (mesh 8x1x1),
on 1 process x 8 virtual devices and on 2 processes x 4 (JAX's multi-controller runtime,
gloo on loopback), with `parallel.grad_allreduce` / `parallel.grad_bucket_bytes`:
psum per leaf (the default), psum over 4 MiB buckets, the ppermute ring over 4 MiB buckets.
For each: the median step time; the collectives over `replica` the program asks for (psum
and ppermute equations of the jaxpr); from the compiled step's HLO the all-reduce and
collective-permute ops (XLA combines independent all-reduces into tuple all-reduces, one op
each) and the bytes the permutes send per device, against 2(n-1)/n of the gradient bytes.
Each run is a fresh subprocess (the device count is fixed when jax starts). Prints a table,
writes JSON.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    GPT_D256,
    ROOT,
    machine,
    options,
    run_worker,
    serve_worker,
    table,
    time_steps,
    write_report,
)

from jaxpod.platform import virtual_cpu_flags  # noqa: E402  (jax-free)

MODEL = [*GPT_D256, "model.remat=none", "train.grad_accum=1"]
MODEL += ["mesh.replica=8", "mesh.pipeline=1", "mesh.tensor=1"]
BUCKET = 4 * 2**20
OPTIONS = {
    "psum per leaf": [],
    "psum bucketed": [f"parallel.grad_bucket_bytes={BUCKET}"],
    "ring bucketed": ["parallel.grad_allreduce=ring", f"parallel.grad_bucket_bytes={BUCKET}"],
}
PERMUTE = re.compile(r"= (\w+)\[([\d,]*)\][^ ]* collective-permute\(")
ALL_REDUCE = re.compile(r"= (\(?[\w\[\]{}, ]*?\)?) all-reduce\(")
BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4}


def _worker(job: dict) -> dict:
    """One option in this process (of `job["processes"]`, joined first if several)."""
    import jax

    if job["processes"] > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            f"127.0.0.1:{job['port']}", num_processes=job["processes"], process_id=job["pid"]
        )
    import numpy as np

    from jaxpod.config import load_config
    from jaxpod.engine import build_engine
    from jaxpod.parallel.mesh import make_mesh

    devices = 8 // job["processes"]
    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        [f"devices={devices}", *MODEL, *job["overrides"]],
        processes=job["processes"],
    )
    mesh = make_mesh(cfg.mesh, sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    engine, state = build_engine(cfg, mesh)
    tokens = np.random.default_rng(0).integers(0, 256, (cfg.global_batch, cfg.model.seq_len + 1))
    tokens = tokens.astype(np.int32)
    sharding = engine.batch_sharding[0]
    batch = (jax.make_array_from_callback(tokens.shape, sharding, lambda i: tokens[i]),)
    asked = _asked(engine, state, batch)
    step = engine.train_step.lower(state, batch).compile()
    hlo = step.as_text()
    state, metrics, times = time_steps(step, state, batch, job["repeats"])
    size = lambda dtype, dims: BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    grad_bytes = sum(p.size * p.dtype.itemsize for p in jax.tree.leaves(state.params))
    return {
        "step_s": float(np.median(times)),
        "step_s_min": float(np.min(times)),
        "asked": asked,
        "all_reduce": len(ALL_REDUCE.findall(hlo)),
        "collective_permute": len(PERMUTE.findall(hlo)),
        "permute_bytes_per_device": sum(size(*m) for m in PERMUTE.findall(hlo)),
        "grad_bytes_per_device": grad_bytes,
        "loss": float(metrics["loss"]),
    }


def _asked(engine, state, batch) -> int:
    """Collectives over `replica` the program asks for (psum / ppermute equations of
    `loss_and_grads`'s jaxpr), before XLA combines any."""
    import jax
    from jax.extend.core import jaxprs_in_params

    count = 0

    def walk(jaxpr):
        nonlocal count
        for eqn in jaxpr.eqns:
            axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
            axes = axes if isinstance(axes, tuple) else (axes,)
            if "replica" in axes and eqn.primitive.name in ("psum", "psum_invariant", "ppermute"):
                count += 1
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(engine.loss_and_grads)(state.params, batch).jaxpr)
    return count


def run(name: str, processes: int, repeats: int) -> dict:
    job = {"overrides": OPTIONS[name], "processes": processes, "repeats": repeats}
    if processes == 1:
        return run_worker(__file__, job, 8)
    with socket.socket() as sock:  # a free port on loopback for the coordinator
        sock.bind(("127.0.0.1", 0))
        job["port"] = sock.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS=virtual_cpu_flags(8 // processes))
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", json.dumps(job | {"pid": i})],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for i in range(processes)
    ]
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"benchmark job {job} failed:\n{err[-4000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])  # process 0's clock


def main() -> None:
    ap = options(
        __doc__,
        only="1x8,2x4",
        only_help="processes x devices per process",
        repeats=10,
        out="collectives.json",
    )
    args = ap.parse_args()
    if serve_worker(args, _worker):
        return
    report = {"machine": machine()}
    rows = []
    for layout in args.only.split(","):
        processes = int(layout.split("x")[0])
        for name in OPTIONS:
            t0 = time.perf_counter()
            r = run(name, processes, args.repeats)
            print(f"{layout} {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            report[f"{layout} {name}"] = r
            ratio = r["permute_bytes_per_device"] / (2 * 7 / 8 * r["grad_bytes_per_device"])
            rows.append(
                [
                    layout,
                    name,
                    f"{r['step_s'] * 1e3:.0f}",
                    f"{r['step_s_min'] * 1e3:.0f}",
                    r["asked"],
                    r["all_reduce"],
                    r["collective_permute"],
                    f"{r['permute_bytes_per_device'] / 1e6:.2f}",
                    f"{ratio:.3f}",
                    f"{r['loss']:.6f}",
                ]
            )
    header = [
        "processes x devices",
        "gradient all-reduce",
        "step ms (median)",
        "min",
        "asked (jaxpr)",
        "all-reduce ops",
        "collective-permute ops",
        "permute MB/device",
        "/ (2(n-1)/n grads)",
        f"loss, step {2 + args.repeats}",
    ]
    print(table("Gradient all-reduce on 8 replicas (mesh 8x1x1), GPT 8 x d256", header, rows))
    write_report(report, args.out)


if __name__ == "__main__":
    main()
