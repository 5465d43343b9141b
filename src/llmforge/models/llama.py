"""Old import path of the Llama 3 model: now :mod:`llmforge.models.llama3.model` (re-exported)."""

from llmforge.models.llama3.config import ROPE_SCALING_KEYS, LlamaArgs, ffn_hidden_dim  # noqa: F401
from llmforge.models.llama3.model import *  # noqa: F401,F403
from llmforge.models.llama3.model import __all__  # noqa: F401
