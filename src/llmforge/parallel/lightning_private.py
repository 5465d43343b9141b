"""Every use of Lightning's private attributes, in this one module.

Lightning has no public API for these; each function names the attribute it reaches, and
:func:`check_lightning_private` verifies all of them on the installed Lightning, so a release
that renames one fails ``tests/test_lightning_private.py`` with the attribute's name instead of
breaking a training run (checked with lightning 2.6.6, the newest release the pin allows):

- ``trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress.total``: the optimizer
  steps Lightning has counted under manual optimization (``global_step`` is derived from it);
  llmforge sets it on resume and counts a skipped update as a step.
- ``ModelParallelStrategy._setup_distributed`` and ``._device_mesh``, and calling
  ``ParallelStrategy.setup_environment`` past ``ModelParallelStrategy``'s own: llmforge's
  strategy builds a 3-D (dp_replicate, dp_shard, tp) mesh instead of Lightning's 2-D one
  (``strategy.device_mesh`` is public but raises before the mesh exists).
- ``LightningModule._trainer`` and ``._device_mesh``: whether a module is attached to a trainer
  (``module.trainer`` raises when it is not) and the mesh ``module.device_mesh`` returns.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.parallel import ParallelStrategy

__all__ = ["attached_trainer", "check_lightning_private", "optimizer_step_progress",
           "setup_strategy_mesh", "strategy_mesh"]


def optimizer_step_progress(trainer: Any) -> Any:
    """The ``ready``/``completed`` counters of the optimizer steps of a manual-optimization fit."""
    return trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress.total


def strategy_mesh(strategy: Any) -> Optional[Any]:
    """The strategy's device mesh, or ``None`` before it is built (or for other strategies)."""
    return getattr(strategy, "_device_mesh", None)


def attached_trainer(module: Any) -> Optional[Any]:
    """The Lightning trainer ``module`` is attached to, or ``None``."""
    return getattr(module, "_trainer", None)


def setup_strategy_mesh(strategy: ModelParallelStrategy, build_mesh: Any) -> None:
    """``setup_environment`` of a :class:`ModelParallelStrategy` with ``build_mesh()``'s mesh in
    place of Lightning's 2-D one: the accelerator and cluster environment
    (``ParallelStrategy.setup_environment``), the process group, then the mesh on the strategy
    and its LightningModule."""
    ParallelStrategy.setup_environment(strategy)  # skip ModelParallelStrategy's 2-D mesh
    strategy._setup_distributed()
    strategy._device_mesh = build_mesh()
    assert strategy.lightning_module is not None
    strategy.lightning_module._device_mesh = strategy._device_mesh


def check_lightning_private() -> None:
    """Check that the installed Lightning still has every private attribute used above.

    Raises:
        RuntimeError: names the attribute that is gone and the Lightning version.
    """
    missing = []
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    try:
        progress = optimizer_step_progress(trainer)
        if not (hasattr(progress, "ready") and hasattr(progress, "completed")):
            missing.append("optim_step_progress.total.ready/.completed")
    except AttributeError as exc:
        missing.append(f"trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress.total ({exc})")
    if not callable(getattr(ModelParallelStrategy, "_setup_distributed", None)):
        missing.append("ModelParallelStrategy._setup_distributed")
    if "_device_mesh" not in vars(ModelParallelStrategy()):
        missing.append("ModelParallelStrategy._device_mesh")
    module = L.LightningModule()
    for name in ("_trainer", "_device_mesh"):
        if name not in vars(module):
            missing.append(f"LightningModule.{name}")
    if not issubclass(ModelParallelStrategy, ParallelStrategy):
        missing.append("ModelParallelStrategy is no longer a ParallelStrategy")
    if missing:
        raise RuntimeError(f"lightning {L.__version__} changed private attributes llmforge uses "
                           f"(llmforge/parallel/lightning_private.py): {'; '.join(missing)}")


def count_optimizer_step(trainer: Any) -> None:
    """Make Lightning count one more optimizer step without one (a skipped update), so
    ``global_step``, the data position and ``max_steps`` stay in steps of batches."""
    if trainer is None:
        return
    progress = optimizer_step_progress(trainer)
    progress.ready += 1
    progress.completed += 1
