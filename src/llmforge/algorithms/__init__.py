"""Algorithm plugins and the model pipeline (see :mod:`llmforge.algorithms.base`)."""

from llmforge.algorithms.base import Algorithm, ModelContext, Stage, Transform, run_pipeline

__all__ = ["Algorithm", "ModelContext", "Stage", "Transform", "run_pipeline"]
