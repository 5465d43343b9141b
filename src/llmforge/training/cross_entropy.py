"""Summed cross-entropy whose backward makes no new ``[N, V]`` tensor.

``F.cross_entropy`` is ``log_softmax`` then ``nll_loss``: its graph saves the float32
log-probabilities ``[N, V]``, and its backward makes two more tensors of that size at once
(the gradient of the log-probabilities, zeros with ``-1/N`` at the targets, then the gradient
of the logits). That moment is the training step's peak: the backward starts while every
activation of the micro-batch is still saved (measured on the demo model: 3 x 16 MiB of the
step's ~520 MiB of live tensors; ``benchmarks/results/peers-issue30-2026-12-02b.md``).

:func:`cross_entropy_sum` runs the same ``log_softmax`` and ``nll_loss`` (the same value, bit
for bit) and keeps the log-probabilities; its backward turns them in place into the gradient
``dL/dz_i = softmax(z_i) - onehot(y_i)`` (Goodfellow et al., *Deep Learning*, 2016, section
6.2.2.3). Fused cross-entropy kernels do the same on the GPU (Liger Kernel's
``cross_entropy``; Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models", 2024,
section 3); here it is stock torch ops.

What it gives up, against ``F.cross_entropy``: a second backward through the same loss
(``retain_graph``) raises, higher derivatives (``create_graph``) and ``torch.func`` transforms
are not supported, and ``saved_tensors_hooks`` (e.g. ``save_on_cpu``) do not see the kept
log-probabilities. Research code that needs any of these overrides
:meth:`llmforge.training.module.LLMModule.compute_loss` with ``F.cross_entropy``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor

from llmforge.events import IGNORE_INDEX


class _CrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        logp = torch.log_softmax(logits, dim=-1)  # [N, V]: this Function's own tensor
        valid = labels != ignore_index
        # an intermediate, kept on ctx (not save_for_backward): the backward turns it into the
        # gradient in place, so it must not be read again (see backward)
        ctx.logp, ctx.labels, ctx.valid = logp, labels.masked_fill(~valid, 0), valid
        # nll_loss: the very reduction F.cross_entropy runs, so the value is bit-identical
        return F.nll_loss(logp, labels, ignore_index=ignore_index, reduction="sum")

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        logp = ctx.logp
        if logp is None:
            raise RuntimeError("cross_entropy_sum: backward ran twice through the same loss; its "
                               "backward consumes its saved log-probabilities (no retain_graph)")
        labels, valid = ctx.labels, ctx.valid
        ctx.logp = ctx.labels = ctx.valid = None
        # softmax(z) - onehot(y), times the upstream gradient; ignored rows end zero (no
        # host sync: their -0 goes to column 0, then the row is scaled by 0)
        g = logp.exp_()
        g.scatter_add_(1, labels.unsqueeze(1), valid.to(g.dtype).neg_().unsqueeze(1))
        g.mul_(torch.where(valid, grad, 0).to(g.dtype).unsqueeze(1))
        return g, None, None


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor,
                      ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``sum_i -log softmax(logits_i)[labels_i]`` over the rows whose label is not
    ``ignore_index``: the same value as ``F.cross_entropy(logits.float(), labels,
    ignore_index=ignore_index, reduction="sum")``, bit for bit; the gradient equal to within
    float32 rounding (one ulp).

    Args:
        logits: ``[N, V]``, any float dtype (computed in float32).
        labels: ``LongTensor[N]``.

    Returns:
        a float32 scalar tensor.

    The lean path runs outside ``torch.compile`` (inductor fuses the standard loss itself,
    ``compile_loss``) and on tensors that are not DTensors (a vocabulary-parallel loss is
    ``F.cross_entropy``'s); both of those use ``F.cross_entropy``. Its backward may run once
    (it consumes what it saved): no ``retain_graph`` through it.
    """
    logits = logits.float()
    if isinstance(logits, DTensor) or torch.compiler.is_compiling():
        return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    return _CrossEntropySum.apply(logits, labels, ignore_index)
