"""The auxiliary losses and records of a training step: what a model's optional
``aux_losses()`` and ``aux_metrics()`` (the model factory contract of :mod:`llmforge.models`)
give after each forward, added to the optimized loss in training and turned into the step's
records. A helper every step object owns (:mod:`llmforge.training.steps`); it names no model
family."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["AuxRecords", "model_aux_losses"]


def model_aux_losses(model: Any) -> dict[str, torch.Tensor]:
    """The auxiliary losses of ``model``'s last forward (its optional ``aux_losses()``; e.g. a
    router's load-balancing loss): ``name -> scalar tensor``, a mean per token, weight
    included; ``{}`` for models without."""
    fn = getattr(model, "aux_losses", None)
    return dict(fn()) if fn is not None else {}


class AuxRecords:
    """The step's auxiliary terms (summed over target tokens) and the model's ``aux_metrics``
    (summed over forwards, with their counts); :meth:`step_metrics` reads and empties them."""

    def __init__(self) -> None:
        self.sums: dict[str, Any] = {}
        self.metric_sums: dict[str, Any] = {}

    def loss_sum(self, aux: dict[str, torch.Tensor], n_targets: torch.Tensor) -> torch.Tensor:
        """What the auxiliary losses add to a micro-batch's summed loss: ``n_targets * sum(aux)``
        (each is a per-token mean, and the step divides the summed loss by the target count, so
        with one micro-batch the optimized loss is ``cross-entropy + sum(aux)``, as in
        transformers' ``loss + router_aux_loss_coef * aux_loss``). Also accumulates the step's
        ``train/aux_loss`` and ``train/aux/<name>``."""
        total = torch.zeros((), dtype=torch.float32, device=n_targets.device)
        for name, value in aux.items():
            term = value.float() * n_targets
            total = total + term
            self.sums[name] = self.sums.get(name, 0.0) + term.detach()
        return total

    def record(self, model: Any, carry: Any = None) -> None:
        """Accumulate ``model``'s (the whole model or one pipeline stage) optional
        ``aux_metrics()`` (monitoring values of its last forward, e.g. expert load), or
        ``aux_metrics(carry)`` (what needs every pipeline stage's statistics), over the step's
        micro-batches."""
        fn = getattr(model, "aux_metrics", None)
        if fn is None:
            return
        for name, value in (fn() if carry is None else fn(carry)).items():
            total, count = self.metric_sums.get(name, (0.0, 0))
            self.metric_sums[name] = (total + torch.as_tensor(value).float(), count + 1)

    def step_metrics(self, total_targets: torch.Tensor, dp_sum: Callable[[torch.Tensor], torch.Tensor],
                     dp_size: int) -> dict[str, Any]:
        """The step's auxiliary records: ``train/aux_loss`` (the sum of the terms, per target
        token over all data-parallel ranks; ``train/loss - train/aux_loss`` is the
        cross-entropy), ``train/aux/<name>`` per term, and the model's ``aux_metrics`` as
        means over the forwards that gave them (each of a rank's pipeline stages gives its
        own) and the ``dp_size`` data-parallel ranks (``dp_sum`` sums over them)."""
        out: dict[str, Any] = {}
        if self.sums:
            terms = {k: dp_sum(torch.as_tensor(v)) / total_targets for k, v in self.sums.items()}
            out["train/aux_loss"] = sum(terms.values())
            out.update({f"train/aux/{k}": v for k, v in terms.items()})
        out.update({k: dp_sum(v) / (count * dp_size) for k, (v, count) in self.metric_sums.items()})
        self.sums, self.metric_sums = {}, {}
        return out
