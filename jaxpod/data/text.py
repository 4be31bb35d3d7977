"""Byte-level language-modelling datasets, deterministic and independent of the mesh.

Vocabulary is bytes (0..255; `data.tokenizer=bytes`). Documents (files: `jaxpod.data.documents`)
are read in sorted order up to a cap held in memory (16 MiB), whole documents held out for
validation by a hash of their text; each split is its documents joined by a blank line and cut
into windows of ``seq_len + 1`` consecutive bytes, which the engine shifts into
inputs/targets. Row ``i`` of training step ``k`` is global example
``g = k * global_batch + i``; train windows are visited in a seeded permutation per epoch, so
the rows of a step depend only on (dataset, seq_len, seed, global_batch), never on the mesh or
the number of processes. Host-side only: numpy + standard library, no jax, nothing downloaded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jaxpod.data.documents import (
    is_validation,
    read_stdlib,
    read_text,
    stdlib_files,
    stdlib_root,
    text_files,
)
from jaxpod.errors import DataError

NAMES = ("stdlib-code", "synthetic", "text-files")
SEPARATOR = b"\n\n"
_SPLIT_IDS = {"train": 0, "val": 1}


class Windows:
    """What every token dataset shares: examples are windows of `seq_len + 1` ids, a batch is
    `(tokens int32[G, seq_len + 1],)` read by `train_rows` / `val_rows`, and validation rows
    wrap around (no fixed number of batches)."""

    seq_len: int
    unit = "tokens"  # what a step's throughput counts

    @property
    def window(self) -> int:
        """Ids per example: seq_len + 1."""
        return self.seq_len + 1

    def per_example(self) -> int:
        """Units (tokens) one example trains on: seq_len."""
        return self.seq_len

    def shapes(self, global_batch: int) -> tuple[tuple[int, ...], ...]:
        """The global shape of each batch array: `((G, seq_len + 1),)`."""
        return ((global_batch, self.window),)

    def read(self, split: str, step: int, start: int, stop: int, global_batch: int) -> tuple:
        """Rows [start, stop) of train step / val batch `step`: `(tokens,)` (see `train_rows`)."""
        rows = self.train_rows if split == "train" else self.val_rows
        return (rows(step, start, stop, global_batch),)

    def val_batches(self, global_batch: int) -> int | None:
        """Validation batches before repeating: None (any number; rows wrap around)."""
        return None


def epoch_positions(seed: int, n: int, g: np.ndarray) -> np.ndarray:
    """Positions among `n` training examples of global examples `g` (int64[B]): each epoch
    of n consecutive global examples is the permutation seeded by (seed, epoch). int64[B]
    (shared by the text and image datasets)."""
    epochs = g // n
    pos = np.empty_like(g)
    for epoch in np.unique(epochs):
        sel = epochs == epoch
        pos[sel] = epoch_permutation(seed, int(epoch), n)[g[sel] % n]
    return pos


def epoch_rows(windows: np.ndarray, seed: int, g: np.ndarray) -> np.ndarray:
    """Train windows of global example indices `g` as int32: each epoch visits `windows` in a
    permutation seeded by (seed, epoch)."""
    return windows[epoch_positions(seed, windows.shape[0], g)].astype(np.int32)


@dataclass(frozen=True)
class TokenDataset(Windows):
    """A byte corpus cut into non-overlapping train/val windows (or synthetic random bytes)."""

    name: str
    seq_len: int
    seed: int
    _train: np.ndarray | None = field(default=None, repr=False, compare=False)  # uint8[n, W]
    _val: np.ndarray | None = field(default=None, repr=False, compare=False)  # uint8[m, W]
    _source: str = field(default="", repr=False)

    @property
    def num_train_windows(self) -> int | None:
        """Number of train windows per epoch (None for synthetic: unlimited)."""
        return None if self._train is None else int(self._train.shape[0])

    @property
    def num_val_windows(self) -> int | None:
        """Number of validation windows (None for synthetic: unlimited)."""
        return None if self._val is None else int(self._val.shape[0])

    def train_rows(self, step: int, start: int, stop: int, global_batch: int) -> np.ndarray:
        """Rows [start, stop) of training step `step` (0-based): int32[stop-start, seq_len+1]."""
        g = global_indices(step, start, stop, global_batch)
        if self._train is None:
            return self._synthetic(g, "train")
        return epoch_rows(self._train, self.seed, g)

    def val_rows(self, batch: int, start: int, stop: int, global_batch: int) -> np.ndarray:
        """Rows [start, stop) of validation batch `batch` (unshuffled): int32[stop-start, W]."""
        g = global_indices(batch, start, stop, global_batch)
        if self._val is None:
            return self._synthetic(g, "val")
        return self._val[g % self._val.shape[0]].astype(np.int32)

    def describe(self) -> str:
        """One line: source, size and window counts."""
        if self._train is None:
            return f"{self.name}: {self._source}, unlimited windows of {self.window} bytes"
        return (
            f"{self.name}: {self._source}, {self.num_train_windows:,} train / "
            f"{self.num_val_windows:,} val windows of {self.window} bytes"
        )

    def _synthetic(self, g: np.ndarray, split: str) -> np.ndarray:
        """Random bytes, each row generated from (seed, split, global index): int32[len(g), W]."""
        out = np.empty((g.shape[0], self.window), dtype=np.int32)
        for r, gi in enumerate(g.tolist()):
            rng = np.random.default_rng([self.seed, _SPLIT_IDS[split], gi])
            out[r] = rng.integers(0, 256, size=self.window, dtype=np.uint8)
        return out


def global_indices(step: int, start: int, stop: int, global_batch: int) -> np.ndarray:
    """Global example indices step * global_batch + [start, stop): int64[stop-start]."""
    if step < 0 or global_batch < 1 or not 0 <= start <= stop <= global_batch:
        raise ValueError(
            f"bad row request: step={step}, rows [{start}, {stop}) of global_batch={global_batch}"
        )
    return np.arange(start, stop, dtype=np.int64) + np.int64(step) * global_batch


@functools.lru_cache(maxsize=8)
def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The visiting order of the n training examples in `epoch`: int64[n] (shared by the
    text and image datasets)."""
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    perm.setflags(write=False)
    return perm


def decode(tokens: np.ndarray) -> str:
    """Bytes (any int array, flattened) -> str, undecodable bytes replaced."""
    data = np.asarray(tokens).ravel().astype(np.uint8).tobytes()
    return data.decode("utf-8", errors="replace")


def _join(texts: list[bytes]) -> np.ndarray:
    """File contents joined with SEPARATOR: read-only uint8[n]."""
    return np.frombuffer(SEPARATOR.join(texts), dtype=np.uint8)


def _capped(files: list[Path], max_bytes: int, read) -> tuple[list[bytes], int, bool]:
    """The documents of `files` in order until `max_bytes` (separators counted), each read
    no further than the cap leaves room for: (texts, files skipped by `read`, cut)."""
    texts: list[bytes] = []
    skipped, total, cut = 0, 0, False
    for f in files:
        if total >= max_bytes:
            return texts, skipped, True
        got = read(f, max_bytes - total)
        if got is None:
            skipped += 1
            continue
        data, cut = got
        texts.append(data)
        total += len(data) + len(SEPARATOR)
    return texts, skipped, cut


def _split(texts: list[bytes], window: int, val_fraction: float) -> tuple[np.ndarray, ...]:
    """Held-out documents (`is_validation`) apart, each split joined and cut into
    uint8[k, window]: (train, val)."""
    held = [is_validation(t.decode("utf-8", "replace"), val_fraction) for t in texts]
    out = []
    for split in (False, True):
        data = _join([t for t, h in zip(texts, held, strict=True) if h == split])
        n = data.shape[0] // window
        out.append(data[: n * window].reshape(n, window))
    return tuple(out)


@functools.lru_cache(maxsize=4)
def _stdlib_corpus(root: str, max_bytes: int) -> tuple[list[bytes], int, bool]:
    """The stdlib's .py files in sorted relative-path order, capped: (texts, skipped, cut)."""
    return _capped(stdlib_files(root), max_bytes, read_stdlib)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _too_few(where: str, train: np.ndarray, val: np.ndarray, seq_len: int, vf: float) -> str:
    """The one-line message of a corpus with < 2 train or < 1 held-out window."""
    return (
        f"{where} {train.size:,} train / {val.size:,} held-out bytes in whole windows, too few "
        f"for model.seq_len={seq_len}: need 2 train and 1 held-out window of {seq_len + 1} "
        f"bytes (whole documents are held out, by a hash of their text, at "
        f"data.val_fraction={vf})"
    )


def _corpus(name: str, path: str | None, max_bytes: int) -> tuple[list[bytes], str, str]:
    """(documents, source description, where-clause of the too-few message)."""
    if name == "stdlib-code":
        root = stdlib_root()
        texts, _, cut = _stdlib_corpus(root, max_bytes)
        size = sum(map(len, texts))
        first = f", the first {_mib(max_bytes)} read" if cut else ""
        source = f"{_mib(size)} of Python from {root} ({len(texts)} files{first})"
        return texts, source, "stdlib-code has"
    if path is None:
        raise DataError(
            "data.path is not set; data.name='text-files' needs data.path pointing at a "
            "directory of text files"
        )
    texts, skipped, truncated = _capped(text_files(path), max_bytes, read_text)
    if not texts:
        raise DataError(
            f"data.path={path!r} holds no UTF-8 text files ({skipped} binary or unreadable "
            "skipped); point data.path at a directory of text files"
        )
    cut = f", the first {_mib(max_bytes)} read" if truncated else ""
    size = sum(map(len, texts))
    files = f"{len(texts)} files, {skipped} skipped as binary{cut}"
    source = f"{_mib(size)} of text from {path} ({files})"
    return texts, source, f"data.path={path!r} holds"


def load_dataset(
    name: str,
    *,
    seq_len: int,
    seed: int,
    path: str | None = None,
    val_fraction: float = 0.05,
    max_bytes: int = 16 * 2**20,
) -> TokenDataset:
    """Load dataset `name` ('stdlib-code', 'text-files' or 'synthetic') as windows of seq_len+1."""
    if name not in NAMES:
        raise DataError(f"data.name={name!r} is unknown; use one of: {', '.join(NAMES)}")
    if seq_len < 1:
        raise DataError(f"model.seq_len={seq_len} must be >= 1; set model.seq_len to e.g. 128")
    window = seq_len + 1
    if name == "synthetic":
        source = f"uniformly random bytes (seed {seed})"
        return TokenDataset(name, seq_len, seed, _source=source)
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"data.val_fraction={val_fraction} must be in (0, 1); e.g. 0.05")
    if max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes} must be positive")  # no config key sets it
    texts, source, where = _corpus(name, path, max_bytes)
    train, val = _split(texts, window, val_fraction)
    if train.shape[0] < 2 or val.shape[0] < 1:
        fix = "lower model.seq_len" if name == "stdlib-code" else "add text files to data.path"
        raise DataError(f"{_too_few(where, train, val, seq_len, val_fraction)}; {fix}")
    return TokenDataset(name, seq_len, seed, _train=train, _val=val, _source=source)
