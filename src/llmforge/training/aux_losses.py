"""The auxiliary losses of :class:`llmforge.training.module.LLMModule`: what a model's optional
``aux_losses()`` and ``aux_metrics()`` (the model factory contract of :mod:`llmforge.models`)
give after each forward, added to the optimized loss in training and turned into the step's
records. A mixin of the module, like :class:`~llmforge.training.eval_loop.Evaluation`; it names
no model family."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["AuxLosses"]


class AuxLosses:
    """Needs the module's ``model``, ``plan`` and ``dp_all_reduce``, and two dicts the module's
    ``__init__`` creates empty: ``_aux_sums`` (the step's auxiliary terms summed over target
    tokens) and ``_aux_metric_sums`` (the model's ``aux_metrics`` summed over forwards, with
    their counts); :meth:`aux_step_metrics` empties them."""

    _aux_sums: dict[str, Any]
    _aux_metric_sums: dict[str, Any]

    def model_aux_losses(self) -> dict[str, torch.Tensor]:
        """The auxiliary losses of the model's last forward (its optional ``aux_losses()``,
        the model factory contract of :mod:`llmforge.models`; e.g. a router's load-balancing
        loss): ``name -> scalar tensor``, a mean per token, weight included; ``{}`` for models
        without."""
        fn = getattr(self.model, "aux_losses", None)
        return dict(fn()) if fn is not None else {}

    def aux_loss_sum(self, aux: dict[str, torch.Tensor], n_targets: torch.Tensor) -> torch.Tensor:
        """What the auxiliary losses add to a micro-batch's summed loss: ``n_targets * sum(aux)``
        (each is a per-token mean, and the step divides the summed loss by the target count, so
        with one micro-batch the optimized loss is ``cross-entropy + sum(aux)``, as in
        transformers' ``loss + router_aux_loss_coef * aux_loss``). Also accumulates the step's
        ``train/aux_loss`` and ``train/aux/<name>``."""
        total = torch.zeros((), dtype=torch.float32, device=n_targets.device)
        for name, value in aux.items():
            term = value.float() * n_targets
            total = total + term
            self._aux_sums[name] = self._aux_sums.get(name, 0.0) + term.detach()
        return total

    def record_aux_metrics(self, model: Any = None, carry: Any = None) -> None:
        """Accumulate the model's (or ``model``'s, e.g. one pipeline stage's) optional
        ``aux_metrics()`` (monitoring values of its last forward, e.g. expert load), or
        ``aux_metrics(carry)`` (what needs every pipeline stage's statistics), over the step's
        micro-batches."""
        fn = getattr(self.model if model is None else model, "aux_metrics", None)
        if fn is None:
            return
        for name, value in (fn() if carry is None else fn(carry)).items():
            total, count = self._aux_metric_sums.get(name, (0.0, 0))
            self._aux_metric_sums[name] = (total + torch.as_tensor(value).float(), count + 1)

    def aux_step_metrics(self, total_targets: torch.Tensor, n_micro: int) -> dict[str, Any]:
        """The step's auxiliary records: ``train/aux_loss`` (the sum of the terms, per target
        token over all data-parallel ranks; ``train/loss - train/aux_loss`` is the
        cross-entropy), ``train/aux/<name>`` per term, and the model's ``aux_metrics`` as
        means over the forwards that gave them (``n_micro`` micro-batches; each of a rank's
        pipeline stages gives its own) and the data-parallel ranks."""
        out: dict[str, Any] = {}
        if self._aux_sums:
            terms = {k: self.dp_all_reduce(torch.as_tensor(v)) / total_targets
                     for k, v in self._aux_sums.items()}
            out["train/aux_loss"] = sum(terms.values())
            out.update({f"train/aux/{k}": v for k, v in terms.items()})
        out.update({k: self.dp_all_reduce(v) / (count * self.plan.dp_size)
                    for k, (v, count) in self._aux_metric_sums.items()})
        self._aux_sums, self._aux_metric_sums = {}, {}
        return out
