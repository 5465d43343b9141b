"""Research example: a custom model factory registered under a name.

``parallel_llama`` is Llama 3 with *parallel* attention and feed-forward sub-layers
(GPT-J; PaLM, Chowdhery et al. 2022, sec. 2): ``out = x + attn(norm(x)) + ffn(norm(x))`` with
one shared norm per block instead of two sequential sub-layers. Everything else (presets, RoPE,
init, FLOPs) is inherited. It is registered with a spec derived from Llama 3's, so it keeps the
``model:`` keys (``preset``, ``dim``, ...), the tensor-parallel plan (its module names are
Llama's: ``strategy.tp=2`` works, see ``parallel_block_tp.yaml``), FSDP2/HSDP, activation
checkpointing and compile. The YAML imports this module and names the model::

    imports: [examples.parallel_block_model]
    model:
      name: parallel_llama
      kwargs: {share_norm: true}
"""

from __future__ import annotations

import torch

from llmforge.models import LLAMA3
from llmforge.models.llama3.model import Llama, llama_args_from_config
from llmforge.models.llama3.model import TransformerBlock
from llmforge.registry import models


class ParallelBlock(TransformerBlock):
    """``out = x + attn(n(x)) + ffn(n'(x))``; ``n' = n`` when ``share_norm``."""

    def __init__(self, layer_id, args, share_norm: bool = True) -> None:
        super().__init__(layer_id, args)
        self.share_norm = share_norm

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        a = self.attention_norm(x)
        f = a if self.share_norm else self.ffn_norm(x)
        return x + self.attention(a, rope) + self.feed_forward(f)


def build_parallel_llama(cfg) -> Llama:
    """Model factory: the ``model:`` section -> a Llama whose blocks are :class:`ParallelBlock`."""
    kwargs = dict(cfg.get("kwargs") or {})
    share_norm = bool(kwargs.pop("share_norm", True))
    if kwargs:
        raise ValueError(f"model.kwargs: unknown keys {sorted(kwargs)} for parallel_llama")
    model = Llama(llama_args_from_config(cfg))
    model.layers = torch.nn.ModuleList(
        ParallelBlock(i, model.args, share_norm) for i in range(model.args.n_layers))
    return model


# one registry line: Llama 3's spec (YAML keys, TP plan, blocks, FLOPs) with this factory; the
# HF adapter is dropped since Hugging Face has no such architecture
models.register("parallel_llama", LLAMA3.derive(name="parallel_llama", build=build_parallel_llama,
                                                model_cls=None, hf_adapter=None))
