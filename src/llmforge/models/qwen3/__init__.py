"""The Qwen3 dense family (0.6B ... 32B): ``config.py`` (YAML keys, presets), ``model.py``,
``parallelize.py`` (tensor-parallel plan), ``hf.py`` (Hugging Face adapter), bundled by
:data:`QWEN3`. Importing this package imports no torch."""

from llmforge.models.qwen3.config import PRESETS, Qwen3Config, memory_shape, qwen3_args_from_config
from llmforge.models.spec import family_spec

__all__ = ["QWEN3"]

QWEN3 = family_spec("qwen3", __name__, model="Qwen3", build="build_qwen3", hf_adapter="Qwen3HFAdapter",
                    config_cls=Qwen3Config, presets=PRESETS, memory_shape=memory_shape,
                    check_config=qwen3_args_from_config,
                    description="Qwen3 dense decoder (QK-norm, decoupled head dim, RoPE theta 1e6)")
