"""Context parallelism on the CPU: tokens per second of ``strategy.cp=2`` on 2 processes against
one process at the same global batch and sequence, for both ``context_parallel.mode`` values,
and the per-rank activation memory.

Every side trains the same Llama (default dim 128, 2 blocks, 8 heads / 4 kv heads, vocab 2048,
seq 2048, fp32, global batch 2 of micro-batch 1) with AdamW and clipping on random tokens, one
compute thread per process, warm-up steps excluded; each prints the median seconds per step.
Memory per rank: the bytes of the tensors autograd saves for backward in one micro-batch's
forward (distinct storages; the activations, which context parallelism divides), and the
process's peak resident set (``ru_maxrss``, dominated by the interpreter and torch on a model
this small). CPU numbers are a proxy for the overhead: two processes share the machine's
cores, gloo carries K/V (or the all-to-alls), and nothing overlaps communication with compute.

    python benchmarks/cp.py [--seq 2048] [--steps 4]
    python benchmarks/cp.py --smoke
"""

from __future__ import annotations

import argparse
import json
import resource
import sys

from _worker import build_module, run_worker, timed_steps, tiny_config  # benchmarks/_worker.py, beside this script



def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 2 steps (keeps the script runnable)")
    ap.add_argument("--worker", choices=("single", "all_gather", "ulysses"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup, args.dim, args.layers, args.seq = 2, 1, 32, 2, 64
    return args


def saved_bytes(mod, batch) -> int:
    """Bytes of the distinct storages autograd saves in one forward + loss of ``batch``."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        st = mod.step
        inputs, labels = mod.split_batch(batch)
        st.state.training = True
        st.micro_batch_loss(0, inputs[:1], labels[:1], None)
    st.state.outputs = st.state.loss = None
    return sum(seen.values())


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cfg = tiny_config(args.dim, args.layers, args.seq)
    cfg.trainer.merge_with({"micro_batch_size": 1, "global_batch_size": 2, "seq_len": args.seq})
    world = 1
    if args.worker != "single":
        dist.init_process_group("gloo")
        world = dist.get_world_size()
        cfg.strategy.cp = world
        cfg.context_parallel.mode = args.worker
    mod, opt = build_module(cfg, world)
    seconds, losses = timed_steps(mod, opt, lambda: torch.randint(0, 2048, (2, args.seq + 1)), args.warmup, args.steps, world)
    act = saved_bytes(mod, torch.randint(0, 2048, (2, args.seq + 1)))
    if world == 1 or dist.get_rank() == 0:
        print(json.dumps({"seconds_per_step": seconds, "losses": losses,
                          "saved_bytes": act,
                          "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}),
              flush=True)
    if world > 1:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    single = run_worker(__file__, "single", argv, 1)
    tokens = 2 * args.seq
    print(f"model: dim {args.dim}, {args.layers} blocks, seq {args.seq}, global batch 2 (micro-batch 1); "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(f"1 process          {tokens / single['seconds_per_step']:9.0f} tokens/s   activations "
          f"{single['saved_bytes'] / 2**20:7.1f} MiB   peak RSS {single['maxrss_bytes'] / 2**20:6.0f} MiB")
    for mode in ("all_gather", "ulysses"):
        cp = run_worker(__file__, mode, argv, 2)
        same = max(abs(x - y) for x, y in zip(single["losses"], cp["losses"]))
        print(f"cp=2 {mode:<13} {tokens / cp['seconds_per_step']:9.0f} tokens/s   activations "
              f"{cp['saved_bytes'] / 2**20:7.1f} MiB   peak RSS {cp['maxrss_bytes'] / 2**20:6.0f} MiB   "
              f"(x{single['seconds_per_step'] / cp['seconds_per_step']:.2f} speed, "
              f"x{cp['saved_bytes'] / single['saved_bytes']:.2f} activations per rank, "
              f"losses within {same:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
