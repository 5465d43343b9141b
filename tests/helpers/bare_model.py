"""A bare model factory (no ModelSpec), named in YAML by import path: its model: keys are the
generic ones, its arguments come through model.kwargs."""

from llmforge.models.llama3.config import LlamaArgs
from llmforge.models.llama3.model import Llama


def build(cfg):
    return Llama(LlamaArgs(**dict(cfg.kwargs)))
