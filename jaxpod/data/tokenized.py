"""A text corpus as BPE tokens: `data.tokenizer` (`bpe`, or a `tokenizer.json`) picks the
tokenizer, and the corpus's token files are written once into the user's cache, then
memory-mapped by every run that reads the same corpus the same way.

`bpe` trains a byte-level BPE of `model.vocab` ids on the training corpus itself (the
stdlib, or the files under `data.path`; for BERT with `[MASK]` as id 1); a path or a URL
(read through fsspec: `jaxpod.data.store`) loads the user's tokenizer, whose ids must fit in
`model.vocab` (a larger `model.vocab` pads the table, as GPT-2's 50,257 ids in 50,304 rows).
Nothing is downloaded. Every file is read, one chunk of documents at a time: no size cap.

The cache: `$XDG_CACHE_HOME/jaxpod/tokens/<key>/` (`~/.cache/jaxpod/tokens/<key>/` when
`XDG_CACHE_HOME` is unset), holding `train.tokens`, `val.tokens`, `meta.json` and the
`tokenizer.json` they were encoded with. `<key>` hashes the corpus's files (relative path,
size, and modification time, or under a URL the store's version marks), the tokenizer
(`bpe`, `model.vocab` and its special ids, or the bytes of the user's file) and
`data.val_fraction`: an edited corpus or another tokenizer gets a new directory, and a
directory is complete or absent (`jaxpod.data.tokens.write_token_files`). Every process
builds or finds it on its own host; the rows a step reads do not depend on which process
wrote it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from jaxpod.data.documents import (
    file_stamp,
    read_stdlib,
    read_text,
    stdlib_files,
    stdlib_root,
    text_files,
)
from jaxpod.data.store import is_url
from jaxpod.data.tokens import (
    END_OF_TEXT,
    META,
    TokenFileDataset,
    load_tokenizer,
    open_token_files,
    require_tokenizers,
    tokenizer_bytes,
    train_bpe,
    write_token_files,
)
from jaxpod.errors import DataError

BYTES, BPE = "bytes", "bpe"  # data.tokenizer's named choices; anything else is a path


def cache_dir() -> Path:
    """Where token files are kept: `$XDG_CACHE_HOME/jaxpod/tokens` (default `~/.cache/...`)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxpod" / "tokens"


def _corpus(name: str, path: str | None) -> tuple[list, Path | None, Callable, str]:
    """(files, their root, the reader of one file, a description of the corpus)."""
    if name == "stdlib-code":
        root = stdlib_root()
        return stdlib_files(root), Path(root), read_stdlib, f"Python from {root}"
    if name != "text-files":
        raise DataError(f"data.name={name!r} has no text to tokenize; set data.tokenizer=bytes")
    if path is None:
        raise DataError("data.path is not set; data.name='text-files' needs data.path=DIR")
    files = text_files(path)
    if is_url(path):
        return files, None, read_text, f"text from {path}"
    root = Path(path).expanduser()
    return files, (root if root.is_dir() else root.parent), read_text, f"text from {path}"


def _texts(files: list[Path], read: Callable) -> Iterator[str]:
    """The documents of `files` in order, read one at a time (unreadable files skipped)."""
    for f in files:
        got = read(f)
        if got is not None:
            yield got[0].decode("utf-8", "replace")


def _key(
    files: list, root: Path | None, tokenizer: str, vocab: int, vf: float, specials: tuple
) -> str:
    """The cache key of a corpus read with a tokenizer (see the module docstring)."""
    h = hashlib.blake2b(digest_size=12)
    for f in files:
        h.update(f"{file_stamp(f, root)}\n".encode())
    extra = "" if specials == (END_OF_TEXT,) else ":" + ",".join(specials)
    spec = f"{BPE}:{vocab}{extra}".encode() if tokenizer == BPE else tokenizer_bytes(tokenizer)
    h.update(b"\0tokenizer\0" + spec + f"\0val_fraction\0{vf!r}".encode())
    return h.hexdigest()


def _check_vocab(ids: int, vocab: int, tokenizer: str) -> None:
    """The tokenizer's ids fit in the model's table."""
    if ids > vocab:
        raise DataError(
            f"model.vocab={vocab} is smaller than the {ids:,} ids of data.tokenizer="
            f"{tokenizer!r}; set model.vocab>={ids} (rounded up to a multiple of mesh.tensor)"
        )


def check_tokenizer(tokenizer: str, vocab: int) -> None:
    """`data.tokenizer` can be used: `tokenizers` is installed (`bpe` or a path), and a path
    names a tokenizer.json whose ids fit in `model.vocab` (one-line `DataError` otherwise)."""
    if tokenizer == BYTES:
        return
    require_tokenizers()
    if tokenizer != BPE:
        user = load_tokenizer(tokenizer if is_url(tokenizer) else os.path.expanduser(tokenizer))
        _check_vocab(user.get_vocab_size(), vocab, tokenizer)


def load_tokens(
    name: str,
    *,
    tokenizer: str,
    vocab: int,
    seq_len: int,
    seed: int,
    path: str | None = None,
    val_fraction: float = 0.05,
    specials: tuple[str, ...] = (END_OF_TEXT,),
) -> TokenFileDataset:
    """Dataset `name` ('stdlib-code' or 'text-files') tokenized by `tokenizer` (`bpe` or a
    tokenizer.json path) as windows of `seq_len + 1` ids, built into `cache_dir()` once;
    `specials`: a trained BPE's first ids (BERT's holds `[MASK]`)."""
    files, root, read, source = _corpus(name, path)
    if tokenizer != BPE and not is_url(tokenizer):
        tokenizer = os.path.expanduser(tokenizer)
    user = None if tokenizer == BPE else load_tokenizer(tokenizer)  # one line if missing
    if user is not None:
        _check_vocab(user.get_vocab_size(), vocab, tokenizer)
    directory = cache_dir() / _key(files, root, tokenizer, vocab, val_fraction, specials)
    if not (directory / META).is_file():
        tok = user if user is not None else train_bpe(_texts(files, read), vocab, specials)
        write_token_files(_texts(files, read), tok, directory, val_fraction)
    ids = json.loads((directory / META).read_text())["vocab"]
    _check_vocab(ids, vocab, tokenizer)
    how = "a BPE trained on it" if tokenizer == BPE else f"tokenizer {tokenizer}"
    return open_token_files(
        directory, name=name, seq_len=seq_len, seed=seed, source=f"{source}, {how}"
    )
