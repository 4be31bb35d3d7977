"""A `data.tokenizer` the run cannot use, through the CLI: one line naming the field and the
fix, exit 2, before jax starts (the no-jax shim), and no run directory left behind."""

from __future__ import annotations

import pytest
from helpers.cli import SMALL, TINY, assert_user_error, jaxpod, without_jax
from helpers.texts import documents, write_corpus

pytestmark = pytest.mark.cli
pytest.importorskip("tokenizers")


def train(tmp_path, *overrides: str, env: dict | None = None):
    corpus = write_corpus(tmp_path / "corpus", n=10)
    text = ("data.name=text-files", f"data.path={corpus}", f"train.logdir={tmp_path}/run")
    return jaxpod("train", TINY, *SMALL, *text, *overrides, env=env or without_jax(tmp_path))


def test_bpe_without_tokenizers_installed_names_the_extra(tmp_path):
    env = without_jax(tmp_path)
    shim = tmp_path / "no-jax" / "tokenizers"  # beside the no-jax shim, on its PYTHONPATH
    shim.mkdir()
    (shim / "__init__.py").write_text('raise ImportError("no tokenizers (the test\'s shim)")\n')
    proc = train(tmp_path, "data.tokenizer=bpe", "model.vocab=512", env=env)
    assert_user_error(proc, "data.tokenizer needs Hugging Face tokenizers", "jaxpod[data]")
    assert not (tmp_path / "run").exists()


def test_a_missing_tokenizer_json_is_one_line(tmp_path):
    proc = train(tmp_path, f"data.tokenizer={tmp_path}/nope/tokenizer.json")
    assert_user_error(proc, "data.tokenizer=", "is no file; name a tokenizer.json")
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_larger_than_model_vocab_is_one_line(tmp_path):
    from jaxpod.data.tokens import train_bpe

    train_bpe(documents(20), vocab=300).save(str(tmp_path / "tokenizer.json"))
    proc = train(tmp_path, f"data.tokenizer={tmp_path}/tokenizer.json", "model.vocab=256")
    assert_user_error(
        proc, "model.vocab=256 is smaller than the 300 ids of data.tokenizer=", "model.vocab>=300"
    )
    assert not (tmp_path / "run").exists()
