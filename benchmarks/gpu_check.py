"""A prepared check for one machine with an NVIDIA GPU: prints tables and writes JSON.

    python benchmarks/gpu_check.py [--out gpu_check.json] [--only a,b,c] [--steps N] [--repeats N]
    JAX_PLATFORMS=cpu python benchmarks/gpu_check.py --cpu-dry-run --out /tmp/gpu_check.json

(a) losses: configs/tiny.yaml on one GPU (mesh 1x1x1) for `--steps` steps beside the same
    steps on the CPU backend (same config, seed and data), the GPU at jax's default matmul
    precision and at "highest"; the largest relative difference against a float32 bound
    (`tolerances`).
(b) bytes: XLA:GPU's `memory_analysis()` of the tiny step compiled for the attached GPU,
    beside the same step compiled for a compile-only H100 (`jaxpod.target.gpu`: what a machine
    with no GPU reads) and the planner's bytes for the `h100-80gb` profile.
(c) speed: a GPT-2-small-shaped model (12 x d768, 12 heads, d_ff 3072, seq 1024, vocabulary
    50304, micro-batch 8, bfloat16 compute) on one GPU: step time, model FLOP/s (3 x the
    planner's forward FLOPs per token x tokens per step / step time) and their fraction of
    the H100 SXM's 989 TFLOP/s dense BF16 peak.

Each part records its error in the JSON and the script goes on; it exits 0. `--cpu-dry-run`
runs every code path on the CPU backend at small sizes (1-2 steps): a test of the script, not a
measurement. No network is needed (the data are this Python's standard library sources).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, table, time_steps  # noqa: E402

H100_BF16_PEAK = 989e12  # FLOP/s, dense BF16, H100 SXM
TINY = ROOT / "configs" / "tiny.yaml"
ONE_DEVICE = ["devices=1", "mesh.replica=1", "mesh.pipeline=1", "mesh.tensor=1"]
# test_pinned's GPT case: global batch 16 (micro-batch 2 x 8), learning rate from step 1
PINNED_GPT = ["train.global_batch=16", "train.grad_accum=null", "optim.warmup_steps=0"]
GPT2_SMALL = ["model.layers=12", "model.d_model=768", "model.heads=12", "model.d_ff=3072"]
GPT2_SMALL += ["model.seq_len=1024", "model.vocab=50304", "model.remat=none"]
GPT2_SMALL += ["train.micro_batch=8", "train.grad_accum=1", "precision.compute=bfloat16"]
GPT2_SMALL += ["optim.warmup_steps=0"]
DRY_GPT = ["model.layers=2", "model.d_model=64", "model.heads=4", "model.d_ff=256"]
DRY_GPT += ["model.seq_len=64", "model.vocab=256", "model.remat=none", "train.micro_batch=2"]
DRY_GPT += ["train.grad_accum=1", "precision.compute=bfloat16", "optim.warmup_steps=0"]

U32 = 2.0**-24  # float32 unit roundoff
U_TF32 = 2.0**-11  # TF32's (10-bit mantissa), which XLA:GPU may use for float32 matmuls


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def load(overrides: list[str]):
    from jaxpod.config import load_config

    return load_config(TINY, overrides)


def one_device_mesh(cfg, device):
    from jaxpod.parallel.mesh import make_mesh

    return make_mesh(cfg.mesh, devices=[device])


def tolerances(cfg) -> dict:
    """Relative bounds on a float32 step's loss computed by two backends. The longest sum in
    the step runs over its n = global batch x seq_len tokens (the loss's mean, every weight
    gradient); two orders of a sum of n terms differ by at most 2 (n - 1) u of the sum of their
    magnitudes (u = 2^-24), which for the loss (positive terms) is the loss itself. TF32 inputs
    add 2 u_tf32 (u_tf32 = 2^-11: each factor of a product rounded once). A bound for the first
    step's loss; later steps also carry the earlier updates' differences."""
    n = cfg.global_batch * cfg.model.seq_len
    order = 2 * (n - 1) * U32
    return {"tokens": n, "highest": order, "default": order + 2 * U_TF32}


def train_losses(cfg, device, steps: int, precision: str | None, dataset) -> dict:
    """Loss and gradient norm of the first `steps` steps of `cfg` on `device` alone."""
    import jax

    from jaxpod.engine import build_engine
    from jaxpod.run.tasks import Task

    t0 = time.perf_counter()
    with jax.default_matmul_precision(precision):  # None: jax's default
        engine, state = build_engine(cfg, one_device_mesh(cfg, device))
        task = Task(cfg, dataset, engine)
        losses, norms = [], []
        for step in range(steps):
            state, metrics = engine.train_step(state, task.batch(step))
            metrics = jax.device_get(metrics)
            losses.append(float(metrics["loss"]))
            norms.append(float(metrics["grad_norm"]))
    return {
        "device": str(device),
        "loss": losses,
        "grad_norm": norms,
        "seconds": time.perf_counter() - t0,
    }


def part_a(gpu, steps: int) -> tuple[dict, str]:
    import jax

    from jaxpod.run.tasks import load_data

    cfg = load([*ONE_DEVICE, *PINNED_GPT])
    dataset = load_data(cfg)
    cpu = jax.devices("cpu")[0]
    say(f"(a) {steps} steps of the tiny GPT on {cpu} ...")
    runs = {"cpu": train_losses(cfg, cpu, steps, None, dataset)}
    for precision in ("default", "highest"):
        say(f"(a) ... and on {gpu}, {precision} matmul precision")
        runs[precision] = train_losses(cfg, gpu, steps, precision, dataset)
    tol = tolerances(cfg)
    ref = np.array(runs["cpu"]["loss"])
    out = {"steps": steps, "global_batch": cfg.global_batch, "runs": runs, "tolerance": tol}
    rows = [[i + 1, f"{ref[i]:.7f}"] for i in range(steps)]
    for precision in ("default", "highest"):
        got = np.array(runs[precision]["loss"])
        rel = np.abs(got - ref) / np.abs(ref)
        gn_ref, gn = np.array(runs["cpu"]["grad_norm"]), np.array(runs[precision]["grad_norm"])
        out[precision] = {
            "max_rel_loss": float(rel.max()),
            "first_step_rel_loss": float(rel[0]),
            "max_rel_grad_norm": float((np.abs(gn - gn_ref) / np.abs(gn_ref)).max()),
            "first_step_within": bool(rel[0] <= tol[precision]),
            "all_steps_within": bool(rel.max() <= tol[precision]),
        }
        for i, row in enumerate(rows):
            row += [f"{got[i]:.7f}", f"{rel[i]:.1e}"]
    rows.append(["tol", ""] + [x for p in ("default", "highest") for x in ("", f"{tol[p]:.1e}")])
    header = ["step", "CPU loss", "GPU default", "rel", "GPU highest", "rel"]
    title = f"(a) tiny GPT 1x1x1, global batch {cfg.global_batch}: GPU vs CPU losses"
    return out, table(title, header, rows)


def compiled_bytes(cfg, mesh) -> dict:
    """`memory_analysis()` of the tiny step lowered from abstract inputs (as `jaxpod compile`)."""
    from jaxpod.inspect.compile import abstract_inputs

    engine, state, batch = abstract_inputs(cfg, mesh)
    lowered = engine.train_step.lower(*engine.updating_arguments(state, batch))
    t0 = time.perf_counter()
    compiled = lowered.compile()
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = (cost[0] if cost else {}) if isinstance(cost, list) else cost
    return {
        "device": str(mesh.devices.flat[0]),
        "device_kind": mesh.devices.flat[0].device_kind,
        "compile_s": time.perf_counter() - t0,
        "argument": int(mem.argument_size_in_bytes),
        "temp": int(mem.temp_size_in_bytes),
        "output": int(mem.output_size_in_bytes),
        "alias": int(mem.alias_size_in_bytes),
        "host_argument": int(mem.host_argument_size_in_bytes),
        "host_temp": int(mem.host_temp_size_in_bytes),
        "flops": float(cost.get("flops", 0.0)),
    }


def part_b(gpu) -> tuple[dict, str]:
    import dataclasses

    from jaxpod.planner.backend import backend_plan

    cfg = load([*ONE_DEVICE, *PINNED_GPT])
    out: dict = {}
    say(f"(b) compiling the tiny step for {gpu}")
    try:
        out["attached"] = compiled_bytes(cfg, one_device_mesh(cfg, gpu))
    except Exception as e:
        out["attached"] = error(e)
    say("(b) compiling it for a compile-only H100 (jaxpod.target.gpu)")
    try:
        from jaxpod.target.gpu import gpu_topology_devices

        h100 = gpu_topology_devices("h100", 1)[0]
        out["compile_only_h100"] = compiled_bytes(cfg, one_device_mesh(cfg, h100))
    except Exception as e:
        out["compile_only_h100"] = error(e)
    h100 = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, device="h100-80gb"))
    plan = backend_plan(h100, "gpu")  # no profile for "gpu": memory.device's, h100-80gb
    out["planned"] = plan
    mib = lambda n: f"{n / 2**20:.2f}"  # noqa: E731
    rows = []
    for key, name in (("argument", "arguments"), ("temp", "temporaries"), ("output", "outputs")):
        row = [name]
        for run in ("attached", "compile_only_h100"):
            r = out[run]
            row.append(mib(r[key]) if key in r else "error")
        row.append(
            mib(plan["arguments"] if key == "argument" else plan["temporaries"])
            if key != "output"
            else ""
        )
        rows.append(row)
    header = [
        "MiB per device",
        "XLA:GPU attached",
        "compile-only H100",
        f"planned {plan['profile']}",
    ]
    return out, table("(b) the tiny step's bytes (1x1x1)", header, rows)


def part_c(gpu, overrides: list[str], warmup: int, repeats: int) -> tuple[dict, str]:
    import jax

    from jaxpod.engine import build_engine
    from jaxpod.planner.counts import flops_per_example

    cfg = load([*ONE_DEVICE, *overrides])
    say(
        f"(c) GPT {cfg.model.layers} x d{cfg.model.d_model}, seq {cfg.model.seq_len}, batch "
        f"{cfg.global_batch}, compute {cfg.precision.compute} on {gpu}"
    )
    engine, state = build_engine(cfg, one_device_mesh(cfg, gpu))
    shape = (cfg.global_batch, cfg.model.seq_len + 1)
    tokens = np.random.default_rng(0).integers(0, 256, shape).astype(np.int32)
    batch = jax.device_put((tokens,), engine.batch_sharding)
    t0 = time.perf_counter()
    step = engine.train_step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    state, metrics, times = time_steps(step, state, batch, repeats, warmup)
    step_s = float(np.median(times))
    tokens_per_step = cfg.global_batch * cfg.model.seq_len
    model_flops = 3 * flops_per_example(cfg) * tokens_per_step  # forward + backward (2x)
    rate = model_flops / step_s
    try:
        temp = int(step.memory_analysis().temp_size_in_bytes)
    except Exception:  # the timing stands without it
        temp = None
    out = {
        "overrides": overrides,
        "compile_s": compile_s,
        "warmup": warmup,
        "step_s": times,
        "median_step_s": step_s,
        "tokens_per_step": tokens_per_step,
        "model_flops_per_step": model_flops,
        "model_flops_per_s": rate,
        "fraction_of_h100_bf16_peak": rate / H100_BF16_PEAK,
        "loss": float(metrics["loss"]),
        "temp_bytes": temp,
    }
    rows = [
        [
            f"{step_s * 1e3:.1f}",
            f"{tokens_per_step / step_s:,.0f}",
            f"{rate / 1e12:.1f}",
            f"{100 * rate / H100_BF16_PEAK:.1f}%",
            f"{compile_s:.0f}",
        ]
    ]
    header = ["step ms", "tokens/s", "model TFLOP/s", "of 989 TFLOP/s", "compile s"]
    return out, table(f"(c) GPT {cfg.model.layers} x d{cfg.model.d_model} on {gpu}", header, rows)


def summary(report: dict) -> str:
    """The final table: each part's headline numbers, or its error."""
    rows = []
    a, b, c = (report.get(k, {"error": "not run"}) for k in "abc")
    if "error" in a:
        rows.append(["(a) GPU vs CPU loss", "error", a["error"][:80]])
    else:
        for p in ("default", "highest"):
            r, tol = a[p], a["tolerance"][p]
            ok = "within" if r["all_steps_within"] else "OUTSIDE"
            rows.append(
                [
                    f"(a) max rel loss diff, {p}",
                    f"{r['max_rel_loss']:.1e}",
                    f"{ok} {tol:.1e} (step 1: {r['first_step_rel_loss']:.1e})",
                ]
            )
    for run in ("attached", "compile_only_h100"):
        r = b.get(run, {"error": b.get("error", "not run")})
        value = "error" if "error" in r else f"{(r['argument'] + r['temp']) / 2**20:.2f} MiB"
        note = r["error"][:80] if "error" in r else f"arguments + temporaries on {r['device']}"
        rows.append([f"(b) XLA:GPU bytes, {run}", value, note])
    if "planned" in b:
        total = b["planned"]["device_total"] / 2**20
        rows.append(["(b) planned bytes", f"{total:.2f} MiB", b["planned"]["profile"]])
    if "error" in c:
        rows.append(["(c) model FLOP/s", "error", c["error"][:80]])
    else:
        rate = c["model_flops_per_s"]
        rows.append(
            [
                "(c) model FLOP/s",
                f"{rate / 1e12:.2f} T",
                f"{100 * c['fraction_of_h100_bf16_peak']:.1f}% of 989 T; step "
                f"{c['median_step_s'] * 1e3:.1f} ms",
            ]
        )
    dry = " (CPU dry run: not a measurement)" if report["cpu_dry_run"] else ""
    return table(f"summary{dry}", ["check", "value", "note"], rows)


def error(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}


def environment() -> dict:
    import jax

    env = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [f"{d} ({d.device_kind})" for d in jax.devices()],
    }
    try:
        import jaxlib

        env["jaxlib"] = jaxlib.__version__
        from importlib.metadata import version

        env["jax_cuda12_plugin"] = version("jax-cuda12-plugin")
    except Exception as e:
        env["jax_cuda12_plugin"] = f"not installed ({type(e).__name__})"
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gpu_check.json", help="the JSON report")
    ap.add_argument("--steps", type=int, default=5, help="(a): steps compared")
    ap.add_argument("--repeats", type=int, default=10, help="(c): timed steps")
    ap.add_argument("--only", default="a,b,c", help="the parts to run, by letter")
    ap.add_argument("--cpu-dry-run", action="store_true", help="small sizes on the CPU backend")
    args = ap.parse_args()
    import jax

    dry = args.cpu_dry_run
    steps, warmup, repeats = (2, 1, 2) if dry else (args.steps, 3, args.repeats)
    report: dict = {"machine": machine(), "cpu_dry_run": dry, "environment": environment()}
    say(f"environment: {json.dumps(report['environment'])}")
    gpu = jax.devices()[0]
    if gpu.platform != "gpu" and not dry:
        report["error"] = f"no GPU: jax's devices are {jax.devices()} (try --cpu-dry-run)"
        say(report["error"])
    parts = {
        "a": lambda: part_a(gpu, steps),
        "b": lambda: part_b(gpu),
        "c": lambda: part_c(gpu, DRY_GPT if dry else GPT2_SMALL, warmup, repeats),
    }
    for name in args.only.split(","):
        run = parts[name]
        if "error" in report:
            break
        t0 = time.perf_counter()
        try:
            report[name], text = run()
            print(text, flush=True)
        except Exception as e:
            report[name] = error(e)
            say(f"({name}) FAILED: {report[name]['error']}")
        say(f"({name}) took {time.perf_counter() - t0:.0f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(summary(report), flush=True)
    say(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
