"""A local, read-only mirror of what TensorBoard reads under a URL (`gs://bucket/runs`, any
fsspec filesystem): the event files and the profile plugin's files, nothing else.

Why not hand TensorBoard the URL: TensorBoard 2.21 reads event files through fsspec, but its
profile plugin (xprof 2.24) opens paths with etils.epath, which knows gs://, s3://, az:// and
hf:// only (any other protocol fails on every request), writes `.cached_tools.json` into the
profile folders it reads, and TensorBoard's fsspec `join` fails on a filesystem whose `sep` is
a property (fsspec's `dir://`). A mirror serves every fsspec URL the same way, writes nothing
to the store, and holds the same relative paths, so the run names are those of a local folder.

`refresh()` lists the prefix once and downloads the files whose listing stamp (size and the
store's change markers, `jaxpod.data.store.stamp`) changed, to a temporary name: an event file
the store rewrote longer gets the new bytes appended to its copy (TensorBoard reads on from
where it was), any other file is renamed into place; a file gone from the store goes from the
mirror. Checkpoints are never downloaded. jax-free.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from jaxpod.data.store import filesystem, quiet, stamp
from jaxpod.errors import UserError

EVENTS = "events.out.tfevents."  # the start of an event file's name
PROFILE = ("plugins", "profile")  # the folder of the profile plugin's files


def wanted(rel: str) -> bool:
    """True for the files TensorBoard reads: event files, and files under `plugins/profile/`
    of a run (none inside `checkpoints/`, none hidden)."""
    parts = rel.split("/")
    if "checkpoints" in parts or any(p.startswith(".") for p in parts):
        return False
    if parts[-1].startswith(EVENTS):
        return True
    return any(tuple(parts[i : i + 2]) == PROFILE for i in range(len(parts) - 2))


class Mirror:
    """The files under `url` that TensorBoard reads, copied into `local`, a new temporary
    folder (made once the URL's filesystem is known)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.root = filesystem("LOGDIR", self.url)
        self.root = self.root.rstrip("/")
        self.local = Path(tempfile.mkdtemp(prefix="jaxpod-tensorboard-"))
        self._stamps: dict[str, str] = {}  # relative path -> the stamp of its copy

    def _listing(self) -> dict[str, dict]:
        """The wanted files under the URL by relative path; one-line `UserError` if the store
        cannot be listed or holds nothing there."""
        try:
            found = self.fs.find(self.root, detail=True)
        except Exception as exc:  # any store's own error (auth, network): the user's setup
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UserError(f"LOGDIR {self.url} cannot be listed ({why}); check the URL") from None
        if not found:
            raise UserError(
                f"LOGDIR {self.url} does not exist (nothing there); pass the prefix your runs "
                "are in, e.g. jaxpod tensorboard gs://bucket/runs"
            )
        files = {p[len(self.root) + 1 :]: i for p, i in found.items()}
        return {rel: i for rel, i in files.items() if i.get("type") == "file" and wanted(rel)}

    def refresh(self) -> int:
        """Bring the mirror up to the store (see the module); the number of files changed."""
        with quiet(self.fs):
            return self._refresh()

    def _refresh(self) -> int:
        listed = self._listing()
        changed = 0
        for rel, info in sorted(listed.items()):
            mark = stamp(info)
            if self._stamps.get(rel) != mark:
                self._download(rel)
                self._stamps[rel] = mark
                changed += 1
        for rel in sorted(set(self._stamps) - set(listed)):
            self._drop(rel)
            del self._stamps[rel]
            changed += 1
        return changed

    def _drop(self, rel: str) -> None:
        """Remove the copy of `rel`, and the folders it leaves empty (a run's, a trace's)."""
        path = self.local / rel
        path.unlink(missing_ok=True)
        for folder in path.parents:
            if folder == self.local or any(folder.iterdir()):
                return
            folder.rmdir()

    def _download(self, rel: str) -> None:
        """Copy one file: a grown file whose copy is its start gets the new bytes appended
        (TensorBoard keeps reading an event file where it was); any other is renamed in."""
        target = self.local / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.part")
        try:
            self.fs.get_file(f"{self.root}/{rel}", str(partial))
            old = target.read_bytes() if target.is_file() else None
            new = partial.read_bytes() if old else b""
            if old and new.startswith(old):
                with open(target, "ab") as f:
                    f.write(new[len(old) :])
            else:
                os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)

    def remove(self) -> None:
        """Delete the mirror folder (it is only ever a copy)."""
        shutil.rmtree(self.local, ignore_errors=True)


def open_mirror(url: str) -> Mirror:
    """A `Mirror` of `url`, filled once (a `UserError` leaves no folder behind)."""
    mirror = Mirror(url)
    try:
        mirror.refresh()
    except BaseException:
        mirror.remove()
        raise
    return mirror
