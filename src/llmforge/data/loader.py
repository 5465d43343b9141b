"""The training loader of a streaming source, whose position after every batch handed to the
training step is kept for the checkpoint.

torchdata's ``StatefulDataLoader`` gathers the position of each worker
(:meth:`llmforge.data.streaming.StreamingWindows.state_dict`) with the batches it produces;
Lightning fetches one batch ahead of the step it trains, so the state of the loader itself is
one batch past the step a checkpoint saves. :class:`PositionedLoader` keeps the loader state
after each of the last batches it handed out and answers the position after ``n`` of them.
"""

from __future__ import annotations

import atexit
import collections
import copy
import weakref
from typing import Any, Iterator, Optional

from llmforge.errors import LLMForgeError


class PositionedLoader:
    """Iterate a ``StatefulDataLoader`` and remember its state after each batch.

    Args:
        loader: a ``torchdata.stateful_dataloader.StatefulDataLoader``.
        start_state: the state it was resumed from (``loader.load_state_dict`` already
            called), the position after 0 batches; ``None`` = a fresh start.
        keep: how many of the latest positions to keep (Lightning prefetches one batch).
    """

    def __init__(self, loader: Any, start_state: Optional[dict] = None, keep: int = 8) -> None:
        self.loader, self.start_state = loader, start_state
        self.positions: collections.deque = collections.deque(maxlen=keep)
        # a run that stops on an exception may skip teardown: stop the workers before exit
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().close())  # type: ignore[union-attr]

    def __iter__(self) -> Iterator[Any]:
        self.positions.clear()
        try:
            for count, batch in enumerate(self.loader, start=1):
                self.positions.append((count, self.loader.state_dict()))
                yield batch
        except LLMForgeError as exc:
            raise unwrap_worker_error(exc) from None

    def close(self) -> None:
        """Stop the loader's workers (Lightning shuts down only torch's own DataLoader
        iterators; left running, they keep the process from exiting)."""
        it = getattr(self.loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        self.loader._iterator = None

    def position(self, consumed: int) -> Optional[dict]:
        """The loader state after ``consumed`` batches of this iteration (``None``: a fresh
        start and nothing consumed yet).

        Raises:
            KeyError: that batch is older than the last ``keep`` handed out.
        """
        if consumed == 0:
            return copy.deepcopy(self.start_state)
        for count, state in self.positions:
            if count == consumed:
                return state
        raise KeyError(f"no loader position after {consumed} batches (kept: "
                       f"{[c for c, _ in self.positions]})")


def unwrap_worker_error(exc: LLMForgeError) -> LLMForgeError:
    """The error a loader worker raised, without the traceback torch's ``ExceptionWrapper``
    puts into the message (``Caught DataError in DataLoader worker process 1. Original
    Traceback ...``): the CLI prints one line."""
    text = str(exc)
    if "Original Traceback" not in text:
        return exc
    last = text.rstrip().splitlines()[-1]
    prefix = f"{type(exc).__module__}.{type(exc).__name__}: "
    return type(exc)(last.removeprefix(prefix))
