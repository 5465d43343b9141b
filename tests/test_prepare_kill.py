"""`llmforge data prepare` killed at any moment, then run again, gives the shards of an
uninterrupted run, sha256 for sha256 (issue 26.3); SIGTERM and SIGINT stop it with exit 75 / 130
and one `stopped:` line (llmforge.signals).

Cheap by design (the suite is over its time budget): the moments are the points where prepare
writes into OUT, counted by a wrapper of ``os.replace`` (every file prepare writes is a temporary
file renamed into place); each killed run and each rerun is ``llmforge.cli.main`` in an
``os.fork`` of this already-imported process (a few ms to start, no imports), and the config is
built once. The killed child sends the signal to itself at its moment, so the moment is exact
rather than a time that a loaded machine stretches. ``benchmarks/prepare_interrupt.py`` does the
same with real processes, signals to the process group at wall-clock moments and 2 workers.
Forking is safe here: conftest sets ``TOKENIZERS_PARALLELISM=false`` (the ``tokenizers`` thread
pool is never started in the parent), the reference prepare runs in this process first (so a
child imports nothing: ``datasets`` imports scipy lazily, 2 s a child otherwise), and the ten
moments use one tokenizing worker (each child one process); one more case uses a pool of 2.
Cost: about 3.5 CPU seconds for 41 forked runs (measured on the loaded 2-core machine).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

import llmforge.data.prepare as prep  # here, not in each child: its imports (datasets, torch) cost 2 s
from helpers.prepared import TOK, write_corpus
from llmforge.cli import data_commands, main
from llmforge.data import prepare_pool

ARGS = [*TOK, "data.val_fraction=0.2", "--docs-per-shard", "3", "--no-progress"]


def _hooks(out: Path, kill: Optional[tuple[str, int, int]], renames: list[str], group: bool = False):
    """``(os.replace, build_tokenizer)`` wrappers that list the renames into OUT and, with
    ``kill = (when, k, signal)``, send ``signal`` to this process (``group``: to its process
    group) before/after the k-th rename (``when`` "before"/"after") or before the tokenizer is
    built (``"start"``: OUT not created)."""
    real_replace, real_build, me = os.replace, prep.build_tokenizer, os.getpid()

    def at(when: str) -> None:
        if kill is not None and kill[:2] == (when, len(renames)):
            os.killpg(0, kill[2]) if group else os.kill(os.getpid(), kill[2])

    def replace(src, dst, *a, **kw):
        if os.getpid() != me or not str(dst).startswith(str(out)):  # a tokenizing worker's
            return real_replace(src, dst, *a, **kw)
        renames.append(os.path.relpath(dst, out))
        at("before")  # the temporary file is whole, not renamed yet
        real_replace(src, dst, *a, **kw)
        at("after")

    def build(*a, **kw):
        at("start")
        return real_build(*a, **kw)

    return replace, build


def _child(source: str, out: Path, err: Path, kill: Optional[tuple[str, int, int]], workers: int,
           group: bool, own_process: bool) -> int:
    """In the forked child: ``data prepare SOURCE OUT`` with stderr into ``err``, killed at
    ``kill`` (``group``: in a process group of its own, the signal sent to the group;
    ``("worker", 0, signal)``: sent by the first tokenizing worker as it starts); the pids of its
    tokenizing workers (``workers`` > 1) go to ``OUT.pids`` as the pool forks them (here, not in
    the worker: a worker the scheduler starts late may be ended before it ran a line).
    ``own_process``: as the command line runs it (a stop exits at once, llmforge.signals), else
    as an in-process caller."""
    if group:
        os.setpgid(0, 0)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the files, not only Python's streams: an
    os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)  # exit at once writes to fd 2
    sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", buffering=1, closefd=False)
    os.replace, prep.build_tokenizer = _hooks(out, kill, [], group)
    real_init, real_add_child = prep.init_worker, prepare_pool.add_child

    def add_child(pid):
        with open(out.with_name(out.name + ".pids"), "a") as f:
            f.write(f"{pid}\n")
        real_add_child(pid)

    def init(*a):
        if kill is not None and kill[0] == "worker":
            try:  # the first worker to start signals; the other may be mid-fork
                os.close(os.open(out.with_name(out.name + ".first"), os.O_CREAT | os.O_EXCL))
                os.killpg(0, kill[2])
            except FileExistsError:
                pass
        real_init(*a)

    prep.init_worker = init  # the name prepare() hands its ShardPool
    prepare_pool.add_child = add_child  # called by the pool for each worker it forks
    return main(["data", "prepare", source, str(out), *ARGS, "--workers", str(workers)], own_process=own_process)


def run(source: str, out: Path, kill: Optional[tuple[str, int, int]] = None, workers: int = 1,
        group: bool = False, own_process: bool = False) -> tuple[int, str]:
    """``data prepare`` in a fork of this process: ``(exit code or -signal, its stderr)``."""
    err = out.with_name(out.name + ".err")
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # never return into pytest
        code = 99
        try:
            code = _child(source, out, err, kill, workers, group, own_process)
        finally:
            os._exit(code)
    deadline = time.monotonic() + 120
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"data prepare into {out} hung")
        time.sleep(0.005)
    status = done[1]
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return code, err.read_text() if err.exists() else ""


def state(out: Path) -> dict[str, object]:
    """Every file in ``out``: its sha256 (the manifest, or its temporary file: its content less the timing)."""
    files: dict[str, object] = {}
    for p in sorted(out.rglob("*")) if out.exists() else ():
        if p.name in ("manifest.json", "manifest.tmp"):
            files[p.name] = {k: v for k, v in json.loads(p.read_text()).items() if k != "seconds"}
        elif p.is_file():  # a shard's temporary file is named after the writing process
            name = re.sub(r"\.\d+\.tmp$", ".PID.tmp", str(p.relative_to(out)))
            files[name] = hashlib.sha256(p.read_bytes()).hexdigest()
    return files


def digests(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.glob("*/shard_*.bin"))}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """18 short documents, the config built once (forks reuse it), the reference prepare run in
    this process (so every module it imports is imported before the forks), its renames listed."""
    root = tmp_path_factory.mktemp("kill")
    source = write_corpus(root / "corpus", files=2, docs=9)
    cfg = data_commands.load_prepare_config(source, [a for a in ARGS if "=" in a])
    mp, renames = pytest.MonkeyPatch(), []
    mp.setattr(data_commands, "load_prepare_config", lambda *a: cfg)
    with pytest.MonkeyPatch.context() as hooked:
        replace, build = _hooks(root / "ref", None, renames)
        hooked.setattr(os, "replace", replace)
        hooked.setattr(prep, "build_tokenizer", build)
        assert main(["data", "prepare", source, str(root / "ref"), *ARGS, "--workers", "1"]) == 0
    yield source, root, renames
    mp.undo()


def test_prepare_killed_at_ten_moments_by_three_signals_reruns_to_identical_shards(corpus, tmp_path):
    source, root, renames = corpus
    ref = root / "ref"
    want, manifest = digests(ref), json.loads((ref / "manifest.json").read_text())
    shards = [r for r in renames if r.endswith(".bin")]
    tokenizer = [r for r in renames if r.startswith("tokenizer/")]
    # the order of writes that makes any moment safe: progress first, each shard then its
    # listing, the manifest last
    assert renames == ["progress.json", *tokenizer, *[x for s in shards for x in (s, "progress.json")],
                       "manifest.json"] and tokenizer, renames
    assert len(want) == len(shards) >= 6 and manifest["splits"]["val"]["shards"], renames
    first_val = renames.index(next(s for s in shards if s.startswith("val/"))) + 1
    n = len(renames)
    shard0 = len(tokenizer) + 2  # the first shard's rename
    moments = [("start", 0), ("before", 1), ("after", 1), ("after", 2), ("before", shard0),
               ("after", shard0), ("after", shard0 + 1), ("before", first_val), ("before", n), ("after", n)]
    signals = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT)
    for i, (when, k) in enumerate(moments):
        states = []
        for sig in signals:
            out = tmp_path / f"{when}{k}-{sig.name}"
            code, err = run(source, out, (when, k, sig), own_process=True)  # as `llmforge data prepare`
            at = f"{sig.name} {when} write {k} ({renames[k - 1] if k else 'OUT not created'})"
            if sig == signal.SIGKILL:
                assert (code, err) == (-signal.SIGKILL, ""), at
            else:
                assert code == {signal.SIGTERM: 75, signal.SIGINT: 130}[sig], (at, code, err)
                assert err == (f"stopped: received {sig.name}: `data prepare` stopped; the shards finished "
                               f"in {out} are kept: run the same command again to continue\n"), (at, err)
            assert (out / "manifest.json").exists() == ((when, k) == ("after", n)), at
            states.append(state(out))
        # the three signals leave the same files in OUT, so the same command continues alike
        # from each: rerun one of them (in turn), a rerun per moment instead of three
        assert states[0] == states[1] == states[2], at
        out = tmp_path / f"{when}{k}-{signals[i % 3].name}"
        listed = json.loads((out / "progress.json").read_text())["splits"] if (out / "progress.json").exists() else {}
        kept = {s["file"]: (out / s["file"]).stat().st_ino for split in listed.values() for s in split}
        code, err = run(source, out)
        assert (code, err) == (0, ""), (at, err)
        assert digests(out) == want, at
        assert json.loads((out / "manifest.json").read_text())["splits"] == manifest["splits"], at
        assert not (out / "progress.json").exists() and not list(out.rglob("*.tmp")), at
        # the shards the killed run had listed were kept, not tokenized again
        assert {f: (out / f).stat().st_ino for f in kept} == kept, at
    # the same command after it completed changes nothing and succeeds (a signal as it finished)
    before = (out / "manifest.json").read_bytes()
    assert run(source, out, ("before", 1, signal.SIGKILL)) == (0, "")  # not one rename
    assert (out / "manifest.json").read_bytes() == before and digests(out) == want


def test_prepare_with_workers_killed_reruns_and_leaves_no_worker_behind(corpus, tmp_path):
    """SIGKILL to the parent alone (the OOM killer's way) while 2 tokenizing workers hold tasks:
    the workers end (the pool's queue closes) and the same command, started at once beside
    any worker still finishing its shard (each writes its own temporary file), gives the same
    shards."""
    source, root, renames = corpus
    listed_one = 1 + sum(r.startswith("tokenizer/") for r in renames) + 1  # first shard listed
    out = tmp_path / "pool"
    assert run(source, out, ("after", listed_one, signal.SIGKILL), workers=2) == (-signal.SIGKILL, "")
    assert run(source, out, workers=2) == (0, "")
    pids = [int(p) for p in out.with_name("pool.pids").read_text().split()]
    assert len(pids) == 4  # two per run
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.01)
    assert not any(_alive(p) for p in pids)
    # after the killed run's workers ended: one started late may still finish its task
    assert digests(out) == digests(root / "ref") and not list(out.rglob("*.tmp"))


def test_prepare_stopped_while_its_workers_tokenize_ends_them_too(corpus, tmp_path, monkeypatch):
    """A stop the command line's ``data prepare`` gets exits at once (llmforge.signals), so its
    pool's ``close()`` never runs; SIGUSR1 or SIGINT (which the workers ignore) or a ``kill PID``
    to the parent alone left the 2 workers orphaned until their shard was done. Each worker here
    takes 60 s a shard and the first, once both have started, sends SIGUSR1 to the parent: exit
    75, one `stopped:` line, both workers gone at once; the rerun gives the uninterrupted run's
    shards."""
    source, root, _ = corpus
    out = tmp_path / "busy"

    def slow_shard(args):
        # both pids were written as the pool forked, before any task was sent
        if out.with_name("busy.pids").read_text().split()[0] == str(os.getpid()):  # one stop
            os.kill(os.getppid(), signal.SIGUSR1)
        time.sleep(60)

    monkeypatch.setattr(prep, "pool_shard", slow_shard)  # forked children inherit it
    code, err = run(source, out, workers=2, own_process=True)
    assert (code, err) == (75, "stopped: received SIGUSR1: `data prepare` stopped; the shards finished in "
                           f"{out} are kept: run the same command again to continue\n")
    pids = [int(p) for p in out.with_name("busy.pids").read_text().split()]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.01)
    assert len(pids) == 2 and not any(_alive(p) for p in pids)
    monkeypatch.undo()
    assert run(source, out, workers=2) == (0, "")
    assert digests(out) == digests(root / "ref") and not list(out.rglob("*.tmp"))


def _alive(pid: int) -> bool:
    """A process that runs (a zombie, reparented and not yet reaped, has ended)."""
    try:
        return "\tZ" not in Path(f"/proc/{pid}/status").read_text().split("State:")[1][:4]
    except (FileNotFoundError, IndexError):
        return False


def test_prepare_with_workers_sigterm_to_its_group_exits_75_and_reruns(corpus, tmp_path):
    """SIGTERM to the process group (a scheduler's way) as the 2 tokenizing workers start and
    once the first shard is listed: the workers die of it while waiting for a task, and the
    command still exits 75 with its one `stopped:` line (a multiprocessing.Pool's terminate()
    waited for ever on the task-queue lock a dead worker held: issue 50.7); no worker is left
    and the rerun gives the uninterrupted run's shards."""
    source, root, renames = corpus
    listed_one = 1 + sum(r.startswith("tokenizer/") for r in renames) + 1  # first shard listed
    for i, kill in enumerate([("worker", 0, signal.SIGTERM), ("after", listed_one, signal.SIGTERM)]):
        out = tmp_path / f"group{i}"
        code, err = run(source, out, kill, workers=2, group=True)
        assert (code, err) == (75, "stopped: received SIGTERM: `data prepare` stopped; the shards "
                               f"finished in {out} are kept: run the same command again to continue\n"), kill
        pids = [int(p) for p in out.with_name(out.name + ".pids").read_text().split()]
        assert len(pids) == 2 and not any(_alive(p) for p in pids), kill
        assert run(source, out, workers=2) == (0, ""), kill
        assert digests(out) == digests(root / "ref") and not list(out.rglob("*.tmp")), kill
