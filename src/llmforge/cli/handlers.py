"""Handlers of the ``llmforge`` commands ``train``, ``generate``, ``eval``, ``convert``,
``checkpoint``, ``algorithms`` and ``runs plot`` (``args -> exit code``); each imports what it
needs when called, so a typo in a config fails before torch is imported. Bad input raises
:class:`~llmforge.errors.ConfigError` (exit 2); :func:`llmforge.cli.main` prints it."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from llmforge.cli.runs_commands import RUN_COMMANDS
from llmforge.errors import ConfigError, LLMForgeError
from llmforge.job.torchrun import die_with_launcher
from llmforge.paths import resolve_dotdot
from llmforge.planning.gpus import gpu_kind
from llmforge.quiet import quiet_libraries
from llmforge.runs.plot import plot_runs


def cmd_train(args: argparse.Namespace) -> int:
    """Load and resolve the run before the heavy imports (a typo fails in a fraction of a
    second), then build the Trainer: its one start-up sequence serves the dry run, the
    ``--nproc`` launcher's check and training."""
    die_with_launcher()  # a worker of `--nproc` or llmforge.job.torchrun: ends with its launcher
    # the config machinery (omegaconf, yaml) after argument parsing: `llmforge --help` stays fast
    from llmforge.config import load_config
    from llmforge.config.validate import WARNINGS_SHOWN_ENV
    from llmforge.preflight.resolve import resolve_run

    cfg = load_config(args.config, args.overrides)
    if args.nproc is not None:
        if args.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
        cfg.trainer.devices = args.nproc  # the command line's input, like an override
    if args.simulate and not args.dry_run:
        raise ConfigError("--simulate goes with --dry-run (llmforge train CONFIG --dry-run --simulate)")
    launcher = bool(args.nproc and args.nproc > 1 and not os.environ.get("WORLD_SIZE"))
    run = resolve_run(cfg, overwrite=args.overwrite, check_dir=not args.dry_run,
                      dry_run=args.dry_run)
    quiet_libraries()
    from llmforge.training.trainer import Trainer  # heavy (torch, Lightning): after the config errors

    trainer = Trainer(cfg, overwrite=args.overwrite, run=run)  # imports, strategy, algorithms
    if args.dry_run:
        from llmforge.planning.dry_run import dry_run_text  # heavy (torch, Lightning): after config errors
        from llmforge.runs.checks import build_loggers  # the launcher's logger check: dry runs only

        try:  # a tracker SDK missing here fails the real run here: say it now (an API key may
            # be set only where the run goes, so a missing one is left to it)
            build_loggers(trainer.cfg, {"run_dir": str(run.run_dir)}, strict=True)
        except LLMForgeError as exc:
            if isinstance(exc.__cause__, ImportError):
                raise

        for note in run.notes:
            print(f"note            {note}")
        print(dry_run_text(trainer, run, args.device_memory_gib, simulate=args.simulate))
        return 0
    if launcher:
        from llmforge.job.nproc import launch_local  # after the config errors, like the Trainer

        argv = ["train", args.config, *args.overrides, f"trainer.devices={args.nproc}"]
        argv += ["--overwrite"] * args.overwrite + ["--debug"] * args.debug
        trainer.lock_run_dir()  # held here for the whole run; the workers inherit its token
        # the workers check the same config: its warnings were printed here, once
        shown = os.environ.get(WARNINGS_SHOWN_ENV)
        os.environ[WARNINGS_SHOWN_ENV] = "1"
        try:
            return launch_local(args.nproc, argv)
        finally:
            trainer.run_lock.release()
            if shown is None:
                os.environ.pop(WARNINGS_SHOWN_ENV, None)
    summary = trainer.fit()
    if trainer.is_rank_zero():
        _print_summary(summary)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """``llmforge plan``: a bad ``--gpu`` fails before the heavy imports."""
    if args.gpu:
        gpu_kind(args.gpu)
    from llmforge.runs.auto_layout import plan_command  # heavy (torch): off the CLI's fast path

    quiet_libraries()
    return plan_command(args)


def cmd_algorithms(args: argparse.Namespace) -> int:
    from llmforge.algorithms.loading import available  # heavy (torch): off the CLI's fast path

    rows = available()
    width = max(len(r[0]) for r in rows)
    swidth = max(len(r[1]) for r in rows)
    for name, stage, summary in rows:
        print(f"{name:<{width}}  {stage:<{swidth}}  {summary}")
    return 0


def cmd_runs_plot(args: argparse.Namespace) -> int:
    metrics = args.metric or ["train/loss"]
    out = args.out or metrics[0].replace("/", "_") + ".png"
    path = plot_runs(args.run_dirs, metrics, out, x=args.x, width=args.width, height=args.height,
                     log_y=args.log_y)
    print(f"wrote {path}")
    return 0


RUNS_COMMANDS = {"plot": cmd_runs_plot}


def cmd_runs(args: argparse.Namespace) -> int:
    """``llmforge runs SUBCOMMAND``: dispatch on :data:`RUNS_COMMANDS` (and run management's)."""
    return {**RUN_COMMANDS, **RUNS_COMMANDS}[args.runs_command](args)


def _print_summary(s: dict[str, Any]) -> None:
    minutes, seconds = divmod(int(s["seconds"]), 60)
    resumed = s.get("resumed_step")
    if resumed is not None and resumed >= s["max_steps"]:
        print(f"nothing to train: the checkpoint resumed is at step {resumed}, and "
              f"trainer.max_steps is {s['max_steps']}; to train on, raise trainer.max_steps and pass "
              "checkpoint.allow_config_changes=true (the schedule's length changes)")
        print(f"run directory: {s['run_dir']}")
        return
    if s.get("stopped_by"):
        head = f"stopped early ({s['stopped_by']}): {s['steps']} of {s['max_steps']} steps"
    else:
        head = f"done: {s['steps']} steps"
    took = f"{minutes}m{seconds:02d}s"
    if resumed is not None:  # the tokens are the run's; the time is this process's
        parts = [f"{head}, {s['tokens']:,} tokens ({s['steps'] - resumed} steps in {took} after "
                 f"resuming at step {resumed})"]
    else:
        parts = [f"{head}, {s['tokens']:,} tokens in {took}"]
    if s["final_train_loss"] is not None:
        parts.append(f"train/loss {s['final_train_loss']:.4f}")
    if s["final_eval_loss"] is not None:
        first = s["initial_eval_loss"]
        start = f" (step {s.get('initial_eval_step', 0)}: {first:.4f})" if first is not None else ""
        parts.append(f"eval/loss {s['final_eval_loss']:.4f}{start}")
    print(" | ".join(parts))
    print(f"run directory: {s['run_dir']}")
    if s["checkpoint"]:
        print(f"checkpoint: {s['checkpoint']}")
        hint = ('--chat --prompt "What is 3 plus 4?"' if s.get("data_task") == "sft"
                else '--prompt "ROMEO."')
        print(f"try: llmforge generate {s['run_dir']} {hint}")


def cmd_generate(args: argparse.Namespace) -> int:
    from llmforge.generate import sample_text  # heavy (torch): off the CLI's fast path

    checks = [(args.max_new_tokens >= 0, "--max-new-tokens must be >= 0"),
              (args.temperature >= 0 and args.temperature != float("inf"),
               "--temperature must be a finite number >= 0 (0 = greedy)"),
              (args.top_k is None or args.top_k >= 1, "--top-k must be >= 1"),
              (0 <= args.seed < 2**63, "--seed must be in [0, 2**63)")]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    stats: dict = {}

    def show(piece: str) -> None:  # tokens are printed as they come
        if not stats.get("started"):
            stats["started"] = True
            if not args.chat:
                sys.stdout.write(args.prompt)
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:
        sample_text(args.path, args.prompt, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                    chat=args.chat, use_cache=not args.no_cache, on_text=show, stats=stats,
                    trust_code=args.trust_code)
    except ValueError as exc:
        raise LLMForgeError(str(exc)) from exc
    if not stats.get("started") and not args.chat:
        sys.stdout.write(args.prompt)
    print(flush=True)
    print(f"{stats['tokens']} tokens in {stats['seconds']:.2f} s ({stats['tokens_per_second']:.1f} "
          f"tokens/s, KV cache {'on' if stats['kv_cache'] else 'off'}, {stats['threads']} "
          f"thread{'s' * (stats['threads'] != 1)})", file=sys.stderr)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from torch import device as torch_device
    from torch.cuda import is_available as cuda_available

    from llmforge.evaluation.harness import parse_limit  # heavy (torch): off the CLI's fast path
    from llmforge.evaluation.run import evaluate_run  # heavy (torch, lm-eval)

    try:
        limit = parse_limit(args.limit)
    except ValueError as exc:
        raise ConfigError(f"--{exc}") from None
    try:
        device = torch_device(args.device)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"--device {args.device!r}: {exc}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not cuda_available():
        raise ConfigError(f"--device {args.device}: no CUDA device here (this torch build or machine "
                          "has none); use --device cpu")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ConfigError(f"--num-fewshot must be >= 0; got {args.num_fewshot}")
    if args.batch_size < 1 or args.max_gen_toks < 1:
        raise ConfigError("--batch-size and --max-gen-toks must be >= 1")
    out = evaluate_run(args.path, args.tasks.split(","), include_path=args.include_path,
                       limit=limit, num_fewshot=args.num_fewshot, batch_size=args.batch_size,
                       max_gen_toks=args.max_gen_toks, seed=args.seed, device=args.device,
                       trust_code=args.trust_code)
    for key, value in sorted(out["scores"].items()):
        print(f"{key:40s} {value:.4f}")
    print(f"wrote {out['path']}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    if args.convert_command == "foundry":
        return _convert_foundry(args)

    from llmforge.checkpoint.convert import from_hf, to_hf  # heavy (torch): off the CLI's fast path

    out = resolve_dotdot(args.out)  # 'new/../hf' without new/: the folder 'hf' (checked here)
    args.out = str(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
        raise ConfigError(f"{out} already exists and is not empty; choose another output folder or "
                          "pass --overwrite to write into it")

    if args.convert_command == "to-hf":
        written = to_hf(args.path, args.out, args.dtype, adapters_only=args.adapters_only,
                        trust_code=args.trust_code, overwrite=args.overwrite)
        print(f"wrote {written}")
    else:
        print(f"wrote {from_hf(args.path, args.out, overwrite=args.overwrite)}")
    return 0


def _convert_foundry(args: argparse.Namespace) -> int:
    """``convert foundry``: the YAML to OUT (or stdout), the report to stdout (or stderr)."""
    from llmforge.config.foundry import write_converted  # omegaconf, yaml: off the --help path
    from llmforge.models.spec import get_spec  # the model configs (omegaconf): off it too

    def _model_shape(cfg: Any) -> None:
        """The family's shape check of ``train --dry-run`` (``model.dim`` divisible by
        ``model.n_heads``, ...), raising ConfigError; a Hugging Face folder fixes its own shape."""
        if not cfg.model.get("init_from"):
            get_spec(cfg.model.name).check(cfg.model)

    if args.steps_per_epoch is not None and args.steps_per_epoch < 1:
        raise ConfigError(f"--steps-per-epoch must be >= 1, got {args.steps_per_epoch}")
    text, report = write_converted(args.path, args.out, overwrite=args.overwrite,
                                   steps_per_epoch=args.steps_per_epoch, prepared=args.prepared,
                                   checks=(_model_shape,))
    if args.out is None:
        sys.stdout.write(text)
        print(report, file=sys.stderr)
        return 0
    written = resolve_dotdot(args.out)  # the file write_converted wrote, as `train` will read it
    print(f"wrote {written}: {report}")
    print(f"check it: llmforge train {written} --dry-run")
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from llmforge.checkpoint.tools import consolidate, inspect_checkpoint  # heavy (torch): off the fast path

    if args.checkpoint_command == "inspect":
        print(inspect_checkpoint(args.path))
    else:
        print(f"wrote {consolidate(args.path, args.out, overwrite=args.overwrite)}")
    return 0
