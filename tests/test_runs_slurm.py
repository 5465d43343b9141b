"""A real SLURM job: `llmforge launch --cluster <slurm>` submits the generated sbatch script to a
running SLURM controller (e.g. Debian's slurm-wlm as a one-node cluster on this machine); the
job trains and reports `completed` to the registry. Skipped where no SLURM cluster answers."""

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, TINY_OVERRIDES, run_cli
from llmforge.runs.launch import refresh
from llmforge.runs.registry import RunRegistry

DEMO = str(REPO / "yamls" / "demo_cpu.yaml")


def _partition():
    if not shutil.which("sinfo") or not shutil.which("sbatch"):
        return None
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P %T"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return None
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        name, state = line.split()[:2]
        if state in ("idle", "mixed", "allocated"):
            return name.rstrip("*")
    return None


PARTITION = _partition()


@pytest.mark.slow
@pytest.mark.skipif(PARTITION is None, reason="no SLURM cluster answers here (sinfo shows no usable node); "
                    "a one-node cluster from Debian's slurm-wlm (slurmctld + slurmd + munge) runs this test")
def test_launch_submits_a_real_slurm_job(tmp_path):
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
