"""Checkpoints of the train state under `<train.logdir>/checkpoints/<step>/` (orbax).

A checkpoint holds the `TrainState` (step, params, optimizer state; every array saved shard by
shard from the devices that own it) and a small JSON record: step, seed, the config that trained
it, the run record's lines of that step, and a checksum of every array (`jaxpod.run.integrity`:
two uint32 sums of its bits, computed on the devices, exact under any sharding), verified after
every restore, so bytes changed on disk are refused naming the array. The data position needs
no saving: the batch of step k is a pure function of (seed, k).

Saving is asynchronous: `save` returns once the arrays are copied off the devices, and orbax
writes them in the background into a temporary directory that is renamed into place when
complete, so a run killed mid-save leaves the earlier checkpoints intact and the incomplete one
is never listed. Rotation (`train.keep_checkpoints`) renames an old checkpoint into
`checkpoints/deleting/` in one step before its files are removed, so no interruption leaves a
half-deleted checkpoint under a step's name. Restoring reads straight into the target
shardings of the current mesh (which may differ from the saving mesh): no array is ever
gathered onto one device. Only orbax's standard formats (tensorstore arrays + JSON) are read;
nothing is unpickled. A save that fails (disk full, permissions) is a one-line `UserError`;
waits for background writes are bounded when the run is already failing.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxpod.engine import Engine, TrainState
from jaxpod.errors import Muted, UserError
from jaxpod.run.integrity import by_path, check_matches, check_sums, checksums, leaf_paths
from jaxpod.run.logdir import CHECKPOINTS

# The keys of a checkpoint's JSON record (`save` writes them all; `config` may be null).
RECORD = ("step", "seed", "checksums", "config", "records", "layer_order")
FIX = "delete that directory to resume from the previous checkpoint, or use a fresh train.logdir"

ABANDON_SECONDS = 20.0  # how long a failing run waits for background writes before leaving
# Under the checkpoints directory: where rotation moves an old checkpoint (one rename, orbax's
# `todelete_subdir`) before its files are removed; never a step name, so never listed.
DELETING = "deleting"


def _to_nested(state: TrainState) -> dict:
    """`state` as nested dicts with string keys: orbax's plainest, most portable tree."""
    out: dict = {}
    for path, leaf in zip(leaf_paths(state), jax.tree.leaves(state), strict=True):
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = leaf
    return out


def _from_nested(nested: dict, like: TrainState) -> TrainState:
    """Inverse of `_to_nested`: the leaves of `nested` in the structure of `like`."""
    leaves = []
    for path in leaf_paths(like):
        node = nested
        for part in path:
            node = node[part]
        leaves.append(node)
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def _register_array_handler() -> None:
    """In a single process, each shard of an array is saved whole from one of its replicas.

    orbax's default (replica-parallel saving) has each of a shard's R replicas save 1/R of it,
    which spreads a pod's writes over its hosts; in one process the bytes leave the same host
    either way, and every slice is an eager `slice_in_dim`, one small XLA compile per shape
    and device (docs/runs.md). Either way without orbax's per-process array metadata files,
    whose directory the other processes wait to see process 0 create: each process then
    writes only into directories it made, so processes that share no filesystem can save."""
    global _HANDLER_SET
    if not _HANDLER_SET:
        parallel = None if jax.process_count() > 1 else False  # None: orbax's default
        handler = ocp.type_handlers.ArrayHandler(use_replica_parallel=parallel)
        absl = logging.getLogger("absl")
        level = absl.level
        absl.setLevel(logging.ERROR)  # not its "overriding jax.Array" warning
        try:
            ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
        finally:
            absl.setLevel(level)
        _HANDLER_SET = True


_HANDLER_SET = False  # registered in this process


class Checkpointer:
    """Save and restore `TrainState`s in `<logdir>/checkpoints/` (keeps the newest `keep`)."""

    def __init__(
        self,
        logdir: str | Path,
        keep: int,
        on_commit: Callable[[], None] | None = None,
        barrier: Callable[..., None] | None = None,
    ):
        self.logdir = Path(logdir)  # the run directory these checkpoints are kept in
        self.directory = self.logdir.absolute() / CHECKPOINTS
        self._on_commit = on_commit  # called once the saves so far are committed (and rotated)
        self.shown = Path(logdir) / CHECKPOINTS  # as the user spelled it, for messages
        self.saved_step: int | None = None  # the newest step this checkpointer saved
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=False,
            enable_async_checkpointing=True,
            todelete_subdir=DELETING,
            # orbax's barriers of a save (`jaxpod.run.shardsync` for a URL's copies)
            async_options=None if barrier is None else ocp.AsyncOptions(barrier_sync_fn=barrier),
        )
        self._remove_rotated()  # what an interrupted run had rotated out
        _register_array_handler()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step (incomplete, temporary ones are ignored)."""
        return self._manager.latest_step() if self.directory.is_dir() else None

    def save(
        self,
        step: int,
        state: TrainState,
        seed: int,
        *,
        config: dict | None = None,
        records: list[dict] = (),
        layer_order: Sequence[int] | None = None,
    ) -> None:
        """Start saving `state` as checkpoint `step`; returns once the arrays are off-device.

        The state may be donated to the next train step as soon as this returns. `config` (the
        run's config as a dict) and `records` (the run record's lines of this step, e.g. its
        metrics) are kept with it: a resume restores them even if the record lost them.
        `layer_order` is the engine's (`stages.layer_order`, the order its stacked layers are
        stored in): a restore under another order moves every layer to its place.
        A save that fails is a one-line `UserError` naming the directory.
        """
        meta = {"step": step, "seed": seed, "checksums": checksums(state)}
        meta |= {"config": config, "records": list(records)}
        meta["layer_order"] = None if layer_order is None else [int(i) for i in layer_order]
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with Muted() as mute:  # a failed write leaves orbax's threads printing tracebacks
                try:
                    self._manager.wait_until_finished()  # the last save's rotation included
                    self._remove_rotated()
                    if self._on_commit is not None:
                        self._on_commit()
                    self._manager.save(
                        step,
                        args=ocp.args.Composite(
                            state=ocp.args.StandardSave(_to_nested(state)),
                            meta=ocp.args.JsonSave(meta),
                        ),
                        force=True,
                    )
                except Exception:
                    mute.keep()
                    raise
        except UserError:  # `on_commit`'s own, already one line
            raise
        except Exception as exc:
            raise self._save_error(exc) from None
        self.saved_step = step

    def _save_error(self, exc: BaseException) -> UserError:
        return UserError(
            f"checkpoint could not be saved under {self.shown} ({_why(exc)}); check that the "
            "directory is writable and has free space, then run again to resume from the "
            "last saved checkpoint"
        )

    def meta(self, step: int) -> dict:
        """The JSON record of checkpoint `step` (`RECORD`); a checkpoint that cannot be read,
        or whose record lacks one of those keys, is refused naming its directory (`UserError`)."""
        where = self.shown / str(step)
        for part in ("state/_METADATA", "meta/metadata"):
            if not (self.directory / str(step) / part).is_file():
                raise UserError(f"checkpoint {where} cannot be read ({part} is missing); {FIX}")
        args = ocp.args.Composite(meta=ocp.args.JsonRestore())
        meta = dict(_read(where, lambda: self._manager.restore(step, args=args))["meta"])
        missing = [key for key in RECORD if key not in meta]
        if missing:
            raise UserError(
                f"checkpoint {where} has another layout (its record has no {', '.join(missing)}); "
                "use a fresh train.logdir"
            )
        return meta

    def restore(
        self, step: int, engine: Engine, like: TrainState, seed: int, meta: dict | None = None
    ) -> TrainState:
        """Checkpoint `step`, read directly into `engine.state_sharding` (the current mesh).

        Refuses (`UserError`, before reading any array) a checkpoint whose tree, shapes or
        dtypes differ from `like` (the freshly built state of this config), or whose seed
        differs; a checkpoint that cannot be read is refused naming its directory. Stacked
        layers saved in another order than the engine's are moved to its order. `meta`: the
        checkpoint's record if the caller has read it (`meta(step)`), else it is read here.
        """
        where = self.shown / str(step)
        meta = self.meta(step) if meta is None else meta
        saved_seed = meta["seed"]
        saved = by_path(_read(where, lambda: self._manager.item_metadata(step))["state"])
        if saved_seed != seed:
            raise UserError(
                f"checkpoint {where} was trained with train.seed={saved_seed} but "
                f"train.seed={seed} here; use the same train.seed or a fresh train.logdir"
            )
        target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            like,
            engine.state_sharding,
        )
        check_matches(where, saved, by_path(_to_nested(target)))
        args = ocp.args.Composite(state=ocp.args.StandardRestore(_to_nested(target)))
        restored = _read(where, lambda: self._manager.restore(step, args=args))
        state = _from_nested(restored["state"], like)
        check_sums(where, meta["checksums"], checksums(state), FIX)
        return engine.stages.reordered(state, meta["layer_order"])

    def close(self) -> None:
        """Wait for in-flight saves to be committed, then release the manager; a background
        write that failed is a one-line `UserError`."""
        try:
            with Muted() as mute:
                try:
                    self._manager.close()
                except Exception:
                    mute.keep()
                    raise
        except Exception as exc:
            raise self._save_error(exc) from None
        self._remove_rotated()

    def _remove_rotated(self) -> None:
        """Remove the checkpoints rotation moved into `DELETING` (process 0, when no save is
        finishing: orbax renames into it only while finishing one)."""
        if jax.process_index() == 0:
            shutil.rmtree(self.directory / DELETING, ignore_errors=True)

    def abandon(self, seconds: float = ABANDON_SECONDS) -> None:
        """Close, waiting at most `seconds` for in-flight writes (the run is failing anyway:
        a write that never ends must not hold the process). Errors are dropped."""

        def close() -> None:
            try:
                self._manager.close()
            except Exception:  # noqa: S110 - the run's own error is what gets reported
                pass

        thread = threading.Thread(target=close, daemon=True)
        thread.start()
        thread.join(seconds)
        if not thread.is_alive():  # else the next run removes what rotation moved
            self._remove_rotated()

    def __enter__(self) -> Checkpointer:
        """Inside, errors of orbax's abandoned writes (after one failed) are not printed."""
        self._hooks = sys.excepthook, sys.unraisablehook
        sys.excepthook = lambda *e: None if _abandoned(e[1]) else self._hooks[0](*e)
        sys.unraisablehook = lambda u: None if _abandoned(u.exc_value) else self._hooks[1](u)
        logging.getLogger("absl").addFilter(_reraised)
        logging.getLogger("asyncio").addFilter(_reraised)
        return self

    def __exit__(self, kind, *exc) -> None:
        try:
            if kind is None:
                self.close()
            else:  # a second Ctrl-C wants out now: an uncommitted save is discarded atomically
                self.abandon(0.5 if issubclass(kind, KeyboardInterrupt) else ABANDON_SECONDS)
        finally:
            sys.excepthook, sys.unraisablehook = self._hooks
            logging.getLogger("absl").removeFilter(_reraised)
            if kind is None:  # after an error, orbax's unretrieved tasks may be logged later
                logging.getLogger("asyncio").removeFilter(_reraised)


def _reraised(record: logging.LogRecord) -> bool:
    """False (drop) for orbax's logs of a failed background write (with its traceback), and
    for asyncio's "Task exception was never retrieved" about orbax's other writes: the same
    error is raised by the next save or the close, and reported there in one line."""
    if not record.exc_info:
        return True
    if "orbax" in record.pathname:
        return False
    return "orbax" not in record.getMessage()


def _abandoned(exc: BaseException | None) -> bool:
    """The error a write raises when orbax has given up on it after another write failed
    (its callback finds the event loop closed): noise next to the error that matters."""
    return isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc)


def _read(where: Path, read):
    """`read()` of checkpoint `where`; if it fails, a one-line `UserError` naming the directory
    (orbax/tensorstore raise many types for a damaged one). Muted: a failed read leaves orbax's
    other reads printing tracebacks as they finish (`_settle`)."""
    why = None
    with Muted() as mute:
        try:
            return read()
        except Exception as exc:
            why = _why(exc)  # keep no reference to it: its frames hold the abandoned reads
        if not mute.keep():
            _settle(seconds=3.0)
    raise UserError(f"checkpoint {where} cannot be read ({why}); {FIX}")


def _settle(seconds: float) -> None:
    """Give the reads a failed restore left in flight `seconds` to finish (while muted).

    When one array fails, orbax abandons the others mid-read; as they finish they print
    tracebacks (its read coroutine turns the cancellation into an Exception, and tensorstore
    calls back into the closed event loop). Best effort for library callers: on a loaded
    machine a read can outlive any window, which is why the CLI stays muted instead.
    """
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)


# the operating system's reason inside a storage error ("...: File too large
# [os_error_code='27']"): read from its error number, however the text around it is worded or
# quoted, or else found by the wording of any error number (a message without the number)
OS_ERROR_CODE = re.compile(r"os_error_code=\W*(\d+)")
OS_REASONS = tuple(os.strerror(n) for n in sorted(errno.errorcode))


def _os_reason(text: str) -> str | None:
    """The operating system's reason named in `text` (its first, by position), or None."""
    code = OS_ERROR_CODE.search(text)
    if code:
        return os.strerror(int(code.group(1)))
    found = [(text.find(reason), reason) for reason in OS_REASONS if reason in text]
    return min(found)[1] if found else None


FULL = (errno.ENOSPC, errno.EDQUOT)


def _why(exc: BaseException) -> str:
    """One line of a storage error: its type, its start and, when the text is long, the
    operating system's reason (orbax joins the errors of many writes into one message); a full
    disk says so first (tensorstore calls it RESOURCE_EXHAUSTED, as XLA calls running out of
    memory)."""
    text = " ".join(str(exc).split()).split(" See full")[0]
    full = any(os.strerror(n) in text for n in FULL) or any(
        int(code) in FULL for code in OS_ERROR_CODE.findall(text)
    )
    if len(text) > 200:
        tail = _os_reason(text) or text[-95:]
        text = f"{text[:100]} ... {tail}"
    why = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return f"disk full: {why}" if full else why
