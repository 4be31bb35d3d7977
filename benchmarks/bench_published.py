"""The step-time model against published runs (`../shared/published/throughput_calibration.csv`).

Each row becomes a `jaxpod.planner.step_time.Workload` and a measured step time (converted
by the source's own FLOP count where it reports TFLOP/s); the model estimates it on the
row's hardware (`jaxpod.planner.speed`). `--fit` fits each chip's `compute_efficiency` on
the training rows only (every row not named in benchmarks/published_heldout.yaml) and
prints the figures to put in speed.py; without it the table reports every row, the
training and the held-out errors apart. Prints a table, writes JSON.

    .venv/bin/python benchmarks/bench_published.py [--fit] [--out results/published.json]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import re
import sys
from pathlib import Path

import yaml

from jaxpod.planner.speed import get_speed
from jaxpod.planner.step_time import Workload, estimate

ROOT = Path(__file__).resolve().parents[1]
CSV = ROOT.parent / "shared" / "published" / "throughput_calibration.csv"
HELDOUT = ROOT / "benchmarks" / "published_heldout.yaml"
CHIPS = {  # hardware column prefix -> speed profile
    "A100-80": "a100-80gb",
    "A100-40": "a100-40gb",
    "A100 (DGX-A100)": "a100-40gb",
    "V100": "v100-32gb",
    "H100": "h100-80gb",
    "TPU v5e": "tpu-v5e",
    "TPU v4": "tpu-v4",
}
FLASH = ("LLMF", "DGXC", "MXT")  # sources whose kernels compute the causal half, fused


def chip_of(row: dict) -> str:
    return next(v for k, v in CHIPS.items() if row["hardware"].startswith(k))


def note(row: dict, pattern: str, default=None):
    m = re.search(pattern, row["notes"])
    return float(m.group(1)) if m else default


def workload(row: dict) -> Workload | None:
    """The row's workload, or None when the source leaves out what it needs."""
    if not row["global_batch"] and not row["micro_batch"]:
        return None
    h, layers, seq = int(row["hidden"]), int(row["layers"]), int(row["seq"])
    t, p, d = (int(row[k] or 1) for k in ("t", "p", "d"))
    c = int(note(row, r"CP=(\d+)", 1))
    gb = int(row["global_batch"] or 0)
    mb = int(row["micro_batch"] or max(gb // d, 1))
    heads = int(row["heads"].split()[0])
    kv = note(row, r"\((\d+) KV\)")
    kv = int(re.search(r"\((\d+) KV\)", row["heads"]).group(1)) if "KV" in row["heads"] else kv
    ffn = int(note(row, r"(?:mlp|FFN) (\d+)", 4 * h))
    zero = row["zero/dist_opt"]
    sharding = "zero3" if "FULL_SHARD" in zero or row["source"].startswith("MXT") else "dp"
    sharding = "zero2" if "SHARD_GRAD_OP" in zero else sharding
    sharding = "zero1" if "dist-opt" in zero else sharding
    rec = row["recompute"]
    return Workload(
        layers=layers,
        hidden=h,
        heads=heads,
        seq=seq,
        vocab=int(row["vocab"] or 0),
        ffn=ffn,
        global_batch=gb or mb * d,
        micro_batch=mb,
        t=t,
        p=p,
        d=d,
        c=c,
        virtual=int(row["vpp"] or 1),
        kv_heads=kv,
        gated=row["source"].startswith(("MXT", "DGXC-L")),  # Llama-family: SwiGLU, RoPE
        rope=row["source"].startswith(("MXT", "DGXC-L")),
        recompute="full" if "full" in rec else ("selective" if "selective" in rec else "none"),
        sequence_parallel=row["seq_parallel"] == "yes",
        sharding=sharding,
        overlap="overlap on" in row["notes"] or "DDP-impl torch" in zero,
        grad_bytes=2 if row["source"] == "MLM20" else 4,
        flash=row["source"].startswith(FLASH),
        dtype="float16" if row["hardware"].startswith("V100") else "bfloat16",
    )


def measured_seconds(row: dict, w: Workload) -> float:
    """The row's step time in seconds, converted with the source's own FLOP count."""
    v, n = float(row["measured_value"]), int(row["n_devices"])
    src = row["source"]
    if src == "NAR21-T1":  # the paper's Eq. 3, per iteration
        b, s, lay, h, voc = w.global_batch, w.seq, w.layers, w.hidden, w.vocab
        f = 96 * b * s * lay * h * h * (1 + s / (6 * h) + voc / (16 * lay * h))
        return f / (v * 1e12 * n)
    if src.startswith("MXT"):  # MaxText's 6·params + attention (full) per token
        from jaxpod.planner.step_time import params

        per_token = 6 * params(w) + 12 * w.layers * w.seq * w.hidden
        return w.global_batch * w.seq * per_token / (v * 1e12 * n)
    if src == "LLMF":
        return w.global_batch * w.seq / (note(row, r"([\d.]+) tok/s/GPU") * n)
    return v / 1000 if row["units"] == "ms" else v


def rows() -> list[tuple[int, dict]]:
    """`(CSV line, row)` of every row; the held-out list checked against the file."""
    table = list(csv.DictReader(CSV.open()))
    held = yaml.safe_load(HELDOUT.read_text())["heldout"]
    for h in held:
        row = table[h["line"] - 2]
        if (row["source"], row["model"], int(row["n_devices"])) != (
            h["source"],
            h["model"],
            h["n_devices"],
        ):
            sys.exit(f"{HELDOUT.name}: line {h['line']} no longer matches the CSV")
    return [(i + 2, r) for i, r in enumerate(table)], {h["line"] for h in held}


def evaluate(efficiency: dict | None = None) -> list[dict]:
    """One record per modelled row: measured and predicted seconds, the split it is in."""
    table, held = rows()
    out = []
    for line, row in table:
        w = workload(row)
        if w is None:
            continue
        speed = get_speed(chip_of(row))
        if efficiency and speed.name in efficiency:
            speed = dataclasses.replace(speed, compute_efficiency=efficiency[speed.name])
        est = estimate(w, speed)
        meas = measured_seconds(row, w)
        out.append(
            {
                "line": line,
                "source": row["source"],
                "model": row["model"],
                "chip": speed.name,
                "devices": int(row["n_devices"]),
                "mapping": f"t{w.t} p{w.p} d{w.d} c{w.c} v{w.virtual}",
                "split": "heldout" if line in held else "train",
                "measured_s": meas,
                "predicted_s": est["step_s"],
                "ratio": est["step_s"] / meas,
                "breakdown": est,
            }
        )
    return out


def fit() -> dict:
    """Each chip's efficiency minimising the mean |log(predicted / measured)| of its
    training rows (a scan over 0.20 ... 0.95)."""
    chips = sorted({r["chip"] for r in evaluate() if r["split"] == "train"})
    best = {}
    for chip in chips:

        def loss(e, chip=chip):
            recs = [r for r in evaluate({chip: e}) if r["chip"] == chip and r["split"] == "train"]
            return sum(abs(math.log(r["ratio"])) for r in recs) / len(recs)

        best[chip] = min((round(0.2 + 0.01 * i, 2) for i in range(76)), key=loss)
    return best


def summary(recs: list[dict]) -> str:
    lines = [
        "| split | rows | within 10 % | within 15 % | within 20 % | median |ratio-1| | worst |",
        "|---|---|---|---|---|---|---|",
    ]
    for split in ("train", "heldout"):
        rs = [r for r in recs if r["split"] == split]
        errs = sorted(abs(r["ratio"] - 1) for r in rs)
        worst = max(rs, key=lambda r: abs(r["ratio"] - 1))
        lines.append(
            f"| {split} | {len(rs)} | {sum(e <= 0.1 for e in errs)} | "
            f"{sum(e <= 0.15 for e in errs)} | {sum(e <= 0.2 for e in errs)} | "
            f"{errs[len(errs) // 2]:.1%} | "
            f"{worst['source']} {worst['model']} ({worst['ratio']:.2f}) |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fit", action="store_true", help="fit each chip's efficiency (train rows)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/published.json")
    args = ap.parse_args()
    if args.fit:
        print("compute_efficiency fitted on the training rows:", fit())
        return
    recs = evaluate()
    print("| line | source | model | chip | N | mapping | split | measured s | model s | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in recs:
        print(
            f"| {r['line']} | {r['source']} | {r['model']} | {r['chip']} | {r['devices']} | "
            f"{r['mapping']} | {r['split']} | {r['measured_s']:.3g} | {r['predicted_s']:.3g} | "
            f"{r['ratio']:.2f} |"
        )
    table, _ = rows()
    for line, row in table:
        if workload(row) is None:
            print(
                f"not modelled: line {line} {row['source']} {row['model']}: the source "
                "gives no micro-batch or global batch"
            )
    print()
    print(summary(recs))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(recs, indent=1))
    print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
