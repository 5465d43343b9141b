"""GPU-only checks and timings in one call, for a lent accelerator (one H200 here).

    python benchmarks/gpu_check.py            # on the GPU machine: every section, ~5 minutes
    python benchmarks/gpu_check.py --smoke    # anywhere: tiny shapes on the CPU (keeps it runnable)

Sections (each isolated: a failure is reported and the next one runs):

1. ``fsdp2_bf16``: ``llmforge`` training with ``strategy.name=fsdp2`` on one device, FSDP2
   mixed precision (bf16 parameters, fp32 reduction), Llama 3 8B layer shapes (dim 4096,
   32 heads, 8 KV heads, FFN 14336, vocab 128256) with a few layers, seq 8192 (smoke: tiny):
   tokens/s, TFLOP/s per device, MFU against the device's dense bf16 peak, peak memory.
2. ``fsdp2_bf16_compile``: the same with the ``compile`` algorithm (per block).
3. ``fsdp2_bf16_compile_float8``: the same with ``compile`` and ``float8`` (tensorwise).
4. ``fsdp2_fp8_all_gather``: with several GPUs only (FSDP2 must shard): ``--nproc N`` with
   FP8 all-gather; per-device tokens/s. Skipped on one GPU.
5. ``ratios``: tokens/s per device of 2-4 over 1, printed beside the seed's +38 % for
   compile + float8 at 8B shapes. Smoke mode compiles with the ``aot_eager`` backend (no
   inductor codegen on the CPU, to stay quick).

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


def section_fsdp2_bf16(smoke: bool, work: Path, algorithms: str = "", name: str = "fsdp2_bf16") -> dict:
    import torch

    from llmforge import Trainer, load_config

    cfg = load_config(REPO / "yamls" / "demo_cpu.yaml", train_overrides(smoke, work, name, algorithms))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    torch._dynamo.reset()  # each section compiles its own graphs
    trainer = Trainer(cfg)
    summary = trainer.fit()
    last = [r for r in trainer.module.history if "throughput/tokens_per_second" in r][-1]
    tflops = last.get("throughput/tflops_per_device", float("nan"))
    out = {"tokens_per_second": last["throughput/tokens_per_second"], "tflops_per_device": tflops,
           "final_loss": summary["final_train_loss"]}
    compiled = [r["time/compile_seconds"] for r in trainer.module.history if "time/compile_seconds" in r]
    if compiled:
        out["compile_seconds"] = compiled[0]
    if torch.cuda.is_available():
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 1024**3
        out["mfu_vs_h200_bf16"] = tflops / H200_BF16_DENSE_TFLOPS
    return out


def train_overrides(smoke: bool, work: Path, name: str, algorithms: str = "") -> list[str]:
    """Overrides of demo_cpu.yaml for the timed runs: 8B layer shapes (smoke: tiny), bf16 FSDP2."""
    corpus = work / "corpus.txt"
    if not corpus.exists():
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
                 f"run.output_dir={work}", f"run.name={name}", "data.num_workers=0",
                 "checkpoint.save_final=false"]
    return overrides + ([f"algorithms={algorithms}"] if algorithms else [])


SEED_CLAIM = 0.38  # the seed's expected tokens/s gain of compile + float8 over bf16 at 8B shapes


def _compile(smoke: bool) -> str:
    # smoke (CPU): dynamo + AOTAutograd only; inductor's C++ codegen would take minutes
    return "{name: compile, backend: aot_eager}" if smoke else "{name: compile}"


def section_compile(smoke: bool, work: Path) -> dict:
    return section_fsdp2_bf16(smoke, work, f"[{_compile(smoke)}]", "fsdp2_bf16_compile")


def section_compile_float8(smoke: bool, work: Path) -> dict:
    algos = f"[{_compile(smoke)}, {{name: float8, recipe: tensorwise}}]"
    return section_fsdp2_bf16(smoke, work, algos, "fsdp2_bf16_compile_float8")


def section_fp8_all_gather(smoke: bool, work: Path) -> dict:
    """compile + float8 with FP8 all-gather on every GPU (``--nproc N``); needs N >= 2."""
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        return {"skipped": f"FP8 all-gather needs FSDP2 over >= 2 GPUs ({n} here)"}
    algos = (f"[{_compile(smoke)}, {{name: float8, recipe: tensorwise, "
             "enable_fsdp_float8_all_gather: true}]")
    name = "fsdp2_fp8_all_gather"
    over = train_overrides(smoke, work, name, algos) + [f"trainer.global_batch_size={n}"]
    proc = subprocess.run([sys.executable, "-m", "llmforge", "train", str(REPO / "yamls" / "demo_cpu.yaml"),
                           *over, "--nproc", str(n)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-1500:])
    recs = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in recs if "throughput/tokens_per_second_per_device" in r][-1]
    return {"tokens_per_second": last["throughput/tokens_per_second_per_device"], "gpus": n,
            "tflops_per_device": last.get("throughput/tflops_per_device")}


def ratios(results: dict) -> dict:
    """tokens/s (per device) of each section over ``fsdp2_bf16``; the seed's claim beside."""
    base = results.get("fsdp2_bf16", {}).get("tokens_per_second")
    out: dict = {}
    for name in ("fsdp2_bf16_compile", "fsdp2_bf16_compile_float8", "fsdp2_fp8_all_gather"):
        tps = results.get(name, {}).get("tokens_per_second")
        if base and tps:
            out[name] = round(tps / base, 3)
    out["seed_claim_compile_float8"] = round(1 + SEED_CLAIM, 2)
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
        for name, fn in [("fsdp2_bf16", section_fsdp2_bf16), ("fsdp2_bf16_compile", section_compile),
                         ("fsdp2_bf16_compile_float8", section_compile_float8),
                         ("fsdp2_fp8_all_gather", section_fp8_all_gather)]:
            start = time.perf_counter()
            try:
                results[name] = fn(args.smoke, Path(tmp))
            except Exception as exc:  # report and go on: one device call must say everything
                results[name] = {"error": f"{type(exc).__name__}: {exc}",
                                 "traceback": traceback.format_exc()[-2000:]}
            results[name]["seconds"] = round(time.perf_counter() - start, 1)
            print(name, json.dumps(results[name], default=str), flush=True)
    results["ratios"] = ratios(results)
    r = results["ratios"]
    print("tokens/s per device vs fsdp2_bf16: " + " | ".join(
        f"{k.replace('fsdp2_bf16_', '+').replace('fsdp2_', '+')} {v:.2f}x"
        + (f" (seed: +{SEED_CLAIM:.0%} = {1 + SEED_CLAIM:.2f}x)" if k.endswith("compile_float8") else "")
        for k, v in r.items() if k != "seed_claim_compile_float8"), flush=True)
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
