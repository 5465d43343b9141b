"""In-process helpers for the algorithm tests: a tiny config, the model pipeline, a few AdamW steps
on a learnable synthetic stream (next token = affine map of the current one), a structural
fingerprint, and the bytes of activations kept alive after a forward."""

from __future__ import annotations

import gc
import weakref
from typing import Any, Optional

import torch
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from llmforge.algorithms.loading import build_algorithms
from llmforge.config.schema import TrainConfig
from llmforge.config.validate import plan_batch
from llmforge.training.module import LLMModule

VOCAB = 256


def make_cfg(algorithms: list[dict], *, dim: int = 64, n_layers: int = 2, seq: int = 32,
             **model: Any) -> Any:
    cfg = OmegaConf.structured(TrainConfig)
    cfg.model.merge_with({"dim": dim, "n_layers": n_layers, "n_heads": 4, "n_kv_heads": 2,
                          "vocab_size": VOCAB, "multiple_of": 32, "max_seq_len": seq, **model})
    cfg.trainer.merge_with({"micro_batch_size": 2, "global_batch_size": 4, "seq_len": seq})
    cfg.algorithms = algorithms
    return cfg


def make_module(algorithms: list[dict], **kw: Any) -> LLMModule:
    """An :class:`LLMModule` with the algorithms' pipeline applied, materialized, seed 1234."""
    cfg = make_cfg(algorithms, **kw)
    algos = build_algorithms(cfg)
    pipeline = [t for t in (a.transform() for a in algos) if t is not None]
    module = LLMModule(cfg, plan_batch(cfg, 1), pipeline=pipeline)
    module.configure_model()
    return module


def batches(steps: int, seq: int, seed: int = 0) -> list[torch.Tensor]:
    """``steps`` windows ``[4, seq + 1]``: random starts, then ``x -> (5 x + 3) mod V`` with 10 %
    random tokens, so the loss falls quickly but not to zero."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.empty(4, seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, VOCAB, (4,), generator=g)
        for t in range(seq):
            x[:, t + 1] = (5 * x[:, t] + 3) % VOCAB
        noise = torch.rand(4, seq + 1, generator=g) < 0.1
        x[noise] = torch.randint(0, VOCAB, (int(noise.sum()),), generator=g)
        out.append(x)
    return out


def train_losses(algorithms: list[dict], steps: int = 5, dtype: Optional[torch.dtype] = None,
                 lr: float = 3e-3, **kw: Any) -> list[float]:
    """Mean loss per target token of ``steps`` AdamW steps (2 micro-batches of 2 each)."""
    module = make_module(algorithms, **kw)
    if dtype is not None:
        module.model.to(dtype)
    opt = torch.optim.AdamW(module.model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for batch in batches(steps, module.cfg.trainer.seq_len):
        loss_sum, n = module.forward_backward(batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append((loss_sum / n).item())
    return losses


def fingerprint(model: torch.nn.Module) -> list[tuple[str, str, bool]]:
    """``(path, module type, compiled in place)`` for every submodule."""
    return [(name, type(m).__name__, getattr(m, "_compiled_call_impl", None) is not None)
            for name, m in model.named_modules()]


class _LiveStorages(TorchDispatchMode):
    """Records the storage of every tensor an operator returns (weakly)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, Any] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.refs[id(s)] = weakref.ref(s)
        return out

    def live_bytes(self) -> int:
        gc.collect()
        alive = {s.data_ptr(): s.nbytes() for s in (r() for r in self.refs.values()) if s is not None}
        return sum(alive.values())


def activation_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the tensors created in one forward (and the loss) that are still alive before
    the backward: what autograd, checkpointing and selective-checkpoint caches keep (unique
    storages; parameters excluded as they are not created by the forward)."""
    mode = _LiveStorages()
    with mode:
        loss = model(tokens).float().logsumexp(-1).mean()
    live = mode.live_bytes()
    loss.backward()
    return live
