"""``LLMModule``: the LightningModule that trains a causal language model.

One Lightning training step is one optimizer step (manual optimization): the batch holds
``local_batch_size = micro_batch_size * gradient_accumulation_steps`` windows of
``seq_len + 1`` tokens; the module runs the micro-batches, normalizes the loss by the number of
target tokens in the whole accumulation window (over all data-parallel ranks), clips the
gradient norm once, steps AdamW and the schedule once.

Research code subclasses it and overrides :meth:`build_model`, :meth:`compute_loss`,
:meth:`training_step` or :meth:`configure_optimizers`, then names the class in YAML
(``trainer.module: my_lab.MyModule``); see ``examples/``.
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
from llmforge.models.spec import get_spec
from llmforge.parallel.init import init_parallel_model, seeded_init
from llmforge.parallel.lightning_private import attached_trainer, count_optimizer_step, strategy_mesh
from llmforge.parallel.mesh import ParallelDims, pp_size
from llmforge.parallel.schedule import build_schedule
from llmforge.parallel.transforms import fsdp_stage_root, pipeline_layout
from llmforge.plugin import ModelContext, meta_model, run_pipeline
from llmforge.training.aux_losses import AuxLosses
from llmforge.training.bridge import put_first
from llmforge.training.cross_entropy import cross_entropy_sum
from llmforge.training.eval_loop import Evaluation
from llmforge.training.gradients import GradientSteps
from llmforge.training.host_malloc import release_free_heap, tune_host_malloc
from llmforge.training.optim import build_optimizer
from llmforge.training.pipeline_steps import PipelineSteps
from llmforge.training.schedule import build_scheduler


class LLMModule(AuxLosses, Evaluation, GradientSteps, PipelineSteps, L.LightningModule):
    """Causal-LM training on a model built by a registered factory.

    Args:
        cfg: the resolved run config (:class:`llmforge.config.schema.TrainConfig`).
        plan: the batch arithmetic (:class:`llmforge.config.validate.BatchPlan`).
        pipeline: model transforms applied between build (meta) and materialization, in
            order (:mod:`llmforge.algorithms`); ``None`` = none.

    Attributes:
        model: the ``nn.Module`` (``None`` until :meth:`configure_model`).
        step_metrics: metrics of the current optimizer step (the same dict as
            ``state.metrics``); callbacks add theirs and the module writes them to every logger
            at the end of a logging step.
        state: the :class:`llmforge.events.State` every event handler receives.
        history: every record written to the loggers (``list[dict]``), for the closing summary.
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
        self._aux_sums: dict[str, Any] = {}  # AuxLosses: the step's auxiliary terms
        self._aux_metric_sums: dict[str, Any] = {}  # AuxLosses: the model's aux_metrics
        self.dispatch: Optional[Dispatcher] = Dispatcher()  # set up at fit start (setup_events)

    # ----------------------------------------------------------------- model
    def build_model(self) -> nn.Module:
        """Build the model from ``cfg.model`` with the registered factory (called on meta)."""
        factory = registry.models.get(self.cfg.model.name, key="model.name")
        return factory(self.cfg.model)

    @property
    def mesh(self) -> Any:
        """The strategy's device mesh (dims dp_replicate, dp_shard, tp; flattened dp), or None.
        Without a Lightning trainer (tests, Fabric) it is whatever ``mesh_override`` holds."""
        if self.mesh_override is not None or attached_trainer(self) is None:
            return self.mesh_override
        return strategy_mesh(self.trainer.strategy)

    def model_context(self) -> ModelContext:
        mesh = self.mesh
        if mesh is None:
            dims = ParallelDims(1, 1, 1, 1)
        else:
            sizes = [mesh[d].size() for d in ("dp_replicate", "dp_shard", "tp")]
            pp = pp_size(mesh)
            ep = mesh["ep"].size() if "ep" in (mesh.mesh_dim_names or ()) else 1
            dims = ParallelDims(*sizes, world_size=sizes[0] * sizes[1] * sizes[2] * pp, pp=pp, ep=ep)
        device = self.trainer.strategy.root_device if attached_trainer(self) is not None else self.device
        return ModelContext(cfg=self.cfg, mesh=self.mesh, dims=dims, device=device)

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
        if ctx.dims.pp > 1:  # the rank's stages of the pruned model, run by a schedule
            self.pp_layout = layout = pipeline_layout(self.cfg, ctx.dims)
            stages = layout.stages_of_rank(ctx.mesh["pp"].get_local_rank())
            self.pp_stages = (0 in stages, layout.num_stages - 1 in stages)
            self.pp_last_rank = layout.last_stage_rank()
            spec = get_spec(self.cfg.model.name)
            carry = callable(getattr(model, "aux_carry", None))
            self.pp_schedule = build_schedule(model, layout, ctx.mesh["pp"], ctx.device, self.pipeline_loss,
                                              spec.stage_ends, fsdp_stage_root(ctx), carry=carry,
                                              on_forward=self.pp_stage_forward if carry else None)
            whole = meta_model(self.cfg)  # the whole model's FLOPs for MFU (no memory)
            self.model_flops_per_token = lambda seq_len: spec.flops(whole, seq_len)

    def forward(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``tokens: LongTensor[B, T] -> logits: FloatTensor[B, T, vocab_size]``.

        ``doc_ids: LongTensor[B, T]`` (packed SFT rows): the document of each token; the model
        restarts positions and masks attention per document (:meth:`Llama.forward`).
        ``token_mask: BoolTensor[B, T]`` (SFT rows; False = padding): passed on to a model that
        declares ``takes_token_mask`` (routers leave padding out of their statistics), dropped
        for others. Without either the model is called as ``model(tokens)``."""
        assert self.model is not None, "configure_model() has not run"
        kwargs = {} if doc_ids is None else {"doc_ids": doc_ids}
        if token_mask is not None and getattr(self.model, "takes_token_mask", False):
            kwargs["token_mask"] = token_mask
        return self.model(tokens, **kwargs)

    # ------------------------------------------------------------------ loss
    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed cross-entropy over target tokens and their count (``F.cross_entropy``'s value,
        with a leaner backward: :func:`llmforge.training.cross_entropy.cross_entropy_sum`).

        Args:
            logits: ``[B, T, V]``.
            labels: ``[B, T]``; ``-100`` marks positions without a target.

        Returns:
            ``(loss_sum, n_targets)``: scalar tensors; the step divides by the number of target
            tokens of the whole accumulation window, so micro-batches with different target
            counts weigh each token equally.

        Training and evaluation both call it; during an evaluation the module is in eval mode
        (``self.training`` is ``False``, as is ``self.state.training``), so an override adds a
        training-only term under ``if self.training:`` and ``eval/loss`` stays comparable.
        """
        loss_sum = cross_entropy_sum(logits.flatten(0, 1), labels.flatten(), IGNORE_INDEX)
        return loss_sum, (labels != IGNORE_INDEX).sum()

    # -------------------------------------------------------------- training
    def backward_loss(self, loss: torch.Tensor) -> None:
        """Backward through Lightning (precision, strategy hooks), or plain without a trainer."""
        if attached_trainer(self) is not None:
            self.manual_backward(loss)
        else:
            loss.backward()

    @staticmethod
    def split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, labels)``, each ``LongTensor[B, T]``: a window batch ``[B, T + 1]`` is
        shifted by one (labels = next tokens); a dict gives ``input_ids`` and ``labels``."""
        if isinstance(batch, dict):
            return batch["input_ids"], batch["labels"]
        return batch[:, :-1], batch[:, 1:]

    @staticmethod
    def doc_ids(batch: Any) -> Optional[torch.Tensor]:
        """``LongTensor[B, T]`` document ids of a packed SFT batch (dict key ``doc_ids``), else
        None."""
        return batch.get("doc_ids") if isinstance(batch, dict) else None

    @staticmethod
    def token_mask(batch: Any) -> Optional[torch.Tensor]:
        """``BoolTensor[B, T]`` real tokens of an SFT batch (dict key ``token_mask``; False =
        padding), else None (windows have no padding)."""
        return batch.get("token_mask") if isinstance(batch, dict) else None

    # ---------------------------------------------------------------- events
    def setup_events(self, plugins: Optional[Sequence[Any]] = None) -> None:
        """Collect the event handlers of ``plugins`` (default: the Lightning trainer's
        callbacks, which include the algorithms) in their documented order
        (:mod:`llmforge.events`)."""
        if plugins is None:
            plugins = list(self.trainer.callbacks) if attached_trainer(self) is not None else []
        self.dispatch = Dispatcher(plugins)
        self.state.trainer = attached_trainer(self)

    def event(self, event: Event) -> None:
        """Run every handler of ``event`` on :attr:`state`."""
        self.dispatch(event, self.state)

    def micro_batch_loss(self, index: int, inputs: torch.Tensor, labels: torch.Tensor,
                         doc_ids: Optional[torch.Tensor],
                         token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Forward and loss of one micro-batch through the events ``BEFORE_FORWARD`` ..
        ``AFTER_LOSS``; returns ``state.loss``: the loss summed over the micro-batch's target
        tokens (a scalar tensor). ``inputs``, ``labels``, ``doc_ids``: ``LongTensor[b, T]``;
        ``token_mask``: ``BoolTensor[b, T]`` or None (:meth:`forward`)."""
        st = self.state
        st.micro_batch, st.inputs, st.labels, st.doc_ids = index, inputs, labels, doc_ids
        st.token_mask = token_mask
        self.event(Event.BEFORE_FORWARD)
        if st.doc_ids is None and st.token_mask is None:
            st.outputs = self(st.inputs)
        else:
            st.outputs = self(st.inputs, st.doc_ids, st.token_mask)
        st.aux_losses = self.model_aux_losses()
        if st.training:
            self.record_aux_metrics()
        self.event(Event.AFTER_FORWARD)
        return self.outputs_loss()

    def outputs_loss(self) -> torch.Tensor:
        """The loss events ``BEFORE_LOSS`` .. ``AFTER_LOSS`` on ``state.outputs`` and
        ``state.labels``; returns ``state.loss`` (summed over the target tokens, plus the
        model's auxiliary losses in training)."""
        st = self.state
        st.loss, st.n_targets = None, (st.labels != IGNORE_INDEX).sum()
        self.event(Event.BEFORE_LOSS)
        if st.loss is None:  # no plugin computed it (e.g. chunked cross-entropy)
            st.loss, _ = self.compute_loss(st.outputs, st.labels)
        if st.training and st.aux_losses:
            st.loss = st.loss + self.aux_loss_sum(st.aux_losses, st.n_targets)
        self.event(Event.AFTER_LOSS)
        self.dispatch.check_loss(st, Event.BEFORE_LOSS, Event.AFTER_LOSS)
        return st.loss

    def forward_backward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Run every micro-batch of one optimizer step forward and backward.

        Args:
            batch: windows ``LongTensor[local_batch_size, seq_len + 1]``, or a dict with
                ``input_ids`` and ``labels`` (``LongTensor[local_batch_size, seq_len]``, -100 =
                no target) and optionally ``doc_ids`` (packed SFT rows) and ``token_mask``
                (SFT rows, ``BoolTensor``, False = padding); see
                :meth:`split_batch`. ``BATCH_START`` handlers may replace it (shorter windows,
                other labels); the target count is taken after them.

        Gradients equal those of the mean loss over all target tokens of the whole
        accumulation window on all data-parallel ranks: each micro-batch's summed loss is
        divided by the global target count (times ``dp_size``, since data parallelism averages
        gradients over ranks).

        Returns:
            ``(loss_sum, n_targets)`` over this rank's micro-batches and over all ranks.
        """
        if self.pp_schedule is not None:
            return self.pipeline_forward_backward(batch)
        st = self.state
        st.training, st.batch = True, batch
        self.event(Event.BATCH_START)
        batch = st.batch
        inputs, labels = self.split_batch(batch)
        doc_ids, token_mask = self.doc_ids(batch), self.token_mask(batch)
        mb = self.plan.micro_batch_size
        n_micro = max(1, inputs.shape[0] // mb)
        total_targets = self.dp_all_reduce((labels != IGNORE_INDEX).sum().float()).clamp(min=1)
        st.total_targets, st.n_micro = total_targets, n_micro
        scale = self.plan.dp_size / total_targets
        loss_total = torch.zeros((), device=inputs.device)
        for i in range(n_micro):
            sl = slice(i * mb, (i + 1) * mb)
            with self.no_sync(i == n_micro - 1):
                self.micro_batch_loss(i, inputs[sl], labels[sl], None if doc_ids is None else doc_ids[sl],
                                      None if token_mask is None else token_mask[sl])
                self.event(Event.BEFORE_BACKWARD)
                # the logits [b, T, V] go before backward: the loss's graph keeps what it needs
                # (cross-entropy its log-probabilities), so backward's peak does not hold them too
                st.outputs = None
                self.backward_loss(st.loss * scale)
                # nor may the graph the loss holds outlive the micro-batch: its nodes that
                # backward skipped (frozen weights' branches, e.g. under activation
                # checkpointing) keep their saved tensors until it goes
                st.aux_losses, st.loss = {}, st.loss.detach()
                self.event(Event.AFTER_BACKWARD)
            loss_total += st.loss.detach()
        self.step_tokens = int(inputs.numel()) * self.plan.dp_size  # real tokens, all ranks
        return loss_total, total_targets

    def training_step(self, batch: Any, batch_idx: int) -> None:
        """One optimizer step: micro-batches forward/backward, clip, AdamW step, schedule step,
        with the events of :mod:`llmforge.events` in between.

        ``step_metrics`` (``state.metrics``) is filled before ``BEFORE_OPTIMIZER_STEP`` and
        ``optimizer.step()``, so handlers and Lightning's ``on_before_optimizer_step`` hooks
        (e.g. a NaN guard) see this step's loss and gradient norm. A handler that sets
        ``state.skip_step`` drops the update: no optimizer or schedule step, gradients cleared,
        the batch counted as consumed (the step number advances).
        """
        opt = self.optimizers()
        sched = self.lr_schedulers()
        st = self.state
        st.step = self.trainer.global_step + 1
        st.skip_step, st.grad_norm = False, None
        st.metrics = self.step_metrics = {}
        lr = opt.optimizer.param_groups[0]["lr"]
        loss_total, total_targets = self.forward_backward(batch)
        st.grad_norm = grad_norm = self.clip_gradients_(opt.optimizer)
        st.metrics.update({
            "train/loss": self.dp_all_reduce(loss_total) / total_targets,
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "train/tokens_seen": self.tokens_seen + self.step_tokens,
        })
        aux = self.aux_step_metrics(total_targets, st.n_micro)
        st.metrics.update(aux)
        computed = set(st.metrics)
        self.event(Event.BEFORE_OPTIMIZER_STEP)
        if self.pp_schedule is not None:  # plugins' metrics from the loss events' stage; one skip
            self.pp_agree_on_step(set(st.metrics) - computed, set(aux))
        if st.skip_step:
            opt.zero_grad(set_to_none=True)
            count_optimizer_step(self.trainer)  # the batch is consumed: step numbers stay aligned
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            self.model_after_optimizer_step()
        self.tokens_seen += self.step_tokens
        self.event(Event.AFTER_OPTIMIZER_STEP)

    def configure_optimizers(self) -> Any:
        assert self.model is not None
        optimizer = build_optimizer(self.model, self.cfg.optimizer, self.cfg.trainer.precision)
        scheduler = build_scheduler(optimizer, self.cfg.scheduler, self.cfg.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # --------------------------------------------------------------- logging
    def log_record(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Turn tensors into floats, write one record to every logger and keep it in history."""
        record: dict[str, Any] = {}
        for k, v in metrics.items():
            record[k] = v.item() if isinstance(v, torch.Tensor) else v
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
        """Lightning calls it after the data module's ``setup`` (the corpus is tokenized) and
        before :meth:`configure_model`: the heap the data path freed goes back to the kernel,
        then the allocator is tuned for the steps (``trainer.malloc_tuning``;
        :mod:`llmforge.training.host_malloc`). Tuned first, the freed heap stayed resident under
        the run's peak."""
        release_free_heap()
        if self.cfg.trainer.malloc_tuning:
            tune_host_malloc()

    def on_fit_start(self) -> None:
        """Put the :class:`~llmforge.training.bridge.EventBridge` first in the trainer's
        callbacks and collect the event handlers (:mod:`llmforge.training.bridge`)."""
        put_first(self.trainer, self)
        self.setup_events()

    def on_train_start(self) -> None:
        """After ``FIT_START`` (the bridge ran it, a resumed checkpoint is loaded) and the
        Lightning callbacks' ``on_train_start``: the evaluation before training (step 0, a
        fresh run only)."""
        self.train_start_time = time.perf_counter()
        if self.state.trainer is None:  # a subclass's on_fit_start skipped super()
            bridge = put_first(self.trainer, self)
            self.setup_events()
            bridge.on_train_start(self.trainer, self)  # Lightning's loop over the callbacks is past
        self.state.step = self.trainer.global_step
        if self.trainer.global_step == 0:
            metrics = self.evaluate()
            if metrics:
                self.log_record(0, metrics)
                self.publish_evaluation(metrics, before_training=True)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Runs after every callback's ``on_train_batch_end``: evaluate, write the record, then
        the event ``STEP_RECORDED`` (the checkpointer saves there, so a checkpoint of step N
        never exists without step N's record in the loggers)."""
        step = self.trainer.global_step
        # a callback that ends the run after this step (Lightning's Timer, ...) gets the final
        # evaluation a run that reaches trainer.max_steps gets (one that stops on an
        # evaluation's result sets should_stop during it, after this check)
        stopping = bool(self.trainer.should_stop) and step < self.cfg.trainer.max_steps
        if self.is_eval_step(step) or stopping:
            evaluated = self.evaluate() or {}
            self.step_metrics.update(evaluated)
            if evaluated:
                self.publish_evaluation(evaluated)
        if self.is_log_step(step) or any(k.startswith("eval/") for k in self.step_metrics):
            self.log_record(step, self.step_metrics)
        self.state.step = step
        self.event(Event.STEP_RECORDED)
