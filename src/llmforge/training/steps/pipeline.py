"""The pipeline step: the model is cut into pipeline stages (``strategy.pp > 1``;
:mod:`llmforge.parallel.pipeline`) and one optimizer step runs the schedule once over the
rank's batch, split into ``pipeline.microbatches`` micro-batches.

Every rank of a pipeline reads the same batch; the first stage feeds the inputs, the last
computes the loss, and packed SFT rows' document ids (``doc_ids``) and, in training, SFT rows'
``token_mask`` (for a model that takes it) go to every stage's forward. The events it fires
(:attr:`PipelineStep.fires`; :mod:`llmforge.events` has the table): ``BATCH_START`` on every
rank; ``AFTER_FORWARD``, ``BEFORE_LOSS`` and ``AFTER_LOSS`` once per micro-batch, in
micro-batch order, on the ranks that hold the last stage, where the logits are
(``state.inputs`` is ``None`` there: the tokens are on the first stage); ``BEFORE_BACKWARD`` and
``AFTER_BACKWARD`` once per step around the schedule (its forwards and backwards interleave).
``BEFORE_FORWARD`` does not fire (a handler could not change inputs already sent), so a
plugin that handles it is refused at fit start. ``state.loss`` of each micro-batch is summed
like gradient accumulation's, and the step's sum is sent from the last stage to every stage (a
sum over the ``pp`` group, zero elsewhere), so every rank's ``train/loss`` (and every logger)
sees the same value. The metrics plugins add at ``BEFORE_OPTIMIZER_STEP`` (e.g.
``train/z_loss``, summed from the loss events) are the last stage's on every rank once the
event is over, and a skip (``state.skip_step``) set on any stage holds on all
(:meth:`PipelineStep.agree_on_step`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from llmforge.events import IGNORE_INDEX, Event
from llmforge.models.spec import get_spec
from llmforge.parallel.schedule import build_schedule, forward_only
from llmforge.parallel.transforms import fsdp_stage_root, pipeline_layout
from llmforge.plugin import meta_model
from llmforge.training.modes import eval_mode, restore_modes
from llmforge.training.steps.base import EVERY_EVENT, Step

__all__ = ["PipelineStep"]


class PipelineStep(Step):
    """The rank's pipeline stages of the pruned model, run by a ``torch.distributed.pipelining``
    schedule (:func:`llmforge.parallel.schedule.build_schedule`).

    Args:
        module: the module (its ``model`` is this rank's stages, already materialized).
        ctx: the :class:`~llmforge.plugin.ModelContext` the model was built with (its
            ``dims.pp > 1`` and the mesh's ``pp`` dim).

    Attributes:
        pipeline: the :class:`~llmforge.parallel.pipeline.PipelineLayout` (stages, schedule).
        schedule: the schedule object.
        stages: whether this rank holds the first and the last stage.
        last_rank: the ``pp`` rank that holds the last stage.
    """

    kind = "pipeline"
    fires = EVERY_EVENT - {Event.BEFORE_FORWARD}

    def __init__(self, module: Any, ctx: Any) -> None:
        super().__init__(module)
        model, cfg = module.model, module.cfg
        self.dims = ctx.dims
        self.pipeline = layout = pipeline_layout(cfg, ctx.dims)
        stages = layout.stages_of_rank(ctx.mesh["pp"].get_local_rank())
        self.stages = (0 in stages, layout.num_stages - 1 in stages)
        self.last_rank = layout.last_stage_rank()
        spec = get_spec(cfg.model.name)
        carry = callable(getattr(model, "aux_carry", None))
        self.schedule = build_schedule(model, layout, ctx.mesh["pp"], ctx.device, self.pipeline_loss,
                                       spec.stage_ends, fsdp_stage_root(ctx), carry=carry,
                                       on_forward=self.stage_forward if carry else None)
        whole = meta_model(cfg)  # the whole model's FLOPs for MFU (no memory)
        module.model_flops_per_token = lambda seq_len: spec.flops(whole, seq_len)

    remedy = "set strategy.pp=1"

    @classmethod
    def layout_of(cls, dims: Any) -> str:
        return f"the pipeline step (strategy.pp={dims.pp if dims is not None else '>1'})"

    def pp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the pipeline ranks (a value only the last stage has reaches all)."""
        t = t.detach().clone()
        dist.all_reduce(t, group=self.module.mesh["pp"].get_group())
        return t

    def stage_forward(self, stage: Any) -> None:
        """After each training forward of one of this rank's stages (a model with auxiliary
        losses): accumulate the stage's ``aux_metrics()`` (its own layers', e.g. expert load)."""
        if self.state.training:
            self.aux.record(stage)

    def agree_on_step(self, keys: set[str], merged: set[str] = frozenset()) -> None:
        """Make every ``pp`` rank's step decision the same, after ``BEFORE_OPTIMIZER_STEP``:
        ``state.metrics[k]`` for the last stage's ``k in keys`` becomes the last stage's value
        (tensors become floats) and ``state.skip_step`` is true on all stages if a handler set
        it on any. A plugin's metric summed from the loss events (``state.dp_sum`` at
        ``BEFORE_OPTIMIZER_STEP``) exists only where the loss is, and loggers write from rank
        0, the first stage; a stage that stepped while another skipped would leave the model
        half updated (``loss_spike_guard`` decides on values that are already the same on all
        stages; a plugin watching the loss events sees them on the last stage only). One small
        object gathered over the ``pp`` group per step (the key sets may differ between
        stages, so no tensor collective). ``merged`` (the model's auxiliary records): every
        stage's, a key several stages give (e.g. ``moe/dropped_fraction``) their mean; each
        stage's expert load keys are its own layers'."""
        st = self.state

        def floats(names: set[str]) -> dict[str, Any]:
            return {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in st.metrics.items()
                    if k in names}

        mine = (floats(keys), bool(st.skip_step), floats(merged))
        group = self.module.mesh["pp"].get_group()
        box: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(box, mine, group=group)
        st.metrics.update(box[self.last_rank][0])
        st.skip_step = any(skip for _, skip, _ in box)
        values: dict[str, list[Any]] = {}
        for _, _, aux in box:
            for k, v in aux.items():
                values.setdefault(k, []).append(v)
        st.metrics.update({k: sum(v) / len(v) for k, v in values.items()})

    def pipeline_loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function (last stage, one call per micro-batch): the loss events
        on ``output`` (logits ``[b, T, V]``, or ``(logits, carry)`` for a model with
        ``aux_carry()``: its auxiliary losses from the whole model's ``carry``) and ``target``
        (``LongTensor[b, T]``); returns the
        micro-batch's summed loss scaled for the backward (``dp_size / total targets``)."""
        st, model = self.state, self.module.model
        st.micro_batch, self._micro = self._micro, self._micro + 1
        carry = None
        if isinstance(output, tuple):  # (logits, the model's aux_carry summed over all stages)
            output, carry = output
        aux = model.aux_losses(carry) if carry is not None and st.training else {}
        if carry is not None and st.training:
            self.aux.record(model, carry)  # e.g. the dropped fraction over all stages
        st.inputs, st.labels, st.doc_ids, st.outputs, st.aux_losses = None, target, None, output, aux
        self.event(Event.AFTER_FORWARD)
        loss = self.outputs_loss()
        self.loss_sum = self.loss_sum + loss.detach().float()
        self.target_count = self.target_count + st.n_targets
        st.outputs = None  # the logits must not outlive their micro-batch
        return loss * self._scale if st.training else loss

    def run_schedule(self, inputs: torch.Tensor, labels: torch.Tensor, train: bool,
                      doc_ids: Any = None, token_mask: Any = None, positions: Any = None) -> None:
        """One pass of the schedule over ``inputs``/``labels`` (``LongTensor[B, T]``, split into
        ``pipeline.microbatches``): forward and backward (``train``) or forward only; leaves
        this rank's summed loss and target count in ``loss_sum``/``target_count`` (the last
        stage's; zero on the others). ``positions`` (``LongTensor[B, T]``, context parallelism:
        the RoPE positions of a slice of every row) reach every stage like ``doc_ids``."""
        first, last = self.stages
        self._micro = 0
        self.loss_sum = torch.zeros((), device=inputs.device)
        self.target_count = torch.zeros((), device=inputs.device)
        args = (inputs,) if first else ()
        target = labels if last else None
        # keyword tensors are split into micro-batches like the inputs and reach every stage
        # (every rank reads the whole batch): packed rows' document ids mask each stage's blocks
        kwargs = {} if doc_ids is None else {"doc_ids": doc_ids}
        if positions is not None:
            kwargs["positions"] = positions
        if token_mask is not None and getattr(self.module.model, "takes_token_mask", False):
            kwargs["token_mask"] = token_mask  # padding out of the routers (LLMModule.forward)
        if train:
            self.schedule.step(*args, target=target, return_outputs=False, **kwargs)
        else:
            with forward_only(self.schedule):
                self.schedule.eval(*args, target=target, **kwargs)

    def forward_backward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`LLMModule.forward_backward` through the pipeline schedule (same returns:
        ``(loss_sum, n_targets)``, the loss sum of this data-parallel rank's batch, the same on
        every stage)."""
        st, module = self.state, self.module
        st.training, st.batch = True, batch
        self.event(Event.BATCH_START)
        inputs, labels = module.split_batch(st.batch)
        total_targets = self.dp_all_reduce((labels != IGNORE_INDEX).sum().float()).clamp(min=1)
        st.total_targets, st.n_micro = total_targets, self.pipeline.microbatches
        self._scale = self.gradient_ranks() / total_targets
        self.event(Event.BEFORE_BACKWARD)
        self.run_schedule(inputs, labels, train=True, doc_ids=module.doc_ids(st.batch),
                           token_mask=module.token_mask(st.batch))
        self.event(Event.AFTER_BACKWARD)
        module.step_tokens = int(inputs.numel()) * module.plan.dp_size
        return self.pp_all_reduce(self.loss_sum), total_targets

    def eval_sums(self, loader: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed loss and target count over ``trainer.eval_batches`` batches of ``loader``,
        through the schedule's forward-only ``eval``, the same on every stage: the batches go
        through in groups of ``pipeline.microbatches``; a last, smaller group is filled up with
        rows without targets (labels -100), which change neither the sum nor the count; so is
        the loader's last batch when it has fewer rows than the first (one shape for every
        micro-batch)."""
        module = self.module
        m = self.pipeline.microbatches
        loss_sum = torch.zeros((), device=module.device)
        count = torch.zeros((), device=module.device)
        group: list[tuple[torch.Tensor, torch.Tensor, Any]] = []

        def flush() -> None:
            nonlocal loss_sum, count
            while len(group) < m:
                group.append((group[0][0], torch.full_like(group[0][1], IGNORE_INDEX), group[0][2]))
            inputs = torch.cat([g[0] for g in group]).to(module.device)
            labels = torch.cat([g[1] for g in group]).to(module.device)
            doc_ids = None if group[0][2] is None else torch.cat([g[2] for g in group]).to(module.device)
            with module.trainer.precision_plugin.forward_context():
                self.run_schedule(inputs, labels, train=False, doc_ids=doc_ids)
            loss_sum += self.loss_sum
            count += self.target_count
            group.clear()

        modes = eval_mode(module)  # the module too: compute_loss overrides read self.training
        rows = 0
        try:
            for i, batch in enumerate(loader):
                if i >= module.cfg.trainer.eval_batches:
                    break
                inputs, labels = module.split_batch(batch)
                doc_ids = module.doc_ids(batch)
                rows = rows or inputs.shape[0]
                if inputs.shape[0] < rows:  # the loader's last, smaller batch: every micro-batch of
                    # a schedule has one shape, so it is filled up with rows without targets
                    def fill(t: torch.Tensor) -> torch.Tensor:
                        return torch.cat([t, t[:1].expand(rows - t.shape[0], *t.shape[1:])])

                    inputs, doc_ids = fill(inputs), None if doc_ids is None else fill(doc_ids)
                    labels = torch.cat([labels, labels.new_full((rows - labels.shape[0], *labels.shape[1:]),
                                                                IGNORE_INDEX)])
                group.append((inputs, labels, doc_ids))
                if len(group) == m:
                    flush()
            if group:
                flush()
        finally:
            restore_modes(modes)
        return self.pp_all_reduce(loss_sum), self.pp_all_reduce(count.float())

    def total_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The L2 norm over all stages from this rank's stages' ``norm`` (sum of squares over
        the ``pp`` group)."""
        return self.pp_all_reduce(norm.float() ** 2).sqrt()
