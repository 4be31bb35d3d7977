"""Tokenized text (`jaxpod.data.tokens`): a byte-level BPE trained on the corpus, token files
written once with held-out documents, windows read by (seed, step) from the memory map."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.texts import documents

from jaxpod.data.tokens import (
    END_OF_TEXT,
    is_validation,
    load_tokenizer,
    open_token_files,
    train_bpe,
    write_token_files,
)
from jaxpod.errors import DataError

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(documents(), vocab=300)


def test_the_bpe_is_the_same_for_the_same_texts_and_round_trips(bpe, tmp_path):
    assert bpe.get_vocab_size() == 300 and bpe.token_to_id(END_OF_TEXT) == 0
    assert train_bpe(documents(), vocab=300).to_str() == bpe.to_str()
    text = "def ünïcode_42(x):\n    return x\n"  # bytes it never saw still encode
    assert bpe.decode(bpe.encode(text).ids) == text
    ids, raw = bpe.encode(documents()[0]).ids, documents()[0].encode()
    assert len(ids) < 0.6 * len(raw)  # 43 merges learnt: fewer ids than bytes
    bpe.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path / "tokenizer.json").to_str() == bpe.to_str()


def test_a_bad_tokenizer_path_is_one_line(tmp_path):
    with pytest.raises(DataError, match="is no file; name a tokenizer.json"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError) as exc:
        load_tokenizer(tmp_path / "bad.json")
    assert "is no tokenizer.json" in str(exc.value) and "\n" not in str(exc.value)


def test_documents_are_held_out_whole_by_their_text(bpe, tmp_path):
    docs = documents()
    held = [d for d in docs if is_validation(d, 0.2)]
    assert 0 < len(held) < len(docs) / 2
    assert [is_validation(d, 0.2) for d in docs] == [is_validation(d, 0.2) for d in docs]
    out = write_token_files(iter(docs), bpe, tmp_path / "tok", val_fraction=0.2)
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["val_docs"], meta["train_docs"]) == (len(held), len(docs) - len(held))
    val = np.fromfile(out / "val.tokens", dtype=meta["dtype"])
    expected = [t for d in held for t in [*bpe.encode(d).ids, 0]]  # each closed by id 0
    assert val.tolist() == expected


def test_token_files_are_written_once(bpe, tmp_path):
    out = write_token_files(documents(), bpe, tmp_path / "tok", val_fraction=0.2)
    before = (out / "train.tokens").read_bytes()
    # a second writer finds them complete and reads none of its texts
    assert write_token_files(iter(()), bpe, out, val_fraction=0.2) == out
    assert (out / "train.tokens").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["tok"]  # no temporary directory left


def test_rows_depend_on_seed_and_step_only(bpe, tmp_path):
    out = write_token_files(documents(), bpe, tmp_path / "tok", val_fraction=0.2)
    ds = open_token_files(out, name="bpe-test", seq_len=16, seed=3)
    whole = ds.train_rows(5, 0, 8, 8)
    halves = np.concatenate([ds.train_rows(5, 0, 4, 8), ds.train_rows(5, 4, 8, 8)])
    np.testing.assert_array_equal(whole, halves)  # any split of rows over processes
    assert whole.shape == (8, 17) and whole.dtype == np.int32
    again = open_token_files(out, name="bpe-test", seq_len=16, seed=3)
    np.testing.assert_array_equal(again.train_rows(5, 0, 8, 8), whole)
    other = open_token_files(out, name="bpe-test", seq_len=16, seed=4)
    assert not np.array_equal(other.train_rows(5, 0, 8, 8), whole)
    train = np.fromfile(out / "train.tokens", dtype=ds.meta["dtype"])
    windows = train[: ds.num_train_windows * 17].reshape(-1, 17)
    assert all(any((w == row).all() for w in windows) for row in whole)  # whole windows
    assert "held-out documents" in ds.describe()


def test_too_little_text_is_one_line(bpe, tmp_path):
    out = write_token_files(documents(6), bpe, tmp_path / "tok", val_fraction=0.2)
    with pytest.raises(DataError, match="too few for model.seq_len=4096"):
        open_token_files(out, name="bpe-test", seq_len=4096, seed=0)


def test_berts_bpe_holds_mask_as_its_second_id():
    """The BPE trained for BERT (`specials` with `MASK`) has `[MASK]` at the id the config
    resolves for it, and encodes `[MASK]` in text as that one id."""
    from jaxpod.config.rules_data import BPE_MASK_ID
    from jaxpod.data.tokens import MASK

    tok = train_bpe(documents(), vocab=300, specials=(END_OF_TEXT, MASK))
    assert tok.token_to_id(END_OF_TEXT) == 0 and tok.token_to_id(MASK) == BPE_MASK_ID
    assert BPE_MASK_ID in tok.encode("a [MASK] b").ids
