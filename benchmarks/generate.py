"""Generation speed with and without the KV cache, side by side in one process.

    python benchmarks/generate.py                     # Llama 3 debug preset, 200 new tokens
    python benchmarks/generate.py --family qwen3 --new-tokens 200
    python benchmarks/generate.py --threads 1          # one compute thread (a busy machine)
    python benchmarks/generate.py --smoke

Both paths decode the same greedy tokens (checked here) from a randomly initialized model of the
preset (weights do not change the cost), one process, torch's default threads unless
``--threads``. Prints tokens/s
of each and the ratio cached/uncached; the uncached path re-runs the whole context per token, so
the ratio grows with the number of new tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="llama3", choices=["llama3", "qwen3"])
    p.add_argument("--preset", default="debug")
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    args = p.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
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
