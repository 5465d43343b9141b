"""The model code of this tree against an older revision's: same config, same seed, same
random batch, side by side (issue 15: "the Llama path is unchanged").

    python benchmarks/model_speed.py                       # demo Llama vs f8c7c2b (before models/llama3/)
    python benchmarks/model_speed.py --base REV --model qwen3_debug_cpu
    python benchmarks/model_speed.py --smoke               # tiny, HEAD against itself

Each run is a fresh subprocess that imports llmforge from one tree (the older one from a
temporary ``git worktree``), builds ``model.name`` through the registry with ``run.seed``,
initializes it and trains ``--steps`` optimizer steps (forward, cross-entropy, backward, AdamW)
on one fixed random batch of ``[micro_batch_size, seq_len + 1]`` tokens, after ``--warmup``
steps. Runs alternate old new old new ...; prints the median ms per step of each, the ratio
old/new (> 1: this tree is faster) with its spread over the pairs, and the loss of the first
step of each (equal when the model code computes the same function from the same init).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE = "f8c7c2b"  # the last commit before the model families moved into models/<family>/
SMOKE = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.multiple_of=32", "model.vocab_size=512", "variables.seq_len=64"]


def worker(overrides: list[str], steps: int, warmup: int) -> dict:
    """Time ``steps`` optimizer steps of the model this process's ``llmforge`` builds."""
    import torch
    import torch.nn.functional as F

    from llmforge import registry
    from llmforge.config import load_config

    cfg = load_config(Path.cwd() / "yamls" / "demo_cpu.yaml", overrides)  # the tree's own demo
    torch.manual_seed(cfg.run.seed)
    model = registry.models.get(cfg.model.name)(cfg.model)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, int(cfg.model.vocab_size), (int(cfg.trainer.micro_batch_size),
                                                         int(cfg.trainer.seq_len) + 1), generator=gen)
    inputs, labels = batch[:, :-1], batch[:, 1:]
    first, times = None, []
    for step in range(warmup + steps):
        start = time.perf_counter()
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - start)
        first = loss.item() if first is None else first
    return {"ms_per_step": 1000 * statistics.median(times), "first_loss": first,
            "tokens": inputs.numel()}


def run(tree: Path, overrides: list[str], steps: int, warmup: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker",
                           "--steps", str(steps), "--warmup", str(warmup), "--", *overrides],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"worker in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=BASE, help="the older revision (default: %(default)s)")
    ap.add_argument("--model", default=None, help="model.name (default: the demo's)")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="tiny model, HEAD against itself, 1 pair")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if min(args.pairs, args.steps) < 1 or args.warmup < 0:
        ap.error("--pairs and --steps must be >= 1, --warmup >= 0")
    overrides = list(args.overrides) + ([f"model.name={args.model}"] if args.model else [])
    if args.worker:
        print(json.dumps(worker(overrides, args.steps, args.warmup)))
        return
    base = "HEAD" if args.smoke else args.base
    if args.smoke:
        overrides, args.pairs, args.steps, args.warmup = SMOKE + overrides, 1, 2, 1
    tmp = Path(tempfile.mkdtemp(prefix="llmforge-base-"))
    old_tree = tmp / "tree"
    try:
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(old_tree), base], cwd=REPO,
                       check=True, capture_output=True)
        old, new = [], []
        for _ in range(args.pairs):
            old.append(run(old_tree, overrides, args.steps, args.warmup))
            new.append(run(REPO, overrides, args.steps, args.warmup))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=REPO,
                       capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    ratios = [o["ms_per_step"] / n["ms_per_step"] for o, n in zip(old, new)]
    ms_old = statistics.median(o["ms_per_step"] for o in old)
    ms_new = statistics.median(n["ms_per_step"] for n in new)
    tokens = new[0]["tokens"]
    print(f"model code: {base} vs this tree, {args.pairs} interleaved pairs of {args.steps} steps "
          f"after {args.warmup} warm-up ({tokens} tokens a step)")
    print(f"median step: {base} {ms_old:.1f} ms ({1000 * tokens / ms_old:,.0f} tokens/s), this tree "
          f"{ms_new:.1f} ms ({1000 * tokens / ms_new:,.0f} tokens/s)")
    print(f"ratio {base} time / this tree's (this tree's speed relative): median "
          f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    print("per pair (ms): " + ", ".join(f"{o['ms_per_step']:.1f}/{n['ms_per_step']:.1f}"
                                         for o, n in zip(old, new)))
    print(f"first-step loss: {base} {old[0]['first_loss']:.6f}, this tree {new[0]['first_loss']:.6f} "
          f"({'equal' if old[0]['first_loss'] == new[0]['first_loss'] else 'DIFFERENT'})")


if __name__ == "__main__":
    main()
