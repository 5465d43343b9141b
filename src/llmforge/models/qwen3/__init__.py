"""The Qwen3 dense family (0.6B ... 32B): ``config.py`` (YAML keys, presets), ``model.py``,
``parallelize.py`` (tensor-parallel plan), ``hf.py`` (Hugging Face adapter), bundled by
:data:`QWEN3`. Importing this package imports no torch."""

from llmforge.models.qwen3.config import PRESETS, Qwen3Config, memory_shape
from llmforge.models.spec import ModelSpec

__all__ = ["QWEN3"]

QWEN3 = ModelSpec(
    name="qwen3",
    build="llmforge.models.qwen3.model:build_qwen3",
    config_cls=Qwen3Config,
    presets=PRESETS,
    model_cls="llmforge.models.qwen3.model:Qwen3",
    tp_plan="llmforge.models.qwen3.parallelize:apply_tp",
    check_tp="llmforge.models.qwen3.parallelize:check_tp",
    hf_adapter="llmforge.models.qwen3.hf:Qwen3HFAdapter",
    memory_shape=memory_shape,
    description="Qwen3 dense decoder (QK-norm, decoupled head dim, RoPE theta 1e6)",
)
