"""The ``local`` backend: a detached supervisor process group on this machine.

``llmforge launch --cluster local`` starts ``python -m llmforge.job.supervisor RUN_ID`` in a new
session (its process group id is the supervisor's pid, recorded as the run's ``pgid``); the
supervisor runs torchrun (:mod:`llmforge.job.torchrun`) with the output in
``<run_dir>/logs/resumption-<k>.log`` and updates the registry. torch's launcher starts each
worker in a session of its own, so "the run's processes" are the supervisor's process group and
every descendant of it (found through /proc).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional
from urllib.parse import urlsplit

from llmforge.errors import ConfigError, LLMForgeError
from llmforge.job.ft_groups import group_overrides
from llmforge.job.records import RunRecord
from llmforge.job.supervisor import torchrun_command
from llmforge.job.torchrun import proc_table as _proc_table
from llmforge.parallel.lighthouse import lighthouse_command
from llmforge.run_guard import mark_run_dir
from llmforge.runs.backend import Backend, replica_group
from llmforge.runs.cluster_types import LocalCluster
from llmforge.runs.credentials import job_environment


def run_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a local run: the process group ``pgid`` and all their
    descendants (the torch workers live in sessions of their own)."""
    table = _proc_table()
    if table is None:
        return []
    members = {pid for pid, (_, g, _) in table.items() if g == pgid}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    todo = list(members)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in members:
                members.add(child)
                todo.append(child)
    return sorted(p for p in members if table[p][2] not in ("Z", "X"))


def group_alive(pgid: Optional[int]) -> bool:
    """Whether any non-zombie process is left in process group ``pgid``."""
    if not pgid:
        return False
    table = _proc_table()
    if table is None:
        return _reachable(os.killpg, pgid)
    return any(g == pgid and state not in ("Z", "X") for _, g, state in table.values())


def start_supervisor(run: RunRecord, env: Mapping[str, str], workdir: str) -> int:
    """Start the detached supervisor of ``run``; returns its pid (= the process group id).

    Its own output goes to ``<run_dir>/logs/supervisor.log``; it never holds the caller's
    terminal or pipes, so the caller can exit at once."""
    logs = Path(run.run_dir or ".") / "logs"
    mark_run_dir(logs.parent)
    logs.mkdir(exist_ok=True)
    with open(logs / "supervisor.log", "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "llmforge.job.supervisor", run.id], cwd=workdir,
                                env=dict(env), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc.pid


def signal_run(pgid: int, sig: int = signal.SIGTERM) -> list[int]:
    """Send ``sig`` to the process group of every training worker of the run (each worker and
    its data-loader processes), or to the run's own group ``pgid`` when no worker runs yet;
    returns the pids that were alive. Missing processes are ignored.

    The workers save and exit 75; torch's agent then reports 75 and the supervisor records
    ``stopped`` (signalling the agent instead would make it exit with the signal)."""
    pids = run_pids(pgid)
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    groups.discard(pgid)
    groups = groups or {pgid}
    for group in sorted(groups):
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            pass
    return pids


def wait_gone(pids: list[int], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for every pid to exit (zombies count as gone)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        table = _proc_table()
        alive = [p for p in pids if table is not None and p in table and table[p][2] not in ("Z", "X")]
        if table is None:
            alive = [p for p in pids if _exists(p)]
        if not alive:
            return True
        time.sleep(0.2)
    return False


def _exists(pid: int) -> bool:
    return _reachable(os.kill, pid)


def _reachable(send: Any, target: int) -> bool:
    """Whether signal 0 finds ``target`` (``send``: ``os.kill`` for a pid, ``os.killpg`` for a
    group); one that is not ours to signal still exists."""
    try:
        send(target, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LocalBackend(Backend):
    """``local``: a detached supervisor (:mod:`llmforge.job.supervisor`) running torchrun here."""

    type = "local"
    cluster_class = LocalCluster
    job_label = "process group"
    runs_here = True

    def render(self, run_id: str, name: str, spec: dict[str, Any], resumption: int = 0) -> str:
        if spec.get("fault_tolerance"):
            return self.render_groups(spec, resumption)
        cmd = torchrun_command(spec, resume=resumption > 0)
        env = ", ".join(spec["secrets"]) or "none"
        log = shlex.quote(f"{spec['run_dir']}/logs/resumption-{resumption}.log")
        # shown, not run (the supervisor runs the argument list without a shell), but quoted
        # so that a printed line is the one command it stands for
        return (f"# local: a detached supervisor runs, in {shlex.quote(spec['workdir'])} (output in "
                f"{log}; secrets forwarded: {env}):\n" + shlex.join(cmd) + "\n")

    def render_groups(self, spec: dict[str, Any], resumption: int) -> str:
        """A fault-tolerant run: the lighthouse and one torchrun per replica group
        (:mod:`llmforge.job.ft_groups`)."""
        ft = spec["fault_tolerance"]
        where = urlsplit(ft["lighthouse"])
        house = lighthouse_command(f"{where.hostname}:{where.port}", ft["min_replicas"])
        lines = [f"# local: a detached supervisor runs, in {shlex.quote(spec['workdir'])}, torchft's lighthouse "
                 f"(output in {shlex.quote(spec['run_dir'] + '/logs/lighthouse.log')}):",
                 shlex.join([Path(house[0]).name, *house[1:]])]
        for g in range(len(ft["groups"])):
            cmd = torchrun_command({**spec, "overrides": group_overrides(spec, g)}, resume=resumption > 0)
            log = shlex.quote(f"{spec['run_dir']}/logs/group-{g}.log")
            lines += [f"# replica group {g} (output in {log}; restarted alone when lost, up to "
                      f"scheduling.max_retries={spec.get('max_retries', 0)} times):", shlex.join(cmd)]
        return "\n".join(lines) + "\n"

    def job_environment(self, spec: dict[str, Any], env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        out = job_environment(spec["secrets"], env)
        out.update(LLMFORGE_RUN_ID="<run id>", LLMFORGE_HOME=spec["home"], PYTHONUNBUFFERED="1")
        return out

    def submit(self, run: RunRecord) -> tuple[dict[str, Any], str]:
        env = self.job_environment(run.spec)
        env["LLMFORGE_RUN_ID"] = run.id
        pgid = start_supervisor(run, env, run.spec["workdir"])
        return {"pgid": pgid}, f"supervisor pid/pgid {pgid}"

    def poll(self, run: RunRecord) -> tuple[Optional[str], str]:
        if run.pgid is None:
            late = time.time() - run.created_at > 120
            return ("gone", "the launch did not start a supervisor") if late else (None, "")
        if group_alive(run.pgid):
            return None, ""  # the supervisor and the training record the status themselves
        return "gone", f"process group {run.pgid} is gone without a final status (killed?)"

    kill_wait_s = 10.0
    """Seconds to wait for the processes to vanish after SIGKILL."""

    def cancel(self, run: RunRecord, *, wait: bool = True, timeout: float = 180.0) -> bool:
        """SIGTERM to the run's workers (they save and exit 75); after ``timeout`` seconds (the
        grace period) SIGKILL to every process of the run still alive (the pids are then in
        :attr:`killed`, which ``runs stop`` records). A fault-tolerant run's processes are its
        supervisor's descendants too: every replica group and the lighthouse.

        Raises:
            LLMForgeError: processes survived SIGKILL for :attr:`kill_wait_s` seconds (in
                uninterruptible sleep, say)."""
        self.killed: list[int] = []
        pids = signal_run(run.pgid, signal.SIGTERM) if run.pgid else []
        if not wait or wait_gone(pids, timeout):
            return wait
        left = sorted(set(p for p in pids if _exists(p)) | set(run_pids(run.pgid or 0)))
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                self.killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
        if not wait_gone(left, self.kill_wait_s):
            raise LLMForgeError(f"run {run.id}: processes {run_pids(run.pgid or 0)} still alive "
                                f"{self.kill_wait_s:.0f}s after SIGKILL (SIGTERM {timeout:.0f}s before)")
        return True

    def logs(self, run: RunRecord, resumption: int, group: Optional[str] = None) -> tuple[Path, str]:
        """A fault-tolerant run's log is replica group ``group``'s (default 0:
        ``logs/group-<G>.log``, one file across the group's restarts; ``lighthouse``: the
        lighthouse's; the hint names the others); else the resumption's.

        Raises:
            ConfigError: ``group`` names no replica group (:func:`replica_group`), or a
                fault-tolerant run is asked for an earlier resumption (its groups restart
                alone, each appending to its one log).
        """
        ft = run.spec.get("fault_tolerance")
        g = replica_group(run, group)
        if ft and resumption != run.resumptions:
            raise ConfigError(f"--resumption {resumption}: run {run.id} is fault-tolerant: each replica group "
                              "restarts alone and appends to its own log (logs/group-<G>.log); use --group G")
        if not ft or g == "lighthouse":  # the run's own folder, as every backend keeps it
            return super().logs(run, resumption, group)
        folder = Path(run.run_dir or "") / "logs"
        others = [str(folder / f"group-{o}.log") for o in range(len(ft["groups"])) if o != g]
        return folder / f"group-{g}.log", (f"; replica group {g}'s log; the other groups': {', '.join(others)} "
                                           f"(--group G); the lighthouse's: {folder / 'lighthouse.log'}")

    def where(self) -> str:
        gpus = self.cluster.gpus_per_node if self.cluster else 0
        return "this machine" + ("" if gpus else " (CPU processes, gloo)")
