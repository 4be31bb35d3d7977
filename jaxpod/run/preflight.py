"""The checks before training, run once: a mistake is refused in one line, nothing touched.

`preflight(cfg)` refuses, in this order: `train.profile_steps` reaching beyond the run; a
`data.tokenizer` without Hugging Face `tokenizers` installed, or a tokenizer file that is
missing or whose ids do not fit in `model.vocab`; a `data.path` URL no installed fsspec
filesystem reads (`jaxpod.data.store`); a mapping whose planned bytes per device
exceed `memory.device_budget` (the planner's `check_budget`); more host RAM than this host has
for its virtual CPU devices (`jaxpod.run.hostmem`, one process); a run directory that cannot
be claimed (`jaxpod.run.logdir`, or `jaxpod.run.remote` for a URL). Then it holds the
directory's lock (process 0's; for a URL, the store's lock and that of its local copy, which
the run writes into and `Cleared` pushes to the store at its end; with several processes each
has its own copy, process 0's step pulled into all). The CLI runs it before jax starts (one
process); the loop runs it for any other caller. jax-free; the planner is imported only when
these checks ask it (the budget, the host's RAM), never by the loop.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jaxpod.config import Config
from jaxpod.data.store import filesystem, is_url
from jaxpod.errors import UserError
from jaxpod.run.hostmem import check_host_ram
from jaxpod.run.logdir import CHECKPOINTS, LogdirLock, hold
from jaxpod.run.profiling import check_profile_steps
from jaxpod.run.remote import RemoteLogdir


@dataclass(frozen=True)
class Cleared:
    """A config that passed `preflight`, and the run directory's lock it took (None on
    processes other than 0)."""

    cfg: Config
    lock: LogdirLock | None
    remote: RemoteLogdir | None = None

    @property
    def logdir(self) -> Path:
        """Where the run writes its record: `train.logdir`, or the local copy of a URL's."""
        return self.remote.local if self.remote is not None else Path(self.cfg.train.logdir)

    def barrier(self) -> Callable[..., None] | None:
        """orbax's barrier function for the run's checkpoints: with several processes and a
        URL, the one that moves their shards through the store (`jaxpod.run.shardsync`);
        else None, orbax's own."""
        if self.remote is None or self.remote.processes == 1:
            return None
        from jaxpod.run.shardsync import ShardBarrier

        return ShardBarrier(self.remote, self.logdir.absolute() / CHECKPOINTS)

    def __enter__(self) -> Cleared:
        return self

    def __exit__(self, kind, value, tb) -> None:
        try:
            if self.remote is not None:
                self._push(failing=kind is not None)
        finally:
            if self.lock is not None:
                self.lock.release()
            if self.remote is not None:
                self.remote.release()

    def _push(self, failing: bool) -> None:
        """The record to the store; a failed upload during another error is a note."""
        try:
            self.remote.push()
        except UserError as exc:
            if not failing:
                raise
            print(f"jaxpod: note: {exc}", file=sys.stderr, flush=True)


def preflight(
    cfg: Config,
    *,
    processes: int = 1,
    process: int = 0,
    foreign_ok: bool = False,
    agree: Callable[[int], int] | None = None,
) -> Cleared:
    """Check `cfg` before training and claim its run directory (one-line `UserError`s).

    `processes`: the run's processes (with one, its virtual devices share this host's RAM);
    `process`: this one's index (0 holds the lock); `foreign_ok`: the run directory may hold
    files that are not jaxpod's (`jaxpod.run.logdir.check_logdir`); `agree`: with several
    processes and a URL, hands process 0's value to every process (`from_process_0`)."""
    check_profile_steps(cfg.train.profile_steps, cfg.train.steps)
    if cfg.data.tokenizer != "bytes":
        from jaxpod.data.tokenized import check_tokenizer

        check_tokenizer(cfg.data.tokenizer, cfg.model.vocab)
    if is_url(cfg.data.path):
        filesystem("data.path", cfg.data.path)  # its package installed, before the claim
    check_budget(cfg)
    if processes == 1:
        check_host_ram(cfg)
    main = process == 0
    if not is_url(cfg.train.logdir):
        return Cleared(cfg, hold(cfg.train.logdir, foreign_ok) if main else None)
    if processes > 1 and agree is None:
        raise ValueError("several processes claim a URL run directory through `agree`")
    remote = RemoteLogdir(cfg.train.logdir, cfg.train.keep_checkpoints, process, processes)
    remote.claim(agree)
    try:
        return Cleared(cfg, hold(remote.local, foreign_ok) if main else None, remote)
    except BaseException:
        remote.release()
        raise


def check_budget(cfg: Config) -> None:
    """The planner's refusal of a mapping over `memory.device_budget` (none set: no plan)."""
    if cfg.memory.device_budget is None:
        return
    from jaxpod.planner.plan import check_budget as refuse_over_budget

    refuse_over_budget(cfg)
