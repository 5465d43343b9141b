"""Peak memory of one training step with and without ``chunked_cross_entropy`` (CPU RSS).

Method: each variant runs in its own fresh process (so one's high-water mark never hides the
other's): build a small Llama with a large vocabulary, run one warm-up step, read the resident
set size (``VmRSS`` of ``/proc/self/status``), reset the high-water mark (``echo 5 >
/proc/self/clear_refs``), run one forward + backward + AdamW step, read the high-water mark
(``VmHWM``). The step's peak is ``VmHWM - VmRSS``; the script prints both variants and the ratio
side by side. The plain step holds the full ``[b, T, V]`` float32 logits and their gradient;
the chunked one a chunk of them.

    python benchmarks/chunked_ce_memory.py                 # vocab 128,256, seq 2048
    python benchmarks/chunked_ce_memory.py --smoke         # tiny, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _status(key: str) -> int:
    """A ``/proc/self/status`` field, in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def worker(args: argparse.Namespace) -> None:
    import torch
    from omegaconf import OmegaConf

    from llmforge.algorithms.chunked_cross_entropy import ChunkedCrossEntropy
    from llmforge.config.schema import TrainConfig
    from llmforge.config.validate import plan_batch
    from llmforge.training.module import LLMModule

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    cfg = OmegaConf.structured(TrainConfig)
    cfg.model.merge_with({"dim": args.dim, "n_layers": 1, "n_heads": 4, "n_kv_heads": 4,
                          "vocab_size": args.vocab, "multiple_of": 64, "max_seq_len": args.seq})
    cfg.trainer.merge_with({"micro_batch_size": 1, "global_batch_size": 1, "seq_len": args.seq})
    pipeline = []
    algo = None
    if args.variant == "chunked":
        algo = ChunkedCrossEntropy(chunk_size=args.chunk)
        pipeline = [algo.transform()]
    module = LLMModule(cfg, plan_batch(cfg, 1), pipeline=pipeline)
    module.configure_model()
    if algo is not None:
        module.setup_events([algo])
        algo.fit_start(module.state)
    opt = torch.optim.AdamW(module.model.parameters(), lr=1e-4)
    batch = torch.randint(0, args.vocab, (1, args.seq + 1), generator=torch.Generator().manual_seed(0))

    def step() -> float:
        loss, n = module.forward_backward(batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss / n)

    step()  # warm-up: optimizer state and allocator caches exist before the measurement
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5\n")  # reset VmHWM to the current RSS
    loss = step()
    peak = _status("VmHWM")
    print(json.dumps({"variant": args.variant, "before": before, "peak": peak, "loss": loss}))


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--vocab", str(args.vocab), "--seq",
           str(args.seq), "--dim", str(args.dim), "--chunk", str(args.chunk)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for the test suite")
    p.add_argument("--worker", choices=["plain", "chunked"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.vocab, args.seq, args.dim, args.chunk = 4096, 128, 64, 32
    if args.worker:
        args.variant = args.worker
        worker(args)
        return
    rows = {v: run_variant(v, args) for v in ("plain", "chunked")}
    logits_gib = args.seq * args.vocab * 4 / 2**30
    print(f"one training step, vocab {args.vocab:,}, seq {args.seq}, dim {args.dim}, chunk {args.chunk} "
          f"(fp32 logits of the micro-batch: {logits_gib:.2f} GiB)")
    for v, r in rows.items():
        print(f"{v:8s} step peak {(r['peak'] - r['before']) / 2**20:9.1f} MiB above "
              f"{r['before'] / 2**20:8.1f} MiB resident; loss {r['loss']:.6f}")
    plain = rows["plain"]["peak"] - rows["plain"]["before"]
    chunked = rows["chunked"]["peak"] - rows["chunked"]["before"]
    print(f"ratio chunked/plain step peak: {chunked / max(plain, 1):.3f}")
    print(f"ratio chunked/plain process peak: {rows['chunked']['peak'] / rows['plain']['peak']:.3f}")


if __name__ == "__main__":
    main()
