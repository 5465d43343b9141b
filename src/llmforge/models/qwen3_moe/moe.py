"""The sparse mixture-of-experts feed-forward of Qwen3-MoE: softmax top-k router, experts
computed grouped by expert, optional capacity, and the statistics of the router losses.

Numerically the same as transformers' ``Qwen3MoeSparseMoeBlock`` (``Qwen3MoeTopKRouter`` +
``Qwen3MoeExperts``): ``p = softmax(x W_r^T)`` in float32, the top-k of ``p`` (renormalized to
sum 1 when ``norm_topk_prob``), and ``y = sum_k p_k * SwiGLU_{e_k}(x)``. Module names and
layouts (torchtitan's ``GroupedExperts``)::

    router          nn.Linear(D, E), no bias            HF mlp.gate.weight          [E, D]
    experts.w1      [E, I, D] gate projection           HF mlp.experts.{e}.gate_proj.weight [I, D]
    experts.w3      [E, I, D] up projection             HF mlp.experts.{e}.up_proj.weight   [I, D]
    experts.w2      [E, D, I] down projection           HF mlp.experts.{e}.down_proj.weight [D, I]

Shapes: ``N`` tokens (``B * T``), ``D`` width, ``E`` experts, ``k`` experts per token, ``I`` an
expert's hidden width. No ranks, no trainer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

__all__ = ["GroupedExperts", "MoE", "RouterStats", "expert_swiglu", "grouped_mm_ok"]


def grouped_mm_ok(x: torch.Tensor, dims: tuple[int, ...]) -> bool:
    """Whether ``torch._grouped_mm`` can run here: the installed torch has it (2.8+), every row
    stride is a multiple of 16 bytes (its alignment rule: ``D`` and ``I`` multiples of 8 in
    bfloat16, 4 in float32), and the dtype is bfloat16, or float32 in eager mode on the CPU
    (torch 2.13's CPU kernel takes float32, forward and backward, but its meta kernel, which
    ``torch.compile`` traces, and the CUDA kernel take bfloat16 only; so do fake tensors)."""
    if not hasattr(torch, "_grouped_mm") or any(d * x.element_size() % 16 for d in dims):
        return False
    if x.dtype == torch.bfloat16:
        return True
    # is_compiling() first: dynamo cannot trace is_fake (issue 50)
    return (x.dtype == torch.float32 and x.device.type == "cpu"
            and not torch.compiler.is_compiling() and not is_fake(x))


def expert_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  w3: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """Each expert's SwiGLU ``w2_e(silu(w1_e x) * w3_e x)`` on its own rows.

    Args:
        x: ``[M, D]`` rows sorted by expert (expert 0's rows first).
        counts: ``[E]`` int64 rows per expert (sums to ``M``).
        w1, w3: ``[E, I, D]``; w2: ``[E, D, I]``.
        impl: ``grouped_mm`` (``torch._grouped_mm``: one kernel per projection for all
            experts), ``loop`` (one matmul per non-empty expert) or ``auto`` (grouped_mm where
            :func:`grouped_mm_ok`, else loop).

    Returns:
        ``[M, D]`` in the row order of ``x``.
    """
    if impl != "grouped_mm" and not torch.compiler.is_compiling() and is_fake(x) and (
            x.dtype != torch.bfloat16 or not grouped_mm_ok(x, (w1.shape[-1], w1.shape[-2]))):
        # the planner's simulation (fake tensors: no counts to loop over): the meta kernel of
        # _grouped_mm takes bfloat16 only, with D and I multiples of 8 (training's loop takes
        # any): bfloat16 temporaries at most 7 columns wider (the FLOPs are counted by formula)
        d, i = w1.shape[-1], w1.shape[-2]
        pd, pi = -d % 8, -i % 8
        w1, w2, w3, xb = (t.bfloat16() for t in (w1, w2, w3, x))
        if pd or pi:  # (aligned: no padded copies, so no extra bytes measured)
            w1, w3 = (F.pad(w, (0, pd, 0, pi)) for w in (w1, w3))
            w2, xb = F.pad(w2, (0, pi, 0, pd)), F.pad(xb, (0, pd))
        out = expert_swiglu(xb, counts, w1, w2, w3, "grouped_mm")
        return (out[:, :d] if pd else out).to(x.dtype)
    if impl == "auto":
        impl = "grouped_mm" if grouped_mm_ok(x, (w1.shape[-1], w1.shape[-2])) else "loop"
    if impl == "grouped_mm":
        offs = torch.cumsum(counts, 0).to(torch.int32)  # end row of each group, on the device
        h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
    if torch.compiler.is_compiling():
        # the loop's trip count is data (counts.tolist()): one opaque op for torch.compile
        return expert_swiglu_loop(x, counts, w1, w2, w3)
    return _loop(x, counts, w1, w2, w3)


def _loop(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
          w3: torch.Tensor) -> torch.Tensor:
    """:func:`expert_swiglu`'s ``loop``: one SwiGLU per non-empty expert on its rows."""
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            xe = x[start:start + n]
            out.append(F.linear(F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e]), w2[e]))
            start += n
    return torch.cat(out) if out else x.new_zeros(0, w2.shape[1])


@torch.library.custom_op("llmforge::expert_swiglu_loop", mutates_args=())
def expert_swiglu_loop(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                       w3: torch.Tensor) -> torch.Tensor:
    """:func:`expert_swiglu`'s ``loop`` as a custom operator, which ``torch.compile`` keeps as
    one opaque call (fullgraph: no graph break at ``counts.tolist()``); shapes as
    :func:`expert_swiglu`, output ``[M, D]``. Backward: :func:`expert_swiglu_loop_backward`."""
    return _loop(x, counts, w1, w2, w3)


@expert_swiglu_loop.register_fake
def _(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
      w3: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w2.shape[1])


@torch.library.custom_op("llmforge::expert_swiglu_loop_backward", mutates_args=())
def expert_swiglu_loop_backward(grad: torch.Tensor, x: torch.Tensor, counts: torch.Tensor,
                                w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dx, dw1, dw2, dw3)`` of :func:`expert_swiglu_loop` for ``grad [M, D]``,
    per expert with ``a = x w1^T``, ``b = x w3^T``, ``h = silu(a) b`` recomputed:
    ``dw2 = g^T h``, ``dh = g w2``, ``da = dh b silu'(a)``, ``db = dh silu(a)``,
    ``dx = da w1 + db w3``, ``dw1 = da^T x``, ``dw3 = db^T x``, with
    ``silu'(a) = s (1 + a (1 - s))``, ``s = sigmoid(a)`` (aten's silu_backward)."""
    dx, dw1, dw2, dw3 = (torch.zeros_like(t) for t in (x, w1, w2, w3))
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            xe, g = x[start:start + n], grad[start:start + n]
            a, b = F.linear(xe, w1[e]), F.linear(xe, w3[e])
            s = torch.sigmoid(a)
            act = a * s
            dw2[e] = g.t() @ (act * b)
            dh = g @ w2[e]
            da, db = dh * b * (s * (1 + a * (1 - s))), dh * act
            dx[start:start + n] = da @ w1[e] + db @ w3[e]
            dw1[e], dw3[e] = da.t() @ xe, db.t() @ xe
            start += n
    return dx, dw1, dw2, dw3


@expert_swiglu_loop_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor,
      w2: torch.Tensor, w3: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty_like(t) for t in (x, w1, w2, w3))


def _setup(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: object, grad: torch.Tensor) -> tuple:
    x, counts, w1, w2, w3 = ctx.saved_tensors
    dx, dw1, dw2, dw3 = expert_swiglu_loop_backward(grad.contiguous(), x, counts, w1, w2, w3)
    return dx, None, dw1, dw2, dw3


expert_swiglu_loop.register_autograd(_backward, setup_context=_setup)


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts stored as three 3-D parameters (see the module docstring)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w1, mean=0.0, std=std)
        nn.init.normal_(self.w3, mean=0.0, std=std)
        nn.init.normal_(self.w2, mean=0.0, std=out_std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, impl: str = "auto") -> torch.Tensor:
        """``x [M, D]`` sorted by expert, ``counts [E]`` -> ``[M, D]`` (:func:`expert_swiglu`).

        Weights split by expert parallelism (DTensors sharded on dim 0) compute with this
        rank's experts: the dispatch then hands in their rows and ``counts [E / ep]``. The
        weights come through :meth:`local_weight` in the dtype of ``x``."""
        w1, w2, w3 = (self.local_weight(n).to(x.dtype) for n in ("w1", "w2", "w3"))
        return expert_swiglu(x, counts, w1, w2, w3, impl)

    def local_weight(self, name: str) -> torch.Tensor:
        """This rank's experts of weight ``name`` (``w1``, ``w2``, ``w3``): ``[E_local, out, in]``,
        what the forward computes with (an adapter plugin overrides it: the spec's ``experts``
        contract)."""
        return _local(getattr(self, name))


def _local(w: torch.Tensor) -> torch.Tensor:
    # a DTensor's own shard (this rank's experts); a plain tensor as it is
    to_local = getattr(w, "to_local", None)
    return to_local() if to_local is not None else w


@dataclass
class RouterStats:
    """What one MoE layer's last forward leaves for the router losses and the metrics, over its
    real tokens (every token without a ``token_mask``; the mask's True positions with one).

    ``counts [E]`` float32 top-k assignments per expert (before capacity; no gradient);
    ``prob_sum [E]`` float32 routing probabilities summed over the tokens (differentiable);
    ``z_sum`` float32 sum over tokens of ``logsumexp(router logits)^2`` (differentiable; ``None``
    when the z-loss is off); ``tokens`` the real tokens' count; ``dropped`` token-expert
    assignments over capacity (int64 scalar tensor)."""

    counts: torch.Tensor
    prob_sum: torch.Tensor
    z_sum: Optional[torch.Tensor]
    tokens: int
    dropped: torch.Tensor


class MoE(nn.Module):
    """Sparse feed-forward ``x [B, T, D] -> [B, T, D]``: softmax top-k router, experts computed
    grouped by expert, dropless unless ``capacity_factor`` is set.

    Args:
        dim, hidden_dim: ``D`` and an expert's ``I``.
        num_experts, top_k: ``E`` and ``k`` (``1 <= k <= E``).
        norm_topk_prob: renormalize the k selected probabilities to sum to 1.
        capacity_factor: ``None`` = dropless; else each expert takes at most
            ``ceil(capacity_factor * N * k / E)`` of its assignments, earliest tokens first (the
            Switch Transformer's expert capacity, Fedus et al. 2021, sec. 2.2); the rest add
            nothing (the token keeps its residual). ``stats.dropped`` counts them.
        with_z: keep the router z-loss sum in :attr:`stats`.
        bias_update_rate: > 0: DeepSeek-V3's auxiliary-loss-free balancing (DeepSeek-AI 2024,
            "DeepSeek-V3 Technical Report", sec. 2.1.2): the top-k experts are chosen by
            ``probs + expert_bias`` while the weights stay the unbiased probabilities, and
            :meth:`update_bias` moves ``expert_bias`` by ``bias_update_rate`` towards the
            under-loaded experts after each optimizer step.

    Padding (``forward``'s ``token_mask``): positions marked False are not routed (no expert
    computes them, they take no capacity; their output is 0) and count in no statistic, so the
    load-balancing and z-losses, the balancing load and the dropped count are those of the real
    tokens, as transformers' ``load_balancing_loss_func`` with an ``attention_mask``.

    Attributes:
        stats: the :class:`RouterStats` of the last forward (``None`` before one).
        impl: the expert computation (:func:`expert_swiglu`'s ``impl``).
        expert_bias: ``[E]`` float32 buffer (saved in checkpoints) when balancing, else ``None``.
        load: ``[E]`` float32 assignments counted in training forwards since the last
            :meth:`update_bias` (not saved), when balancing.
        takes_token_mask: True (the block passes its ``token_mask`` on; dense FFNs lack it).
    """

    takes_token_mask = True

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool = True, capacity_factor: Optional[float] = None,
                 with_z: bool = False, bias_update_rate: float = 0.0) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.capacity_factor, self.with_z, self.impl = capacity_factor, with_z, "auto"
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.stats: Optional[RouterStats] = None
        self.bias_update_rate = bias_update_rate
        self.expert_bias: Optional[torch.Tensor]
        self.load: Optional[torch.Tensor]
        if bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
            self.register_buffer("load", torch.zeros(num_experts, dtype=torch.float32), persistent=False)
        else:
            self.expert_bias = self.load = None

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.router.weight, mean=0.0, std=std)
        self.experts.init_weights(std, out_std)
        if self.expert_bias is not None:
            self.expert_bias.zero_()
            self.load.zero_()

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """``expert_bias += rate * sign(mean(load) - load)`` (DeepSeek-V3 eq. 16's rule) and the
        counted load reset; ``load [E]`` is this layer's :attr:`load` summed over the
        data-parallel ranks, so every rank moves its bias alike. Only the sign of each expert's
        deviation counts, so a forward counted twice (activation-checkpointing recompute) changes
        nothing."""
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.load.zero_()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [N, D]`` -> ``(logits [N, E], probs [N, E] float32, weights [N, k] in x.dtype,
        experts [N, k] int64)`` (transformers' ``Qwen3MoeTopKRouter``: softmax in float32,
        top-k, optional renormalization)."""
        logits = self.router(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        if self.expert_bias is not None:  # choose with the balancing bias, weigh without it
            idx = torch.topk(probs + self.expert_bias, self.top_k, dim=-1).indices
            top = probs.gather(-1, idx)
        else:
            top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, probs, top.to(logits.dtype), idx

    def forward(self, x: torch.Tensor, token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x [B, T, D]`` -> ``[B, T, D]``; sets :attr:`stats`.

        ``token_mask [B, T]`` bool (optional; True = a real token, False = padding): padding is
        left out of the routing and the statistics (class docstring). Costs one host sync (the
        number of real tokens sizes the dispatch)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n, k, e = x.shape[0], self.top_k, self.num_experts
        logits, probs, weights, idx = self.route(x)
        flat = idx.reshape(-1)  # [N*k] expert of each assignment, token-major
        real = None
        if token_mask is not None:
            real = token_mask.reshape(-1).to(torch.bool)
            # a padding token's assignments go to bin e: out of the counts, sorted last
            flat = torch.where(real[:, None].expand(n, k).reshape(-1), flat, e)
        # counts without a host sync (histc on float ids; bincount would sync on CUDA)
        counts_f = torch.histc(flat.float(), bins=e + 1, min=0, max=e + 1)[:e]
        if self.load is not None and self.training:
            self.load += counts_f.detach()
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, tokens in order
        counts = counts_f.long()
        if real is not None:
            n = int(real.sum())  # host sync: the padding's assignments leave the dispatch
            order = order[:n * k]
        dropped = torch.zeros((), dtype=torch.long, device=x.device)
        if self.capacity_factor is not None:
            cap = math.ceil(self.capacity_factor * n * k / e)
            starts = torch.cumsum(counts, 0) - counts
            sorted_e = flat[order]
            keep = torch.arange(order.numel(), device=x.device) - starts[sorted_e] < cap
            order = order[keep]
            kept = counts.clamp(max=cap)
            dropped = counts.sum() - kept.sum()
            counts = kept
        token = order // k
        y = self.experts(x[token], counts, self.impl)
        y = y * weights.reshape(-1)[order, None]
        out = torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))
        z = None
        if self.with_z:
            lse = torch.logsumexp(logits.float(), dim=-1)
            z = (lse * lse if real is None else torch.where(real, lse * lse, 0.0)).sum()
        prob_sum = probs.sum(0) if real is None else torch.where(real[:, None], probs, 0.0).sum(0)
        self.stats = RouterStats(counts=counts_f.detach(), prob_sum=prob_sum, z_sum=z,
                                 tokens=n, dropped=dropped)
        return out.reshape(shape)
