"""Start-up costs: ``llmforge --help``, a config error, ``--dry-run`` and the first step.

    python benchmarks/startup.py            # 5 runs of --help / a config error, 2 dry runs,
                                            # 2 runs of the demo's first step
    python benchmarks/startup.py --smoke

Targets: ``--help`` and a config error (a typo'd key) under 0.5 s: the config is loaded and
checked before torch, Lightning and datasets are imported; an unknown ``model.preset`` or an
impossible model shape (``n_kv_heads`` not dividing ``n_heads``) under 1 s, checked as early; ``--dry-run`` output in a few
seconds (it builds the model on the meta device, so it imports torch); the first optimizer
step of ``llmforge train yamls/demo_cpu.yaml`` under 10 s, the one-time corpus download
excluded (a warm-up run fills the cache first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO / "src")}


def time_help() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "llmforge", "--help"], capture_output=True, env=ENV, check=True)
    return time.perf_counter() - start


def time_command(*args: str, expect: int) -> float:
    """Seconds until ``llmforge ARGS`` exits (with exit code ``expect``)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "llmforge", *args], capture_output=True, env=ENV, text=True)
    if proc.returncode != expect:
        raise RuntimeError(f"llmforge {' '.join(args)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return time.perf_counter() - start


def time_first_step(work: Path, name: str, extra: list[str]) -> float:
    """Seconds from process start to the first record of step 1 in metrics.jsonl."""
    metrics = work / name / "metrics.jsonl"
    cmd = [sys.executable, "-m", "llmforge", "train", str(REPO / "yamls" / "demo_cpu.yaml"),
           f"run.output_dir={work}", f"run.name={name}", "trainer.max_steps=2",
           "scheduler.warmup_steps=1", "trainer.progress_bar=false", *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV, text=True)
    try:
        while proc.poll() is None:
            if metrics.exists() and any(json.loads(x).get("step") == 1
                                        for x in metrics.read_text().splitlines() if x.strip()):
                return time.perf_counter() - start
            time.sleep(0.02)
        raise RuntimeError(f"training ended before step 1: {proc.stderr.read()[-2000:]}")
    finally:
        proc.kill()
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    extra = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
             "model.multiple_of=32", "tokenizer.vocab_size=1024", "variables.seq_len=64"] if args.smoke else []
    helps = [time_help() for _ in range(1 if args.smoke else 5)]
    demo = str(REPO / "yamls" / "demo_cpu.yaml")
    errors = [time_command("train", demo, "trainer.max_stepz=3", expect=2)
              for _ in range(1 if args.smoke else 5)]
    # an unknown preset and an impossible shape: the families' light config.py checks them
    # before torch too (issue 49.4; they came after torch, 15-27 s on a busy machine)
    presets = [time_command("train", demo, "model.preset=llama3_9b", expect=2)
               for _ in range(1 if args.smoke else 5)]
    shapes = [time_command("train", demo, "model.n_kv_heads=3", expect=2)
              for _ in range(1 if args.smoke else 5)]
    dries = [time_command("train", demo, "--dry-run", expect=0) for _ in range(1 if args.smoke else 2)]
    with tempfile.TemporaryDirectory() as tmp:
        if not args.smoke:  # the smoke run only proves the script runs
            time_first_step(Path(tmp), "warm", extra)  # fills the corpus and tokenizer caches
        firsts = [time_first_step(Path(tmp), f"r{i}", extra) for i in range(1 if args.smoke else 2)]
    print(f"llmforge --help          median {statistics.median(helps):.3f} s   (target < 0.5 s)")
    print(f"config error (typo)      median {statistics.median(errors):.3f} s   (target < 0.5 s)")
    print(f"model.preset error       median {statistics.median(presets):.3f} s   (target < 1 s)")
    print(f"model shape error        median {statistics.median(shapes):.3f} s   (target < 1 s)")
    print(f"--dry-run output         median {statistics.median(dries):.2f} s")
    print(f"first optimizer step     median {statistics.median(firsts):.2f} s   (target < 10 s, caches warm)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
