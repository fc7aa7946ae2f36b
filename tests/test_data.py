"""Data sources, the held-out split, tokenization and the Markov chain's exact floor."""

from __future__ import annotations

import json

import numpy as np
import pytest

from recipe.config import ConfigError, DataConfig, MarkovConfig
from recipe.data.corpus import load_corpus, split_documents, tokenize
from recipe.data.markov import END_CHAR, MarkovChain
from recipe.data.tokenizer import ByteTokenizer, split_long

TOK = ByteTokenizer()


def test_tokenizer_round_trip_and_specials():
    ids = TOK.encode("héllo")
    assert ids[0] == TOK.bos_id and ids[-1] == TOK.eos_id
    assert TOK.decode(ids) == "héllo"
    assert TOK.vocab_size == 259 and len({TOK.bos_id, TOK.eos_id, TOK.pad_id}) == 3


@pytest.mark.parametrize("n,max_len", [(1, 5), (10, 3), (9, 3), (100, 7)])
def test_long_documents_are_split_not_dropped(n, max_len):
    ids = list(range(n))
    pieces = split_long(ids, max_len)
    assert [t for p in pieces for t in p] == ids
    assert all(len(p) <= max_len for p in pieces)


def test_tokenize_keeps_every_token_of_long_documents():
    doc = "x" * 1000
    seqs = tokenize([doc], TOK, max_seq_len=64)
    assert all(len(s) <= 64 for s in seqs)
    assert sum(len(s) for s in seqs) == len(doc) + 2


def test_split_is_seeded_disjoint_and_complete():
    docs = [f"doc{i}" for i in range(100)]
    train, eval_ = split_documents(docs, 0.1, seed=7)
    assert len(eval_) == 10 and sorted(train + eval_) == sorted(docs)
    assert split_documents(docs, 0.1, seed=7) == (train, eval_)
    assert split_documents(docs, 0.1, seed=8)[1] != eval_


def _tiny_chain(seed=0):
    return MarkovChain.create(
        order=2, alphabet_size=4, concentration=0.3, mean_doc_len=30, max_doc_len=80, seed=seed
    )


def test_token_log_probs_match_a_direct_reference():
    chain = _tiny_chain()
    for doc in chain.sample_documents(20, seed=1):
        ids = TOK.encode(doc)
        got = chain.token_log_probs(np.asarray(ids), TOK.bos_id, TOK.eos_id)
        # Reference: walk the document with an explicit context tuple.
        start = chain.alphabet_size
        context = (start, start)
        expected = []
        for token in ids[1:]:
            if token == TOK.eos_id:
                expected.append(0.0)
                continue
            code = chain.alphabet_size if chr(token) == END_CHAR else token - ord("a")
            index = context[0] + (chain.alphabet_size + 1) * context[1]
            expected.append(np.log(chain.probs[index, code]))
            context = (context[1], code)
        np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_generated_documents_follow_the_chain():
    """Empirical next-symbol frequencies in the most common context match the chain."""
    chain = _tiny_chain()
    docs = chain.sample_documents(3000, seed=2)
    counts = {}
    for doc in docs:
        codes = [chain.alphabet_size] * 2 + [
            chain.alphabet_size if c == END_CHAR else ord(c) - ord("a") for c in doc
        ]
        for a, b, c in zip(codes, codes[1:], codes[2:]):
            counts.setdefault((a, b), np.zeros(chain.alphabet_size + 1))[c] += 1
    (a, b), row = max(counts.items(), key=lambda kv: kv[1].sum())
    index = a + (chain.alphabet_size + 1) * b
    np.testing.assert_allclose(row / row.sum(), chain.probs[index], atol=0.02)


def test_documents_end_with_the_end_symbol_or_at_the_cap():
    chain = _tiny_chain()
    docs = chain.sample_documents(500, seed=3)
    for doc in docs:
        assert doc.endswith(END_CHAR) or len(doc) == chain.max_doc_len
        assert END_CHAR not in doc[:-1]
    lengths = [len(d) for d in docs]
    assert min(lengths) < 10 and max(lengths) == chain.max_doc_len


def test_default_markov_corpus_has_a_wide_learnable_gap():
    corpus = load_corpus(DataConfig())
    assert corpus.baseline_loss - corpus.entropy_floor >= 0.5
    lengths = [len(s) for s in corpus.train]
    assert min(lengths) < 20 and max(lengths) > 1500  # a few tokens to ~2k
    assert not set(map(tuple, corpus.train[:500])) & set(map(tuple, corpus.eval))


def test_markov_cap_must_fit_in_a_sequence():
    with pytest.raises(ConfigError, match="up to 202 tokens, more than data.max_seq_len=201"):
        DataConfig(max_seq_len=201, markov=MarkovConfig(max_doc_len=200))
    # The bound is tight: BOS + 200 symbols + EOS fit exactly, and no document is ever cut.
    cfg = DataConfig(
        max_seq_len=202,
        markov=MarkovConfig(
            max_doc_len=200, mean_doc_len=150, num_train_docs=300, num_eval_docs=20
        ),
    )
    corpus = load_corpus(cfg)
    assert max(len(s) for s in corpus.train) == 202
    assert all(
        s[0] == corpus.tokenizer.bos_id and s[-1] == corpus.tokenizer.eos_id for s in corpus.train
    )


def test_pydoc_source_is_real_english_text():
    corpus = load_corpus(DataConfig(source="pydoc", max_seq_len=512))
    text = TOK.decode(corpus.train[0] + corpus.train[1])
    assert " the " in text
    assert corpus.entropy_floor is None and corpus.baseline_loss > 2.0
    assert all(len(s) <= 512 for s in corpus.train)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_files_source_reads_local_jsonl(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", [{"body": f"document number {i} " * 20} for i in range(30)])
    corpus = load_corpus(
        DataConfig(source="files", path="json", data_files=path, text_field="body", max_seq_len=128)
    )
    assert "document number" in TOK.decode(corpus.train[0])
    assert len(corpus.train) + len(corpus.eval) >= 30


def test_files_source_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="cannot read data.path='json'"):
        load_corpus(
            DataConfig(source="files", path="json", data_files=str(tmp_path / "missing.jsonl"))
        )
    path = _jsonl(tmp_path / "c.jsonl", [{"body": "x", "id": 1}] * 3)
    with pytest.raises(ConfigError, match=r"no column 'text'.*\['body', 'id'\]"):
        load_corpus(DataConfig(source="files", path="json", data_files=path))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        load_corpus(DataConfig(source="files", path="json", data_files=str(empty)))
