"""`StepLog`: a run's step metrics read to the host one step late, logged and checked.

Reading step N's metrics while step N+1 runs keeps the device queue full; a non-finite loss or
parameter norm stops the run (`UserError`) before a checkpoint of that step is written.
"""

from __future__ import annotations

import math
import time

from jaxpod.config import Config
from jaxpod.data.feed import fetch_when_done
from jaxpod.errors import UserError
from jaxpod.run.progress import elapsed_and_eta
from jaxpod.run.tasks import Task


class StepLog:
    """Reads step metrics to the host one step late, logs every `log_every`, times steps.

    `push(step, metrics)` after dispatching a step; `flush()` reads everything still pending
    (before an evaluation, a trace stop, the end); `restart_timing(step)` excludes work done
    between steps (evaluation, writing a trace) from the next step times. Without a progress
    bar (no terminal: SLURM, nohup, a pipe) each log line ends with the time the steps since
    `start` took and the time the rest will take at that pace (`clock`: the time source)."""

    def __init__(self, cfg: Config, task: Task, writer, bar, log, start: int, ckpt, clock=None):
        self.cfg, self.task, self.writer, self.bar, self.log = cfg, task, writer, bar, log
        self.ckpt, self.clock = ckpt, clock or time.perf_counter
        self.began, self.first = self.clock(), start
        self.rate = f"{task.unit}_per_s"
        self.losses: list[float] = []
        self.pending: list = []  # (step, metrics on device) not yet read to the host
        self.restart_timing(start)

    def restart_timing(self, step: int) -> None:
        self.last_time, self.last_step = self.clock(), step

    def push(self, step: int, metrics) -> None:
        self.pending.append((step, metrics))
        self._read(keep=1)  # reads step N-1 while step N runs

    def flush(self) -> None:
        self._read(keep=0)

    def _read(self, keep: int) -> None:
        steps, log_every = self.cfg.train.steps, self.cfg.train.log_every
        while len(self.pending) > keep:
            step, metrics = self.pending.pop(0)
            # read, and so timed, once every device is done
            host = {k: float(v) for k, v in fetch_when_done(metrics).items()}
            self.losses.append(host["loss"])
            bad = nonfinite(self.cfg, host)
            if (step % log_every and step != steps) and not bad:
                continue
            now = self.clock()
            step_time = (now - self.last_time) / (step - self.last_step)
            self.last_time, self.last_step = now, step
            speed = self.task.per_step / step_time
            self.writer.write({"step": step, **host, "step_time_s": step_time, self.rate: speed})
            self.bar.set_postfix(loss=f"{host['loss']:.3f}", **{self.rate: f"{speed:,.0f}"})
            if self.bar.disable:
                acc = f"acc {host['accuracy']:.3f}  " if "accuracy" in host else ""
                times = elapsed_and_eta(now - self.began, step - self.first, steps - step)
                self.log(
                    f"step {step:>6}/{steps}  loss {host['loss']:.4f}  {acc}"
                    f"lr {host['lr']:.2e}  {speed:,.0f} {self.task.unit}/s  {times}"
                )
            if bad:
                saved = self.ckpt.saved_step or self.ckpt.latest_step()  # or a resumed one
                newest = f"the newest checkpoint, step {saved}, is intact" if saved else "none"
                raise UserError(
                    f"training diverged at step {step}: {bad}, so the run stopped before "
                    f"saving it ({newest}); lower optim.lr or optim.grad_clip (resume with "
                    "--allow-changes optim), or use precision.loss_scale=dynamic"
                )


def nonfinite(cfg: Config, host: dict[str, float]) -> str | None:
    """What is not finite in a step's metrics ("loss nan", ...), or None. With a dynamic loss
    scale a non-finite loss is an overflow the step skipped; the parameters must stay finite."""
    keys = ["param_norm"] if cfg.precision.loss_scale == "dynamic" else ["loss", "param_norm"]
    bad = [f"{k} {host[k]}" for k in keys if k in host and not math.isfinite(host[k])]
    return ", ".join(bad) or None
