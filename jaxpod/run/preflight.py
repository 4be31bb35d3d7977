"""The checks before training, run once: a mistake is refused in one line, nothing touched.

`preflight(cfg)` refuses, in this order: `train.profile_steps` reaching beyond the run; a
`data.tokenizer` without Hugging Face `tokenizers` installed, or a tokenizer file that is
missing or whose ids do not fit in `model.vocab`; a mapping whose planned bytes per device
exceed `memory.device_budget` (the planner's `check_budget`); more host RAM than this host has
for its virtual CPU devices (`jaxpod.run.hostmem`, one process); a run directory that cannot
be claimed (`jaxpod.run.logdir`). Then it holds the directory's lock (process 0's). The CLI
runs it before jax starts (one process); the loop runs it for any other caller. jax-free; the
planner is imported only when these checks ask it (the budget, the host's RAM), never by the
loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxpod.config import Config
from jaxpod.run.hostmem import check_host_ram
from jaxpod.run.logdir import LogdirLock, hold
from jaxpod.run.profiling import check_profile_steps


@dataclass(frozen=True)
class Cleared:
    """A config that passed `preflight`, and the run directory's lock it took (None on
    processes other than 0)."""

    cfg: Config
    lock: LogdirLock | None

    def __enter__(self) -> Cleared:
        return self

    def __exit__(self, *exc) -> None:
        if self.lock is not None:
            self.lock.release()


def preflight(
    cfg: Config, *, processes: int = 1, main: bool = True, foreign_ok: bool = False
) -> Cleared:
    """Check `cfg` before training and claim its run directory (one-line `UserError`s).

    `processes`: the run's processes (with one, its virtual devices share this host's RAM);
    `main`: this is process 0, the one that holds the lock; `foreign_ok`: the run directory
    may hold files that are not jaxpod's (`jaxpod.run.logdir.check_logdir`)."""
    check_profile_steps(cfg.train.profile_steps, cfg.train.steps)
    if cfg.data.tokenizer != "bytes":
        from jaxpod.data.tokenized import check_tokenizer

        check_tokenizer(cfg.data.tokenizer, cfg.model.vocab)
    check_budget(cfg)
    if processes == 1:
        check_host_ram(cfg)
    return Cleared(cfg, hold(cfg.train.logdir, foreign_ok) if main else None)


def check_budget(cfg: Config) -> None:
    """The planner's refusal of a mapping over `memory.device_budget` (none set: no plan)."""
    if cfg.memory.device_budget is None:
        return
    from jaxpod.planner.plan import check_budget as refuse_over_budget

    refuse_over_budget(cfg)
