"""`make figures` (`python -m jaxpod.figures`): every figure of the docs, written to
`docs/figures/*.png` deterministically (Agg, fixed sizes and seeds, no timestamps).

    python -m jaxpod.figures [--only NAME,...] [--refresh compiled,meshes,digits] [--out DIR]

The figures come from jaxpod itself (the schedule tables, the planner, `stochastic_round`)
and from committed data: `docs/figures/data/` (see `jaxpod.figures.data`, recomputed with
`--refresh`), `docs/results/` (the digits run) and `docs/figures/data/schedules.json`
(`benchmarks/bench_schedules.py`). A figure whose data is missing is skipped with a message.
Each `*_figure()` returns a matplotlib figure; the notebooks call the same functions.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxpod.figures import data, save

OUT = data.ROOT / "docs" / "figures"
SCHEDULE_BENCH = data.ROOT / "docs" / "figures" / "data" / "schedules.json"
PRESET_LABELS = {
    "bert_large_pod16": "BERT-L POD16\n4x4x1",
    "bert_large_pod16_pipeline8": "BERT-L POD16\n2x8x1, seq 512",
    "gpt3_175b_pod256": "GPT-3 POD256\n4x8x8",
    "efficientnet_b4_g16_pod16": "EffNet-B4\nPOD16 8x2x1",
    "efficientnet_b4_g16_pod64": "EffNet-B4\nPOD64 32x2x1",
    "efficientnet_b4_g16_pod128": "EffNet-B4\nPOD128 64x2x1",
    "efficientnet_b4_g16_pod256": "EffNet-B4\nPOD256 128x2x1",
}
XLA_TPU = "XLA:TPU compiled total"
TPU_LABELS = {
    "bert_large_tpu_v5p": "BERT-L\nv5p 2x2x4",
    "efficientnet_b4_g16_tpu_v5e16": "EffNet-B4\nv5e 4x4",
    "efficientnet_b4_g16_tpu_v5e256": "EffNet-B4\nv5e 16x16",
    "gpt3_175b_tpu_v5p": "GPT-3\nv5p 8x8x4",
    "llama3_8b_tpu_v5p": "Llama-3 8B\nv5p 4x4x4",
}


class MissingData(Exception):
    """A figure's committed data file is not there (the message says how to make it)."""


def schedules_figure(stages: int = 4, micro: int = 8):
    """Every schedule's table (`TABLE_CASES`) as a tick chart in lockstep time."""
    from jaxpod.figures.schedule import TABLE_CASES
    from jaxpod.figures.schedule import schedules_figure as draw

    return draw(stages, micro, TABLE_CASES)


def presets_figure(compiled: dict | None = None):
    """Bytes per device of each full-size preset, like beside like: the TPU presets'
    planned bytes (their `tpu-*` profile) beside XLA:TPU's compiled HBM per chip; apart, the
    GC200 presets' planned bytes alone (no XLA backend compiles for an IPU)."""
    import matplotlib.pyplot as plt

    from jaxpod.config.presets import TPU_SLICES
    from jaxpod.figures.memory import draw_bytes, legend_entries

    compiled = data.load("compiled_tpu.json") if compiled is None else compiled
    tpu_plans, xla, stale = _plans(TPU_SLICES, TPU_LABELS, memory=True), {}, set()
    for name, label in zip(TPU_SLICES, tpu_plans, strict=True):
        entry = (compiled or {}).get(name)
        if entry and entry.get("preset_digest") == data.preset_digest(name):
            xla[label] = entry["device_total_bytes"]
        else:
            stale.add(name)
    _say_missing(stale)
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 4.8), gridspec_kw={"width_ratios": [5, 7]})
    when = f", {compiled['date']}" if xla else ""
    draw_bytes(
        left,
        tpu_plans,
        xla,
        beside_label=XLA_TPU,
        title=f"TPU presets: planner (tpu-* profile) and XLA:TPU's program{when}",
        legend=False,
        limits=False,  # 16 to 95 GiB of HBM: every bar is far below it (in the labels)
    )
    draw_bytes(
        right,
        _plans(data.PRESETS, PRESET_LABELS),
        title="GC200 presets: planner only (ipu-gc200; no XLA backend for an IPU)",
        legend=False,
    )
    fig.legend(
        *legend_entries([left, right], XLA_TPU), loc="center right", fontsize=7, frameon=False
    )
    fig.tight_layout(rect=(0, 0, 0.9, 1))
    return fig


def _plans(names, labels: dict[str, str], memory: bool = False) -> dict[str, dict]:
    """The planner's report of each preset in `names`, by its bar label (with the device's
    memory under it if `memory`)."""
    from jaxpod.config import load_config
    from jaxpod.planner.plan import plan
    from jaxpod.planner.report import format_bytes

    plans = {n: plan(load_config(data.ROOT / "configs" / f"{n}.yaml")) for n in names}
    return {
        labels[n] + (f"\n{format_bytes(p['device_memory_bytes'])} HBM" if memory else ""): p
        for n, p in plans.items()
    }


def _say_missing(stale: set[str]) -> None:
    if stale:
        print(
            f"no XLA bar for {', '.join(sorted(stale))}: compiled_tpu.json does not hold this "
            "preset (`python -m jaxpod.figures --refresh compiled-tpu`)",
            file=sys.stderr,
        )


def mesh_losses_figure():
    """The demo's loss and validation loss on each mesh (`docs/figures/data/demo_meshes.json`)."""
    import matplotlib.pyplot as plt

    from jaxpod.figures.curves import draw_losses

    meshes = _need("demo_meshes.json", "meshes")
    fig, ax = plt.subplots(figsize=(8, 4.2))
    draw_losses(ax, meshes["runs"])
    ax.get_legend().set_title("replica x pipeline x tensor", prop={"size": 7})
    ax.set_title(
        f"configs/demo.yaml, {data.MESH_STEPS} steps, 32 sequences a step, each mesh", fontsize=10
    )
    fig.tight_layout()
    return fig


def rounding_figure():
    """Float16 rounding error, and 1000 sub-ulp updates with either rounding."""
    import matplotlib.pyplot as plt

    from jaxpod.figures.rounding import draw_errors, draw_stall, rounding_errors, stall

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4))
    draw_errors(ax0, rounding_errors())
    draw_stall(ax1, stall())
    fig.tight_layout()
    return fig


def digits_figure():
    """EfficientNet digits accuracy over steps: 8 devices (4x2x1) vs 1 device."""
    import matplotlib.pyplot as plt

    from jaxpod.figures.curves import draw_accuracy

    one = _need("digits_1device.json", "digits")
    runs = {"8 devices (4x2x1)": data.digits_8devices(), "1 device": one["records"]}
    fig, ax = plt.subplots(figsize=(8, 4.2))
    draw_accuracy(ax, runs)
    ax.set_title(
        "configs/efficientnet_digits.yaml: EfficientNet-B0 G16, FP16 + SR, LARS", fontsize=10
    )
    fig.tight_layout()
    return fig


def schedule_bench_figure(path: Path = SCHEDULE_BENCH):
    """Memory and step time of each schedule against M (`benchmarks/bench_schedules.py`)."""
    import matplotlib.pyplot as plt

    from jaxpod.figures.schedule import draw_measurements

    if not path.exists():
        raise MissingData(
            f"{path.relative_to(data.ROOT)} is not there: run "
            "`python benchmarks/bench_schedules.py` (tens of minutes) to measure it"
        )
    report = json.loads(path.read_text())
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    draw_measurements(axes, report)
    date = report.get("machine", {}).get("date", "")
    fig.suptitle(
        f"pipeline schedules measured on {report.get('machine', {}).get('cpus')} CPU "
        f"cores, {date} (benchmarks/bench_schedules.py)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def _need(name: str, refresh: str) -> dict:
    found = data.load(name)
    if found is None:
        raise MissingData(
            f"docs/figures/data/{name} is not there: `python -m jaxpod.figures --refresh {refresh}`"
        )
    return found


FIGURES = {
    "pipeline_schedules": schedules_figure,
    "bytes_per_device": presets_figure,
    "demo_loss_by_mesh": mesh_losses_figure,
    "float16_rounding": rounding_figure,
    "digits_accuracy": digits_figure,
    "schedule_measurements": schedule_bench_figure,
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m jaxpod.figures", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--only", help=f"comma-separated, of: {', '.join(FIGURES)}")
    ap.add_argument(
        "--refresh", default="", help=f"recompute data first: {', '.join(data.REFRESH)}"
    )
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcdefaults()  # no user matplotlibrc: the same pixels on every machine
    import matplotlib.pyplot as plt

    for name in filter(None, args.refresh.split(",")):
        data.REFRESH[name]()
    names = args.only.split(",") if args.only else list(FIGURES)
    for name in names:
        try:
            fig = FIGURES[name]()
        except MissingData as err:
            print(f"skipped {name}: {err}", file=sys.stderr)
            continue
        path = save(fig, args.out / f"{name}.png")
        plt.close(fig)
        print(f"wrote {path.relative_to(data.ROOT) if path.is_relative_to(data.ROOT) else path}")
