"""``LLMModule``: the LightningModule that trains a causal language model.

One Lightning training step is one optimizer step (manual optimization) of
``micro_batch_size * gradient_accumulation_steps`` windows, run by the step object
``configure_model`` chooses from the resolved mesh (:mod:`llmforge.training.steps`: the
micro-batch step, the pipeline step under ``strategy.pp > 1``, the context-parallel step under
``strategy.cp > 1``); the module keeps the model, the loss, the events and Lightning's hooks.

Research code subclasses it and overrides :meth:`build_model`, :meth:`compute_loss`,
:meth:`forward`, :meth:`training_step` or :meth:`configure_optimizers`, then names the class in
YAML (``trainer.module: my_lab.MyModule``); see ``examples/``.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import lightning as L
import torch
from torch import nn

from llmforge import registry
from llmforge.checkpoint.init_from import load_initial_weights
from llmforge.events import IGNORE_INDEX, Dispatcher, Event, State
from llmforge.parallel.init import init_parallel_model, seeded_init
from llmforge.parallel.lightning_private import attached_trainer, strategy_mesh
from llmforge.parallel.mesh import mesh_dims
from llmforge.plugin import ModelContext, run_pipeline
from llmforge.training.bridge import evaluate_before_training, put_first, record_step
from llmforge.training.cross_entropy import cross_entropy_sum
from llmforge.host_malloc import release_free_heap, tune_host_malloc
from llmforge.training.optim import build_optimizer
from llmforge.training.schedule import build_scheduler
from llmforge.training.steps import MicroBatchStep, Step, choose_step
from llmforge.training.steps.base import batch_doc_ids, batch_token_mask, split_batch


class LLMModule(L.LightningModule):
    """Causal-LM training on a model built by a registered factory.

    Args:
        cfg: the resolved run config (:class:`llmforge.config.schema.TrainConfig`).
        plan: the batch arithmetic (:class:`llmforge.config.batch_plan.BatchPlan`).
        pipeline: model transforms applied between build (meta) and materialization, in
            order (:mod:`llmforge.algorithms`); ``None`` = none.

    Attributes:
        model: the ``nn.Module`` (``None`` until :meth:`configure_model`).
        step_metrics: metrics of the current optimizer step (the same dict as
            ``state.metrics``); callbacks add theirs and the module writes them to every logger
            at the end of a logging step.
        state: the :class:`llmforge.events.State` every event handler receives.
        history: every record written to the loggers, for the closing summary.
        step: the :class:`~llmforge.training.steps.Step` that runs each optimizer step (the
            micro-batch step until :meth:`configure_model` chooses from the mesh).
    """

    def __init__(self, cfg: Any, plan: Any, pipeline: Optional[list] = None) -> None:
        super().__init__()
        self.cfg, self.plan = cfg, plan
        self.pipeline = pipeline or []
        self.automatic_optimization = False
        self.model: Optional[nn.Module] = None
        self.tokens_seen = 0
        self.step_metrics: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []
        self.last_eval: Optional[dict[str, float]] = None
        self.init_method = ""
        self.mesh_override: Any = None
        self.train_start_time: Optional[float] = None
        self.step_tokens = 0  # tokens (inputs, all ranks) of the last step
        self.state = State(cfg=cfg, module=self)  # what every event handler sees
        self.dispatch: Optional[Dispatcher] = Dispatcher()  # set up at fit start (setup_events)
        self.step: Step = MicroBatchStep(self)

    def build_model(self) -> nn.Module:
        """Build the model from ``cfg.model`` with the registered factory (called on meta)."""
        factory = registry.models.get(self.cfg.model.name, key="model.name")
        return factory(self.cfg.model)

    @property
    def mesh(self) -> Any:
        """The strategy's device mesh, or None; without a trainer ``mesh_override``."""
        if self.mesh_override is not None or attached_trainer(self) is None:
            return self.mesh_override
        return strategy_mesh(self.trainer.strategy)

    def model_context(self) -> ModelContext:
        """The mesh, its sizes and the device the model is built for (the pipeline's input)."""
        device = self.trainer.strategy.root_device if attached_trainer(self) is not None else self.device
        return ModelContext(cfg=self.cfg, mesh=self.mesh, dims=mesh_dims(self.mesh), device=device)

    def configure_model(self) -> None:
        """Build on the meta device, run the model pipeline (algorithms and the strategy's
        parallel transforms, sorted by stage), materialize and initialize."""
        if self.model is not None:
            return
        with torch.device("meta"):
            model = self.build_model()
        ctx = self.model_context()
        model = run_pipeline(model, self.pipeline, ctx)
        model.to_empty(device=ctx.device)
        if self.cfg.model.get("init_from"):
            # buffers and parameters the source lacks (e.g. a plugin's adapters) by the seeded init of
            # each rank's shards; no full copy of the model on rank 0 (the weights come next)
            seeded_init(model, self.cfg.run.seed)
            self.init_method = load_initial_weights(model, self.cfg.model.init_from)
        else:
            self.init_method = init_parallel_model(model, self.build_model, self.cfg.run.seed,
                                                   every_rank_builds=ctx.dims.pp > 1)
        self.model = model
        self.step = choose_step(self, ctx)  # micro-batch, pipeline or context-parallel

    def forward(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                token_mask: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``tokens: LongTensor[B, T] -> logits: FloatTensor[B, T, vocab_size]``.

        ``doc_ids: LongTensor[B, T]`` (packed SFT rows): each token's document (positions and
        attention restart per document). ``token_mask: BoolTensor[B, T]`` (False = padding):
        for a model that declares ``takes_token_mask``, dropped for others. ``positions``
        ``[B, T]``: the tokens' RoPE positions (the context-parallel step's slices)."""
        assert self.model is not None, "configure_model() has not run"
        mask = token_mask if getattr(self.model, "takes_token_mask", False) else None
        named = (("doc_ids", doc_ids), ("token_mask", mask), ("positions", positions))
        return self.model(tokens, **{k: v for k, v in named if v is not None})

    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed cross-entropy over target tokens and their count (``F.cross_entropy``'s value,
        with a leaner backward: :func:`llmforge.training.cross_entropy.cross_entropy_sum`).

        Args:
            logits: ``[B, T, V]``.
            labels: ``[B, T]``; ``-100`` marks positions without a target.

        Returns:
            ``(loss_sum, n_targets)``: scalar tensors; the step divides by the target tokens of
            the whole accumulation window, so every token weighs the same.

        Evaluation calls it in eval mode (``self.training`` is ``False``): an override adds a
        training-only term under ``if self.training:`` and ``eval/loss`` stays comparable.
        """
        loss_sum = cross_entropy_sum(logits.flatten(0, 1), labels.flatten(), IGNORE_INDEX)
        return loss_sum, (labels != IGNORE_INDEX).sum()

    def backward_loss(self, loss: torch.Tensor) -> None:
        """Backward through Lightning (precision, strategy hooks), or plain without a trainer."""
        if attached_trainer(self) is not None:
            self.manual_backward(loss)
        else:
            loss.backward()

    split_batch = staticmethod(split_batch)  # (inputs, labels) of a batch
    doc_ids = staticmethod(batch_doc_ids)  # packed SFT rows' document ids, or None
    token_mask = staticmethod(batch_token_mask)  # SFT rows' real tokens, or None

    def setup_events(self, plugins: Optional[Sequence[Any]] = None) -> None:
        """Collect the event handlers of ``plugins`` (default: the Lightning trainer's
        callbacks, which include the algorithms) in their documented order
        (:mod:`llmforge.events`), refusing a plugin whose handler the run's step never fires.

        Raises:
            ConfigError: a plugin handles an event outside ``self.step.fires``."""
        if plugins is None:
            plugins = list(self.trainer.callbacks) if attached_trainer(self) is not None else []
        self.dispatch = Dispatcher(plugins)
        self.dispatch.check_fires(self.step.fires, self.step.layout(), self.step.remedy)
        self.state.trainer = attached_trainer(self)

    def event(self, event: Event) -> None:
        """Run every handler of ``event`` on :attr:`state`."""
        self.dispatch(event, self.state)

    def forward_backward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Every micro-batch of one optimizer step forward and backward: ``(loss_sum,
        n_targets)`` (:meth:`Step.forward_backward <llmforge.training.steps.Step.forward_backward>`)."""
        return self.step.forward_backward(batch)

    def clip_gradients_(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Clip the global gradient norm once per step; returns it before clipping."""
        return self.step.clip_gradients_(optimizer)

    def dp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the data-parallel ranks (identity in one process)."""
        return self.step.dp_all_reduce(t)

    @property
    def pp_schedule(self) -> Any:
        """The pipeline schedule of the pipeline step, else ``None``."""
        return getattr(self.step, "schedule", None)

    @torch.no_grad()
    def evaluate(self) -> Optional[dict[str, float]]:
        """``{"eval/loss": nats per target token, "eval/perplexity"}`` on the fixed evaluation
        set (:meth:`LLMDataModule.eval_dataloader`) over all data-parallel ranks, through the
        events, the module in eval mode (:meth:`Step.evaluate`); ``None`` without a validation
        split."""
        dm = self.trainer.datamodule
        loader = dm.eval_dataloader() if dm is not None else None
        return None if loader is None else self.step.evaluate(loader)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        """One optimizer step: micro-batches forward/backward, clip, optimizer step, schedule
        step, with the events of :mod:`llmforge.events` in between (:meth:`Step.train`; a
        ``BEFORE_OPTIMIZER_STEP`` handler may skip the update)."""
        self.step.train(batch, self.optimizers(), self.lr_schedulers())

    def configure_optimizers(self) -> Any:
        assert self.model is not None
        optimizer = build_optimizer(self.model, self.cfg.optimizer, self.cfg.trainer.precision)
        scheduler = build_scheduler(optimizer, self.cfg.scheduler, self.cfg.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def log_record(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Turn tensors into floats, write one record to every logger and keep it in history."""
        record = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
        self.history.append({"step": step, **record})
        for logger in self.loggers:
            logger.log_metrics(record, step=step)
        return record

    def is_log_step(self, step: int) -> bool:
        every = self.cfg.trainer.log_every
        return step == 1 or step % every == 0 or step == self.cfg.trainer.max_steps

    def is_eval_step(self, step: int) -> bool:
        every = self.cfg.trainer.eval_every
        return step == self.cfg.trainer.max_steps or (every > 0 and step % every == 0)

    def setup(self, stage: str) -> None:
        """After the data module's ``setup``: the heap the data path freed goes back to the
        kernel, then the allocator is tuned (:mod:`llmforge.host_malloc`)."""
        release_free_heap()
        if self.cfg.trainer.malloc_tuning:
            tune_host_malloc()

    def on_fit_start(self) -> None:
        """The :class:`~llmforge.training.bridge.EventBridge` first, then :meth:`setup_events`."""
        put_first(self.trainer, self)
        self.setup_events()

    def on_train_start(self) -> None:
        """The evaluation of step 0 (:func:`~llmforge.training.bridge.evaluate_before_training`)."""
        self.train_start_time = time.perf_counter()
        evaluate_before_training(self)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Evaluate when due, write the record, ``STEP_RECORDED`` (:func:`~llmforge.training.bridge.record_step`)."""
        record_step(self)
