"""The event contract of the step objects (:mod:`llmforge.training.steps`, issue 44): every
built-in plugin (``src/llmforge/algorithms/*``, ``src/llmforge/callbacks/*``) under every step kind
either runs (all its handlers fire) or is refused before the run with exit 2 and one line.

Where the acting plugins' effects are observed: under the micro-batch step, chunked
cross-entropy below (no full-vocabulary logits) and each plugin's own tests (test_algorithms*.py,
test_monitors.py, test_events*.py, test_resume.py); under the pipeline step, the one
multi-process run of tests/dist/pipeline_worker.py (z_loss, ema, loss_spike_guard, float8, lora,
compile, activation checkpointing against one process; the fit-start refusal of
chunked_cross_entropy by the real ``PipelineStep``) and test_pipeline.py's pp=2 CLI run (the
checkpointer, z_loss, the speed monitor and NaN guard every run has). Under the context-parallel
step (every event fires, the forward and loss events on the rank's slice): chunked
cross-entropy below (the CP step on a one-rank gloo group) and in test_context_parallel.py's
cp=2 run (the loss of one process); seq_length_warmup's check refuses lengths 2 x cp does not
divide (test_algorithms.py); the rest act as under the micro-batch step, whose code it runs.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import llmforge.algorithms
import llmforge.callbacks
from llmforge.algorithms.loading import build_algorithms
from llmforge.errors import ConfigError
from llmforge.events import Event, handles
from llmforge.parallel.mesh import ParallelDims
from llmforge.training.steps import (ContextParallelPipelineStep, ContextParallelStep, MicroBatchStep,
                                     PipelineStep, check_plugins, step_class)

from algo_harness import VOCAB, batches, make_module
from conftest import DEMO, TINY_OVERRIDES, run_main

DIMS = {"micro-batch": ParallelDims(1, 1, 1, 1),
        "pipeline": ParallelDims(1, 1, 1, 2, pp=2),
        "context-parallel": ParallelDims(1, 1, 1, 2, cp=2),
        "context-parallel pipeline": ParallelDims(1, 1, 1, 4, pp=2, cp=2)}
# hands the labels to the head at BEFORE_FORWARD, which no pipeline step fires
REFUSED = {("pipeline", "ChunkedCrossEntropy"): "the pipeline step (strategy.pp=2)",
           ("context-parallel pipeline", "ChunkedCrossEntropy"): "the pipeline step (strategy.pp=2, "
                                                                  "strategy.cp=2)"}


def builtin_plugins() -> list[type]:
    """Every class of the built-in plugin packages that handles at least one event."""
    found = []
    for pkg in (llmforge.algorithms, llmforge.callbacks):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            mod = importlib.import_module(info.name)
            for _, cls in inspect.getmembers(mod, inspect.isclass):
                if cls.__module__ == mod.__name__ and any(handles(cls, e) for e in Event):
                    found.append(cls)
    return found


def test_what_each_step_fires():
    assert step_class(DIMS["micro-batch"]) is MicroBatchStep and step_class(DIMS["pipeline"]) is PipelineStep
    assert step_class(DIMS["context-parallel"]) is ContextParallelStep
    assert step_class(DIMS["context-parallel pipeline"]) is ContextParallelPipelineStep
    assert MicroBatchStep.fires == ContextParallelStep.fires == frozenset(Event)
    assert frozenset(Event) - PipelineStep.fires == {Event.BEFORE_FORWARD}
    assert ContextParallelPipelineStep.fires == PipelineStep.fires


def test_every_builtin_plugin_under_every_step_kind_runs_or_is_refused():
    plugins = builtin_plugins()
    names = {cls.__name__ for cls in plugins}
    assert len(plugins) >= 22 and {"ChunkedCrossEntropy", "ZLoss", "EMA", "Checkpointer",
                                   "SpeedMonitor", "NaNGuard", "LoRA"} <= names, names
    for kind, dims in DIMS.items():
        for cls in plugins:
            plugin = cls.__new__(cls)  # the handlers are the class's: no settings needed
            if (kind, cls.__name__) not in REFUSED:
                check_plugins([plugin], dims)  # every handler fires under this step
                continue
            with pytest.raises(ConfigError) as err:
                check_plugins([plugin], dims)
            msg = str(err.value)
            assert err.value.exit_code == 2 and "\n" not in msg
            assert msg == (f"plugin chunked_cross_entropy handles before_forward, which "
                           f"{REFUSED[kind, cls.__name__]} never fires (llmforge.events): remove "
                           "chunked_cross_entropy from the run or set strategy.pp=1")


def test_a_refused_plugin_stops_the_cli_before_anything_is_written(tmp_path):
    """`llmforge train ... strategy.pp=2 --nproc 2` with chunked_cross_entropy: exit 2, one line,
    no process started and no run directory."""
    out = run_main("train", DEMO, *TINY_OVERRIDES, "trainer.global_batch_size=8",
                   "trainer.micro_batch_size=2", "strategy.pp=2", f"run.output_dir={tmp_path / 'runs'}",
                   "algorithms=[{name: chunked_cross_entropy}]", "--nproc", "2")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "chunked_cross_entropy handles before_forward" in lines[0] \
        and "strategy.pp=2" in lines[0], out.stderr
    assert not (tmp_path / "runs").exists()


class _LargestLogits(TorchDispatchMode):
    """The most elements of any new tensor an op makes with the vocabulary as its last dim
    (views, e.g. the transposed output weight ``[dim, V]``, are not new memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.shape[-1:] == (VOCAB,) \
                    and t.untyped_storage().data_ptr() not in inputs:
                self.most = max(self.most, t.numel())
        return out


def _context_parallel(module, store):
    """``module`` runs the context-parallel step on a one-rank gloo group (this process)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    module.mesh_override = mesh
    module.step = ContextParallelStep(module, SimpleNamespace(dims=ParallelDims(1, 1, 1, 1, cp=1), mesh=mesh))


@pytest.mark.parametrize("kind", ["micro-batch", "context-parallel"])
@pytest.mark.parametrize("algorithms", [[], [{"name": "chunked_cross_entropy", "chunk_size": 16}]])
def test_chunked_cross_entropy_acts_under_the_micro_batch_and_context_parallel_steps(algorithms, kind, tmp_path):
    """The micro-batch step (and the context-parallel one, which hands the head the labels of
    the rank's slice) fires BEFORE_FORWARD, so the head gets the labels: no tensor of more than
    one chunk's logits (16 tokens x vocab) exists, against the whole micro-batch's (2 x 32
    tokens) without the plugin; the loss is the same."""
    ref, module = make_module([]), make_module(algorithms)
    module.model.load_state_dict(ref.model.state_dict())
    if kind == "context-parallel":
        _context_parallel(module, tmp_path / "store")
    try:
        _chunked_acts(ref, module, algorithms)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _chunked_acts(ref, module, algorithms):
    module.setup_events(build_algorithms(module.cfg))
    module.event(Event.FIT_START)
    batch = batches(1, module.cfg.trainer.seq_len)[0]
    spy = _LargestLogits()
    with spy:
        loss, n = module.forward_backward(batch)
    tokens = module.plan.micro_batch_size * module.cfg.trainer.seq_len
    assert spy.most == (16 * VOCAB if algorithms else tokens * VOCAB), spy.most
    ref.setup_events([])
    ref_loss, ref_n = ref.forward_backward(batch)
    assert (loss / n).item() == pytest.approx((ref_loss / ref_n).item(), abs=1e-5)
