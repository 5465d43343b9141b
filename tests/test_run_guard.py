"""A run directory is llmforge's to delete only when llmforge made it, and one process writes it
(``llmforge.run_guard``): ``--overwrite`` leaves user folders and symlinked runs intact, a second
writer exits 2 naming the holder, a killed holder's lock is taken over."""

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DEMO, REPO, TINY_OVERRIDES
from llmforge.checkpoint.run_dir import resolve_checkpoint
from llmforge.cli import main
from llmforge.errors import ConfigError
from llmforge.run_guard import LOCK, MARK, TOKEN_ENV, RunDirBusy, RunLock, peek_holder


ONE_STEP = ["trainer.max_steps=1", "scheduler.warmup_steps=0"]


def files(path: Path) -> dict:
    """Every file and folder under ``path`` with its bytes (None for a folder)."""
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else None) for p in sorted(path.rglob("*"))}


def old_run(path: Path, step: int = 1) -> dict:
    """A run as a version of llmforge before the mark left it: config, metrics, a checkpoint."""
    ckpt = path / "checkpoints" / f"step_{step:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text("")
    (path / "config.yaml").write_text("run: {name: old}\n")
    (path / "metrics.jsonl").write_text('{"step": 99, "train/loss": 1.0}\n')
    return files(path)


def train(tmp_path: Path, *extra: str) -> int:
    return main(["train", DEMO, *TINY_OVERRIDES, *ONE_STEP, f"run.output_dir={tmp_path / 'runs'}",
                 "run.name=r", *extra])


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_folder_llmforge_did_not_make_is_neither_trained_into_nor_deleted(tmp_path, capsys):
    user = tmp_path / "runs" / "r"
    user.mkdir(parents=True)
    (user / "thesis.tex").write_text("years of work")
    ckpts = tmp_path / "ckpts"  # checkpoint.dir holds checkpoints: the run counts as "used"
    (ckpts / "step_00000003").mkdir(parents=True)
    (ckpts / "step_00000003" / "COMPLETE").write_text("")
    (ckpts / "data.csv").write_text("1,2\n")
    before, ckpts_before = files(user), files(ckpts)
    for extra in ([], ["--overwrite"]):
        assert train(tmp_path, f"checkpoint.dir={ckpts}", *extra) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: run.name: {user} is not empty and is not an llmforge run (no {MARK} "
                              "file); llmforge neither trains into nor deletes (--overwrite) a folder"), err
        assert err.count("\n") == 1 and "Traceback" not in err
    assert files(user) == before and files(ckpts) == ckpts_before


def test_a_folder_holding_only_the_lock_is_a_run_being_claimed(tmp_path):
    """Rank 0 opens the lock, then writes the mark under it; another rank's check in between
    saw a non-empty folder without the mark and refused its own run (a 4-rank launch, once in
    the suite). The lock alone is llmforge's; anything beside it still needs the mark."""
    from llmforge.errors import ConfigError
    from llmforge.run_guard import LOCK
    from llmforge.run_guard.marks import check_run_dir

    run = tmp_path / "r"
    run.mkdir()
    (run / LOCK).write_text("")
    check_run_dir(run, "run.name")
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not empty and is not an llmforge run"):
        check_run_dir(run, "run.name")


def test_another_runs_checkpoint_dir_is_neither_continued_nor_deleted(tmp_path, capsys):
    """A checkpoint.dir holding the checkpoints of another run (its meta.json names it and that
    run is still there) is refused fresh, resumed and with --overwrite, all before a write."""
    other = tmp_path / "runs" / "other"
    other.mkdir(parents=True)
    (other / "config.yaml").write_text("run: {name: other}\n")
    ckpts = tmp_path / "shared"
    step = ckpts / "step_00000003"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("")
    (step / "meta.json").write_text(json.dumps({"config": {"run": {"name": "other",
                                                                   "output_dir": str(tmp_path / "runs")}}}))
    before = files(ckpts)
    for extra in ([], ["checkpoint.resume=auto"], ["--overwrite"]):
        assert train(tmp_path, f"checkpoint.dir={ckpts}", *extra) == 2
        err = capsys.readouterr().err
        assert err == (f"error: checkpoint.dir={ckpts} holds the checkpoints of another run, {other} (its "
                       "config.yaml names this folder); --overwrite replaces this run only: give this run its "
                       f"own checkpoint.dir (start from that run's weights with model.init_from={step}, or "
                       "continue it with run.name=other)\n")
    assert files(ckpts) == before and not (tmp_path / "runs" / "r").exists()


def test_a_symlinked_run_and_checkpoint_dir_survive_overwrite(tmp_path, capsys):
    real = tmp_path / "real" / "r"
    before = old_run(real)
    link = tmp_path / "runs" / "r"
    link.parent.mkdir()
    link.symlink_to(real)
    assert train(tmp_path, "--overwrite") == 2
    assert capsys.readouterr().err.startswith(f"error: run.name: {link} is a symbolic link (to {real}); "
                                              "llmforge does not write a run through a link")
    assert link.is_symlink() and files(real) == before

    ckpt_link = tmp_path / "ckpt-link"
    ckpt_link.symlink_to(real / "checkpoints")
    assert train(tmp_path, "run.name=other", f"checkpoint.dir={ckpt_link}", "--overwrite") == 2
    assert capsys.readouterr().err.startswith(f"error: checkpoint.dir: {ckpt_link} is a symbolic link")
    assert files(real) == before and not (tmp_path / "runs" / "other").exists()


def test_a_second_writer_exits_2_naming_the_holder_and_a_killed_holders_lock_is_taken_over(tmp_path, capsys):
    run = tmp_path / "runs" / "r"
    before = old_run(run)
    code = ("import sys, time; from pathlib import Path; from llmforge.run_guard import RunLock\n"
            "lock = RunLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(120)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop(TOKEN_ENV, None)
    holder = subprocess.Popen([sys.executable, "-c", code, str(run)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline() == "held\n"
        info = json.loads((run / LOCK).read_text())
        assert (info["host"], info["pid"]) == (socket.gethostname(), holder.pid)
        want = (f"error: run directory {run} is in use by pid {holder.pid} on host {socket.gethostname()} "
                f"since {info['started']}; one process writes a run at a time")
        for extra in ([], ["checkpoint.resume=auto"], ["--overwrite"]):
            assert train(tmp_path, *extra) == 2
            assert capsys.readouterr().err.startswith(want)
        with pytest.raises(RunDirBusy, match=f"pid {holder.pid}"):  # the lock itself, past the early check
            RunLock(run).acquire()
    finally:
        holder.kill()
        holder.wait()
    assert files(run) == {**before, LOCK: (run / LOCK).read_bytes(), MARK: (run / MARK).read_bytes()}

    lock = RunLock(run).acquire()  # SIGKILL left the holder's JSON; the kernel dropped its flock
    try:
        assert lock.took_over["pid"] == holder.pid
        assert capsys.readouterr().err == (f"note: took over the lock of {run} left by pid {holder.pid} on host "
                                           f"{socket.gethostname()} since {info['started']}, which is no "
                                           "longer running\n")
        assert json.loads((run / LOCK).read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert (run / LOCK).read_text() == "" and TOKEN_ENV not in os.environ  # a clean end is no stale lock


def test_processes_the_holder_started_are_its_run(tmp_path, monkeypatch):
    """torchrun's workers under --nproc and Lightning's re-run ranks inherit the holder's token;
    the lock file holds only its hash, which does not pass for it."""
    run = tmp_path / "r"
    lock = RunLock(run).acquire()
    token = os.environ[TOKEN_ENV]
    try:
        text = (run / LOCK).read_text()  # world-readable: the token's SHA-256 only
        assert token not in text
        assert json.loads(text)["token_sha256"] == hashlib.sha256(token.encode()).hexdigest()
        for forged in ("", json.loads(text)["token_sha256"]):  # what a reader of the file could pass
            monkeypatch.setenv(TOKEN_ENV, forged)
            with pytest.raises(RunDirBusy):
                RunLock(run).acquire()
        monkeypatch.delenv(TOKEN_ENV)
        with pytest.raises(RunDirBusy):
            peek_holder(run)
        monkeypatch.setenv(TOKEN_ENV, token)  # what a worker process sees
        peek_holder(run)
        worker = RunLock(run).acquire()
        assert worker.fd is None  # nothing taken: the holder's lock covers it
    finally:
        lock.release()


def test_overwrite_replaces_an_old_run_keeps_foreign_files_and_expands_paths(tmp_path, monkeypatch, capsys):
    """A run from before the mark is adopted; ``--overwrite`` deletes its files and, in a
    checkpoint.dir elsewhere, only llmforge's checkpoints; ``~`` is the home folder; a lock a
    killed process left is taken over."""
    monkeypatch.setenv("HOME", str(tmp_path))
    run = tmp_path / "runs" / "r"
    old_run(run, step=7)
    gone = dead_pid()
    (run / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": gone, "started": "then", "token": "t"}))
    ckpts = tmp_path / "ckpts"
    (ckpts / "step_00000009").mkdir(parents=True)
    (ckpts / "step_00000009" / "COMPLETE").write_text("")
    (ckpts / "notes.txt").write_text("mine")
    (ckpts / "step_by_step").mkdir()
    (ckpts / "step_by_step" / "plan.md").write_text("mine too")
    monkeypatch.chdir(tmp_path)  # a relative checkpoint.dir: recorded absolute
    assert main(["train", DEMO, *TINY_OVERRIDES, *ONE_STEP, "run.output_dir=~/runs", "run.name=r",
                 "checkpoint.dir=ckpts", "--overwrite"]) == 0
    assert f"note: took over the lock of {run} left by pid {gone} on host" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == [LOCK, MARK, "config.yaml", "metrics.jsonl", "tokenizer"]
    assert '"step": 99' not in (run / "metrics.jsonl").read_text()
    assert sorted(p.name for p in ckpts.iterdir()) == ["notes.txt", "step_00000001", "step_by_step"]
    assert (ckpts / "step_by_step" / "plan.md").read_text() == "mine too"
    assert (run / LOCK).read_text() == "" and not (tmp_path / "~").exists()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # eval / export of the run from another directory find its checkpoint
    assert f"dir: {ckpts}\n" in (run / "config.yaml").read_text()
    assert resolve_checkpoint(run) == (run, ckpts / "step_00000001")


def test_overwrite_keeps_the_old_run_when_the_new_data_is_too_small(tmp_path, capsys):
    """``--overwrite`` deletes the old run only once the new run's data is checked: a corpus too
    small for one optimizer step exits 2 naming the sizes, and the old run stays as it was."""
    run = tmp_path / "runs" / "r"
    before = old_run(run)
    (tmp_path / "small.txt").write_text("only a few words here. " * 40)
    assert train(tmp_path, "data.source=files", f"data.path={tmp_path / 'small.txt'}",
                 "data.val_fraction=0", "--overwrite") == 2
    err = capsys.readouterr().err
    assert "data: the training split has" in err and "one optimizer step needs 16 per rank" in err, err
    assert "Traceback" not in err and files(run) == before


@pytest.mark.parametrize("name", [LOCK, MARK])
def test_a_linked_lock_or_mark_in_a_shared_run_is_never_written_through(tmp_path, capsys, name):
    """A run directory someone shared with ``.llmforge-lock -> ~/.bashrc`` (or a dangling
    ``.llmforge-run`` link): continuing it neither truncates nor creates the file the link names."""
    run = tmp_path / "runs" / "r"
    old_run(run)
    victim = tmp_path / "victim"
    if name == LOCK:
        victim.write_text("precious\n")
    (run / name).symlink_to(victim)
    before = files(tmp_path)
    assert train(tmp_path, "checkpoint.resume=auto") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run / name} is a symbolic link (to {victim}); ") and err.count("\n") == 1, err
    with pytest.raises(ConfigError, match="is a symbolic link"):
        RunLock(run).acquire()
    assert files(tmp_path) == before  # the victim's bytes (or its absence) unchanged


@pytest.mark.parametrize("make", ["fifo", "folder"])
def test_a_lock_that_is_a_pipe_or_a_folder_is_refused_not_waited_on(tmp_path, capsys, make):
    """A named pipe as .llmforge-lock made the early check block for ever (open waits for a
    writer); a folder was an IsADirectoryError (exit 1)."""
    run = tmp_path / "runs" / "r"
    old_run(run)
    os.mkfifo(run / LOCK) if make == "fifo" else (run / LOCK).mkdir()
    assert train(tmp_path, "checkpoint.resume=auto") == 2
    err = capsys.readouterr().err
    assert err == (f"error: {run / LOCK} is not a regular file; llmforge keeps its own small file "
                   "there: delete it\n"), err
    with pytest.raises(ConfigError, match="not a regular file"):
        RunLock(run).acquire()
