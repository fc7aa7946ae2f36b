"""Documents in, token sequences out: the three sources, the held-out split and tokenization.

Every source goes through Hugging Face `datasets` so local files and hub datasets behave the same.
The split is by document and seeded, so eval text is never trained on and the same seed gives the
same split everywhere. Documents longer than `data.max_seq_len` tokens are cut into pieces, never
dropped. For the Markov source the true distribution gives the exact best achievable loss.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from recipe.config import ConfigError, DataConfig
from recipe.markov import MarkovChain
from recipe.tokenizer import ByteTokenizer, split_long


@dataclass
class Corpus:
    train: list[list[int]]
    """Training sequences (token ids, BOS ... EOS), in source order."""
    eval: list[list[int]]
    """Held-out sequences, capped at data.max_eval_tokens."""
    tokenizer: ByteTokenizer
    entropy_floor: float | None
    """Mean -log P_true(label | context) over the eval labels (Markov source only)."""
    baseline_loss: float
    """Loss of the best context-free predictor on the eval labels: their unigram entropy."""


def _markov_documents(cfg: DataConfig) -> tuple[list[str], list[str], MarkovChain]:
    m = cfg.markov
    chain = MarkovChain.create(
        m.order, m.alphabet_size, m.concentration, m.mean_doc_len, m.max_doc_len, seed=cfg.seed
    )
    train = chain.sample_documents(m.num_train_docs, seed=cfg.seed + 1)
    eval_ = chain.sample_documents(m.num_eval_docs, seed=cfg.seed + 2)
    return train, eval_, chain


def _texts_from_dataset(dataset, text_field: str, where: str) -> list[str]:
    if text_field not in dataset.column_names:
        raise ConfigError(
            f"{where} has no column {text_field!r}; its columns are {dataset.column_names}. "
            "Set data.text_field to one of them"
        )
    texts = [t for t in dataset[text_field] if isinstance(t, str) and t]
    if not texts:
        raise ConfigError(f"{where} has no non-empty text in column {text_field!r}")
    return texts


def _pydoc_documents() -> list[str]:
    from pydoc_data.topics import topics

    import datasets

    names = sorted(topics)
    dataset = datasets.Dataset.from_dict({"topic": names, "text": [topics[n] for n in names]})
    return _texts_from_dataset(dataset, "text", "pydoc_data.topics")


def _file_documents(cfg: DataConfig) -> list[str]:
    import datasets

    where = f"data.path={cfg.path!r}" + (
        f" data.data_files={cfg.data_files!r}" if cfg.data_files else ""
    )
    try:
        dataset = datasets.load_dataset(
            cfg.path, name=cfg.name, data_files=cfg.data_files, split=cfg.split
        )
    except FileNotFoundError as err:
        raise ConfigError(
            f"cannot read {where}: {err}. Check the path (relative paths are taken "
            "from the directory you started in)"
        ) from err
    except StopIteration as err:  # the json builder's way of saying "no rows"
        raise ConfigError(f"{where} is empty: no rows to read") from err
    except ValueError as err:
        raise ConfigError(f"cannot load {where} split {cfg.split!r}: {err}") from err
    except Exception as err:  # connection errors, unknown builders: say what was asked for
        raise ConfigError(f"cannot load {where}: {type(err).__name__}: {err}") from err
    if len(dataset) == 0:
        raise ConfigError(f"{where} split {cfg.split!r} is empty")
    return _texts_from_dataset(dataset, cfg.text_field, where)


def split_documents(
    docs: list[str], eval_fraction: float, seed: int
) -> tuple[list[str], list[str]]:
    """Hold out a seeded random share of documents (at least one each side)."""
    if len(docs) < 2:
        raise ConfigError(f"need at least 2 documents to hold one out for eval, got {len(docs)}")
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_eval = min(len(docs) - 1, max(1, round(eval_fraction * len(docs))))
    eval_ids = set(order[:n_eval])
    train = [d for i, d in enumerate(docs) if i not in eval_ids]
    eval_ = [d for i, d in enumerate(docs) if i in eval_ids]
    return train, eval_


def tokenize(docs: list[str], tokenizer: ByteTokenizer, max_seq_len: int) -> list[list[int]]:
    sequences = []
    for doc in docs:
        sequences.extend(split_long(tokenizer.encode(doc), max_seq_len))
    # A one-token piece has nothing to predict; it can only come from a cut and carries no label.
    return [s for s in sequences if len(s) >= 2]


def cap_tokens(sequences: list[list[int]], max_tokens: int) -> list[list[int]]:
    kept, total = [], 0
    for seq in sequences:
        if kept and total + len(seq) > max_tokens:
            break
        kept.append(seq)
        total += len(seq)
    return kept


def unigram_entropy(sequences: list[list[int]]) -> float:
    labels = np.concatenate([np.asarray(s[1:]) for s in sequences])
    _, counts = np.unique(labels, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())


def load_corpus(cfg: DataConfig) -> Corpus:
    tokenizer = ByteTokenizer()
    chain = None
    if cfg.source == "markov":
        train_docs, eval_docs, chain = _markov_documents(cfg)
    else:
        docs = _pydoc_documents() if cfg.source == "pydoc" else _file_documents(cfg)
        train_docs, eval_docs = split_documents(docs, cfg.eval_fraction, cfg.seed)
    train = tokenize(train_docs, tokenizer, cfg.max_seq_len)
    eval_ = cap_tokens(tokenize(eval_docs, tokenizer, cfg.max_seq_len), cfg.max_eval_tokens)
    if not train or not eval_:
        raise ConfigError(
            f"data source {cfg.source!r} gave no trainable sequences "
            f"({len(train)} train, {len(eval_)} eval)"
        )
    floor = None
    if chain is not None:
        log_probs = np.concatenate(
            [
                chain.token_log_probs(np.asarray(s), tokenizer.bos_id, tokenizer.eos_id)
                for s in eval_
            ]
        )
        floor = float(-log_probs.mean())
    return Corpus(train, eval_, tokenizer, floor, unigram_entropy(eval_))
