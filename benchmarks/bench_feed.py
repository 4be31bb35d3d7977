"""Feeding the step one part at a time (`jaxpod.data.feed.DeviceFeed`) against putting parts ahead.

    python benchmarks/bench_feed.py [--only tiny,digits] [--out FILE]

The training loop reads `data.prefetch` parts ahead into host memory and copies a part to the
device only once the call before it is done: one part on the device, the one the compiled step
counts. Before, the prefetch thread copied parts to the device as it read them and a step's k
parts were put before its first call. Both ways run here in one process on the same programs,
alternating (3 rounds each way after a warm-up), through the real `Prefetcher`, `Task.read`
and `Engine.run_step`:

(time)  seconds per step, the metrics read one step late as the loop reads them
(parts) the most batch parts alive on the devices at any call's dispatch (`jax.live_arrays`)

Configs: `tiny` (the GPT of configs/tiny.yaml, 2x2x2, 16 sequences a step; k = 1 and 4) and
`digits` (configs/efficientnet_digits.yaml, 4x2x1, 64 images; k = 1 and 2). Prints tables,
writes JSON.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, options, run_parts, run_worker, serve_worker, table, write_report  # noqa: E402

CASES = {  # config, devices, batch parts, steps a round
    "tiny": ("tiny.yaml", 8, [1, 4], 20),
    "digits": ("efficientnet_digits.yaml", 8, [1, 2], 4),
}
MODES = ("one part on the device", "parts put ahead")
ROUNDS = 3  # each mode runs `steps` steps this many times, alternating with the other


def _counting(engine, shape: tuple, most: list):
    """`engine` whose calls first record how many arrays of the batch's first `shape` are
    alive (the call's own part among them) into `most[0]` (the largest seen)."""
    import jax

    def wrap(call):
        if call is None:
            return None

        def counted(*args):
            alive = sum(1 for x in jax.live_arrays() if x.shape == shape and not x.is_deleted())
            most[0] = max(most[0], alive)
            return call(*args)

        return counted

    return engine._replace(
        train_step=wrap(engine.train_step),
        first_part_step=wrap(engine.first_part_step),
        accumulate_step=wrap(engine.accumulate_step),
    )


def _run(task, engine, state, mode: str, start: int, steps: int, depth: int):
    """`steps` steps from `start` the loop's way (`mode` 0) or with parts put ahead (1)."""
    from jaxpod.data.feed import DeviceFeed, fetch_when_done
    from jaxpod.data.prefetch import Prefetcher

    k = task.cfg.train.batch_parts
    if mode == MODES[0]:
        read = lambda i: task.read(i // k, part=i % k)  # noqa: E731
    else:
        read = lambda i: task.read(i // k, part=i % k).put()  # noqa: E731
    pending = []
    t0 = time.perf_counter()
    with Prefetcher(read, start * k, (start + steps) * k, depth=depth) as parts:
        feed = DeviceFeed(parts) if mode == MODES[0] else None
        for _ in range(steps):
            if feed is not None:
                state, metrics = engine.run_step(state, feed, feed.dispatched)
            else:
                state, metrics = engine.run_step(state, [next(parts) for _ in range(k)])
            pending.append(metrics)
            if len(pending) > 1:  # the loop reads step N-1 while step N runs
                fetch_when_done(pending.pop(0))
    fetch_when_done(pending)  # the last step done on every device
    return state, (time.perf_counter() - t0) / steps


def _worker(job: dict) -> dict:
    """Runs inside a subprocess whose XLA_FLAGS already hold the device count."""
    from jaxpod.config import load_config
    from jaxpod.parallel.mesh import make_mesh, select_devices
    from jaxpod.run.tasks import build_task

    cfg = load_config(ROOT / "configs" / job["config"], [f"train.batch_parts={job['k']}"])
    task, state = build_task(cfg, make_mesh(cfg.mesh, select_devices(cfg.devices)))
    shape = task.dataset.shapes(cfg.part_batch)[0]
    most = {m: [0] for m in MODES}
    engines = {m: _counting(task.engine, shape, most[m]) for m in MODES}
    times = {m: [] for m in MODES}
    step = 0
    for m in MODES:  # compile and warm up
        state, _ = _run(task, engines[m], state, m, step, 2, cfg.data.prefetch)
        step += 2
    for _ in range(ROUNDS):
        for m in MODES:
            state, seconds = _run(task, engines[m], state, m, step, job["steps"], cfg.data.prefetch)
            times[m].append(seconds)
            step += job["steps"]
    return {
        m: {"step_s": min(times[m]), "step_s_all": times[m], "most_parts": most[m][0]}
        for m in MODES
    }


def bench(name: str) -> tuple[dict, str]:
    config, devices, ks, steps = CASES[name]
    results, rows = {}, []
    for k in ks:
        res = run_worker(__file__, {"config": config, "k": k, "steps": steps}, devices)
        results[f"k={k}"] = res
        base = res[MODES[1]]["step_s"]
        for m in MODES:
            r = res[m]
            ratio = f"{r['step_s'] / base:.2f}"
            rows.append([k, m, f"{r['step_s'] * 1e3:.1f}", ratio, r["most_parts"]])
    header = ["k", "feed", "ms a step (best round)", "/ put ahead", "most parts on the devices"]
    title = f"`{config}` with `data.prefetch` 3: {ROUNDS} rounds of {steps} steps each way"
    return results, table(title, header, rows)


def main() -> None:
    ap = options(__doc__, only="tiny,digits", only_help="configs: tiny, digits", out="feed.json")
    args = ap.parse_args()
    if serve_worker(args, _worker):
        return
    parts = {name: (lambda name=name: bench(name)) for name in CASES}
    write_report(run_parts(parts, args.only), args.out)


if __name__ == "__main__":
    main()
