"""``llmforge data prepare CONFIG_OR_SOURCE OUT [key=value ...]``: the CLI of
:func:`llmforge.data.prepare.prepare`.

``CONFIG_OR_SOURCE`` is a run's YAML (its ``data:`` and ``tokenizer:`` sections are used, with
the overrides) or a file, glob or URL of documents (``data.source=files``, the default
tokenizer unless overridden, e.g. ``tokenizer.type=huggingface tokenizer.path=...``), or an MDS
folder (mosaicml-streaming's format: ``data.format=mds`` is set, see :mod:`llmforge.data.mds`).
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any, Optional

from llmforge import signals
from llmforge.errors import ConfigError
from llmforge.paths import resolve_dotdot


def add_parser(sub: Any) -> None:
    """Add ``data prepare`` to the top-level subparsers ``sub``."""
    d = sub.add_parser("data", help="prepare token shards from a corpus")
    d_sub = d.add_subparsers(dest="data_command", required=True)
    p = d_sub.add_parser("prepare", help="tokenize a corpus once into token shards (data.source: prepared)")
    p.add_argument("source", metavar="CONFIG_OR_SOURCE",
                   help="a run's YAML, or documents: a file, glob or URL (txt, jsonl, parquet, csv), "
                        "or an MDS folder (LLM Foundry's shards; docs/data.md)")
    p.add_argument("out", metavar="OUT", help="output folder (new, empty, or an interrupted prepare), "
                   "or an fsspec URL (s3://bucket/out, gs://...: prepared locally, then uploaded)")
    p.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. tokenizer.vocab_size=32000")
    p.add_argument("--workers", type=int, default=None,
                   help="tokenizing processes (default: every core; 1 = in this process)")
    p.add_argument("--docs-per-shard", type=int, default=10_000, help="documents per shard file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def load_prepare_config(source: str, overrides: list[str]) -> Any:
    """The run config whose ``data:`` and ``tokenizer:`` a prepare uses.

    Raises:
        ConfigError: as :func:`llmforge.config.load_config`.
    """
    # the config machinery (omegaconf, yaml) when the command runs: `llmforge --help` stays fast
    from llmforge.config import load_config
    from llmforge.config.overrides import _apply_override
    from llmforge.config.schema import TrainConfig
    from llmforge.data.mds import is_mds  # numpy, datasets: after --help

    if source.endswith((".yaml", ".yml")):
        return load_config(source, overrides)
    from omegaconf import OmegaConf

    cfg = OmegaConf.structured(TrainConfig)
    mds = ["data.format=mds"] if is_mds(source) else []  # LLM Foundry's MDS folder (docs/data.md)
    for item in ["data.source=files", f"data.path={source}", *mds, *overrides]:
        _apply_override(cfg, item)
    OmegaConf.resolve(cfg)
    return cfg


def _check_preparable(cfg: Any) -> None:
    """``data prepare`` tokenizes one pretraining document source.

    Raises:
        ConfigError: a mixture, an already prepared source or an SFT config (names the key).
    """
    if cfg.data.get("mixture"):
        raise ConfigError("data.mixture: `data prepare` prepares one source; prepare each entry into "
                          "its own folder (llmforge data prepare ENTRY_PATH OUT) and list the folders "
                          "as prepared entries (docs/data.md)")
    if cfg.data.source == "prepared":
        raise ConfigError(f"data.source=prepared: {cfg.data.path} is prepared already; `data prepare` "
                          "reads documents (data.source files, hub or shakespeare)")
    if cfg.data.task != "pretrain":
        raise ConfigError(f"data.task={cfg.data.task}: `data prepare` writes pretraining token shards; "
                          "an SFT run tokenizes its examples itself (train on the jsonl directly)")


def cmd_data(args: argparse.Namespace) -> int:
    """``data prepare``; a stop signal at any moment (llmforge.signals) says the command stopped
    and that running it again continues (exit 75 for SIGTERM/SIGUSR1, 130 for SIGINT)."""
    from llmforge.config.redaction import scrub_url_credentials  # omegaconf: after --help

    out = scrub_url_credentials(str(args.out))

    def stopped(signum: Optional[int]) -> str:  # built here: the signal handler imports nothing
        name = signal.Signals(signum).name if signum else "a stop signal"
        return (f"received {name}: `data prepare` stopped; the shards finished in {out} are kept: "
                "run the same command again to continue")

    signals.describe_startup_stop(stopped)  # what the process's own command line prints
    try:
        return _prepare_command(args)
    except signals.StoppedBeforeTraining as exc:  # the CLI prints "stopped: ..."
        raise signals.StopRequested(stopped(exc.signum), exc.exit_code, exc.signum) from None


def _prepare_command(args: argparse.Namespace) -> int:
    from llmforge.config.redaction import scrub_url_credentials  # omegaconf: after --help
    from llmforge.data.prepare import prepare  # heavy (datasets, torch): after the config's errors

    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    cfg = load_prepare_config(args.source, list(args.overrides))
    _check_preparable(cfg)
    if "://" not in str(args.out):  # a local 'new/../prep' without new/: the folder 'prep'
        args.out = str(resolve_dotdot(args.out))
    manifest = prepare(cfg, args.out, workers=args.workers, docs_per_shard=args.docs_per_shard,
                       show_progress=not args.no_progress and sys.stderr.isatty())
    out = scrub_url_credentials(str(args.out))  # s3://KEY:SECRET@bucket/x: never printed
    train = manifest["splits"]["train"]
    val = manifest["splits"].get("val", {"tokens": 0, "documents": 0})
    print(f"wrote {out}: {train['tokens']:,} training tokens ({train['documents']:,} documents, "
          f"{len(train['shards'])} shard{'s' * (len(train['shards']) != 1)}), {val['tokens']:,} "
          f"validation tokens; tokenized in {manifest['seconds']:.1f}s; tokenizer fingerprint "
          f"{manifest['tokenizer']['fingerprint']}")
    if not val["documents"] and cfg.data.val_fraction > 0 and not cfg.data.val_split:
        # the streaming hold-out picks documents by their hash: a corpus of few documents can
        # come out with none, and a run on it would not evaluate
        print(f"note: no document of {train['documents']:,} was held out for validation "
              f"(data.val_fraction={cfg.data.val_fraction}), so a run on {out} will not evaluate; "
              "prepare again with a larger data.val_fraction or give data.val_split", file=sys.stderr)
    print(f"train on it: llmforge train CONFIG data.source=prepared data.path={out}")
    return 0
