"""The Llama 3 family (3.1 8B/70B/405B, 3.2 1B/3B): ``config.py`` (YAML keys, presets),
``model.py`` (the decoder), ``parallelize.py`` (tensor-parallel plan), ``hf.py`` (Hugging Face
adapter), bundled by :data:`LLAMA3`. Importing this package imports no torch."""

from llmforge.models.llama3.config import PRESETS, Llama3Config, llama_args_from_config, memory_shape
from llmforge.models.spec import family_spec

__all__ = ["LLAMA3"]

LLAMA3 = family_spec("llama3", __name__, model="Llama", build="build_llama", hf_adapter="LlamaHFAdapter",
                     config_cls=Llama3Config, presets=PRESETS, memory_shape=memory_shape,
                     check_config=llama_args_from_config,
                     description="Llama 3 / 3.1 / 3.2 decoder (Meta's layout and names)")
