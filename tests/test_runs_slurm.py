"""A real SLURM job: `llmforge launch --cluster <slurm>` submits the generated sbatch script to a
running SLURM controller (e.g. Debian's slurm-wlm as a one-node cluster on this machine); the
job trains and reports `completed` to the registry. Skipped, with the reason, where no SLURM
controller answers when the test runs (checked in the test, not at import: a controller that
goes away between collection and the test skips it instead of failing it)."""

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import DEMO, REPO, TINY_OVERRIDES, run_cli
from llmforge.runs.launch import refresh
from llmforge.job.records import RunRegistry


HOW = "a one-node cluster from Debian's slurm-wlm (slurmctld + slurmd + munge) runs this test"


def slurm_partition() -> tuple[str | None, str]:
    """``(partition, "")`` of a usable SLURM partition, or ``(None, why not)``."""
    if not shutil.which("sinfo") or not shutil.which("sbatch"):
        return None, "sinfo/sbatch are not installed"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P %T"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return None, "sinfo did not answer within 10 s (no controller?)"
    if out.returncode != 0:
        return None, f"sinfo failed: {(out.stderr or out.stdout).strip()[:200]}"
    for line in out.stdout.splitlines():
        name, state = (line.split() + ["", ""])[:2]
        if state in ("idle", "mixed", "allocated"):
            return name.rstrip("*"), ""
    return None, "sinfo shows no usable node"


def test_slurm_check_skips_with_the_reason_when_no_controller_answers(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sinfo at all
    assert slurm_partition() == (None, "sinfo/sbatch are not installed")
    for name, script in (("sinfo", "echo 'slurm_load_partitions: Unable to contact slurm controller' >&2; "
                                   "exit 1"), ("sbatch", "exit 1")):
        (tmp_path / name).write_text(f"#!/bin/sh\n{script}\n")
        (tmp_path / name).chmod(0o755)
    partition, why = slurm_partition()
    assert partition is None and why == "sinfo failed: slurm_load_partitions: Unable to contact slurm controller"


@pytest.mark.slow
def test_launch_submits_a_real_slurm_job(tmp_path):
    PARTITION, why = slurm_partition()  # at the test: the controller may have gone since collection
    if PARTITION is None:
        pytest.skip(f"no SLURM cluster answers here ({why}); {HOW}")
    home = tmp_path / "home"
    home.mkdir()
    (home / "clusters.yaml").write_text(f"cpu: {{type: slurm, partition: {PARTITION}, gpus_per_node: 0, "
                                        "time_limit: '00:10:00'}\n")
    env = {"LLMFORGE_HOME": str(home)}
    proc = run_cli("launch", DEMO, *TINY_OVERRIDES, "trainer.max_steps=4", "trainer.log_every=1",
                   "trainer.eval_every=0", "trainer.eval_batches=1", "data.max_documents=6",
                   f"run.output_dir={tmp_path / 'runs'}", "run.name=slurm1", "--cluster", "cpu",
                   cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr
    reg = RunRegistry(home / "runs.db")
    run = reg.get(proc.stdout.split()[1])
    assert run.job_id and run.job_id.isdigit()
    end = time.monotonic() + 480
    while time.monotonic() < end and reg.get(run.id).status in ("pending", "running"):
        refresh(reg)  # a job that left the queue without a final status is failed
        time.sleep(1)
    done = reg.get(run.id)
    log = Path(run.run_dir) / "logs" / "resumption-0.log"
    assert done.status == "completed", (done, log.read_text()[-3000:] if log.exists() else "no log")
    assert done.last_step == 4
    text = log.read_text()
    assert f"job {run.job_id}, resumption 0, rendezvous" in text and "done: 4 steps" in text
    end = time.monotonic() + 60
    while time.monotonic() < end and "== exit code" not in log.read_text():
        time.sleep(0.5)
    assert "== exit code 0" in log.read_text()
