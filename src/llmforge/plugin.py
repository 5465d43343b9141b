"""The model pipeline and the ``Algorithm`` base class (Composer-style).

A model is built on the meta device and passes through one ordered pipeline of transforms
before it is materialized (the order torchtitan uses and documents)::

    CONVERT (adapters, float8: swap module types)
      -> PIPELINE (keep this rank's pipeline stages) -> TENSOR_PARALLEL -> ACTIVATION_CHECKPOINTING -> COMPILE
      -> DATA_PARALLEL (FSDP2 per block, then root; or DDP)
      -> materialize + initialize (LLMModule.configure_model)

Algorithms declare the stage they act in; the strategy owns the two parallel stages. The
pipeline sorts transforms by stage (stable within a stage), so the order of the YAML list never
changes the result.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from lightning.pytorch.callbacks import Callback
from omegaconf import OmegaConf
from torch import nn

from llmforge import registry


class Stage(IntEnum):
    """Pipeline stages, in the order they run."""

    CONVERT = 10
    PIPELINE = 15
    TENSOR_PARALLEL = 20
    ACTIVATION_CHECKPOINTING = 30
    COMPILE = 40
    DATA_PARALLEL = 50


@dataclass
class ModelContext:
    """What a transform may need: the run config, the device mesh and parallel sizes.

    Attributes:
        cfg: the resolved run config.
        mesh: the ``DeviceMesh`` (dims ``dp_replicate``, ``dp_shard``, ``tp``; with expert
            parallelism ``dp_replicate``, ``efsdp``, ``ep``, ``tp``, ``dp_shard`` flattened) or
            ``None`` in one process.
        dims: :class:`llmforge.parallel.mesh.ParallelDims`.
        device: the device the model will be materialized on.
        tp_styles: the styles the tensor-parallel plan gives linear layers
            (:class:`llmforge.models.tp_styles.TPStyles`; ``None``: torch's). A transform
            that swaps module types before ``TENSOR_PARALLEL`` may set styles that suit them
            (``float8``: float8 all-gathers).
    """

    cfg: Any
    mesh: Any
    dims: Any
    device: Any
    tp_styles: Any = None


@dataclass
class Transform:
    """One pipeline step: ``fn(model, ctx) -> model`` at ``stage``; within a stage, lower
    ``priority`` runs first (an adapter algorithm has 1, so ``float8`` converts the base layers
    before the adapters are added)."""

    stage: Stage
    name: str
    fn: Callable[[nn.Module, ModelContext], nn.Module]
    priority: int = 0

    def sort_key(self) -> tuple[int, int]:
        return int(self.stage), int(self.priority)


def run_pipeline(model: nn.Module, transforms: Sequence[Transform], ctx: ModelContext) -> nn.Module:
    """Apply ``transforms`` sorted by stage, then priority (stable), returning the model."""
    for t in sorted(transforms, key=lambda t: t.sort_key()):
        model = t.fn(model, ctx)
    return model


def build_meta_model(cfg: Any) -> nn.Module:
    """A new model of ``cfg.model`` on the meta device (no memory), from its registered factory:
    the one place a run's model is built on meta. Code that changes the model (the transform
    pipeline of a run directory's model, a dry run's adapter count) builds its own with this;
    code that only reads it (shapes, counts, FLOPs, checks) uses the shared :func:`meta_model`.

    Raises:
        ConfigError: ``model.name`` is not registered.
    """
    factory = registry.models.get(cfg.model.name, key="model.name")
    with torch.device("meta"):
        return factory(cfg.model)


_SHARED: "OrderedDict[tuple[int, str], tuple[Any, nn.Module]]" = OrderedDict()
_SHARED_MAX = 4  # a run has one model; the planner and tests a few


def meta_model(cfg: Any) -> nn.Module:
    """The run's model on the meta device, built once (:func:`build_meta_model`) and shared by
    every reader: the checks of :class:`CheckContext`, the dry run, the Trainer's checks, the
    planner. Read it, never change it (build your own to transform).

    Cached by the model's factory and the ``cfg.model`` section (the only inputs of the
    build), so the resolved run, its checks and its dry run see one object.
    """
    factory = registry.models.get(cfg.model.name, key="model.name")
    section = cfg.model
    # a factory (a ModelSpec) need not be hashable: keyed by id, kept alive beside its model;
    # the section with its interpolations resolved (model.max_seq_len: ${variables.seq_len})
    key = (id(factory), OmegaConf.to_yaml(section, resolve=True) if OmegaConf.is_config(section)
           else repr(section))
    hit = _SHARED.get(key)
    if hit is not None and hit[0] is factory:
        _SHARED.move_to_end(key)
        return hit[1]
    model = build_meta_model(cfg)
    _SHARED[key] = (factory, model)
    while len(_SHARED) > _SHARED_MAX:
        _SHARED.popitem(last=False)
    return model


@dataclass
class CheckContext:
    """What :meth:`Algorithm.check` receives: the run as resolved once
    (:func:`llmforge.preflight.resolve.resolve_run`) and the model on the meta device, built
    once for every check, so no plugin derives the world size, the strategy, the batch plan or
    the model's shape again.

    Attributes:
        run: the :class:`~llmforge.preflight.resolve.ResolvedRun` (or, outside a run, e.g. a
            unit test, an object with the same ``cfg``, ``world_size``, ``dims``, ``plan`` and
            ``strategy``: :func:`llmforge.algorithms.loading.unresolved_run`).
        algorithms: every configured algorithm (instances, YAML order).
    """

    run: Any
    algorithms: Sequence["Algorithm"]

    @property
    def cfg(self) -> Any:
        """The resolved config (``strategy.name`` ``auto`` is ``fsdp2`` with several processes)."""
        return self.run.cfg

    @property
    def world_size(self) -> int:
        """Processes in the job."""
        return int(self.run.world_size)

    @property
    def dims(self) -> Any:
        """:class:`~llmforge.parallel.mesh.ParallelDims`: dp_replicate x dp_shard x tp."""
        return self.run.dims

    @property
    def plan(self) -> Any:
        """The :class:`~llmforge.config.batch_plan.BatchPlan` (``None`` outside a resolved run)."""
        return self.run.plan

    @property
    def strategy(self) -> str:
        """The strategy name after resolution (``auto`` only for one process)."""
        return str(self.run.strategy)

    @property
    def model(self) -> nn.Module:
        """The run's model on the meta device (:func:`meta_model`), built at the first use and
        shared by every check and the dry run: read it, do not change it."""
        return meta_model(self.cfg)


ADAPTER_CHILDREN = "adapter_children"
"""Attribute of an ``nn.Module``: names of its child modules whose parameters a plugin added
(adapters, e.g. an adapter algorithm's two low-rank factors). Base-model weights (a plain build, a Hugging Face
folder, a full checkpoint) do not have them: core code skips them when it loads or broadcasts
base weights, and saves only them for a plugin with ``adapters_only``."""


def adapter_names(model: nn.Module) -> frozenset[str]:
    """The child names marked by :data:`ADAPTER_CHILDREN` anywhere in ``model``."""
    return frozenset(n for m in model.modules() for n in getattr(m, ADAPTER_CHILDREN, ()))


def has_adapters(model: nn.Module) -> bool:
    """Whether any module of ``model`` carries adapters."""
    return bool(adapter_names(model))


def adapter_key_filter(model: nn.Module) -> Callable[[str], bool]:
    """A predicate on parameter / state-dict keys: True for the parameters of ``model``'s
    adapters (a key with one of :func:`adapter_names` as a path component)."""
    names = adapter_names(model)
    return lambda key: bool(names) and any(part in names for part in key.split("."))


def algorithm_kind(obj: Any) -> str:
    """"" when ``obj`` (named by import path under ``algorithms:``) is an :class:`Algorithm`
    subclass, else what it is (checked before anything calls it)."""
    if isinstance(obj, type) and issubclass(obj, Algorithm):
        return ""
    if isinstance(obj, type):
        return (f"a class, but {obj.__name__} is not a subclass of llmforge.plugin.Algorithm; "
                "subclass it (plain callbacks go under callbacks:)")
    return f"a {type(obj).__name__}, not a class; name an llmforge.plugin.Algorithm subclass"


class Algorithm(Callback):
    """A Lightning ``Callback`` that may also transform the model at one pipeline stage and act
    on the events of :mod:`llmforge.events`.

    Subclasses set ``stage`` and override :meth:`apply`; handle an event by defining the method
    of its name (``after_loss(self, state)``, ...; several plugins on one event run by
    ``order``, then ``name``; the events are the one bus of every built-in, see
    :mod:`llmforge.training.bridge` for Lightning's hooks beside them) and override
    :meth:`check`, which sees the resolved run and every configured algorithm before any weight
    is allocated and raises :class:`llmforge.errors.ConfigError` for combinations that cannot
    work.

    Checkpoints: ``state_dict()``/``load_state_dict()`` (plain values) and
    :meth:`sharded_state_dict`/:meth:`load_sharded_state_dict` (tensors, sharded like the
    weights) are saved in every checkpoint and restored on resume. A plugin with
    ``adapters_only = True`` makes checkpoints hold only the adapter parameters (the frozen base
    is rebuilt from its pointer, ``model.init_from`` or the seeded init).

    Attributes:
        name: the registered name (messages, ``meta.json``, ordering).
        stage, priority: where the transform runs in the model pipeline.
        order: position among the handlers of one event (lower first; default 0).
        adapters_only: checkpoints hold only adapter parameters.
        replaces_memory_estimate: the :meth:`dry_run_lines` replace the dry run's generic
            ``memory/device`` line.
    """

    name: str = "algorithm"
    stage: Optional[Stage] = None
    priority: int = 0
    order: int = 0
    adapters_only: bool = False
    replaces_memory_estimate: bool = False

    def apply(self, model: nn.Module, ctx: ModelContext) -> nn.Module:
        """Transform the (meta-device) model; return it (or a wrapper)."""
        return model

    def check(self, run: CheckContext) -> None:
        """Reject impossible combinations before anything is allocated: ``run`` holds the
        resolved run (``cfg``, ``world_size``, ``dims``, ``plan``, ``strategy``), every configured
        algorithm and the meta model (:class:`CheckContext`). (A subclass may still define the
        older ``check(self, cfg, algorithms)``: it is called that way.)"""

    def transform(self) -> Optional[Transform]:
        """This algorithm's pipeline step, or ``None`` if it only acts on training events."""
        if self.stage is None:
            return None
        return Transform(self.stage, self.name, self.apply, int(self.priority))

    # ---------------------------------------------------------------- checkpoints
    def sharded_state_dict(self) -> dict[str, Any]:
        """Tensors to save in every checkpoint (through DCP, resharded on load), e.g. an EMA
        copy of the weights; ``{}`` (default) saves nothing."""
        return {}

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`sharded_state_dict` saved (``state`` has its keys, loaded into
        the tensors :meth:`sharded_state_dict` returns now)."""

    def checkpoint_meta(self, cfg: Any) -> dict[str, Any]:
        """JSON values written to the checkpoint's ``meta.json`` under ``plugins.<name>``
        (e.g. settings a resume must match)."""
        return {}

    def check_resume(self, checkpoint: Path, meta: dict[str, Any], cfg: Any) -> None:
        """Refuse a resume from ``checkpoint`` (its ``meta.json`` is ``meta``) that this
        plugin cannot continue exactly.

        Raises:
            ConfigError: naming the setting that differs and how to resume.
        """

    # ------------------------------------------------------- inference and export
    def inference_model(self, model: nn.Module, cfg: Any, meta: dict[str, Any]) -> nn.Module:
        """Prepare a model built on the meta device for loading a checkpoint of this run
        outside training (``generate``, ``eval``, ``convert``): e.g. add adapter layers with the
        settings in ``meta`` (the checkpoint's ``meta.json``). Default: unchanged. Several
        plugins run in pipeline order (:mod:`llmforge.checkpoint.run_dir`)."""
        return model

    def export_model(self, model: nn.Module, checkpoint: Path) -> nn.Module:
        """The model to write for ``convert to-hf`` (unsharded, loaded from ``checkpoint``):
        e.g. adapters merged into the base weights. Default: unchanged. Several plugins run in
        the reverse of pipeline order (:func:`llmforge.checkpoint.run_dir.export_order`)."""
        return model

    def export_adapters(self, model: nn.Module, out: Path, cfg: Any, meta: dict[str, Any],
                        dtype: Any = None) -> Optional[Path]:
        """``convert to-hf --adapters-only``: write only this plugin's adapters to ``out`` and
        return it, or ``None`` if it has none."""
        return None

    def dry_run_lines(self, cfg: Any, plan: Any, device_memory_gib: Optional[float]) -> list[str]:
        """Lines for ``llmforge train --dry-run`` (e.g. trainable parameters, memory)."""
        return []

    @classmethod
    def from_peft_config(cls, peft_config: Mapping[str, Any]) -> Optional[dict[str, Any]]:
        """``llmforge convert foundry``: this plugin's ``algorithms:`` entry (``{"name": ...,
        **kwargs}``) for a PEFT adapter config (LLM Foundry's ``model.peft_config``, PEFT's
        ``adapter_config.json`` keys), or ``None`` when the adapter is not of this plugin's kind."""
        return None

