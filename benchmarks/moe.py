"""Mixture of experts on the CPU, side by side (issue 24):

1. the expert computation of one MoE layer (forward + backward): ``torch._grouped_mm`` over all
   experts against one matmul per expert (:func:`llmforge.models.qwen3_moe.moe.expert_swiglu`),
   same routed rows, same weights;
2. training steps of the Qwen3-MoE ``debug`` preset (8 experts, top-2, expert width 256)
   against a dense Qwen3 with the same *active* parameters (SwiGLU width 2 x 256 = 512, no
   router): tokens/s of forward + cross-entropy + backward + AdamW on one random batch.

    python benchmarks/moe.py                # the sizes above
    python benchmarks/moe.py --smoke        # tiny, seconds

Prints the median over ``--repeats`` timings of each variant, alternating, and the ratios.
Timings on a shared machine are noisy: compare ratios, on idle cores.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from llmforge.models.qwen3_moe.moe import expert_swiglu, grouped_mm_ok


def time_experts(tokens: int, dim: int, hidden: int, experts: int, top_k: int, repeats: int) -> dict:
    """Median seconds of forward + backward of the routed rows through every expert."""
    gen = torch.Generator().manual_seed(0)
    rows = tokens * top_k
    counts = torch.bincount(torch.randint(0, experts, (rows,), generator=gen), minlength=experts)
    x = torch.randn(rows, dim, generator=gen, requires_grad=True)
    ws = [torch.randn(experts, hidden, dim, generator=gen) * 0.05,
          torch.randn(experts, dim, hidden, generator=gen) * 0.05,
          torch.randn(experts, hidden, dim, generator=gen) * 0.05]
    for w in ws:
        w.requires_grad_(True)
    impls = ["loop"] + (["grouped_mm"] if grouped_mm_ok(x, (dim, hidden)) else [])
    times: dict[str, list[float]] = {i: [] for i in impls}
    outs = {}
    for _ in range(repeats + 1):  # the first round warms up
        for impl in impls:
            t0 = time.perf_counter()
            y = expert_swiglu(x, counts, ws[0], ws[1], ws[2], impl)
            y.square().mean().backward()
            times[impl].append(time.perf_counter() - t0)
            outs[impl] = y.detach()
    if "grouped_mm" in outs:
        print(f"  max |grouped_mm - loop| = {(outs['grouped_mm'] - outs['loop']).abs().max().item():.2e}")
    return {k: statistics.median(v[1:]) for k, v in times.items()}


def time_models(overrides: dict, dense_hidden: int, batch: int, seq: int, steps: int) -> dict:
    """Median seconds per training step of the MoE and of the dense model of equal active size."""
    from omegaconf import OmegaConf

    from llmforge.models.spec import get_spec

    moe_cfg = OmegaConf.create({"name": "qwen3_moe", "preset": "debug", **overrides})
    dense_cfg = OmegaConf.create({"name": "qwen3", "preset": "debug", "hidden_dim": dense_hidden,
                                  **{k: v for k, v in overrides.items() if not k.startswith(("num_", "moe_"))}})
    models = {}
    for name, cfg in (("qwen3_moe", moe_cfg), ("qwen3 dense", dense_cfg)):
        torch.manual_seed(0)
        spec = get_spec(cfg.name)
        model = spec(cfg)
        total, active = spec.num_params(model)
        print(f"  {name:12s} params {total:,} active {active:,}")
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    vocab = int(moe_cfg.get("vocab_size") or 8192)
    data = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(steps + 1):
        for name, (model, opt) in models.items():
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten())
            aux = getattr(model, "aux_losses", dict)()
            (loss + sum(aux.values())).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times[name].append(time.perf_counter() - t0)
    return {k: batch * seq / statistics.median(v[1:]) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (a CI check that it runs)")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    if args.smoke:
        layer = dict(tokens=64, dim=32, hidden=16, experts=4, top_k=2)
        model = dict(overrides={"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16,
                                "vocab_size": 128, "max_seq_len": 32, "num_experts": 4,
                                "moe_intermediate_size": 16}, dense_hidden=32, batch=2, seq=16)
        repeats = 2
    else:
        layer = dict(tokens=2048, dim=256, hidden=256, experts=8, top_k=2)
        model = dict(overrides={"vocab_size": 2048, "max_seq_len": 256}, dense_hidden=512, batch=8, seq=256)
        repeats = args.repeats
    print(f"expert computation, forward + backward: {layer}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    t = time_experts(repeats=repeats, **layer)
    for k, v in t.items():
        print(f"  {k:12s} {v * 1e3:8.2f} ms")
    if "grouped_mm" in t:
        print(f"  ratio loop/grouped_mm {t['loop'] / t['grouped_mm']:.2f} (> 1: grouped is faster)")
    print(f"training step, batch {model['batch']} x {model['seq']} tokens:")
    tps = time_models(steps=max(2, repeats // 2), **model)
    for k, v in tps.items():
        print(f"  {k:12s} {v:10.0f} tokens/s")
    print(f"  ratio moe/dense {tps['qwen3_moe'] / tps['qwen3 dense']:.2f} (same active parameters)")


if __name__ == "__main__":
    main()
