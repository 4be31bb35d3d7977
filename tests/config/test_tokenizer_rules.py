"""`data.tokenizer`'s rules (`jaxpod.config.rules_data`): what the config alone decides, in one
line naming the field and the fix. A tokenizer file's own vocabulary is tests/data's."""

from __future__ import annotations

import pytest
from helpers import TINY_YAML

from jaxpod.config import ConfigError, load_config

TEXT = ("data.name=text-files", "data.path=/corpus")


def test_the_default_is_bytes_and_a_path_expands_home(monkeypatch):
    monkeypatch.setenv("HOME", "/home/me")
    assert load_config(TINY_YAML).data.tokenizer == "bytes"
    cfg = load_config(TINY_YAML, [*TEXT, "data.tokenizer=~/tok/tokenizer.json"])
    assert cfg.data.tokenizer == "/home/me/tok/tokenizer.json"
    assert load_config(TINY_YAML, ["data.tokenizer=bpe", "model.vocab=512"]).data.tokenizer == "bpe"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.tokenizer=bep"],
            "data.tokenizer='bep' is not bytes, bpe or a path to a tokenizer.json",
        ),
        (
            ["data.tokenizer=bpe", "data.name=synthetic", "model.vocab=512"],
            "data.tokenizer=bpe reads text files, not data.name=synthetic; use data.name one "
            "of stdlib-code, text-files, or data.tokenizer=bytes",
        ),
        (
            [*TEXT, "data.tokenizer=/t/tokenizer.json", "model.name=bert", "model.vocab=512"],
            "data.tokenizer=/t/tokenizer.json: model.name=bert needs its [MASK] id; set "
            "model.mask_id to the tokenizer's id for [MASK]",
        ),
        (
            ["model.mask_id=3"],
            "model.mask_id=3 is BERT's [MASK] id; set model.mask_id=null",
        ),
        (
            ["model.name=bert", "model.vocab=264", "model.mask_id=264"],
            "model.mask_id=264 is not an id of model.vocab=264",
        ),
        (
            ["data.tokenizer=bpe", "model.vocab=256"],
            "data.tokenizer=bpe learns model.vocab=256 ids, the 256 bytes and an end-of-text id "
            "among them: set model.vocab larger, e.g. 1024",
        ),
        (
            [
                "data.tokenizer=bpe",
                "model.name=efficientnet",
                "data.name=digits",
                "mesh.tensor=1",
                "mesh.pipeline=1",
                "mesh.replica=-1",
            ],
            "data.tokenizer=bpe reads text files, not data.name=digits",
        ),
    ],
    ids=["typo", "synthetic", "bert-json", "gpt-mask", "mask-range", "small-vocab", "images"],
)
def test_a_tokenizer_the_config_cannot_use_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as exc:
        load_config(TINY_YAML, overrides)
    assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


def test_berts_mask_id_is_the_tokenizers():
    """After the bytes (256) with the byte tokenizer, id 1 of the BPE jaxpod trains for BERT,
    the user's own for a tokenizer.json; GPT has none."""
    bert = ("model.name=bert", "model.vocab=512")
    assert load_config(TINY_YAML, bert).model.mask_id == 256
    assert load_config(TINY_YAML, [*bert, "data.tokenizer=bpe"]).model.mask_id == 1
    json = [*TEXT, "data.tokenizer=/t/tokenizer.json", "model.mask_id=4"]
    assert load_config(TINY_YAML, [*bert, *json]).model.mask_id == 4
    assert load_config(TINY_YAML, ["data.tokenizer=bpe", "model.vocab=512"]).model.mask_id is None
