"""llmforge: a composable, YAML-driven trainer for Llama-3 models on Lightning.

Public API::

    from llmforge import Trainer, LLMModule, load_config, registry
"""

__version__ = "0.1.0"

from llmforge import registry  # noqa: E402
from llmforge import models  # noqa: E402,F401  (registers llama3)
from llmforge.config import TrainConfig, load_config  # noqa: E402
from llmforge.training.module import LLMModule  # noqa: E402
from llmforge.training.trainer import Trainer  # noqa: E402

__all__ = ["LLMModule", "TrainConfig", "Trainer", "__version__", "load_config", "registry"]
