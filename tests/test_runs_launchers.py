"""Generated jobs for a 16-GPU run (2 nodes x 8): the sbatch script, the SkyPilot task and the
SageMaker estimator; secrets appear by name only."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import DEMO, REPO

SECRETS = {"WANDB_API_KEY": "wandb-FAKE-secret-0001", "HF_TOKEN": "hf_FAKE_secret_0002",
           "AWS_SECRET_ACCESS_KEY": "aws-FAKE-secret-0003"}
BATCH = ["trainer.global_batch_size=256", "trainer.micro_batch_size=2"]
CLUSTERS = """
big:
  type: slurm
  partition: gpu
  account: llm-team
  gpus_per_node: 8
  gpu_type: h100
  time_limit: "04:00:00"
  sbatch: ["--qos=high"]
  setup: source /opt/venv/bin/activate
sky:
  type: skypilot
  cloud: aws
  accelerator: H100
  gpus_per_node: 8
  spot: true
  region: us-east-1
k8s:
  type: skypilot
  cloud: kubernetes
  context: lab-cluster
  accelerator: H100
  gpus_per_node: 8
sm:
  type: sagemaker
  instance_type: ml.p5.48xlarge
  image_uri: 123456789012.dkr.ecr.us-east-1.amazonaws.com/llmforge:latest
  role: arn:aws:iam::123456789012:role/SageMakerRole
  channels: {train: s3://my-bucket/shakespeare}
  checkpoint_s3_uri: s3://my-bucket/checkpoints
"""


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    h.mkdir()
    (h / "clusters.yaml").write_text(CLUSTERS)
    monkeypatch.setenv("LLMFORGE_HOME", str(h))
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(REPO)
    return h


def _no_secret_values(text: str) -> None:
    for value in SECRETS.values():
        assert value not in text


def _dry(cluster, *extra, secrets=("WANDB_API_KEY",)):
    from llmforge.runs.launch import launch

    return launch(DEMO, [*BATCH, *extra], cluster=cluster, gpus=16, dry_run=True, secrets=secrets)


def test_sbatch_script_for_two_nodes_of_eight_gpus(home, tmp_path):
    res = _dry("big")
    script = res.definition
    assert (res.plan.nodes, res.plan.procs_per_node, res.plan.batch.gradient_accumulation_steps) == (2, 8, 8)
    path = tmp_path / "job.sh"
    path.write_text(script)
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=h100:8",
                 "#SBATCH --partition=gpu", "#SBATCH --account=llm-team", "#SBATCH --time=04:00:00",
                 "#SBATCH --signal=USR1@120", "#SBATCH --requeue", "#SBATCH --qos=high",
                 "source /opt/venv/bin/activate"):
        assert line in script.splitlines(), line
    assert 'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    assert "--nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d" in script
    assert '--rdzv-endpoint="$HEAD_NODE:29500" --rdzv-id="$SLURM_JOB_ID"' in script
    assert "srun --export=ALL --kill-on-bad-exit=1 --nodes=2 --ntasks-per-node=1" in script
    assert 'if [ "$code" -eq 75 ]; then' in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert "checkpoint.resume=auto" in script and "\n  python3 -m llmforge.job.torchrun --nnodes=2" in script
    assert sys.executable not in script  # the nodes' interpreter (after setup), not this machine's path
    assert "#SBATCH --cpus-per-task=16" in script.splitlines()  # 8 processes x (1 + data.num_workers=1)
    export = next(ln for ln in script.splitlines() if ln.startswith("#SBATCH --export="))
    assert export.endswith(",WANDB_API_KEY") and "HF_TOKEN" not in export  # only the named secret
    _no_secret_values(script)


def test_slurm_submit_records_the_job_with_a_fake_sbatch(home, tmp_path, monkeypatch):
    from llmforge.runs.launch import launch
    from llmforge.job.records import RunRegistry

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho \"$@\" > \"$(dirname \"$0\")/args\"\necho 4242\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "runs"
    res = launch(DEMO, [*BATCH, f"run.output_dir={out}", "run.name=big16"], cluster="big", gpus=16,
                 secrets=["WANDB_API_KEY", "HF_TOKEN"])
    run = RunRegistry().get(res.run.id)
    assert run.job_id == "4242" and run.status == "pending" and run.kind == "slurm"
    script = out / "big16" / "launch" / "sbatch-0.sh"
    assert (bin_dir / "args").read_text().split() == ["--parsable", str(script)]
    assert run.spec["secrets"] == ["WANDB_API_KEY", "HF_TOKEN"]
    blobs = [p.read_bytes() for p in home.iterdir() if p.is_file()]
    blobs += [p.read_bytes() for p in (out / "big16").rglob("*") if p.is_file()]
    for blob in blobs:
        for value in SECRETS.values():
            assert value.encode() not in blob


def _sky_fields_ok(task: dict) -> None:
    from llmforge.runs.skypilot import RESOURCE_FIELDS, TASK_FIELDS

    assert set(task) <= TASK_FIELDS, set(task) - TASK_FIELDS
    assert set(task["resources"]) <= RESOURCE_FIELDS, set(task["resources"]) - RESOURCE_FIELDS


def test_skypilot_task_for_two_nodes_of_eight_gpus(home):
    text = _dry("sky").definition
    _no_secret_values(text)
    task = yaml.safe_load(text)
    _sky_fields_ok(task)
    assert task["num_nodes"] == 2
    assert task["resources"] == {"infra": "aws/us-east-1", "accelerators": "H100:8", "use_spot": True}
    assert task["secrets"] == {"WANDB_API_KEY": None} and task["envs"]["LLMFORGE_RUN_ID"] == task["name"]
    for var in ("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_GPUS_PER_NODE", "SKYPILOT_NUM_NODES"):
        assert var in task["run"], var
    assert "checkpoint.resume=auto" in task["run"] and task["setup"] == "pip install ."
    assert task["workdir"] == str(REPO) and " yamls/demo_cpu.yaml " in task["run"]
    k8s = yaml.safe_load(_dry("k8s").definition)
    assert k8s["resources"]["infra"] == "k8s/lab-cluster"
    check = subprocess.run(["bash", "-n", "-c", task["run"]], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def _sky_python():
    try:
        import sky  # noqa: F401

        return sys.executable
    except ImportError:
        return os.environ.get("LLMFORGE_SKYPILOT_PYTHON")


@pytest.mark.skipif(not _sky_python(), reason="SkyPilot is not installed (pip install 'llmforge[launch]', or "
                    "point LLMFORGE_SKYPILOT_PYTHON at a Python that has it); the task's fields are "
                    "checked against SkyPilot's documented ones in test_skypilot_task_for_two_nodes...")
def test_skypilot_parser_accepts_the_task(home, tmp_path):
    path = tmp_path / "task.yaml"
    path.write_text(_dry("sky").definition)
    code = ("import sys, sky; t = sky.Task.from_yaml(sys.argv[1]); t.update_secrets({'WANDB_API_KEY': 'x'}); "
            "r = list(t.resources)[0]; print(t.num_nodes, r.accelerators, r.use_spot, r.region, sorted(t.envs))")
    out = subprocess.run([_sky_python(), "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2].startswith("2 {'H100': 8} True us-east-1"), out.stdout


def test_sagemaker_estimator_definition(home):
    text = _dry("sm", secrets=("WANDB_API_KEY", "HF_TOKEN")).definition
    _no_secret_values(text)
    d = json.loads(text)
    assert d["distribution"] == {"torch_distributed": {"enabled": True}}
    assert (d["instance_type"], d["instance_count"]) == ("ml.p5.48xlarge", 2)
    assert d["image_uri"].endswith("llmforge:latest") and d["role"].startswith("arn:aws:iam::")
    assert d["inputs"] == {"train": "s3://my-bucket/shakespeare"}
    assert d["entry_point"] == "src/llmforge/cli/sagemaker_entry.py" and d["source_dir"] == str(REPO)
    assert d["hyperparameters"]["config"] == "yamls/demo_cpu.yaml"
    assert set(d["environment"]) == {"LLMFORGE_RUN_ID", "PYTHONUNBUFFERED", "WANDB_API_KEY", "HF_TOKEN"}
    assert d["checkpoint_s3_uri"].startswith("s3://my-bucket/checkpoints/")


def test_compute_section_drives_the_launch_and_cli_dry_run(home, tmp_path, capsys):
    from llmforge.cli import main

    cfg = tmp_path / "big.yaml"
    cfg.write_text(f"base: {DEMO}\ntrainer: {{global_batch_size: 256, micro_batch_size: 2}}\n"
                   "compute: {gpus: 128, cluster: big, secrets: [WANDB_API_KEY]}\nscheduling: {max_retries: 3}\n")
    assert main(["launch", str(cfg), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# 128 GPUs = 16 node(s) x 8 on big; global batch 256 = micro 2 x "
                                  "data-parallel 128 x accumulation 1")
    assert "#SBATCH --nodes=16" in out and "WANDB_API_KEY" in out
    _no_secret_values(out)
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n"], input=out, text=True).returncode == 0


def test_sbatch_uses_the_clusters_python_and_cpus_per_task(home, monkeypatch):
    with open(home / "clusters.yaml", "a") as f:
        f.write("own:\n  type: slurm\n  gpus_per_node: 0\n  processes_per_node: 2\n  cpus_per_task: 6\n"
                "  python: /shared/envs/llm/bin/python\n")
    from llmforge.config import loader
    from llmforge.runs.launch import launch

    reads = []  # launch reads the YAML once, and resolves it here and in the job's environment
    monkeypatch.setattr(loader, "_read_chain", lambda *a, _read=loader._read_chain: reads.append(a[1]) or _read(*a))
    script = launch(DEMO, ["data.num_workers=2"], cluster="own", gpus=2, dry_run=True).definition
    assert reads == [DEMO]
    assert "\n  /shared/envs/llm/bin/python -m llmforge.job.torchrun --nnodes=1 --nproc-per-node=2" in script
    assert "#SBATCH --cpus-per-task=6" in script.splitlines() and "--gpus-per-node" not in script
    default = launch(DEMO, [*BATCH, "data.num_workers=2"], cluster="big", gpus=8, dry_run=True).definition
    assert "#SBATCH --cpus-per-task=24" in default.splitlines()  # 8 x (1 + 2 workers)


def _config(tmp_path, text):
    path = tmp_path / "job.yaml"
    path.write_text(f"base: {DEMO}\n{text}")
    return str(path)


@pytest.mark.parametrize("cluster, text, secrets, expect", [
    ("local", "loggers: [{name: jsonl}, {name: wandb, mode: offline, api_key: abc123}]\n", (),
     "loggers.1.api_key: API keys are not read from config files"),
    ("big", "run: {name: '${oc.env:LAB_RUN_NAME}'}\n", (),
     "Environment variable 'LAB_RUN_NAME' not found\" -- the job on cluster 'big' will not have LAB_RUN_NAME: "
     "forward it by name with --secret LAB_RUN_NAME"),
    ("local", "run: {name: '${oc.env:LAB_SECRET_TOKEN}'}\n", (),
     "not found\" -- the job on cluster 'local' will not have LAB_SECRET_TOKEN"),
    ("big", "imports: [no_such_lab_module]\n", (), "imports: cannot import 'no_such_lab_module'"),
    ("local", "model: {init_from: 'hf:/nonexistent/llama'}\n", (),
     "model.init_from: /nonexistent/llama/config.json not found"),
    ("big", "loggers: [{name: wandb, mode: online}]\n", (),
     "loggers: wandb is online but WANDB_API_KEY is not set; export WANDB_API_KEY=... before training, or "
     "set mode: offline in its loggers: entry -- the job on cluster 'big' will not have WANDB_API_KEY: "
     "forward it by name with --secret WANDB_API_KEY"),
    ("big", "loggers: [{name: wandb, mode: sometimes}]\n", (),
     "error: loggers: wandb: mode must be 'online' or 'offline'; got 'sometimes'\n"),
])
def test_launch_refuses_what_the_job_would_refuse_before_submitting(home, tmp_path, monkeypatch, capsys,
                                                                    cluster, text, secrets, expect):
    from llmforge.cli import main

    monkeypatch.setenv("LAB_RUN_NAME", "from-the-login-node")
    monkeypatch.setenv("LAB_SECRET_TOKEN", "tok-FAKE-0004")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\ntouch \"$(dirname \"$0\")/submitted\"\necho 4242\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    gpus = ["--gpus", "16"] if cluster == "big" else []
    argv = ["launch", _config(tmp_path, text), *BATCH, f"run.output_dir={tmp_path / 'runs'}", "--cluster", cluster,
            *gpus]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expect in err and "tok-FAKE" not in err, err
    assert not (bin_dir / "submitted").exists() and not (tmp_path / "runs").exists()  # nothing submitted
    from llmforge.job.records import RunRegistry

    assert RunRegistry().list() == []


def test_an_env_interpolation_forwarded_by_name_or_set_in_setup_passes(home, tmp_path, monkeypatch):
    from llmforge.runs.launch import launch

    monkeypatch.setenv("LAB_SECRET_TOKEN", "tok-FAKE-0004")
    monkeypatch.setenv("LAB_RUN_NAME", "lab")
    # in a tag, not run.name: a secret in a folder name is refused (check_no_secret_in_folders)
    secret = _config(tmp_path, "run: {tags: ['${oc.env:LAB_SECRET_TOKEN}']}\n")
    assert launch(secret, [], dry_run=True, secrets=["LAB_SECRET_TOKEN"]).definition
    with open(home / "clusters.yaml", "a") as f:
        f.write("lab:\n  type: slurm\n  gpus_per_node: 8\n  setup: |\n    export LAB_RUN_NAME=lab\n")
    named = _config(tmp_path, "run: {name: '${oc.env:LAB_RUN_NAME}'}\n")
    assert "#SBATCH" in launch(named, BATCH, cluster="lab", gpus=8, dry_run=True).definition
    online = _config(tmp_path, "loggers: [{name: wandb, mode: online}]\n")
    assert "WANDB_API_KEY" in launch(online, BATCH, cluster="big", gpus=8, dry_run=True,
                                     secrets=["WANDB_API_KEY"]).definition
    # weights that live on the cluster, not on the login node: noted, not refused
    there = _config(tmp_path, "model: {init_from: 'hf:/nonexistent/llama'}\n")
    assert "#SBATCH" in launch(there, BATCH, cluster="lab", gpus=8, dry_run=True).definition


# issue 21 item 9: names and paths rendered into job scripts are data, never shell
HOSTILE_NAME = "x'; touch P1; echo \"$(touch P2)\" `touch P3`;#end"


def _recorders(tmp_path, *names):
    """Stand-ins for ``names`` that append their arguments (NUL-separated) to ``<name>.args``."""
    bin_dir = tmp_path / "stub-bin"
    bin_dir.mkdir(parents=True)
    for name in names:
        (bin_dir / name).write_text(f'#!/bin/bash\nprintf "%s\\0" "$@" >> "$(dirname "$0")/{name}.args"\n')
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _run_bash(script, bin_dir, cwd, env):
    """Run ``script`` with only the recorders and the system's tools on PATH; returns what each
    recorder got, by name."""
    proc = subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", **env})
    return proc, {p.stem: p.read_text().split("\0")[:-1] for p in bin_dir.glob("*.args")}


def test_hostile_names_and_paths_reach_the_job_as_one_argument_in_every_backend(home, tmp_path, monkeypatch):
    """Quotes, ``$(...)``, backticks, ``;`` and ``#`` in run.name and run.output_dir: the sbatch
    script and the SkyPilot task run (with recorders for srun, scontrol and python) and pass the
    exact values; the local command line and SageMaker's hyperparameters split back to them;
    nothing the values spell runs."""
    import shlex

    from llmforge.cli.sagemaker_entry import train_argv

    work = tmp_path / "work dir"
    work.mkdir()
    out = tmp_path / "out $(touch P4); `touch P5`"
    hostile = [f"run.name={HOSTILE_NAME}", f"run.output_dir={out}"]
    monkeypatch.chdir(work)
    script = _dry("big", *hostile).definition
    sbatch = dict(shlex.split(ln[len("#SBATCH "):])[0].split("=", 1) for ln in script.splitlines()
                  if ln.startswith("#SBATCH --") and "=" in ln)
    assert sbatch["--job-name"] == HOSTILE_NAME and sbatch["--output"] == f"{out}/{HOSTILE_NAME}/logs/slurm-%j.log"
    bins = _recorders(tmp_path, "srun", "scontrol")
    proc, calls = _run_bash(script, bins, work, {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"})
    assert calls["srun"][-3:] == [*hostile, "checkpoint.resume=auto"], proc.stderr
    assert (out / HOSTILE_NAME / "logs" / "resumption-0.log").is_file()

    task = yaml.safe_load(_dry("sky", *hostile).definition)
    bins = _recorders(tmp_path / "sky", "python")
    proc, calls = _run_bash(task["run"], bins, work, {"SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "0",
                                                      "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2",
                                                      "SKYPILOT_NUM_GPUS_PER_NODE": "8"})
    assert calls["python"][-3:] == [*hostile, "checkpoint.resume=auto"], proc.stderr

    local = _dry("local", *hostile).definition.splitlines()
    assert shlex.split(local[1])[-2:] == hostile and shlex.split(local[0])[7] == str(work)
    monkeypatch.chdir(REPO)  # SageMaker uploads the project folder
    hp = json.loads(_dry("sm", *hostile).definition)["hyperparameters"]
    argv = train_argv(["--config", hp["config"], "--overrides", hp["overrides"]], env={})
    assert argv[-4:-2] == hostile
    assert [p.name for p in tmp_path.rglob("P[0-9]")] == [] and not list(REPO.glob("P[0-9]"))


@pytest.mark.parametrize("key", ["run.name", "run.output_dir"])
def test_a_control_character_in_a_name_or_path_exits_2_naming_the_key(home, tmp_path, capsys, key):
    from llmforge.cli import main
    from llmforge.errors import ConfigError
    from llmforge.runs.clusters import get_cluster
    from llmforge.runs.slurm import sbatch_script

    section, field = key.split(".")
    value = "x\ntouch P\n#"
    cfg = _config(tmp_path, f"{section}: {{{field}: {json.dumps(value)}}}\n")
    want = (f"error: {key}={value!r} holds a control character (newline, tab, ...); use printable characters "
            f"only in {key}\n")
    for argv in (["launch", cfg, *BATCH, "--cluster", "big", "--gpus", "16", "--dry-run"], ["train", cfg]):
        assert main(argv) == 2
        assert capsys.readouterr().err == want
    spec = {"run_dir": "/r", "nodes": 1, "procs_per_node": 1, "workdir": "/w", "home": "/h", "config_path": "c.yaml"}
    with pytest.raises(ConfigError, match="run.name='a\\\\nb' holds a control character"):
        sbatch_script("id", "a\nb", spec, get_cluster("big"))  # a backend called directly refuses too


def test_a_percent_in_the_run_directory_is_literal_in_sbatch_output(home):
    """sbatch expands %u, %j, %x... in --output: a run directory `100%u` would send the job's log
    to a folder that does not exist (the job fails before its first line)."""
    import shlex

    from llmforge.runs.clusters import get_cluster
    from llmforge.runs.slurm import sbatch_script

    spec = {"run_dir": "/r/100%u", "nodes": 1, "procs_per_node": 1, "workdir": "/w", "home": "/h",
            "config_path": "c.yaml"}
    lines = sbatch_script("id", "n", spec, get_cluster("big")).splitlines()
    output = [shlex.split(ln[len("#SBATCH "):])[0] for ln in lines if ln.startswith("#SBATCH --output=")]
    assert output == ["--output=/r/100%%u/logs/slurm-%j.log"]
    assert "mkdir -p /r/100%u/logs" in lines  # the folder itself is the literal name


def test_fault_tolerant_slurm_launch_is_a_lighthouse_job_and_one_job_per_group(home, tmp_path, monkeypatch, capsys):
    """No controller: fake sbatch/squeue/scancel record their arguments. The lighthouse's job
    goes first; each group's job starts after it, reads its host and names it to the training."""
    from llmforge.cli import main
    from llmforge.job.records import RunRegistry
    from llmforge.run_guard.marks import is_run_dir
    from llmforge.runs.launch import launch

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {"sbatch": 'n=$(cat "$D/n" 2>/dev/null || echo 100); n=$((n + 1)); echo $n > "$D/n"; '
                       'echo "$@" >> "$D/sbatch.args"; echo $n',
             "squeue": 'echo "$@" >> "$D/squeue.args"; echo RUNNING', "scancel": 'echo "$@" >> "$D/scancel.args"'}
    for name, body in fakes.items():
        (bin_dir / name).write_text(f'#!/bin/sh\nD="$(dirname "$0")"\n{body}\n')
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "runs"
    res = launch(DEMO, [f"run.output_dir={out}", "run.name=ft", "fault_tolerance.enabled=true",
                        "fault_tolerance.replica_groups=2", "fault_tolerance.lighthouse=http://127.0.0.1:29600"],
                 cluster="big", gpus=1)
    run = RunRegistry().get(res.run.id)
    assert run.job_id == "101,102,103" and run.status == "pending"
    launch_dir = out / "ft" / "launch"
    calls = (bin_dir / "sbatch.args").read_text().splitlines()
    assert calls == [f"--parsable {launch_dir}/lighthouse.sh",
                     f"--parsable --dependency=after:101 {launch_dir}/group-0.sh",
                     f"--parsable --dependency=after:101 {launch_dir}/group-1.sh"]
    house = (launch_dir / "lighthouse.sh").read_text()
    for line in ("#SBATCH --job-name=ft-lighthouse", "#SBATCH --nodes=1", "#SBATCH --ntasks=1",
                 "#SBATCH --partition=gpu", "#SBATCH --time=04:00:00", "source /opt/venv/bin/activate",
                 'hostname > "$HOST_FILE.tmp" && mv "$HOST_FILE.tmp" "$HOST_FILE"',
                 "exec torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000 --heartbeat_timeout_ms 2000 "
                 "--quorum_tick_ms 100 --bind 0.0.0.0:29600"):
        assert line in house.splitlines(), line
    assert "gpus-per-node" not in house and "--requeue" not in house
    for g in (0, 1):
        script = (launch_dir / f"group-{g}.sh").read_text()
        check = subprocess.run(["bash", "-n", str(launch_dir / f"group-{g}.sh")], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        for line in (f"#SBATCH --job-name=ft-g{g}", "#SBATCH --gpus-per-node=h100:1", "#SBATCH --requeue",
                     f"#SBATCH --output={out}/ft-g{g}/logs/slurm-%j.log", f"HOST_FILE={launch_dir}/lighthouse.host",
                     'LIGHTHOUSE_HOST=$(cat "$HOST_FILE")'):
            assert line in script.splitlines(), (g, line)
        assert (f"fault_tolerance.replica_id={g} run.name=ft-g{g} checkpoint.resume=auto "
                '"fault_tolerance.lighthouse=http://$LIGHTHOUSE_HOST:29600"') in script
        assert ("unset LLMFORGE_RUN_ID" in script) == (g == 1)  # group 0 reports the run's status
        assert is_run_dir(out / f"ft-g{g}")  # marked: the script makes its logs/ before training
    assert main(["runs", "describe", run.id]) == 0
    shown = capsys.readouterr().out
    assert "replica groups (lighthouse http://127.0.0.1:29600, min_replicas 1)" in shown
    for g in (0, 1):
        assert f"  {g:<6} running    -         -      -             -          {out}/ft-g{g}" in shown, shown
    assert main(["runs", "stop", run.id]) == 0
    assert (bin_dir / "scancel.args").read_text().split() == ["101", "102", "103"]
