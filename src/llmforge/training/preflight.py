"""Pre-flight: the checks a training job runs before it trains, in one place.

``llmforge train`` (also ``--dry-run`` and the ``--nproc`` parent), ``llmforge launch`` (for a
job that runs elsewhere, at that job's world size) and the Trainer itself all run the same
sequence: resolve the run (:func:`llmforge.preflight.resolve.resolve_run`: config arithmetic,
world size, strategy, batch plan, resume point), then build the :class:`Trainer` (research
imports, strategy, algorithms and their ``check``, callbacks and loggers), which allocates
nothing: the model is built later, in ``configure_model``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmforge.algorithms.loading import pipeline_order
from llmforge.checkpoint.safe_load import CheckpointShapeError, check_model_shapes, resume_shape_error
from llmforge.config.validate import BatchPlan
from llmforge.parallel.transforms import strategy_transforms
from llmforge.plugin import meta_model
from llmforge.preflight.resolve import resolve_run
from llmforge.training.entries import build_callbacks
from llmforge.training.trainer import Trainer

__all__ = ["build_callbacks", "job_checks", "pipeline_line", "resume_shapes"]


def job_checks(cfg: Any, world_size: int, dry_run: bool = False) -> tuple[BatchPlan, str]:
    """The checks ``llmforge train`` runs before training, for a job of ``world_size``
    processes (``trainer.devices`` per node) that runs elsewhere (``llmforge launch``): the same
    resolution and Trainer start-up, without looking at the run directory. ``dry_run``: files
    the config names (an HF folder, a tokenizer) may be missing here. Returns (batch plan,
    pipeline line).

    Raises:
        ConfigError: what the job would exit 2 with.
    """
    env = {"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(cfg.trainer.devices)}
    run = resolve_run(cfg, check_dir=False, dry_run=dry_run, environ=env)
    return run.plan, pipeline_line(Trainer(cfg, run=run))


def pipeline_line(trainer: Any) -> str:
    """The model-transform order a run would apply (algorithms and the strategy's stages)."""
    order = pipeline_order(trainer.cfg, trainer.algorithms, strategy_transforms(trainer.cfg, trainer.dims))
    return f"pipeline        build (meta) -> {' -> '.join(order + ['materialize'])}"


def resume_shapes(cfg: Any, ckpt: Path) -> None:
    """A resume from ``ckpt`` can load into ``cfg``'s model: each model tensor of the checkpoint
    that the model (the run's model on the meta device, :func:`llmforge.plugin.meta_model`;
    no weights read) has is of the same shape. ``llmforge runs restart`` checks it before
    submitting a job that changes ``model:`` keys (the job itself finds it only at load).

    Raises:
        ConfigError: a parameter of another shape (named, both shapes), exit 2.
        CheckpointReadError: the checkpoint's ``.metadata`` is missing or damaged.
    """
    try:
        check_model_shapes(meta_model(cfg), str(ckpt))
    except CheckpointShapeError as exc:
        raise resume_shape_error(exc) from exc
