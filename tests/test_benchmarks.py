"""Keep the benchmark scripts runnable (tiny CPU smoke runs), not their timings."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO


def run_script(*args, timeout=600):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO / "src")})


def test_gpu_check_smoke_on_cpu(tmp_path):
    proc = run_script("benchmarks/gpu_check.py", "--smoke", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = (tmp_path / "gpu_check-smoke.md").read_text()
    assert "fsdp2_bf16" in report and "tokens_per_second" in report


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_check_full(tmp_path):
    proc = run_script("benchmarks/gpu_check.py", "--out", str(tmp_path), timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:]


def test_checkpoint_save_smoke():
    proc = run_script("benchmarks/checkpoint_save.py", "--smoke")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "async" in proc.stdout and "ratio async/sync" in proc.stdout


@pytest.mark.parametrize("script", ["overhead.py", "data.py", "startup.py", "threads.py", "generate.py",
                                    "model_speed.py", "moe.py"])
def test_cpu_benchmark_smoke(script):
    proc = run_script(f"benchmarks/{script}", "--smoke")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "tokens/s" in proc.stdout or " s " in proc.stdout


def test_overhead_paired_steps_smoke():
    proc = run_script("benchmarks/overhead.py", "--smoke", "--paired-steps")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "paired steps after 1 warm-up" in proc.stdout and "per-step ratio" in proc.stdout


def test_compile_cpu_smoke(tmp_path):
    proc = run_script("benchmarks/compile_cpu.py", "--smoke", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    table = (tmp_path / "compile_cpu-smoke.md").read_text()
    for variant in ("| eager |", "| compile per block |", "| compile whole model |"):
        assert variant in table
    assert "| float8 + full AC + compile | " in table and "failed" not in table  # issue 50


def test_peers_block_runs_or_names_litgpt(capsys):
    """peers_block.py (one block against LitGPT's, in this process): without LitGPT (CI) it
    exits 2 naming the package; with it, two eager rounds print both sides and the ratio."""
    spec = importlib.util.spec_from_file_location("peers_block", REPO / "benchmarks" / "peers_block.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--rounds", "0"]) == 2
    assert "--rounds and --warmup must be >= 1" in capsys.readouterr().err
    code = module.main(["--eager", "--rounds", "2", "--warmup", "1", "--batch", "1", "--seq-len", "16"])
    out, err = capsys.readouterr()
    if importlib.util.find_spec("litgpt") is None:
        assert code == 2 and "LitGPT is needed" in err and "pip install litgpt" in err
    else:
        assert code == 0 and "llmforge speed / LitGPT: median" in out, out + err


@pytest.mark.parametrize("mode", ["one after another", "side by side", "alternating"])
def test_peers_smoke(mode):
    """peers.py runs the peers installed here (plain Lightning always; LitGPT and torchtitan only
    where their packages are, never in CI) and says which it skipped; ``--side-by-side`` runs
    each beside an llmforge run, one core each; ``--alternate`` runs both at once, their timed
    steps taking turns (each run checks that it timed every step in its own turn)."""
    if mode == "side by side" and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--side-by-side needs two cores; this process may use one")
    flag = {"side by side": ["--side-by-side"], "alternating": ["--alternate"]}.get(mode, [])
    proc = run_script("benchmarks/peers.py", "--smoke", *flag)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "ratio llmforge/lightning (eager)" in proc.stdout
    assert ("llmforge beside it" in proc.stdout) == (mode == "side by side"), proc.stdout
    assert ("after each llmforge step, llmforge alternating" in proc.stdout) == (mode == "alternating")
    for package in ("litgpt", "torchtitan"):
        if importlib.util.find_spec(package) is None:
            assert f"{package}: skipped: {package} not installed" in proc.stdout
        else:
            assert f"ratio llmforge/{package} (eager)" in proc.stdout or \
                f"{package} (eager): cannot run:" in proc.stdout


def test_side_by_side_barrier(tmp_path, monkeypatch):
    """A run waits after its warm-up until the run beside it has marked its own (or the parent
    has marked it ended); without ``$PEERS_BARRIER`` it does not wait."""
    import time

    sys.path.insert(0, str(REPO / "benchmarks"))
    from overhead import side_by_side_barrier

    t0 = time.monotonic()
    side_by_side_barrier(timeout_s=5)  # no $PEERS_BARRIER: returns at once
    monkeypatch.setenv("PEERS_BARRIER", str(tmp_path))
    side_by_side_barrier(timeout_s=0.2)  # alone: waits until its timeout
    waited = time.monotonic() - t0
    assert 0.2 <= waited < 10 and [p.name for p in tmp_path.iterdir()] == [f"ready-{os.getpid()}"]
    (tmp_path / "ended-1").touch()  # the other run ended (or marked itself ready)
    t0 = time.monotonic()
    side_by_side_barrier(timeout_s=5)
    assert time.monotonic() - t0 < 4  # not the timeout (bounds wide: a loaded machine stalls)


def test_turns_hand_over_wait_and_time_out(tmp_path, monkeypatch):
    """``peers.py --alternate``'s turns: role 1 waits for role 0's byte (and gives up after its
    timeout instead of hanging), times only its own step (not the wait, not the settling
    sleep), hands the turn over, and checks the count of its timed turns."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from overhead import Turns

    for role in (0, 1):
        os.mkfifo(tmp_path / f"turn-{role}")
    monkeypatch.setenv("PEERS_TURNS", str(tmp_path))
    monkeypatch.setenv("PEERS_TURN_ROLE", "1")
    turns = Turns(timeout_s=0.2)
    with pytest.raises(TimeoutError, match="no turn"):
        turns.begin()  # nobody gave role 1 the turn
    mine, other = (os.open(tmp_path / f"turn-{r}", os.O_RDWR | os.O_NONBLOCK) for r in (1, 0))
    os.write(mine, b"t")  # role 0 ended its step
    turns.begin()
    turns.step_end(last=True)  # role 1's last step: hands over, waits for nothing
    assert os.read(other, 8) == b"t"
    assert 0 <= turns.timed(1) < Turns.SETTLE_S
    with pytest.raises(RuntimeError, match="expected 2 timed turns, counted 1"):
        turns.timed(2)
    for fd in (mine, other):
        os.close(fd)


def test_chunked_ce_memory_smoke():
    proc = run_script("benchmarks/chunked_ce_memory.py", "--smoke")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "ratio chunked/plain step peak" in proc.stdout
    losses = {line.split()[0]: line.split("loss ")[1] for line in proc.stdout.splitlines() if "loss " in line}
    assert abs(float(losses["plain"]) - float(losses["chunked"])) < 1e-4
