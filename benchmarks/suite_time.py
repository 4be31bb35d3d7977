"""Where the test suite's time goes: per test file, the seconds its tests ran and how many of
them jax spent tracing, lowering and XLA spent compiling; per xdist worker, its busy seconds
and when it finished; the heaviest xdist groups; the longest compiles, each with its test and
jitted function (where to look for nearly identical programs). Prints tables, writes JSON.

    python benchmarks/suite_time.py [--out FILE] [--top N] [-- PYTEST ARGS ...]   # or `make test`
    JAXPOD_SUITE_TIME_EVENTS=F PYTHONPATH=benchmarks PYTEST_ADDOPTS="-p suite_time" make test
    python benchmarks/suite_time.py --events F   # the table of that run
    python benchmarks/suite_time.py --yardstick [--events F]   # how fast this machine compiles

Runs `make test` (or pytest with the given arguments) with this file loaded as a plugin in
every process (`PYTEST_ADDOPTS`): it records jax's compile-time events
(`jax.monitoring`: trace, lowering, backend compile, persistent-cache hits) and each test's
duration under the test that was running. Times are wall seconds inside busy worker
processes, so a file's share is what matters, not its absolute seconds; what a test's own
subprocesses compile (`jaxpod` CLI runs, notebook kernels) is in its test seconds only.

The same code takes longer on a slower day of this shared machine (docs/benchmarks.md). With
`--yardstick` the report carries how long one fixed program takes to compile now, before and
after the suite (alone with `--events`): test_pinned's float16 GPT step on 2x2x2, in a fresh
process without the compilation cache, the best of two. Suites timed on different days compare
by their worker-seconds per yardstick-second, roughly: the yardstick is a reading of the same
shared host and moves too (its spread: docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, options, run_worker, serve_worker, table, write_report  # noqa: E402

EVENTS_ENV = "JAXPOD_SUITE_TIME_EVENTS"
LONG_COMPILE_S = 1.0  # compiles at least this long are recorded with their test and function
PHASES = {  # jax.monitoring event -> column
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
    "/jax/compilation_cache/compile_time_saved_sec": "cache_saved_s",
}


# ------------------------------------------------------------------ the plugin (every process)
def _record(**fields) -> None:
    with open(os.environ[EVENTS_ENV], "a") as f:  # one short line per append: no interleaving
        f.write(json.dumps(fields) + "\n")


def pytest_configure(config) -> None:
    if EVENTS_ENV not in os.environ:
        return
    import jax.monitoring

    def on_event(event: str, seconds: float, fun_name: str | None = None, **_) -> None:
        if event in PHASES:
            test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
            fields = {"file": test.split("::")[0], "phase": PHASES[event], "s": seconds}
            if PHASES[event] == "compile_s" and seconds >= LONG_COMPILE_S:
                fields |= {"test": test, "fun": fun_name}
            _record(**fields)

    jax.monitoring.register_event_duration_secs_listener(on_event)


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children that have ended (CLI
    runs, notebook kernels): unlike a test's wall time, not inflated by what the other worker
    runs beside it."""
    import resource

    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Record the CPU seconds of each test (setup, call and teardown) as a `cpu_s` event."""
    before = _cpu_seconds() if EVENTS_ENV in os.environ else None
    yield
    if before is not None:
        cpu = _cpu_seconds() - before
        _record(file=item.nodeid.split("::")[0], phase="cpu_s", s=cpu, test=item.nodeid)


def _group(nodeid: str) -> str | None:
    """The xdist group of a test: what `--dist loadgroup` appended after the id's first `@`
    (after its parameters: `tests/a.py::t[x]@tests/a.py@name` -> `tests/a.py@name`)."""
    tail = nodeid.rsplit("]", 1)[-1]
    return tail.split("@", 1)[1] if "@" in tail else None


def pytest_runtest_logreport(report) -> None:
    if EVENTS_ENV in os.environ and not hasattr(report, "node"):  # in the process that ran it
        _record(
            file=report.nodeid.split("::")[0],
            phase="test_s",
            s=report.duration,
            worker=os.environ.get("PYTEST_XDIST_WORKER", "main"),
            group=_group(report.nodeid),
            end=report.stop,
        )


# ------------------------------------------------------------------ the driver
def summarize(records: list[dict]) -> dict[str, dict]:
    """Per test file: test, trace, lower, compile and cache-saved seconds, and compiles."""
    files: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for r in records:
        counts = files[r["file"] or "(outside a test)"]
        counts[r["phase"]] += r["s"]
        counts["compiles"] += r["phase"] == "compile_s"
    return {name: dict(v) for name, v in files.items()}


def workers(records: list[dict]) -> dict[str, dict]:
    """Per xdist worker: the seconds its tests ran and when its last test ended (seconds after
    the first test's end): a worker that ends early idled while the other worked."""
    rows = [r for r in records if "worker" in r]
    if not rows:
        return {}
    start = min(r["end"] - r["s"] for r in rows)
    out: dict[str, dict] = defaultdict(lambda: {"test_s": 0.0, "last_end_s": 0.0})
    for r in rows:
        w = out[r["worker"]]
        w["test_s"] += r["s"]
        w["last_end_s"] = max(w["last_end_s"], r["end"] - start)
    return dict(sorted(out.items()))


def groups(records: list[dict]) -> dict[str, float]:
    """Per xdist group (tests/conftest.py), the seconds its tests ran, the largest first: the
    order `HEAVY_FIRST` hands them out in."""
    out: dict[str, float] = defaultdict(float)
    for r in records:
        if r.get("group"):
            out[r["group"]] += r["s"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def long_compiles(records: list[dict]) -> list[dict]:
    """The compiles of at least `LONG_COMPILE_S`, the longest first: the test that ran each
    and the jitted function's name (where to look for programs that are nearly the same)."""
    rows = [{"test": r["test"], "fun": r["fun"], "s": r["s"]} for r in records if "fun" in r]
    return sorted(rows, key=lambda r: -r["s"])


def heaviest_tests(records: list[dict]) -> list[dict]:
    """Each test's CPU seconds (its process and its ended children), the most first."""
    rows = [{"test": r["test"], "s": r["s"]} for r in records if r["phase"] == "cpu_s"]
    return sorted(rows, key=lambda r: -r["s"])


def run_pytest(pytest_args: list[str]) -> tuple[str, int]:
    """`make test`, or pytest with `pytest_args`, from the repository root with this plugin;
    the file of its events and its exit code."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as tmp:
        events = tmp.name
    env = dict(os.environ, **{EVENTS_ENV: events})
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")])
    )
    env["PYTEST_ADDOPTS"] = " ".join(filter(None, [env.get("PYTEST_ADDOPTS"), "-p suite_time"]))
    cmd = [sys.executable, "-m", "pytest", *pytest_args] if pytest_args else ["make", "test"]
    print(" ".join(cmd), file=sys.stderr, flush=True)
    return events, subprocess.run(cmd, cwd=ROOT, env=env).returncode


# ------------------------------------------------------------------ the yardstick
def _yardstick_worker(job: dict) -> dict:
    """In a fresh process with 8 virtual devices: seconds to compile the yardstick's train step,
    tests/engine/test_pinned.py's gpt-fp16-222 (configs/tiny.yaml on 2x2x2 with the pinned
    float16 recipe), lowered first; the compilation cache off, so XLA compiles it whole."""
    import time

    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import FP16_LARS, GPT16, TINY_YAML  # jax-free: the pinned case's overrides

    from jaxpod.config import load_config
    from jaxpod.parallel.mesh import make_mesh
    from jaxpod.run.tasks import build_task

    cfg = load_config(TINY_YAML, [*GPT16, *FP16_LARS])
    task, state = build_task(cfg, make_mesh(cfg.mesh))
    lowered = task.engine.train_step.lower(state, task.batch(0))
    t0 = time.perf_counter()
    lowered.compile()
    return {"compile_s": time.perf_counter() - t0}


def yardstick(repeats: int = 2) -> float:
    """The best of `repeats` yardstick compiles, each in its own process (seconds)."""
    print("timing the yardstick compile ...", file=sys.stderr, flush=True)
    return min(run_worker(__file__, {}, 8)["compile_s"] for _ in range(repeats))


def main() -> None:
    ap = options(__doc__, out="suite_time.json")
    ap.add_argument("--top", type=int, default=25, help="rows in the printed table")
    ap.add_argument("--events", help="summarize these recorded events instead of running pytest")
    ap.add_argument("--yardstick", action="store_true", help="time the yardstick compile too")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, pytest_args = ap.parse_args(argv[:cut]), argv[cut + 1 :]
    if serve_worker(args, _yardstick_worker):
        return
    sticks = {("now" if args.events else "before"): yardstick()} if args.yardstick else {}
    if args.events:
        events, returncode, ran = args.events, 0, f"recorded in {args.events}"
    else:
        events, returncode = run_pytest(pytest_args)
        ran = " ".join(["pytest", *pytest_args] if pytest_args else ["make test"])
        if args.yardstick:
            sticks["after"] = yardstick()
    records = [json.loads(line) for line in Path(events).read_text().splitlines()]
    files, busy, grouped = summarize(records), workers(records), groups(records)
    longest = long_compiles(records)
    if not args.events:
        os.unlink(events)
    cols = ["test_s", "cpu_s", "trace_s", "lower_s", "compile_s", "compiles", "cache_saved_s"]
    total = {c: sum(f.get(c, 0) for f in files.values()) for c in cols}
    ranked = sorted(files.items(), key=lambda kv: -kv[1].get("test_s", 0))

    def cells(f: dict) -> list[str]:
        return [
            f"{f.get(c, 0):.0f}"
            if c == "compiles" or abs(f.get(c, 0)) >= 10
            else f"{f.get(c, 0):.1f}"
            for c in cols
        ]

    rows = [[name, *cells(f)] for name, f in ranked[: args.top]] + [["all files", *cells(total)]]
    header = [
        "test file",
        "test s",
        "cpu s",
        "trace s",
        "lower s",
        "compile s",
        "compiles",
        "cache saved s",
    ]
    print(table(f"where the suite's time goes ({ran})", header, rows))
    if busy:
        rows = [[w, f"{b['test_s']:.0f}", f"{b['last_end_s']:.0f}"] for w, b in busy.items()]
        print(table("per worker", ["worker", "test s", "last test ended at s"], rows))
    if grouped:
        rows = [[g, f"{s:.0f}"] for g, s in list(grouped.items())[: args.top]]
        print(table("the heaviest groups", ["xdist group", "test s"], rows))
    heavy = heaviest_tests(records)
    if heavy:
        rows = [[r["test"], f"{r['s']:.1f}"] for r in heavy[: args.top]]
        print(table("the tests that take the most CPU", ["test", "cpu s"], rows))
    if longest:
        rows = [[r["test"], r["fun"], f"{r['s']:.1f}"] for r in longest[: args.top]]
        title = f"the longest compiles ({len(longest)} of at least {LONG_COMPILE_S:.0f} s)"
        print(table(title, ["test", "function", "compile s"], rows))
    if sticks:
        rows = [[when, f"{s:.2f}", f"{total['test_s'] / s:.0f}"] for when, s in sticks.items()]
        header = ["measured", "yardstick compile s", "test s per yardstick s"]
        print(table("the yardstick (module docstring)", header, rows))
    write_report(
        {
            "ran": ran,
            "exit": returncode,
            "total": total,
            "files": files,
            "workers": busy,
            "groups": grouped,
            "long_compiles": longest,
            "cpu": heavy,
            "yardstick_s": sticks,
        },
        args.out,
    )
    raise SystemExit(returncode)


if __name__ == "__main__":
    main()
