"""How a model is spread over ranks: tensor parallel, FSDP2 / HSDP, DDP.

Each function is a pipeline transform ``fn(model, ctx) -> model`` (see
:mod:`llmforge.algorithms.base`) applied to the model on the meta device, before it is
materialized. They rely on the model factory contract: ``model.blocks()`` returns the repeated
transformer blocks. The tensor-parallel plan is Llama's (module names of
:class:`llmforge.models.llama.Llama`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from llmforge.algorithms.base import ModelContext, Stage, Transform
from llmforge.errors import ConfigError

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


def apply_fsdp(model: nn.Module, ctx: ModelContext) -> nn.Module:
    """``fully_shard`` every block, then the root (FSDP2; HSDP when ``dp_replicate > 1``).

    The root keeps its parameters unsharded after forward (they are used again at once by the
    backward, as torchtitan does); blocks follow ``strategy.reshard_after_forward``.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    s = ctx.cfg.strategy
    dims = ctx.dims
    mesh = ctx.mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else ctx.mesh["dp_shard"]
    kwargs = dict(mesh=mesh, mp_policy=mixed_precision_policy(ctx.cfg),
                  offload_policy=CPUOffloadPolicy() if s.cpu_offload else OffloadPolicy())
    for block in model.blocks():
        fully_shard(block, reshard_after_forward=s.reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def apply_ddp(model: nn.Module, ctx: ModelContext) -> nn.Module:
    """Replicate the model over ``dp_replicate`` (DDP semantics: gradients all-reduced,
    averaged) with torch's FSDP2-based ``replicate``."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    replicate(model, mesh=ctx.mesh["dp_replicate"], mp_policy=mixed_precision_policy(ctx.cfg))
    return model


def apply_tp(model: nn.Module, ctx: ModelContext) -> nn.Module:
    """Megatron-style tensor parallelism for Llama with sequence parallelism.

    Column-wise: wq, wk, wv, w1, w3 (output features sharded); row-wise: wo, w2 (input features
    sharded, output sequence-sharded); RMSNorms run sequence-parallel; the embedding is sharded
    by vocabulary rows and the output projection column-wise, its logits gathered
    (``Replicate``) so the loss is computed as in one process.

    Raises:
        ConfigError: tied embeddings, or head counts not divisible by ``tp``.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    _check_tp(model, ctx)
    mesh = ctx.mesh["tp"]
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(),
                                  use_local_output=True),
    })
    for block in model.blocks():
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                            desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    return model


def check_strategy(cfg: Any, dims: Any) -> None:
    """Reject strategy settings that cannot work, before any process or weight exists.

    Raises:
        ConfigError: ``single`` with several processes, ``ddp`` with sharding, or a
            tensor-parallel degree the model's heads (or tied embeddings) do not allow.
    """
    if cfg.strategy.name == "single" and dims.world_size > 1:
        raise ConfigError(f"strategy.name=single runs one process, but the world size is "
                          f"{dims.world_size}; use strategy.name=ddp or fsdp2")
    strategy_transforms(cfg, dims)
    if dims.tp > 1:
        from llmforge import registry

        with torch.device("meta"):
            model = registry.models.get(cfg.model.name, key="model.name")(cfg.model)
        ctx = ModelContext(cfg=cfg, mesh=None, dims=dims, device=torch.device("meta"))
        _check_tp(model, ctx)


def _check_tp(model: nn.Module, ctx: ModelContext) -> None:
    tp = ctx.dims.tp
    args = getattr(model, "args", None)
    if args is None:
        raise ConfigError("strategy.tp > 1 needs a Llama-shaped model (the built-in 'llama3' factory)")
    if args.tie_embeddings:
        raise ConfigError("strategy.tp > 1 does not support tied embeddings (model.tie_embeddings=false)")
    if args.n_heads % tp or args.n_kv_heads % tp:
        raise ConfigError(f"strategy.tp={tp} must divide model.n_heads ({args.n_heads}) and "
                          f"model.n_kv_heads ({args.n_kv_heads})")


def strategy_transforms(cfg: Any, dims: Any) -> list[Transform]:
    """The strategy's pipeline steps: tensor parallel (tp > 1) and data parallel (DDP when
    ``dp_replicate > 1``; FSDP2 when ``dp > 1``, or on one device when named explicitly)."""
    out: list[Transform] = []
    if dims.tp > 1:
        out.append(Transform(Stage.TENSOR_PARALLEL, "tensor_parallel", apply_tp))
    if cfg.strategy.name == "ddp":
        if dims.dp_shard > 1:
            raise ConfigError(f"strategy.name=ddp replicates the model on every data-parallel rank; "
                              f"strategy.dp_shard={dims.dp_shard} needs strategy.name=fsdp2")
        if dims.dp_replicate > 1:
            out.append(Transform(Stage.DATA_PARALLEL, "ddp", apply_ddp))
    elif dims.dp > 1 or (cfg.strategy.name == "fsdp2" and dims.world_size == 1):
        # fsdp2 on one device still applies (mixed-precision policy, CPU offload)
        out.append(Transform(Stage.DATA_PARALLEL, "fsdp2", apply_fsdp))
    return out
