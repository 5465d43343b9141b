"""The Lightning module, the Trainer that wires config to ``lightning.Trainer``, optimizer and
schedule."""

from llmforge.training.module import LLMModule
from llmforge.training.trainer import Trainer

__all__ = ["LLMModule", "Trainer"]
