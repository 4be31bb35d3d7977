"""The planner against XLA on mappings it was never tuned on, and on every preset.

    python benchmarks/bench_heldout.py [--set heldout|heldout2|heldout3|heldout4|heldout-llama|
                                        presets|calibration-efficientnet] [--only TEXT] [--out FILE]

(heldout) the rows of benchmarks/heldout.yaml, fixed in a commit before any fitting; (heldout2)
benchmarks/heldout2.yaml, a second set fixed in a commit before it was first compiled;
(heldout3) benchmarks/heldout3.yaml, a third, fixed the same way before the guard's update
became a `lax.cond`; (heldout4) benchmarks/heldout4.yaml, 16-bit weights beside float32
optimizer state or masters, fixed before it was first compiled; (heldout-llama)
benchmarks/heldout_llama.yaml, GPT's grouped-query attention, SwiGLU and RoPE, fixed before
the planner counted their activations;
(presets) every config in configs/, at its real size; (calibration-efficientnet) the rows of
benchmarks/calibration_efficientnet.yaml, the configs EfficientNet's byte model was read off.
Each row is compiled in a fresh subprocess with its own virtual device count
(`jaxpod.inspect.compile.compile_step`, which reports XLA's device-resident arguments and
temporaries beside the planner's prediction for the CPU backend's device profile). Prints a
table, writes JSON (benchmarks/results/<set>.json).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, options, run_worker, serve_worker, table, write_report  # noqa: E402

ROW_FILES = {
    "heldout": "heldout.yaml",
    "heldout2": "heldout2.yaml",
    "heldout3": "heldout3.yaml",
    "heldout4": "heldout4.yaml",
    "heldout-llama": "heldout_llama.yaml",
    "calibration-efficientnet": "calibration_efficientnet.yaml",
}


def rows(which: str) -> list[dict]:
    if which in ROW_FILES:
        return yaml.safe_load((ROOT / "benchmarks" / ROW_FILES[which]).read_text())
    return [
        {"name": p.stem, "base": f"configs/{p.name}", "mesh": None, "overrides": []}
        for p in sorted((ROOT / "configs").glob("*.yaml"))
    ]


def _overrides(row: dict) -> list[str]:
    if row["mesh"] is None:
        return list(row["overrides"])
    r, p, t = row["mesh"]
    mesh = [f"devices={r * p * t}", f"mesh.replica={r}", f"mesh.pipeline={p}", f"mesh.tensor={t}"]
    return mesh + list(row["overrides"])


def _worker(job: dict) -> dict:
    from jaxpod.config import load_config
    from jaxpod.inspect.compile import compile_step
    from jaxpod.parallel.mesh import make_mesh, select_devices

    cfg = load_config(ROOT / job["base"], job["overrides"])
    return compile_step(cfg, make_mesh(cfg.mesh, select_devices(cfg.total_devices)))


def main() -> None:
    ap = options(__doc__, only="", only_help="rows whose name contains this text")
    ap.add_argument("--set", default="heldout", choices=[*ROW_FILES, "presets"])
    args = ap.parse_args()
    if serve_worker(args, _worker):
        return
    from jaxpod.config import load_config

    results, table_rows = {}, []
    for row in rows(args.set):
        if args.only not in row["name"]:
            continue
        over = _overrides(row)
        devices = load_config(ROOT / row["base"], over).total_devices
        t0 = time.perf_counter()
        print(f"{row['name']}: compiling on {devices} devices ...", file=sys.stderr, flush=True)
        try:
            r = run_worker(__file__, {"base": row["base"], "overrides": over}, devices)
        except RuntimeError as e:
            print(f"  failed: {str(e).splitlines()[-1]}", file=sys.stderr)
            table_rows.append([row["name"], devices, "failed", "", "", "", ""])
            continue
        results[row["name"]] = r
        mb = lambda n: f"{n / 1e6:.1f}"  # noqa: E731
        table_rows.append(
            [
                row["name"],
                devices,
                f"{mb(r['device_argument_bytes'])} / {mb(r['planned_device_argument_bytes'])}",
                f"{mb(r['temp_bytes'])} / {mb(r['planned_temp_bytes'])}",
                mb(r["device_total_bytes"]),
                mb(r["planned_device_total_bytes"]),
                f"{r['planned_ratio']:.2f}",
            ]
        )
        print(
            f"  {time.perf_counter() - t0:.0f} s, planned / XLA {r['planned_ratio']:.2f}",
            file=sys.stderr,
        )
    header = [
        "config",
        "devices",
        "args MB XLA / plan",
        "temps MB XLA / plan",
        "XLA MB",
        "planned MB",
        "plan / XLA",
    ]
    print(table(f"planner vs XLA:CPU, {args.set}", header, table_rows))
    write_report(results, args.out or RESULTS / f"{args.set}.json")


if __name__ == "__main__":
    main()
