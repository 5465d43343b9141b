"""Command-line parts of run management (registered into ``llmforge``'s parser by :mod:`llmforge.cli`)::

    llmforge launch CONFIG.yaml [--cluster NAME] [--gpus N] [--nodes M] [--secret NAME]... [--dry-run] [key=value ...]
    llmforge clusters
    llmforge secrets
    llmforge runs list [--status S] [--cluster C]
    llmforge runs describe RUN
    llmforge runs logs RUN [--follow] [--resumption K] [--group G]
    llmforge runs stop RUN [--no-wait] [--timeout S]
    llmforge runs delete RUN [--purge] [--yes] [--force]
    llmforge runs restart RUN [key=value ...]

RUN is a run id, a unique prefix of one, or a run name (its newest run). Errors in what is
asked (an unknown run, a run in the wrong state, a restart with nothing to train) exit 2 like
the other input errors; a scheduler that refuses exits 1.

Each handler imports the launcher side (:mod:`llmforge.runs`, :mod:`llmforge.job.records`:
sqlite3, the backends) when it runs: this module is imported by every ``llmforge`` command to
build the parser, and ``llmforge train``'s config errors must not pay for them.
"""

from __future__ import annotations

import argparse
import codecs
import datetime as dt
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

from llmforge.cli.common_args import add_debug as _debug
from llmforge.errors import ConfigError, LLMForgeError
from llmforge.run_guard import MARK, is_run_dir


def add_parsers(sub: Any, runs_sub: Any) -> None:
    """Add ``launch``, ``clusters``, ``secrets`` to ``sub`` and list/describe/logs/stop/delete/
    restart to the ``runs`` group ``runs_sub``."""
    la = sub.add_parser("launch", help="start a recorded run on a cluster (local, slurm, skypilot, sagemaker)")
    la.add_argument("config", help="YAML file (e.g. yamls/demo_cpu.yaml)")
    la.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.max_steps=100")
    la.add_argument("--cluster", default=None, help="cluster name (default: compute.cluster, i.e. local)")
    la.add_argument("--gpus", type=int, default=None, metavar="N",
                    help="GPUs for the whole job (CPU processes without GPUs); default compute.gpus")
    la.add_argument("--nodes", type=int, default=None, metavar="M", help="nodes (default: derived)")
    la.add_argument("--secret", action="append", default=[], metavar="NAME",
                    help="forward this environment variable to the job by name (repeatable)")
    la.add_argument("--dry-run", action="store_true", help="print the script/task/estimator; submit nothing")
    _debug(la)
    _debug(sub.add_parser("clusters", help="list the clusters (GPU type and count per node)"))
    _debug(sub.add_parser("secrets", help="list the credentials this environment provides (names only)"))

    rl = runs_sub.add_parser("list", help="a table of runs")
    rl.add_argument("--status", choices=["pending", "running", "completed", "failed", "stopped"])
    rl.add_argument("--cluster", default=None)
    _debug(rl)
    rd = runs_sub.add_parser("describe", help="config, timeline and last metrics of a run")
    rd.add_argument("run", metavar="RUN")
    _debug(rd)
    lg = runs_sub.add_parser("logs", help="print a run's output")
    lg.add_argument("run", metavar="RUN")
    lg.add_argument("--follow", "-f", action="store_true", help="keep printing until the run ends")
    lg.add_argument("--resumption", type=int, default=None, metavar="K", help="default: the latest")
    lg.add_argument("--group", default=None, metavar="G",
                    help="a fault-tolerant run: replica group G's log (a number or a group's name; "
                         "'lighthouse': the lighthouse's; default 0)")
    _debug(lg)
    st = runs_sub.add_parser("stop", help="stop a run (it saves a checkpoint and exits 75)")
    st.add_argument("run", metavar="RUN")
    st.add_argument("--no-wait", action="store_true", help="return after signalling")
    st.add_argument("--timeout", type=float, default=180.0,
                    help="grace period: seconds after SIGTERM before any process still alive gets SIGKILL")
    _debug(st)
    de = runs_sub.add_parser("delete", help="remove a run's record (--purge: and its run directory)")
    de.add_argument("run", metavar="RUN")
    de.add_argument("--purge", action="store_true", help="also delete the run directory")
    de.add_argument("--yes", "-y", action="store_true", help="do not ask before purging")
    de.add_argument("--force", action="store_true",
                    help="a pending or running run: stop it first (it saves), then delete")
    de.add_argument("--timeout", type=float, default=180.0, help="with --force: seconds to wait for the stop")
    _debug(de)
    rs = runs_sub.add_parser("restart", help="start a run again from its newest checkpoint")
    rs.add_argument("run", metavar="RUN")
    rs.add_argument("overrides", nargs="*", help="extra dotlist overrides")
    _debug(rs)


def _console() -> Any:
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 200, soft_wrap=False)


def _time(t: Optional[float]) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def _duration(run: Any) -> str:
    if not run.started_at:
        return "-"
    seconds = int((run.ended_at or time.time()) - run.started_at)
    return str(dt.timedelta(seconds=seconds))


def cmd_launch(args: argparse.Namespace) -> int:
    from llmforge.runs.launch import launch  # lazy: see the module doc

    res = launch(args.config, args.overrides, cluster=args.cluster, gpus=args.gpus, nodes=args.nodes,
                 dry_run=args.dry_run, secrets=args.secret)
    if args.dry_run:
        print(f"# {res.plan.summary()}")
        sys.stdout.write(res.definition)
        return 0
    run = res.run
    assert run is not None
    where = f"job {run.job_id}" if run.job_id else f"process group {run.pgid}"
    print(f"launched {run.id} on {run.cluster} ({where}): {res.plan.summary()}")
    print(f"run directory: {run.run_dir}")
    ft = run.spec.get("fault_tolerance")
    if ft:  # docs/fault_tolerance.md
        print(f"replica groups: {len(ft['groups'])} jobs beside it ({', '.join(g['name'] for g in ft['groups'])}), "
              f"lighthouse {ft['lighthouse']}; their state: llmforge runs describe {run.id}")
    print(f"follow: llmforge runs logs {run.id} --follow | status: llmforge runs list | "
          f"stop: llmforge runs stop {run.id}")
    return 0


def cmd_clusters(args: argparse.Namespace) -> int:
    from rich.table import Table

    from llmforge.runs.clusters import clusters_file, describe, load_clusters  # lazy: see the module doc

    table = Table(title=f"clusters ({clusters_file()})")
    for col in ("name", "type", "GPU type", "GPUs/node", "where"):
        table.add_column(col, no_wrap=True)
    for cluster in load_clusters().values():
        row = describe(cluster)
        table.add_row(row["name"], row["type"], row["gpu_type"], row["gpus_per_node"], row["where"])
    _console().print(table)
    return 0


def cmd_secrets(args: argparse.Namespace) -> int:
    from rich.table import Table

    from llmforge.runs.credentials import available  # lazy: see the module doc

    rows = available()
    table = Table(title="credentials in this environment (values never shown)")
    for col in ("name", "service", "source"):
        table.add_column(col, no_wrap=True)
    for r in rows:
        table.add_row(r["name"], r["service"], r["source"])
    _console().print(table)
    if not rows:
        print("none found")
    print("forward to a job by name: llmforge launch CONFIG --secret NAME (or compute.secrets: [NAME])")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from rich.table import Table

    from llmforge.job.records import RunRegistry  # lazy: see the module doc
    from llmforge.runs.backend import record_backend_allowed  # lazy: see the module doc
    from llmforge.runs.launch import refresh  # lazy: see the module doc

    registry = RunRegistry()
    refresh(registry)
    runs = registry.list(status=args.status, cluster=args.cluster)
    table = Table()
    for col in ("id", "name", "cluster", "status", "step", "loss", "resumptions", "created", "duration"):
        table.add_column(col, no_wrap=True)
    colors = {"running": "cyan", "completed": "green", "failed": "red", "stopped": "yellow"}
    refused = []
    for r in runs:
        loss = f"{r.last_loss:.4f}" if r.last_loss is not None else "-"
        status = f"[{colors.get(r.status, 'white')}]{r.status}[/]"
        cluster = r.cluster
        if not record_backend_allowed(r):  # not polled, nothing imported
            refused.append(r.id)
            cluster += " [red](backend refused)[/]"
        table.add_row(r.id, r.name, cluster, status, str(r.last_step if r.last_step is not None else "-"),
                      loss, str(r.resumptions), _time(r.created_at), _duration(r))
    _console().print(table)
    if not runs:
        print(f"no runs in {registry.path}")
    if refused:
        print(f"backend refused: {', '.join(refused)} name a backend that is not registered and not "
              "their cluster's type: in clusters.yaml; run records never import code (statuses as "
              "last recorded; llmforge runs describe ID)")
    return 0


def _last_metrics(run_dir: Optional[str]) -> dict[str, Any]:
    path = Path(run_dir or "") / "metrics.jsonl"
    last: dict[str, Any] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                last.update(json.loads(line))
    return last


def cmd_describe(args: argparse.Namespace) -> int:
    import yaml

    from llmforge.runs.backend import backend_of  # lazy: see the module doc
    from llmforge.runs.launch import refresh  # lazy: see the module doc
    from llmforge.job.records import RunRegistry  # lazy: see the module doc

    registry = RunRegistry()
    refresh(registry)
    r = registry.resolve(args.run)
    try:
        label = backend_of(r).job_label
    except LLMForgeError:  # its backend is not installed here
        label = "job"
    where = f"{label} {r.job_id}" if r.job_id else f"process group {r.pgid}"
    lines = [f"run          {r.id}", f"name         {r.name}", f"cluster      {r.cluster} ({r.kind})",
             f"status       {r.status}" + (f" (exit code {r.exit_code})" if r.exit_code is not None else ""),
             f"created      {_time(r.created_at)}", f"started      {_time(r.started_at)}",
             f"ended        {_time(r.ended_at)}", f"duration     {_duration(r)}",
             f"run dir      {r.run_dir}", f"process      {where}",
             f"size         {r.spec.get('summary', '-')}",
             f"resumptions  {r.resumptions} (automatic restarts {r.retries}/{r.spec.get('max_retries', 0)})",
             f"secrets      {', '.join(r.spec.get('secrets', [])) or '-'} (names only)",
             f"last step    {r.last_step if r.last_step is not None else '-'}  loss "
             f"{r.last_loss if r.last_loss is not None else '-'}"]
    if r.message:
        lines.append(f"message      {r.message}")
    if r.spec.get("fault_tolerance"):
        lines += _group_lines(r)
    lines.append("\ntimeline")
    for e in registry.events(r.id):
        lines.append(f"  {_time(e['time'])}  {e['kind']:<10} {e['detail'] or ''}")
    metrics = _last_metrics(r.run_dir)
    if metrics:
        lines.append("\nlast metrics (metrics.jsonl)")
        lines += [f"  {k:<40} {v}" for k, v in metrics.items()]
    lines.append("\nconfig (secrets redacted)")
    lines.append(yaml.safe_dump(r.config, sort_keys=False).rstrip())
    print("\n".join(lines))
    return 0


def _group_lines(r: Any) -> list[str]:
    """A fault-tolerant run's replica groups: state (the local supervisor's ``ft_groups.json``,
    or SLURM's view of each group's job), restarts, and from each group's ``metrics.jsonl`` its
    last step, that step's participants and its last committed step."""
    from llmforge.job.ft_groups import group_progress, read_state  # lazy: see the module doc
    from llmforge.runs.slurm import job_state  # lazy: see the module doc

    ft = r.spec["fault_tolerance"]
    state = read_state(r.run_dir) or {}
    kept = {g["id"]: g for g in state.get("groups", [])}
    jobs = (r.job_id or "").split(",")[1:] if r.kind == "slurm" else []
    lines = [f"\nreplica groups (lighthouse {state.get('lighthouse', ft['lighthouse'])}, min_replicas "
             f"{ft['min_replicas']})",
             f"  {'group':<6} {'state':<10} {'restarts':<9} {'step':<6} {'participants':<13} "
             f"{'committed':<10} run dir"]
    for g, group in enumerate(ft["groups"]):
        if g in kept:
            status, restarts = kept[g]["status"], str(kept[g]["restarts"])
        elif g < len(jobs):
            status, restarts = (job_state(jobs[g]).split() or ["gone"])[0].lower(), "-"
        else:
            status, restarts = "-", "-"
        p = group_progress(group["run_dir"])
        cell = ["-" if p[k] is None else str(p[k]) for k in ("step", "participants", "committed")]
        lines.append(f"  {g:<6} {status:<10} {restarts:<9} {cell[0]:<6} {cell[1]:<13} {cell[2]:<10} "
                     f"{group['run_dir']}")
    return lines


def cmd_logs(args: argparse.Namespace) -> int:
    from llmforge.runs.backend import backend_of  # lazy: see the module doc
    from llmforge.runs.launch import refresh  # lazy: see the module doc
    from llmforge.job.records import RunRegistry  # lazy: see the module doc

    registry = RunRegistry()
    r = registry.resolve(args.run)
    backend = backend_of(r)
    if args.resumption is not None and args.resumption < 0:
        raise ConfigError(f"--resumption {args.resumption}: resumptions count from 0 "
                          f"(this run's: 0..{r.resumptions})")
    k = r.resumptions if args.resumption is None else args.resumption
    # the group only when given: a backend of the documented logs(run, resumption) still works
    group = {} if args.group is None else {"group": args.group}
    path, hint = backend.logs(r, k, **group)
    if not path.is_absolute():  # no local run directory (none, or a remote one): not a file here
        raise ConfigError(f"run {r.id} has no run directory here, so no log to show{hint}")
    if not path.is_file() and not args.follow:
        raise ConfigError(f"no log {path} (resumptions of this run: 0..{r.resumptions}){hint}")
    tail = _Tail(path)
    tail.print_new(final=not args.follow)
    while args.follow:
        refresh(registry)
        now = registry.get(r.id)
        # what was written between the last read and this poll (a resumption's last lines, the
        # run's end) is printed before leaving that log
        tail.print_new()
        if not now.active and (now.resumptions == k or args.resumption is not None):
            tail.print_new(final=True)
            if not tail.path.is_file():  # it ended (or had ended) without writing one
                raise ConfigError(f"no log {tail.path}: run {r.id} is {now.status} and wrote none "
                                  f"(resumptions of this run: 0..{now.resumptions}){hint}")
            return 0
        if now.resumptions != k and args.resumption is None:  # a restart began: follow it
            k, new = now.resumptions, backend.logs(now, now.resumptions, **group)[0]
            # a fault-tolerant group's restarts append to its one log: keep the position there
            if new != tail.path:
                tail.print_new(final=True)
                tail = _Tail(new)
            tail.print_new()
            continue
        time.sleep(0.5)
    return 0


class _Tail:
    """A log printed to stdout from where the last read stopped; UTF-8 decoded across reads,
    so a character a read cut in two (a progress bar's block) is printed whole with the next."""

    def __init__(self, path: Path) -> None:
        self.path, self.pos = path, 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def print_new(self, final: bool = False) -> None:
        """Print what was appended since the last call; ``final``: the log ends here (a cut
        character left at its end is printed as U+FFFD)."""
        if self.path.is_file():  # else not written yet
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                while chunk := f.read(1 << 20):  # 1 MiB at a time: a GB log is not held whole
                    self.pos += len(chunk)
                    sys.stdout.write(self._decoder.decode(chunk))
        sys.stdout.write(self._decoder.decode(b"", final=final))
        sys.stdout.flush()


def cmd_stop(args: argparse.Namespace) -> int:
    from llmforge.runs.launch import stop  # lazy: see the module doc

    r = stop(args.run, wait=not args.no_wait, timeout=args.timeout)
    print(f"{r.id}: {r.status}" + (f" (exit code {r.exit_code})" if r.exit_code is not None else ""))
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    from llmforge.runs.launch import refresh, stop  # lazy: see the module doc
    from llmforge.job.records import RunRegistry  # lazy: see the module doc

    registry = RunRegistry()
    refresh(registry)
    r = registry.resolve(args.run)
    if r.active and not args.force:  # deleting the record would orphan the job
        raise ConfigError(f"run {r.id} is {r.status}: stop it first (llmforge runs stop {r.id}), or "
                          f"pass --force to stop it and then delete it")
    folder = Path(r.run_dir) if args.purge and r.run_dir else None
    if folder and (folder.is_symlink() or (folder.is_dir() and not is_run_dir(folder))):
        # a record is data: --purge deletes only a folder llmforge made (llmforge.run_guard)
        raise ConfigError(f"--purge: {folder} is a link or not an llmforge run directory (no {MARK} "
                          "file); nothing deleted: delete the record without --purge")
    if args.purge and r.run_dir and Path(r.run_dir).exists() and not args.yes and not sys.stdin.isatty():
        raise ConfigError(f"--purge deletes {r.run_dir}: confirm with --yes")
    if r.active:
        r = stop(r.id, wait=True, timeout=args.timeout, registry=registry)
        print(f"{r.id}: {r.status}")
    if args.purge and r.run_dir and Path(r.run_dir).exists():
        if not args.yes:
            if input(f"delete {r.run_dir} and everything in it? [y/N] ").strip().lower() not in ("y", "yes"):
                print("nothing deleted")
                return 1
        shutil.rmtree(r.run_dir)
        print(f"deleted {r.run_dir}")
    registry.delete(r.id)
    print(f"deleted record {r.id}")
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    from llmforge.runs.launch import restart  # lazy: see the module doc

    r = restart(args.run, args.overrides)
    print(f"restarted {r.id} as resumption {r.resumptions} (checkpoint.resume=auto) on {r.cluster}")
    return 0


TOP_COMMANDS = {"launch": cmd_launch, "clusters": cmd_clusters, "secrets": cmd_secrets}
RUN_COMMANDS = {"list": cmd_list, "describe": cmd_describe, "logs": cmd_logs, "stop": cmd_stop,
                "delete": cmd_delete, "restart": cmd_restart}
