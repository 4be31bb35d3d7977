"""Byte-level language-modelling datasets, deterministic and independent of the mesh.

Vocabulary is bytes (0..255). An example is a window of ``seq_len + 1`` consecutive bytes; the
engine shifts it into inputs/targets. Row ``i`` of training step ``k`` is global example
``g = k * global_batch + i``; train windows are visited in a seeded permutation per epoch, so
the rows of a step depend only on (dataset, seq_len, seed, global_batch), never on the mesh or
the number of processes. Host-side only: numpy + standard library, no jax, nothing downloaded.
"""

from __future__ import annotations

import codecs
import functools
import math
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jaxpod.errors import DataError

NAMES = ("stdlib-code", "synthetic", "text-files")
SEPARATOR = b"\n\n"
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
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


def epoch_rows(windows: np.ndarray, seed: int, g: np.ndarray) -> np.ndarray:
    """Train windows of global example indices `g` as int32: each epoch visits `windows` in a
    permutation seeded by (seed, epoch)."""
    n = windows.shape[0]
    epochs = g // n
    idx = np.empty_like(g)
    for epoch in np.unique(epochs):
        sel = epochs == epoch
        idx[sel] = epoch_permutation(seed, int(epoch), n)[g[sel] % n]
    return windows[idx].astype(np.int32)


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


def _join(texts: list[bytes], max_bytes: int) -> tuple[np.ndarray, bool]:
    """Join file contents with SEPARATOR, capped at max_bytes: (read-only uint8[n], truncated)."""
    data = SEPARATOR.join(texts)
    truncated = len(data) > max_bytes
    arr = np.frombuffer(data[:max_bytes], dtype=np.uint8)
    return arr, truncated


@functools.lru_cache(maxsize=4)
def _stdlib_corpus(root: str, max_bytes: int) -> tuple[np.ndarray, int]:
    """The stdlib's .py files in sorted relative-path order, capped: (uint8[n], files used)."""
    paths: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        paths += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    paths.sort(key=lambda p: os.path.relpath(p, root).split(os.sep))
    texts: list[bytes] = []
    total = 0
    for p in paths:
        if total >= max_bytes:
            break
        try:
            with open(p, "rb") as f:
                data = f.read(max_bytes - total)  # never more than the cap leaves room for
        except OSError:
            continue
        texts.append(data)
        total += len(data) + len(SEPARATOR)
    return _join(texts, max_bytes)[0], len(texts)


def _text_corpus(path: str, max_bytes: int) -> tuple[np.ndarray, int, int, bool]:
    """UTF-8 files under `path` (sorted, hidden entries skipped): (uint8[n], kept, skipped, cut)."""
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(
            f"data.path={path!r} does not exist; point data.path at a directory of text files"
        )
    if root.is_file():
        files = [root]
    else:
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            files += [Path(dirpath, f) for f in filenames if not f.startswith(".")]
        files = sorted((f for f in files if f.is_file()), key=lambda f: f.relative_to(root).parts)
    texts: list[bytes] = []
    skipped = 0
    total = 0
    for f in files:
        if total >= max_bytes:
            break
        try:
            with open(f, "rb") as stream:  # never more than the cap leaves room for
                data = stream.read(max_bytes - total + 1)
            if b"\0" in data[:8192]:
                raise UnicodeDecodeError("utf-8", data, 0, 1, "NUL byte")
            cut = len(data) > max_bytes - total  # a character cut at the cap is no error
            codecs.getincrementaldecoder("utf-8")().decode(data, final=not cut)
        except (OSError, UnicodeDecodeError):
            skipped += 1
            continue
        texts.append(data)
        total += len(data) + len(SEPARATOR)
    if not texts:
        raise DataError(
            f"data.path={path!r} holds no UTF-8 text files ({skipped} binary or unreadable "
            "skipped); point data.path at a directory of text files"
        )
    corpus, truncated = _join(texts, max_bytes)
    return corpus, len(texts), skipped, truncated


def _bytes_needed(window: int, val_fraction: float) -> int:
    """Smallest corpus size giving >= 2 train windows and >= 1 val window."""
    n = max(3 * window, math.ceil(window / val_fraction))
    while not _enough(n, window, val_fraction):
        n += 1
    return n


def _enough(n: int, window: int, val_fraction: float) -> bool:
    n_val = int(n * val_fraction)
    return n_val >= window and n - n_val >= 2 * window


def _split(corpus: np.ndarray, window: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Last val_fraction of the bytes is validation; each split cut into uint8[k, window]."""
    n_val = int(corpus.shape[0] * val_fraction)
    train, val = corpus[: corpus.shape[0] - n_val], corpus[corpus.shape[0] - n_val :]
    nt, nv = train.shape[0] // window, val.shape[0] // window
    return train[: nt * window].reshape(nt, window), val[: nv * window].reshape(nv, window)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


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
    needed = _bytes_needed(window, val_fraction)
    if name == "stdlib-code":
        root = sysconfig.get_paths()["stdlib"]
        corpus, n_files = _stdlib_corpus(root, max_bytes)
        source = f"{_mib(corpus.shape[0])} of Python from {root} ({n_files} files)"
        if not _enough(corpus.shape[0], window, val_fraction):
            raise DataError(
                f"stdlib-code has {corpus.shape[0]:,} bytes (read up to {_mib(max_bytes)}), too "
                f"few for model.seq_len={seq_len}: need >= {needed:,}; lower model.seq_len, or "
                "use data.name=text-files with a larger corpus"
            )
    else:
        if path is None:
            raise DataError(
                "data.path is not set; data.name='text-files' needs data.path pointing at a "
                "directory of text files"
            )
        corpus, kept, skipped, truncated = _text_corpus(path, max_bytes)
        cut = f", the first {_mib(max_bytes)} read" if truncated else ""
        source = (
            f"{_mib(corpus.shape[0])} of text from {path} ({kept} files, "
            f"{skipped} skipped as binary{cut})"
        )
        if not _enough(corpus.shape[0], window, val_fraction):
            raise DataError(
                f"data.path={path!r} holds {corpus.shape[0]:,} bytes of text, too few for "
                f"model.seq_len={seq_len}: need >= {needed:,} (2 train + 1 val windows of "
                f"{window} bytes at data.val_fraction={val_fraction}); add text to data.path or "
                "lower model.seq_len"
            )
    train, val = _split(corpus, window, val_fraction)
    return TokenDataset(name, seq_len, seed, _train=train, _val=val, _source=source)
