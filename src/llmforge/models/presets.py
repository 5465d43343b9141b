"""Old import path of the Llama 3 presets: now :mod:`llmforge.models.llama3.config` (re-exported)."""

from llmforge.models.llama3.config import (OVERRIDABLE_FIELDS, PRESETS,  # noqa: F401
                                           llama_args_from_config)

__all__ = ["PRESETS", "llama_args_from_config", "OVERRIDABLE_FIELDS"]
