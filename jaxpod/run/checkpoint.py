"""Checkpoints of the train state under `<train.logdir>/checkpoints/<step>/` (orbax).

A checkpoint holds the `TrainState` (step, params, optimizer state; every array saved shard by
shard from the devices that own it) and a small JSON record (step, seed). The data position
needs no saving: the batch of step k is a pure function of (seed, k).

Saving is asynchronous: `save` returns once the arrays are copied off the devices, and orbax
writes them in the background into a temporary directory that is renamed into place when
complete, so a run killed mid-save leaves the earlier checkpoints intact and the incomplete one
is never listed. Restoring reads straight into the target shardings of the current mesh (which
may differ from the saving mesh): no array is ever gathered onto one device. Only orbax's
standard formats (tensorstore arrays + JSON) are read; nothing is unpickled.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxpod.engine import Engine, TrainState
from jaxpod.errors import Muted, UserError

CHECKPOINTS = "checkpoints"


def _part(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)  # pragma: no cover


def _paths(tree) -> list[tuple[str, ...]]:
    """The path of every leaf of `tree`, as strings (dict keys, field names, indices)."""
    return [tuple(_part(k) for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _to_nested(state: TrainState) -> dict:
    """`state` as nested dicts with string keys: orbax's plainest, most portable tree."""
    out: dict = {}
    for path, leaf in zip(_paths(state), jax.tree.leaves(state), strict=True):
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = leaf
    return out


def _from_nested(nested: dict, like: TrainState) -> TrainState:
    """Inverse of `_to_nested`: the leaves of `nested` in the structure of `like`."""
    leaves = []
    for path in _paths(like):
        node = nested
        for part in path:
            node = node[part]
        leaves.append(node)
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def _flat(nested, prefix: tuple[str, ...] = ()) -> dict[str, object]:
    """`{"params.blocks.mlp.w_in": leaf, ...}` of a nested dict (any mapping-like metadata)."""
    if hasattr(nested, "items"):
        out: dict[str, object] = {}
        for key, value in nested.items():
            out.update(_flat(value, (*prefix, str(key))))
        return out
    return {".".join(prefix): nested}


def _shape(leaf) -> str:
    return f"{list(leaf.shape)} {jax.numpy.dtype(leaf.dtype).name}"


class Checkpointer:
    """Save and restore `TrainState`s in `<logdir>/checkpoints/` (keeps the newest `keep`)."""

    def __init__(self, logdir: str | Path, keep: int):
        self.directory = Path(logdir).absolute() / CHECKPOINTS
        self.shown = Path(logdir) / CHECKPOINTS  # as the user spelled it, for messages
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=False, enable_async_checkpointing=True
        )
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

    def save(self, step: int, state: TrainState, seed: int) -> None:
        """Start saving `state` as checkpoint `step`; returns once the arrays are off-device.

        The state may be donated to the next train step as soon as this returns.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_to_nested(state)),
                meta=ocp.args.JsonSave({"step": step, "seed": seed}),
            ),
            force=True,
        )

    def restore(self, step: int, engine: Engine, like: TrainState, seed: int) -> TrainState:
        """Checkpoint `step`, read directly into `engine.state_sharding` (the current mesh).

        Refuses (`UserError`, before reading any array) a checkpoint whose tree, shapes or
        dtypes differ from `like` (the freshly built state of this config), or whose seed
        differs; a checkpoint that cannot be read is refused naming its directory.
        """
        where = self.shown / str(step)
        fix = "delete that directory to resume from the previous checkpoint, or use a fresh"
        fix += " train.logdir"
        try:
            args = ocp.args.Composite(meta=ocp.args.JsonRestore())
            saved_seed = dict(self._manager.restore(step, args=args)["meta"]).get("seed")
            saved = _flat(self._manager.item_metadata(step)["state"])
        except Exception as exc:  # orbax/tensorstore raise many types for a damaged directory
            raise UserError(f"checkpoint {where} cannot be read ({_why(exc)}); {fix}") from None
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
        _check_matches(where, saved, _flat(_to_nested(target)))
        args = ocp.args.Composite(state=ocp.args.StandardRestore(_to_nested(target)))
        why = None
        with Muted() as mute:  # a failed read leaves orbax's other reads printing tracebacks
            try:
                restored = self._manager.restore(step, args=args)
            except Exception as exc:
                why = _why(exc)  # keep no reference to it: its frames hold the abandoned reads
            if why is not None and not mute.keep():
                _settle(seconds=3.0)
        if why is not None:
            raise UserError(f"checkpoint {where} cannot be read ({why}); {fix}")
        return _from_nested(restored["state"], like)

    def close(self) -> None:
        """Wait for in-flight saves to be committed, then release the manager."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def _why(exc: BaseException) -> str:
    text = " ".join(str(exc).split()).split(" See full")[0]
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _check_matches(where: Path, saved: dict[str, object], here: dict[str, object]) -> None:
    """One-line `UserError` naming the first parameter path whose shape/dtype differ."""
    fix = "use a fresh train.logdir or the same model.* and optim.*"
    head = f"checkpoint {where} does not match the model:"
    for path in sorted(set(saved) | set(here), key=lambda p: (not p.startswith("params."), p)):
        if path not in here or path not in saved:
            side = "the checkpoint only" if path in saved else "the model only"
            raise UserError(f"{head} {path} is in {side}; {fix}")
        a, b = saved[path], here[path]
        if tuple(a.shape) != tuple(b.shape) or jax.numpy.dtype(a.dtype) != b.dtype:
            raise UserError(f"{head} {path} is {_shape(a)} there but {_shape(b)} here; {fix}")
