"""The run resolved once (issue 13.15), before the heavy imports (18.2), with its threads (18.1)."""

import json
import subprocess
import sys

import pytest
from omegaconf.errors import ReadonlyConfigError

from conftest import REPO, TINY_OVERRIDES
from llmforge.cli import main
from llmforge.config import load_config
from llmforge.preflight.resolve import resolve_run
from llmforge.parallel.threads import TORCHRUN_SET_OMP, choose_num_threads

DEMO = str(REPO / "yamls" / "demo_cpu.yaml")


def test_resolved_once_into_a_frozen_copy(tmp_path):
    cfg = load_config(DEMO, [*TINY_OVERRIDES, f"run.output_dir={tmp_path}", "trainer.global_batch_size=64"])
    run = resolve_run(cfg, environ={"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})
    assert (run.world_size, run.local_world_size, run.strategy) == (4, 2, "fsdp2")
    assert (run.cfg.trainer.devices, run.cfg.trainer.num_nodes) == (2, 2)
    assert (run.plan.dp_size, run.plan.gradient_accumulation_steps) == (4, 2)  # 64 = 8 x 4 x 2
    assert (run.dims.dp_shard, run.dims.tp) == (4, 1)
    # the user's config is not touched; the resolved one cannot be changed
    assert (cfg.strategy.name, cfg.trainer.devices, cfg.trainer.num_nodes) == ("auto", 1, 1)
    with pytest.raises(ReadonlyConfigError):
        run.cfg.strategy.name = "ddp"
    one = resolve_run(cfg, environ={})
    assert (one.world_size, one.strategy, one.run_dir) == (1, "auto", tmp_path / cfg.run.name)


def test_allowed_values_are_listed_once():
    from importlib import import_module

    schema, validate, sft, tokenizers, schedule, trainer = (import_module(f"llmforge.{m}") for m in (
        "config.schema", "config.validate", "data.sft", "data.tokenizers", "training.schedule",
        "training.trainer"))

    assert schedule.SCHEDULES is schema.SCHEDULES and validate.SCHEDULES is schema.SCHEDULES
    assert tokenizers.TOKENIZER_TYPES is schema.TOKENIZER_TYPES
    assert sft.OVERLONG is schema.OVERLONG
    assert trainer.PRECISIONS is schema.PRECISIONS and validate.PRECISIONS is schema.PRECISIONS
    assert not hasattr(validate, "SCHEDULERS") and not hasattr(trainer, "PRECISION")


@pytest.mark.parametrize("override, needle", [
    ("checkpoint.save_every_minutes=-1", "checkpoint.save_every_minutes must be > 0"),
    ("checkpoint.save_every_minutes=0", "checkpoint.save_every_minutes must be > 0"),
    ("trainer.num_threads=0", "trainer.num_threads must be >= 1"),
])
def test_bad_values_exit_2(override, needle, capsys, tmp_path):
    assert main(["train", DEMO, override, f"run.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and "Traceback" not in err
    assert not (tmp_path / "demo_cpu").exists()  # nothing written


def test_config_errors_come_before_the_heavy_imports(tmp_path):
    """One fresh interpreter (no torch yet): each bad input exits 2 and torch, Lightning and
    datasets were never imported."""
    used = tmp_path / "runs" / "demo_cpu"
    used.mkdir(parents=True)
    # a run of a version before the mark: the config llmforge saved for it, beside its metrics
    (used / "config.yaml").write_text("run: {name: demo_cpu}\nmodel: {name: llama3}\ntrainer: {max_steps: 1}\n")
    (used / "metrics.jsonl").write_text('{"step": 1}\n')
    cases = [[DEMO, "trainer.max_stepz=3"],
             [DEMO, f"run.output_dir={tmp_path / 'runs'}"],
             [DEMO, "tokenizer.type=huggingface", f"tokenizer.path={tmp_path / 'nope.json'}"],
             [DEMO, "trainer.global_batch_size=10"],
             [DEMO, "model.preset=llama3_9b"],  # the families' light config checks (issue 49.4)
             [DEMO, "model.n_kv_heads=3"],
             [DEMO, "model.name=qwen3", "model.preset=qwen3_9b"]]
    code = ("import json, sys; from llmforge.cli import main\n"
            f"codes = [main(['train', *c]) for c in {cases!r}]\n"
            "print(json.dumps([codes, [m for m in ('torch', 'lightning', 'datasets') if m in sys.modules]]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"})
    codes, heavy = json.loads(proc.stdout.strip().splitlines()[-1])
    assert codes == [2] * 7 and heavy == [], proc.stderr
    errors = proc.stderr.strip().splitlines()
    assert "trainer.max_steps" in errors[0]
    assert "already holds a run" in errors[1] and str(used) in errors[1]
    assert "tokenizer.path" in errors[2] and "nope.json" in errors[2]
    assert "global_batch_size=10" in errors[3]
    assert errors[4].startswith("error: model.preset: unknown preset 'llama3_9b'. Valid presets: debug,")
    assert errors[5] == "error: model.n_heads (8) must be divisible by model.n_kv_heads (3)"
    assert errors[6].startswith("error: model.preset: unknown qwen3 preset 'qwen3_9b'")
    assert (used / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.parametrize("override, procs, workers, cores, busy, want", [
    (None, 1, 0, 2, 0.0, 2),    # the demo on 2 idle cores: its worker slices windows in memory
    (None, 1, 0, 2, 1.0, 1),    # beside one CPU-burning process
    (None, 1, 0, 2, 9.0, 1),    # a shared machine at load 9: never 0
    (None, 1, 1, 2, 0.0, 1),    # a streaming source's worker tokenizes: it takes a core
    (None, 1, 0, 2, None, 2),   # no count (taskset/SLURM: machine-wide counts do not apply)
    (None, 2, 1, 8, 1.0, 3),    # --nproc 2 on 8 cores: 4 each, less the worker; the sibling is not busy
    (None, 2, 0, 8, 5.0, 2),    # ... 4 other tasks leave 4 cores: 2 each
    (None, 1, 0, 64, 10.0, 54),
    (None, 4, 1, 2, 0.0, 1),    # never 0
    (3, 1, 1, 2, 9.0, 3),       # trainer.num_threads wins
])
def test_threads_per_process(override, procs, workers, cores, busy, want):
    n, why = choose_num_threads(override, procs, workers, cores=cores, environ={}, busy=busy)
    assert n == want
    assert f"{cores} cores" in why
    if override is None and busy and want < cores // procs - workers:
        assert "of other processes" in why
    # an explicit OMP_NUM_THREADS is a choice too; trainer.num_threads still wins over it
    omp = {"OMP_NUM_THREADS": "5"}
    assert choose_num_threads(override, procs, workers, cores=cores, environ=omp, busy=busy)[0] == (override or 5)
    # torchrun's own default (1, noted by llmforge's launcher) is not a choice: the cores decide
    torchrun = {"OMP_NUM_THREADS": "1", TORCHRUN_SET_OMP: "1"}
    assert choose_num_threads(override, procs, workers, cores=cores, environ=torchrun, busy=busy)[0] == want


def test_busy_cores_reads_the_machine():
    """One real read: a count of other tasks, never negative (this process is not counted)."""
    from llmforge.parallel.threads import busy_cores

    busy = busy_cores(samples=3, interval=0.0)
    assert busy is None or busy >= 0


@pytest.mark.parametrize("overrides, want", [
    ([], 0),                                             # the demo: windows tokenized up front
    (["data.num_workers=2", "data.source=prepared"], 0),  # memory-mapped shards
    (["data.num_workers=2", "data.streaming=true"], 2),   # workers tokenize
    (["data.num_workers=1", "data.mixture=[{path: a, weight: 1, source: files}]"], 1),
])
def test_data_workers_that_cost_a_core(overrides, want):
    from llmforge.preflight.resolve import worker_cores

    assert worker_cores(load_config(DEMO, overrides).data) == want


def test_launched_workers_choose_their_threads(tmp_path):
    """Real torchrun workers under llmforge's torchrun: torchrun's OMP_NUM_THREADS=1 is noted,
    so each worker chooses from its cores; a user's own OMP_NUM_THREADS still wins."""
    import os

    script = tmp_path / "worker.py"
    script.write_text("import os\nfrom llmforge.parallel.threads import choose_num_threads\n"
                      "n, _ = choose_num_threads(None, 2, 0, cores=8, busy=None)\n"
                      "open(os.path.join(os.environ['OUT'], os.environ['RANK']), 'w').write(str(n))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", TORCHRUN_SET_OMP)}
    for extra, want in (({}, "4"), ({"OMP_NUM_THREADS": "3"}, "3")):
        out = tmp_path / f"out{len(extra)}"
        out.mkdir()
        subprocess.run([sys.executable, "-m", "llmforge.job.torchrun", "--standalone",
                        "--nproc-per-node", "2", str(script)], check=True, timeout=120,
                       env={**env, **extra, "OUT": str(out), "PYTHONPATH": str(REPO / "src")},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert sorted(p.read_text() for p in out.iterdir()) == [want, want]


def test_trainer_applies_and_logs_threads(tmp_path, capsys):
    import torch

    from llmforge import Trainer

    before = torch.get_num_threads()
    cfg = load_config(DEMO, [*TINY_OVERRIDES, f"run.output_dir={tmp_path}", "trainer.num_threads=1"])
    trainer = Trainer(cfg)
    try:
        trainer.apply_threads()
        trainer.announce()
        assert torch.get_num_threads() == 1 == trainer.run.num_threads
    finally:
        torch.set_num_threads(before)
    assert "threads: 1 compute thread per process (trainer.num_threads=1" in capsys.readouterr().err


def test_one_meta_model_per_run(tmp_path, capsys, monkeypatch):
    """Issue 22.4: the dry run of a 2-process tp=2 run with ``ema`` builds the model on the meta
    device once: the strategy check (tp heads), the algorithms' dry-run lines and the report
    read the run's shared :func:`llmforge.plugin.meta_model`; a transform builds its own."""
    from collections import OrderedDict

    import llmforge.plugin as plugin

    builds = []
    real = plugin.build_meta_model
    monkeypatch.setattr(plugin, "build_meta_model", lambda cfg: builds.append(1) or real(cfg))
    monkeypatch.setattr(plugin, "_SHARED", OrderedDict())  # no model left by an earlier test
    assert main(["train", DEMO, *TINY_OVERRIDES, f"run.output_dir={tmp_path}", "trainer.devices=2",
                 "strategy.name=fsdp2", "strategy.tp=2", "algorithms=[{name: ema}]", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "tp 2" in out and "ema" in out
    assert len(builds) == 1
    cfg = load_config(DEMO, TINY_OVERRIDES)
    assert plugin.meta_model(cfg) is plugin.meta_model(cfg)  # shared, read-only
    assert plugin.build_meta_model(cfg) is not plugin.meta_model(cfg)  # new, to transform
    cfg.model.n_layers = 1
    assert len(plugin.meta_model(cfg).layers) == 1  # another model config, another model
    longer = load_config(DEMO, [*TINY_OVERRIDES, "variables.seq_len=128"])  # an interpolated key
    assert plugin.meta_model(longer).max_seq_len == 128


def test_nproc_prints_a_preflight_warning_once(tmp_path, monkeypatch, capsys):
    """`--nproc 2` (issue 49.4): the launcher prints the warm-up warning; its workers, which
    resolve the same config again in fresh processes (here: their pre-flight, with the
    environment the launcher gives them), do not repeat it."""
    import os

    import llmforge.job.nproc as nproc

    validate_module = sys.modules["llmforge.config.validate"]  # the package exports the function

    def workers(n, argv):  # each worker: a fresh process that resolves the run at its start
        for rank in range(n):
            monkeypatch.setattr(validate_module, "_WARNED", set())
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n)}
            monkeypatch.setattr(os, "environ", env)
            resolve_run(load_config(argv[1], [a for a in argv[2:] if not a.startswith("--")]),
                        check_dir=False)
        return 0

    monkeypatch.setattr(nproc, "launch_local", workers)
    assert main(["train", DEMO, *TINY_OVERRIDES, f"run.output_dir={tmp_path}", "trainer.max_steps=5",
                 "scheduler.warmup_steps=50", "--nproc", "2"]) == 0
    warnings = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning:")]
    assert warnings == ["warning: scheduler.warmup_steps (50) > trainer.max_steps (5): the learning "
                        "rate only warms up and never reaches optimizer.lr; for a whole schedule "
                        "warm up for about a tenth of the steps: scheduler.warmup_steps=1"]
