"""`jaxpod search` on Megatron-LM's Table 1 (Narayanan et al. 2021: GPT 1.7B to 1T on 32 to 3,072
A100-80GB, `../shared/published/throughput_calibration.csv`, rows NAR21-T1): each model searched
at its GPU count and global batch, and where the published mapping ranks among the mappings
jaxpod finds that fit.

Each row becomes the tiny preset with the row's shape (d_ff 4h, vocabulary 51,200), float16
weights and compute with float32 masters and a dynamic loss scale, AdamW (Megatron's mixed
precision). The published mapping is written as the search writes one: its (t, p, d), micro-
batch, 1F1B (interleaved 1F1B with its virtual stages) and full recomputation, no RTS. Its
rank is its place in the search's ranking (the step-time model for jaxpod's lockstep
program, `jaxpod.planner.step_time`); where jaxpod prefers another, the table names the term
of the breakdown that differs most and by how much. Prints a table, writes JSON.

    .venv/bin/python benchmarks/bench_megatron_search.py [--out results/megatron_search.json]
"""

from __future__ import annotations

import csv
import time
from pathlib import Path

from common import ROOT, machine, options, write_report

from jaxpod.errors import ConfigError
from jaxpod.inspect.estimate import estimate_config
from jaxpod.inspect.search import mapping_maker, reason, search
from jaxpod.planner.plan import plan

CSV = ROOT.parent / "shared" / "published" / "throughput_calibration.csv"
PROFILE = "a100-80gb"


def table_rows() -> list[dict]:
    """The ten NAR21-T1 rows, each once (the file repeats some)."""
    seen, out = set(), []
    for row in csv.DictReader(Path(CSV).open()):
        if row["source"] == "NAR21-T1" and row["model"] not in seen:
            seen.add(row["model"])
            out.append(row)
    return out


def shape(row: dict) -> list[str]:
    h = int(row["hidden"])
    return [
        f"model.layers={row['layers']}",
        f"model.d_model={h}",
        f"model.heads={row['heads']}",
        f"model.d_ff={4 * h}",
        f"model.seq_len={row['seq']}",
        f"model.vocab={row['vocab']}",
        "precision.params=float16",
        "precision.compute=float16",
        "precision.master=float32",
        "precision.loss_scale=dynamic",
        "optim.name=adamw",
    ]


def published(row: dict) -> list[str]:
    """The row's mapping in the search's own override form."""
    t, p, d, v, mb = (int(row[k] or 1) for k in ("t", "p", "d", "vpp", "micro_batch"))
    accum = int(row["global_batch"]) // (d * mb)
    kind = "interleaved-1f1b" if v > 1 else "1f1b" if p > 1 else "gpipe"
    return [
        f"mesh.replica={d}",
        f"mesh.pipeline={p}",
        f"mesh.tensor={t}",
        f"train.micro_batch={mb}",
        f"train.grad_accum={accum}",
        "train.global_batch=null",
        f"train.pipeline_schedule={kind}",
        f"train.virtual_stages={v}",
        "model.remat=full",
        "memory.rts=1",
        "memory.rts_optimizer=1",
    ]


def mesh_of(overrides: list[str]) -> str:
    """`t8 p64 d6 mb1 1f1b V1 full rts1`, a mapping in a few words."""
    v = dict(o.split("=", 1) for o in overrides)
    return (
        f"t{v['mesh.tensor']} p{v['mesh.pipeline']} d{v['mesh.replica']} "
        f"mb{v['train.micro_batch']} {v['train.pipeline_schedule']} "
        f"V{v['train.virtual_stages']} {v['model.remat']} rts{v['memory.rts']}"
    )


def evaluate(row: dict) -> dict:
    """Search the row's model at its GPU count and batch; place its published mapping."""
    n, batch = int(row["n_devices"]), int(row["global_batch"])
    t0 = time.process_time()
    found = search("tiny", shape(row), PROFILE, n, batch)
    cpu_s = time.process_time() - t0
    mine = published(row)
    ranked = found["top"]
    rank = next((i for i, m in enumerate(ranked, 1) if m["overrides"] == mine), None)
    entry = ranked[rank - 1] if rank else None
    why = "ranked"
    if entry is None:  # not enumerated, invalid, or not fitting: say which
        try:
            cfg = mapping_maker("tiny", shape(row), PROFILE, n)(mine)
        except ConfigError as exc:
            entry, why = None, f"invalid: {exc}"
        else:
            planned = plan(cfg, advice=False)
            entry = {"overrides": mine, "estimate": estimate_config(cfg, PROFILE)}
            why = "does not fit" if not planned["fits"] else "not enumerated"
    top = ranked[0]
    return {
        "model": row["model"],
        "gpus": n,
        "global_batch": batch,
        "considered": found["considered"],
        "fitting": found["fitting"],
        "cpu_s": round(cpu_s, 2),
        "published": mesh_of(mine),
        "published_rank": rank,
        "published_note": why,
        "published_step_s": entry["estimate"]["step_time_s"] if entry else None,
        "top": mesh_of(top["overrides"]),
        "top_step_s": top["estimate"]["step_time_s"],
        "top_beats_published_by": reason(top, entry) if entry and rank != 1 else "",
    }


def markdown(results: list[dict]) -> str:
    lines = [
        "| model | GPUs | published mapping | its rank (of fitting) | its step s | "
        "search's first | its step s | the first beats it by |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rank = r["published_rank"] or r["published_note"]
        pub = f"{r['published_step_s']:.2f}" if r["published_step_s"] else "-"
        lines.append(
            f"| {r['model']} | {r['gpus']} | {r['published']} | {rank} ({r['fitting']:,}) | "
            f"{pub} | {r['top']} | {r['top_step_s']:.2f} | {r['top_beats_published_by']} |"
        )
    return "\n".join(lines)


def main() -> None:
    args = options(__doc__, out="megatron_search.json").parse_args()
    results = []
    for row in table_rows():
        results.append(evaluate(row))
        r = results[-1]
        print(f"{r['model']}: {r['considered']} mappings in {r['cpu_s']} CPU-s", flush=True)
    print(markdown(results))
    write_report({"machine": machine(), "rows": results}, args.out)


if __name__ == "__main__":
    main()
