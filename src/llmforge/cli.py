"""The ``llmforge`` command line.

    llmforge train CONFIG.yaml [key=value ...] [--nproc N] [--dry-run] [--overwrite] [--debug]
    llmforge generate RUN_DIR_OR_CHECKPOINT --prompt TEXT [--max-new-tokens N] [--temperature T]
                      [--top-k K] [--seed S] [--debug]

Errors in the input print one line ``error: ...`` and exit non-zero (2 for configuration and
data errors) without a traceback; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional, Sequence

from llmforge.errors import LLMForgeError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmforge", description="Train Llama-3 models from one YAML.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train from a YAML config")
    t.add_argument("config", help="YAML file (e.g. yamls/demo_cpu.yaml)")
    t.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.max_steps=100")
    t.add_argument("--dry-run", action="store_true",
                   help="build the model on the meta device, print sizes and exit")
    t.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="run N local processes (torchrun's launcher; gloo on CPU, NCCL on GPUs)")
    t.add_argument("--overwrite", action="store_true",
                   help="delete an existing run directory of the same run.name first")
    t.add_argument("--debug", action="store_true", help="show tracebacks")

    g = sub.add_parser("generate", help="sample text from a trained run or checkpoint")
    g.add_argument("path", help="run directory (runs/NAME) or a checkpoint folder")
    g.add_argument("--prompt", required=True, help="text to continue")
    g.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate")
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=50, help="sample among the K likeliest tokens")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def _quiet_libraries() -> None:
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    import logging
    import warnings

    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*isinstance.treespec, LeafSpec.*")
    warnings.filterwarnings("ignore", module="torch.distributed.device_mesh")
    warnings.filterwarnings("ignore", module="torch.distributed.tensor._random")
    warnings.filterwarnings("ignore", message=".*_get_slice_mesh_layout.*|.*_rng_tracker.*")
    warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def cmd_train(args: argparse.Namespace) -> int:
    from llmforge.config import load_config, validate
    from llmforge.training.trainer import Trainer, detect_world_size

    cfg = load_config(args.config, args.overrides)
    if args.nproc:
        cfg.trainer.devices = args.nproc
    if args.dry_run:
        from llmforge import registry
        from llmforge.training.dry_run import dry_run_report

        registry.import_modules(cfg.imports)
        plan = validate(cfg, detect_world_size(cfg))
        print(dry_run_report(cfg, plan))
        return 0
    if args.nproc and args.nproc > 1 and not os.environ.get("WORLD_SIZE"):
        from llmforge.parallel.launch import launch_local

        validate(cfg, detect_world_size(cfg))  # fail fast, before any process starts
        argv = ["train", args.config, *args.overrides, f"trainer.devices={args.nproc}"]
        argv += ["--overwrite"] * args.overwrite + ["--debug"] * args.debug
        return launch_local(args.nproc, argv)
    trainer = Trainer(cfg, overwrite=args.overwrite)
    summary = trainer.fit()
    if trainer.is_rank_zero():
        _print_summary(summary)
    return 0


def _print_summary(s: dict[str, Any]) -> None:
    minutes, seconds = divmod(int(s["seconds"]), 60)
    parts = [f"done: {s['steps']} steps, {s['tokens']:,} tokens in {minutes}m{seconds:02d}s"]
    if s["final_train_loss"] is not None:
        parts.append(f"train/loss {s['final_train_loss']:.4f}")
    if s["final_eval_loss"] is not None:
        first = s["initial_eval_loss"]
        start = f" (step 0: {first:.4f})" if first is not None else ""
        parts.append(f"eval/loss {s['final_eval_loss']:.4f}{start}")
    print(" | ".join(parts))
    print(f"run directory: {s['run_dir']}")
    if s["checkpoint"]:
        print(f"checkpoint: {s['checkpoint']}")
        print(f"try: llmforge generate {s['run_dir']} --prompt \"ROMEO.\"")


def cmd_generate(args: argparse.Namespace) -> int:
    from llmforge.generate import sample_text

    try:
        text = sample_text(args.path, args.prompt, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    except ValueError as exc:
        raise LLMForgeError(str(exc)) from exc
    print(args.prompt + text)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``llmforge`` script; returns the exit code."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if args.command != "train" or "=" not in a or a.startswith("-")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    _quiet_libraries()
    handlers = {"train": cmd_train, "generate": cmd_generate}
    try:
        return handlers[args.command](args)
    except LLMForgeError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
