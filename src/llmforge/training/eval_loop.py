"""The evaluation of :class:`llmforge.training.module.LLMModule`: the loss on the fixed
evaluation set at ``trainer.eval_every`` steps, run through the events, and handed to
Lightning (``self.log`` and the callbacks' ``on_validation_end``). A mixin of the module, so a
subclass still overrides :meth:`Evaluation.evaluate` alone."""

from __future__ import annotations

import math
from typing import Optional

import torch
from lightning.pytorch.callbacks import Callback

from llmforge.events import Event
from llmforge.training.modes import eval_mode, restore_modes

__all__ = ["Evaluation"]


class Evaluation:
    """Needs the module's ``cfg``, ``model``, ``state``, ``event``, ``split_batch``,
    ``doc_ids``, ``micro_batch_loss``, ``dp_all_reduce``, ``pp_schedule`` and
    ``pipeline_evaluate``."""

    last_eval: Optional[dict[str, float]]

    @torch.no_grad()
    def evaluate(self) -> Optional[dict[str, float]]:
        """Mean loss per target token on the fixed evaluation set (see
        :meth:`LLMDataModule.eval_dataloader`), reduced over data-parallel ranks; the events
        ``BEFORE_EVALUATION``, then ``BEFORE_FORWARD`` .. ``AFTER_LOSS`` per batch with
        ``state.training = False`` and the module (``self``, the model with it) in eval mode,
        so an overridden :meth:`~llmforge.training.module.LLMModule.compute_loss` tells an
        evaluation by ``self.training``, then ``AFTER_EVALUATION``.

        Returns ``{"eval/loss": nats per token, "eval/perplexity": exp(loss)}``, or ``None``
        without a validation split.
        """
        dm = self.trainer.datamodule
        loader = dm.eval_dataloader() if dm is not None else None
        if loader is None:
            return None
        st = self.state
        st.training = False
        self.event(Event.BEFORE_EVALUATION)
        if self.pp_schedule is not None:  # pipeline stages: the schedule's forward-only pass
            return self._finish_evaluation(self.pipeline_evaluate(loader))
        # the module itself too: a compute_loss override tells evaluation by `self.training`;
        # restore_modes gives each submodule its own mode back
        modes = eval_mode(self)
        loss_sum = torch.zeros((), device=self.device)
        count = torch.zeros((), device=self.device)
        for i, batch in enumerate(loader):
            if i >= self.cfg.trainer.eval_batches:  # streaming sources have no end
                break
            inputs, labels = self.split_batch(batch)
            doc_ids = self.doc_ids(batch)
            with self.trainer.precision_plugin.forward_context():
                s = self.micro_batch_loss(i, inputs.to(self.device), labels.to(self.device),
                                          None if doc_ids is None else doc_ids.to(self.device))
            st.outputs, st.aux_losses = None, {}
            loss_sum += s.float()
            count += st.n_targets
        restore_modes(modes)
        st.training = True
        return self._finish_evaluation(self.eval_metrics(loss_sum, count))

    def eval_metrics(self, loss_sum: torch.Tensor, count: torch.Tensor) -> dict[str, float]:
        """``{"eval/loss": nats per target token, "eval/perplexity": exp(loss)}`` from this
        rank's summed token losses and target count (scalar tensors), summed over the
        data-parallel ranks first; exp is capped at exp(80) so a diverged run logs a number."""
        loss = (self.dp_all_reduce(loss_sum) / self.dp_all_reduce(count.float()).clamp(min=1)).item()
        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 80.0))}

    def _finish_evaluation(self, metrics: dict[str, float]) -> dict[str, float]:
        st = self.state
        self.last_eval = metrics
        st.eval_metrics = dict(self.last_eval)
        self.event(Event.AFTER_EVALUATION)
        return self.last_eval

    def publish_evaluation(self, metrics: dict[str, float], before_training: bool = False) -> None:
        """Hand an evaluation's metrics to Lightning the Lightning way: ``self.log`` (so
        ``trainer.callback_metrics`` holds them) and the callbacks' ``on_validation_end``
        hook, which Lightning's own ``EarlyStopping``/``ModelCheckpoint(monitor=...)`` check.
        llmforge evaluates outside Lightning's validation loop (a fixed set, every
        ``trainer.eval_every`` steps, and step 0), so it calls the hook itself.

        ``before_training``: the step-0 evaluation, from ``on_train_start``, where Lightning
        allows no step-level ``self.log`` (and an epoch-level value would come back at the
        epoch's end in place of the last evaluation's): the values go into
        ``trainer.callback_metrics`` directly, where the next evaluation's ``self.log``
        replaces them."""
        if before_training:
            self.trainer.callback_metrics.update({k: torch.tensor(float(v)) for k, v in metrics.items()})
        else:
            for key, value in metrics.items():
                self.log(key, float(value), on_step=True, on_epoch=False, logger=False, sync_dist=False)
        for cb in self.trainer.callbacks:
            if type(cb).on_validation_end is not Callback.on_validation_end:
                cb.on_validation_end(self.trainer, self)
