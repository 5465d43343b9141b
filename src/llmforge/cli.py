"""The ``llmforge`` command line.

    llmforge train CONFIG.yaml [key=value ...] [--nproc N] [--dry-run [--device-memory-gib G]]
                   [--overwrite] [--debug]
    llmforge generate RUN_DIR_OR_CHECKPOINT --prompt TEXT [--max-new-tokens N] [--temperature T]
                      [--top-k K] [--seed S] [--chat] [--debug]
    llmforge eval RUN_DIR_OR_CHECKPOINT --tasks T1,T2 [--include-path DIR] [--limit N]
                  [--num-fewshot K] [--batch-size B] [--device D]
    llmforge algorithms          # the algorithm plugins: name, pipeline stage, summary
    llmforge runs plot RUN_DIR... [--metric train/loss] [--out FILE.png] [--x step|tokens]
    llmforge launch CONFIG.yaml [--cluster NAME] [--gpus N] [--nodes M] [--dry-run] [key=value ...]
    llmforge clusters | secrets | runs list|describe|logs|stop|delete|restart   (llmforge.runs.commands)

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
    p = argparse.ArgumentParser(prog="llmforge", description="Train language models (Llama 3, Qwen3, your own) from one YAML.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train from a YAML config")
    t.add_argument("config", help="YAML file (e.g. yamls/demo_cpu.yaml)")
    t.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.max_steps=100")
    t.add_argument("--dry-run", action="store_true",
                   help="build the model on the meta device, print sizes and exit")
    t.add_argument("--device-memory-gib", type=float, default=None, metavar="GIB",
                   help="with --dry-run: memory of one device for the fit verdict of LoRA "
                        "configs (default: 80 and 192)")
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
    g.add_argument("--chat", action="store_true",
                   help="the prompt is a user turn: render it with the run's chat template "
                        "(data.chat_template, Llama 3 by default), print only the answer, stop "
                        "at the end of the assistant turn (SFT runs)")
    g.add_argument("--no-cache", action="store_true",
                   help="recompute the whole context for every token instead of using a KV cache")
    g.add_argument("--debug", action="store_true", help="show tracebacks")

    e = sub.add_parser("eval", help="run lm-evaluation-harness tasks on a run or checkpoint")
    e.add_argument("path", help="run directory (runs/NAME) or a checkpoint folder")
    e.add_argument("--tasks", required=True,
                   help="comma-separated lm-eval task names, e.g. hellaswag,arc_easy")
    e.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="folder of extra task YAMLs (local data); repeatable")
    e.add_argument("--limit", type=float, default=None,
                   help="documents per task: a count, or a share if < 1")
    e.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples per prompt")
    e.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    e.add_argument("--max-gen-toks", type=int, default=256, help="cap on generated tokens")
    e.add_argument("--seed", type=int, default=0, help="lm-eval's seeds")
    e.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    e.add_argument("--debug", action="store_true", help="show tracebacks")

    v = sub.add_parser("convert", help="Hugging Face <-> llmforge weights")
    cv_sub = v.add_subparsers(dest="convert_command", required=True)
    th = cv_sub.add_parser("to-hf", help="write config.json + safetensors + tokenizer for transformers")
    th.add_argument("path", help="run directory or checkpoint folder")
    th.add_argument("out", help="output folder")
    th.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="cast weights (default: as trained; merged LoRA weights: float32)")
    th.add_argument("--adapters-only", action="store_true",
                    help="LoRA runs: write only the adapters in PEFT's format (adapter_config.json + "
                         "adapter_model.safetensors) instead of merged weights")
    th.add_argument("--overwrite", action="store_true", help="replace files in a non-empty OUT")
    th.add_argument("--debug", action="store_true", help="show tracebacks")
    fh = cv_sub.add_parser("from-hf", help="turn a Hugging Face Llama folder into an llmforge run directory")
    fh.add_argument("path", help="Hugging Face folder (config.json, *.safetensors, tokenizer.json)")
    fh.add_argument("out", help="output run directory (usable by generate and model.init_from)")
    fh.add_argument("--overwrite", action="store_true", help="replace files in a non-empty OUT")
    fh.add_argument("--debug", action="store_true", help="show tracebacks")

    c = sub.add_parser("checkpoint", help="inspect or consolidate a checkpoint")
    ck_sub = c.add_subparsers(dest="checkpoint_command", required=True)
    ci = ck_sub.add_parser("inspect", help="step, tokens, world size, tensors and sizes")
    ci.add_argument("path", help="a checkpoint folder or a run directory (its newest checkpoint)")
    ci.add_argument("--debug", action="store_true", help="show tracebacks")
    cc = ck_sub.add_parser("consolidate", help="write the model as one safetensors file")
    cc.add_argument("path", help="a checkpoint folder or a run directory (its newest checkpoint)")
    cc.add_argument("out", help="output .safetensors file, or a folder (model.safetensors in it)")
    cc.add_argument("--debug", action="store_true", help="show tracebacks")

    a = sub.add_parser("algorithms", help="list the algorithm plugins (name, stage, summary)")
    a.add_argument("--debug", action="store_true", help="show tracebacks")

    r = sub.add_parser("runs", help="look at runs (plot, ...)")
    runs_sub = r.add_subparsers(dest="runs_command", required=True)
    rp = runs_sub.add_parser("plot", help="draw a metric of one or several runs into a PNG")
    rp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (runs/NAME)")
    rp.add_argument("--metric", action="append", default=None,
                    help="metric name, e.g. train/loss (default); repeat for several panels")
    rp.add_argument("--out", default=None, help="PNG file (default: <metric>.png, / replaced by _)")
    rp.add_argument("--x", choices=["step", "tokens"], default="step", help="x axis")
    rp.add_argument("--width", type=int, default=1000, help="image width in pixels")
    rp.add_argument("--height", type=int, default=600, help="image height in pixels")
    rp.add_argument("--log-y", action="store_true", help="logarithmic y axis")
    rp.add_argument("--debug", action="store_true", help="show tracebacks")
    from llmforge.data.commands import add_parser as add_data_parser  # data prepare

    add_data_parser(sub)
    from llmforge.runs.commands import add_parsers  # launch, clusters, secrets, runs list/stop/...

    add_parsers(sub, runs_sub)
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
    # not actionable on every run: DTensor's RNG is CUDA-only (warned from its caller's module,
    # so matched by text), and Lightning's hint that srun exists on this machine
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
    warnings.filterwarnings("ignore", message="The `srun` command is available on your system")
    warnings.filterwarnings("ignore", message=".*_get_slice_mesh_layout.*|.*_rng_tracker.*")
    warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
    warnings.filterwarnings("ignore", message=".*Found a non-scalar tensor with numel=1 and ndim!=0.*")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def cmd_train(args: argparse.Namespace) -> int:
    """Load and resolve the run before the heavy imports (a typo fails in a fraction of a
    second), then build the Trainer: its one start-up sequence serves the dry run, the
    ``--nproc`` launcher's check and training."""
    from llmforge.config import load_config
    from llmforge.config.resolve import resolve_run
    from llmforge.errors import ConfigError

    cfg = load_config(args.config, args.overrides)
    if args.nproc is not None:
        if args.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
        cfg.trainer.devices = args.nproc  # the command line's input, like an override
    launcher = bool(args.nproc and args.nproc > 1 and not os.environ.get("WORLD_SIZE"))
    run = resolve_run(cfg, overwrite=args.overwrite, check_dir=not args.dry_run,
                      dry_run=args.dry_run)
    _quiet_libraries()
    from llmforge.training.trainer import Trainer

    trainer = Trainer(cfg, overwrite=args.overwrite, run=run)  # imports, strategy, algorithms
    if args.dry_run:
        from llmforge.training.dry_run import dry_run_report

        for note in run.notes:
            print(f"note            {note}")
        print(dry_run_report(trainer.cfg, run.plan, device_memory_gib=args.device_memory_gib))
        print(_pipeline_line(trainer))
        return 0
    if launcher:
        from llmforge.parallel.launch import launch_local

        argv = ["train", args.config, *args.overrides, f"trainer.devices={args.nproc}"]
        argv += ["--overwrite"] * args.overwrite + ["--debug"] * args.debug
        return launch_local(args.nproc, argv)
    summary = trainer.fit()
    if trainer.is_rank_zero():
        _print_summary(summary)
    return 0


def _static_checks(cfg: Any, world_size: int, dry_run: bool = False) -> tuple[Any, str]:
    """The checks ``llmforge train`` runs before training, for a job of ``world_size``
    processes (``trainer.devices`` per node) that runs elsewhere (``llmforge launch``): the same
    resolution and Trainer start-up, without looking at the run directory. ``dry_run``: files
    the config names (an HF folder, a tokenizer) may be missing here. Returns (plan, pipeline
    line).

    Raises:
        ConfigError: what the job would exit 2 with.
    """
    from llmforge.config.resolve import resolve_run
    from llmforge.training.trainer import Trainer

    env = {"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(cfg.trainer.devices)}
    run = resolve_run(cfg, check_dir=False, dry_run=dry_run, environ=env)
    return run.plan, _pipeline_line(Trainer(cfg, run=run))


def _pipeline_line(trainer: Any) -> str:
    """The model-transform order a run would apply (algorithms and the strategy's stages)."""
    from llmforge.algorithms.loading import pipeline_order
    from llmforge.parallel.transforms import strategy_transforms

    order = pipeline_order(trainer.cfg, trainer.algorithms, strategy_transforms(trainer.cfg, trainer.dims))
    return f"pipeline        build (meta) -> {' -> '.join(order + ['materialize'])}"


def cmd_algorithms(args: argparse.Namespace) -> int:
    from llmforge.algorithms.loading import available

    rows = available()
    width = max(len(r[0]) for r in rows)
    swidth = max(len(r[1]) for r in rows)
    for name, stage, summary in rows:
        print(f"{name:<{width}}  {stage:<{swidth}}  {summary}")
    return 0


def cmd_runs_plot(args: argparse.Namespace) -> int:
    from llmforge.runs.plot import plot_runs

    metrics = args.metric or ["train/loss"]
    out = args.out or metrics[0].replace("/", "_") + ".png"
    path = plot_runs(args.run_dirs, metrics, out, x=args.x, width=args.width, height=args.height,
                     log_y=args.log_y)
    print(f"wrote {path}")
    return 0


RUNS_COMMANDS = {"plot": cmd_runs_plot}


def cmd_runs(args: argparse.Namespace) -> int:
    """``llmforge runs SUBCOMMAND``: dispatch on :data:`RUNS_COMMANDS` (and run management's)."""
    from llmforge.runs.commands import RUN_COMMANDS

    return {**RUN_COMMANDS, **RUNS_COMMANDS}[args.runs_command](args)


def _print_summary(s: dict[str, Any]) -> None:
    minutes, seconds = divmod(int(s["seconds"]), 60)
    parts = [f"done: {s['steps']} steps, {s['tokens']:,} tokens in {minutes}m{seconds:02d}s"]
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
    from llmforge.errors import ConfigError
    from llmforge.generate import sample_text

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
                    chat=args.chat, use_cache=not args.no_cache, on_text=show, stats=stats)
    except ValueError as exc:
        raise LLMForgeError(str(exc)) from exc
    if not stats.get("started") and not args.chat:
        sys.stdout.write(args.prompt)
    print(flush=True)
    print(f"{stats['tokens']} tokens in {stats['seconds']:.2f} s ({stats['tokens_per_second']:.1f} "
          f"tokens/s, KV cache {'on' if stats['kv_cache'] else 'off'})", file=sys.stderr)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from torch import device as torch_device
    from torch.cuda import is_available as cuda_available

    from llmforge.errors import ConfigError
    from llmforge.evaluation.harness import parse_limit
    from llmforge.evaluation.run import evaluate_run

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
                       max_gen_toks=args.max_gen_toks, seed=args.seed, device=args.device)
    for key, value in sorted(out["scores"].items()):
        print(f"{key:40s} {value:.4f}")
    print(f"wrote {out['path']}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from llmforge.checkpoint.convert import from_hf, to_hf
    from llmforge.errors import ConfigError

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
        raise ConfigError(f"{out} already exists and is not empty; choose another output folder or "
                          "pass --overwrite to write into it")

    if args.convert_command == "to-hf":
        print(f"wrote {to_hf(args.path, args.out, args.dtype, adapters_only=args.adapters_only)}")
    else:
        print(f"wrote {from_hf(args.path, args.out)}")
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from llmforge.checkpoint.tools import consolidate, inspect_checkpoint

    if args.checkpoint_command == "inspect":
        print(inspect_checkpoint(args.path))
    else:
        print(f"wrote {consolidate(args.path, args.out)}")
    return 0


def _scrub(message: str) -> str:
    """An error message without URL credentials or the environment's credential values."""
    from llmforge.config.loader import redact

    return redact({"message": message})["message"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``llmforge`` script; returns the exit code."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if not hasattr(args, "overrides") or "=" not in a or a.startswith("-")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    from llmforge import signals
    from llmforge.runs.commands import RUN_COMMANDS, TOP_COMMANDS

    # before the heavy imports: a stop during startup loses nothing (see llmforge.signals)
    owns_signals = args.command == "train" and signals.install()
    handlers = {"train": cmd_train, "generate": cmd_generate, "algorithms": cmd_algorithms,
                "runs": cmd_runs, "checkpoint": cmd_checkpoint, "convert": cmd_convert, "eval": cmd_eval}
    handlers.update(TOP_COMMANDS)  # launch, clusters, secrets
    from llmforge.data.commands import cmd_data

    handlers["data"] = cmd_data
    try:
        light = args.command in TOP_COMMANDS or getattr(args, "runs_command", None) in RUN_COMMANDS
        if not light and args.command != "train":  # train quiets them after its config checks
            _quiet_libraries()  # run management imports neither datasets nor (mostly) torch
        return handlers[args.command](args)
    except LLMForgeError as exc:
        if args.debug:
            raise
        if isinstance(exc, signals.StopRequested):
            # our own message, no secrets; and no import here: the signal may have interrupted
            # one, leaving that module half-initialized (yaml, in CI)
            print(f"stopped: {exc}", file=sys.stderr)
            return exc.exit_code
        print(f"error: {_scrub(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and closed
        sys.stderr.close()
        return 0
    except Exception as exc:  # a bug or an input we did not foresee: one line, no traceback
        if args.debug:
            raise
        if isinstance(exc, OSError) and exc.filename is not None:  # a read/write error: exit 2
            from llmforge.paths import os_error_message

            print(f"error: {_scrub(os_error_message(exc))}", file=sys.stderr)
            return 2
        print(f"error: {type(exc).__name__}: {_scrub(str(exc))} (run again with --debug for the "
              "traceback)", file=sys.stderr)
        return 1
    finally:
        if owns_signals:  # an in-process caller (tests) gets its handlers back
            signals.uninstall()


if __name__ == "__main__":
    sys.exit(main())
