"""Training time lost per checkpoint save, with DCP async save on and off, side by side.

    python benchmarks/checkpoint_save.py            # demo model, 3 interleaved rounds
    python benchmarks/checkpoint_save.py --big      # dim 512, 8 blocks: 25.7M parameters, 0.29 GiB per save
    python benchmarks/checkpoint_save.py --smoke    # tiny, for the test suite

Each round trains the same run three ways in one process: no saves, a save every
``--every`` steps synchronously, and the same with ``checkpoint.async_save=true``. It prints the
median seconds the training thread spent inside each save (the checkpointer's own timer) and the
wall time added per save compared with the run without saves.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def run(overrides: list[str], work: Path, name: str) -> tuple[float, list[float]]:
    from llmforge import Trainer, load_config
    from llmforge.callbacks import Checkpointer

    cfg = load_config(REPO / "yamls" / "demo_cpu.yaml",
                      [*overrides, f"run.output_dir={work}", f"run.name={name}"])
    trainer = Trainer(cfg, overwrite=True)
    trainer.setup()
    start = time.perf_counter()
    trainer.lightning.fit(trainer.module, datamodule=trainer.datamodule)
    wall = time.perf_counter() - start
    ck = next(c for c in trainer.lightning.callbacks if isinstance(c, Checkpointer))
    return wall, ck.save_seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--big", action="store_true", help="dim 512, 8 blocks (larger checkpoints)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5)
    args = ap.parse_args()
    import datasets

    datasets.disable_progress_bars()
    common = ["trainer.progress_bar=false", "trainer.eval_every=0", "data.num_workers=0",
              "loggers=[]", "checkpoint.save_final=false"]
    if args.big:
        common += ["model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=4"]
    if args.smoke:
        common += ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                   "model.multiple_of=32", "tokenizer.vocab_size=1024", "variables.seq_len=64",
                   "scheduler.warmup_steps=1"]
        args.rounds, args.steps, args.every = 1, 4, 2
    common.append(f"trainer.max_steps={args.steps}")
    modes = {"none": [], "sync": [f"checkpoint.save_every={args.every}"],
             "async": [f"checkpoint.save_every={args.every}", "checkpoint.async_save=true"]}
    walls: dict[str, list[float]] = {m: [] for m in modes}
    saves: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode, extra in modes.items():
                wall, per_save = run(common + extra, Path(tmp), f"{mode}{r}")
                walls[mode].append(wall)
                saves[mode].extend(per_save)
    n_saves = args.steps // args.every
    base = statistics.median(walls["none"])
    print(f"{'mode':6s} {'median wall s':>14s} {'added s/save':>13s} {'in-save s (median)':>19s}")
    for mode in modes:
        w = statistics.median(walls[mode])
        added = (w - base) / n_saves if mode != "none" else 0.0
        inside = statistics.median(saves[mode]) if saves[mode] else 0.0
        print(f"{mode:6s} {w:14.2f} {added:13.3f} {inside:19.3f}")
    if saves["sync"] and saves["async"]:
        print(f"ratio async/sync time in save: {statistics.median(saves['async']) / statistics.median(saves['sync']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
