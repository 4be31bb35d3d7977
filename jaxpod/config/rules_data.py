"""The data section's rules: a dataset that feeds what the model reads (images or token ids),
its path, and a tokenizer that fits the model's vocabulary (`data.tokenizer`).

A tokenizer file's own vocabulary is checked where it is read (`jaxpod.data.tokenized`); here
only what the config alone decides. jax-free.
"""

from jaxpod.config.fields import _check_fields, fail
from jaxpod.config.schema import IMAGE_DATA, TEXT_DATA, Config

PATH_DATA = ("text-files", "image-folder")  # the data.name values that read data.path
TOKENIZED_DATA = ("stdlib-code", "text-files")  # what a data.tokenizer other than bytes reads
BYTE_VOCAB = 256  # data.tokenizer=bytes: token ids are the byte values 0..255


def check_data(cfg: Config) -> None:
    """The dataset: its path, and that it feeds what the model reads (images or tokens)."""
    _check_fields(cfg, "data")
    d, md = cfg.data, cfg.model
    if not 0 < d.val_fraction < 1:
        fail(f"data.val_fraction={d.val_fraction} must be between 0 and 1 (exclusive)")
    if d.name in PATH_DATA and not d.path:
        kind = "text files" if d.name == "text-files" else "one subdirectory of images per class"
        fail(f"data.name={d.name} needs data.path=DIR (a directory of {kind})")
    if d.name not in PATH_DATA and d.path is not None:
        fail(
            f"data.path={d.path!r} is only used by data.name=text-files or image-folder; "
            "set data.path=null"
        )
    _check_mask_id(cfg)
    if d.tokenizer != "bytes":
        _check_tokenizer(cfg)
    if cfg.kind.data == "images":
        if d.name not in IMAGE_DATA:
            fail(
                f"data.name={d.name} is text but model.name={md.name} classifies images; "
                f"use data.name one of {', '.join(IMAGE_DATA)}"
            )
        return
    if d.name not in TEXT_DATA:
        fail(
            f"data.name={d.name} is images but model.name={md.name} reads tokens; "
            f"use data.name one of {', '.join(TEXT_DATA)}"
        )
    if d.tokenizer != "bytes":
        return
    if md.name == "bert" and md.vocab <= BYTE_VOCAB:
        t = cfg.mesh.tensor
        fail(
            f"model.vocab={md.vocab}: BERT needs the {BYTE_VOCAB} byte values plus a "
            f"[MASK] id ({BYTE_VOCAB}); use model.vocab>={BYTE_VOCAB + 1} divisible by "
            f"mesh.tensor={t}, e.g. {-(-(BYTE_VOCAB + 1) // t) * t}"
        )
    if md.vocab < BYTE_VOCAB:
        fail(
            f"model.vocab={md.vocab} is smaller than {BYTE_VOCAB} byte values of "
            f"data.name={d.name}; use model.vocab>={BYTE_VOCAB}"
        )


BPE_MASK_ID = 1  # the BPE jaxpod trains for BERT: <|endoftext|> is id 0, [MASK] id 1


def resolve_mask_id(cfg: Config) -> int | None:
    """BERT's [MASK] id: `model.mask_id`, else the tokenizer's (`BYTE_VOCAB` after the bytes,
    `BPE_MASK_ID` in jaxpod's BPE); None for the other models."""
    md = cfg.model
    if md.name != "bert":
        return md.mask_id
    if md.mask_id is not None:
        return md.mask_id
    return BPE_MASK_ID if cfg.data.tokenizer == "bpe" else BYTE_VOCAB


def _check_mask_id(cfg: Config) -> None:
    md = cfg.model
    if md.mask_id is None:
        return
    if md.name != "bert":
        fail(f"model.mask_id={md.mask_id} is BERT's [MASK] id; set model.mask_id=null")
    if not 0 <= md.mask_id < md.vocab:
        fail(f"model.mask_id={md.mask_id} is not an id of model.vocab={md.vocab}")


def _check_tokenizer(cfg: Config) -> None:
    """`data.tokenizer` other than bytes: a text corpus, a model that reads any ids, and for
    `bpe` a vocabulary with room for merges after the 256 bytes and the end-of-text id."""
    d, md = cfg.data, cfg.model
    if d.tokenizer != "bpe" and not d.tokenizer.endswith(".json"):
        fail(f"data.tokenizer={d.tokenizer!r} is not bytes, bpe or a path to a tokenizer.json")
    if d.name not in TOKENIZED_DATA:
        fail(
            f"data.tokenizer={d.tokenizer} reads text files, not data.name={d.name}; "
            f"use data.name one of {', '.join(TOKENIZED_DATA)}, or data.tokenizer=bytes"
        )
    if md.name == "bert" and d.tokenizer != "bpe" and md.mask_id is None:
        fail(
            f"data.tokenizer={d.tokenizer}: model.name=bert needs its [MASK] id; set "
            "model.mask_id to the tokenizer's id for [MASK]"
        )
    if d.tokenizer == "bpe" and md.vocab <= BYTE_VOCAB + 1:
        fail(
            f"data.tokenizer=bpe learns model.vocab={md.vocab} ids, the {BYTE_VOCAB} bytes and "
            "an end-of-text id among them: set model.vocab larger, e.g. 1024"
        )
