"""The ``llmforge`` command line's argument parser (``train``, ``generate``, ``eval``,
``convert``, ``checkpoint``, ``algorithms``, ``runs plot``; ``data`` and run management add
their own subparsers). The handlers are in :mod:`llmforge.cli.handlers`, dispatch in
:mod:`llmforge.cli`."""

from __future__ import annotations

import argparse

from llmforge import __version__
from llmforge.cli.common_args import add_debug
from llmforge.cli.data_commands import add_parser as add_data_parser  # data prepare
from llmforge.cli.runs_commands import add_parsers  # launch, clusters, secrets, runs list/stop/...
from llmforge.planning.command import add_parser as add_plan_parser

__all__ = ["_parser"]


def add_trust_code(p: argparse.ArgumentParser) -> None:
    """``--trust-code``: a command that loads a run directory may import what its config names."""
    p.add_argument("--trust-code", action="store_true",
                   help="import the research code the run's config.yaml names (imports:, an import "
                        "path in model.name or algorithms:) from PYTHONPATH; without it only "
                        "built-in and registered names load (a run directory is data)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmforge", description="Train language models (Llama 3, Qwen3, Qwen3-MoE, your own) from one YAML.")
    p.add_argument("--version", action="version", version=f"llmforge {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train from a YAML config")
    t.add_argument("config", help="YAML file (e.g. yamls/demo_cpu.yaml)")
    t.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.max_steps=100")
    t.add_argument("--dry-run", action="store_true",
                   help="build the model on the meta device, print sizes and exit")
    t.add_argument("--simulate", action="store_true",
                   help="with --dry-run: also run one training step of rank 0 (and, with "
                        "pipeline stages, of the last stage's rank) at the run's world size on a "
                        "fake process group with fake tensors and report its measured memory, "
                        "collectives and FLOPs beside the estimate (docs/scale.md)")
    t.add_argument("--device-memory-gib", type=float, default=None, metavar="GIB",
                   help="with --dry-run: memory of one device for the fit verdict of adapter "
                        "configs (default: 80 and 192)")
    t.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="run N local processes (torchrun's launcher; gloo on CPU, NCCL on GPUs)")
    t.add_argument("--overwrite", action="store_true",
                   help="delete an existing run directory of the same run.name first (only one "
                        "llmforge made: docs/guarantees.md, 'What --overwrite deletes')")
    add_debug(t)

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
    add_trust_code(g)
    add_debug(g)

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
    add_trust_code(e)
    add_debug(e)

    v = sub.add_parser("convert", help="Hugging Face <-> llmforge weights; LLM Foundry YAMLs")
    cv_sub = v.add_subparsers(dest="convert_command", required=True)
    th = cv_sub.add_parser("to-hf", help="write config.json + safetensors + tokenizer for transformers")
    th.add_argument("path", help="run directory or checkpoint folder")
    th.add_argument("out", help="output folder")
    th.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="cast weights (default: as trained; merged adapter weights: float32)")
    th.add_argument("--adapters-only", action="store_true",
                    help="adapter runs: write only the adapters in PEFT's format (adapter_config.json + "
                         "adapter_model.safetensors) instead of merged weights")
    th.add_argument("--overwrite", action="store_true",
                    help="replace an earlier export in OUT (only a folder llmforge exported)")
    add_trust_code(th)
    add_debug(th)
    fh = cv_sub.add_parser("from-hf", help="turn a Hugging Face folder (Llama, Qwen3) into an "
                           "llmforge run directory")
    fh.add_argument("path", help="Hugging Face folder (config.json, *.safetensors, tokenizer.json)")
    fh.add_argument("out", help="output run directory (usable by generate and model.init_from)")
    fh.add_argument("--overwrite", action="store_true",
                    help="replace the llmforge run in OUT (never one that holds PATH)")
    add_debug(fh)

    ff = cv_sub.add_parser("foundry", help="turn an LLM Foundry (Composer) training YAML into an "
                           "llmforge YAML, with a report of every key (docs/migrating_from_composer.md)")
    ff.add_argument("path", metavar="IN.yaml", help="the LLM Foundry training YAML")
    ff.add_argument("-o", "--out", default=None, metavar="OUT.yaml",
                    help="write the llmforge YAML here (default: print it) and the report to stdout")
    ff.add_argument("--steps-per-epoch", type=int, default=None, metavar="N",
                    help="optimizer steps in one pass over the training data (for times in ep)")
    ff.add_argument("--prepared", default=None, metavar="DIR",
                    help="where `llmforge data prepare` writes an MDS loader's token shards "
                         "(default: the MDS folder + -llmforge)")
    ff.add_argument("--overwrite", action="store_true", help="replace OUT.yaml if it exists")
    add_debug(ff)

    c = sub.add_parser("checkpoint", help="inspect or consolidate a checkpoint")
    ck_sub = c.add_subparsers(dest="checkpoint_command", required=True)
    ci = ck_sub.add_parser("inspect", help="step, tokens, world size, tensors and sizes")
    ci.add_argument("path", help="a checkpoint folder or a run directory (its newest checkpoint)")
    add_debug(ci)
    cc = ck_sub.add_parser("consolidate", help="write the model as one safetensors file")
    cc.add_argument("path", help="a checkpoint folder or a run directory (its newest checkpoint)")
    cc.add_argument("out", help="output .safetensors file, or a folder (model.safetensors in it)")
    cc.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    add_debug(cc)

    a = sub.add_parser("algorithms", help="list the algorithm plugins (name, stage, summary)")
    add_debug(a)

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
    add_debug(rp)
    add_data_parser(sub)
    add_plan_parser(sub)  # plan
    add_parsers(sub, runs_sub)
    return p
