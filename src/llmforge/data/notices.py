"""One-line notes on stderr for the slow first-run steps of the data path (fetching the
embedded corpus, training a BPE, tokenizing the documents), which otherwise left a minute of
silence before the first step."""

from __future__ import annotations

import os
import sys

__all__ = ["notice"]


def notice(message: str) -> None:
    """Print ``message`` to stderr once per job: from the process of global rank 0 only
    (``RANK``, else ``SLURM_PROCID``; a process without either is rank 0)."""
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"
    if rank == "0":
        print(message, file=sys.stderr, flush=True)
