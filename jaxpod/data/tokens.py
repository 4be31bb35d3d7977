"""Tokenized text: a byte-level BPE (Hugging Face `tokenizers`), token files written once and
read as memory-mapped windows.

Documents -> token ids -> two flat token files, `train.tokens` and `val.tokens`: each document
goes wholly to one split, chosen by a hash of its text (so validation is held-out documents,
and adding a file moves no other document across). The files are written once, in chunks of
documents (memory bounded by a chunk, not the corpus), into a temporary directory renamed
into place, so a reader never sees half a file. A step's rows are windows of `seq_len + 1`
tokens read from the memory map: row `i` of step `k` is the same window for every mesh and
process count (`global_indices`, `epoch_permutation`, as for bytes), and a process touches
only the pages of the rows it reads. Host-side only: numpy and `tokenizers`, nothing
downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jaxpod.data.documents import is_validation
from jaxpod.data.ledger import Ledger
from jaxpod.data.store import is_url, read_bytes
from jaxpod.data.text import Windows, epoch_positions, global_indices
from jaxpod.errors import DataError

END_OF_TEXT = "<|endoftext|>"  # id 0: closes every document
MASK = "[MASK]"  # id 1 of the BPE trained for BERT (`jaxpod.config.rules_data.BPE_MASK_ID`)
META = "meta.json"
TOKENIZER = "tokenizer.json"  # the tokenizer the files were encoded with, kept beside them
CHUNK = 256  # documents encoded (and held) at a time


def require_tokenizers():
    """The `tokenizers` module; a one-line `DataError` naming the extra if it is missing."""
    try:
        import tokenizers
    except ImportError:
        raise DataError(
            "data.tokenizer needs Hugging Face tokenizers; pip install 'jaxpod[data]'"
        ) from None
    return tokenizers


def train_bpe(texts: Iterable[str], vocab: int, specials: tuple[str, ...] = (END_OF_TEXT,)):
    """A byte-level BPE of `vocab` ids trained on `texts`, `specials` its first ids (id 0:
    `END_OF_TEXT`; BERT's adds `MASK`, id 1); the same texts in the same order give the same
    tokenizer."""
    tk = require_tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(specials),
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def tokenizer_bytes(path: str | os.PathLike) -> bytes:
    """The bytes of the tokenizer.json at `path`, a local path or a URL read through fsspec
    (`jaxpod.data.store`); one-line `DataError` if there is no such file."""
    if is_url(path):
        return read_bytes("data.tokenizer", path, "a tokenizer.json")
    if not Path(path).is_file():
        raise DataError(f"data.tokenizer={os.fspath(path)!r} is no file; name a tokenizer.json")
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise DataError(
            f"data.tokenizer={os.fspath(path)!r} cannot be read ({exc.strerror}); name a "
            "tokenizer.json you can read"
        ) from None


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved at `path` (a `tokenizer.json`, local or a URL); one-line
    `DataError` otherwise."""
    tk = require_tokenizers()
    data = tokenizer_bytes(path)
    try:
        return tk.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # the library raises a bare Exception for a bad file
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(
            f"data.tokenizer={os.fspath(path)!r} is no tokenizer.json ({first}); name one "
            "saved by Hugging Face tokenizers"
        ) from None


def _chunks(texts: Iterable[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    for text in texts:
        chunk.append(text)
        if len(chunk) == CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def write_token_files(
    texts: Iterable[str], tokenizer, directory: str | os.PathLike, val_fraction: float
) -> Path:
    """Encode `texts` (documents) into `directory`'s `train.tokens` and `val.tokens` once,
    with the tokenizer saved beside them (`TOKENIZER`); an existing complete directory is kept
    as it is. Returns the directory."""
    directory = Path(directory)
    if (directory / META).is_file():
        return directory
    vocab = tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    end = tokenizer.token_to_id(END_OF_TEXT)
    directory.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".writing-", dir=directory.parent))
    counts = {"train": [0, 0], "val": [0, 0]}  # documents, tokens
    try:
        with open(work / "train.tokens", "wb") as train, open(work / "val.tokens", "wb") as val:
            for chunk in _chunks(texts):
                for text, encoding in zip(chunk, tokenizer.encode_batch(chunk), strict=True):
                    split = "val" if is_validation(text, val_fraction) else "train"
                    ids = np.asarray([*encoding.ids, *([end] if end is not None else [])], dtype)
                    (val if split == "val" else train).write(ids.tobytes())
                    counts[split][0] += 1
                    counts[split][1] += ids.size
        tokenizer.save(str(work / TOKENIZER))
        meta = {"vocab": vocab, "dtype": np.dtype(dtype).name, "val_fraction": val_fraction}
        meta |= {f"{s}_{k}": counts[s][i] for s in counts for i, k in enumerate(("docs", "ids"))}
        (work / META).write_text(json.dumps(meta, indent=2))
        try:
            os.replace(work, directory)
        except OSError:  # another process wrote it first: theirs is the same
            if not (directory / META).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return directory


@dataclass(frozen=True)
class TokenFileDataset(Windows):
    """Windows of `seq_len + 1` token ids from the token files in `directory` (memory-mapped);
    the same interface as `jaxpod.data.text.TokenDataset`.

    `ledger` counts the bytes the reader holds (`jaxpod.data.ledger`): one epoch's visiting
    order (`index_bytes`), the rows it copies out of the map for a batch and the int32 batch
    it returns while alive. The mapped pages are the kernel's page cache, dropped under
    pressure, and not counted.
    """

    name: str
    seq_len: int
    seed: int
    directory: Path
    _source: str = field(default="", repr=False)
    ledger: Ledger = field(default_factory=Ledger, repr=False, compare=False)

    def __post_init__(self):
        self.ledger.hold(self.index_bytes)

    @property
    def index_bytes(self) -> int:
        """Bytes of one epoch's visiting order of the train windows (int64 each)."""
        return 8 * self.num_train_windows

    @property
    def peak_bytes(self) -> int:
        """The most bytes the reader has held at once (`ledger`)."""
        return self.ledger.peak

    @property
    def meta(self) -> dict:
        return json.loads((self.directory / META).read_text())

    def _map(self, split: str) -> np.ndarray:
        """The split's windows, uint[n, window], mapped from disk (nothing read yet)."""
        path = self.directory / f"{split}.tokens"
        dtype = np.dtype(self.meta["dtype"])
        n = path.stat().st_size // dtype.itemsize // self.window
        if n == 0:
            return np.zeros((0, self.window), dtype)
        return np.memmap(path, dtype=dtype, mode="r", shape=(n, self.window))

    @property
    def num_train_windows(self) -> int:
        return int(self._map("train").shape[0])

    @property
    def num_val_windows(self) -> int:
        return int(self._map("val").shape[0])

    def train_rows(self, step: int, start: int, stop: int, global_batch: int) -> np.ndarray:
        """Rows [start, stop) of training step `step`: int32[stop-start, seq_len+1]; each
        epoch visits the train windows in a permutation seeded by (seed, epoch)."""
        g = global_indices(step, start, stop, global_batch)
        windows = self._map("train")
        return self._copy(windows, epoch_positions(self.seed, windows.shape[0], g))

    def val_rows(self, batch: int, start: int, stop: int, global_batch: int) -> np.ndarray:
        """Rows [start, stop) of validation batch `batch`, in order (wrapping around)."""
        windows = self._map("val")
        g = global_indices(batch, start, stop, global_batch)
        return self._copy(windows, g % windows.shape[0])

    def _copy(self, windows: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Windows `rows` (int64[B]) copied out of the map as int32[B, window], counted."""
        picked = windows[rows]
        with self.ledger.scratch(picked.nbytes):
            return self.ledger.track(picked.astype(np.int32))

    def describe(self) -> str:
        m = self.meta
        return (
            f"{self.name}: {self._source}, {m['vocab']:,} token ids; {m['train_docs']:,} train "
            f"/ {m['val_docs']:,} held-out documents, {self.num_train_windows:,} / "
            f"{self.num_val_windows:,} windows of {self.window} tokens"
        )


def open_token_files(
    directory: str | os.PathLike, *, name: str, seq_len: int, seed: int, source: str = ""
) -> TokenFileDataset:
    """The dataset of written token files; one-line `DataError` if a split has no window."""
    ds = TokenFileDataset(name, seq_len, seed, Path(directory), _source=source)
    m = ds.meta
    if ds.num_train_windows < 2 or ds.num_val_windows < 1:
        raise DataError(
            f"{name}: {m['train_ids']:,} train / {m['val_ids']:,} held-out tokens, too few "
            f"for model.seq_len={seq_len} (2 train and 1 held-out window of {seq_len + 1}; "
            f"whole documents are held out, by a hash of their text, at data.val_fraction="
            f"{m['val_fraction']}); add text or lower model.seq_len"
        )
    return ds
