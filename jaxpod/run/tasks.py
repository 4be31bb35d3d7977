"""What the training loop trains: a dataset bound to an engine, behind one interface.

Batches (with `train.batch_parts` > 1, parts of batches) are tuples of global arrays sharded
over the batch axes (`(tokens,)` or `(images, labels)`). They are read in two steps:
`Task.read` reads each device's rows into host memory (a `HostBatch`; every process reads only
the rows of its own devices), `HostBatch.put` copies them to the devices
(`jax.make_array_from_callback`). Images cross host->device as uint8 (a quarter of float32's
bytes) and are normalised on the device inside the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxpod.config import Config
from jaxpod.data.feed import DeviceFeed, HostBatch, fetch_when_done, index_key
from jaxpod.engine import Engine, TrainState, abstract_engine, build_engine


@dataclass
class Task:
    """A dataset (`TokenDataset`, `TokenFileDataset`, `ImageDataset` or `FolderImages`) bound
    to an engine: a task in the learning sense (the data and the model and loss that learn
    from it), not a cluster's (a process)."""

    cfg: Config
    dataset: Any
    engine: Engine

    @property
    def unit(self) -> str:
        """What `per_step` counts: tokens or images."""
        return self.dataset.unit

    @property
    def per_step(self) -> int:
        return self.cfg.global_batch * self.dataset.per_example()

    def read(self, step: int, val: bool = False, part: int = 0) -> HostBatch:
        """Part `part` of the global batch of train step `step` (0-based) or of validation
        batch `step`, in host memory: its rows `[part * n, (part + 1) * n)`, n =
        `cfg.part_batch` (the whole batch when `train.batch_parts` is 1)."""
        g, n = self.cfg.global_batch, self.cfg.part_batch
        split = "val" if val else "train"
        cache: dict[tuple[int, int], tuple] = {}

        def rows(index):  # one read per replica slice, shared by every array of the batch
            key = (part * n + (index[0].start or 0), part * n + (index[0].stop or n))
            if key not in cache:
                cache[key] = self.dataset.read(split, step, *key, g)
            return cache[key]

        arrays = []
        for i, (shape, sharding) in enumerate(
            zip(self.dataset.shapes(n), self.engine.batch_sharding, strict=True)
        ):
            indices = sharding.addressable_devices_indices_map(shape).values()
            arrays.append((shape, sharding, {index_key(ix): rows(ix)[i] for ix in indices}))
        return HostBatch(tuple(arrays))

    def batch(self, step: int, val: bool = False, part: int = 0) -> tuple:
        """`read(step, val, part)` copied to the devices."""
        return self.read(step, val, part).put()

    def evaluate(self, params) -> dict[str, float]:
        """`val_loss` (and `val_accuracy` for classifiers): the mean over `train.eval_batches`
        validation batches (fewer if the validation set is smaller), each the sum of its
        parts' (every part's loss is divided by the whole batch's count). It runs between
        calls: its first part is copied once the step that computed `params` is done, and it
        returns once its own calls are done on every device (`DeviceFeed`)."""
        n = self.cfg.train.eval_batches
        limit = self.dataset.val_batches(self.cfg.global_batch)
        n = n if limit is None else min(n, limit)
        k = self.cfg.train.batch_parts
        reads = (self.read(b, True, part) for b in range(n) for part in range(k))
        feed = DeviceFeed(reads, after=params)  # the step that computed `params` is done
        outs = []
        for _ in range(n * k):
            outs.append(self.engine.eval_step(params, next(feed)))
            feed.dispatched(outs[-1])
        parts = fetch_when_done(outs)  # every device's calls done before the next part is copied
        sums = [
            {m: sum(p[m] for p in parts[b * k : (b + 1) * k]) for m in parts[0]} for b in range(n)
        ]
        return {m: float(np.mean([r[m] for r in sums])) for m in sums[0]}


def load_data(cfg: Config):
    """The dataset of `cfg.data`, cut for the model: byte or token windows, or labelled
    images."""
    if cfg.kind.data == "images":
        from jaxpod.data.images import load_images

        return load_images(
            cfg.data.name,
            image_size=cfg.model.image_size,
            seed=cfg.train.seed,
            path=cfg.data.path,
            val_fraction=cfg.data.val_fraction,
            num_classes=cfg.model.num_classes,
            workers=cfg.data.workers,
        )
    if cfg.data.tokenizer != "bytes":
        from jaxpod.data.tokenized import load_tokens
        from jaxpod.data.tokens import END_OF_TEXT, MASK

        return load_tokens(
            cfg.data.name,
            tokenizer=cfg.data.tokenizer,
            vocab=cfg.model.vocab,
            seq_len=cfg.model.seq_len,
            seed=cfg.train.seed,
            path=cfg.data.path,
            val_fraction=cfg.data.val_fraction,
            specials=(END_OF_TEXT, MASK) if cfg.model.name == "bert" else (END_OF_TEXT,),
        )
    from jaxpod.data.text import load_dataset

    return load_dataset(
        cfg.data.name,
        seq_len=cfg.model.seq_len,
        seed=cfg.train.seed,
        path=cfg.data.path,
        val_fraction=cfg.data.val_fraction,
    )


def build_task(
    cfg: Config, mesh: jax.sharding.Mesh, *, initialise: bool = True
) -> tuple[Task, TrainState]:
    """Load the dataset and build the engine; returns `(task, initial state)`, the state as
    `ShapeDtypeStruct`s with shardings if not `initialise` (a resume restores into those:
    nothing is initialised only to be overwritten)."""
    dataset = load_data(cfg)
    engine, state = (build_engine if initialise else abstract_engine)(cfg, mesh)
    return Task(cfg, dataset, engine), state
