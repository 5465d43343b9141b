"""One transformer block of llmforge's Llama against LitGPT's ``Block``, same shapes, in one
process: forward + backward, compiled (``fullgraph``) or eager, timed in alternation.

    python benchmarks/peers_block.py                      # compiled, 300 rounds, demo shapes
    python benchmarks/peers_block.py --eager --rounds 200
    python benchmarks/peers_block.py --profile            # + torch.profiler table of each side

This is the probe that located issue 30's compiled gap (``benchmarks/results/
peers-issue30-2026-12-03d.md``): ``peers.py`` measures whole runs, whose ratio moves with the
machine by more than the 1-2 % looked for; one block in one process, the two sides taking turns
every round, resolves ~0.5 %. The block is the demo's (``yamls/demo_cpu.yaml``: dim 256, 8 heads,
4 kv heads, SwiGLU hidden 704, ``micro_batch_size`` 8 x ``seq_len`` 256, fp32); LitGPT's is
configured to the same shapes (``LLaMAMLP``, ``RMSNorm``, no biases, rotate-half RoPE) with
its own random weights (the work does not depend on the values).

Prints each side's median milliseconds per round and llmforge's speed over LitGPT's (median of
the per-round ratios, and the ratio of the sums). Needs LitGPT (``pip install litgpt==0.5.13``
beside this torch, as for ``peers.py``); exits 2 with that message without it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from llmforge.config import load_config  # noqa: E402
from llmforge.models.llama3.config import llama_args_from_config  # noqa: E402
from llmforge.models.llama3.model import TransformerBlock, precompute_rope  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import litgpt_config  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "yamls" / "demo_cpu.yaml"


def build(batch: int, seq_len: int):
    """The two blocks (the demo's shapes), their input ``[batch, seq_len, dim]`` and upstream
    gradient; returns ``(ours, theirs, {name: step})``."""
    from litgpt.model import Block, build_rope_cache

    args = llama_args_from_config(load_config(str(DEMO), []).model)
    ours = TransformerBlock(0, args)
    rope = precompute_rope(args.head_dim, seq_len, args.rope_theta)
    lc = litgpt_config(args, seq_len)
    theirs = Block(lc, 0)
    cos, sin = build_rope_cache(seq_len, n_elem=lc.rope_n_elem, base=lc.rope_base)
    cos, sin = cos[None], sin[None]  # LitGPT's blocks take [1, T, hd]
    x = torch.randn(batch, seq_len, args.dim, requires_grad=True)
    grad = torch.randn(batch, seq_len, args.dim)
    return ours, theirs, {"llmforge": lambda: ours(x, rope).backward(grad),
                          "litgpt": lambda: theirs(x, cos, sin).backward(grad)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=300, help="timed rounds (each side once per round)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--eager", action="store_true", help="no torch.compile")
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler tables (50 rounds each)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.warmup < 1:
        print("peers_block.py: --rounds and --warmup must be >= 1", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    try:
        ours, theirs, steps = build(args.batch, args.seq_len)
    except ImportError as e:
        print(f"peers_block.py: LitGPT is needed ({e}); pip install litgpt==0.5.13", file=sys.stderr)
        return 2
    if not args.eager:
        ours.compile(fullgraph=True)
        theirs.compile(fullgraph=True)
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for i in range(args.rounds):
        for name in (names if i % 2 == 0 else names[::-1]):  # who goes first alternates
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    ratios = [b / a for a, b in zip(times["llmforge"], times["litgpt"])]
    kind = "eager" if args.eager else "compiled"
    print(f"one block fwd+bwd, {kind}, {args.rounds} rounds, B={args.batch} T={args.seq_len}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    for name, v in times.items():
        print(f"  {name:9s} median {statistics.median(v) * 1e3:8.2f} ms")
    print(f"llmforge speed / LitGPT: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}); sums {sum(times['litgpt']) / sum(times['llmforge']):.3f}")
    if args.profile:
        from torch.profiler import profile

        for name, step in steps.items():
            with profile() as prof:
                for _ in range(50):
                    step()
            print(f"===== {name}: 50 rounds")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15,
                                            max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
