"""The Qwen3-MoE family (Qwen3-30B-A3B, Qwen3-235B-A22B): ``config.py`` (YAML keys, presets),
``moe.py`` (router, grouped experts), ``model.py``, ``parallelize.py`` (tensor-parallel
checks), ``hf.py`` (Hugging Face adapter), bundled by :data:`QWEN3_MOE`. Importing this package
imports no torch."""

from llmforge.models.qwen3_moe.config import (PRESETS, Qwen3MoeConfig, check_tokens, memory_shape,
                                               qwen3_moe_args_from_config)
from llmforge.models.spec import family_spec

__all__ = ["QWEN3_MOE"]

QWEN3_MOE = family_spec("qwen3_moe", __name__, model="Qwen3Moe", build="build_qwen3_moe",
                        hf_adapter="Qwen3MoeHFAdapter", config_cls=Qwen3MoeConfig, presets=PRESETS,
                        check_config=qwen3_moe_args_from_config,
                        memory_shape=memory_shape, check_tokens=check_tokens,
                        active_params="llmforge.models.qwen3_moe.model:active_params",
                        experts="llmforge.models.qwen3_moe.model:expert_modules",
                        description="Qwen3-MoE decoder (Qwen3 attention, softmax top-k experts)")
