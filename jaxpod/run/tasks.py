"""What the training loop trains: a dataset, an engine and its state, behind one interface.

    text   (gpt):           tokens int32[G, T+1]                      -> jaxpod.engine.transformer
    vision (efficientnet):  (images uint8[G, H, W, 3], labels int32[G]) -> jaxpod.engine.vision

Batches are global arrays sharded over `replica`, assembled with
`jax.make_array_from_callback`: each device's callback reads only the rows of its own
replica, so in a multi-process run every process reads only the data of its own devices.
Images cross host->device as uint8 (a quarter of float32's bytes) and are normalised on the
device inside the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxpod.config.load import Config


@dataclass
class Task:
    """A dataset bound to an engine. `unit` names what `per_step` counts (tokens/images)."""

    cfg: Config
    dataset: Any  # TokenDataset | ImageDataset
    engine: Any  # Engine | VisionEngine
    unit: str
    per_step: int

    @property
    def vision(self) -> bool:
        return self.unit == "images"

    @property
    def params(self) -> int | None:
        """The real parameter count when the state's arrays include padding (packed stage
        rows of the image engine); None when counting the arrays' elements is right."""
        return self.engine.model.params if self.vision else None

    def batch(self, step: int, val: bool = False):
        """Global batch of train step `step` (0-based) or of validation batch `step`."""
        g, sharding = self.cfg.global_batch, self.engine.batch_sharding
        if not self.vision:
            read = self.dataset.val_rows if val else self.dataset.train_rows
            return jax.make_array_from_callback(
                (g, self.cfg.model.seq_len + 1),
                sharding,
                lambda idx: read(step, idx[0].start or 0, idx[0].stop or g, g),
            )
        read = self.dataset.val_batch if val else self.dataset.train_batch
        size = self.cfg.model.image_size
        cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

        def rows(idx):  # one read per replica slice, shared by images and labels
            key = (idx[0].start or 0, idx[0].stop or g)
            if key not in cache:
                cache[key] = read(step, *key, g)
            return cache[key]

        images = jax.make_array_from_callback((g, size, size, 3), sharding, lambda i: rows(i)[0])
        labels = jax.make_array_from_callback((g,), sharding, lambda i: rows(i)[1])
        return images, labels

    def evaluate(self, params) -> dict[str, float]:
        """`val_loss` (and `val_accuracy` for classifiers) over `train.eval_batches` batches."""
        n = self.cfg.train.eval_batches
        if not self.vision:
            losses = [self.engine.eval_loss(params, self.batch(b, val=True)) for b in range(n)]
            return {"val_loss": float(np.mean(jax.device_get(losses)))}
        n = min(n, self.dataset.val_batches(self.cfg.global_batch))
        results = jax.device_get(
            [self.engine.eval_batch(params, self.batch(b, val=True)) for b in range(n)]
        )
        loss = float(np.mean([r[0] for r in results]))
        accuracy = float(sum(r[1] for r in results) / (n * self.cfg.global_batch))
        return {"val_loss": loss, "val_accuracy": accuracy}


def build_task(cfg: Config, mesh: jax.sharding.Mesh) -> tuple[Task, Any]:
    """Load the dataset and build the engine; returns `(task, initial state)`."""
    if cfg.is_vision:
        from jaxpod.engine.vision import build_vision_engine
        from jaxpod.run.images import load_images

        ds = load_images(
            cfg.data.name,
            image_size=cfg.model.image_size,
            seed=cfg.train.seed,
            path=cfg.data.path,
            val_fraction=cfg.data.val_fraction,
            num_classes=cfg.model.num_classes,
        )
        engine, state = build_vision_engine(cfg, mesh)
        return Task(cfg, ds, engine, "images", cfg.global_batch), state
    from jaxpod.engine.transformer import build_engine
    from jaxpod.run.data import load_dataset

    ds = load_dataset(
        cfg.data.name,
        seq_len=cfg.model.seq_len,
        seed=cfg.train.seed,
        path=cfg.data.path,
        val_fraction=cfg.data.val_fraction,
    )
    engine, state = build_engine(cfg, mesh)
    return Task(cfg, ds, engine, "tokens", cfg.tokens_per_step), state
