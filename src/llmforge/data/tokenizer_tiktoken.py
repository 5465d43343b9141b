"""The ``tiktoken`` tokenizer kind: a tiktoken BPE rank file in the Llama 3 ``tokenizer.model``
format, with Llama 3's split pattern and its 256 special tokens."""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

from llmforge.data.tokenizer_base import _atomic_write, _StoredIds
from llmforge.errors import ConfigError

__all__ = ["TiktokenTokenizer", "LLAMA3_PAT_STR", "LLAMA3_SPECIAL_TOKENS"]

#: Llama 3's pre-tokenizer split pattern (Meta's llama3 ``tokenizer.py``).
LLAMA3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_BASIC_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
]
#: Llama 3's 256 special tokens, in id order after the base ranks.
LLAMA3_SPECIAL_TOKENS: list[str] = _LLAMA3_BASIC_SPECIALS + [
    f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(_LLAMA3_BASIC_SPECIALS))
]


def _parse_tiktoken_bpe(path: Path) -> dict[bytes, int]:
    """Ranks of a ``base64(token) rank`` file, validated so tiktoken can use them.

    Same format and parsing as ``tiktoken.load.load_tiktoken_bpe``, which is not called
    because it caches local files in a temp dir keyed by path only (stale after edits).
    """
    try:
        contents = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path} cannot be read: {e}") from e
    expected = ("the format tokenizer.type: tiktoken expects, a Llama 3 tokenizer.model with "
                "lines 'base64(token_bytes) rank'")
    if contents.lstrip().startswith(b"{"):
        raise ConfigError(f"{path} does not parse as a tiktoken BPE file ({expected}); it looks "
                          "like JSON: use tokenizer.type: huggingface for a tokenizer.json")
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(contents.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except Exception as e:
            raise ConfigError(f"{path} does not parse as a tiktoken BPE file ({expected}): "
                              f"line {lineno}: {line[:80]!r} ({e})") from e
    n = len(ranks)
    problem = None
    if n == 0:
        problem = "it holds no ranks"
    elif sorted(ranks.values()) != list(range(n)):
        problem = f"ranks are not the distinct numbers 0..{n - 1} (or a token repeats)"
    elif any(bytes([b]) not in ranks for b in range(256)):
        problem = "not all 256 single bytes have a rank"
    if problem:
        raise ConfigError(f"{path} does not parse as a tiktoken BPE file ({expected}): {problem}")
    return ranks


class TiktokenTokenizer(_StoredIds):
    """A Llama 3 style tiktoken tokenizer from a ``tokenizer.model`` rank file.

    Uses :data:`LLAMA3_PAT_STR` and appends :data:`LLAMA3_SPECIAL_TOKENS` after the base ranks:
    bos = ``<|begin_of_text|>`` (id n_base), eos = ``<|end_of_text|>`` (n_base + 1),
    pad = ``<|finetune_right_pad_id|>`` (n_base + 4); vocab_size = n_base + 256 (128256 for
    Llama 3).

    Raises:
        ConfigError: the file is missing or not a valid rank file.
    """

    type = "tiktoken"

    def __init__(self, path: str | os.PathLike) -> None:
        import tiktoken

        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"{self.path} does not exist or is not a file; "
                              "point it at a Llama 3 tokenizer.model (tiktoken BPE)")
        self._ranks = _parse_tiktoken_bpe(self.path)
        n_base = len(self._ranks)
        self.special_tokens = {t: n_base + i for i, t in enumerate(LLAMA3_SPECIAL_TOKENS)}
        self.encoding = tiktoken.Encoding(
            name=f"llama3-{self.path.name}", pat_str=LLAMA3_PAT_STR,
            mergeable_ranks=self._ranks, special_tokens=self.special_tokens)
        self.n_base = n_base
        self._vocab_size = n_base + len(LLAMA3_SPECIAL_TOKENS)
        self._bos = self.special_tokens["<|begin_of_text|>"]
        self._eos = self.special_tokens["<|end_of_text|>"]
        self._pad: int | None = self.special_tokens["<|finetune_right_pad_id|>"]

    def token_id(self, token: str) -> int | None:
        return self.special_tokens.get(token)

    def _encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(list(texts))

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(list(ids))

    def _save_files(self, directory: Path) -> dict[str, Any]:
        lines = sorted(self._ranks.items(), key=lambda kv: kv[1])
        data = b"".join(base64.b64encode(tok) + b" %d\n" % r for tok, r in lines)
        _atomic_write(directory / "tokenizer.model", data)
        return {"file": "tokenizer.model"}
