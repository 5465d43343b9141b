"""Shared by the benchmarks that compare one process with a 2-process gloo run of the same model
(``cp.py``, ``pipeline.py``): the timed training steps inside a worker, and starting a worker.

Not a benchmark itself (the leading underscore); the scripts import it from their own folder.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]


def tiny_config(dim: int, layers: int, seq: int) -> Any:
    """The benchmarks' Llama 3 config: ``dim``, ``layers`` blocks, 8 heads (4 KV), 2,048 ids,
    rows of ``seq`` tokens; the caller sets the batch and the strategy."""
    from omegaconf import OmegaConf

    from llmforge.config.schema import TrainConfig

    cfg = OmegaConf.structured(TrainConfig)
    cfg.model.merge_with({"dim": dim, "n_layers": layers, "n_heads": 8, "n_kv_heads": 4,
                          "vocab_size": 2048, "multiple_of": 32, "max_seq_len": seq})
    return cfg


def build_module(cfg: Any, world: int) -> tuple[Any, Any]:
    """``(LLMModule with its model configured, its optimizer)`` for ``cfg`` on ``world`` ranks
    (the process group initialized when ``world > 1``; the mesh built on the CPU)."""
    from llmforge.config.validate import plan_batch
    from llmforge.parallel.mesh import ParallelDims, build_mesh
    from llmforge.parallel.transforms import strategy_transforms
    from llmforge.training.module import LLMModule
    from llmforge.training.optim import build_optimizer

    dims = ParallelDims.from_config(cfg, world)
    mod = LLMModule(cfg, plan_batch(cfg, world), pipeline=strategy_transforms(cfg, dims))
    if world > 1:
        mod.mesh_override = build_mesh(dims, "cpu")
    mod.configure_model()
    return mod, build_optimizer(mod.model, cfg.optimizer)


def timed_steps(mod: Any, opt: Any, batch: Callable[[], torch.Tensor], warmup: int, steps: int,
                world: int) -> tuple[float, list[float]]:
    """``(median seconds per step after warmup, loss per token of every step)`` of ``warmup +
    steps`` optimizer steps of ``mod`` (an ``LLMModule`` with its model configured) on the
    batches ``batch()`` returns (``LongTensor[B, T + 1]``, drawn after ``torch.manual_seed(0)``)."""
    torch.manual_seed(0)
    times, losses = [], []
    for step in range(warmup + steps):
        rows = batch()
        start = time.perf_counter()
        loss, n = mod.forward_backward(rows)
        mod.clip_gradients_(opt)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if world > 1:
            dist.barrier()
        if step >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss / n))
    return statistics.median(times), losses


def run_worker(script: str, kind: str, argv: list[str], nproc: int) -> dict:
    """Run ``script --worker kind ARGV`` in one process (``nproc`` 1) or under torchrun with
    ``nproc`` processes (one thread each) and return the last JSON line it printed.

    Raises:
        SystemExit: the worker failed (its stderr's end in the message)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    me = str(Path(script).resolve())
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                 str(nproc)] if nproc > 1 else [sys.executable])
    cmd = [*launcher, me, "--worker", kind, *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} failed:\n{proc.stderr[-3000:]}")
    return json.loads([x for x in proc.stdout.splitlines() if x.startswith("{")][-1])
