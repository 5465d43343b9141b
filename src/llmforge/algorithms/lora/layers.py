"""LoRA layers: the adapter mixin, its Linear classes, initialization and merging.

Each targeted ``nn.Linear`` ``W [out, in]`` gains ``A [r, in]`` (``lora_A.weight``) and
``B [out, r]`` (``lora_B.weight``); the forward becomes::

    y = x W^T + (alpha / r) * B(A(dropout(x)))        x: [..., in] -> y: [..., out]

``A`` is Kaiming-uniform (``a = sqrt(5)``, i.e. U(-1/sqrt(in), 1/sqrt(in)), as PEFT) and ``B`` is
zero, so training starts from the base model exactly (Hu et al. 2021, "LoRA: Low-Rank
Adaptation of Large Language Models", arXiv:2106.09685, sec. 4.1). The algorithm that puts them
in a model is :class:`llmforge.algorithms.lora.LoRA`.
"""

from __future__ import annotations

import math
import zlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from llmforge.checkpoint.hf import _local_box as box

ADAPTERS = ("lora_A", "lora_B")


def is_adapter_key(name: str) -> bool:
    """Whether a parameter / state-dict key belongs to a LoRA adapter
    (``...wq.lora_A.weight``, ``...wq.lora_B.weight``; wrapper prefixes allowed)."""
    return ".lora_A." in name or ".lora_B." in name or name.startswith(("lora_A.", "lora_B."))


class LoRAMixin:
    """Adds ``lora_A``/``lora_B``/``lora_dropout`` to a Linear-like module (class swap: the base
    module keeps its type's behaviour through ``super().forward``). ``adapter_children`` tells
    core code (:func:`llmforge.plugin.adapter_names`) which children are adapters."""

    adapter_children = ADAPTERS
    lora_rank: int
    lora_alpha: float
    lora_scaling: float
    lora_fqn: str

    def add_adapters(self, rank: int, alpha: float, dropout: float, fqn: str) -> None:
        dev = self.weight.device  # type: ignore[attr-defined]
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=dev)  # type: ignore[attr-defined]
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=dev)  # type: ignore[attr-defined]
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_rank, self.lora_alpha = int(rank), float(alpha)
        self.lora_scaling = float(alpha) / int(rank)
        self.lora_fqn = fqn

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)  # type: ignore[misc]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in] -> [..., out]``: base output plus the scaled adapter output."""
        out = self.base_forward(x)
        a = self.lora_A.weight
        h = x if x.dtype == a.dtype or torch.is_autocast_enabled(x.device.type) else x.to(a.dtype)
        delta = self.lora_B(self.lora_A(self.lora_dropout(h)))
        return out + (self.lora_scaling * delta).to(out.dtype)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, lora_rank={self.lora_rank}, "  # type: ignore[misc]
                f"lora_alpha={self.lora_alpha}")


class LoRALinear(LoRAMixin, nn.Linear):
    """``nn.Linear`` with LoRA adapters. The base weight may be stored in a lower precision
    than the input (``base_dtype``): the base matmul then runs in the weight's dtype and its
    output is cast back to the input's dtype."""

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype == w.dtype or torch.is_autocast_enabled(x.device.type):
            return F.linear(x, w, self.bias)
        return F.linear(x.to(w.dtype), w, self.bias).to(x.dtype)


_CLASSES: dict[type, type] = {nn.Linear: LoRALinear}


def lora_class(base: type) -> type:
    """The LoRA class for a Linear type (``nn.Linear`` -> :class:`LoRALinear`; a subclass such
    as torchao's ``Float8Linear`` -> a ``LoRAFloat8Linear`` made once and cached)."""
    if base not in _CLASSES:
        _CLASSES[base] = type(f"LoRA{base.__name__}", (LoRAMixin, base), {})
    return _CLASSES[base]


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRAMixin]]:
    """``(fqn at conversion time, module)`` of every LoRA layer of ``model``."""
    for m in model.modules():
        if isinstance(m, LoRAMixin):
            yield m.lora_fqn, m


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(m, LoRAMixin) for m in model.modules())


def adapter_seed(seed: int, fqn: str) -> int:
    """Seed of one adapter's ``A``: ``run.seed`` mixed with a CRC32 of its module name."""
    return (int(seed) * 1_000_003 + zlib.crc32(fqn.encode())) % (2**63)


def _local_box(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, shape)`` of this rank's part of a (possibly DTensor) parameter."""
    return box(param)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """``A`` Kaiming-uniform (``a = sqrt(5)``) from :func:`adapter_seed`, ``B`` zeros, in place.

    ``A`` is drawn in full on the CPU and each rank copies its own part, so the result does
    not depend on the sharding. A no-op on the meta device.
    """
    for fqn, m in lora_modules(model):
        a, b = m.lora_A.weight, m.lora_B.weight
        if a.device.type == "meta":
            continue
        full = torch.empty(tuple(a.shape), dtype=torch.float32)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5),
                                 generator=torch.Generator().manual_seed(adapter_seed(seed, fqn)))
        offset, shape = _local_box(a)
        local = a.to_local() if hasattr(a, "to_local") else a
        part = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
        local.copy_(part.to(device=local.device, dtype=local.dtype))
        (b.to_local() if hasattr(b, "to_local") else b).zero_()


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight, ``W <- W + (alpha / r) B A`` (computed in
    float32, stored in ``W``'s dtype), and turn the layers back into their base type; returns
    ``model`` (unsharded models only). Logits equal the unmerged model's up to rounding in
    ``W``'s dtype (within 1e-5 in float32)."""
    for _, m in list(lora_modules(model)):
        w = m.weight
        delta = m.lora_B.weight.float() @ m.lora_A.weight.float()
        w.copy_((w.float() + m.lora_scaling * delta).to(w.dtype))
        base = next(c for c in type(m).__mro__[1:] if c is not LoRAMixin
                    and not issubclass(c, LoRAMixin))
        for name in ("lora_A", "lora_B", "lora_dropout"):
            delattr(m, name)
        m.__class__ = base
    return model
