"""The ``huggingface`` tokenizer kind: a Hugging Face ``tokenizers`` ``tokenizer.json``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llmforge.data.tokenizer_base import _atomic_write, _StoredIds
from llmforge.errors import ConfigError

__all__ = ["HFTokenizer"]

_BOS_NAMES = ["<|begin_of_text|>", "<s>", "<|bos|>", "<bos>", "[BOS]", "<|startoftext|>",
              "<|endoftext|>"]
_EOS_NAMES = ["<|end_of_text|>", "</s>", "<|eos|>", "<eos>", "[EOS]", "<|endoftext|>"]
_PAD_NAMES = ["<|pad|>", "<pad>", "[PAD]", "<|padding|>", "<|finetune_right_pad_id|>"]


class HFTokenizer(_StoredIds):
    """A Hugging Face ``tokenizers`` tokenizer loaded from a ``tokenizer.json`` file.

    BOS/EOS/PAD are found by name among common tokens (``<|begin_of_text|>``/``<|end_of_text|>``,
    ``<s>``/``</s>``, ``<|endoftext|>`` for both, ``<|bos|>``...) unless named by ``bos_token``,
    ``eos_token``, ``pad_token``. Encoding never runs the file's post-processor specials
    (``add_special_tokens=False``) and never parses special-token text.

    Raises:
        ConfigError: the file is missing or not a tokenizer.json, or BOS/EOS cannot be found.
    """

    type = "huggingface"

    def __init__(self, path: str | os.PathLike, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None) -> None:
        from tokenizers import Tokenizer as _HFTok

        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"{self.path} does not exist or is not a file; "
                              "point it at a Hugging Face tokenizer.json")
        try:
            self._tok = _HFTok.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ConfigError(f"{self.path} does not parse as a Hugging Face tokenizer.json "
                              f"(the format tokenizer.type: huggingface expects): {e}; for a "
                              "Llama 3 tokenizer.model use tokenizer.type: tiktoken") from e
        self._tok.encode_special_tokens = True  # special-token text is ordinary text
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values(), default=-1) + 1
        self.bos_token = self._find(vocab, bos_token, _BOS_NAMES, "BOS", "bos_token")
        self.eos_token = self._find(vocab, eos_token, _EOS_NAMES, "EOS", "eos_token")
        self._bos, self._eos = vocab[self.bos_token], vocab[self.eos_token]
        pad = self._find(vocab, pad_token, _PAD_NAMES, "PAD", "pad_token", required=False)
        self.pad_token = pad if pad is not None and vocab[pad] != self._eos else None
        self._pad = vocab[self.pad_token] if self.pad_token is not None else None

    def _find(self, vocab: dict[str, int], given: str | None, names: list[str], what: str,
              arg: str, required: bool = True) -> str | None:
        if given is not None:
            if given not in vocab:
                raise ConfigError(f"{self.path}: {arg}={given!r} is not in the vocabulary")
            return given
        for name in names:
            if name in vocab:
                return name
        if required:
            raise ConfigError(f"{self.path}: no {what} token found (looked for {names}); use a "
                              f"tokenizer.json that defines one, or pass {arg}= to HFTokenizer")
        return None

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def _save_files(self, directory: Path) -> dict[str, Any]:
        _atomic_write(directory / "tokenizer.json", self._tok.to_str(pretty=True).encode())
        return {"file": "tokenizer.json", "bos_token": self.bos_token,
                "eos_token": self.eos_token, "pad_token": self.pad_token}
