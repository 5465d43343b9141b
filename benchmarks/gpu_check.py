"""GPU-only checks and timings in one call, for a lent accelerator (one H200 here).

    python benchmarks/gpu_check.py            # on the GPU machine: every section, ~5 minutes
    python benchmarks/gpu_check.py --smoke    # anywhere: tiny shapes on the CPU (keeps it runnable)

Sections (each isolated: a failure is reported and the next one runs):

1. ``fsdp2_bf16``: ``llmforge`` training with ``strategy.name=fsdp2`` on one device, FSDP2
   mixed precision (bf16 parameters, fp32 reduction), Llama 3 8B layer shapes (dim 4096,
   32 heads, 8 KV heads, FFN 14336, vocab 128256) with a few layers, seq 8192 (smoke: tiny):
   tokens/s, TFLOP/s per device, MFU against the device's dense bf16 peak, peak memory.

The data is generated text written to a temporary file (the machine has no network). Results go
to ``benchmarks/results/gpu_check-<date>.md`` with GPU name, driver, torch version.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

H200_BF16_DENSE_TFLOPS = 989.0  # NVIDIA H200 SXM datasheet, dense BF16 (1979 with sparsity)


def write_corpus(path: Path, n_words: int = 3_000_000) -> None:
    rng = random.Random(0)
    words = [w for w in (REPO / "README.md").read_text().split() if w.isalpha()] or ["lorem"]
    with open(path, "w") as f:
        for i in range(0, n_words, 1000):
            f.write(" ".join(rng.choice(words) for _ in range(1000)) + "\n\n")


def section_fsdp2_bf16(smoke: bool, work: Path) -> dict:
    import torch

    from llmforge import Trainer, load_config

    corpus = work / "corpus.txt"
    write_corpus(corpus, 200_000 if smoke else 3_000_000)
    shape = (["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
              "model.multiple_of=32", "variables.seq_len=64", "trainer.max_steps=4"] if smoke else
             ["model.preset=llama3_8b", "model.n_layers=2", "variables.seq_len=8192",
              "model.max_seq_len=8192", "trainer.max_steps=12"])
    overrides = [*shape, "data.source=files", f"data.path={corpus}", "tokenizer.vocab_size=1024",
                 "model.vocab_size=null" if not smoke else "model.vocab_size=1024",
                 "data.val_fraction=0", "trainer.global_batch_size=1", "trainer.micro_batch_size=1",
                 "trainer.eval_every=0", "trainer.log_every=4", "trainer.progress_bar=false",
                 "strategy.name=fsdp2", "strategy.mixed_precision.param_dtype=bfloat16",
                 "strategy.mixed_precision.reduce_dtype=float32", "scheduler.warmup_steps=1",
                 f"run.output_dir={work}", "run.name=fsdp2_bf16", "data.num_workers=0",
                 "checkpoint.save_final=false"]
    cfg = load_config(REPO / "yamls" / "demo_cpu.yaml", overrides)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg)
    summary = trainer.fit()
    last = [r for r in trainer.module.history if "throughput/tokens_per_second" in r][-1]
    tflops = last.get("throughput/tflops_per_device", float("nan"))
    out = {"tokens_per_second": last["throughput/tokens_per_second"], "tflops_per_device": tflops,
           "final_loss": summary["final_train_loss"]}
    if torch.cuda.is_available():
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 1024**3
        out["mfu_vs_h200_bf16"] = tflops / H200_BF16_DENSE_TFLOPS
    return out


def machine() -> dict:
    import torch

    info = {"torch": torch.__version__, "date": dt.date.today().isoformat()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                             "--format=csv,noheader"], capture_output=True,
                                            text=True).stdout.strip()
        except OSError:
            info["driver"] = "unknown"
    else:
        info["gpu"] = "none (CPU)"
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args()
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    import datasets

    datasets.disable_progress_bars()
    results: dict = {"machine": machine()}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in [("fsdp2_bf16", section_fsdp2_bf16)]:
            start = time.perf_counter()
            try:
                results[name] = fn(args.smoke, Path(tmp))
            except Exception as exc:  # report and go on: one device call must say everything
                results[name] = {"error": f"{type(exc).__name__}: {exc}",
                                 "traceback": traceback.format_exc()[-2000:]}
            results[name]["seconds"] = round(time.perf_counter() - start, 1)
            print(name, json.dumps(results[name], default=str), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = "smoke" if args.smoke else results["machine"]["date"]
    lines = [f"# gpu_check {stamp}", "", f"machine: `{json.dumps(results['machine'])}`", "",
             "| section | result |", "| --- | --- |"]
    for k, v in results.items():
        if k != "machine":
            lines.append(f"| {k} | `{json.dumps({x: y for x, y in v.items() if x != 'traceback'}, default=str)}` |")
    (out / f"gpu_check-{stamp}.md").write_text("\n".join(lines) + "\n")
    return 0 if all("error" not in v for k, v in results.items() if k != "machine") else 1


if __name__ == "__main__":
    sys.exit(main())
