"""One real training step of one rank at the real world size, in one CPU process.

The simulation runs llmforge's own code, not a model of it: the device mesh of
:func:`llmforge.parallel.mesh.build_mesh`, the model pipeline the Trainer runs (the algorithms'
transforms -- float8 conversion, activation checkpointing -- and the strategy's tensor parallel
and FSDP2 / HSDP, :func:`llmforge.parallel.transforms.strategy_transforms`), ``LLMModule``'s
``configure_model``, ``configure_optimizers``, ``forward_backward`` (every micro-batch with
gradient accumulation, the loss normalised over the whole window), ``clip_gradients_`` and the
optimizer step. With ``fake=True`` the process group is torch's fake backend
(``torch.testing._internal.distributed.fake_pg.FakeStore``: collectives return at once) of the
real world size and every tensor is a ``FakeTensor`` (shape, dtype and device, no storage), so an
8B or 405B step costs seconds on a laptop; rank 0 is simulated (FSDP2 / TP ranks are symmetric,
so it holds the most, with rank 0's extra padding of uneven shards).

What is measured (per rank, the second of two steps: the first creates the optimizer state):

* at most :data:`SIMULATED_MICRO_BATCHES` micro-batches of gradient accumulation are run (the
  first, two middle ones and the last: the memory patterns of a step, since gradients exist
  from the second on and only the last one syncs them); the FLOPs and collectives of the
  micro-batches left out are the third one's, added per micro-batch (the second can differ:
  under ``bf16-mixed`` with FSDP2 its reduce-scatters carry less);

* memory: ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` (``MemTracker``
  without FSDP2): the peak of live tensor bytes, split at the moment of the peak into
  parameters (sharded, all-gathered, buffers), gradients, optimizer state, activations (saved
  for backward, recomputed ones included) and temporaries (everything else: gradients of
  activations, collective buffers, the batch);
* communication: every collective's payload (the unsharded tensor of an all-gather or
  reduce-scatter, the tensor of an all-reduce), counted by a dispatch mode that sees what
  ``torch.distributed.tensor.debug.CommDebugMode`` sees (see :class:`llmforge.planning.measure.ByteCounter`) and attributed to the mesh dim whose
  process group ran it;
* FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` (recomputation of activation
  checkpointing included; it sees tensor-parallel ops at their global shapes, so its count is
  divided by ``tp``), beside the model spec's formula (:meth:`ModelSpec.flops`).

Not simulated: ``torch.compile`` (the ``compile`` algorithm is left out of the traced step),
the speed of kernels, the CUDA caching allocator's fragmentation and reserve, NCCL's own
buffers and the CUDA context. The SDPA kernel is the CPU one (flash-style: it keeps the output
and the log-sum-exp, as the GPU kernels do).

Context parallelism (``strategy.cp > 1``): the step is the runtime's
:class:`~llmforge.training.steps.ContextParallelStep` (each rank's load-balanced slice of every
sequence; the attention hook's all-gathers or all-to-alls run on the fake group and are
measured over the mesh's ``cp`` dim; FSDP2's over ``dp_shard_cp``); with ``pp > 1`` the
stage's blocks run as one model on the slices, as above.

Scaling by layer count: :mod:`llmforge.planning.depth`.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from llmforge.algorithms.loading import build_algorithms
from llmforge.config.validate import validate
from llmforge.errors import ConfigError
from llmforge.models.memory_estimate import bf16_param_dtype
from llmforge.models.spec import get_spec
from llmforge.parallel.mesh import ParallelDims, build_mesh
from llmforge.parallel.transforms import check_strategy, fsdp_stage_root, strategy_transforms
from llmforge.plugin import run_pipeline
from llmforge.planning.layout import Layout, last_stage_rank, layout_config
from llmforge.planning.measure import (ByteCounter, Collective, FrozenSafeMemTracker, StepFSDPMemTracker,
                                       MicroBatchCounts, PhasePeaks, StepFlopCounter, collectives)
from llmforge.training.module import LLMModule
from llmforge.training.steps import ContextParallelStep

SIMULATED_MICRO_BATCHES = 4
"""Micro-batches of gradient accumulation a simulated step runs at most (the first, two middle
ones, the last): a step of 16 costs the time of 4; the measurement is the same (tested against
every micro-batch, ``tests/test_planning.py``)."""


@dataclass
class StepMeasurement:
    """What one simulated (or real) step of one rank measured. Bytes, FLOPs per step."""

    layout: Layout
    world_size: int
    n_layers: int
    peak_bytes: float
    breakdown: dict[str, float]
    flops: float
    formula_flops: float
    collectives: list[Collective] = field(default_factory=list)
    seconds: float = 0.0
    phases: dict[str, tuple] = field(default_factory=dict)
    """``{phase: (peak bytes, breakdown, sharded state bytes)}`` for the phases forward, loss,
    backward (each over all micro-batches) and optimizer (clipping and the step)."""
    sharded_state: float = 0.0
    """Bytes at the peak that shrink with ``dp_shard``: sharded parameters and gradients,
    optimizer state (all model state without FSDP2)."""
    simulated_layers: tuple[int, ...] = ()
    block_backward: list = field(default_factory=list)
    """Per block of this rank, in order: ``(peak bytes, breakdown, sharded state bytes)`` while
    the block ran its backward (``None`` where the tracker saw none)."""
    rank: int = 0
    """The simulated rank (0, or the last pipeline stage's first rank)."""

    def as_dict(self) -> dict[str, Any]:
        return {"peak_bytes_per_rank": self.peak_bytes, "breakdown": self.breakdown,
                "flops_per_rank": self.flops, "formula_flops_per_rank": self.formula_flops,
                "n_layers": self.n_layers, "simulated_layers": list(self.simulated_layers),
                "collectives": [vars(c) for c in self.collectives], "seconds": self.seconds,
                "sharded_state_bytes": self.sharded_state, "rank": self.rank,
                "phase_peak_bytes": {name: p[0] for name, p in self.phases.items()}}


def _fake_group(world_size: int, rank: int = 0) -> None:
    if dist.is_initialized():
        if dist.get_backend() == "fake" and dist.get_world_size() == world_size \
                and dist.get_rank() == rank:
            return
        if dist.get_backend() != "fake":
            raise RuntimeError("a real process group is initialized; simulate(fake=False) uses it")
        dist.destroy_process_group()
    # DTensor caches sharding decisions by mesh equality (the layout, not this rank's ranks),
    # and a cached result holds the mesh (and its group names) of an earlier, destroyed group
    # or another simulated rank: start from empty caches, the Python one and the C++ one
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", lambda: None)()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())


@contextlib.contextmanager
def _gc_paused() -> Any:
    # a tensor kept by a reference cycle lives until the garbage collector runs: collect now
    # and not during the step, so the measured peak does not depend on when it would have run
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


_frozen = [0]  # depth of nested frozen_heap blocks


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Leave every object alive at entry out of the garbage collector's passes until the block
    ends (``gc.freeze``, then ``gc.unfreeze``; nested blocks are one; a heap the caller froze
    is left as it is). Usable as a decorator.

    Each simulation collects garbage before its measured step (``_gc_paused``). Outside this
    block that pass walks every object the process holds (torch's, Lightning's, the test
    suite's: 0.2 s in a fresh ``llmforge plan``, more in a long process); inside, only those
    created since entry, the simulations' own, which are all its measured step can free. So the
    peaks are the same: a tracker counts only the tensors its own simulation creates, and an
    object that was alive at entry and dies inside is collected after the block.
    """
    if gc.get_freeze_count() and _frozen[0] == 0:  # the caller froze the heap: leave it to it
        yield
        return
    if _frozen[0] == 0:
        gc.collect()
        gc.freeze()
    _frozen[0] += 1
    try:
        yield
    finally:
        _frozen[0] -= 1
        if _frozen[0] == 0:
            gc.unfreeze()


def _precision_context(cfg: Any) -> Any:
    # what Lightning's precision plugin does around training_step
    if cfg.trainer.precision == "bf16-mixed":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def simulate(cfg: Any, layout: Layout, *, n_layers: Optional[int] = None, fake: bool = True,
             device: str = "cpu", last_stage: bool = False,
             every_micro_batch: bool = False, reuse: bool = True) -> StepMeasurement:
    """Run one training step of rank 0 for ``layout`` and measure it (with ``last_stage`` and
    ``layout.pp > 1``: the first rank of the last pipeline stage, :func:`last_stage_rank`).

    Args:
        cfg: a loaded run config (:func:`llmforge.config.load_config`).
        layout: degrees, activation checkpointing and micro-batch size.
        n_layers: build the model with this many blocks (``None``: the config's).
        fake: fake process group of ``layout.world_size`` and fake tensors; ``False``: real
            tensors on the process group already initialized (a gloo job, to check the fake run).
        last_stage: simulate the rank that holds the output layer and the loss; its stage's
            input, the hidden states ``[rows, seq_len, dim]`` the stage before sends, is a
            tensor that requires grad (the stage sends its gradient back).
        every_micro_batch: run all of the step's micro-batches, not at most
            :data:`SIMULATED_MICRO_BATCHES` (the same measurement, slower: for tests).
        reuse: with ``fake``, return (a copy of) the measurement of an earlier simulation in
            this process of the same config, layout and arguments (the last
            :data:`REUSED_MEASUREMENTS`): a simulation is deterministic and does not depend on
            the GPU kind, so planning one config for several GPU kinds simulates each layout
            once. ``False``: simulate again.

    Returns:
        the measurement; ``breakdown`` maps :data:`CATEGORIES` to bytes at the peak.

    Raises:
        ConfigError: the layout does not divide the batch or the model (names the key).
    """
    key = None
    if fake and reuse:
        key = (OmegaConf.to_yaml(cfg), layout, n_layers, device, last_stage, every_micro_batch)
        if key in _measured:
            _measured.move_to_end(key)
            return copy.deepcopy(_measured[key])
    try:
        m = _simulate(cfg, layout, n_layers, fake, device, last_stage, every_micro_batch)
    finally:
        # the fake group must not outlive the simulation: a later checkpoint in this process
        # would take it for a real world of layout.world_size ranks
        if fake and dist.is_initialized() and dist.get_backend() == "fake":
            dist.destroy_process_group()
    if key is not None:
        _measured[key] = copy.deepcopy(m)
        while len(_measured) > REUSED_MEASUREMENTS:
            _measured.popitem(last=False)
    return m


REUSED_MEASUREMENTS = 64
"""Fake simulations :func:`simulate` keeps for reuse in a process (a few KiB each)."""
_measured: "OrderedDict[tuple, StepMeasurement]" = OrderedDict()


def _stage_inputs(model: Any, dtype: torch.dtype) -> Any:
    """``split_batch`` for a stage without the embedding: the previous stage's hidden states
    ``[B, T, D]`` (requiring grad) instead of the token ids; the labels as usual. One row's
    storage expanded to ``B`` rows: the schedule receives (and sends the gradient of) one
    micro-batch at a time, not the step's ``B`` rows at once. The length is the batch's
    (``seq_length_warmup`` shortens it)."""
    dim = getattr(getattr(model, "args", None), "dim", None)
    if dim is None:
        raise ConfigError("strategy.pp: simulating the last pipeline stage needs the model's "
                          "hidden size as model.args.dim; this model has none")

    def split(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq_len = batch.shape[1] - 1
        row = torch.empty(1, seq_len, int(dim), dtype=dtype).requires_grad_()
        return row.expand(batch.shape[0], seq_len, int(dim)), batch[:, 1:]
    return split


def _simulate(cfg: Any, layout: Layout, n_layers: Optional[int], fake: bool,
              device: str, last_stage: bool = False, every_micro_batch: bool = False) -> StepMeasurement:
    t0 = time.perf_counter()
    rank = last_stage_rank(layout, cfg.pipeline.schedule) if last_stage else 0
    run_cfg = layout_config(cfg, layout, n_layers)
    world = layout.world_size
    plan = validate(run_cfg, world)
    dims = ParallelDims.from_config(run_cfg, world)
    check_strategy(run_cfg, dims)
    algorithms = build_algorithms(run_cfg)
    pipeline = [t for t in (a.transform() for a in algorithms) if t is not None]
    pipeline += strategy_transforms(run_cfg, dims)
    # the Trainer's rule (build_strategy): one process without a mesh only for auto / single
    with_mesh = world > 1 or run_cfg.strategy.name not in ("auto", "single")
    if fake and with_mesh:
        _fake_group(world, rank)
    mesh = build_mesh(dims, device) if with_mesh else None  # outside FakeTensorMode (real ranks)
    module = LLMModule(run_cfg, plan, pipeline)
    module.mesh_override = mesh
    module.setup_events(algorithms)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if run_cfg.trainer.precision == "bf16-true" else torch.float32)
    try:
        if fake:  # configure_model, with the pipeline on meta outside FakeTensorMode (the mesh
            # code it runs needs real tensors) and no init of the weights (no values to init)
            with torch.device("meta"):
                model = module.build_model()
                ctx = module.model_context()
                model = run_pipeline(model, pipeline, ctx)
                stage_root = fsdp_stage_root(ctx)
                if stage_root is not None:  # the rank's blocks run as one stage: its FSDP2 root
                    stage_root(model)
        else:
            module.configure_model()
    finally:
        torch.set_default_dtype(default)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with mode:
        if fake:
            module.model = model.to_empty(device=device)
        if rank != 0:  # the stage's input: the hidden states the stage before sends
            # the activations' dtype between stages: the forward's weights' (autocast keeps
            # the residual stream in fp32 over fp32 weights; a frozen base in bf16 makes it bf16)
            norm = getattr(module.model, "norm", None)
            weights = norm.weight.dtype if isinstance(norm, torch.nn.Module) else torch.float32
            module.split_batch = _stage_inputs(module.model, torch.bfloat16
                                               if bf16_param_dtype(run_cfg) else weights)
        if dims.cp > 1:  # the runtime's context-parallel step: slices, the cp attention hook
            # and its all-gathers / all-to-alls on the fake group (with pp: the stage's blocks as
            # one model, as above, on the slices)
            module.step = ContextParallelStep(module, module.model_context())
        optimizer = module.configure_optimizers()["optimizer"]
        rows = plan.micro_batch_size * plan.gradient_accumulation_steps
        n_micro = plan.gradient_accumulation_steps
        if not every_micro_batch and module.pp_schedule is None:
            n_micro = min(n_micro, SIMULATED_MICRO_BATCHES)
        batch = torch.randint(0, int(module.model.vocab_size), (rows, plan.seq_len + 1))
        model = module.model
        if isinstance(model, FSDPModule):
            tracker: MemTracker = StepFSDPMemTracker(mod=model, optm=optimizer)
        else:
            tracker = FrozenSafeMemTracker()
            tracker.track_external(model, optimizer)
        tracker.track_inputs((batch,)) if isinstance(tracker, FSDPMemTracker) else None
        comm, flops = ByteCounter(), StepFlopCounter()
        spec = get_spec(run_cfg.model.name)
        phases = PhasePeaks(tracker, spec.model_blocks(model))
        counts = MicroBatchCounts(flops, comm)
        module.setup_events([*algorithms, phases, counts])
        # the micro-batches run: a view, so the whole batch's storage is counted as before
        run = batch[:plan.micro_batch_size * n_micro]
        with tracker, _gc_paused():
            _step(module, optimizer, run)  # warm-up: the optimizer state exists from here on
            tracker.reset_mod_stats()
            # the steady-state step only: the warm-up's optimizer step creates the AdamW state
            # through DTensor, which the tracker counts at several times its size for a moment
            # (e.g. 6.3x the sharded fp32 state on a dim-1024 model over 8 ranks)
            phases.start()
            counts.after.clear()  # the warm-up's micro-batches
            with comm, flops:
                _step(module, optimizer, run)
            phases.record("optimizer")
    step_flops = float(flops.get_total_flops())
    if plan.gradient_accumulation_steps > n_micro:  # the middle micro-batches left out
        step_flops = counts.add_middle(plan.gradient_accumulation_steps - n_micro)
    total, breakdown, sharded = max(phases.peaks.values(), key=lambda p: p[0])
    # per rank: the tp group's work split over tp, each cp rank's slice of every sequence
    formula = float(spec.flops(model, plan.seq_len)) * rows * plan.seq_len / (dims.tp * dims.cp)
    return StepMeasurement(
        layout=layout, world_size=world, n_layers=len(spec.model_blocks(model)),
        peak_bytes=total, breakdown=breakdown, phases=dict(phases.peaks),
        # FlopCounterMode sees DTensor ops at their global shapes (the tp group's work)
        flops=step_flops / dims.tp, formula_flops=formula,
        collectives=collectives(comm, mesh), seconds=time.perf_counter() - t0, sharded_state=sharded,
        block_backward=list(phases.block_backward), rank=rank)


def _step(module: LLMModule, optimizer: Any, batch: torch.Tensor) -> None:
    """The body of ``LLMModule.training_step`` without Lightning (no scheduler, no metrics)."""
    with _precision_context(module.cfg):
        module.forward_backward(batch)
    module.clip_gradients_(optimizer)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


__all__ = ["SIMULATED_MICRO_BATCHES", "StepMeasurement", "frozen_heap", "simulate"]
