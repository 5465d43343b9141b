"""Writes tests/data/mds with mosaicml-streaming's own ``MDSWriter`` (0.13.0).

mosaicml-streaming 0.13.0 pins ``transformers<5`` and ``numpy<2.2`` and pulls torchvision (which
moves torch off 2.13), so it is not in the test environment; these files were written once by::

    pip install --no-deps --target /tmp/mdslib mosaicml-streaming==0.13.0 xxhash zstd catalogue
    PYTHONPATH=/tmp/mdslib python tests/helpers/mds_fixture.py tests/data/mds

(``streaming/__init__`` imports its vision datasets, hence torchvision; :func:`mds_writer`
imports the writer module alone). tests/test_mds.py writes the same folders again with
:func:`write` when ``streaming`` is importable.
"""

from __future__ import annotations

import random
import sys
import types
from pathlib import Path

import numpy as np

WORDS = ("the king and queen of a far land rode out at dawn to meet the sea where ships "
         "with white sails carried spice silk and letters from old friends who had gone "
         "before them into the west while the children sang songs of rain and harvest").split()


def documents(n: int, seed: int) -> list[str]:
    """``n`` deterministic pseudo-English documents of 20-120 words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120))).capitalize() + "."
            for _ in range(n)]


def token_rows(n: int, seed: int, vocab: int = 256) -> list[np.ndarray]:
    """``n`` int32 rows of 9-64 ids below ``vocab`` (what LLM Foundry's ``concat_tokens`` writes)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(9, 65)).astype(np.int32) for _ in range(n)]


def mds_writer() -> type:
    """mosaicml-streaming's ``MDSWriter``, imported without ``streaming/__init__`` (which imports
    torchvision for its vision datasets). Raises ImportError when the package is missing."""
    try:
        from streaming import MDSWriter
        return MDSWriter
    except ImportError:
        if "streaming" in sys.modules and getattr(sys.modules["streaming"], "__file__", None):
            raise
    import importlib.util

    spec = importlib.util.find_spec("streaming")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mosaicml-streaming is not installed")
    base = Path(list(spec.submodule_search_locations)[0])
    for name in ("streaming", "streaming.base", "streaming.base.format"):
        module = types.ModuleType(name)  # packages without their __init__: no torchvision
        module.__path__ = [str(base.parent / name.replace(".", "/"))]
        sys.modules[name] = module
    from streaming.base.format.mds.writer import MDSWriter
    return MDSWriter


def write(root: Path) -> None:
    """``root/text/{train,val}`` (str ``text`` plus an int ``id`` column; train gz-compressed, two
    shards) and ``root/tokens/train`` (``ndarray:int32`` ``tokens``, uncompressed)."""
    MDSWriter = mds_writer()

    for split, n, compression, limit in (("train", 60, "gz", 1 << 12), ("val", 8, None, 1 << 26)):
        with MDSWriter(out=str(root / "text" / split), columns={"text": "str", "id": "int"},
                       compression=compression, size_limit=limit) as w:
            for i, text in enumerate(documents(n, seed=len(split))):
                w.write({"text": text, "id": i})
    with MDSWriter(out=str(root / "tokens" / "train"), columns={"tokens": "ndarray:int32"}) as w:
        for row in token_rows(40, seed=3):
            w.write({"tokens": row})


if __name__ == "__main__":
    write(Path(sys.argv[1]))
