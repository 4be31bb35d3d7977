"""A run directory behind a URL (`train.logdir=gs://bucket/run`, any fsspec filesystem).

The run writes into a local copy of it, `$XDG_CACHE_HOME/jaxpod/logdirs/<name>-<hash>/`, with
the same code, checks and atomic writes as a local run; `RemoteLogdir` moves the files between
the copy and the store through fsspec. `claim()` takes the store's lock (`.jaxpod.lock`, created
with fsspec's exclusive mode `xb`), removes the uploads cut short (no commit mark), empties the
copy, and pulls the record's files and the newest complete checkpoint. `push()` uploads what
changed: record files whole (an object store cannot append), each complete checkpoint (every
file, then `commit_success.txt` last, the mark a pull requires), and it removes from the store
what the run removed from the copy (a rotated checkpoint, a record cut back for a resume),
never a file it did not pull or push. The loop pushes after each checkpoint commits and when
the run ends, also in an error; `release()` removes the lock. Nothing here treats the URL as a
local path. jax-free.

With several processes each keeps its own copy (`...-p<index>`). Process 0 claims, pushes and
releases as above; the others pull only the checkpoint process 0 pulled (`claim(agree)`).
During a save (`jaxpod.run.shardsync`) each other process `share`s the shard files it wrote
(and a list of them) before orbax's write barrier, and process 0 `gather`s the listed files into
its copy after it, so orbax commits there a checkpoint holding every process's shards; its
push then uploads its own files, `commit_success.txt` last. `memory://` is refused for them.

The lock's limits: only GCS (gcsfs, `ifGenerationMatch=0`) creates it atomically (elsewhere
two runs may both take it in a short window); a killed run's lock is taken over by the same
host, a lock of another host refused until it is deleted (docs/runs.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

from jaxpod.data.store import filesystem
from jaxpod.errors import UserError

LOCK_FILE = ".jaxpod.lock"
CHECKPOINTS = "checkpoints"
COMMITTED = "commit_success.txt"  # written last into a pushed checkpoint (orbax's GCS mark)
SHARED = ".shared-{}.json"  # another process's list of the files it uploaded for a save
TEMPORARY = ".orbax-checkpoint-tmp"  # orbax's suffix of the directories a save writes into


def local_copy(url: str, process: int | None = None) -> Path:
    """Where the run keeps its local copy of the run directory at `url` (see the module);
    `process`: this process's index in a run of several (each keeps its own copy)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", url.split("://", 1)[1]).strip("-.")[-60:] or "run"
    digest = hashlib.sha256(url.encode()).hexdigest()[:12]
    tail = "" if process is None else f"-p{process}"
    return base / "jaxpod" / "logdirs" / f"{name}-{digest}{tail}"


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return True  # not ours to judge: keep it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class RemoteLogdir:
    """The run directory at `url` and the local copy `local` of process `process` of
    `processes` (see the module)."""

    def __init__(self, url: str, keep: int, process: int = 0, processes: int = 1):
        self.url, self.keep = url.rstrip("/"), keep
        self.process, self.processes = process, processes
        self.fs, self.root = filesystem("train.logdir", self.url)
        self.root = self.root.rstrip("/")
        if processes > 1 and _private(self.fs):
            raise UserError(
                f"train.logdir={self.url}: {self.url.split('://')[0]}:// is held in each process's "
                f"memory, and the {processes} processes of this run must share one store; use "
                "a bucket (gs://, s3://) or a directory every host mounts"
            )
        self.local = local_copy(self.url, process if processes > 1 else None)
        self._known: dict[str, tuple[int, int] | None] = {}  # path -> (size, mtime) sent
        self._gathered: dict[str, set[str]] = {}  # step -> the files other processes wrote
        self._locked = False

    def _remote(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def claim(self, agree: Callable[[int], int] | None = None) -> None:
        """Process 0: take the store's lock, remove the uploads no commit mark completed, and
        make the local copy hold the record and the newest complete checkpoint of the store's
        run directory (empty if it has none). With several processes `agree` hands process 0's
        pulled step (-1: its claim failed) to every process; the others pull that checkpoint."""
        if self.process != 0:
            step = agree(-1)
            if step < 0:
                raise UserError(
                    f"train.logdir={self.url}: process 0 could not claim it; its error says why"
                )
            self._reset()
            self._read(lambda: self._pull(str(step) if step else None, record=False))
            return
        try:
            self._lock()
            self._reset()
            step = self._read(self._claimed)
        except BaseException:
            if agree is not None:
                agree(-1)
            raise
        if agree is not None:
            agree(int(step or 0))

    def _reset(self) -> None:
        shutil.rmtree(self.local, ignore_errors=True)
        self.local.mkdir(parents=True)

    def _read(self, pull: Callable[[], str | None]) -> str | None:
        """`pull()`; a store that cannot be read is a one-line `UserError` (lock released)."""
        try:
            return pull()
        except OSError as exc:
            self.release()
            raise UserError(f"train.logdir={self.url} cannot be read ({exc})") from None

    def _claimed(self) -> str | None:
        """Remove the cut uploads, pull the record and the newest complete checkpoint."""
        steps = self._remote_steps(committed=False)
        done = self._remote_steps(committed=True)
        for step in sorted(set(steps) - set(done), key=int):
            self.fs.rm(self._remote(f"{CHECKPOINTS}/{step}"), recursive=True)
        newest = done[-1] if done else None
        self._pull(newest, record=True)
        return newest

    def _lock(self) -> None:
        me = {"pid": os.getpid(), "host": socket.gethostname()}
        me["started"] = time.strftime("%Y-%m-%d %H:%M:%S")
        path, data = self._remote(LOCK_FILE), (json.dumps(me) + "\n").encode()
        try:
            with self.fs.open(path, "xb") as f:
                f.write(data)
        except FileExistsError:
            holder = self._holder(path)
            if holder.get("host") != me["host"] or _alive(holder.get("pid")):
                pid, host = holder.get("pid", "?"), holder.get("host", "?")
                raise UserError(
                    f"train.logdir={self.url} is in use by another jaxpod run (pid {pid} on host "
                    f"{host}, since {holder.get('started', '?')}); wait for it, or if it is no "
                    f"longer running delete {self.url}/{LOCK_FILE}"
                ) from None
            self.fs.pipe_file(path, data)  # its process is gone: taken over
        self._locked = True

    def _holder(self, path: str) -> dict:
        try:
            holder = json.loads(self.fs.cat_file(path).decode("utf-8", "replace") or "{}")
        except (OSError, ValueError):
            return {}
        return holder if isinstance(holder, dict) else {}

    def _pull(self, step: str | None, record: bool) -> None:
        """Copy checkpoint `step` (if any) and, if `record`, the record files into the copy."""
        if not self.fs.isdir(self.root):
            return
        for path in self.fs.find(self.root):
            rel = path[len(self.root) + 1 :]
            parts = rel.split("/")
            if parts[0] == CHECKPOINTS and parts[1:2] != [step]:
                continue
            if rel == LOCK_FILE or (parts[0] != CHECKPOINTS and not record):
                continue
            target = self.local / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(path, str(target))
            key = "/".join(parts[:2]) if parts[0] == CHECKPOINTS else rel
            self._known[key] = None if parts[0] == CHECKPOINTS else _stamp(target)

    def _remote_steps(self, committed: bool) -> list[str]:
        """The step names under the store's `checkpoints/` (only those whose push completed,
        if `committed`), oldest first."""
        saves = self._remote(CHECKPOINTS)
        if not self.fs.isdir(saves):
            return []
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(saves, detail=False)]
        steps = sorted((n for n in names if n.isdigit()), key=int)
        if committed:
            steps = [s for s in steps if self.fs.exists(f"{saves}/{s}/{COMMITTED}")]
        return steps

    def push(self) -> None:
        """Process 0: upload the local copy's changes to the store (see the module);
        `UserError` naming the URL if the store refuses. The others: nothing (`share`)."""
        if self.process != 0:
            return
        try:
            self._push()
        except OSError as exc:
            raise self._upload_error(exc) from None

    def _upload_error(self, exc: OSError) -> UserError:
        return UserError(
            f"train.logdir={self.url}: cannot upload the run record ({exc}); the local "
            f"copy {self.local} holds it: copy it there, or run again to resume"
        )

    def _push(self) -> None:
        present: set[str] = set()
        steps = set(self._remote_steps(committed=True))
        for path in sorted(p for p in self.local.rglob("*") if p.is_file()):
            rel = path.relative_to(self.local).as_posix()
            parts = rel.split("/")
            if rel == LOCK_FILE or rel.endswith(".tmp"):
                continue
            if parts[0] == CHECKPOINTS:
                if len(parts) < 3 or not parts[1].isdigit():
                    continue  # orbax's temporary or rotated-out directories
                present.add(f"{CHECKPOINTS}/{parts[1]}")
                continue
            present.add(rel)
            if self._known.get(rel) != _stamp(path):
                self.fs.put_file(str(path), self._remote(rel))
                self._known[rel] = _stamp(path)
        local_steps = {p.name for p in (self.local / CHECKPOINTS).glob("*") if p.name.isdigit()}
        for step in sorted(local_steps - steps, key=int):
            self._push_step(step)
        self._forget(present)
        for step in self._remote_steps(committed=True)[: -self.keep]:  # the newest `keep` stay
            self.fs.rm(self._remote(f"{CHECKPOINTS}/{step}"), recursive=True)

    def _push_step(self, step: str) -> None:
        """Upload checkpoint `step` file by file (but those the other processes uploaded, and
        orbax's own commit mark), then its commit mark: the last file, after every other."""
        rel = f"{CHECKPOINTS}/{step}"
        theirs = self._gathered.pop(step, None)
        if self.processes > 1 and theirs is None:  # orbax merged this process's shards alone
            raise RuntimeError(f"checkpoint {step} was committed without the others' shards")
        source = self.local / rel
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            inside = path.relative_to(source).as_posix()
            if inside != COMMITTED and inside not in (theirs or ()):
                self.fs.put_file(str(path), self._remote(f"{rel}/{inside}"))
        self.fs.pipe_file(self._remote(f"{rel}/{COMMITTED}"), b"")
        self._known[rel] = None

    def share(self, step: str, written: Path) -> None:
        """Another process's part of a save: upload the files it wrote into `written` (orbax's
        temporary directory of checkpoint `step`) under their final names, then the list of
        them (`.shared-<process>.json`), which process 0 waits for."""
        names = []
        try:
            for path in sorted(p for p in written.rglob("*") if p.is_file()):
                inside = final_name(path.relative_to(written).as_posix())
                self.fs.put_file(str(path), self._remote(f"{CHECKPOINTS}/{step}/{inside}"))
                names.append(inside)
            shared = self._remote(f"{CHECKPOINTS}/{step}/{SHARED.format(self.process)}")
            self.fs.pipe_file(shared, json.dumps(names).encode())
        except OSError as exc:
            raise self._upload_error(exc) from None

    def gather(self, step: str, written: Path) -> None:
        """Process 0's part of a save, once every process has shared: download the files each
        other process listed for checkpoint `step` into `written`, orbax's temporary directory
        (their lists then removed); a list missing is a one-line `UserError`."""
        remote = self._remote(f"{CHECKPOINTS}/{step}")
        theirs: set[str] = set()
        try:
            for process in range(1, self.processes):
                theirs.update(self._shared(step, process))
            for inside in sorted(theirs):
                target = written / temporary_name(inside, written)
                target.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(f"{remote}/{inside}", str(target))
            for process in range(1, self.processes):
                self.fs.rm_file(f"{remote}/{SHARED.format(process)}")
        except OSError as exc:
            raise UserError(f"train.logdir={self.url} cannot be read ({exc})") from None
        self._gathered[step] = theirs

    def _shared(self, step: str, process: int) -> list[str]:
        """The files `process` uploaded for checkpoint `step`, as it listed them."""
        try:
            listed = self.fs.cat_file(
                self._remote(f"{CHECKPOINTS}/{step}/{SHARED.format(process)}")
            )
        except FileNotFoundError:
            raise UserError(
                f"train.logdir={self.url}: process {process}'s shards of checkpoint {step} are "
                "not in the store; every process must reach the same store (a bucket, not "
                "memory:// or a path local to each host)"
            ) from None
        return json.loads(listed)

    def _forget(self, present: set[str]) -> None:
        """Remove from the store what was pulled or pushed and is gone from the copy."""
        for rel in sorted(set(self._known) - present):
            remote = self._remote(rel)
            if self.fs.exists(remote):
                self.fs.rm(remote, recursive=rel.startswith(CHECKPOINTS))
            del self._known[rel]

    def release(self) -> None:
        """Remove the store's lock (if this run holds it)."""
        if self._locked:
            self._locked = False
            try:
                self.fs.rm_file(self._remote(LOCK_FILE))
            except OSError:  # noqa: S110 - a lock left behind is reported by the next run
                pass


def _private(fs) -> bool:
    """True for a filesystem each process holds in its own memory (fsspec's `memory://`)."""
    from fsspec.implementations.memory import MemoryFileSystem

    return isinstance(fs, MemoryFileSystem)


def final_name(inside: str) -> str:
    """A path inside orbax's temporary directory of a save as it is once committed (orbax
    names each item's temporary directory `<item>.orbax-checkpoint-tmp`)."""
    return "/".join(part.removesuffix(TEMPORARY) for part in inside.split("/"))


def temporary_name(inside: str, written: Path) -> str:
    """`inside` (a committed name) as it is in the temporary directory `written`."""
    item, _, rest = inside.partition("/")
    if rest and (written / f"{item}{TEMPORARY}").is_dir():
        return f"{item}{TEMPORARY}/{rest}"
    return inside


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns
