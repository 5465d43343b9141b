"""``python -m llmforge.job.supervisor RUN_ID``: runs a local job, records it, restarts it.

Started detached by ``llmforge launch``/``llmforge runs restart`` (the leader of the run's
process group). For each resumption ``k`` it runs torchrun (:mod:`llmforge.job.torchrun`)
with the output in ``<run_dir>/logs/resumption-<k>.log`` and ``checkpoint.resume=auto`` from
the first restart on, waits, and records the outcome:

========================================  ===========================================
exit of the training                      status
========================================  ===========================================
0                                         ``completed``
75 (saved on SIGTERM/SIGUSR1), or a stop  ``stopped`` (never restarted)
2 (configuration or data error)           ``failed`` (never restarted)
anything else (killed process, crash)     restarted up to ``scheduling.max_retries``
                                          times as a new resumption, then ``failed``
========================================  ===========================================

SIGTERM, SIGINT and SIGHUP to the supervisor mean "stop": it keeps waiting for the workers
(which save and exit 75) and does not restart them.

A fault-tolerant run (the spec's ``fault_tolerance`` entry) runs its lighthouse and one torchrun
per replica group instead, and restarts a lost group alone (:mod:`llmforge.job.ft_groups`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from llmforge.errors import LLMForgeError
from llmforge.job.ft_groups import GroupSupervisor, group_progress
from llmforge.job.records import RunNotFound, RunRecord, RunRegistry
from llmforge.signals import EXIT_PREEMPTED

EXIT_CONFIG = 2
SHUTDOWN_TIMEOUT_S = 300


def torchrun_command(spec: dict[str, Any], resume: bool, python: str = sys.executable) -> list[str]:
    """The local training command: torchrun on one node with ``spec['procs_per_node']`` workers."""
    cmd = [python, "-m", "llmforge.job.torchrun", "--standalone",
           f"--nproc-per-node={spec['procs_per_node']}", f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}",
           "-m", "llmforge", "train", spec["config_path"], *spec.get("overrides", [])]
    if resume:
        cmd.append("checkpoint.resume=auto")
    return cmd


def decide(code: int, stop_requested: bool, retries: int, max_retries: int) -> Optional[str]:
    """Final status for an exit code, or None to restart (see the module table)."""
    if code == 0:
        return "completed"
    if stop_requested or code == EXIT_PREEMPTED:
        return "stopped"
    if code == EXIT_CONFIG or retries >= max_retries:
        return "failed"
    return None


class Supervisor:
    """Runs the resumptions of one local run (see the module doc)."""

    def __init__(self, run_id: str, registry: Optional[RunRegistry] = None) -> None:
        self.registry = registry or RunRegistry()
        self.run_id = run_id
        self.stop = False
        self.child: Optional[subprocess.Popen] = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stop = True  # the workers get the signal too (or from torch's agent) and save

    def stop_requested(self) -> bool:
        return self.stop or bool(self.registry.get(self.run_id).stop_requested)

    def run_once(self, run: RunRecord) -> int:
        spec = run.spec
        k = run.resumptions
        log_path = Path(run.run_dir or ".") / "logs" / f"resumption-{k}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = torchrun_command(spec, resume=k > 0 or bool(spec.get("resume")))
        env = dict(os.environ)
        # no OMP_NUM_THREADS here: each worker chooses from its cores, share and data workers
        fields: dict[str, Any] = {"pgid": os.getpgid(0), "exit_code": None}
        if run.started_at is None:
            fields["started_at"] = time.time()
        self.registry.set_status(self.run_id, "running", f"resumption {k}: {' '.join(cmd[1:])}", **fields)
        with open(log_path, "ab") as log:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            log.write(f"== llmforge supervisor {stamp}: run {run.id}, resumption {k}\n"
                      f"== {' '.join(cmd)}\n".encode())
            log.flush()
            self.child = subprocess.Popen(cmd, cwd=spec.get("workdir") or None, env=env,
                                          stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            code = self.child.wait()
            log.write(f"== exit code {code}\n".encode())
        return code

    def supervise(self) -> int:
        """Run until a final status; returns the last exit code."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        while True:
            run = self.registry.get(self.run_id)
            if self.stop_requested():  # stopped before (re)starting: nothing to save
                self.registry.set_status(self.run_id, "stopped", "stop requested before training started")
                return 0
            if run.spec.get("fault_tolerance"):
                return self.supervise_groups(run)
            code = self.run_once(run)
            run = self.registry.get(self.run_id)
            max_retries = int(run.spec.get("max_retries", 0))
            status = decide(code, self.stop_requested(), run.retries, max_retries)
            if status is None:
                retries = self.registry.increment(self.run_id, "retries")
                self.registry.increment(self.run_id, "resumptions")
                self.registry.update(self.run_id, event=(
                    "restart", f"exit code {code} (system failure); restart {retries}/{max_retries} "
                               "from the newest checkpoint"))
                continue
            why = {"completed": "exit code 0", "stopped": f"exit code {code} (stop requested or "
                   "preempted; saved if training had started)", "failed": f"exit code {code}"}[status]
            if status == "failed" and code == EXIT_CONFIG:
                why += " (configuration or data error: see the log)"
            elif status == "failed" and max_retries:
                why += f" after {run.retries} restart(s)"
            self.registry.set_status(self.run_id, status, why, exit_code=code)
            return code


    def supervise_groups(self, run: RunRecord) -> int:
        """A fault-tolerant run: the lighthouse and its replica groups until all have ended."""
        groups = len(run.spec["fault_tolerance"]["groups"])
        self.registry.set_status(self.run_id, "running", f"lighthouse {run.spec['fault_tolerance']['lighthouse']} "
                                 f"and {groups} replica groups", pgid=os.getpgid(0), exit_code=None,
                                 **({"started_at": time.time()} if run.started_at is None else {}))
        keeper = GroupSupervisor(run.spec, Path(run.run_dir or "."), torchrun_command, self.stop_requested,
                                 lambda kind, detail: self.registry.update(self.run_id, event=(kind, detail)))
        try:
            status, code = keeper.run(resume=run.resumptions > 0 or bool(run.spec.get("resume")))
        except LLMForgeError as exc:
            self.registry.set_status(self.run_id, "failed", str(exc), message=str(exc), exit_code=1)
            return 1
        done = ", ".join(f"group {g['id']} {g['status']}" for g in keeper.groups)
        last = max((group_progress(g["run_dir"])["committed"] or 0 for g in keeper.groups), default=0)
        self.registry.set_status(self.run_id, status, done, exit_code=code, **({"last_step": last} if last else {}))
        return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m llmforge.job.supervisor RUN_ID", file=sys.stderr)
        return 2
    try:
        return Supervisor(args[0]).supervise()
    except RunNotFound:  # the record was deleted (runs delete --force): nothing left to report to
        print(f"run {args[0]}: its record was deleted; the supervisor exits", file=sys.stderr)
        return 0


if __name__ == "__main__":
    sys.exit(main())
