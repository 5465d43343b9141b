"""The ``lora`` algorithm plugin: layers (:mod:`.layers`), the algorithm and its hooks
(:mod:`.algorithm`), PEFT export (:mod:`.peft`), the dry run's memory estimate (:mod:`.memory`).
"""

from llmforge.algorithms.lora.algorithm import BASE_DTYPES, DEFAULT_TARGETS, LoRA, match_targets, parse_dtype
from llmforge.algorithms.lora.layers import (LoRALinear, LoRAMixin, adapter_seed, has_adapters,
                                             init_adapters, is_adapter_key, lora_class, lora_modules,
                                             merge_lora)
from llmforge.algorithms.lora.memory import parameter_counts

__all__ = ["BASE_DTYPES", "DEFAULT_TARGETS", "LoRA", "LoRALinear", "LoRAMixin", "adapter_seed",
           "has_adapters", "init_adapters", "is_adapter_key", "lora_class", "lora_modules",
           "match_targets", "merge_lora", "parameter_counts", "parse_dtype"]
