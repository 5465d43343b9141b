"""A parallel layout to simulate (:class:`Layout`) and the run config it gives
(:func:`layout_config`): strategy degrees, micro-batch size, activation checkpointing entry,
pipeline settings, and which rank holds the last pipeline stage. No tensors, no process group.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import ListConfig, OmegaConf

from llmforge.errors import ConfigError
from llmforge.parallel.pipeline import last_stage_pp_rank

AC_MODES = ("none", "selective", "full")
"""Activation checkpointing choices: none, ``selective: op`` (torchtitan's per-operator
policy), ``full`` (every block)."""

KEEP_AC = "config"
"""``Layout.activation_checkpointing`` value that keeps the config's own entry (the dry run's
``--simulate``: e.g. ``selective: layer`` with ``every``)."""

AC_ENTRIES = {"selective": {"name": "activation_checkpointing", "mode": "selective", "selective": "op"},
              "full": {"name": "activation_checkpointing", "mode": "full"}}


@dataclass(frozen=True)
class Layout:
    """A parallel layout: ``dp_replicate * dp_shard * tp * pp * cp`` = world size.

    ``cp`` (context parallelism) splits every sequence over ``cp`` ranks; FSDP2 shards over
    ``dp_shard x cp``. The simulation runs the context-parallel step of the runtime; the
    planner ranks ``cp > 1`` from the ``cp=1`` twin (:mod:`llmforge.planning.context`).

    ``ep`` (expert parallelism) borrows ``dp_shard`` ranks: it divides ``dp_shard`` and leaves
    the world size alone. The simulation runs ``ep=1`` only; the planner derives ``ep > 1``.

    ``pp > 1``: the run's ``pipeline:`` settings cut the model into stages and the simulation
    measures rank 0 (the first stage, with the embedding; ``simulate(..., last_stage=True)``
    the last stage's rank, with the output layer and the loss): its blocks run as one model,
    micro-batch after micro-batch, without the schedule, so its parameters, gradients and
    optimizer state are the stage's, but the activations of micro-batches in flight (1F1B: up
    to ``pp`` on the first stage) and the point-to-point sends are not simulated
    (``llmforge plan`` adds the first from the measured forward activations,
    :func:`llmforge.planning.stages.simulate_layout`).
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    activation_checkpointing: str
    micro_batch_size: int
    pp: int = 1
    ep: int = 1
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp


def refuse_ep(layout: Layout) -> None:
    """Raises ConfigError: ``layout.ep > 1``, which the simulation cannot run (the fake process
    group's all-to-all carries no token counts to dispatch by); ``llmforge plan`` derives ep
    layouts from the ep=1 simulation instead."""
    if layout.ep != 1:
        raise ConfigError(f"strategy.ep={layout.ep}: the simulation (--dry-run --simulate) runs "
                          "strategy.ep=1 only (a fake process group carries no token counts to "
                          "dispatch by); `llmforge plan` estimates ep from the ep=1 step")


def pipeline_settings(cfg: Any, pp: int) -> dict[str, Any]:
    """The ``pipeline:`` keys a layout of ``pp`` stages runs with: the config's, except an
    explicit block split or micro-batch count written for another ``pp`` (then ``balanced``
    and the gradient-accumulation micro-batches)."""
    p = cfg.pipeline
    same = int(cfg.strategy.get("pp", 1)) == pp
    split = p.split if same or not isinstance(p.split, (list, ListConfig)) else "balanced"
    return {"schedule": p.schedule, "stages_per_rank": p.stages_per_rank, "split": split,
            "microbatches": p.microbatches if same else None}


def layout_config(cfg: Any, layout: Layout, n_layers: Optional[int] = None) -> Any:
    """A copy of ``cfg`` with ``layout``: strategy degrees (``fsdp2``), micro-batch size, the
    ``activation_checkpointing`` entry replaced (kept with :data:`KEEP_AC`), ``compile`` and the
    sequence-length and batch-size warm-ups left out, and ``model.n_layers`` when given (with
    ``pp > 1`` the stages then split the blocks ``balanced``: a split written for the real
    depth does not fit the simulated one).

    Raises:
        ConfigError: ``layout.ep > 1`` (:func:`refuse_ep`).
    """
    refuse_ep(layout)
    out = copy.deepcopy(cfg)
    OmegaConf.set_readonly(out, False)
    for key, value in pipeline_settings(cfg, layout.pp).items():
        out.pipeline[key] = value
    s = out.strategy
    s.name = "fsdp2" if layout.world_size > 1 else s.name
    s.dp_replicate, s.dp_shard, s.tp = layout.dp_replicate, layout.dp_shard, layout.tp
    s.ep, s.pp = layout.ep, layout.pp
    if "cp" in s:  # the schema's strategy.cp (context parallelism): the simulated layout's
        s.cp = layout.cp
    out.trainer.micro_batch_size = layout.micro_batch_size
    # the world size the checks derive from the trainer (devices x nodes) is the layout's
    out.trainer.devices, out.trainer.num_nodes = layout.world_size, 1
    # warm-ups that shorten the first steps are left out too: the simulated step is one at the
    # full sequence length and batch, where the run's peak is
    drop = ("compile", "seq_length_warmup", "batch_size_warmup")
    if layout.activation_checkpointing != KEEP_AC:
        drop += ("activation_checkpointing",)
    algos = [a for a in OmegaConf.to_container(out.algorithms) if a.get("name") not in drop]
    if layout.activation_checkpointing not in ("none", KEEP_AC):
        if layout.activation_checkpointing not in AC_ENTRIES:
            raise ConfigError(f"Layout.activation_checkpointing={layout.activation_checkpointing!r}: "
                              f"expected one of {', '.join(AC_MODES)} or {KEEP_AC!r}")
        algos.append(AC_ENTRIES[layout.activation_checkpointing])
    out.algorithms = algos
    if n_layers is not None:
        out.model.n_layers = n_layers
        if layout.pp > 1:
            out.pipeline.split = "balanced"
    return out


def last_stage_rank(layout: Layout, schedule: str) -> int:
    """The first rank of the ``pp`` rank that holds the last pipeline stage (``pp`` is the mesh's
    outermost dim; :func:`llmforge.parallel.pipeline.last_stage_pp_rank`): 0 without stages and
    for the V schedules, whose rank 0 holds the first and the last stage."""
    if layout.pp <= 1:
        return 0
    return last_stage_pp_rank(schedule, layout.pp) * (layout.world_size // layout.pp)


__all__ = ["AC_ENTRIES", "AC_MODES", "KEEP_AC", "Layout", "last_stage_rank", "layout_config",
           "pipeline_settings", "refuse_ep"]
