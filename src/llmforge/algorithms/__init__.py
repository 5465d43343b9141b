"""Algorithm plugins and the model pipeline (see :mod:`llmforge.algorithms.base`).

Built-ins (registered in :data:`llmforge.registry.algorithms`): ``float8`` (stage convert),
``activation_checkpointing`` (activation_checkpointing), ``compile`` (compile), ``lora``
(convert, after float8). The pipeline
order and why: ``docs/algorithms/README.md``.
"""

from llmforge.algorithms.base import Algorithm, ModelContext, Stage, Transform, run_pipeline
from llmforge.algorithms.checkpointing import ActivationCheckpointing
from llmforge.algorithms.compile import Compile
from llmforge.algorithms.float8 import Float8
from llmforge.algorithms.lora import LoRA
from llmforge.registry import algorithms as _registry

_registry.register("compile", Compile)
_registry.register("activation_checkpointing", ActivationCheckpointing)
_registry.register("float8", Float8)
_registry.register("lora", LoRA)

__all__ = ["Algorithm", "ModelContext", "Stage", "Transform", "run_pipeline",
           "ActivationCheckpointing", "Compile", "Float8", "LoRA"]
