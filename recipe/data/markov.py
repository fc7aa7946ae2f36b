"""The generated default dataset: documents from a seeded order-k Markov chain.

Because the generator knows the true distribution, the best achievable loss on any set of
sequences is computable exactly. The chain emits one of `alphabet_size` symbols (written as the
letters a, b, c, ...) or END (written as '.') from a distribution that depends on the previous k
symbols, a START symbol standing in before the document begins. Each context's distribution is a
Dirichlet draw with a small concentration, so the next symbol is far more predictable with context
than without: the gap between the unigram entropy and the chain's entropy is what a model learns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

END_CHAR = "."


@dataclass(frozen=True)
class MarkovChain:
    order: int
    alphabet_size: int
    probs: np.ndarray
    """[(alphabet_size+1) ** order, alphabet_size+1]: next-outcome distribution per context.
    Context digits use `alphabet_size` for START; outcome `alphabet_size` is END."""
    max_doc_len: int

    @classmethod
    def create(
        cls,
        order: int,
        alphabet_size: int,
        concentration: float,
        mean_doc_len: int,
        max_doc_len: int,
        seed: int,
    ) -> MarkovChain:
        rng = np.random.default_rng(seed)
        n_contexts = (alphabet_size + 1) ** order
        symbols = rng.dirichlet(np.full(alphabet_size, concentration), size=n_contexts)
        # END rates vary per context around 1/mean so lengths spread widely (a few to thousands).
        end = np.clip(rng.uniform(0.5, 1.5, size=n_contexts) / mean_doc_len, 0.0, 0.5)
        probs = np.concatenate([symbols * (1.0 - end)[:, None], end[:, None]], axis=1)
        start_only = cls._context_index_of(np.full((1, order), alphabet_size), alphabet_size)
        # A document never ends before its first symbol.
        probs[start_only, alphabet_size] = 0.0
        probs /= probs.sum(axis=1, keepdims=True)
        return cls(order, alphabet_size, probs, max_doc_len)

    @staticmethod
    def _context_index_of(contexts: np.ndarray, alphabet_size: int) -> np.ndarray:
        base = alphabet_size + 1
        weights = base ** np.arange(contexts.shape[1])
        return contexts @ weights

    def context_index(self, contexts: np.ndarray) -> np.ndarray:
        """contexts: [n, order] symbol codes, oldest first (START = alphabet_size)."""
        return self._context_index_of(contexts, self.alphabet_size)

    def sample_documents(self, num_docs: int, seed: int) -> list[str]:
        """Generate documents as text, all in parallel. A document that emits END ends with '.';
        one that reaches max_doc_len symbols is cut there."""
        rng = np.random.default_rng(seed)
        start = self.alphabet_size
        contexts = np.full((num_docs, self.order), start, dtype=np.int64)
        cdf = np.cumsum(self.probs, axis=1)
        out = np.full((num_docs, self.max_doc_len + 1), -1, dtype=np.int64)
        active = np.ones(num_docs, dtype=bool)
        for t in range(self.max_doc_len):
            idx = np.flatnonzero(active)
            if idx.size == 0:
                break
            rows = cdf[self.context_index(contexts[idx])]
            draws = (rows < rng.random((idx.size, 1))).sum(axis=1)
            draws = np.minimum(draws, self.alphabet_size)  # guard against cdf rounding
            out[idx, t] = draws
            ended = draws == self.alphabet_size
            active[idx[ended]] = False
            contexts[idx] = np.concatenate([contexts[idx, 1:], draws[:, None]], axis=1)
        letters = np.array([chr(ord("a") + i) for i in range(self.alphabet_size)] + [END_CHAR])
        return ["".join(letters[row[row >= 0]]) for row in out]

    def token_log_probs(self, tokens: np.ndarray, bos_id: int, eos_id: int) -> np.ndarray:
        """True log P(label | visible context) for every predicted token of one sequence.

        `tokens` is a tokenized document (BOS, letters, optional '.', EOS); the labels are
        tokens[1:]. EOS is certain once '.' or the length cap is reached, so it costs nothing.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        codes = np.full(tokens.shape, -1, dtype=np.int64)
        letters = (tokens >= ord("a")) & (tokens < ord("a") + self.alphabet_size)
        codes[letters] = tokens[letters] - ord("a")
        codes[tokens == ord(END_CHAR)] = self.alphabet_size
        codes[tokens == bos_id] = self.alphabet_size  # BOS reads as START in a context
        if tokens[0] != bos_id or np.any((codes < 0) & (tokens != eos_id)):
            raise ValueError("sequence is not a whole tokenized Markov document (BOS ... EOS)")
        padded = np.concatenate([np.full(self.order - 1, self.alphabet_size), codes])
        labels = codes[1:]
        # Context of label j (tokens[j+1]) is the `order` codes ending at tokens[j].
        windows = np.lib.stride_tricks.sliding_window_view(padded[:-1], self.order)
        log_probs = np.zeros(labels.shape, dtype=np.float64)
        is_symbol = tokens[1:] != eos_id
        ctx = self.context_index(windows[is_symbol])
        log_probs[is_symbol] = np.log(self.probs[ctx, labels[is_symbol]])
        return log_probs
