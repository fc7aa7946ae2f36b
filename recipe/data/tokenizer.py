"""Tokenizers: byte-level by default, or a local Hugging Face `tokenizer.json`.

The byte tokenizer (256 byte ids plus BOS, EOS and PAD) works on any text with no vocabulary
file, which keeps the default run free of downloads; the price is longer sequences than a subword
tokenizer gives. `data.tokenizer=PATH/tokenizer.json` loads a subword vocabulary with the
`tokenizers` package instead; the recipe trains from scratch, so it reserves its own BOS, EOS and
PAD ids after that vocabulary rather than guessing which of the file's special tokens mean what.
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


class FileTokenizer:
    """A Hugging Face `tokenizer.json` plus three ids of the recipe's own (BOS, EOS, PAD)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.path = path
        self._tokenizer = Tokenizer.from_file(path)
        base = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id, self.pad_id = base, base + 1, base + 2
        self.vocab_size = base + 3

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids if int(i) < self.bos_id])


def load_tokenizer(spec: str):
    """`byte`, or the path of a tokenizer.json; a bad path is a ConfigError naming the field."""
    if spec == "byte":
        return ByteTokenizer()
    from pathlib import Path

    from recipe.errors import ConfigError

    if not Path(spec).is_file():
        raise ConfigError(
            f"data.tokenizer={spec!r} is not a file; give the path of a Hugging Face "
            "tokenizer.json (relative paths are taken from the directory you started in), or "
            "data.tokenizer=byte"
        )
    try:
        return FileTokenizer(spec)
    except Exception as err:  # the tokenizers package reports a bad file as a plain Exception
        raise ConfigError(
            f"data.tokenizer={spec!r} is not a readable tokenizer.json: {err}"
        ) from err
