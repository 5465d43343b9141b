"""A tiny Qwen3-MoE LLMModule for in-process tests (no trainer)."""

from llmforge.config import structured_config
from llmforge.config.validate import plan_batch
from llmforge.training.module import LLMModule


def moe_module(**model):
    """2 layers, 4 experts, top-2, dim 32, vocab 50, seq 8, one micro-batch of 2; ``model``:
    more ``model.*`` keys."""
    cfg = structured_config("qwen3_moe")
    cfg.model.merge_with({"preset": None, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                          "head_dim": 16, "hidden_dim": 64, "vocab_size": 50, "max_seq_len": 16,
                          "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                          **model})
    cfg.trainer.merge_with({"micro_batch_size": 2, "global_batch_size": 2, "seq_len": 8})
    module = LLMModule(cfg, plan_batch(cfg, 1))
    module.configure_model()
    return module
