"""LoRA layers: the adapter mixin, its Linear classes, initialization and merging.

Each targeted ``nn.Linear`` ``W [out, in]`` gains ``A [r, in]`` (``lora_A.weight``) and
``B [out, r]`` (``lora_B.weight``); the forward becomes::

    y = x W^T + (alpha / r) * B(A(dropout(x)))        x: [..., in] -> y: [..., out]

``A`` is Kaiming-uniform (``a = sqrt(5)``, i.e. U(-1/sqrt(in), 1/sqrt(in)), as PEFT) and ``B`` is
zero, so training starts from the base model exactly (Hu et al. 2021, "LoRA: Low-Rank
Adaptation of Large Language Models", arXiv:2106.09685, sec. 4.1). The algorithm that puts them
in a model is :class:`llmforge.algorithms.lora.LoRA`.

Expert layers (a ``ModelSpec.experts`` module: weights stacked by expert, ``W [E, out, in]``,
read by its forward through ``local_weight(name)``) gain per-expert factors
``A [E, r, in]`` (``lora_A.<name>``) and ``B [E, out, r]`` (``lora_B.<name>``), and compute with

    W_e + (alpha / r) * B_e A_e          for each expert e (float32)

so the adapters are stacked by expert on dim 0 like the weights: expert parallelism and FSDP2
shard them with the experts. Dropout cannot act on a merged weight (PEFT's ``ParamWrapper``
refuses it too); the algorithm refuses ``dropout > 0`` on expert weights.
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


class LoRAExpertsMixin:
    """Adds ``lora_A``/``lora_B`` (``nn.ParameterDict`` keyed by weight name) to an expert layer
    (class swap, as :class:`LoRAMixin`); :meth:`local_weight` returns the adapted weights."""

    adapter_children = ADAPTERS
    lora_rank: int
    lora_alpha: float
    lora_scaling: float
    lora_fqn: str

    def add_expert_adapters(self, names: list[str], rank: int, alpha: float, fqn: str) -> None:
        """``A [E, rank, in]`` (uninitialized) and ``B [E, out, rank]`` (zeros) for each weight
        ``[E, out, in]`` in ``names``, on that weight's device."""
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()
        for n in names:
            w = getattr(self, n)
            e, out, inp = w.shape
            self.lora_A[n] = nn.Parameter(torch.empty(e, rank, inp, device=w.device))
            self.lora_B[n] = nn.Parameter(torch.zeros(e, out, rank, device=w.device))
        self.lora_rank, self.lora_alpha = int(rank), float(alpha)
        self.lora_scaling = float(alpha) / int(rank)
        self.lora_fqn = fqn

    def local_weight(self, name: str) -> torch.Tensor:
        """This rank's ``[E_local, out, in]`` weight plus ``(alpha / r) B_e A_e`` for each of its
        experts (float32) when ``name`` has adapters; the base weight otherwise."""
        w = super().local_weight(name)  # type: ignore[misc]
        if name not in self.lora_A:
            return w
        a, b = _local(self.lora_A[name]), _local(self.lora_B[name])
        return w.to(a.dtype) + self.lora_scaling * torch.bmm(b, a)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def lora_experts_class(base: type) -> type:
    """The LoRA class of an expert layer type (made once and cached)."""
    if base not in _CLASSES:
        _CLASSES[base] = type(f"LoRA{base.__name__}", (LoRAExpertsMixin, base), {})
    return _CLASSES[base]


def lora_expert_modules(model: nn.Module) -> Iterator[tuple[str, LoRAExpertsMixin]]:
    """``(fqn at conversion time, module)`` of every expert layer with adapters."""
    for m in model.modules():
        if isinstance(m, LoRAExpertsMixin):
            yield m.lora_fqn, m


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRAMixin]]:
    """``(fqn at conversion time, module)`` of every LoRA layer of ``model``."""
    for m in model.modules():
        if isinstance(m, LoRAMixin):
            yield m.lora_fqn, m


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(m, (LoRAMixin, LoRAExpertsMixin)) for m in model.modules())


def adapter_seed(seed: int, fqn: str) -> int:
    """Seed of one adapter's ``A``: ``run.seed`` mixed with a CRC32 of its module name."""
    return (int(seed) * 1_000_003 + zlib.crc32(fqn.encode())) % (2**63)


def _local_box(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, shape)`` of this rank's part of a (possibly DTensor) parameter."""
    return box(param)


def _copy_own_part(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part (its box of a DTensor) of the full tensor ``full`` into ``param``."""
    offset, shape = _local_box(param)
    local = _local(param)
    part = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
    local.copy_(part.to(device=local.device, dtype=local.dtype))


def _kaiming_a(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Kaiming-uniform (``a = sqrt(5)``: U(-1/sqrt(in), 1/sqrt(in))) of a ``[..., in]`` shape,
    drawn as a 2-D ``[prod(...), in]`` matrix (PEFT's ``lora_A`` of an expert stack is
    ``[E * r, in]``: the same bound), float32 on the CPU."""
    full = torch.empty(math.prod(shape[:-1]), shape[-1], dtype=torch.float32)
    nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed))
    return full.view(shape)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """``A`` Kaiming-uniform (``a = sqrt(5)``) from :func:`adapter_seed`, ``B`` zeros, in place.

    ``A`` is drawn in full on the CPU and each rank copies its own part, so the result does
    not depend on the sharding (experts: nor on ``strategy.ep``). A no-op on the meta device.
    """
    for fqn, m in lora_modules(model):
        a, b = m.lora_A.weight, m.lora_B.weight
        if a.device.type == "meta":
            continue
        _copy_own_part(a, _kaiming_a(tuple(a.shape), adapter_seed(seed, fqn)))
        _local(b).zero_()
    for fqn, m in lora_expert_modules(model):
        for name, a in m.lora_A.items():
            if a.device.type == "meta":
                continue
            _copy_own_part(a, _kaiming_a(tuple(a.shape), adapter_seed(seed, f"{fqn}.{name}")))
            _local(m.lora_B[name]).zero_()


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
    for _, m in list(lora_expert_modules(model)):
        for name, a in m.lora_A.items():
            w = getattr(m, name)
            delta = torch.bmm(m.lora_B[name].float(), a.float())
            w.copy_((w.float() + m.lora_scaling * delta).to(w.dtype))
        del m.lora_A, m.lora_B
        m.__class__ = next(c for c in type(m).__mro__[1:] if c is not LoRAExpertsMixin
                           and not issubclass(c, LoRAExpertsMixin))
    return model
