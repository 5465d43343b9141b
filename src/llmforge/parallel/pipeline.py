"""Pipeline parallelism: the model's repeated blocks cut into stages over the mesh's ``pp`` dim.

The stages are the model itself, pruned (torchtitan's ``components/pipeline`` approach): every
pipeline rank builds the whole model on the meta device and keeps the blocks of its own stages,
in an ``nn.ModuleDict`` keyed by their index in the whole model, so parameter names (DCP keys,
optimizer state keys) stay the model's own: ``layers.5.attention.wq.weight`` on whatever rank
holds block 5, and a checkpoint saved with ``pp=2`` loads at ``pp=1`` or ``pp=4``. The first
stage keeps the embedding, the last the final norm and output (which modules those are is the
spec's :attr:`~llmforge.models.spec.ModelSpec.stage_ends`); on the other stages they are ``None``.

A rank holds ``stages_per_rank`` stages (virtual stages, for the interleaved and V schedules):
its model is the union of their blocks (what the other parallel transforms, the optimizer and the
checkpoint see), and each stage is a *view* of it (:func:`stage_view`: a shallow copy that shares
the modules, so gradients land in the model's parameters) run by
:class:`torch.distributed.pipelining.PipelineStage` under one of the library's schedules
(:mod:`llmforge.parallel.schedule`).

This module knows nothing of YAML: callers pass the ``pipeline:`` section's values.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed.pipelining as pipelining
from torch import nn

from llmforge.errors import ConfigError

__all__ = ["SCHEDULE_CLASSES", "PipelineLayout", "bubble_fraction", "last_stage_pp_rank", "min_microbatches",
           "rank_stages", "split_blocks", "resolve_layout",
           "prune_model", "stage_view", "stage_params", "apply_pipeline_split", "MULTI_STAGE"]

SCHEDULE_CLASSES = {"1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
                    "gpipe": "ScheduleGPipe", "zbv": "ScheduleZBVZeroBubble",
                    "dualpipev": "ScheduleDualPipeV"}
"""``pipeline.schedule`` -> the class name in ``torch.distributed.pipelining``."""
MULTI_STAGE = ("interleaved_1f1b", "zbv", "dualpipev")
"""Schedules that take a list of stages per rank."""
_V_SHAPED = ("zbv", "dualpipev")  # exactly 2 stages per rank, rank r holds r and 2p - 1 - r


def _installed_schedules() -> tuple[str, ...]:
    return tuple(k for k, cls in SCHEDULE_CLASSES.items() if hasattr(pipelining, cls))


def last_stage_pp_rank(schedule: str, pp: int) -> int:
    """The ``pp`` rank that holds the last stage (the output layer and the loss): ``0`` for the
    V schedules (rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``), else ``pp - 1``."""
    return 0 if schedule in _V_SHAPED else pp - 1


def rank_stages(schedule: str, stages_per_rank: Optional[int]) -> int:
    """Stages one rank holds: ``pipeline.stages_per_rank``, or when ``None`` the schedule's
    default (2 for ``interleaved_1f1b``, ``zbv`` and ``dualpipev``, else 1)."""
    return (2 if schedule in MULTI_STAGE else 1) if stages_per_rank is None else int(stages_per_rank)


def min_microbatches(schedule: str, pp: int) -> int:
    """The fewest micro-batches per step ``schedule`` runs on ``pp`` ranks: one for GPipe, two
    per rank for the V schedules (ZBV, DualPipeV), one per rank otherwise (else stages idle or
    the schedule cannot fill)."""
    return {"gpipe": 1, "zbv": 2 * pp, "dualpipev": 2 * pp}.get(schedule, pp)


def bubble_fraction(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle share of a pipeline step, with equal forward and backward times per stage.

    * ``1f1b``, ``gpipe``: ``(p - 1) / (m + p - 1)``: each rank idles ``p - 1`` stage-slots of
      the ``m + p - 1`` a step takes (Narayanan et al. 2021, "Efficient Large-Scale Language
      Model Training on GPU Clusters Using Megatron-LM", §2.2.1, whose ratio of idle to ideal
      time is ``(p - 1) / m``).
    * ``interleaved_1f1b``: ``(p - 1) / (v m + p - 1)``: ``v`` virtual stages per rank cut the
      idle time by ``v`` (ibid. §2.2.2: ``(1 / v) (p - 1) / m``).
    * ``zbv``, ``dualpipev``: 0 when ``m >= 2p`` and the forward, input-gradient and
      weight-gradient passes take equal times (Qi et al. 2023, "Zero Bubble Pipeline
      Parallelism", arXiv:2401.10241 §6, ZB-V); with fewer micro-batches the warm-up is not
      filled and the 1F1B value over ``2p`` stages is returned as an upper estimate.

    Returns 0.0 for ``pp == 1``.
    """
    p, m, v = int(pp), int(microbatches), int(stages_per_rank)
    if p <= 1:
        return 0.0
    if schedule in _V_SHAPED:
        return 0.0 if m >= 2 * p else (p - 1) / (2 * m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (m + p - 1)


def _counts_to_split(counts: Sequence[int]) -> list[list[int]]:
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def split_blocks(n_blocks: int, n_stages: int, split: Any, stages_per_rank: int = 1,
                 world_size: Optional[int] = None) -> list[list[int]]:
    """Block indices of each of ``n_stages`` stages (stage order = model order).

    Args:
        split: ``"balanced"`` (``n_blocks / n_stages`` each), ``"lighter_ends"`` (the first and
            the last stage one block fewer: the embedding and the output layer count as one
            block each, so ``n_blocks + 2`` is divided evenly) or an explicit list of block-index
            lists, one per stage, together ``0 .. n_blocks - 1`` in order.
        stages_per_rank, world_size: only for the message (the pp degrees that would work:
            those that also divide ``world_size``).

    Raises:
        ConfigError: the stages do not divide the blocks (the message names the numbers and the
            pp degrees that do), or an explicit split that is not ``n_stages`` non-empty
            consecutive runs covering every block once.
    """
    v = max(1, int(stages_per_rank))
    units = n_blocks + 2  # lighter_ends: the embedding and the output count as a block each

    def lighter_ok(stages: int) -> bool:
        return stages >= 2 and units % stages == 0 and units // stages >= 2

    def fits(ok_stages: Any) -> str:
        ok = [d // v for d in range(v, n_blocks + 1, v) if ok_stages(d)
              and (world_size is None or world_size % (d // v) == 0)]
        return ", ".join(map(str, ok))

    def fixes(this: str, degrees: str) -> str:
        """Only the fixes that work for these stages and blocks: the degrees, then the splits."""
        fixes = [f"strategy.pp in [{degrees}] with {v} stage(s) per rank"] if degrees else []
        if this != "balanced" and n_blocks % n_stages == 0:
            fixes.append("pipeline.split=balanced")
        if this != "lighter_ends" and lighter_ok(n_stages):
            fixes.append("pipeline.split=lighter_ends")
        if n_stages <= n_blocks:
            fixes.append(f"an explicit pipeline.split list of {n_stages} runs of blocks")
        else:
            fixes.append(f"a model of {n_stages} or more blocks (a stage holds at least one)")
        return "use " + ", ".join(fixes[:-1]) + (", or " if len(fixes) > 1 else "") + fixes[-1]

    if isinstance(split, str):
        if split == "balanced":
            if n_blocks % n_stages:
                raise ConfigError(
                    f"strategy.pp x pipeline.stages_per_rank = {n_stages} stages do not divide the "
                    f"model's {n_blocks} blocks evenly (pipeline.split=balanced); "
                    f"{fixes('balanced', fits(lambda d: n_blocks % d == 0))}")
            return _counts_to_split([n_blocks // n_stages] * n_stages)
        if split == "lighter_ends":
            if not lighter_ok(n_stages):
                raise ConfigError(
                    f"pipeline.split=lighter_ends: {n_stages} stages must divide the model's "
                    f"{n_blocks} blocks + 2 (embedding, output) = {units} into parts of 2 or more; "
                    f"{fixes('lighter_ends', fits(lighter_ok))}")
            counts = [units // n_stages] * n_stages
            counts[0] -= 1
            counts[-1] -= 1
            return _counts_to_split(counts)
        raise ConfigError(f"pipeline.split: expected balanced, lighter_ends or a list of "
                          f"block-index lists; got {split!r}")
    stages = [list(map(int, s)) for s in split]
    flat = [i for s in stages for i in s]
    if len(stages) != n_stages or any(not s for s in stages) or flat != list(range(n_blocks)):
        raise ConfigError(
            f"pipeline.split: an explicit split needs {n_stages} non-empty lists (strategy.pp x "
            f"stages per rank) that together list blocks 0..{n_blocks - 1} once, in order; got "
            f"{stages}, e.g. {_counts_to_split([n_blocks // n_stages] * n_stages) if n_blocks % n_stages == 0 else '[[0, 1], [2, 3]]'}")
    return stages


@dataclass(frozen=True)
class PipelineLayout:
    """A resolved pipeline: ``pp`` ranks x ``stages_per_rank`` stages, ``microbatches`` per step,
    ``split[s]`` the block indices of stage ``s``."""

    schedule: str
    pp: int
    stages_per_rank: int
    microbatches: int
    split: tuple[tuple[int, ...], ...]

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stages_of_rank(self, rank: int) -> list[int]:
        """Stage indices rank ``rank`` holds: ``rank, rank + p, ...`` (loop order), or ``rank``
        and ``2p - 1 - rank`` for the V schedules (the first rank holds the first and the last
        stage)."""
        if self.schedule in _V_SHAPED:
            return [rank, 2 * self.pp - 1 - rank]
        return [rank + k * self.pp for k in range(self.stages_per_rank)]

    def last_stage_rank(self) -> int:
        """The ``pp`` rank that holds the last stage (where the loss is): ``pp - 1``, or ``0``
        for the V schedules."""
        return last_stage_pp_rank(self.schedule, self.pp)

    def bubble(self) -> float:
        """:func:`bubble_fraction` of this layout."""
        return bubble_fraction(self.schedule, self.pp, self.microbatches, self.stages_per_rank)


def resolve_layout(schedule: str, pp: int, n_blocks: int, local_batch_size: int,
                   microbatches: Optional[int], stages_per_rank: Optional[int], split: Any,
                   default_microbatches: int, world_size: Optional[int] = None) -> PipelineLayout:
    """Check the pipeline settings against the model and the batch; return the layout.

    Args:
        local_batch_size: sequences per optimizer step on one data-parallel rank.
        default_microbatches: ``pipeline.microbatches`` when ``microbatches`` is None (the
            gradient-accumulation micro-batches).
        world_size: the job's processes (the pp degrees a message suggests divide it).

    Raises:
        ConfigError: a schedule the installed torch lacks, stages per rank the schedule cannot
            run, stages that do not divide the blocks (:func:`split_blocks`), micro-batches that
            do not divide the batch or are fewer than the schedule needs; each message names
            the key, the numbers and the nearest valid values.
    """
    installed = _installed_schedules()
    if schedule not in SCHEDULE_CLASSES:
        raise ConfigError(f"pipeline.schedule: expected one of {', '.join(SCHEDULE_CLASSES)}; got "
                          f"{schedule!r}")
    if schedule not in installed:
        raise ConfigError(f"pipeline.schedule={schedule}: torch {torch.__version__} has no "
                          f"{SCHEDULE_CLASSES[schedule]}; use one of {', '.join(installed)}")
    v = rank_stages(schedule, stages_per_rank)
    if schedule in _V_SHAPED and v != 2:
        raise ConfigError(f"pipeline.stages_per_rank={v}: pipeline.schedule={schedule} runs exactly "
                          "2 stages per rank; set pipeline.stages_per_rank=2 (or null)")
    if schedule == "interleaved_1f1b" and v < 2:
        raise ConfigError(f"pipeline.stages_per_rank={v}: interleaved_1f1b needs 2 or more stages "
                          "per rank; set pipeline.stages_per_rank=2, or pipeline.schedule=1f1b")
    if schedule in ("1f1b", "gpipe") and v != 1:
        raise ConfigError(f"pipeline.stages_per_rank={v}: pipeline.schedule={schedule} runs one stage "
                          "per rank; set pipeline.stages_per_rank=1, or pipeline.schedule=interleaved_1f1b")
    stages = split_blocks(n_blocks, pp * v, split, v, world_size)
    m = default_microbatches if microbatches is None else int(microbatches)
    if m < 1 or local_batch_size % m:
        ok = ", ".join(map(str, _divisors(local_batch_size)))
        raise ConfigError(f"pipeline.microbatches={m} must divide the {local_batch_size} sequences "
                          f"each rank takes per step (micro_batch_size x gradient_accumulation_steps); "
                          f"use one of {ok}")
    need = min_microbatches(schedule, pp)
    if m < need:
        ok = [d for d in _divisors(local_batch_size) if d >= need]
        hint = (f"use pipeline.microbatches in {ok}" if ok else
                f"raise trainer.global_batch_size so each rank has {need} or more sequences")
        smaller = "; a smaller trainer.micro_batch_size gives more" if local_batch_size > m else ""
        unset = "" if microbatches is not None else (
            f" (unset: the {m} gradient-accumulation micro-batch(es) of {local_batch_size} sequences "
            f"per rank{smaller})")
        raise ConfigError(f"pipeline.microbatches={m}{unset}: pipeline.schedule={schedule} on "
                          f"strategy.pp={pp} needs {need} or more micro-batches per step (else stages "
                          f"idle or the schedule cannot fill); {hint}")
    if schedule == "interleaved_1f1b":
        rounds = max(1, m // pp)
        if m % rounds:
            ok = [d for d in _divisors(local_batch_size) if d >= pp and d % max(1, d // pp) == 0]
            raise ConfigError(f"pipeline.microbatches={m}: interleaved_1f1b on strategy.pp={pp} needs a "
                              f"multiple of its {rounds} rounds (m // pp); use one of {ok}")
    return PipelineLayout(schedule=schedule, pp=int(pp), stages_per_rank=v, microbatches=m,
                          split=tuple(tuple(s) for s in stages))


# ------------------------------------------------------------------------------ the model
def _blocks_container(model: nn.Module, blocks: Sequence[nn.Module]) -> tuple[str, nn.Module]:
    """``(attribute name, container)`` of the top-level child that holds the repeated blocks."""
    ids = {id(b) for b in blocks}
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)) and any(id(c) in ids for c in child.children()):
            return name, child
    raise ConfigError("strategy.pp > 1: the model's repeated blocks are not in a top-level "
                      "nn.ModuleList (e.g. model.layers); pipeline stages cannot be cut from it")


def prune_model(model: nn.Module, keep: Sequence[int], first: bool, last: bool,
                ends: tuple[Sequence[str], Sequence[str]], blocks: Sequence[nn.Module]) -> nn.Module:
    """Keep blocks ``keep`` (indices in the whole model) of ``model``, in place; returns it.

    The blocks' container becomes an ``nn.ModuleDict`` keyed ``"i"`` (parameter names stay
    ``layers.i....``); the modules named in ``ends[0]`` (the embedding) are set to ``None``
    unless ``first``, those in ``ends[1]`` (final norm, output) unless ``last``.
    """
    name, _ = _blocks_container(model, blocks)
    setattr(model, name, nn.ModuleDict({str(i): blocks[i] for i in keep}))
    for attr in ([] if first else list(ends[0])) + ([] if last else list(ends[1])):
        setattr(model, attr, None)
    return model


def stage_view(model: nn.Module, keep: Sequence[int], first: bool, last: bool,
               ends: tuple[Sequence[str], Sequence[str]]) -> nn.Module:
    """One stage of a pruned ``model`` (see :func:`prune_model`) as a module of its own: a
    shallow copy whose children are ``model``'s own modules (shared parameters, wrappers such as
    activation checkpointing included), with only blocks ``keep`` and the ends of this stage.
    Its ``forward`` is the model's (the family's forward skips what is ``None``)."""
    view = copy.copy(model)
    view._modules = dict(model._modules)  # the copy's own table; the modules themselves shared
    view._parameters = dict(model._parameters)
    view._buffers = dict(model._buffers)
    for key, value in vars(model).items():  # own hook tables: a stage's FSDP2 root hooks its view only
        if key.endswith("hooks") and isinstance(value, dict):
            setattr(view, key, type(value)(value))
    name, container = _blocks_container(model, model.blocks())
    view._modules[name] = nn.ModuleDict({str(i): container[str(i)] for i in keep})
    for attr in ([] if first else list(ends[0])) + ([] if last else list(ends[1])):
        view._modules[attr] = None
    return view


def stage_params(model: nn.Module, layout: PipelineLayout, ends: tuple[Sequence[str], Sequence[str]],
                 blocks: Sequence[nn.Module]) -> list[int]:
    """Parameters of each stage of the whole ``model`` (e.g. on meta): its blocks, plus the
    modules of ``ends[0]`` on the first stage and of ``ends[1]`` on the last."""
    def count(mods: Sequence[Optional[nn.Module]]) -> int:
        return sum(p.numel() for m in mods if m is not None for p in m.parameters())

    out = [count([blocks[i] for i in split]) for split in layout.split]
    out[0] += count([getattr(model, n, None) for n in ends[0]])
    out[-1] += count([getattr(model, n, None) for n in ends[1]])
    return out


def apply_pipeline_split(model: nn.Module, ctx: Any, layout: PipelineLayout,
                         ends: tuple[Sequence[str], Sequence[str]], blocks: Sequence[nn.Module]) -> nn.Module:
    """Prune ``model`` (on meta) to the blocks of this rank's stages (``ctx.mesh["pp"]``)."""
    rank = ctx.mesh["pp"].get_local_rank()
    stages = layout.stages_of_rank(rank)
    keep = sorted(i for s in stages for i in layout.split[s])
    return prune_model(model, keep, 0 in stages, layout.num_stages - 1 in stages, ends, blocks)
