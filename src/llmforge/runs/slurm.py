"""The ``slurm`` backend: an sbatch script, submitted with ``sbatch``.

One srun task per node runs torchrun (:mod:`llmforge.job.torchrun`, torchrun's arguments)
with a c10d rendezvous on the first node's hostname. ``#SBATCH --signal=USR1@<s>`` makes SLURM
send SIGUSR1 ``s`` seconds before the time limit: llmforge saves a checkpoint and exits 75, on
which the script requeues the job (``--requeue``) and the next start continues with
``checkpoint.resume=auto``; while SLURM holds the requeued job the run shows ``pending``.
Credentials are forwarded by name only (``--export``; the values come from the submitting
environment). The nodes run the cluster's interpreter: ``python`` of the cluster definition,
else ``python3`` as the job's PATH finds it (after ``setup`` has activated an environment, or
the launching shell's activated venv, whose PATH is exported) — never the launching machine's
absolute path. ``cpus_per_task`` defaults to one CPU per training process and per data worker.
Output: ``<run_dir>/logs/resumption-<k>.log``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Mapping, Optional
from urllib.parse import urlsplit

from llmforge.errors import LLMForgeError
from llmforge.job.ft_groups import group_overrides
from llmforge.job.records import RunRecord
from llmforge.parallel.lighthouse import lighthouse_command
from llmforge.paths import check_printable
from llmforge.run_guard import mark_run_dir
from llmforge.runs.backend import JOB_VARIABLES, Backend, files_dir, train_args
from llmforge.runs.cluster_types import Cluster, ClusterError

# Non-secret variables a job needs from the submitting environment (exported by name if set).
# sbatch passes only these (and the named secrets); srun inside uses --export=ALL so that the
# variables the script sets (LLMFORGE_RUN_ID, ...) reach the tasks.
ENV_NAMES = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH",
             "LD_LIBRARY_PATH", "LLMFORGE_CACHE", "HF_HOME", "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE",
             "TOKENIZERS_PARALLELISM", "TORCHAO_FORCE_SKIP_LOADING_SO_FILES")

# squeue states (``%T``) in which SLURM holds a job that does not run: a requeued job is here
HELD = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "CONFIGURING"}
RUNNING = {"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "SUSPENDED", "RESIZING"}


@dataclass
class SlurmCluster(Cluster):
    """A SLURM cluster reached through ``sbatch`` on this machine."""

    partition: Optional[str] = None
    """Partition (``#SBATCH --partition``); null = the cluster's default."""
    account: Optional[str] = None
    """Account to charge (``#SBATCH --account``)."""
    time_limit: Optional[str] = None
    """Wall-time limit, e.g. ``24:00:00`` (``#SBATCH --time``)."""
    cpus_per_task: Optional[int] = None
    """CPUs per node task (``#SBATCH --cpus-per-task``); null = one per training process on the
    node plus one per data worker of each (``data.num_workers``)."""
    sbatch: List[str] = field(default_factory=list)
    """Extra ``#SBATCH`` options, e.g. ``--qos=high``."""
    setup: str = ""
    """Shell lines run before training (e.g. ``module load cuda``, activating a venv)."""
    signal_seconds: int = 120
    """Seconds before the time limit at which SLURM sends SIGUSR1 (checkpoint, exit 75, requeue)."""
    port: int = 29500
    """Rendezvous port on the first node."""
    python: Optional[str] = None
    """Python interpreter on the nodes; null = ``python3`` from the job's PATH (after ``setup``)."""

    def finish(self, where: str) -> None:
        super().finish(where)
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise ClusterError(f"{where}.cpus_per_task: must be >= 1 (or null for the default)")


def cpus_per_task(spec: dict[str, Any], cluster: SlurmCluster) -> int:
    """``#SBATCH --cpus-per-task``: the cluster's, else processes per node x (1 + data workers)."""
    if cluster.cpus_per_task:
        return int(cluster.cpus_per_task)
    return int(spec["procs_per_node"]) * (1 + int(spec.get("data_workers", 1)))


def export_names(spec: dict[str, Any], env: Any = None) -> list[str]:
    """Variable names for ``--export``: the non-secret basics that are set, plus the secrets."""
    env = os.environ if env is None else env
    return [n for n in ENV_NAMES if env.get(n)] + list(spec.get("secrets", []))


def sbatch_script(run_id: str, name: str, spec: dict[str, Any], cluster: SlurmCluster,
                  base_resumption: int = 0, prelude: str = "", shell_args: str = "") -> str:
    """The sbatch script of a run (names of secrets only, never values).

    Every value is quoted with :func:`shlex.quote`, in the ``#SBATCH`` lines too (sbatch's
    parser of those lines groups single- or double-quoted text as a shell does); a value with a
    control character is refused, as a newline would end the ``#SBATCH`` block and start a shell
    line. The cluster's ``sbatch`` options and ``setup`` lines are written as given: they are the
    clusters file's own shell. ``prelude`` (shell lines run before the training) and
    ``shell_args`` (appended to the training's arguments, expanded by the shell) are llmforge's
    own (a replica group's wait for its lighthouse: :func:`ft_scripts`).

    Raises:
        ConfigError: the run name, run directory, rendered values or cluster fields hold a
            control character (naming the key).
    """
    q = shlex.quote
    run_dir, nodes, per_node = spec["run_dir"], int(spec["nodes"]), int(spec["procs_per_node"])
    for key, value in (("run.name", name), ("run.output_dir", run_dir), ("run id", run_id),
                       ("launch folder", spec["workdir"]), ("summary", spec.get("summary", "")),
                       *((f"clusters.yaml {cluster.name}.{k}", getattr(cluster, k) or "")
                         for k in ("name", "partition", "account", "time_limit", "gpu_type"))):
        check_printable(str(value), key)
    lines = ["#!/bin/bash",
             f"# llmforge launch: run {run_id} on cluster {cluster.name}: {spec.get('summary', '')}",
             f"#SBATCH --job-name={q(name)}"]
    if cluster.partition:
        lines.append(f"#SBATCH --partition={q(cluster.partition)}")
    if cluster.account:
        lines.append(f"#SBATCH --account={q(cluster.account)}")
    lines += [f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1"]
    if cluster.gpus_per_node:
        gres = f"{cluster.gpu_type}:{per_node}" if cluster.gpu_type else str(per_node)
        lines.append(f"#SBATCH --gpus-per-node={q(gres)}")
    lines.append(f"#SBATCH --cpus-per-task={cpus_per_task(spec, cluster)}")
    if cluster.time_limit:
        lines.append(f"#SBATCH --time={q(cluster.time_limit)}")
    lines += [f"#SBATCH --signal=USR1@{int(cluster.signal_seconds)}",
              "#SBATCH --requeue",
              "#SBATCH --open-mode=append",
              # sbatch expands %j, %u, %x... in the file name: a % of the folder's is %%
              f"#SBATCH --output={q(run_dir.replace('%', '%%') + '/logs/slurm-%j.log')}",
              f"#SBATCH --export={','.join(export_names(spec)) or 'NONE'}"]
    lines += [f"#SBATCH {opt}" for opt in cluster.sbatch]
    python = cluster.python or "python3"  # the node's, after setup: not this machine's path
    torchrun = [python, "-m", "llmforge.job.torchrun", f"--nnodes={nodes}",
                f"--nproc-per-node={per_node}", "--rdzv-backend=c10d"]
    command = " ".join(q(a) for a in torchrun)
    command += f' --rdzv-endpoint="$HEAD_NODE:{int(cluster.port)}" --rdzv-id="$SLURM_JOB_ID" \\\n    '
    command += " ".join(q(a) for a in train_args(spec)) + (f" {shell_args}" if shell_args else "")
    lines += ["",
              "set -uo pipefail",
              f"export LLMFORGE_RUN_ID={q(run_id)}",
              f"export LLMFORGE_HOME={q(spec['home'])}",
              f"export LLMFORGE_BASE_RESUMPTION={int(base_resumption)}",
              "export PYTHONUNBUFFERED=1",
              'RESUMPTION=$((LLMFORGE_BASE_RESUMPTION + ${SLURM_RESTART_COUNT:-0}))',
              f'mkdir -p {q(run_dir + "/logs")}',
              f'LOG={q(run_dir + "/logs")}/resumption-$RESUMPTION.log',
              'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              f"cd {q(spec['workdir'])}"]
    if cluster.setup:
        lines += ["", cluster.setup.rstrip(), ""]
    if prelude:
        lines += [prelude.rstrip()]
    lines += ['echo "== llmforge: job $SLURM_JOB_ID, resumption $RESUMPTION, rendezvous '
              f'$HEAD_NODE:{int(cluster.port)}, $(date)" >> "$LOG"',
              f"srun --export=ALL --kill-on-bad-exit=1 --nodes={nodes} --ntasks-per-node=1 \\\n  {command} \\\n"
              '  >> "$LOG" 2>&1',
              "code=$?",
              'echo "== exit code $code" >> "$LOG"',
              'if [ "$code" -eq 75 ]; then',
              '  # saved a checkpoint on SIGUSR1 (time limit) or preemption: continue in a new allocation',
              '  scontrol requeue "$SLURM_JOB_ID"',
              "fi",
              'exit "$code"', ""]
    return "\n".join(lines)


def submit(script_path: str, *options: str) -> str:
    """``sbatch --parsable [OPTIONS] SCRIPT``; returns the job id.

    Raises:
        LLMForgeError: sbatch is missing or refuses the job (its message is included).
    """
    try:
        out = subprocess.run(["sbatch", "--parsable", *options, script_path], capture_output=True, text=True,
                             timeout=120)
    except FileNotFoundError as exc:
        raise LLMForgeError("sbatch not found: run llmforge launch on a SLURM login node") from exc
    if out.returncode != 0:
        raise LLMForgeError(f"sbatch refused the job: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip().split(";")[0]


def cancel(job_id: str) -> None:
    """``scancel JOB...``: SLURM sends SIGTERM to every task (llmforge saves and exits 75), then
    kills. ``job_id``: one id, or several joined by commas (a fault-tolerant run's jobs).

    Raises:
        LLMForgeError: scancel is missing or fails.
    """
    try:
        out = subprocess.run(["scancel", *str(job_id).split(",")], capture_output=True, text=True, timeout=60)
    except FileNotFoundError as exc:
        raise LLMForgeError("scancel not found: run this on a SLURM login node") from exc
    if out.returncode != 0:
        raise LLMForgeError(f"scancel {job_id}: {out.stderr.strip()}")


def setup_variables(setup: str) -> list[str]:
    """Names the cluster's ``setup`` lines assign or export (``export NAME=...``, ``NAME=...``)."""
    return re.findall(r"(?m)(?:^|[;&|]\s*|\bexport\s+)([A-Za-z_][A-Za-z0-9_]*)=", setup or "")


LIGHTHOUSE_WAIT_S = 600
"""Seconds a replica group's job waits for its lighthouse's host file before it gives up."""


def ft_scripts(run_id: str, name: str, spec: dict[str, Any], cluster: SlurmCluster,
               base_resumption: int = 0) -> dict[str, str]:
    """The sbatch scripts of a fault-tolerant run, by file name: ``lighthouse.sh`` (one task on
    one node, no GPU: torchft's lighthouse, which writes its node's hostname into
    ``<run_dir>/launch/lighthouse.host``) and ``group-<G>.sh`` per replica group (the run's
    ordinary script for that group's overrides and run directory; it waits for the host file,
    then trains with ``fault_tolerance.lighthouse=http://<that host>:<port>``).

    One SLURM job per group rather than one heterogeneous job: SLURM requeues, cancels and
    schedules a heterogeneous job as one unit, so losing one group's node would requeue every
    group; separate jobs let SLURM requeue (``--requeue``) the lost group alone while the
    others go on, which is the point of replica groups. Only group 0's job reports to the run
    registry (``LLMFORGE_RUN_ID``), so one group's end is not taken for the run's.

    Raises:
        ConfigError: as :func:`sbatch_script`.
    """
    q = shlex.quote
    ft = spec["fault_tolerance"]
    port = int(urlsplit(ft["lighthouse"]).port or 29510)
    host_file = spec["run_dir"] + "/launch/lighthouse.host"
    for key, value in (("run.name", name), ("run.output_dir", spec["run_dir"]), ("run id", run_id),
                       ("launch folder", spec["workdir"]),
                       *((f"clusters.yaml {cluster.name}.{k}", getattr(cluster, k) or "")
                         for k in ("partition", "account", "time_limit"))):
        check_printable(str(value), key)
    house = ["#!/bin/bash",
             f"# llmforge launch: run {run_id} on cluster {cluster.name}: torchft's lighthouse for "
             f"{len(ft['groups'])} replica groups",
             f"#SBATCH --job-name={q(name + '-lighthouse')}"]
    house += [f"#SBATCH --{k.replace('_', '-') if k != 'time_limit' else 'time'}={q(getattr(cluster, k))}"
              for k in ("partition", "account", "time_limit") if getattr(cluster, k)]
    house += ["#SBATCH --nodes=1", "#SBATCH --ntasks=1", "#SBATCH --cpus-per-task=1",
              f"#SBATCH --output={q(spec['run_dir'].replace('%', '%%') + '/logs/lighthouse-%j.log')}",
              f"#SBATCH --export={','.join(export_names(spec)) or 'NONE'}",
              *(f"#SBATCH {opt}" for opt in cluster.sbatch), "", "set -uo pipefail", f"cd {q(spec['workdir'])}"]
    if cluster.setup:
        house += ["", cluster.setup.rstrip(), ""]
    cmd = lighthouse_command(f"0.0.0.0:{port}", ft["min_replicas"], exe="torchft_lighthouse")
    house += [f"HOST_FILE={q(host_file)}",
              '# the groups read the host from this file (written once the job runs here)',
              'hostname > "$HOST_FILE.tmp" && mv "$HOST_FILE.tmp" "$HOST_FILE"',
              "exec " + " ".join(q(a) for a in cmd), ""]
    out = {"lighthouse.sh": "\n".join(house)}
    wait = "\n".join([
        f"HOST_FILE={q(host_file)}",
        f'for _ in $(seq {LIGHTHOUSE_WAIT_S}); do [ -s "$HOST_FILE" ] && break; sleep 1; done',
        f'[ -s "$HOST_FILE" ] || {{ echo "== no lighthouse host in $HOST_FILE after {LIGHTHOUSE_WAIT_S} s" '
        '>> "$LOG"; exit 1; }',
        'LIGHTHOUSE_HOST=$(cat "$HOST_FILE")'])
    for g, group in enumerate(ft["groups"]):
        prelude = wait if g == 0 else wait + "\nunset LLMFORGE_RUN_ID  # group 0 reports the run's status"
        gspec = {**spec, "overrides": group_overrides(spec, g), "run_dir": group["run_dir"]}
        out[f"group-{g}.sh"] = sbatch_script(run_id, group["name"], gspec, cluster, base_resumption, prelude=prelude,
                                             shell_args=f'"fault_tolerance.lighthouse=http://$LIGHTHOUSE_HOST:{port}"')
    return out


def ft_submit(run: RunRecord, cluster: SlurmCluster) -> list[str]:
    """Write :func:`ft_scripts` under ``<run_dir>/launch/`` and submit them: the lighthouse first,
    then each group with ``--dependency=after:<lighthouse job>`` (it starts once the lighthouse
    has). Returns the job ids, the lighthouse's first.

    Raises:
        LLMForgeError: sbatch refused a job (the jobs already submitted are cancelled).
    """
    folder = files_dir(run.spec)
    (folder / "lighthouse.host").unlink(missing_ok=True)  # never an earlier launch's host
    paths = []
    for file, text in ft_scripts(run.id, run.name, run.spec, cluster, run.resumptions).items():
        paths.append(folder / file)
        paths[-1].write_text(text, encoding="utf-8")
    for group in run.spec["fault_tolerance"]["groups"]:
        mark_run_dir(Path(group["run_dir"]))  # the script makes its logs/ folder before training
    jobs = [submit(str(paths[0]))]
    try:
        jobs += [submit(str(p), f"--dependency=after:{jobs[0]}") for p in paths[1:]]
    except LLMForgeError:
        cancel(",".join(jobs))
        raise
    return jobs


class SlurmBackend(Backend):
    """``slurm``: an sbatch script (:func:`sbatch_script`) submitted with ``sbatch``."""

    type = "slurm"
    cluster_class = SlurmCluster
    job_label = "SLURM job"
    definition_file = "sbatch-{resumption}.sh"

    def render(self, run_id: str, name: str, spec: dict[str, Any], resumption: int = 0) -> str:
        if spec.get("fault_tolerance"):  # the lighthouse's script, then each group's
            return "\n".join(f"# ==== {file} ====\n{text}" for file, text in
                             ft_scripts(run_id, name, spec, self.cluster, resumption).items())
        return sbatch_script(run_id, name, spec, self.cluster, resumption)  # type: ignore[arg-type]

    def submit(self, run: RunRecord) -> tuple[dict[str, Any], str]:
        if not run.spec.get("fault_tolerance"):
            return super().submit(run)
        jobs = ft_submit(run, self.cluster)  # type: ignore[arg-type]
        return {"job_id": ",".join(jobs)}, (f"SLURM jobs {', '.join(jobs)} (the lighthouse, then replica "
                                            f"groups 0..{len(jobs) - 2})")

    def job_environment(self, spec: dict[str, Any], env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        env = os.environ if env is None else env
        out = {n: env.get(n, "") for n in export_names(spec, env)}
        out.update({n: "<set by the job>" for n in (*JOB_VARIABLES, "LLMFORGE_BASE_RESUMPTION")})
        setup = getattr(self.cluster, "setup", "")
        out.update({n: "<set by setup>" for n in setup_variables(setup)})
        return out

    def start(self, path: Any, run: RunRecord) -> str:
        return submit(str(path))

    def poll(self, run: RunRecord) -> tuple[Optional[str], str]:
        if not run.job_id:
            return None, ""
        state = job_state(run.job_id)  # one line per job still queued
        states = state.split()
        if not states:
            return "gone", f"SLURM job {run.job_id} left the queue without a final status"
        if any(s in RUNNING for s in states):
            return "running", f"SLURM job {run.job_id} is {' '.join(states)}"
        if all(s in HELD for s in states):
            return "pending", f"SLURM holds job {run.job_id} ({' '.join(states)})"
        return None, ""

    def stop_job(self, job_id: str) -> None:
        cancel(job_id)

    def logs_hint(self, run: RunRecord) -> str:
        return f"; SLURM's own output: {run.run_dir}/logs/slurm-{run.job_id}.log" if run.job_id else ""

    def where(self) -> str:
        c = self.cluster
        return " ".join(f"{k}={getattr(c, k)}" for k in ("partition", "account", "time_limit") if getattr(c, k))


def job_state(job_id: str) -> str:
    """The job's state from ``squeue`` (e.g. RUNNING, PENDING), or "" when it has left the queue."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True,
                             text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return "UNKNOWN"
    return out.stdout.strip() if out.returncode == 0 else ""
