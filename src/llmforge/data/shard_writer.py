"""One shard of ``llmforge data prepare``: documents tokenized as ``[BOS] doc [EOS]`` into a
token file written atomically (:func:`write_shard`), in this process or in a tokenizing worker
of :class:`llmforge.data.prepare_pool.ShardPool` (:func:`init_worker`, :func:`pool_shard`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from llmforge.data.packing import PIECE_CHARS, iter_packed, token_dtype
from llmforge.data.tokenizer_base import utf8_len
from llmforge.data.tokenizers import load_saved
from llmforge.errors import DataError
from llmforge.paths import write_failed

__all__ = ["init_worker", "pool_shard", "write_shard"]

_WORKER_TOK: Any = None


def init_worker(tokenizer_dir: str) -> None:
    """A tokenizing worker's start: its signal dispositions and the saved tokenizer."""
    global _WORKER_TOK
    import signal

    # a Ctrl-C or a scheduler's signal reaches the whole process group: the parent alone
    # stops (llmforge.signals, exit 75/130) and ends the pool with SIGTERM, whose default
    # action a worker must keep (the handler inherited at fork would raise in the task)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _WORKER_TOK = load_saved(tokenizer_dir)


def write_shard(tok: Any, texts: list[str], path: Path, max_chars: int = PIECE_CHARS) -> dict[str, Any]:
    """Tokenize ``texts`` into ``path`` (``[BOS] doc [EOS]`` each, the smallest dtype), atomically.

    The ids go to the file (and its sha256) piece by piece as :func:`iter_packed` makes them, so
    tokenizing holds one piece of at most ``max_chars`` characters and its ids, not a long
    document's ids (issue 26.4).

    Raises:
        WriteError: it could not be written (e.g. a full disk); no partial file is left.

    Returns:
        ``{"file", "tokens", "sha256", "documents", "bytes"}`` (bytes: UTF-8 text read).
    """
    # this process's own name: a tokenizing worker whose parent was killed (SIGKILL, the OOM
    # killer) finishes its shard before it sees the pool gone, beside a rerun writing the same one
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
    digest, tokens = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as f:
            for ids in _ids(tok, texts, token_dtype(tok.vocab_size), max_chars, path):
                f.write(ids.data)
                digest.update(ids)
                tokens += len(ids)
        os.replace(tmp, path)
    except DataError:  # a token id out of range: no partial shard either
        tmp.unlink(missing_ok=True)
        raise
    except OSError as exc:  # a full disk: no partial shard; the finished ones and progress.json stay
        tmp.unlink(missing_ok=True)
        raise write_failed(exc, tmp, "the shards written so far are kept: free space and run the "
                                     "same command again to continue") from None
    return {"file": f"{path.parent.name}/{path.name}", "tokens": tokens, "sha256": digest.hexdigest(),
            "documents": len(texts),
            "bytes": sum(t.nbytes if isinstance(t, np.ndarray) else utf8_len(t) for t in texts)}


def _ids(tok: Any, docs: list, dtype: np.dtype, max_chars: int, path: Path) -> Iterator[np.ndarray]:
    """The ids of a shard: texts packed as ``[BOS] doc [EOS]`` (:func:`iter_packed`); token
    rows (an MDS ``tokens`` column) as they are, since their writer placed BOS/EOS already.

    Raises:
        DataError: a token id outside the tokenizer's vocabulary."""
    if not docs or not isinstance(docs[0], np.ndarray):
        yield from iter_packed(tok, docs, dtype, max_chars)
        return
    for ids in docs:
        bad = [int(x) for x in (ids.min(), ids.max()) if not 0 <= x < tok.vocab_size] if len(ids) else []
        if bad:
            raise DataError(f"tokenizer.path: a token row of {path.parent.name}/{path.name} holds id "
                            f"{bad[0]}, outside the tokenizer's {tok.vocab_size} ids; name the tokenizer "
                            "that wrote the MDS tokens (tokenizer.type/tokenizer.path)")
        yield ids.astype(dtype)


def pool_shard(args: tuple[list[str], str]) -> dict[str, Any]:
    """:func:`write_shard` of ``(texts, path)`` with the worker's tokenizer."""
    return write_shard(_WORKER_TOK, args[0], Path(args[1]))
