"""``chunked_cross_entropy``: the output projection and the loss, chunk by chunk.

YAML::

    algorithms:
      - name: chunked_cross_entropy
        chunk_size: 1024   # tokens per chunk
        head: output       # the model's output projection (an nn.Linear), by module name

A plain step materializes the logits of a whole micro-batch, ``[b, T, V]``, and their float32
copy for the loss: at vocabulary 128,256 and 8,192 tokens that is 4 GiB per sequence. Here the
output projection runs inside the loss over ``chunk_size`` tokens at a time; per chunk the
forward computes ``logits = h W^T`` (in the compute dtype), their float32 log-softmax, the
summed cross-entropy and right away its gradients (``dlogits = softmax - onehot`` on target
tokens, then ``dh = dlogits W`` and ``dW += dlogits^T h``), and frees the chunk. The backward
only scales the stored ``dh``/``dW`` by the incoming gradient. Peak extra memory: one chunk's
logits plus ``dh`` (``[b*T, D]``) and ``dW`` (float32, ``[V, D]``). This is Liger-Kernel's fused
linear cross-entropy (Hsu et al. 2024, "Liger Kernel", arXiv:2410.10989, sec. 3.3) in PyTorch,
with torchtune's chunking; the result equals the full loss and gradients up to rounding
(within 1e-6 in float32).

How it plugs in: at the convert stage the head's class becomes :class:`ChunkedLossHead` (same
parameters and state-dict keys, so checkpoints and exports are unchanged); at
``BEFORE_FORWARD`` the micro-batch's labels are handed to the head, which then returns the
summed loss instead of logits, and at ``BEFORE_LOSS`` that becomes ``state.loss`` (the default
cross-entropy is skipped). Without labels (``generate``, export) the head is a plain Linear.
Evaluation uses it too (no gradients). Under pipeline stages (``strategy.pp > 1``) it is refused
at fit start: the pipeline step fires no ``BEFORE_FORWARD`` (:mod:`llmforge.events`), so the
labels would never reach the head and the full logits would come back. Composes with FSDP2 (the head is in the root unit, its
weight is unsharded during the root's forward and gets the gradient like any other) and with
per-block ``compile`` (the head is not compiled). Tensor parallelism is refused: its output
layer is column-sharded over the vocabulary and would need a loss-parallel reduction.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmforge.errors import ConfigError
from llmforge.events import IGNORE_INDEX
from llmforge.plugin import Algorithm, CheckContext, meta_model, ModelContext, Stage


def _chunk_grads(logits: torch.Tensor, labels: torch.Tensor,
                 z_coef: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(summed loss, summed z, dloss/dlogits)`` of one chunk; ``logits`` float32 ``[c, V]``,
    labels ``[c]``. The same operations as autograd's cross-entropy (log-softmax, then
    ``exp(log_softmax) - onehot``), so the values agree to the last bits.

    With ``z_coef > 0`` the loss gains PaLM's z-loss, ``z_coef * sum(lse^2)`` over the target
    tokens (``lse = logsumexp(logits)``, the log-normalizer, at hand per chunk), whose gradient
    is ``2 z_coef lse softmax`` (:mod:`llmforge.algorithms.z_loss`); ``summed z`` is
    ``sum(lse^2)`` (0 without)."""
    valid = labels != IGNORE_INDEX
    logp = F.log_softmax(logits, dim=-1)
    loss = F.nll_loss(logp, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    grad = torch.exp(logp)
    z = torch.zeros((), dtype=torch.float32, device=logits.device)
    if z_coef:
        lse = torch.logsumexp(logits, dim=-1) * valid
        z = (lse * lse).sum()
        loss = loss + z_coef * z
        grad_z = grad * (2 * z_coef * lse[:, None])
    grad.scatter_add_(1, labels.clamp(min=0)[:, None], -torch.ones_like(logp[:, :1]))
    if z_coef:
        grad += grad_z
    grad *= valid[:, None]
    return loss, z, grad


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``h W^T (+ b)`` against ``labels``, chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                labels: torch.Tensor, chunk: int, z_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_b = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        z_sum = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk):
            hc = h[start:start + chunk]
            logits = F.linear(hc, weight, bias).float()
            part, z, grad = _chunk_grads(logits, labels[start:start + chunk], z_coef)
            loss += part
            z_sum += z
            g = grad.to(h.dtype)
            grad_h[start:start + chunk] = g @ weight.to(h.dtype)
            grad_w += (g.t() @ hc).float()
            if grad_b is not None:
                grad_b += grad.sum(0)
        ctx.save_for_backward(grad_h, grad_w, *(() if grad_b is None else (grad_b,)))
        ctx.weight_dtype, ctx.has_bias = weight.dtype, bias is not None
        ctx.mark_non_differentiable(z_sum)
        return loss, z_sum

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, _grad_z: Any = None) -> Any:
        saved = ctx.saved_tensors
        grad_h, grad_w = saved[0], saved[1]
        grad_b = (saved[2] * grad_out).to(ctx.weight_dtype) if ctx.has_bias else None
        return (grad_h * grad_out.to(grad_h.dtype), (grad_w * grad_out).to(ctx.weight_dtype),
                grad_b, None, None, None)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         labels: torch.Tensor, chunk_size: int,
                         z_coef: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy (nats, float32 scalar) of the logits ``h W^T + b`` without
    materializing them beyond one chunk, plus ``z_coef`` x the z-loss.

    Args:
        h: hidden states ``[..., D]``; weight: ``[V, D]``; bias: ``[V]`` or ``None``.
        labels: ``[...]`` (the leading dims of ``h``); -100 = no target.
        chunk_size: tokens per chunk.
        z_coef: weight of PaLM's z-loss ``sum(logsumexp(logits)^2)`` over target tokens
            (0 = none).

    Returns:
        ``(loss, z_sum)``: the summed cross-entropy plus ``z_coef * z_sum`` (differentiable),
        and ``z_sum`` (detached; 0 when ``z_coef`` is 0).
    """
    flat_h, flat_labels = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(flat_h, weight, bias, flat_labels, int(chunk_size), float(z_coef))
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    z_sum = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, flat_h.shape[0], chunk_size):
        logits = F.linear(flat_h[start:start + chunk_size], weight, bias).float()
        labels_c = flat_labels[start:start + chunk_size]
        loss += F.cross_entropy(logits, labels_c, ignore_index=IGNORE_INDEX, reduction="sum")
        if z_coef:
            lse = torch.logsumexp(logits, dim=-1)
            z_sum += torch.where(labels_c != IGNORE_INDEX, lse * lse, 0.0).sum()
    return loss + z_coef * z_sum, z_sum


class ChunkedLossHead(nn.Linear):
    """``nn.Linear`` that, when handed labels (:attr:`pending_labels`), returns the summed
    cross-entropy of its output (a scalar) instead of the logits.

    ``pending_z_coef`` (set with the labels of a training micro-batch to ``z_coef``, which
    ``z_loss`` sets at fit start) adds that weight x the z-loss to the returned loss;
    ``last_z_sum`` is then ``sum(logsumexp(logits)^2)`` over the target tokens of that forward
    (detached)."""

    pending_labels: Optional[torch.Tensor] = None
    z_coef: float = 0.0
    pending_z_coef: float = 0.0
    last_z_sum: Optional[torch.Tensor] = None
    chunk_size: int = 1024

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        labels, self.pending_labels = self.pending_labels, None
        z_coef, self.pending_z_coef = self.pending_z_coef, 0.0
        if labels is None:
            return super().forward(x)
        loss, self.last_z_sum = linear_cross_entropy(x, self.weight, self.bias, labels,
                                                     self.chunk_size, z_coef)
        return loss


class ChunkedCrossEntropy(Algorithm):
    """Computes the output projection and cross-entropy together, ``chunk_size`` tokens at a time.

    Args:
        chunk_size: tokens per chunk (>= 1).
        head: module name of the output projection (an ``nn.Linear``).

    Raises:
        ConfigError: a bad value; ``strategy.tp > 1``; ``lora`` targeting the head.
    """

    name = "chunked_cross_entropy"
    stage = Stage.CONVERT
    priority = 5  # after float8 (0) and lora (1): the head must still be a plain Linear
    order = 100  # last at BEFORE_FORWARD: it hands over the labels other handlers left
    summary = "output projection + cross-entropy chunk by chunk: no full-vocabulary logits"

    def __init__(self, chunk_size: int = 1024, head: str = "output") -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ConfigError(f"algorithms: chunked_cross_entropy.chunk_size={chunk_size!r} must be an integer >= 1")
        self.chunk_size, self.head_name = int(chunk_size), str(head)
        self.head: Optional[ChunkedLossHead] = None

    def check(self, run: CheckContext) -> None:
        if run.dims.tp > 1:
            raise ConfigError(f"algorithms: chunked_cross_entropy does not support strategy.tp="
                              f"{run.dims.tp}: the tensor-parallel output layer is sharded over "
                              "the vocabulary (a loss-parallel reduction); use strategy.tp=1")
        for a in run.algorithms:
            targets = getattr(a, "targets", None) or []
            if getattr(a, "adapters_only", False) and self.head_name in targets:
                raise ConfigError(f"algorithms: chunked_cross_entropy computes {self.head_name} "
                                  f"itself; drop '{self.head_name}' from {a.name}.targets")

    def find_head(self, model: nn.Module) -> nn.Linear:
        """The output projection named by ``head``.

        Raises:
            ConfigError: it is missing or not a plain ``nn.Linear``.
        """
        try:
            head = model.get_submodule(self.head_name)
        except AttributeError:
            head = None
        if head is None or type(head) is not nn.Linear:
            kind = "missing" if head is None else type(head).__name__
            raise ConfigError(f"algorithms: chunked_cross_entropy.head={self.head_name!r} must name "
                              f"the model's output nn.Linear (found: {kind})")
        return head

    def dry_run_lines(self, cfg: Any, plan: Any, device_memory_gib: Optional[float]) -> list[str]:
        """The fp32 logits of one chunk against those of a whole micro-batch (and the ``head``
        checked on the meta model, so a typo fails here, not at the first step)."""
        vocab = self.find_head(meta_model(cfg)).out_features
        chunk = min(self.chunk_size, plan.micro_batch_size * int(cfg.trainer.seq_len))
        full = plan.micro_batch_size * int(cfg.trainer.seq_len) * vocab * 4
        return [f"chunked CE      fp32 logits {chunk * vocab * 4 / 2**30:.2f} GiB per chunk of {chunk} "
                f"tokens instead of {full / 2**30:.2f} GiB per micro-batch (head {self.head_name}, "
                f"vocab {vocab:,})"]

    def apply(self, model: nn.Module, ctx: ModelContext) -> nn.Module:
        head = self.find_head(model)
        head.__class__ = ChunkedLossHead
        head.chunk_size = self.chunk_size
        return model

    def fit_start(self, state: Any) -> None:
        self.head = next((m for m in state.model.modules() if isinstance(m, ChunkedLossHead)), None)

    def before_forward(self, state: Any) -> None:
        if self.head is not None:
            self.head.pending_labels = state.labels
            self.head.pending_z_coef = self.head.z_coef if state.training else 0.0

    def before_loss(self, state: Any) -> None:
        if self.head is not None and state.outputs.dim() == 0:
            state.loss = state.outputs
