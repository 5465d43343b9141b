"""Pipeline parallelism on the CPU: time per optimizer step of ``strategy.pp=2`` on 2 processes
against the same model and batch in 1 process, beside the schedule's predicted bubble.

Both sides train the same Llama (default dim 256, 4 blocks, vocab 2048, seq 256, fp32) with
AdamW and clipping on random tokens, one compute thread per process, warm-up steps excluded;
each prints the median seconds per step. With ``p`` stages and an idle share ``b`` of the step
(``llmforge.parallel.pipeline.bubble_fraction``), a perfect pipeline takes ``1 / (p (1 - b))`` of
one process's time. CPU numbers are a proxy: two processes share the machine's cores, gloo
carries the activations, and nothing overlaps communication with compute as NCCL streams do.

    python benchmarks/pipeline.py [--schedule 1f1b] [--steps 8] [--microbatches 8]
    python benchmarks/pipeline.py --smoke
"""

from __future__ import annotations

import argparse
import json
import sys

from _worker import build_module, run_worker, timed_steps, tiny_config  # benchmarks/_worker.py, beside this script



def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 2 steps (keeps the script runnable)")
    ap.add_argument("--worker", choices=("single", "pp"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup, args.dim, args.layers, args.seq, args.microbatches = 2, 1, 32, 4, 16, 4
    return args


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cfg = tiny_config(args.dim, args.layers, args.seq)
    cfg.trainer.merge_with({"micro_batch_size": 2, "global_batch_size": 2 * args.microbatches,
                            "seq_len": args.seq})
    cfg.pipeline.schedule = args.schedule
    world = 1
    if args.worker == "pp":
        dist.init_process_group("gloo")
        world = dist.get_world_size()
        cfg.strategy.pp = world
    mod, opt = build_module(cfg, world)
    seconds, losses = timed_steps(mod, opt, lambda: torch.randint(0, 2048, (2 * args.microbatches, args.seq + 1)), args.warmup, args.steps, world)
    bubble = mod.step.pipeline.bubble() if world > 1 else 0.0
    if world == 1 or dist.get_rank() == 0:
        print(json.dumps({"seconds_per_step": seconds, "losses": losses,
                          "bubble": bubble, "stages": world}), flush=True)
    if world > 1:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    single = run_worker(__file__, "single", argv, 1)
    pp = run_worker(__file__, "pp", argv, 2)
    b, p = pp["bubble"], pp["stages"]
    predicted = 1 / (p * (1 - b))
    measured = pp["seconds_per_step"] / single["seconds_per_step"]
    same = max(abs(x - y) for x, y in zip(single["losses"], pp["losses"]))
    print(f"model: dim {args.dim}, {args.layers} blocks, seq {args.seq}, {args.microbatches} micro-batches "
          f"of 2, schedule {args.schedule}; median of {args.steps} steps after {args.warmup} warm-up")
    print(f"1 process      {single['seconds_per_step']:.3f} s/step")
    print(f"pp=2 (2 procs) {pp['seconds_per_step']:.3f} s/step")
    print(f"ratio pp/1     measured {measured:.2f}, predicted {predicted:.2f} = 1 / (p (1 - bubble)), "
          f"bubble {b:.1%}")
    print(f"losses         max difference {same:.2e} (same model, same batches)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
