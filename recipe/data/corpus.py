"""Documents in, token sequences out: the held-out split, tokenization and the loss floors.

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
from recipe.data.packing import ImageSequence
from recipe.data.shapes import blind_floor, shapes_dataset
from recipe.data.sources import file_documents, markov_documents, pydoc_documents
from recipe.data.tokenizer import ByteTokenizer, FileTokenizer, load_tokenizer, split_long


@dataclass
class Corpus:
    train: list[list[int]]
    """Training sequences (token ids, BOS ... EOS), in source order."""
    eval: list[list[int]]
    """Held-out sequences, capped at data.max_eval_tokens."""
    tokenizer: ByteTokenizer | FileTokenizer
    entropy_floor: float | None
    """Mean -log P_true(label | context) over the eval labels (Markov source with the byte
    tokenizer only)."""
    baseline_loss: float
    """Loss of the best context-free predictor on the eval labels: their unigram entropy (for
    data=shapes: of the best model that cannot see the images)."""
    image_token_id: int | None = None
    """data=shapes: the placeholder id of a merged image patch, one past the tokenizer's ids."""

    @property
    def vocab_size(self) -> int:
        """Ids the model embeds: the tokenizer's, plus the image placeholder."""
        return self.tokenizer.vocab_size + (self.image_token_id is not None)


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


def tokenize(docs: list[str], tokenizer, max_seq_len: int) -> list[list[int]]:
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


def shapes_corpus(cfg: DataConfig, grid: tuple[int, int]) -> Corpus:
    """Image-caption sequences [BOS, one placeholder per merged patch, caption, EOS]; eval gets
    its own seeded draw. With shuffle_images each caption is paired with another sample's image
    (a negative control: nothing then links the two)."""
    tokenizer = load_tokenizer(cfg.tokenizer)
    image_token_id = tokenizer.vocab_size
    s = cfg.shapes
    placeholders = [image_token_id] * (grid[0] * grid[1])

    def sequences(num: int, seed: int) -> list[ImageSequence]:
        rows = shapes_dataset(num, s.image_size, seed).with_format("numpy")[:]
        images, captions = rows["image"].astype(np.uint8), rows["caption"]  # stored as uint8
        if s.shuffle_images:
            images = images[np.random.default_rng(seed + 1).permutation(len(images))]
        out = []
        for image, text in zip(images, captions):
            ids = tokenizer.encode(str(text))
            out.append(ImageSequence(ids[:1] + placeholders + ids[1:], image))
        return out

    train = sequences(s.num_train, cfg.seed + 1)
    eval_ = sequences(s.num_eval, cfg.seed + 2)
    longest = max(len(x) for x in train + eval_)
    if longest > cfg.max_seq_len:
        raise ConfigError(
            f"data=shapes sequences are up to {longest} tokens (BOS, {len(placeholders)} image "
            f"tokens, caption, EOS), more than data.max_seq_len={cfg.max_seq_len}; raise "
            "data.max_seq_len"
        )
    eval_ = cap_tokens(eval_, cfg.max_eval_tokens)
    predicted = sum(sum(1 for t in x[1:] if t != image_token_id) for x in eval_)
    return Corpus(
        train,
        eval_,
        tokenizer,
        entropy_floor=0.0,
        baseline_loss=blind_floor(len(eval_), predicted),
        image_token_id=image_token_id,
    )


def load_corpus(cfg: DataConfig, image_grid: tuple[int, int] | None = None) -> Corpus:
    """The run's sequences; `image_grid` (the merged patch grid of one image) for data=shapes."""
    if cfg.source == "shapes":
        return shapes_corpus(cfg, image_grid)
    tokenizer = load_tokenizer(cfg.tokenizer)
    chain = None
    if cfg.source == "markov":
        train_docs, eval_docs, chain = markov_documents(cfg)
    else:
        docs = pydoc_documents() if cfg.source == "pydoc" else file_documents(cfg)
        train_docs, eval_docs = split_documents(docs, cfg.eval_fraction, cfg.seed)
    train = tokenize(train_docs, tokenizer, cfg.max_seq_len)
    eval_ = cap_tokens(tokenize(eval_docs, tokenizer, cfg.max_seq_len), cfg.max_eval_tokens)
    if not train or not eval_:
        raise ConfigError(
            f"data source {cfg.source!r} gave no trainable sequences "
            f"({len(train)} train, {len(eval_)} eval)"
        )
    floor = None
    # The chain's floor is per letter: exact only when every letter is one token.
    if chain is not None and isinstance(tokenizer, ByteTokenizer):
        log_probs = np.concatenate(
            [
                chain.token_log_probs(np.asarray(s), tokenizer.bos_id, tokenizer.eos_id)
                for s in eval_
            ]
        )
        floor = float(-log_probs.mean())
    return Corpus(train, eval_, tokenizer, floor, unigram_entropy(eval_))
