"""What llmforge may do to a run directory: the mark that says llmforge made it, and the lock
that makes one process its writer.

**The mark.** Every run directory llmforge creates holds :data:`MARK` (``.llmforge-run``, a
small JSON file). ``llmforge train`` writes into, and ``--overwrite`` deletes, only a folder
that is empty, missing, or an llmforge run (:func:`is_run_dir`): marked, or made by an llmforge
version before the mark (its own ``config.yaml`` beside ``metrics.jsonl``, or a complete
checkpoint ``checkpoints/step_<digits>/COMPLETE``; such a folder is marked when a run adopts it). A
run directory that is a symbolic link is refused (:func:`check_run_dir`): writing through it would
mix the new run into the old one's files. Before ``--overwrite`` clears anything, the paths the
command will read are checked against what it clears (:func:`refuse_overlap`); a
``checkpoint.dir`` inside another run is refused (:func:`refuse_run_inside_run`); ``convert
to-hf --overwrite`` replaces only a folder it exported itself (:data:`EXPORT_MARK`).

**The lock.** :class:`RunLock` holds an exclusive ``flock(2)`` on :data:`LOCK`
(``.llmforge-lock`` inside the run directory) for the whole run; the file holds the holder's
host, pid, start time and the SHA-256 of a token as JSON (the file is world-readable: the token
itself stays in the holder's environment). A second process gets :class:`RunDirBusy` (exit 2)
naming the holder. The kernel drops the lock when its process dies, so a lock left by a killed
process is free: the next run takes it over and says whose it was. Processes started by the
holder (torchrun's workers under ``--nproc``, Lightning's re-run ranks) inherit the token in
:data:`TOKEN_ENV` and are recognized as the same run, and die with the holder
(:data:`LAUNCHER_ENV`); in a job started by any other launcher
only rank 0 takes the lock (the caller decides, see :meth:`llmforge.Trainer.setup`).

**The whole process tree.** Processes forked by the holder (data-loader workers) close their
copy of the lock's descriptor at once (``os.register_at_fork``): a ``flock`` belongs to the open
file, so a forked copy would hold it after the holder died. When the holder is dead, taking the
lock over first waits, at most :data:`WAIT_S` seconds and saying so, for the processes that
still carry its token (found through ``/proc/PID/environ``: torchrun's workers whose launcher was
killed, before :func:`llmforge.job.torchrun.die_with_launcher` ends them) and for a descendant
that still holds the lock; if they do not end, :class:`RunDirBusy` names them.

``flock`` is used directly rather than the ``filelock`` package: the holder's JSON must be
readable by the process that is refused, from the file the lock is on.
"""


from llmforge.run_guard.lock import LAUNCHER_ENV, LOCK, TOKEN_ENV, WAIT_S, RunDirBusy, RunLock, peek_holder
from llmforge.run_guard.marks import (EXPORT_MARK, MARK, check_export_dir, check_run_dir, clear_run_dir,
                                      is_run_dir, mark_run_dir, refuse_file_link, refuse_link,
                                      refuse_nested_runs, refuse_overlap, refuse_run_inside_run)

__all__ = ["EXPORT_MARK", "LAUNCHER_ENV", "LOCK", "MARK", "TOKEN_ENV", "WAIT_S", "RunDirBusy", "RunLock",
           "check_export_dir", "check_run_dir", "clear_run_dir", "is_run_dir", "mark_run_dir",
           "peek_holder", "refuse_file_link", "refuse_link", "refuse_nested_runs", "refuse_overlap",
           "refuse_run_inside_run"]
