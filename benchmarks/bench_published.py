"""The step-time model against published runs (`../shared/published/throughput_calibration.csv`).

Each row becomes a jaxpod config (`published_configs.py`: `configs/tiny.yaml` and overrides)
whose step-time workload is `jaxpod estimate`'s, with what a config cannot carry (fused
attention, overlap, MPMD pipelines, the gradient width) set from the run; a row jaxpod
cannot express (context parallelism) keeps a `Workload` written from the file, and says so.
With a measured step time (converted by the source's own FLOP count where it reports
TFLOP/s), the model estimates it on the row's hardware (`jaxpod.planner.speed`). `--fit`
fits each chip's `compute_efficiency` on the training rows only (every row not named in
benchmarks/published_heldout.yaml) and prints the figures to put in speed.py; without it
the table reports every row, the training and the held-out errors apart, and how each row
was modelled. Prints a table, writes JSON.

    .venv/bin/python benchmarks/bench_published.py [--fit] [--out results/published.json]
    .venv/bin/python benchmarks/bench_published.py --command LINE  # its `jaxpod estimate`
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import json
import math
import re
import sys
from pathlib import Path

import yaml
from published_configs import config_overrides, config_workload, differences

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
        schedule="interleaved-1f1b" if int(row["vpp"] or 1) > 1 else "1f1b",
        kv_heads=kv or heads,  # multi-head attention: a key/value head per query head
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


@functools.cache
def modelled() -> tuple[dict, ...]:
    """Each row with a workload: the line, the row, the split, the workload priced (its
    config's, `published_configs.config_workload`; the direct one where the row is no
    config) and how it was modelled."""
    table, held = rows()
    out = []
    for line, row in table:
        direct = workload(row)
        if direct is None:
            continue
        config = config_workload(row, direct)
        expressible = not isinstance(config, str)
        out.append(
            {
                "line": line,
                "row": row,
                "split": "heldout" if line in held else "train",
                "workload": config if expressible else direct,
                "modelled_as": "config" if expressible else "workload",
                "not_config": None if expressible else config,
                "overrides": config_overrides(row) if expressible else None,
                "differences": differences(config, direct) if expressible else {},
            }
        )
    return tuple(out)


def evaluate(efficiency: dict | None = None) -> list[dict]:
    """One record per modelled row: measured and predicted seconds, the split it is in, how
    it was modelled."""
    out = []
    for m in modelled():
        row, w = m["row"], m["workload"]
        speed = get_speed(chip_of(row))
        if efficiency and speed.name in efficiency:
            speed = dataclasses.replace(speed, compute_efficiency=efficiency[speed.name])
        est = estimate(w, speed)
        meas = measured_seconds(row, w)
        out.append(
            {
                "line": m["line"],
                "source": row["source"],
                "model": row["model"],
                "chip": speed.name,
                "devices": int(row["n_devices"]),
                "mapping": f"t{w.t} p{w.p} d{w.d} c{w.c} v{w.virtual}",
                **{k: m[k] for k in ("modelled_as", "not_config", "overrides", "differences")},
                "split": m["split"],
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


def report(recs: list[dict]) -> None:
    """Print the table, the rows not modelled or modelled without a config (and why), the
    config fields that differ from the row's, and the summary."""
    print(
        "| line | source | model | chip | N | mapping | as | split | measured s | model s | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in recs:
        print(
            f"| {r['line']} | {r['source']} | {r['model']} | {r['chip']} | {r['devices']} | "
            f"{r['mapping']} | {r['modelled_as']} | {r['split']} | {r['measured_s']:.3g} | "
            f"{r['predicted_s']:.3g} | {r['ratio']:.2f} |"
        )
    for line, row in rows()[0]:
        if workload(row) is None:
            print(f"not modelled: line {line} {row['source']} {row['model']}: ", end="")
            print(config_overrides(row))
    for r in recs:
        if r["not_config"]:
            print(f"no config (its workload written directly): line {r['line']} ", end="")
            print(f"{r['source']} {r['model']}: {r['not_config']}")
        for name, why in r["differences"].items():
            print(f"config differs: line {r['line']} {r['source']} {r['model']}: {name}: {why}")
    print()
    print(summary(recs))


def command(line: int) -> str:
    """The `jaxpod estimate` command of the CSV line's config on its hardware (the target
    sets `devices`)."""
    row = dict(rows()[0])[line]
    overrides = config_overrides(row)
    if isinstance(overrides, str):
        print(f"--command {line}: the row is no jaxpod config: {overrides}", file=sys.stderr)
        sys.exit(2)
    words = [o for o in overrides if not o.startswith("devices=")]
    target = f"{chip_of(row)}:{row['n_devices']}"
    return " ".join(["jaxpod estimate configs/tiny.yaml", *words, f"--target {target}"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fit", action="store_true", help="fit each chip's efficiency (train rows)")
    ap.add_argument("--command", type=int, metavar="LINE", help="the CSV line's estimate command")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/published.json")
    args = ap.parse_args()
    if args.command:
        print(command(args.command))
        return
    if args.fit:
        print("compute_efficiency fitted on the training rows:", fit())
        return
    recs = evaluate()
    report(recs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(recs, indent=1))
    print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
