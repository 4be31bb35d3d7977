"""Profiles of chosen training steps, in the layout TensorBoard's profile tab reads.

`train.profile_steps=[start, stop]` traces the optimizer steps `start, start+1, ..., stop-1`,
counted as the loop counts them: step 1 is the first optimizer step of the run, step
`train.steps` the last (`start=0` means the same as 1; `stop` may be at most
`train.steps + 1`, which includes the last step). `jax.profiler.start_trace` starts just
before step `start` is dispatched, every traced step is wrapped in
`StepTraceAnnotation("train", step_num=step)` (the profile tab's step view), and the trace
stops after step `stop - 1`'s result has been computed (blocked on), so the last traced step
is complete in the trace. The trace lands in
`<logdir>/plugins/profile/<timestamp>/<host>.xplane.pb`.

With several processes only process 0 traces (processes on one machine share a host name and
would write the same file); its trace shows its own devices. This module imports jax only
where it traces, so the CLI can check `train.profile_steps` before jax starts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from jaxpod.errors import ConfigError

PROFILE_DIR = Path("plugins") / "profile"
STEP_NAME = "train"  # the StepTraceAnnotation name: TensorBoard groups steps by it


def check_profile_steps(profile_steps: tuple[int, ...] | None, steps: int) -> None:
    """One-line `ConfigError` if `train.profile_steps` reaches beyond the run's last step."""
    if profile_steps is None:
        return
    start, stop = profile_steps
    if stop > steps + 1:
        raise ConfigError(
            f"train.profile_steps=[{start}, {stop}] traces steps {max(start, 1)}..{stop - 1} "
            f"but train.steps={steps}; use stop <= {steps + 1} (e.g. "
            f"train.profile_steps=[{min(max(start, 1), steps)},{steps + 1}])"
        )


def traces(logdir: str | Path) -> list[Path]:
    """Every `*.xplane.pb` trace under `<logdir>/plugins/profile/`, oldest first."""
    root = Path(logdir) / PROFILE_DIR
    if not root.is_dir():
        return []
    return sorted(root.glob("*/*.xplane.pb"), key=lambda p: (p.stat().st_mtime, str(p)))


class StepProfiler:
    """Starts and stops one `jax.profiler` trace around the steps `[start, stop)`.

    Use `with profiler.step(step): dispatch...` for every step, and after it, if
    `profiler.stops_after(step)`, `profiler.stop(out)`: the trace starts when the first traced
    step begins and ends once the last traced step's `out` is ready. Steps already done (a
    resumed run) are skipped.
    """

    def __init__(self, logdir: str | Path, profile_steps: tuple[int, ...] | None, enabled=True):
        self.logdir = Path(logdir)
        self.range = None if profile_steps is None or not enabled else tuple(profile_steps)
        self.active = False
        self.trace: Path | None = None  # the written .xplane.pb, once stopped

    def _traced(self, step: int) -> bool:
        return self.range is not None and max(self.range[0], 1) <= step < self.range[1]

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Context for feeding and dispatching `step` (the feed first waits for the call
        before it): starts the trace if needed, annotates the step."""
        if not self._traced(step):
            yield
            return
        import jax

        if not self.active:
            self.logdir.mkdir(parents=True, exist_ok=True)
            self._before = set(traces(self.logdir))
            jax.profiler.start_trace(str(self.logdir))
            self.active = True
        with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=step):
            yield

    def stops_after(self, step: int) -> bool:
        """True if the trace is running and `step` is the last step to trace: the caller
        then calls `stop(result)` once it has dispatched it."""
        return self.active and step == self.range[1] - 1

    def stop(self, result: object = None) -> None:
        """Stop an active trace (after `result` is ready); no-op otherwise."""
        if not self.active:
            return
        import jax

        if result is not None:
            jax.block_until_ready(result)
        jax.profiler.stop_trace()
        self.active = False
        new = [p for p in traces(self.logdir) if p not in self._before]
        self.trace = new[-1] if new else None


def _configured_logdir(config: str, overrides: list[str]) -> str:
    """`train.logdir` as `load_config` reads it (last override, else the YAML's, else the
    default), before the rest of the config is validated."""
    from jaxpod.config import peek

    return peek(config, overrides, "train.logdir")


def profile_overrides(config: str, overrides: list[str], steps: int, warmup: int) -> list[str]:
    """The overrides that turn a config into a short profiling run.

    `warmup` steps run untraced (compilation and caches settle), then `steps` steps are
    traced: `train.steps=warmup+steps`, `train.profile_steps=[warmup+1, warmup+steps+1]`, no
    periodic evaluation, every step logged. The run goes to `<train.logdir>-profile` (its old
    checkpoints removed, so it never resumes: the directory is locked first), or to a
    `train.logdir=` given by the user, which must not hold checkpoints.
    """
    import shutil

    from jaxpod.data.store import is_url
    from jaxpod.run.logdir import CHECKPOINTS

    if steps < 1 or warmup < 0:
        raise ConfigError(f"--steps {steps} must be >= 1 and --warmup {warmup} >= 0")
    user_logdir = any(i.partition("=")[0].strip() == "train.logdir" for i in overrides)
    logdir = _configured_logdir(config, overrides)
    if is_url(logdir):
        raise ConfigError(
            f"train.logdir={logdir} is a URL; jaxpod profile writes its short run to a local "
            "directory: pass train.logdir=DIR, or trace a run at the URL with jaxpod train CONFIG "
            f"train.logdir={logdir} train.profile_steps=[START,STOP] (its trace is uploaded "
            f"with the run) and open it with jaxpod tensorboard {logdir}"
        )
    if user_logdir:
        if (Path(logdir) / CHECKPOINTS).is_dir():
            raise ConfigError(
                f"train.logdir={logdir} holds checkpoints (a training run); jaxpod profile needs "
                "a fresh directory: pick another train.logdir or leave it out"
            )
    else:
        from jaxpod.run.logdir import hold

        logdir = f"{logdir.rstrip('/')}-profile"
        hold(logdir)  # never delete the checkpoints of a run that is using them
        shutil.rmtree(Path(logdir) / CHECKPOINTS, ignore_errors=True)
    total = warmup + steps
    return [
        *overrides,
        f"train.steps={total}",
        f"train.profile_steps=[{warmup + 1},{total + 1}]",
        "train.eval_every=0",
        "train.log_every=1",
        f"train.logdir={logdir}",
    ]


def how_to_open(trace: Path | None, logdir: str | Path) -> str:
    """The console line saying how to look at the trace (or that none was written)."""
    if trace is None:
        return f"profile        no trace was written under {Path(logdir) / PROFILE_DIR}"
    return (
        f"open it        .venv/bin/jaxpod tensorboard {logdir}   then the PROFILE tab "
        f"(or: make tensorboard LOGDIR={logdir})"
    )
