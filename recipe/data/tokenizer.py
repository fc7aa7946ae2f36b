"""Byte-level tokenizer: 256 byte ids plus BOS, EOS and PAD.

Works on any text with no vocabulary file, which keeps the default run free of downloads; the
price is longer sequences than a subword tokenizer would give.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ByteTokenizer:
    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258

    @property
    def vocab_size(self) -> int:
        return 259

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def split_long(ids: list[int], max_len: int) -> list[list[int]]:
    """Cut a token list into pieces of at most `max_len` tokens, keeping every token."""
    return [ids[start : start + max_len] for start in range(0, len(ids), max_len)]
