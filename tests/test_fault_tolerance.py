"""Fault-tolerant replica groups (``fault_tolerance:``, torchft): 2 groups x 1 gloo process
with a real lighthouse. Bad input in-process; without a failure the groups give the losses of
a plain 2-rank DDP run; with one group SIGKILLed the other keeps training, the restarted group
rejoins from its live state and stays bit-equal to it."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import DEMO, REPO, TINY_OVERRIDES, run_main
from helpers.dist import free_port, llmforge, torchrun_job

from llmforge.parallel.lighthouse import start_lighthouse

pytest.importorskip("torchft", reason="needs the llmforge[ft] extra")

# 4 of Shakespeare's texts: every process tokenizes its data (see test_parallel.py)
COMMON = [*TINY_OVERRIDES, "trainer.log_every=1", "trainer.eval_every=0", "trainer.eval_batches=1",
          "data.max_documents=4", "optimizer.eps=1e-6"]


def ft_args(port: int, group: int, out: Path, *extra: str) -> list[str]:
    return ["train", DEMO, *COMMON, f"run.output_dir={out}", f"run.name=g{group}",
            "fault_tolerance.enabled=true", f"fault_tolerance.replica_id={group}",
            f"fault_tolerance.lighthouse=http://127.0.0.1:{port}", "fault_tolerance.timeout_s=20",
            "fault_tolerance.quorum_timeout_s=60", *extra]


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "train/loss" in r]


def wait_all(procs: list, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except Exception:
            p.kill()
            codes.append(p.wait())
    return codes


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from llmforge.checkpoint.run_dir import load_model

    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    return load_model(ckpts[-1], trust_code=True)[0].state_dict()


def test_fault_tolerance_bad_input(tiny_overrides, tmp_path):
    base = ["train", DEMO, *tiny_overrides, "fault_tolerance.enabled=true"]
    cases = {
        "fault_tolerance.min_replicas": ["fault_tolerance.min_replicas=3"],
        "strategy.name=ddp": ["strategy.name=ddp", "trainer.devices=2"],
        "strategy.name=fsdp2": ["strategy.name=fsdp2", "strategy.tp=2", "trainer.devices=2"],  # FSDP2 alone
        "fault_tolerance.lighthouse": [f"fault_tolerance.lighthouse=http://127.0.0.1:{free_port()}"],
        "fault_tolerance.first_quorum_timeout_s": ["fault_tolerance.first_quorum_timeout_s=0"],
        # torchft makes each a duration: 1e12 s panicked there, 1e15 overflowed
        "fault_tolerance.quorum_timeout_s": ["fault_tolerance.quorum_timeout_s=1e12"],
    }
    for key, extra in cases.items():
        res = run_main(*base, *extra)
        assert res.returncode == 2, (key, res.stderr[-2000:])
        assert key in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("metrics.jsonl"))
    dry = run_main(*base, "--dry-run")  # no lighthouse needed: nothing trains
    assert dry.returncode == 0 and "replica group   0 of 2" in dry.stdout, dry.stdout + dry.stderr
    assert "8 of the 16 sequences per step" in dry.stdout


def test_bad_lighthouse_addresses_exit_2_at_the_dry_run(tiny_overrides):
    """A malformed lighthouse (an unclosed IPv6 bracket crashed with ValueError, exit 1; a port
    past 65535 passed the dry run) or one with a password (the start's hint printed it) is
    refused when the config is checked, one line, the password never printed."""
    base = ["train", DEMO, *tiny_overrides, "fault_tolerance.enabled=true", "--dry-run"]
    for address in ("http://[::1", "http://127.0.0.1:99999", "http://u:pw123@127.0.0.1:29510"):
        res = run_main(*base, f"fault_tolerance.lighthouse={address}")
        assert res.returncode == 2 and res.stderr.count("\n") == 1, (address, res.stderr)
        assert res.stderr.startswith("error: fault_tolerance.lighthouse must be an address"), res.stderr
        assert "pw123" not in res.stderr + res.stdout


def test_launch_names_cp_inside_a_replica_group(tiny_overrides, tmp_path):
    """``launch --gpus 2 strategy.cp=2`` of a fault-tolerant run said the GPU count "cannot
    divide the batch" and listed the strategy without cp; now the refusal itself, naming cp."""
    res = run_main("launch", DEMO, *tiny_overrides, "fault_tolerance.enabled=true", "strategy.cp=2",
                   "--gpus", "2", "--dry-run", env={"LLMFORGE_HOME": str(tmp_path / "home")})
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("error: fault_tolerance.enabled: a replica group") and "cp=2" in res.stderr


def test_rejoin_batch_is_the_loaders(tiny_overrides):
    """What a rejoined group reads at step s (``Trainer.batch_for_step``) is what its loader
    yields at step s: group 1 of 2 reads its half of each global batch, the other half is
    group 0's (no window read twice within a step)."""
    import socket

    from llmforge import Trainer

    with socket.socket() as listener:  # a lighthouse address that accepts connections
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        batches = {}
        for group in (0, 1):
            trainer = Trainer.from_yaml(DEMO, [*tiny_overrides, "data.max_documents=4", f"run.name=g{group}",
                                               "fault_tolerance.enabled=true",
                                               f"fault_tolerance.replica_id={group}",
                                               f"fault_tolerance.lighthouse=http://127.0.0.1:{port}"])
            trainer.setup()
            try:
                trainer.datamodule.setup("fit")
                loader = iter(trainer.datamodule.train_dataloader())
                batches[group] = [next(loader) for _ in range(3)]
                for step, batch in enumerate(batches[group], start=1):
                    assert torch.equal(trainer.batch_for_step(step), batch), step
            finally:
                trainer.run_lock.release()
    assert batches[0][0].shape == (8, 65)  # half of the global batch of 16 windows of 64 + 1
    for a, b in zip(batches[0], batches[1]):
        rows = {tuple(r.tolist()) for r in torch.cat([a, b])}
        assert len(rows) == 16


def test_first_quorum_waits_its_own_timeout(tmp_path):
    """The process's first quorum waits ``first_quorum_timeout_s`` (groups may still be starting),
    every later one ``quorum_timeout_s``; a quorum that does not form ends the group with
    QuorumLost naming the key it waited on. torchft's Manager is replaced by a recorder here:
    the real one, and the timeouts through a real lighthouse, run in the tests below."""
    from types import SimpleNamespace

    from llmforge.config import load_config
    from llmforge.parallel.fault_tolerance import QuorumLost, ReplicaGroup

    ft = load_config(DEMO, ["fault_tolerance.first_quorum_timeout_s=7",
                            "fault_tolerance.quorum_timeout_s=3"]).fault_tolerance

    class Manager:  # torchft.Manager.start_quorum's contract: returns, or raises on timeout
        def __init__(self, fail_after: int = 99):
            self.waits, self.fail_after = [], fail_after

        def start_quorum(self, timeout):
            self.waits.append(timeout.total_seconds())
            if len(self.waits) > self.fail_after:
                raise TimeoutError("quorum timed out\ndetails")

    group = ReplicaGroup(ft, batch_for_step=lambda step: None)
    group.manager = Manager()
    for step in (1, 2, 3):
        group.batch_start(SimpleNamespace(step=step))
    assert group.manager.waits == [7.0, 3.0, 3.0]
    saved = []
    for fail_after, key, value in ((0, "first_quorum_timeout_s", 7.0), (1, "quorum_timeout_s", 3.0)):
        group = ReplicaGroup(ft, batch_for_step=lambda step: None, save=lambda: saved.append(1) or tmp_path)
        group.manager = Manager(fail_after)
        with pytest.raises(QuorumLost, match=rf"within fault_tolerance\.{key}={value} s before step") as err:
            for step in (5, 6):
                group.batch_start(SimpleNamespace(step=step))
        assert err.value.exit_code == 75 and "quorum timed out" in str(err.value) and "details" not in str(err.value)
        assert ("start the other groups" in str(err.value)) == (key == "first_quorum_timeout_s")
    assert len(saved) == 2


def test_two_groups_equal_ddp_then_lighthouse_lost(tmp_path):
    """No failure: 2 groups (each 1 process, half of the global batch) = 2-rank DDP = one
    process with the whole batch. Then the lighthouse dies: both groups save a checkpoint and
    exit 75 within quorum_timeout_s."""
    steps = ["scheduler.name=constant"]  # the reference's 4 steps have the groups' lr
    port = free_port()
    house = start_lighthouse(port, min_replicas=2)  # both groups in every quorum from step 1
    try:
        procs = [llmforge(*ft_args(port, g, tmp_path, *steps, "trainer.max_steps=1000",
                                   "fault_tolerance.quorum_timeout_s=10"), log=tmp_path / f"g{g}.log")
                 for g in (0, 1)]
        deadline = time.monotonic() + 300
        while min(len(records(tmp_path / f"g{g}")) for g in (0, 1)) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        house.kill()
    codes = wait_all(procs, 120)
    logs = "".join((tmp_path / f"g{g}.log").read_text()[-3000:] for g in (0, 1))
    assert codes == [75, 75], logs
    for g in (0, 1):
        last = records(tmp_path / f"g{g}")[-1]["step"]
        assert (tmp_path / f"g{g}" / "checkpoints" / f"step_{last:08d}").is_dir(), logs
        assert "fault_tolerance.quorum_timeout_s" in (tmp_path / f"g{g}.log").read_text()
    # the reference in this process: a 2-rank DDP run gives one process's losses (test_parallel.py),
    # and torchrun's two more processes cost the suite about 20 s
    one = run_main("train", DEMO, *COMMON, *steps, "trainer.max_steps=4", f"run.output_dir={tmp_path}",
                   "run.name=one")
    assert one.returncode == 0, one.stderr[-3000:]
    g0, g1, ref = (records(tmp_path / n)[:4] for n in ("g0", "g1", "one"))
    assert [r["step"] for r in g0] == [1, 2, 3, 4] and all(r["ft/participants"] == 2 for r in g0)
    assert [r["train/loss"] for r in g0] == [r["train/loss"] for r in g1]  # bit-equal groups
    for a, b in zip(g0, ref, strict=True):
        assert abs(a["train/loss"] - b["train/loss"]) < 1e-5, (a, b)
        assert abs(a["train/grad_norm"] - b["train/grad_norm"]) < 1e-5, (a, b)
        assert a["train/tokens_seen"] == b["train/tokens_seen"]


def test_launch_local_groups_describe_and_stop(tmp_path):
    """`llmforge launch` on local starts the lighthouse and one torchrun job per replica group;
    `runs describe` shows each group's state, participants and last committed step; a group
    whose launcher is SIGKILLed is restarted alone (scheduling.max_retries=1) and rejoins;
    `runs stop` stops every group and the lighthouse. min_replicas 1: the survivor never
    waits for the lost group (it commits steps alone, none missing), and the restarted group,
    healed from the survivor's live state, equals it bit for bit at every step it logs."""
    from llmforge.job.records import RunRegistry
    from llmforge.runs import local

    home, out = tmp_path / "home", tmp_path / "runs"
    home.mkdir()
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])  # tests.helpers.slow
    env = {"LLMFORGE_HOME": str(home), "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    port = free_port()
    res = run_main("launch", DEMO, *COMMON, f"run.output_dir={out}", "run.name=ft", "trainer.max_steps=1000",
                   "scheduling.max_retries=1",
                   "fault_tolerance.enabled=true", f"fault_tolerance.lighthouse=http://127.0.0.1:{port}",
                   "callbacks=[{name: tests.helpers.slow.SlowSteps, seconds: 0.3}]", cwd=REPO, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"replica groups: 2 jobs beside it (ft-g0, ft-g1), lighthouse http://127.0.0.1:{port}" in res.stdout
    run = RunRegistry(home / "runs.db").get(res.stdout.split()[1])
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not all(
                len(r) >= 2 and r[-1]["ft/participants"] == 2 for r in (records(out / f"ft-g{g}") for g in (0, 1))):
            time.sleep(0.2)
        shown = run_main("runs", "describe", run.id, env=env)
        assert shown.returncode == 0, shown.stderr
        rows = {ln.split()[0]: ln.split() for ln in shown.stdout.split("replica groups")[1].splitlines()[2:4]}
        assert f"replica groups (lighthouse http://127.0.0.1:{port}, min_replicas 1)" in shown.stdout, shown.stdout
        for g in ("0", "1"):  # group, state, restarts, step, participants, committed, run dir
            assert rows[g][1:3] == ["running", "0"] and rows[g][4] == "2", shown.stdout
            assert int(rows[g][5]) >= 1 and rows[g][6] == str(out / f"ft-g{g}"), shown.stdout
        # a lost group: the supervisor restarts it alone, it rejoins from the other
        group1 = json.loads((out / "ft" / "ft_groups.json").read_text())["groups"][1]
        last = records(out / "ft-g1")[-1]["step"]
        os.kill(group1["pid"], signal.SIGKILL)  # its launcher: the workers die with it
        killed = time.monotonic()
        while time.monotonic() < deadline and not any(
                r["step"] > last + 1 and r["ft/participants"] == 2 for r in records(out / "ft-g1")):
            time.sleep(0.2)
        rejoin_s = time.monotonic() - killed
        state = json.loads((out / "ft" / "ft_groups.json").read_text())
        assert [(g["status"], g["restarts"]) for g in state["groups"]] == [("running", 0), ("running", 1)], state
        assert any(e["kind"] == "restart" and "replica group 1: exit code -9; restart 1/1" in e["detail"]
                   for e in RunRegistry(home / "runs.db").events(run.id))
        stopped = run_main("runs", "stop", run.id, "--timeout", "120", env=env)
        assert stopped.returncode == 0 and stopped.stdout.startswith(f"{run.id}: stopped"), \
            stopped.stdout + stopped.stderr
        assert local.wait_gone(local.run_pids(run.pgid or 0), 30)  # every group and the lighthouse
        state = json.loads((out / "ft" / "ft_groups.json").read_text())
        assert [g["status"] for g in state["groups"]] == ["stopped", "stopped"], state
        for g in (0, 1):  # each group saved its checkpoint on the stop
            assert list((out / f"ft-g{g}" / "checkpoints").glob("step_*")), g
        # group 0 may have started later and healed from group 1's step 1: none missing from
        # its first step on
        kept, rejoined = records(out / "ft-g0"), [r for r in records(out / "ft-g1") if r["step"] > last]
        steps = [r["step"] for r in kept]
        assert steps == list(range(steps[0], steps[0] + len(steps))), steps
        back = min(r["step"] for r in rejoined if r["ft/participants"] == 2)
        down = [r for r in kept if last < r["step"] < back]  # while group 1 was lost
        assert any(r["ft/participants"] == 1 for r in down), [r["ft/participants"] for r in kept]
        # never stopped: none of those steps waited for the lost group's restart
        assert max(r["time/step_seconds"] for r in down) < rejoin_s, rejoin_s
        by_step = {r["step"]: r for r in kept}
        after = [r for r in rejoined if r["step"] in by_step]
        assert len(after) >= 2 and [r["step"] for r in after] == list(range(after[0]["step"], after[-1]["step"] + 1))
        for r in after:  # the same averaged gradient, so the same weights, after every step
            k = by_step[r["step"]]
            assert (r["train/loss"], r["train/grad_norm"], r["train/lr"], r["ft/participants"]) == \
                (k["train/loss"], k["train/grad_norm"], k["train/lr"], 2), (r, k)
    finally:
        for pid in local.run_pids(run.pgid or 0):
            os.kill(pid, signal.SIGKILL)


def test_two_groups_of_two_fsdp2_ranks_equal_hsdp_then_kill_and_rejoin(tmp_path):
    """2 groups x 2 processes, FSDP2 inside each group, torchft's managed group across them
    (the replicate dimension). min_replicas 2: both groups in every step. Steps 1..3 without a
    failure equal a plain 4-rank HSDP run (dp_replicate=2, dp_shard=2), which equals one process
    (test_parallel.py: the reference here), within 1e-5; then group 1 is SIGKILLed (its launcher
    and both workers), restarted, receives the live shards from group 0 rank by rank, and from
    its rejoin on equals group 0 bit for bit at every step."""
    max_steps, kill_at = 10, 3
    fsdp = ["strategy.name=fsdp2", "trainer.devices=2", "trainer.micro_batch_size=4", "scheduler.name=constant",
            f"trainer.max_steps={max_steps}",
            "fault_tolerance.min_replicas=2", "fault_tolerance.quorum_timeout_s=400"]
    port = free_port()
    house = start_lighthouse(port, min_replicas=2)
    try:
        procs = [torchrun_job("-m", "llmforge", *ft_args(port, g, tmp_path, *fsdp), nproc=2,
                              log=tmp_path / f"g{g}.log") for g in (0, 1)]
        deadline = time.monotonic() + 500
        while len(records(tmp_path / "g1")) < kill_at and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), (tmp_path / "g1.log").read_text()[-3000:]
            time.sleep(0.1)
        procs[1].kill()  # the launcher: its workers die with it (PR_SET_PDEATHSIG)
        procs[1].wait()
        last = records(tmp_path / "g1")[-1]["step"]
        procs[1] = torchrun_job("-m", "llmforge", *ft_args(port, 1, tmp_path, *fsdp, "checkpoint.resume=auto"),
                                nproc=2, log=tmp_path / "g1.log")
        codes = wait_all(procs, 500)
    finally:
        house.kill()
    logs = "".join((tmp_path / f"g{g}.log").read_text()[-3000:] for g in (0, 1))
    assert codes == [0, 0], logs
    kept, rejoined = records(tmp_path / "g0"), records(tmp_path / "g1")
    assert [r["step"] for r in kept] == list(range(1, max_steps + 1)), logs
    first = min(r["step"] for r in rejoined if r["step"] > last)
    by_step = {r["step"]: r for r in kept}
    after = [r for r in rejoined if r["step"] >= first]
    assert [r["step"] for r in after] == list(range(first, max_steps + 1))
    for r in after:  # the same averaged shards, so the same weights, after every step
        s = by_step[r["step"]]
        assert (r["train/loss"], r["train/grad_norm"], r["ft/participants"]) == \
            (s["train/loss"], s["train/grad_norm"], 2), (r, s)
    a, b = final_weights(tmp_path / "g0"), final_weights(tmp_path / "g1")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the reference in this process: HSDP 2 x 2 gives one process's losses (test_parallel.py), and
    # torchrun's 4 processes cost the suite about 25 s
    one = run_main("train", DEMO, *COMMON, "scheduler.name=constant", "trainer.micro_batch_size=4",
                   f"trainer.max_steps={kill_at}", f"run.output_dir={tmp_path}", "run.name=one")
    assert one.returncode == 0, one.stderr[-3000:]
    for a, b in zip(kept[:kill_at], records(tmp_path / "one"), strict=True):
        assert a["ft/participants"] == 2 and abs(a["train/loss"] - b["train/loss"]) < 1e-5, (a, b)
        assert abs(a["train/grad_norm"] - b["train/grad_norm"]) < 1e-5, (a, b)
        assert a["train/tokens_seen"] == b["train/tokens_seen"], (a, b)
