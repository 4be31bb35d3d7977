"""The checkpoints of a URL run directory written by several processes, each into its own copy.

orbax saves a checkpoint of several processes in three stages: each process writes the shards
it owns (`state/ocdbt.process_<i>/`) into the checkpoint's temporary directory; all meet at a
barrier (`async_write_complete`); then process 0 alone finalizes (merges every process's
OCDBT database into `state/manifest.ocdbt`, writes the metadata) and renames the temporary
directory into place, and all meet again (`async_commit_complete`). That assumes one
filesystem all processes share; a URL run directory has instead one local copy per process
(`jaxpod.run.remote`). `ShardBarrier` is orbax's barrier function for such a run: at the
write barrier each other process first uploads the files it wrote to the store, and process 0,
once all have arrived, downloads them into its own temporary directory, so that its merge and
commit see every shard; at the commit barrier the others remove their temporary directories.
Process 0 uploads its own files and then the commit mark when it pushes (`RemoteLogdir.push`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from orbax.checkpoint import multihost

from jaxpod.run.remote import TEMPORARY, RemoteLogdir

WRITTEN = "async_write_complete"  # orbax's barriers of a save, named `_<name>.<step>`
COMMITTED = "async_commit_complete"


class ShardBarrier:
    """orbax's barrier function (`AsyncOptions.barrier_sync_fn`) for the checkpoints under
    `directory`, the local copy's, of the URL run directory `remote` (see the module)."""

    def __init__(self, remote: RemoteLogdir, directory: Path):
        self.remote, self.directory = remote, directory
        self._barrier = multihost.get_barrier_sync_fn()

    def __call__(self, *, key: str, timeout_ms: int) -> None:
        name, _, step = key.rpartition(".")
        written = self.directory / f"{step}{TEMPORARY}"
        main = self.remote.process == 0
        if name.endswith(WRITTEN) and not main:
            self.remote.share(step, written)
        self._barrier(key=key, timeout_ms=timeout_ms)
        if name.endswith(WRITTEN) and main:
            if not written.is_dir():  # orbax renamed it: its merge would miss the others' shards
                raise RuntimeError(f"orbax's temporary directory {written} is not there")
            self.remote.gather(step, written)
        if name.endswith(COMMITTED) and not main:
            shutil.rmtree(written, ignore_errors=True)
