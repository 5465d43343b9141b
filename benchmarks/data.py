"""The data path alone against the ``tokenizers`` batch encoder on the same text.

    python benchmarks/data.py          # the demo corpus (Shakespeare), 3 repetitions
    python benchmarks/data.py --smoke

(a) ``tokenizers`` ``encode_batch`` on every training document (the floor: tokenizing only);
(b) llmforge's data path: read (HF datasets), clean, tokenize, pack into windows, then iterate
the training DataLoader for one epoch's worth of batches. Prints tokens/s of each and the
ratio. The share of step time spent waiting for data during training is
``time/data_seconds / time/step_seconds`` in a run's metrics.jsonl (printed by
``benchmarks/overhead.py``'s runs); target under 2%.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    import datasets

    datasets.disable_progress_bars()
    from llmforge import load_config
    from llmforge.config import validate
    from llmforge.data.datamodule import LLMDataModule
    from llmforge.data.shakespeare import cache_root
    from llmforge.data.sources import iter_texts, load_documents
    from llmforge.data.tokenizers import build_tokenizer

    overrides = ["data.max_documents=4", "variables.seq_len=64"] if args.smoke else []
    cfg = load_config(REPO / "yamls" / "demo_cpu.yaml", overrides)
    plan = validate(cfg, 1)
    docs = load_documents(cfg.data, cfg.run.seed)
    tok = build_tokenizer(cfg.tokenizer, lambda: iter_texts(docs.train, cfg.tokenizer.train_max_bytes),
                          cache_dir=cache_root() / "tokenizers", fingerprint=docs.fingerprint)
    texts = [r["text"] for r in docs.train]
    raw = getattr(tok, "_tok", None)  # the HF tokenizers object under llmforge's wrapper
    base, ours = [], []
    for _ in range(1 if args.smoke else args.reps):
        start = time.perf_counter()
        n = sum(len(e.ids) for e in raw.encode_batch(texts, add_special_tokens=False)) if raw else \
            sum(len(x) for x in tok.encode_batch(texts))
        base.append(n / (time.perf_counter() - start))

        start = time.perf_counter()
        fresh = load_documents(cfg.data, cfg.run.seed)
        dm = LLMDataModule(fresh, tok, seq_len=cfg.trainer.seq_len, local_batch_size=plan.local_batch_size,
                           micro_batch_size=plan.micro_batch_size, eval_batches=1, seed=0,
                           num_workers=0, dp_rank=0, dp_size=1)
        dm.setup()
        loader = iter(dm.train_dataloader())
        batches = len(dm.train_windows) // plan.local_batch_size
        for _ in range(batches):
            next(loader)
        ours.append(dm.train_tokens / (time.perf_counter() - start))
    b, o = statistics.median(base), statistics.median(ours)
    print(f"tokenizers encode_batch only      {b:14,.0f} tokens/s")
    print(f"llmforge read+tokenize+pack+batch {o:14,.0f} tokens/s   ratio {o / b:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
