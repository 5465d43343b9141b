"""Checks of a loaded config that need arithmetic or sets of allowed values.

:func:`validate` is called once before building anything; it returns the :class:`BatchPlan`
(the batch arithmetic every other part uses) or raises :class:`~llmforge.errors.ConfigError`
naming the key and a fix. Nothing is rounded silently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any, Optional
from urllib.parse import urlsplit

from llmforge.config.batch_plan import BatchPlan, data_parallel_size, plan_batch, resolve_world
from llmforge.config.mixture import mixture_entries
from llmforge.config.parallel_schema import CONTEXT_PARALLEL_MODES, PIPELINE_SCHEDULES, PIPELINE_SPLITS
from llmforge.config.schema import (ACCELERATORS, DATA_FORMATS, DATA_SOURCES, DATA_TASKS,
                                    OPTIMIZER_IMPLEMENTATIONS, OPTIMIZERS, OVERLONG, PRECISIONS,
                                    SCHEDULES, STRATEGIES, TOKENIZER_TYPES, OptimizerConfig)
from llmforge.errors import ConfigError

__all__ = ["BatchPlan", "data_parallel_size", "plan_batch", "validate"]


def _one_of(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: expected one of {', '.join(allowed)}; got {value!r}")


def _require(ok: bool, key: str, rule: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key} must be {rule}, got {value!r}")


def check_entries(section: str, entries: Any) -> None:
    """Each entry of an ``algorithms`` / ``callbacks`` / ``loggers`` list is a mapping with a
    string ``name``.

    Raises:
        ConfigError: names ``section[i]`` and what is wrong (a glued ``key:value`` too).
    """
    for i, entry in enumerate(entries or []):
        if not isinstance(entry, Mapping):
            raise ConfigError(
                f"{section}[{i}]: expected a mapping like {{name: NAME, ...}}, got {entry!r}"
            )
        name = entry.get("name")
        glued = [k for k, v in entry.items() if v is None and ":" in str(k)]
        if name is None and glued:
            # OmegaConf reads a flow mapping's 'key:value' without a space as one key
            raise ConfigError(
                f"{section}[{i}]: '{glued[0]}' is read as one key with no value; write a space "
                f"after the colon, e.g. '{section}=[{{{str(glued[0]).replace(':', ': ', 1)}}}]'"
            )
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(
                f"{section}[{i}]: needs a string 'name' (a registered name or import path), "
                f"got {name!r}"
            )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_context_parallel(cfg: Any) -> None:
    """``strategy.cp`` and ``context_parallel:`` against the sequence and the other degrees
    (the checks against the model's heads are :func:`llmforge.parallel.context_parallel.check_context_parallel`'s)."""
    cp, mode = cfg.strategy.get("cp", 1), cfg.get("context_parallel", {}).get("mode", "all_gather")
    _one_of("context_parallel.mode", mode, CONTEXT_PARALLEL_MODES)
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ConfigError(f"strategy.cp must be an integer >= 1 (1 = no context parallelism), got {cp!r}")
    if cp == 1:
        return
    seq = int(cfg.trainer.seq_len)
    if seq % (2 * cp):
        fit = max(2 * cp, seq // (2 * cp) * 2 * cp)
        raise ConfigError(f"strategy.cp={cp} cuts every sequence into 2 x cp = {2 * cp} chunks (load "
                          f"balance of the causal mask), which must divide trainer.seq_len={seq}; "
                          f"use trainer.seq_len={fit} or a cp that divides it by 2 x cp")
    s = cfg.strategy
    if s.name in ("ddp", "single"):
        raise ConfigError(f"strategy.cp={cp} shards the model over dp_shard x cp with FSDP2; "
                          f"strategy.name={s.name} cannot: set strategy.name=fsdp2 (or auto)")
    if int(s.get("ep", 1)) > 1:
        raise ConfigError(f"strategy.cp={cp} with strategy.ep={s.ep} is not supported (expert "
                          "weights would need FSDP2 over efsdp x cp); set strategy.ep=1 or strategy.cp=1")
    if int(s.get("pp", 1)) > 1 and packed_sft(cfg.data):
        raise ConfigError(f"strategy.cp={cp} with strategy.pp={s.pp} takes rows without documents "
                          "(the schedule would need each micro-batch's document mask); set "
                          "data.packed=false, strategy.pp=1 or strategy.cp=1")


def packed_sft(data: Any) -> bool:
    """Whether ``data:`` packs SFT documents into rows (``task: sft``, ``packed`` not false):
    context parallelism with pipeline stages refuses those rows (no per-micro-batch document
    mask in the schedule)."""
    return data.get("task") == "sft" and bool(data.get("packed", True))


def _check_pipeline(p: Any) -> None:
    """``pipeline:`` values checked whatever ``strategy.pp`` (a typo at pp=1 surfaces when pp is
    raised, far from where it was written); the checks against the model and the batch are
    :func:`llmforge.parallel.pipeline.resolve_layout`'s."""
    _one_of("pipeline.schedule", p.schedule, PIPELINE_SCHEDULES)
    for key in ("microbatches", "stages_per_rank"):
        v = p.get(key)
        if v is not None:
            _require(_is_int(v) and v >= 1, f"pipeline.{key}", "an integer >= 1 or null (the default)", v)
    split = p.split
    if isinstance(split, str):
        _one_of("pipeline.split", split, PIPELINE_SPLITS)
        return
    ok = (isinstance(split, Sequence) and len(split) > 0
          and all(isinstance(st, Sequence) and not isinstance(st, str) and len(st) > 0
                  and all(_is_int(b) and b >= 0 for b in st) for st in split))
    if not ok:
        shown = list(split) if isinstance(split, Sequence) else split
        raise ConfigError(
            f"pipeline.split: expected balanced, lighter_ends or a list of block-index lists, one "
            f"non-empty list of integers >= 0 per stage, e.g. [[0, 1], [2, 3]]; got {shown!r}")


def check_parallel_keys(cfg: Any) -> None:
    """``pipeline:`` and ``context_parallel.mode`` checked on their own, whatever the degrees
    (``llmforge plan --layout`` sets the degrees itself and reads only these of the recipe).

    Raises:
        ConfigError: an unknown schedule, split or attention mode, stages or micro-batches
            below 1 (the message names the key).
    """
    _check_pipeline(cfg.pipeline)
    _one_of("context_parallel.mode", cfg.get("context_parallel", {}).get("mode", "all_gather"),
            CONTEXT_PARALLEL_MODES)


_WARNED: set[str] = set()

WARNINGS_SHOWN_ENV = "LLMFORGE_PREFLIGHT_WARNED"
"""Set (to ``1``) by the ``--nproc`` launcher for its workers: it has already printed the
pre-flight warnings of the same config, so the workers do not print them again."""


def warn_once(message: str) -> None:
    """Print ``warning: MESSAGE`` on stderr once per process, on global rank 0 only, and not
    in the workers of ``--nproc N`` (the launcher printed it: :data:`WARNINGS_SHOWN_ENV`)."""
    import os
    import sys

    if message in _WARNED or os.environ.get("RANK", "0") != "0" or os.environ.get(WARNINGS_SHOWN_ENV):
        return
    _WARNED.add(message)
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _warn_unused_muon_keys(opt: Any) -> None:
    """One warning naming the ``optimizer.muon_*`` keys set away from their defaults while
    another optimizer (which ignores them) is chosen."""
    given = [f"optimizer.{f.name}={getattr(opt, f.name)}" for f in fields(OptimizerConfig)
             if f.name.startswith("muon_") and getattr(opt, f.name, f.default) != f.default]
    if given:
        warn_once(f"{', '.join(given)} set, but optimizer.name={opt.name} ignores the muon_* keys; "
                  "set optimizer.name=muon to use them, or remove them")


def validate(cfg: Any, world_size: Optional[int] = 1) -> BatchPlan:
    """Check value ranges and allowed names, then return :func:`plan_batch`'s plan.

    ``world_size=None`` uses ``trainer.devices * trainer.num_nodes``.

    Raises:
        ConfigError: the first invalid setting, naming its key (e.g. ``trainer.max_steps``,
            ``scheduler.name``, ``algorithms[1]``), or a batch/strategy arithmetic error.
    """
    t, sch, opt = cfg.trainer, cfg.scheduler, cfg.optimizer
    _require(t.max_steps > 0, "trainer.max_steps", "> 0", t.max_steps)
    _require(t.seq_len > 0, "trainer.seq_len", "> 0", t.seq_len)
    _require(t.micro_batch_size > 0, "trainer.micro_batch_size", "> 0", t.micro_batch_size)
    _require(t.global_batch_size > 0, "trainer.global_batch_size", "> 0", t.global_batch_size)
    _one_of("trainer.precision", t.precision, tuple(PRECISIONS))
    _require(t.log_every > 0, "trainer.log_every", "> 0", t.log_every)
    _require(t.eval_every >= 0, "trainer.eval_every", ">= 0 (0 = only at the end)", t.eval_every)
    _require(t.eval_batches > 0, "trainer.eval_batches", "> 0", t.eval_batches)
    if t.gradient_clip_val is not None:
        _require(t.gradient_clip_val > 0, "trainer.gradient_clip_val", "> 0 or null", t.gradient_clip_val)
    _require(t.devices >= 1, "trainer.devices", ">= 1", t.devices)
    _require(t.num_nodes >= 1, "trainer.num_nodes", ">= 1", t.num_nodes)

    _require(0 < opt.lr < float("inf"), "optimizer.lr", "> 0 and finite", opt.lr)
    _require(len(opt.betas) == 2 and all(0 <= b < 1 for b in opt.betas), "optimizer.betas",
             "two numbers in [0, 1), e.g. [0.9, 0.95]", list(opt.betas))
    _require(0 < opt.eps < 1, "optimizer.eps", "in (0, 1), e.g. 1e-8", opt.eps)
    _require(opt.weight_decay >= 0, "optimizer.weight_decay", ">= 0", opt.weight_decay)
    _one_of("optimizer.name", opt.name, OPTIMIZERS)
    _one_of("optimizer.implementation", opt.implementation, OPTIMIZER_IMPLEMENTATIONS)
    if opt.muon_lr is not None:
        _require(0 < opt.muon_lr < float("inf"), "optimizer.muon_lr", "> 0 and finite, or null", opt.muon_lr)
    _require(0 <= opt.muon_momentum < 1, "optimizer.muon_momentum", "in [0, 1), e.g. 0.95", opt.muon_momentum)
    _require(opt.muon_ns_dtype in (None, "bfloat16", "float32"), "optimizer.muon_ns_dtype",
             "bfloat16, float32 or null", opt.muon_ns_dtype)
    _require(0 < opt.muon_ns_steps < 100, "optimizer.muon_ns_steps", "in [1, 99], e.g. 5", opt.muon_ns_steps)
    if opt.name != "muon":
        _warn_unused_muon_keys(opt)
    _require(0 <= cfg.run.seed < 2**32, "run.seed", "in [0, 2**32)", cfg.run.seed)
    _require(cfg.data.num_workers >= 0, "data.num_workers", ">= 0", cfg.data.num_workers)
    _require(cfg.data.max_documents is None or cfg.data.max_documents > 0, "data.max_documents",
             "> 0 or null", cfg.data.max_documents)
    _one_of("trainer.accelerator", t.accelerator, ACCELERATORS)
    _one_of("scheduler.name", sch.name, SCHEDULES)
    _require(t.gc_every >= 0, "trainer.gc_every", ">= 0 (0 = Python's own collector)", t.gc_every)
    _require(sch.warmup_steps >= 0, "scheduler.warmup_steps", ">= 0", sch.warmup_steps)
    if sch.warmup_steps > t.max_steps:
        # one rule for every length: a tenth of the steps, at least one
        warn_once(f"scheduler.warmup_steps ({sch.warmup_steps}) > trainer.max_steps "
                  f"({t.max_steps}): the learning rate only warms up and never reaches "
                  f"optimizer.lr; for a whole schedule warm up for about a tenth of the steps: "
                  f"scheduler.warmup_steps={max(1, t.max_steps // 10)}")
    _require(0 <= sch.min_lr_ratio <= 1, "scheduler.min_lr_ratio", "in [0, 1]", sch.min_lr_ratio)
    _require(0 < sch.decay_fraction <= 1, "scheduler.decay_fraction", "in (0, 1]", sch.decay_fraction)

    _one_of("strategy.name", cfg.strategy.name, STRATEGIES)
    if cfg.get("pipeline") is not None:
        _check_pipeline(cfg.pipeline)
    if cfg.strategy.name == "ddp" and cfg.strategy.get("ep", 1) != 1:
        raise ConfigError(f"strategy.ep={cfg.strategy.ep} borrows ranks of the FSDP2 shard group, "
                          "which strategy.name=ddp does not have; set strategy.name=fsdp2 (or auto)")
    _check_context_parallel(cfg)
    _one_of("data.source", cfg.data.source, DATA_SOURCES)
    if cfg.data.format is not None:  # the readers compare exact names (data.format=MDS read as files)
        _one_of("data.format", cfg.data.format, DATA_FORMATS)
    vf = cfg.data.val_fraction
    _require(0 <= vf < 1, "data.val_fraction", "in [0, 1)", vf)
    _one_of("tokenizer.type", cfg.tokenizer.type, TOKENIZER_TYPES)
    _one_of("data.task", cfg.data.task, DATA_TASKS)
    if cfg.data.mixture:
        if cfg.data.task != "pretrain":
            raise ConfigError(f"data.mixture mixes pretraining sources: data.task={cfg.data.task} "
                              "reads one source; drop data.mixture or set data.task=pretrain")
        mixture_entries(cfg)  # each entry's keys, source, path, weight and name
    if cfg.data.task == "sft":
        _one_of("data.overlong", cfg.data.overlong, OVERLONG)
        if cfg.data.source not in ("files", "hub"):
            raise ConfigError(f"data.task=sft reads jsonl/parquet files or a Hub dataset: set "
                              f"data.source=files (or hub) and data.path (got data.source="
                              f"{cfg.data.source})")
        if cfg.data.streaming:
            raise ConfigError("data.task=sft tokenizes its examples up front; set "
                              "data.streaming=false")
        if cfg.data.val_split and cfg.data.source != "hub":
            raise ConfigError("data.task=sft with files holds out data.val_fraction of the "
                              "examples; set data.val_split=null")

    ck = cfg.checkpoint
    if ck.save_every is not None:
        _require(ck.save_every > 0, "checkpoint.save_every", "> 0 or null", ck.save_every)
    if ck.keep_last_n is not None:
        _require(ck.keep_last_n > 0, "checkpoint.keep_last_n", "> 0 or null", ck.keep_last_n)
    if ck.save_every_minutes is not None:
        _require(0 < ck.save_every_minutes < float("inf"), "checkpoint.save_every_minutes",
                 "> 0 and finite, or null (off)", ck.save_every_minutes)
    if t.num_threads is not None:
        _require(t.num_threads >= 1, "trainer.num_threads", ">= 1 or null (auto)", t.num_threads)

    for section in ("algorithms", "callbacks", "loggers"):
        check_entries(section, getattr(cfg, section))
    if cfg.get("fault_tolerance") is not None and cfg.fault_tolerance.enabled:
        _check_fault_tolerance(cfg, resolve_world(cfg, world_size))
    return plan_batch(cfg, world_size)


FT_TIMEOUT_MAX_S = 7 * 24 * 3600.0
"""The longest ``fault_tolerance`` timeout taken (a week): torchft converts each into a duration,
and 1e12 s panics in its Rust client, 1e15 s overflows in Python."""


def _check_fault_tolerance(cfg: Any, world: int) -> None:
    """``fault_tolerance:`` against itself and the run: what this version supports (one
    process per replica group, data whose position is the step). The lighthouse is reached at
    the run's start (:func:`llmforge.parallel.lighthouse.check_lighthouse`)."""
    ft = cfg.fault_tolerance
    _require(_is_int(ft.replica_groups) and ft.replica_groups >= 1, "fault_tolerance.replica_groups",
             "an integer >= 1", ft.replica_groups)
    _require(_is_int(ft.min_replicas) and 1 <= ft.min_replicas, "fault_tolerance.min_replicas",
             "an integer >= 1", ft.min_replicas)
    if ft.min_replicas > ft.replica_groups:
        raise ConfigError(f"fault_tolerance.min_replicas ({ft.min_replicas}) must be <= "
                          f"fault_tolerance.replica_groups ({ft.replica_groups}): no quorum could "
                          f"ever commit a step; e.g. fault_tolerance.min_replicas=1")
    _require(_is_int(ft.replica_id) and 0 <= ft.replica_id < ft.replica_groups,
             "fault_tolerance.replica_id", f"in [0, {ft.replica_groups - 1}] (one per replica group)",
             ft.replica_id)
    for key in ("timeout_s", "quorum_timeout_s", "first_quorum_timeout_s"):
        v = ft[key]  # torchft turns them into durations: a huge one overflows (or panics) there
        _require(0 < v <= FT_TIMEOUT_MAX_S, f"fault_tolerance.{key}",
                 f"> 0 and at most {FT_TIMEOUT_MAX_S:.0f} (seconds: a week)", v)
    try:  # urlsplit and .port raise ValueError on "http://[::1" or a port past 65535
        parts = urlsplit(str(ft.lighthouse))
        good = (parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port is not None
                and 0 < parts.port < 65536 and "@" not in parts.netloc)  # no user:password@
    except ValueError:
        good = False
    if not good:
        raise ConfigError(f"fault_tolerance.lighthouse must be an address http://HOST:PORT (PORT "
                          f"1-65535, no user:password@; where `torchft_lighthouse --bind HOST:PORT` "
                          f"listens), got {ft.lighthouse!r}")
    st = cfg.strategy
    # FSDP2 over the group's processes (the group's shard dimension; across groups torchft's
    # managed group is the replicate dimension); nothing else inside a group
    fsdp_only = (st.name in ("auto", "fsdp2") and int(st.dp_replicate) == 1 and int(st.tp) == 1
                 and int(st.pp) == 1 and int(st.get("cp", 1)) == 1 and int(st.get("ep", 1)) == 1)
    if not (world == 1 and st.name in ("auto", "single")) and not (world > 1 and fsdp_only):
        raise ConfigError(
            f"fault_tolerance.enabled: a replica group runs one process or FSDP2 over its "
            f"processes, but strategy.name={st.name} (dp_replicate={st.dp_replicate}, tp={st.tp}, "
            f"pp={st.pp}, cp={st.get('cp', 1)}, ep={st.get('ep', 1)}) on {world} processes was asked "
            "for: DDP, TP, PP, CP, EP or "
            "dp_replicate inside a replica group are not supported (see docs/fault_tolerance.md); "
            "use strategy.name=fsdp2 (or auto) with dp_replicate=1 inside each group, and "
            "fault_tolerance.replica_groups for the replicate dimension")
    if cfg.data.streaming or cfg.data.mixture or cfg.data.task != "pretrain":
        raise ConfigError(
            "fault_tolerance.enabled needs data whose position is the step (in-memory "
            "pretraining windows) so a rejoining group reads exactly its next batch; "
            "data.streaming, data.mixture and data.task=sft are not supported with it yet")
