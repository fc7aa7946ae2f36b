"""data.tokenizer: a local Hugging Face tokenizer.json beside the byte tokenizer."""

from __future__ import annotations

import pytest

from recipe.config import ConfigError
from recipe.data.tokenizer import ByteTokenizer, FileTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A small BPE vocabulary trained here on CPython's help topics: no download."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["[UNK]"])
    tok.train_from_iterator(list(topics.values()), trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_file_tokenizer_round_trips_and_reserves_its_own_special_ids(tokenizer_file):
    tok = load_tokenizer(tokenizer_file)
    assert isinstance(tok, FileTokenizer)
    text = "The for statement is used to iterate over the elements of a sequence."
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.pad_id == tok.vocab_size - 1 and max(ids[1:-1]) < tok.bos_id
    assert len(ids) < len(ByteTokenizer().encode(text)), "subwords: fewer tokens than bytes"
    assert tok.decode(ids).strip() == text


def test_bad_tokenizer_paths_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="data.tokenizer='nowhere.json' is not a file"):
        load_tokenizer("nowhere.json")
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="is not a readable tokenizer.json"):
        load_tokenizer(str(broken))
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


def test_training_with_a_tokenizer_file(tokenizer_file):
    from recipe.data.corpus import load_corpus
    from recipe.launch.rank import train
    from tests.helpers.config import typed_config

    cfg = typed_config(["data=pydoc", f"data.tokenizer={tokenizer_file}", "trainer.max_steps=2"])
    corpus = load_corpus(cfg.data)
    assert corpus.tokenizer.vocab_size == load_tokenizer(tokenizer_file).vocab_size
    tok = corpus.tokenizer
    assert max(max(s) for s in corpus.train) <= tok.eos_id, "no id beyond the vocabulary"
    assert sum(s[0] == tok.bos_id for s in corpus.train) >= 10, "documents start with BOS"
    result = train(cfg)
    assert result["summary"]["steps"] == 2
    assert result["summary"]["entropy_floor"] is None
