"""Making a checkpoint folder appear whole or not at all: a save writes into ``.tmp-<name>``,
every rank meets, rank 0 writes the JSON state and ``COMPLETE`` and renames the folder in one
``os.replace`` (:class:`PendingSave`); a failed write removes the unfinished folder and says
what is intact (:class:`CheckpointWriteError`). ``LLMFORGE_CRASH_AT`` injects crashes between
the steps for the crash tests. See :mod:`llmforge.checkpoint.dcp` for the layout."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from llmforge.checkpoint.layout import COMPLETE, latest_checkpoint
from llmforge.errors import LLMForgeError

__all__ = ["CheckpointWriteError", "PendingSave"]


class CheckpointWriteError(LLMForgeError):
    """A checkpoint could not be written (full disk, read-only or vanished folder). Its
    unfinished ``.tmp-*`` folder is removed; the earlier checkpoints are untouched. Exit code 2."""

    exit_code = 2


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc``, the per-rank exceptions a DCP ``CheckpointException`` carries, and their causes."""
    out, todo = [], [exc]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is o for o in out):
            continue
        out.append(e)
        todo += [pair[0] for pair in (getattr(e, "failures", None) or {}).values()]
        todo += [e.__cause__, e.__context__]
    return out


def _write_failed(exc: BaseException, tmp: Path, root: Path) -> Optional[CheckpointWriteError]:
    """Remove the unfinished ``tmp`` folder and say why the save failed and what is intact;
    ``None`` when no file-system error is behind ``exc`` (a bug: the caller re-raises it).

    torch's zip writer reports a full disk as ``unexpected pos`` without the errno: the free
    space (measured before the cleanup frees it) tells that case apart."""
    import errno as errnos

    try:
        free: Optional[int] = shutil.disk_usage(root).free
    except OSError:
        free = None
    if _is_rank0():
        shutil.rmtree(tmp, ignore_errors=True)
    oserr = next((c for c in _causes(exc) if isinstance(c, OSError) and c.errno), None)
    if oserr is not None and oserr.errno in (errnos.ENOSPC, errnos.EDQUOT) or (
            oserr is None and free is not None and free < 64 * 2**20):
        reason = f"no space left on the device ({free or 0:,} bytes free)"
    elif oserr is not None:
        reason = f"{os.strerror(oserr.errno)} ({oserr.filename or tmp})"
    else:
        return None
    previous = latest_checkpoint(root)
    kept = (f"the previous checkpoint {previous} is intact" if previous is not None
            else "no earlier checkpoint exists")
    return CheckpointWriteError(f"cannot write checkpoint {tmp}: {reason}; {kept}. Free space "
                                f"or point checkpoint.dir at another disk, then continue with "
                                "checkpoint.resume=auto")


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class PendingSave:
    """A save whose DCP files may still be in flight; :meth:`finish` completes it."""

    def __init__(self, future: Any, tmp: Path, final: Path, trainer_state: dict, meta: dict) -> None:
        self.future, self.tmp, self.final = future, tmp, final
        self.trainer_state, self.meta = trainer_state, meta
        self.done = False

    def finish(self) -> Path:
        """Wait for the files, then every rank meets and rank 0 marks and renames the folder."""
        if self.done:
            return self.final
        try:
            if self.future is not None:
                self.future.result()
            _barrier()
            if _is_rank0():
                (self.tmp / "trainer_state.json").write_text(json.dumps(self.trainer_state, indent=1))
                (self.tmp / "meta.json").write_text(json.dumps(self.meta, indent=1))
                _crash_point("before_complete")
                (self.tmp / COMPLETE).write_text("ok\n")
                if self.final.exists():  # a stale checkpoint of the same step: replace it
                    shutil.rmtree(self.final)
                os.replace(self.tmp, self.final)
        except (OSError, RuntimeError, CheckpointException) as exc:
            self.done = True
            error = _write_failed(exc, self.tmp, self.final.parent)
            if error is None:
                raise
            raise error from None
        _barrier()
        self.done = True
        _crash_point("after_complete")
        return self.final


_CRASH_COUNTS: dict[str, int] = {}


def _crash_point(name: str) -> None:
    """Fault injection for crash tests: ``LLMFORGE_CRASH_AT=<name>[:<n>]`` kills the process
    with SIGKILL the n-th time (default 1st) it passes point ``name`` (``after_dcp_write``:
    files written, no marker yet; ``before_complete``; ``after_complete``: the checkpoint is
    whole and in place)."""
    spec = os.environ.get("LLMFORGE_CRASH_AT", "")
    point, _, nth = spec.partition(":")
    if point != name:
        return
    _CRASH_COUNTS[name] = _CRASH_COUNTS.get(name, 0) + 1
    if _CRASH_COUNTS[name] == int(nth or 1):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
