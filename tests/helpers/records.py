"""Run directories as `jaxpod train` leaves them, written without training: `config.yaml`,
`metrics.jsonl` and the TensorBoard event file (by the run's own `MetricsWriter`), `eval.json`,
a profile trace and a checkpoint folder, for the tests of the commands that read runs.
jax-free.
"""

from __future__ import annotations

import os
from pathlib import Path

from helpers import TINY_YAML
from jaxpod.config import dump_yaml, load_config
from jaxpod.run.metrics import MetricsWriter, write_json_atomic

TRACE = Path("plugins") / "profile" / "2026_01_01_00_00_00" / "host.xplane.pb"


def write_run(logdir: Path, *overrides: str, losses=(), mtime: int = 0) -> Path:
    """A finished run of `losses` (one step each, a validation loss after the last) under
    `logdir`, with a trace, a checkpoint (holding a `config.yaml` of its own) and the given
    modification time on its files and folder; `logdir`."""
    logdir.mkdir(parents=True)
    (logdir / "config.yaml").write_text(dump_yaml(load_config(TINY_YAML, list(overrides))))
    with MetricsWriter(logdir) as writer:
        for step, loss in enumerate(losses, 1):
            writer.write({"step": step, "loss": loss, "tokens_per_s": 1000.0 * step})
        if losses:
            writer.write({"step": len(losses), "val_loss": losses[-1] + 0.5}, "val")
    if losses:
        write_json_atomic(logdir / "eval.json", {"final_val_loss": losses[-1] + 0.5})
    (logdir / TRACE).parent.mkdir(parents=True)
    (logdir / TRACE).write_bytes(b"trace of " + logdir.name.encode())
    saved = logdir / "checkpoints" / str(len(losses))
    saved.mkdir(parents=True)
    (saved / "config.yaml").write_text("not: a run\n")
    (saved / "state").write_bytes(bytes(1000))
    for path in [*logdir.rglob("*"), logdir]:
        os.utime(path, (mtime, mtime))
    return logdir
