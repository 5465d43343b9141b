"""A fault-tolerant run on this machine (``llmforge launch`` with ``fault_tolerance.enabled``).

The local supervisor (:mod:`llmforge.job.supervisor`) of such a run starts torchft's lighthouse
(:func:`llmforge.parallel.lighthouse.start_lighthouse`, on the port of
``fault_tolerance.lighthouse``) and one torchrun job per replica group, each an ordinary
``llmforge train`` with ``fault_tolerance.replica_id=G`` and ``run.name=<run.name>-g<G>`` (its own
run directory beside the launch's; output in ``<run_dir>/logs/group-<G>.log``). It then keeps
them:

==========================================  ==============================================
a group's exit                              what happens
==========================================  ==============================================
0                                           the group is ``completed``
75 (stop, preemption, lost quorum) or stop  ``stopped``, not restarted
2 (configuration or data error)             ``failed``, not restarted
anything else (killed, crashed)             restarted with ``checkpoint.resume=auto`` up to
                                            ``scheduling.max_retries`` times: it rejoins
                                            from a live group; the others go on meanwhile
==========================================  ==============================================

The run ends when every group has: ``completed`` if all did, else ``stopped`` if none failed,
else ``failed``; the lighthouse is stopped then. The state of every group is kept in
``<run_dir>/ft_groups.json`` (:func:`read_state`), which ``llmforge runs describe`` shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

from llmforge.parallel.lighthouse import start_lighthouse
from llmforge.signals import EXIT_PREEMPTED

STATE_FILE = "ft_groups.json"
EXIT_CONFIG = 2
POLL_S = 0.5


def group_names(name: str, groups: int) -> list[str]:
    """``run.name`` of each replica group of the run ``name``: ``<name>-g<G>``."""
    return [f"{name}-g{g}" for g in range(groups)]


def group_overrides(spec: dict[str, Any], group: int) -> list[str]:
    """The overrides that make the launch's ``llmforge train`` group ``group``'s job."""
    ft = spec["fault_tolerance"]
    return [*spec.get("overrides", []), f"fault_tolerance.replica_id={group}",
            f"run.name={ft['groups'][group]['name']}"]


def read_state(run_dir: Optional[str]) -> Optional[dict[str, Any]]:
    """The groups' state written by the local supervisor (None when there is none)::

        {"lighthouse": "http://HOST:PORT", "groups": [{"id": 0, "name": ..., "run_dir": ...,
         "status": "running|completed|stopped|failed", "pid": ..., "exit_code": ...,
         "restarts": ...}, ...]}
    """
    path = Path(run_dir or "") / STATE_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def group_progress(run_dir: str) -> dict[str, Any]:
    """From a group's ``metrics.jsonl``: ``step`` (its last recorded step), ``participants``
    (``ft/participants`` of that step) and ``committed`` (its last step with ``ft/committed``
    1); ``None`` where there is no record yet."""
    out: dict[str, Any] = {"step": None, "participants": None, "committed": None}
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line being written
        if "ft/participants" not in rec:
            continue
        out["step"], out["participants"] = rec.get("step"), rec["ft/participants"]
        if rec.get("ft/committed"):
            out["committed"] = rec.get("step")
    return out


class GroupSupervisor:
    """Runs the replica groups of one local fault-tolerant run (see the module doc).

    Args:
        spec: the run's launch spec (with its ``fault_tolerance`` entry).
        run_dir: the launch's run directory (logs, state file).
        command: ``(group spec, resume) -> argument list`` of one group's torchrun.
        stop_requested: whether a stop was asked for (signal or ``runs stop``).
        event: ``(kind, detail)`` recorder (the registry's timeline).
    """

    def __init__(self, spec: dict[str, Any], run_dir: Path, command: Callable[[dict, bool], list[str]],
                 stop_requested: Callable[[], bool], event: Callable[[str, str], None]) -> None:
        self.spec, self.run_dir, self.command = spec, run_dir, command
        self.stop_requested, self.event = stop_requested, event
        ft = spec["fault_tolerance"]
        self.max_retries = int(spec.get("max_retries", 0))
        self.groups = [{"id": g, "name": grp["name"], "run_dir": grp["run_dir"], "status": "pending",
                        "pid": None, "exit_code": None, "restarts": 0}
                       for g, grp in enumerate(ft["groups"])]
        self.lighthouse = str(ft["lighthouse"])
        self.procs: dict[int, subprocess.Popen] = {}

    def write_state(self) -> None:
        path = self.run_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"lighthouse": self.lighthouse, "groups": self.groups}, indent=1))
        os.replace(tmp, path)  # describe never reads half a file

    def start_group(self, g: int, resume: bool) -> None:
        spec = {**self.spec, "overrides": group_overrides(self.spec, g)}
        cmd = self.command(spec, resume)
        env = dict(os.environ)
        # the supervisor reports the run's status; a group's own tracker would mark the whole
        # run completed or failed when that one group ends
        env.pop("LLMFORGE_RUN_ID", None)
        with open(self.run_dir / "logs" / f"group-{g}.log", "ab") as log:
            log.write(f"== llmforge supervisor {time.strftime('%Y-%m-%d %H:%M:%S')}: replica group {g}\n"
                      f"== {' '.join(cmd)}\n".encode())
            log.flush()
            self.procs[g] = subprocess.Popen(cmd, cwd=self.spec.get("workdir") or None, env=env,
                                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self.groups[g].update(status="running", pid=self.procs[g].pid, exit_code=None)

    def settle(self, g: int, code: int) -> None:
        """A group ended with ``code``: final status, or restart (see the module table)."""
        grp = self.groups[g]
        grp["exit_code"] = code
        if code == 0:
            grp["status"] = "completed"
        elif self.stop_requested() or code == EXIT_PREEMPTED:
            grp["status"] = "stopped"
        elif code == EXIT_CONFIG or grp["restarts"] >= self.max_retries:
            grp["status"] = "failed"
            self.event("group", f"replica group {g} failed with exit code {code}"
                       + ("" if code == EXIT_CONFIG else f" after {grp['restarts']} restart(s)"))
        else:
            grp["restarts"] += 1
            self.event("restart", f"replica group {g}: exit code {code}; restart {grp['restarts']}/"
                                  f"{self.max_retries} (it rejoins from a live group)")
            self.start_group(g, resume=True)

    def run(self, resume: bool) -> tuple[str, int]:
        """Start the lighthouse and the groups, keep them until all have ended; returns the run's
        final status and exit code (0, 75 or the first failed group's).

        Raises:
            LLMForgeError: the lighthouse could not be started (its port is taken, say)."""
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        where = urlsplit(self.lighthouse)
        house = start_lighthouse(int(where.port or 29510), where.hostname or "127.0.0.1",
                                 int(self.spec["fault_tolerance"]["min_replicas"]),
                                 log=self.run_dir / "logs" / "lighthouse.log")
        try:
            for g in range(len(self.groups)):
                self.start_group(g, resume)
            self.write_state()
            while self.procs:
                time.sleep(POLL_S)
                for g, proc in list(self.procs.items()):
                    code = proc.poll()
                    if code is not None:
                        del self.procs[g]
                        self.settle(g, code)
                        self.write_state()
        finally:
            house.kill()
            house.wait()
        statuses = [grp["status"] for grp in self.groups]
        if all(s == "completed" for s in statuses):
            return "completed", 0
        if "failed" not in statuses:
            return "stopped", EXIT_PREEMPTED
        return "failed", next(grp["exit_code"] for grp in self.groups if grp["status"] == "failed")


__all__ = ["GroupSupervisor", "STATE_FILE", "group_names", "group_overrides", "group_progress", "read_state"]
