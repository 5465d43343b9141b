"""How a model is spread over ranks: pipeline stages, tensor parallel, expert parallel, FSDP2 /
HSDP, DDP.

Each function is a pipeline transform ``fn(model, ctx) -> model`` (see
:mod:`llmforge.plugin`) applied to the model on the meta device, before it is
materialized. The repeated blocks and the tensor-parallel plan come from the family's
:class:`~llmforge.models.spec.ModelSpec` (``model.name``); this module knows no family.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from llmforge.config.validate import plan_batch
from llmforge.errors import ConfigError
from llmforge.models.spec import get_spec
from llmforge.parallel.context_parallel import check_context_parallel
from llmforge.parallel.expert import apply_expert_parallel, check_expert_parallel, shard_experts
from llmforge.parallel.pipeline import PipelineLayout, apply_pipeline_split, resolve_layout
from llmforge.plugin import ModelContext, Stage, Transform, meta_model
from llmforge.registry import accepted

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def _dtype(name: Optional[str], key: str) -> Optional[torch.dtype]:
    if name is None:
        return None
    if name not in DTYPES:
        raise ConfigError(f"{key}: unknown dtype '{name}'; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def mixed_precision_policy(cfg: Any) -> Any:
    """FSDP2 ``MixedPrecisionPolicy`` from ``strategy.mixed_precision``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = cfg.strategy.mixed_precision
    return MixedPrecisionPolicy(
        param_dtype=_dtype(mp.param_dtype, "strategy.mixed_precision.param_dtype"),
        reduce_dtype=_dtype(mp.reduce_dtype, "strategy.mixed_precision.reduce_dtype"))


def _fsdp_kwargs(ctx: ModelContext) -> dict[str, Any]:
    """``fully_shard``'s mesh (``dp_shard``, or ``dp_replicate x dp_shard`` for HSDP; ``dp_shard_cp``
    in place of ``dp_shard`` under context parallelism), mixed
    precision and offload policies from ``strategy:``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    s, dims = ctx.cfg.strategy, ctx.dims
    shard = "dp_shard_cp" if dims.cp > 1 else "dp_shard"  # cp ranks hold the same weights
    mesh = ctx.mesh["dp_replicate", shard] if dims.dp_replicate > 1 else ctx.mesh[shard]
    return dict(mesh=mesh, mp_policy=mixed_precision_policy(ctx.cfg),
                offload_policy=CPUOffloadPolicy() if s.cpu_offload else OffloadPolicy())


def apply_fsdp(model: nn.Module, ctx: ModelContext) -> nn.Module:
    """``fully_shard`` every block, then the root (FSDP2; HSDP when ``dp_replicate > 1``).

    The root keeps its parameters unsharded after forward (they are used again at once by the
    backward, as torchtitan does); blocks follow ``strategy.reshard_after_forward``. With
    pipeline stages the end modules (embedding, final norm, output) are units of their own and
    each stage's module becomes the root when the schedule is built (:func:`fsdp_stage_root`).
    """
    from torch.distributed.fsdp import fully_shard

    s = ctx.cfg.strategy
    dims = ctx.dims
    kwargs = _fsdp_kwargs(ctx)
    if dims.ep > 1:  # expert weights first, over the dp_shard ranks that ep leaves (efsdp)
        emesh = ctx.mesh["dp_replicate", "efsdp"] if dims.dp_replicate > 1 else ctx.mesh["efsdp"]
        shard_experts(_spec(ctx.cfg).expert_modules(model), emesh, dims.dp,
                      reshard_after_forward=s.reshard_after_forward,
                      mp_policy=kwargs["mp_policy"], offload_policy=kwargs["offload_policy"])
    for block in _spec(ctx.cfg).model_blocks(model):
        fully_shard(block, reshard_after_forward=s.reshard_after_forward, **kwargs)
    if dims.pp > 1:
        # pipeline stages call the stage modules, never the whole model's forward; the end
        # modules are units here, the stage modules the roots (fsdp_stage_root)
        for child in model.children():
            if child is not None and not isinstance(child, (nn.ModuleList, nn.ModuleDict)) \
                    and any(True for _ in child.parameters()):
                fully_shard(child, reshard_after_forward=False, **kwargs)
        return model
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def _uses_fsdp(cfg: Any, dims: Any) -> bool:
    """Whether :func:`strategy_transforms` shards with FSDP2 (else DDP or nothing)."""
    return cfg.strategy.name != "ddp" and (
        dims.dp * dims.cp > 1 or (cfg.strategy.name == "fsdp2" and dims.world_size == 1))


def fsdp_stage_root(ctx: ModelContext) -> Optional[Callable[[nn.Module], Any]]:
    """With pipeline stages and FSDP2: ``root(stage_module)`` makes one stage's module (its
    blocks and end modules, already units of :func:`apply_fsdp`) their FSDP2 root, one root per
    stage as torchtitan lays it out. Under a root, a block's reduce-scatter input is freed
    when the next block's is issued and the next block's parameters are gathered ahead
    (backward prefetch); with each block its own root, every block kept its reduce-scatter
    input until the end of the stage's backward (1.49 GiB per block for the 405B yaml,
    docs/scale.md). ``None`` without pipeline stages or without FSDP2."""
    if ctx.dims.pp <= 1 or not _uses_fsdp(ctx.cfg, ctx.dims):
        return None
    from torch.distributed.fsdp import fully_shard

    kwargs = _fsdp_kwargs(ctx)
    return lambda stage: fully_shard(stage, reshard_after_forward=False, **kwargs)


def apply_ddp(model: nn.Module, ctx: ModelContext) -> nn.Module:
    """Replicate the model over ``dp_replicate`` (DDP semantics: gradients all-reduced,
    averaged) with torch's FSDP2-based ``replicate``."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    replicate(model, mesh=ctx.mesh["dp_replicate"], mp_policy=mixed_precision_policy(ctx.cfg))
    return model


def _spec(cfg: Any) -> Any:
    return get_spec(cfg.model.name)


def apply_tp(model: nn.Module, ctx: ModelContext) -> nn.Module:
    """Tensor parallelism on the ``tp`` mesh with the family's plan (``ModelSpec.tp_plan``;
    Llama 3's and Qwen3's are Megatron-style with sequence parallelism, logits replicated).

    A plan that takes ``styles`` gets ``ctx.tp_styles`` when a transform set them
    (:mod:`llmforge.models.tp_styles`).

    Raises:
        ConfigError: the family has no TP plan, or its check refuses the degree (e.g. head
            counts not divisible by ``tp``).
    """
    _check_tp(model, ctx)
    plan = _spec(ctx.cfg).get("tp_plan")
    styles = accepted(plan, {"styles": ctx.tp_styles}) if ctx.tp_styles is not None else {}
    return plan(model, ctx.mesh["tp"], **styles)


def apply_ep(model: nn.Module, ctx: ModelContext) -> nn.Module:
    """Expert parallelism on the ``ep`` mesh over the expert layers the family declares
    (``ModelSpec.experts``; :mod:`llmforge.parallel.expert`)."""
    apply_expert_parallel(_spec(ctx.cfg).expert_modules(model), ctx.mesh["ep"])
    return model


def check_strategy(cfg: Any, dims: Any) -> None:
    """Reject strategy settings that cannot work, before any process or weight exists.

    Raises:
        ConfigError: ``single`` with several processes, ``ddp`` with sharding, a
            tensor-parallel degree the model's heads (or tied embeddings) do not allow, an
            expert-parallel degree on a model without experts or not dividing its
            ``num_experts``, a context-parallel degree the model's attention cannot take
            (:func:`~llmforge.parallel.context_parallel.check_context_parallel`), or a
            micro-batch the model's ``check_tokens`` refuses.
    """
    if cfg.strategy.name == "single" and dims.world_size > 1:
        raise ConfigError(f"strategy.name=single runs one process, but the world size is "
                          f"{dims.world_size}; use strategy.name=ddp or fsdp2")
    strategy_transforms(cfg, dims)
    plan = plan_batch(cfg, dims.world_size)
    rows = plan.micro_batch_size
    if dims.pp > 1:
        rows = plan.local_batch_size // pipeline_layout(cfg, dims).microbatches
    check_tokens = _spec(cfg).get("check_tokens")
    if check_tokens is not None:
        check_tokens(cfg.model, rows * plan.seq_len)
    if dims.cp > 1:
        check_context_parallel(cfg, dims, meta_model(cfg))
    if dims.tp > 1 or dims.ep > 1:
        model = meta_model(cfg)
        ctx = ModelContext(cfg=cfg, mesh=None, dims=dims, device=torch.device("meta"))
        if dims.tp > 1:
            _check_tp(model, ctx)
        spec = _spec(cfg)
        check_expert_parallel(spec.expert_modules(model), dims.ep, cfg.model.name,
                              declared=spec.get("experts") is not None)


def _check_tp(model: nn.Module, ctx: ModelContext) -> None:
    spec = _spec(ctx.cfg)
    if spec.tp_plan is None:
        raise ConfigError(
            f"strategy.tp > 1: model '{ctx.cfg.model.name}' has no tensor-parallel plan; register "
            "it with a ModelSpec that has tp_plan (docs/models.md), or set strategy.tp=1")
    check = spec.get("check_tp")
    if check is not None:
        check(model, ctx.dims.tp)


def pipeline_layout(cfg: Any, dims: Any, model: Optional[nn.Module] = None) -> PipelineLayout:
    """The pipeline layout of ``strategy.pp`` and ``pipeline:`` for this model and batch
    (``model``: the run's model on meta, :func:`llmforge.plugin.meta_model`, when not given).

    Raises:
        ConfigError: see :func:`llmforge.parallel.pipeline.resolve_layout`; also tied
            embeddings, or a model with auxiliary losses but no ``aux_carry()`` (the statistics
            the stages pass on).
    """
    if model is None:
        model = meta_model(cfg)
    if getattr(getattr(model, "args", None), "tie_embeddings", False):
        raise ConfigError("strategy.pp > 1 needs untied embeddings (the first and the last stage "
                          "would share one weight); set model.tie_embeddings=false or strategy.pp=1")
    if callable(getattr(model, "aux_losses", None)) and not callable(getattr(model, "aux_carry", None)):
        raise ConfigError(f"strategy.pp > 1: model '{cfg.model.name}' returns auxiliary losses "
                          "but has no aux_carry() to carry their statistics between pipeline "
                          "stages (docs/models.md); use strategy.pp=1")
    plan = plan_batch(cfg, dims.world_size)
    p = cfg.pipeline
    return resolve_layout(p.schedule, dims.pp, len(_spec(cfg).model_blocks(model)),
                          plan.local_batch_size, p.microbatches, p.stages_per_rank, p.split,
                          plan.gradient_accumulation_steps, dims.world_size)


def apply_pp(model: nn.Module, ctx: ModelContext) -> nn.Module:
    """Keep this rank's pipeline stages of ``model`` (:mod:`llmforge.parallel.pipeline`)."""
    spec = _spec(ctx.cfg)
    layout = pipeline_layout(ctx.cfg, ctx.dims, model)
    return apply_pipeline_split(model, ctx, layout, spec.stage_ends, spec.model_blocks(model))


def strategy_transforms(cfg: Any, dims: Any) -> list[Transform]:
    """The strategy's pipeline steps: pipeline stages (pp > 1), tensor parallel (tp > 1), expert
    parallel (ep > 1, after TP in the same stage) and data parallel (DDP when
    ``dp_replicate > 1``; FSDP2 when ``dp > 1``, or on one device when named explicitly)."""
    out: list[Transform] = []
    if dims.pp > 1:
        out.append(Transform(Stage.PIPELINE, "pipeline_stages", apply_pp))
    if dims.tp > 1:
        out.append(Transform(Stage.TENSOR_PARALLEL, "tensor_parallel", apply_tp))
    if dims.ep > 1:
        out.append(Transform(Stage.TENSOR_PARALLEL, "expert_parallel", apply_ep, priority=1))
    if cfg.strategy.name == "ddp":
        if dims.dp_shard > 1:
            raise ConfigError(f"strategy.name=ddp replicates the model on every data-parallel rank; "
                              f"strategy.dp_shard={dims.dp_shard} needs strategy.name=fsdp2")
        if dims.dp_replicate > 1:
            out.append(Transform(Stage.DATA_PARALLEL, "ddp", apply_ddp))
    elif _uses_fsdp(cfg, dims):
        # fsdp2 on one device still applies (mixed-precision policy, CPU offload)
        out.append(Transform(Stage.DATA_PARALLEL, "fsdp2", apply_fsdp))
    return out
