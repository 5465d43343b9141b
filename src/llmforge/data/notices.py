"""One-line notes on stderr for the slow first-run steps of the data path (fetching the
embedded corpus, training a BPE, tokenizing the documents), which otherwise left a minute of
silence before the first step."""

from __future__ import annotations

import os
import sys

__all__ = ["notice"]


def notice(message: str) -> None:
    """Print ``message`` to stderr once per job: from the process of rank 0 only, read from the
    environment as Lightning's ``rank_zero_only`` does (the first of ``RANK``, ``LOCAL_RANK``,
    ``SLURM_PROCID``, ``JSM_NAMESPACE_RANK`` that is set; none set: rank 0). ``LOCAL_RANK``
    covers the processes Lightning's own launcher starts (``trainer.devices=2`` without
    ``--nproc``), which have no ``RANK`` yet when the data is read."""
    rank = next((os.environ[k] for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
                 if k in os.environ), "0")
    if rank.strip() == "0":
        print(message, file=sys.stderr, flush=True)
