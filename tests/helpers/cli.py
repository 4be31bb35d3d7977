"""Running the `jaxpod` CLI in a subprocess, and checking its one-line user errors.

Each subprocess sets its own virtual device count, so `XLA_FLAGS` (8 devices, set for the
pytest process by `tests/conftest.py`) is not passed on; everything else in the environment
is, the session's shared jax compilation cache (`JAX_COMPILATION_CACHE_DIR`) included.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import ROOT, TINY_YAML, free_port

TINY = str(TINY_YAML)

# The tiny 4-step run (configs/tiny.yaml, 4 steps, no warm-up) of the CLI modules: one program,
# whichever cadence of logs, evaluations and checkpoints a module adds.
TINY4 = [
    "train.steps=4",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "optim.warmup_steps=0",
]
# The multi-process modules' xdist group: one process runs their one-process reference once.
TWO_PROCESSES = "shared:two-processes"


# A CLI run compiles what the runs before it compiled, quick programs (eager ops) included:
# every compile is worth a cache entry there (a cached tiny run: 3.5 s with the pytest
# processes' one-second minimum, 2.4 s without; tests/conftest.py).
CLI_CACHE = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess: this one's without `XLA_FLAGS`, every compile
    cached (`CLI_CACHE`), plus `extra`."""
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | CLI_CACHE | extra


def without_jax(tmp_path: Path) -> dict[str, str]:
    """`cli_env()` in which `import jax` fails (a shim package first on `PYTHONPATH`): a run
    that must end before jax starts ends the same way in it, one that imports jax gets a
    traceback naming the shim."""
    shim = tmp_path / "no-jax" / "jax"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text('raise ImportError("jax was imported (the no-jax shim)")\n')
    path = [str(shim.parent), *filter(None, [os.environ.get("PYTHONPATH")])]  # the caller's kept
    return cli_env(PYTHONPATH=os.pathsep.join(path))


def cli_cmd(*args: str) -> list[str]:
    """`python -m jaxpod.cli ARGS` with this interpreter (the venv's)."""
    return [sys.executable, "-m", "jaxpod.cli", *args]


def later_wins(*items: str) -> list[str]:
    """A test's defaults then its own overrides as one command line: a later `KEY=VALUE`
    replaces an earlier one of the same key, in its place (`jaxpod` refuses a key twice);
    other arguments are kept as they are."""
    keys = [i.split("=", 1)[0] if "=" in i and not i.startswith("-") else None for i in items]
    last = {k: n for n, k in enumerate(keys) if k is not None}
    return [i for n, i in enumerate(items) if keys[n] is None or last[keys[n]] == n]


def start(*args: str, env: dict | None = None) -> subprocess.Popen:
    """Start `jaxpod ARGS` (from the repository root), its stdout and stderr piped; `env`:
    the environment if not `cli_env()`."""
    return subprocess.Popen(
        cli_cmd(*args),
        cwd=ROOT,
        env=cli_env() if env is None else env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def start_two_processes(*args: str, env: dict | None = None) -> list[subprocess.Popen]:
    """Start `jaxpod ARGS` as processes 0 and 1 of one job, coordinated on a free port."""
    port = free_port()
    job = ("--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id")
    return [start(*args, *job, str(i), env=env) for i in range(2)]


def finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Wait for every process; each must exit 0. Returns their stdouts."""
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [out for out, _ in outs]


def jaxpod(
    *args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run `jaxpod ARGS` to completion (from the repository root unless `cwd`)."""
    return subprocess.run(
        cli_cmd(*args),
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        env=cli_env() if env is None else env,
        timeout=timeout,
    )


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, exactly one line on stderr naming the field, no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("jaxpod: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]


# The smallest run of the edge tests (disks, pipes, signals, foreign files): one device, one
# 16-wide layer, one 16-token sequence a step; a few milliseconds a step, so hundreds of steps
# are cheap where a file must grow.
SMALL = [
    "devices=1",
    "mesh.replica=1",
    "mesh.pipeline=1",
    "mesh.tensor=1",
    "model.layers=1",
    "model.d_model=16",
    "model.heads=1",
    "model.d_ff=32",
    "model.seq_len=16",
    "train.micro_batch=1",
    "train.grad_accum=1",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "optim.warmup_steps=0",
]


def event_steps(run: Path, tag: str = "train/loss") -> list[int]:
    """The steps of every `tag` scalar in the run's TensorBoard event files, sorted."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = []
    for path in sorted(run.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(path))
        acc.Reload()
        steps += [e.step for e in acc.Scalars(tag)]
    return sorted(steps)
