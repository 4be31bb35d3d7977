"""The `image-folder` loader alone, in images/s, beside the images/s a training step takes.

    python benchmarks/bench_images.py [--only loader,step] [--files 256] [--out FILE]

(loader) `--files` generated JPEGs of 500x375 (ImageNet's commonest size; quality 90, smooth
random content, 8 classes) read by `jaxpod.data.image_folder` as the training loop reads
them: batches of 64 rows through a `Prefetcher` of depth 3 (`data.prefetch`), decoded by
`data.workers` threads, cut to 224 (EfficientNet-B0) and 380 (B4): training views (random
crop and flip) and validation views (centre crop). One warm-up batch, then the images/s of
the next batches, best of 2 rounds; and the loader's own peak bytes (`ledger`).
(step) `configs/efficientnet_digits.yaml` (32x32 digits, 64 images a step, 4x2x1 on 8
virtual CPU devices) compiled, 2 warm-up steps, then the median of 5: the images/s a step
consumes on this host. Prints tables, writes JSON.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, options, run_parts, run_worker, serve_worker, table, write_report  # noqa: E402

SIZES = (224, 380)
WORKERS = (1, 2, 4)
BATCH = 64
DEPTH = 3
ROUNDS = 2


def _jpegs(root: Path, n: int) -> int:
    """`n` 500x375 JPEGs (smooth random content) in 8 classes under `root`; their bytes."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    total = 0
    for i in range(n):
        small = rng.integers(0, 256, size=(24, 32, 3), dtype=np.uint8)
        image = Image.fromarray(small).resize((500, 375), Image.Resampling.BICUBIC)
        path = root / f"class{i % 8}" / f"{i:05d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path, quality=90)
        total += path.stat().st_size
    return total


def _rate(ds, split: str, batches: int) -> float:
    """Images/s of `batches` batches of `split` after one, through the loop's Prefetcher."""
    from jaxpod.data.prefetch import Prefetcher

    def read(k):
        return ds.read(split, k, 0, BATCH, BATCH)

    best = 0.0
    for r in range(ROUNDS):
        start = r * (batches + 1)
        with Prefetcher(read, start, start + batches + 1, depth=DEPTH) as items:
            next(items)  # the first batch: threads start, files enter the page cache
            t0 = time.perf_counter()
            for _ in items:
                pass
            best = max(best, batches * BATCH / (time.perf_counter() - t0))
    return best


def loader(files: int) -> tuple[dict, str]:
    from jaxpod.data.images import load_images

    results, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        size_on_disk = _jpegs(Path(tmp), files)
        batches = max(2, files // BATCH)
        for s in SIZES:
            for workers, split in [*((w, "train") for w in WORKERS), (WORKERS[-1], "val")]:
                ds = load_images("image-folder", image_size=s, seed=0, path=tmp, workers=workers)
                rate = _rate(ds, split, batches if split == "train" else 1)
                peak = ds.peak_bytes / 2**20
                results[f"{s}/{split}/{workers}"] = {"images_per_s": rate, "peak_mib": peak}
                rows.append([s, split, workers, f"{rate:.0f}", f"{peak:.1f}"])
    header = ["size", "view", "threads", "images/s", "loader peak MiB"]
    title = f"{files} JPEGs 500x375 ({size_on_disk / files / 1024:.0f} KiB each), batch {BATCH}"
    results["jpeg_bytes_mean"] = size_on_disk / files
    return results, table(title, header, rows)


def _worker(job: dict) -> dict:
    """Runs in a subprocess with 8 virtual devices: the digits step's seconds."""
    import statistics

    from common import time_steps

    from jaxpod.config import load_config
    from jaxpod.parallel.mesh import make_mesh, select_devices
    from jaxpod.run.tasks import build_task

    cfg = load_config(ROOT / "configs" / "efficientnet_digits.yaml", [])
    task, state = build_task(cfg, make_mesh(cfg.mesh, select_devices(cfg.devices)))
    batch = task.batch(0)
    step = lambda s, b: task.engine.run_step(s, [b])  # noqa: E731
    _, _, times = time_steps(step, state, batch, repeats=5)
    return {"step_s": statistics.median(times), "images_per_step": cfg.global_batch}


def step() -> tuple[dict, str]:
    res = run_worker(__file__, {}, 8)
    need = res["images_per_step"] / res["step_s"]
    res["images_per_s"] = need
    row = ["efficientnet_digits (4x2x1)", res["images_per_step"], f"{res['step_s'] * 1e3:.0f}"]
    header = ["config", "images a step", "ms a step (median of 5)", "images/s it takes"]
    return res, table("the step's need", header, [[*row, f"{need:.0f}"]])


def main() -> None:
    ap = options(__doc__, only="loader,step", only_help="parts: loader, step", out="images.json")
    ap.add_argument("--files", type=int, default=256, help="generated JPEGs")
    args = ap.parse_args()
    if serve_worker(args, _worker):
        return
    parts = {"loader": lambda: loader(args.files), "step": step}
    write_report(run_parts(parts, args.only), args.out)


if __name__ == "__main__":
    main()
