"""Run management without training: the SQLite registry (8 concurrent writers), clusters.yaml
errors, compute sizing, secrets, the supervisor's decisions and torchrun's exit codes."""

import multiprocessing as mp
from types import SimpleNamespace

import pytest

from conftest import DEMO, REPO
from llmforge.cli import main
from llmforge.errors import ConfigError
from llmforge.job.records import RunNotFound, RunRegistry
from llmforge.run_guard import mark_run_dir


def _writer(db: str, name: str, n: int) -> None:
    reg = RunRegistry(db)
    run = reg.create(name, "local", "local", run_id=name)
    for i in range(1, n + 1):
        reg.update(run.id, last_step=i, last_loss=1.0 / i, event=("step", str(i)))
        reg.increment(run.id, "resumptions")


def test_eight_concurrent_writers_lose_no_update(tmp_path):
    db = str(tmp_path / "runs.db")
    RunRegistry(db)
    ctx = mp.get_context("spawn")
    n = 40
    procs = [ctx.Process(target=_writer, args=(db, f"w{i}", n)) for i in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    reg = RunRegistry(db)
    runs = {r.id: r for r in reg.list()}
    assert sorted(runs) == [f"w{i}" for i in range(8)]
    for rid, r in runs.items():
        assert r.last_step == n and r.resumptions == n, rid
        steps = [e["detail"] for e in reg.events(rid) if e["kind"] == "step"]
        assert steps == [str(i) for i in range(1, n + 1)], rid
    import sqlite3

    assert sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_registry_resolve_status_and_delete(tmp_path):
    reg = RunRegistry(tmp_path / "runs.db")
    a = reg.create("exp", "local", "local", spec={"x": 1}, config={"run": {"name": "exp"}})
    b = reg.create("exp", "local", "local")
    assert reg.resolve(a.id).spec == {"x": 1} and reg.resolve("exp").id == b.id  # name: newest
    assert reg.resolve(b.id[:-1]).id == b.id  # a unique prefix
    with pytest.raises(RunNotFound):
        reg.resolve("nope")
    assert reg.set_status(a.id, "running") and reg.get(a.id).ended_at is None
    assert reg.set_status(a.id, "completed", "done") and reg.get(a.id).ended_at is not None
    assert not reg.set_status(a.id, "failed", only_if_active=True)
    assert [e["kind"] for e in reg.events(a.id)] == ["created", "running", "completed"]
    with pytest.raises(ValueError):
        reg.update(a.id, status="bogus")
    reg.delete(a.id)
    with pytest.raises(RunNotFound):
        reg.get(a.id)


@pytest.mark.parametrize("text, expect", [
    ("big: {type: slurm, gpus_per_node: eight}", "big.gpus_per_node: expected an integer"),
    ("big: {type: slurm, partiton: gpu}", "big.partiton: unknown key for a slurm cluster (did you mean 'partition'?)"),
    ("big: {type: kube}", "big.type: expected one of sagemaker, skypilot, slurm (or a backend's import path)"),
    ("big: {type: slurm, cpus_per_task: 0}", "big.cpus_per_task: must be >= 1"),
    ("sm: {type: sagemaker, instance_type: ml.p5.48xlarge}", "sm: a sagemaker cluster needs 'image_uri'"),
    ("a: [1, 2\n", "not valid YAML"),
    ("local: {type: slurm}", "the name 'local' is reserved"),
])
def test_bad_clusters_file_is_a_clear_error(tmp_path, text, expect):
    from llmforge.runs.cluster_types import ClusterError
    from llmforge.runs.clusters import load_clusters

    path = tmp_path / "clusters.yaml"
    path.write_text(text)
    with pytest.raises(ClusterError) as info:
        load_clusters(path, detect=False)
    assert str(path) in str(info.value) and expect in str(info.value), str(info.value)
    assert info.value.exit_code == 2


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMFORGE_HOME", str(tmp_path))
    return tmp_path


def test_bad_clusters_file_exits_2_without_traceback(home, capsys):
    (home / "clusters.yaml").write_text("big: {type: slurm, gpus_per_node: eight}")
    assert main(["clusters"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {home / 'clusters.yaml'}: big.gpus_per_node: expected an integer, got 'eight'\n"


def test_clusters_lists_gpu_type_and_count(home, capsys):
    (home / "clusters.yaml").write_text(
        "big: {type: slurm, partition: gpu, gpus_per_node: 8, gpu_type: h100}\n"
        "sky: {type: skypilot, cloud: aws, accelerator: A100-80GB, gpus_per_node: 4, spot: true}\n"
        "sm: {type: sagemaker, instance_type: ml.p5.48xlarge, image_uri: img, role: arn:role}\n")
    assert main(["clusters"]) == 0
    out = capsys.readouterr().out
    lines = {ln.split("│")[1].strip(): ln for ln in out.splitlines() if ln.count("│") > 3}
    assert set(lines) >= {"local", "big", "sky", "sm"}
    assert "h100" in lines["big"] and " 8 " in lines["big"]
    assert "A100-80GB" in lines["sky"] and " 4 " in lines["sky"]
    assert "H100" in lines["sm"] and " 8 " in lines["sm"]  # from the instance type
    assert "cpu" in lines["local"] and "partition=gpu" in lines["big"] and "aws spot" in lines["sky"]


def _cfg(*overrides):
    from llmforge.config import load_config

    return load_config(DEMO, list(overrides))


def test_compute_scales_one_yaml_from_one_cpu_process_to_128_gpus():
    from llmforge.runs.cluster_types import LocalCluster
    from llmforge.runs.compute import plan_compute
    from llmforge.runs.slurm import SlurmCluster

    cfg = _cfg("trainer.global_batch_size=256", "trainer.micro_batch_size=2")
    slurm = SlurmCluster(name="big", type="slurm", gpus_per_node=8, gpu_type="h100")
    local = LocalCluster(name="local", gpu_type="cpu")
    seen = {}
    for cluster, gpus in ((local, 1), (local, 2), (slurm, 8), (slurm, 16), (slurm, 128)):
        p = plan_compute(cfg, cluster, gpus)
        assert p.batch.global_batch_size == 256
        assert p.batch.gradient_accumulation_steps * p.batch.dp_size * 2 == 256
        seen[gpus] = (p.nodes, p.procs_per_node, p.batch.gradient_accumulation_steps)
    assert seen == {1: (1, 1, 128), 2: (1, 2, 64), 8: (1, 8, 16), 16: (2, 8, 8), 128: (16, 8, 1)}
    with pytest.raises(ConfigError, match=r"compute.gpus=12 does not fill whole nodes of 8 GPUs.*use 8 or 16"):
        plan_compute(cfg, slurm, 12)
    with pytest.raises(ConfigError, match=r"GPU counts that work on 'big': 1, 2, 3, 4, 6, 8, 16, 24, 32, 48"):
        plan_compute(_cfg("trainer.global_batch_size=96", "trainer.micro_batch_size=1"), slurm, 40)
    with pytest.raises(ConfigError, match="compute.nodes=2 needs a slurm, skypilot or sagemaker"):
        plan_compute(cfg, LocalCluster(name="local", gpus_per_node=2, gpu_type="x"), 4)


def test_launch_with_bad_gpu_count_says_which_work(home, capsys):
    assert main(["launch", DEMO, "--gpus", "3", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "compute.gpus=3 cannot divide the batch" in err and "work on 'local': 1, 2" in err


def test_secrets_lists_names_and_sources_never_values(home, capsys, monkeypatch):
    for k, v in {"WANDB_API_KEY": "wb-fake-VALUE-1", "HF_TOKEN": "hf_fake_VALUE_2", "AWS_PROFILE": "research",
                 "HOME": str(home)}.items():
        monkeypatch.setenv(k, v)
    assert main(["secrets"]) == 0
    out = capsys.readouterr().out
    for name in ("WANDB_API_KEY", "HF_TOKEN", "AWS_PROFILE"):
        assert name in out
    assert "VALUE" not in out and "research" not in out
    from llmforge.runs.credentials import job_environment, secret_overrides

    job = job_environment(["WANDB_API_KEY"], {"WANDB_API_KEY": "a", "HF_TOKEN": "b", "PATH": "/bin"})
    assert job == {"WANDB_API_KEY": "a", "PATH": "/bin"}
    assert secret_overrides(["loggers.0.api_key=x", "trainer.max_steps=3"]) == ["loggers.0.api_key"]
    assert main(["launch", DEMO, "--dry-run", "--secret", "NOT_SET_ANYWHERE"]) == 2
    assert "NOT_SET_ANYWHERE is not set" in capsys.readouterr().err


def test_supervisor_decisions_and_torchrun_exit_codes():
    from llmforge.job.supervisor import decide
    from llmforge.job.torchrun import exit_code

    assert decide(0, False, 0, 3) == "completed"
    assert decide(75, False, 0, 3) == "stopped"
    assert decide(-9, True, 0, 3) == "stopped"  # a requested stop never restarts
    assert decide(2, False, 0, 3) == "failed"  # configuration error: no retry
    assert decide(1, False, 0, 1) is None and decide(137, False, 1, 1) == "failed"
    f = lambda *codes: {i: SimpleNamespace(exitcode=c) for i, c in enumerate(codes)}  # noqa: E731
    assert exit_code(f(-15, 75)) == 75 and exit_code(f(1, 2)) == 2 and exit_code(f(-9)) == 137


def test_runs_commands_on_an_empty_or_unknown_run_exit_2(home, capsys):
    assert main(["runs", "list"]) == 0 and "no runs" in capsys.readouterr().out
    for cmd in (["describe", "x"], ["stop", "x"], ["logs", "x"], ["delete", "x"], ["restart", "x"]):
        assert main(["runs", *cmd]) == 2, cmd
        assert capsys.readouterr().err == "error: no run with id or name 'x' (see: llmforge runs list)\n", cmd
    reg = RunRegistry(home / "runs.db")
    done = reg.create("done", "local", "local")
    reg.set_status(done.id, "completed", "done")
    assert main(["runs", "stop", done.id]) == 2
    assert capsys.readouterr().err == f"error: run {done.id} is already completed; nothing to stop\n"
    assert main(["runs", "logs", done.id]) == 2 and "no log" in capsys.readouterr().err


def test_launch_doc_clusters_example_parses(tmp_path):
    """docs/launch.md's clusters.yaml example, as written."""
    from llmforge.runs.clusters import load_clusters

    text = (REPO / "docs" / "launch.md").read_text()
    block = text.split("**Clusters**", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "clusters.yaml").write_text(block)
    clusters = load_clusters(tmp_path / "clusters.yaml", detect=False)
    assert [c.type for c in clusters.values()] == ["local", "slurm", "skypilot", "sagemaker"]
    assert clusters["sm"].gpus_per_node == 8 and clusters["big"].gpu_type == "h100"


def test_delete_purge_asks_first_unless_yes(home, tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "runs" / "old"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "resumption-0.log").write_text("hello from the run\n")
    reg = RunRegistry(home / "runs.db")
    mine = tmp_path / "mine"  # a record (data) naming a folder llmforge did not make
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    other = reg.create("mine", "local", "local", run_dir=str(mine))
    reg.set_status(other.id, "completed", "done")
    assert main(["runs", "delete", other.id, "--purge", "--yes"]) == 2
    assert capsys.readouterr().err == (f"error: --purge: {mine} is a link or not an llmforge run directory (no "
                                       ".llmforge-run file); nothing deleted: delete the record without --purge\n")
    assert (mine / "notes.txt").read_text() == "keep" and [r.id for r in reg.list()] == [other.id]
    reg.delete(other.id)
    mark_run_dir(run_dir)  # as llmforge launch made it
    run = reg.create("old", "local", "local", run_dir=str(run_dir))
    reg.set_status(run.id, "completed", "done")
    assert main(["runs", "logs", "old"]) == 0 and capsys.readouterr().out == "hello from the run\n"
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    assert main(["runs", "delete", "old", "--purge"]) == 2
    assert "confirm with --yes" in capsys.readouterr().err and run_dir.exists()
    assert main(["runs", "delete", "old", "--purge", "--yes"]) == 0
    assert not run_dir.exists() and reg.list() == []
