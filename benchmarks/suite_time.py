"""Where the test suite's time goes: per test file, the seconds its tests ran and how many of
them jax spent tracing, lowering and XLA spent compiling. Prints a table, writes JSON.

    python benchmarks/suite_time.py [--out FILE] [--top N] [-- PYTEST ARGS ...]   # or `make test`
    JAXPOD_SUITE_TIME_EVENTS=F PYTHONPATH=benchmarks PYTEST_ADDOPTS="-p suite_time" make test
    python benchmarks/suite_time.py --events F   # the table of that run

Runs `make test` (or pytest with the given arguments) with this file loaded as a plugin in
every process (`PYTEST_ADDOPTS`): it records jax's compile-time events
(`jax.monitoring`: trace, lowering, backend compile, persistent-cache hits) and each test's
duration under the test that was running. Times are wall seconds inside busy worker
processes, so a file's share is what matters, not its absolute seconds; what a test's own
subprocesses compile (`jaxpod` CLI runs, notebook kernels) is in its test seconds only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, options, table, write_report  # noqa: E402

EVENTS_ENV = "JAXPOD_SUITE_TIME_EVENTS"
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

    def on_event(event: str, seconds: float, **_) -> None:
        if event in PHASES:
            test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0]
            _record(file=test, phase=PHASES[event], s=seconds)

    jax.monitoring.register_event_duration_secs_listener(on_event)


def pytest_runtest_logreport(report) -> None:
    if EVENTS_ENV in os.environ and not hasattr(report, "node"):  # in the process that ran it
        _record(file=report.nodeid.split("::")[0], phase="test_s", s=report.duration)


# ------------------------------------------------------------------ the driver
def summarize(path: str) -> dict[str, dict]:
    """Per test file: test, trace, lower, compile and cache-saved seconds, and compiles."""
    files: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        counts = files[r["file"] or "(outside a test)"]
        counts[r["phase"]] += r["s"]
        counts["compiles"] += r["phase"] == "compile_s"
    return {name: dict(v) for name, v in files.items()}


def run_pytest(pytest_args: list[str]) -> tuple[dict[str, dict], int]:
    """`make test`, or pytest with `pytest_args`, from the repository root with this plugin;
    its files' summary and exit code."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as tmp:
        events = tmp.name
    env = dict(os.environ, **{EVENTS_ENV: events})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                      env.get("PYTHONPATH")]))  # fmt: skip
    env["PYTEST_ADDOPTS"] = " ".join(filter(None, [env.get("PYTEST_ADDOPTS"), "-p suite_time"]))
    cmd = [sys.executable, "-m", "pytest", *pytest_args] if pytest_args else ["make", "test"]
    print(" ".join(cmd), file=sys.stderr, flush=True)
    returncode = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    files = summarize(events)
    os.unlink(events)
    return files, returncode


def main() -> None:
    ap = options(__doc__, out="suite_time.json")
    ap.add_argument("--top", type=int, default=25, help="rows in the printed table")
    ap.add_argument("--events", help="summarize these recorded events instead of running pytest")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, pytest_args = ap.parse_args(argv[:cut]), argv[cut + 1 :]
    if args.events:
        files, returncode, ran = summarize(args.events), 0, f"recorded in {args.events}"
    else:
        files, returncode = run_pytest(pytest_args)
        ran = " ".join(["pytest", *pytest_args] if pytest_args else ["make test"])
    cols = ["test_s", "trace_s", "lower_s", "compile_s", "compiles", "cache_saved_s"]
    total = {c: sum(f.get(c, 0) for f in files.values()) for c in cols}
    ranked = sorted(files.items(), key=lambda kv: -kv[1].get("test_s", 0))

    def cells(f: dict) -> list[str]:
        return [f"{f.get(c, 0):.0f}" if c == "compiles" or abs(f.get(c, 0)) >= 10
                else f"{f.get(c, 0):.1f}" for c in cols]  # fmt: skip

    rows = [[name, *cells(f)] for name, f in ranked[: args.top]] + [["all files", *cells(total)]]
    header = ["test file", "test s", "trace s", "lower s", "compile s", "compiles", "cache saved s"]
    print(table(f"where the suite's time goes ({ran})", header, rows))
    write_report({"ran": ran, "exit": returncode, "total": total,
                  "files": files}, args.out)  # fmt: skip
    raise SystemExit(returncode)


if __name__ == "__main__":
    main()
