"""Vision-recipe benchmarks: prints tables and writes JSON. Never asserts a time.

    python benchmarks/bench_vision.py [--only a,b] [--repeats N] [--out FILE]

(a) bytes of parameters + optimizer state per device, float32 master vs float16 master
    (stochastic rounding), measured from the live arrays' shards: the digits config and
    EfficientNet-B4 G16 on POD16 (2 stages x 8 replicas)
(b) images/s of configs/efficientnet_digits.yaml on 8 devices (4 replicas x 2 stages) vs 1
    device, same global batch (64) and micro-batch size

Every measurement runs in a fresh subprocess (the virtual device count is fixed when jax
starts); ratios are only taken between numbers measured in the same run.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, options, run_parts, run_worker, serve_worker, table, write_report  # noqa: E402

DIGITS = ROOT / "configs" / "efficientnet_digits.yaml"
B4_POD16 = ROOT / "configs" / "efficientnet_b4_g16_pod16.yaml"
FP32 = [
    "precision.params=float32",
    "precision.compute=float32",
    "precision.master=float32",
    "precision.loss_scale=none",
]
FP16_MASTER = [
    "precision.params=float16",
    "precision.compute=float16",
    "precision.master=same-as-params",
    "precision.loss_scale=dynamic",
]


def _worker(job: dict) -> dict:
    """Runs inside a subprocess whose XLA_FLAGS already hold the device count."""
    import jax
    import numpy as np

    from jaxpod.config import load_config
    from jaxpod.parallel.mesh import make_mesh, select_devices
    from jaxpod.run.mapping import bytes_per_device
    from jaxpod.run.tasks import build_task

    def held(tree):  # device id -> bytes, every memory kind together
        return {d: sum(kinds.values()) for d, kinds in bytes_per_device(tree).items()}

    cfg = load_config(job["config"], job["overrides"])
    mesh = make_mesh(cfg.mesh, select_devices(cfg.devices))
    task, state = build_task(cfg, mesh)
    out = {"devices": cfg.devices, "global_batch": cfg.global_batch}
    if job["kind"] == "bytes":
        p, o = held(state.params), held(state.opt_state)
        worst = max(p, key=lambda d: p[d] + o.get(d, 0))
        count = task.engine.stages.params_count
        out |= {"params": count, "param_bytes": p[worst], "opt_bytes": o.get(worst, 0)}
        return out
    batches = [task.batch(i) for i in range(4)]
    step = task.engine.train_step.lower(state, batches[0]).compile()
    for i in range(3):  # warm-up
        state, metrics = step(state, batches[i % 4])
    jax.block_until_ready(metrics)
    times = []
    for i in range(job["repeats"]):
        t0 = time.perf_counter()
        state, metrics = step(state, batches[i % 4])
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    out["step_s"] = float(np.median(times))
    out["images_per_s"] = cfg.global_batch / out["step_s"]
    return out


def run(job: dict, devices: int) -> dict:
    return run_worker(__file__, job, devices)


def bench_a() -> tuple[dict, str]:
    mib = lambda n: f"{n / 2**20:.2f}"  # noqa: E731
    results, rows = {}, []
    for name, config, devices in [("digits (8 dev)", DIGITS, 8), ("B4 G16 POD16", B4_POD16, 16)]:
        for label, precision in [("float32 master", FP32), ("float16 master + SR", FP16_MASTER)]:
            r = run({"kind": "bytes", "config": str(config), "overrides": precision}, devices)
            results[f"{name} / {label}"] = r
            total = r["param_bytes"] + r["opt_bytes"]
            rows.append(
                [
                    name,
                    label,
                    f"{r['params']:,}",
                    mib(r["param_bytes"]),
                    mib(r["opt_bytes"]),
                    mib(total),
                ]
            )
    for name in ("digits (8 dev)", "B4 G16 POD16"):
        a, b = (results[f"{name} / {k}"] for k in ("float32 master", "float16 master + SR"))
        ratio = (b["param_bytes"] + b["opt_bytes"]) / (a["param_bytes"] + a["opt_bytes"])
        rows.append([name, "float16 / float32", "", "", "", f"{ratio:.2f}x"])
    header = ["model", "precision", "params", "param MiB/dev", "optimizer MiB/dev", "total MiB/dev"]
    return results, table("(a) parameter + optimizer bytes per device (LARS)", header, rows)


def bench_b(repeats: int) -> tuple[dict, str]:
    jobs = {
        "8 devices (4 x 2 x 1)": ([], 8),
        "1 device": (
            [
                "devices=1",
                "mesh.replica=1",
                "mesh.pipeline=1",
                "model.pipeline_splits=[]",
                "train.grad_accum=8",
            ],
            1,
        ),
    }
    results = {}
    for name, (overrides, devices) in jobs.items():
        job = {"kind": "step", "config": str(DIGITS), "overrides": overrides, "repeats": repeats}
        results[name] = run(job, devices)
    base = results["1 device"]["images_per_s"]
    rows = [
        [
            n,
            f"{r['step_s'] * 1e3:.0f}",
            f"{r['images_per_s']:.1f}",
            f"{r['images_per_s'] / base:.2f}x",
        ]
        for n, r in results.items()
    ]
    header = ["mesh", "ms/step", "images/s", "vs 1 device"]
    return results, table("(b) digits config, global batch 64, images/s", header, rows)


def main() -> None:
    args = options(__doc__, only="a,b", repeats=10, out="vision.json").parse_args()
    if serve_worker(args, _worker):
        return
    parts = {"a": bench_a, "b": lambda: bench_b(args.repeats)}
    write_report(run_parts(parts, args.only), args.out)


if __name__ == "__main__":
    main()
