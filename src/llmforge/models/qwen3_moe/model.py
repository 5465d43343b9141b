"""Qwen3-MoE decoder in plain PyTorch (no ranks, no trainer), numerically the same as
transformers' ``Qwen3MoeForCausalLM`` (``transformers/models/qwen3_moe/modeling_qwen3_moe.py``).

Qwen3's blocks (:mod:`llmforge.models.qwen3.model`: QK-norm, decoupled head dim, rotate-half
RoPE) whose feed-forward is the sparse :class:`~llmforge.models.qwen3_moe.moe.MoE` in every
sparse layer (:func:`~llmforge.models.qwen3_moe.config.is_sparse_layer`) and a dense SwiGLU
elsewhere::

    layers.{i}.feed_forward.router.weight      [E, D]
    layers.{i}.feed_forward.experts.w1|w3|w2   [E, I, D], [E, I, D], [E, D, I]

Auxiliary losses (the model factory contract of :mod:`llmforge.models`): after each forward,
:meth:`Qwen3Moe.aux_losses` gives the weighted router losses of that forward and
:meth:`Qwen3Moe.aux_metrics` the expert load and dropped assignments; the trainer adds the
losses to the optimized loss (training only) and logs both.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from llmforge.models.decoder import DecoderLM, PreNormBlock, SwiGLU
from llmforge.models.qwen3.model import Attention, Qwen3
from llmforge.models.qwen3_moe.config import Qwen3MoeArgs, is_sparse_layer, qwen3_moe_args_from_config
from llmforge.models.qwen3_moe.moe import MoE
from llmforge.models.spec import reject_factory_kwargs

__all__ = ["Qwen3Moe", "build_qwen3_moe", "active_params", "expert_modules"]


class Qwen3Moe(Qwen3):
    """Qwen3-MoE decoder: ``forward(tokens [B, T], doc_ids [B, T] | None, cache=None,
    token_mask [B, T] | None) -> logits [B, T, V]``
    (:meth:`~llmforge.models.decoder.DecoderLM.forward`; ``token_mask`` keeps padding out of
    the routers and their statistics, :class:`~llmforge.models.qwen3_moe.moe.MoE`)."""

    takes_token_mask = True

    def __init__(self, args: Qwen3MoeArgs) -> None:
        nn.Module.__init__(self)

        def block(i: int) -> PreNormBlock:
            ffn: nn.Module
            if is_sparse_layer(args, i):
                ffn = MoE(args.dim, args.moe_intermediate_size, args.num_experts,
                          args.num_experts_per_tok, args.norm_topk_prob, args.capacity_factor,
                          with_z=args.router_z_loss_coef > 0,
                          bias_update_rate=args.router_bias_update_rate)
            else:
                ffn = SwiGLU(args.dim, args.hidden_dim)
            return PreNormBlock(Attention(args), ffn, args.dim, args.norm_eps)

        DecoderLM._build(self, args, block)

    def moe_layers(self) -> list[tuple[int, MoE]]:
        """``(layer index, MoE)`` of every sparse layer (found through wrappers such as
        activation checkpointing or compile); in a pipeline stage, the stage's layers under
        their indices in the whole model."""
        layers = self.layers
        items = ((int(k), v) for k, v in layers.items()) if isinstance(layers, nn.ModuleDict) \
            else enumerate(layers)
        out = []
        for i, layer in items:
            out += [(i, m) for m in layer.modules() if isinstance(m, MoE)]
        return out

    def aux_carry(self) -> torch.Tensor:
        """The router statistics of the last forward that the losses need, summed over this
        model's sparse layers, as one float32 tensor ``[2 E + 4]``: top-k assignments per expert
        (no gradient), routing probabilities summed over tokens per expert (differentiable),
        the z-loss sum (differentiable; 0 when off), the real tokens, and the dropped and all
        token-expert assignments (for :meth:`aux_metrics`). Summed over pipeline
        stages it is the whole model's (the auxiliary-loss channel of
        :mod:`llmforge.parallel.pipeline`); :meth:`aux_losses` takes the sum."""
        a = self.args
        stats = [m.stats for _, m in self.moe_layers() if m.stats is not None]
        if not stats:
            return torch.zeros(2 * a.num_experts + 4, device=self.rope_cache.device)
        zero = torch.zeros((), device=stats[0].counts.device)
        dropped, total = self._dropped()
        return torch.cat([torch.stack([s.counts for s in stats]).sum(0),
                          torch.stack([s.prob_sum for s in stats]).sum(0),
                          torch.stack([s.z_sum if s.z_sum is not None else zero for s in stats]).sum()[None],
                          torch.tensor([float(sum(s.tokens for s in stats)), float(dropped), float(total)],
                                       device=zero.device)])

    def aux_losses(self, carry: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        """The weighted router losses of the last forward (``carry``: of :meth:`aux_carry`'s sum
        over pipeline stages instead), scalar float32 tensors per token:

        * ``load_balancing``: ``router_aux_loss_coef * E * sum_e f_e P_e``, with ``f_e`` the
          share of top-k assignments and ``P_e`` the mean routing probability of expert ``e``,
          both over the tokens of every sparse layer together (Switch Transformer, Fedus et al.
          2021, eq. 4-6, with top-k counts; exactly transformers' ``load_balancing_loss_func``,
          so it equals ``router_aux_loss_coef * aux_loss`` of ``Qwen3MoeForCausalLM``; with a
          ``token_mask`` the tokens are the real ones, as that function's masked formulation
          with ``attention_mask``);
        * ``router_z``: ``router_z_loss_coef * mean over layers and tokens of
          logsumexp(router logits)^2`` (ST-MoE, Zoph et al. 2022, eq. 5), when its weight is > 0.

        Empty before a forward, or with both weights 0. A forward with no real token gives 0.
        """
        a = self.args
        out: dict[str, torch.Tensor] = {}
        if carry is None:
            stats = [m.stats for _, m in self.moe_layers() if m.stats is not None]
            if not stats:
                return out
            rows: Any = float(max(1, sum(s.tokens for s in stats)))  # all padding: terms 0
            counts = torch.stack([s.counts for s in stats]).sum(0)
            prob_sum = torch.stack([s.prob_sum for s in stats]).sum(0)
            z_sum = torch.stack([s.z_sum for s in stats]).sum() if a.router_z_loss_coef > 0 else None
        else:
            e = a.num_experts
            counts, prob_sum, z_sum = carry[:e], carry[e:2 * e], carry[2 * e]
            rows = carry[2 * e + 1].clamp(min=1)
        if a.router_aux_loss_coef > 0:
            out["load_balancing"] = a.router_aux_loss_coef * a.num_experts * ((counts / rows) * (prob_sum / rows)).sum()
        if a.router_z_loss_coef > 0:
            out["router_z"] = a.router_z_loss_coef * z_sum / rows
        return out

    def after_optimizer_step(self, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """DeepSeek-V3's loss-free balancing (``router_bias_update_rate > 0``): every sparse
        layer's bias moves by the load counted since the last step, summed over the
        data-parallel ranks by ``all_reduce`` (one call for all layers). No-op when off."""
        layers = [m for _, m in self.moe_layers() if m.load is not None]
        if not layers:
            return
        loads = all_reduce(torch.stack([m.load for m in layers]))
        for m, load in zip(layers, loads):
            m.update_bias(load)

    @torch.no_grad()
    def aux_metrics(self, carry: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        """Expert load of the last forward: ``moe/load_max_mean/layer_{i}`` (tokens of the
        busiest expert over the mean, 1.0 = balanced) per sparse layer, and
        ``moe/dropped_fraction`` (token-expert assignments over capacity, all layers; 0 when
        dropless). A pipeline stage (its ``layers`` keyed by index) gives its layers' loads only;
        ``carry`` (:meth:`aux_carry` summed over the stages) gives the dropped fraction alone, over
        all the stages' layers."""
        if carry is not None:
            e = self.args.num_experts
            return {"moe/dropped_fraction": carry[2 * e + 2].detach() / carry[2 * e + 3].clamp(min=1)}
        out: dict[str, torch.Tensor] = {}
        dropped, total = self._dropped()
        for i, m in self.moe_layers():
            s = m.stats
            if s is not None:
                out[f"moe/load_max_mean/layer_{i}"] = s.counts.max() / s.counts.mean().clamp(min=1e-9)
        if total and not isinstance(self.layers, nn.ModuleDict):
            out["moe/dropped_fraction"] = torch.as_tensor(dropped, dtype=torch.float32) / total
        return out

    def _dropped(self) -> tuple[Any, int]:
        """Token-expert assignments over capacity and all assignments of the last forward,
        summed over this model's sparse layers."""
        dropped, total = 0, 0
        for _, m in self.moe_layers():
            if m.stats is not None:
                dropped, total = dropped + m.stats.dropped, total + m.stats.tokens * m.top_k
        return dropped, total

    def num_active_params(self) -> int:
        """Parameters one token's forward uses: all but the ``E - k`` experts it is not routed
        to in each sparse layer (tied weights once). Global counts for sharded parameters."""
        unused = 0
        for _, m in self.moe_layers():
            per_expert = sum(p.numel() for p in m.experts.parameters()) // m.num_experts
            unused += (m.num_experts - m.top_k) * per_expert
        return self.num_params() - unused

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token from the *active* parameters: ``6 * N_active + 12 * L * H *
        hd * seq_len`` (:meth:`DecoderLM.flops_per_token`'s PaLM formula with ``N`` the active
        parameters except the input embedding; a tied output projection counted). The
        router's ``2 D E`` per token is in ``N``; the dispatch (sort, gather, scatter) is not
        counted."""
        # a pipeline stage may hold neither the embedding nor the output layer
        n = self.num_active_params() - (self.tok_embeddings.weight.numel() if self.tok_embeddings is not None else 0)
        if self.args.tie_embeddings and self.output is not None:
            n += self.output.weight.numel()
        a = self.args
        return float(6 * n + 12 * a.n_layers * a.n_heads * a.head_dim * int(seq_len))


def build_qwen3_moe(cfg: Any, **kwargs: Any) -> Qwen3Moe:
    """The ``model:`` section (``name: qwen3_moe``) -> :class:`Qwen3Moe` on the current default
    device.

    Raises:
        ConfigError: invalid shape or MoE settings, or ``model.kwargs``.
    """
    reject_factory_kwargs("qwen3_moe", cfg, kwargs)
    return Qwen3Moe(qwen3_moe_args_from_config(cfg))


def active_params(model: Qwen3Moe) -> int:
    """The spec's ``active_params`` hook: :meth:`Qwen3Moe.num_active_params`."""
    return model.num_active_params()


def expert_modules(model: Qwen3Moe) -> list[nn.Module]:
    """The spec's ``experts`` hook: the :class:`~llmforge.models.qwen3_moe.moe.GroupedExperts`
    of every sparse layer (what expert parallelism splits)."""
    return [m.experts for _, m in model.moe_layers()]
