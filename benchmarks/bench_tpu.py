"""The planner against XLA:TPU: mappings compiled for TPU topologies with no TPU attached.

    python benchmarks/bench_tpu.py [--set heldout|calibration|presets] [--only TEXT]
                                   [--out FILE]

(heldout) the rows of benchmarks/heldout_tpu.yaml, fixed in a commit before the planner had
any TPU term, never tuned on; (calibration) benchmarks/calibration_tpu.yaml, the rows TPU
terms may be read off; (presets) the full-size TPU presets (`PRESETS`), each on its slice.
Each row is compiled in a fresh subprocess as
`jaxpod compile CONFIG --target TARGET` compiles it (`jaxpod.inspect.compile.compile_for_target`):
XLA:TPU's HBM bytes per chip (its buffer assignment's device memory space) beside the
planner's for the target's profile, the host bytes, the compile time. Prints a table, writes
JSON (benchmarks/results/tpu-<set>.json).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, options, run_worker, serve_worker, table, write_report  # noqa: E402

from jaxpod.config.presets import TPU_SLICES as PRESETS  # noqa: E402

ROW_FILES = {"heldout": "heldout_tpu.yaml", "calibration": "calibration_tpu.yaml"}


def rows(which: str) -> list[dict]:
    """`{"name", "base", "target", "overrides"}` of the set: a row file's rows with their mesh
    as overrides, or the presets."""
    if which in ROW_FILES:
        out = []
        for row in yaml.safe_load((ROOT / "benchmarks" / ROW_FILES[which]).read_text()):
            r, p, t = row["mesh"]
            mesh = [f"mesh.replica={r}", f"mesh.pipeline={p}", f"mesh.tensor={t}"]
            out.append({**row, "overrides": mesh + list(row["overrides"])})
        return out
    return [
        {"name": name, "base": f"configs/{name}.yaml", "overrides": [], "target": target}
        for name, target in PRESETS.items()
    ]


def _worker(job: dict) -> dict:
    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # compile-only: nothing to load
    from jaxpod.config import load_config
    from jaxpod.inspect.compile import compile_for_target
    from jaxpod.target.spec import parse_target

    target = parse_target(job["target"])
    cfg = load_config(ROOT / job["base"], [*job["overrides"], f"devices={target.chips}"])
    return compile_for_target(cfg, target)


def _row(name: str, r: dict) -> list:
    mb = lambda n: f"{n / 1e6:,.1f}"  # noqa: E731
    return [
        name,
        r["target"],
        f"{mb(r['device_argument_bytes'])} / {mb(r['planned_device_argument_bytes'])}",
        mb(r["device_total_bytes"]),
        mb(r["planned_device_total_bytes"]),
        f"{r['planned_ratio']:.2f}",
        f"{mb(r['host_argument_bytes'] + r['host_temp_bytes'])} / {mb(r['planned_host_bytes'])}",
        f"{r['compile_s']:.0f}",
    ]


def main() -> None:
    ap = options(__doc__, only="", only_help="rows whose name contains this text")
    ap.add_argument("--set", default="heldout", choices=[*ROW_FILES, "presets"])
    args = ap.parse_args()
    if serve_worker(args, _worker):
        return
    results, table_rows = {}, []
    for row in rows(args.set):
        if args.only not in row["name"]:
            continue
        t0 = time.perf_counter()
        print(f"{row['name']}: compiling for {row['target']} ...", file=sys.stderr, flush=True)
        try:
            job = {k: row[k] for k in ("base", "target", "overrides")}
            r = run_worker(__file__, job, 1)
        except RuntimeError as e:
            print(f"  failed: {str(e).splitlines()[-1]}", file=sys.stderr)
            table_rows.append([row["name"], row["target"], "failed", "", "", "", "", ""])
            continue
        results[row["name"]] = r
        table_rows.append(_row(row["name"], r))
        print(
            f"  {time.perf_counter() - t0:.0f} s, planned / XLA {r['planned_ratio']:.2f}",
            file=sys.stderr,
        )
    header = [
        "config",
        "target",
        "HBM args MB XLA / plan",
        "XLA HBM MB",
        "planned MB",
        "plan / XLA",
        "host MB XLA / plan",
        "compile s",
    ]
    print(table(f"planner vs XLA:TPU, {args.set}", header, table_rows))
    write_report(results, args.out or RESULTS / f"tpu-{args.set}.json")


if __name__ == "__main__":
    main()
