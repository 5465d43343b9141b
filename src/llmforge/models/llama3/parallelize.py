"""Llama 3's tensor-parallel plan (Megatron-style, with sequence parallelism), as torchtitan's
``torchtitan/models/llama3/infra/parallelize.py`` applies it.

Column-wise: wq, wk, wv, w1, w3 (output features sharded); row-wise: wo, w2 (input features
sharded, output sequence-sharded); RMSNorms run sequence-parallel; the embedding is sharded by
vocabulary rows and the output projection column-wise, its logits gathered (``Replicate``) so the
loss is computed as in one process. Attention runs on the local heads (``view(..., -1, hd)``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

from llmforge.errors import ConfigError
from llmforge.models.decoder import SwiGLU
from llmforge.models.tp_styles import TPStyles
from llmforge.registry import accepted

__all__ = ["apply_decoder_tp", "apply_tp", "check_decoder_tp", "check_tp", "swiglu_plan"]


def swiglu_plan(block: nn.Module, styles: Optional[TPStyles] = None) -> dict:
    """The feed-forward entries of a block's plan: SwiGLU ``w1``/``w3`` column-wise, ``w2``
    row-wise to the sequence-sharded residual (``styles``: :class:`TPStyles`, torch's by
    default)."""
    from torch.distributed.tensor import Replicate, Shard

    st, ff = styles or TPStyles(), block.feed_forward
    return {"feed_forward": st.prepare_input([ff.w1, ff.w3], input_layouts=(Shard(1),),
                                             desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": st.colwise(ff.w1),
            "feed_forward.w2": st.rowwise(ff.w2, output_layouts=Shard(1)),
            "feed_forward.w3": st.colwise(ff.w3)}


def apply_decoder_tp(model: nn.Module, mesh: Any, extra_block_plan: Optional[dict] = None,
                     ffn_plan: Callable[..., dict] = swiglu_plan,
                     styles: Optional[TPStyles] = None) -> nn.Module:
    """The plan above on ``mesh`` (1-D tp mesh); ``extra_block_plan`` adds module styles per
    block (e.g. Qwen3's per-head QK-norms); ``ffn_plan(block)`` gives the feed-forward entries
    (default :func:`swiglu_plan`, which also takes ``styles``; a mixture of experts has its
    own). ``styles``: the linear layers' styles (:class:`~llmforge.models.tp_styles.TPStyles`,
    torch's by default; a transform may set others, :attr:`llmforge.plugin.ModelContext.tp_styles`).
    The embedding and the output projection keep torch's. A tied output projection is
    re-tied afterwards: the embedding (row-wise) and the output (column-wise) both shard the
    ``[V, D]`` weight on dim 0, so one DTensor serves both."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   PrepareModuleOutput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    st = styles or TPStyles()

    ends = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(),
                                  use_local_output=True),
    }
    # a pipeline stage lacks some ends (llmforge.parallel.pipeline); between stages the hidden
    # states travel whole ([B, T, D], replicated over tp): a stage without the embedding cuts
    # them to its sequence shard, one without the output gathers its last block's shards
    parallelize_module(model, mesh, {k: v for k, v in ends.items() if getattr(model, k, None) is not None})
    blocks = model.blocks()
    if blocks and getattr(model, "tok_embeddings", True) is None:
        parallelize_module(blocks[0], mesh, PrepareModuleInput(
            input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None),
            use_local_output=True))
    if blocks and getattr(model, "output", True) is None:
        parallelize_module(blocks[-1], mesh, PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True))
    if getattr(getattr(model, "args", None), "tie_embeddings", False):
        model.output.weight = model.tok_embeddings.weight
    for block in blocks:
        at = block.attention
        ffn = ffn_plan(block, **accepted(ffn_plan, {"styles": st}))  # a family's own may not take styles
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": st.prepare_input([at.wq, at.wk, at.wv], input_layouts=(Shard(1), None),
                                          desired_input_layouts=(Replicate(), None)),
            "attention.wq": st.colwise(at.wq),
            "attention.wk": st.colwise(at.wk),
            "attention.wv": st.colwise(at.wv),
            "attention.wo": st.rowwise(at.wo, output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            **ffn,
            **(extra_block_plan or {}),
        })
    return model


def apply_tp(model: nn.Module, mesh: Any, styles: Optional[TPStyles] = None) -> nn.Module:
    """Llama 3's plan on the tp mesh (see the module docstring), with ``styles`` for the
    linear layers (torch's by default)."""
    return apply_decoder_tp(model, mesh, styles=styles)


def check_decoder_tp(model: nn.Module, tp: int) -> None:
    """Raises ConfigError: ``tp`` does not divide the query and key/value head counts (each
    rank holds whole heads) or a SwiGLU's hidden width (column-parallel ``w1``, ``w3`` and
    row-parallel ``w2`` split it; an uneven split fails in the first matmul)."""
    args = model.args
    if args.n_heads % tp or args.n_kv_heads % tp:
        raise ConfigError(f"strategy.tp={tp} must divide model.n_heads ({args.n_heads}) and "
                          f"model.n_kv_heads ({args.n_kv_heads})")
    uneven = sorted({m.hidden_dim for m in model.modules() if isinstance(m, SwiGLU) and m.hidden_dim % tp})
    if uneven:
        key = ("model.hidden_dim" if hasattr(args, "hidden_dim")
               else "model.dim, model.multiple_of and model.ffn_dim_multiplier")
        raise ConfigError(f"strategy.tp={tp} must divide the feed-forward hidden width {uneven[0]} "
                          f"(set by {key}, or by intermediate_size in the config.json of a "
                          "model.init_from: hf: folder): choose a tp that divides it")


def check_tp(model: nn.Module, tp: int) -> None:
    """Raises ConfigError: tied embeddings, or head counts not divisible by ``tp``."""
    if model.args.tie_embeddings:
        raise ConfigError("strategy.tp > 1 does not support tied embeddings (model.tie_embeddings=false)")
    check_decoder_tp(model, tp)
