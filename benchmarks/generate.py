"""Generation speed with and without the KV cache, side by side in one process.

    python benchmarks/generate.py                     # Llama 3 debug preset, 200 new tokens
    python benchmarks/generate.py --family qwen3 --new-tokens 200
    python benchmarks/generate.py --threads 1          # one compute thread (a busy machine)
    python benchmarks/generate.py --burner            # threads beside a CPU-burning process
    python benchmarks/generate.py --smoke

Both paths decode the same greedy tokens (checked here) from a randomly initialized model of the
preset (weights do not change the cost), one process, with the compute threads ``llmforge
generate`` chooses (:func:`llmforge.generate.use_inference_threads`) unless ``--threads``.
Prints tokens/s of each and the ratio cached/uncached; the uncached path re-runs the whole
context per token, so the ratio grows with the number of new tokens.

``--burner``: one CPU-burning process runs beside; each round runs the KV-cache path in two
fresh subprocesses, llmforge's choice ("default"), ``OMP_NUM_THREADS=1`` and one thread per core
(torch's own default), and prints their tokens/s (with the load average before each), the
medians and the ratio default/OMP_NUM_THREADS=1 (issue 27 asks >= 0.9; torch's own default
gave ~0.3 there).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def burner_comparison(args: argparse.Namespace) -> int:
    """Default threads against OMP_NUM_THREADS=1, each in a fresh subprocess, beside a burner."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(REPO / "src")
    cmd = [sys.executable, __file__, "--cached-only", "--family", args.family, "--preset",
           args.preset, "--new-tokens", str(args.new_tokens), *(["--smoke"] * args.smoke)]
    cores = len(os.sched_getaffinity(0))
    kinds = {"default": {}, "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"},
             f"OMP_NUM_THREADS={cores}": {"OMP_NUM_THREADS": str(cores)}}  # torch's own choice
    got: dict[str, list[float]] = {k: [] for k in kinds}
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    print(f"cores {cores}, one CPU-burning process beside, {args.rounds} "
          f"round(s) of {args.new_tokens} new tokens, load average now {load_before:.1f}")
    try:
        time.sleep(2.0)  # the burner runs before the command looks at the machine
        for i in range(args.rounds):
            for name, extra in kinds.items():
                load = os.getloadavg()[0]
                out = subprocess.run(cmd, env={**env, **extra}, capture_output=True, text=True,
                                     cwd=REPO, check=True).stdout.split()
                tps, threads = float(out[-2]), int(out[-1])
                got[name].append(tps)
                print(f"round {i + 1} {name:17s} {threads} thread{'s' * (threads != 1)} "
                      f"{tps:9,.1f} tokens/s  (load average {load:.1f})", flush=True)
    finally:
        spin.kill()
        spin.wait()
    med = {k: statistics.median(v) for k, v in got.items()}
    print("median " + ", ".join(f"{k} {v:,.1f}" for k, v in med.items()) + " tokens/s")
    print(f"ratio default/OMP_NUM_THREADS=1: "
          f"{med['default'] / med['OMP_NUM_THREADS=1']:.3f}; load average {load_before:.1f} "
          f"before, {os.getloadavg()[0]:.1f} after; {time.perf_counter() - start:.0f} s")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="llama3", choices=["llama3", "qwen3"])
    p.add_argument("--preset", default="debug")
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    p.add_argument("--burner", action="store_true",
                   help="default threads vs OMP_NUM_THREADS=1 beside a CPU-burning process")
    p.add_argument("--rounds", type=int, default=3, help="--burner: subprocess pairs")
    p.add_argument("--cached-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.burner:
        return burner_comparison(args)

    import torch

    from llmforge.generate import use_inference_threads

    if args.threads:
        torch.set_num_threads(args.threads)
    else:
        use_inference_threads()
    from omegaconf import OmegaConf

    from llmforge.models.sampling import generate
    from llmforge.models.spec import get_spec

    spec = get_spec(args.family)
    fields = {"preset": args.preset, "max_seq_len": 1024}
    if args.smoke:
        args.new_tokens = min(args.new_tokens, 24)
        fields.update(n_layers=2, vocab_size=512, max_seq_len=64)
    torch.manual_seed(0)
    model = spec(OmegaConf.structured(spec.config_cls(**fields))).eval()
    prompt = torch.randint(0, model.vocab_size, (args.prompt_tokens,)).tolist()
    generate(model, prompt, 4, temperature=0)  # warm-up (allocator, kernels)
    if args.cached_only:  # one line for --burner: tokens/s and threads
        start = time.perf_counter()
        out = generate(model, prompt, args.new_tokens, temperature=0, use_cache=True)
        print(f"{len(out) / (time.perf_counter() - start):.1f} {torch.get_num_threads()}")
        return 0
    results = {}
    for cached in (True, False):
        start = time.perf_counter()
        out = generate(model, prompt, args.new_tokens, temperature=0, use_cache=cached)
        seconds = time.perf_counter() - start
        results[cached] = (out, len(out) / seconds)
        print(f"{'KV cache' if cached else 'no cache'}: {len(out)} tokens in {seconds:.2f} s = "
              f"{len(out) / seconds:,.1f} tokens/s")
    same = results[True][0] == results[False][0]
    print(f"same greedy tokens: {same}")
    print(f"ratio cached/uncached: {results[True][1] / results[False][1]:.2f}x "
          f"({args.family} {args.preset}, {args.new_tokens} new tokens after {args.prompt_tokens}, "
          f"{torch.get_num_threads()} threads)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
