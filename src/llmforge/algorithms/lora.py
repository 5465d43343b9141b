"""``lora``: low-rank adapters on chosen linear layers, the base model frozen.

YAML::

    algorithms:
      - name: lora
        rank: 16                 # r: inner dimension of the adapters
        alpha: 32                # scaling alpha / r of the adapter output
        dropout: 0.0             # dropout on the adapter input (training only)
        targets: [wq, wk, wv, wo]   # Linear layers by module-name suffix (default: attention)
        base_dtype: bfloat16     # storage dtype of every frozen parameter (bfloat16 | float32)

Each targeted ``nn.Linear`` ``W [out, in]`` gains ``A [r, in]`` (``lora_A.weight``) and
``B [out, r]`` (``lora_B.weight``); the forward becomes::

    y = x W^T + (alpha / r) * B(A(dropout(x)))        x: [..., in] -> y: [..., out]

``A`` is Kaiming-uniform (``a = sqrt(5)``, i.e. U(-1/sqrt(in), 1/sqrt(in)), as PEFT) and ``B`` is
zero, so training starts from the base model exactly (Hu et al. 2021, "LoRA: Low-Rank
Adaptation of Large Language Models", arXiv:2106.09685, sec. 4.1). Every other parameter
(embeddings, norms, the base weights) is frozen (``requires_grad=False``: not in the optimizer,
no gradient) and stored in ``base_dtype``; the adapters stay in float32 (their gradients and
AdamW moments too).

Adapter initialization does not use the global RNG: each adapter's ``A`` is drawn in full on
the CPU from a generator seeded by ``run.seed`` and the module's name, then each rank copies
its own shard, so 1, 2 or 8 processes start from the same adapters and the base model's own
init (same seed) is the one of the model without LoRA.

Composition: ``float8`` converts the frozen base Linear layers to ``Float8Linear`` first (FP8
matmuls, weights stored in ``base_dtype``); LoRA then adds its adapters (kept in high
precision) on top, whatever the YAML order. FSDP2 shards base and adapters per block;
activation checkpointing and compile wrap the converted blocks. Tensor parallelism is not
supported (``strategy.tp > 1`` is a ConfigError): the adapters would need their own plan.

Checkpoints hold only the adapters (and their optimizer state) plus, in ``meta.json``, the
pointer to the base (``model.init_from`` or the init seed); see
:func:`llmforge.checkpoint.dcp.save_checkpoint`. :func:`merge_lora` folds the adapters in
(``W + (alpha / r) B A``); :mod:`llmforge.checkpoint.peft` writes PEFT's adapter format.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from llmforge.algorithms.base import Algorithm, ModelContext, Stage
from llmforge.errors import ConfigError

DEFAULT_TARGETS = ("wq", "wk", "wv", "wo")
BASE_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
               "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}


def is_adapter_key(name: str) -> bool:
    """Whether a parameter / state-dict key belongs to a LoRA adapter
    (``...wq.lora_A.weight``, ``...wq.lora_B.weight``; wrapper prefixes allowed)."""
    return ".lora_A." in name or ".lora_B." in name or name.startswith(("lora_A.", "lora_B."))


class LoRAMixin:
    """Adds ``lora_A``/``lora_B``/``lora_dropout`` to a Linear-like module (class swap: the base
    module keeps its type's behaviour through ``super().forward``)."""

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
    from llmforge.checkpoint.hf import _local_box as box

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


def parse_dtype(name: str, key: str) -> torch.dtype:
    if name not in BASE_DTYPES:
        raise ConfigError(f"{key}: unknown dtype '{name}'; use one of bfloat16, float32, float16")
    return BASE_DTYPES[name]


def match_targets(model: nn.Module, targets: Sequence[str]) -> dict[str, list[str]]:
    """``{target: [fqn, ...]}``: the Linear layers whose name is ``target`` or ends with
    ``"." + target`` (``wq`` matches ``layers.3.attention.wq``; ``attention.wq`` too)."""
    out: dict[str, list[str]] = {t: [] for t in targets}
    for fqn, m in model.named_modules():
        if not isinstance(m, nn.Linear) or isinstance(m, LoRAMixin):
            continue
        for t in targets:
            if fqn == t or fqn.endswith("." + t):
                out[t].append(fqn)
    return out


class LoRA(Algorithm):
    """Low-rank adapters on the ``targets`` Linear layers; everything else frozen.

    Args:
        rank: adapter inner dimension ``r`` (>= 1).
        alpha: the adapter output is scaled by ``alpha / rank`` (> 0).
        dropout: dropout probability on the adapter input, in ``[0, 1)``.
        targets: Linear module-name suffixes (``wq wk wv wo w1 w2 w3 output`` for Llama).
        base_dtype: storage dtype of the frozen parameters: ``bfloat16`` (default; half the
            memory of float32) or ``float32`` (exact comparisons; needed for tests on the CPU).

    Raises:
        ConfigError: a bad value (naming ``lora.<key>``), a target matching no Linear layer,
            ``strategy.tp > 1``, or ``output`` targeted with tied embeddings.
    """

    name = "lora"
    stage = Stage.CONVERT
    priority = 1  # after float8 in the same stage: float8 converts the base Linear layers first
    summary = "LoRA adapters on chosen Linear layers; base frozen (bf16/fp32), adapter-only checkpoints"

    def __init__(self, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
                 targets: Optional[Sequence[str]] = None, base_dtype: str = "bfloat16") -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ConfigError(f"algorithms: lora.rank={rank!r} must be an integer >= 1 (e.g. 8 or 16)")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 < alpha < float("inf"):
            raise ConfigError(f"algorithms: lora.alpha={alpha!r} must be a finite number > 0 (e.g. 2 * rank)")
        if not isinstance(dropout, (int, float)) or not 0.0 <= float(dropout) < 1.0:
            raise ConfigError(f"algorithms: lora.dropout={dropout!r} must be in [0, 1)")
        targets = [targets] if isinstance(targets, str) else targets  # `targets: wq` = [wq]
        targets = list(DEFAULT_TARGETS if targets is None else targets)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ConfigError(f"algorithms: lora.targets={targets!r} must be a non-empty list of "
                              "Linear module-name suffixes, e.g. [wq, wk, wv, wo]")
        self.rank, self.alpha, self.dropout = int(rank), float(alpha), float(dropout)
        self.targets = [str(t) for t in targets]
        self.base_dtype_name = str(base_dtype)
        self.base_dtype = parse_dtype(self.base_dtype_name, "algorithms: lora.base_dtype")
        self.seed = 0
        self.converted: list[str] = []

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def options(self) -> dict[str, Any]:
        """The keys of this entry (as in YAML), for ``meta.json`` and the PEFT config."""
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "targets": list(self.targets), "base_dtype": self.base_dtype_name}

    # -------------------------------------------------------------------- checks
    def check(self, cfg: Any, algorithms: Sequence[Algorithm]) -> None:
        """Targets match, no tensor parallelism, no LoRA on a tied output projection.

        Raises:
            ConfigError: see the class docstring.
        """
        from llmforge.algorithms.float8 import build_model_on_meta

        if int(cfg.strategy.tp) > 1:
            raise ConfigError(f"algorithms: lora does not support strategy.tp={cfg.strategy.tp} "
                              "(tensor parallelism would shard the adapters' rank dimension); "
                              "use strategy.tp=1 with FSDP2 (strategy.name=fsdp2)")
        model = build_model_on_meta(cfg)
        for t, fqns in match_targets(model, self.targets).items():
            if not fqns:
                names = sorted({f.rsplit(".", 1)[-1] for f, m in model.named_modules()
                                if isinstance(m, nn.Linear)})
                raise ConfigError(f"algorithms: lora.targets entry '{t}' matches no Linear layer "
                                  f"of model '{cfg.model.name}'; its Linear layers are named "
                                  f"{', '.join(names)}")
            if getattr(getattr(model, "args", None), "tie_embeddings", False) and "output" in fqns:
                raise ConfigError("algorithms: lora.targets includes 'output', but "
                                  "model.tie_embeddings=true shares it with the embedding; "
                                  "drop 'output' from lora.targets")

    # -------------------------------------------------------------------- pipeline
    def convert(self, model: nn.Module, seed: int) -> nn.Module:
        """Swap the targeted layers to their LoRA class, freeze and cast the rest, and make
        ``model.init_weights`` initialize the adapters too; returns ``model``."""
        self.seed = int(seed)
        self.converted = sorted({f for fqns in match_targets(model, self.targets).values()
                                 for f in fqns})
        for fqn in self.converted:
            m = model.get_submodule(fqn)
            m.__class__ = lora_class(type(m))
            m.add_adapters(self.rank, self.alpha, self.dropout, fqn)
        for name, p in model.named_parameters():
            if is_adapter_key(name):
                p.requires_grad_(True)
                continue
            p.requires_grad_(False)
            if p.dtype != self.base_dtype and p.is_floating_point():
                p.data = p.data.to(self.base_dtype)
        base_init = getattr(model, "init_weights", None)
        if callable(base_init) and not getattr(base_init, "_lora", False):
            def init_weights(*args: Any, **kwargs: Any) -> None:
                base_init(*args, **kwargs)
                init_adapters(model, self.seed)

            init_weights._lora = True  # type: ignore[attr-defined]
            model.init_weights = init_weights  # instance attribute: seeded_init calls it
        return model

    def apply(self, model: nn.Module, ctx: ModelContext) -> nn.Module:
        return self.convert(model, ctx.cfg.run.seed)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.is_global_zero:
            counts = parameter_counts(pl_module.model)
            print(f"lora: {len(self.converted)} Linear layers with rank-{self.rank} adapters "
                  f"(alpha {self.alpha:g}, scale {self.scaling:g}); trainable "
                  f"{counts[0]:,} / frozen {counts[1]:,} parameters (base in "
                  f"{self.base_dtype_name})", flush=True)


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """``(trainable, frozen)`` parameter counts (global for sharded parameters; a tied
    parameter once)."""
    seen: set[int] = set()
    trainable = frozen = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    return trainable, frozen


# ----------------------------------------------------------------------------- runs
def lora_entry(cfg: Any) -> Optional[dict[str, Any]]:
    """The ``algorithms:`` entry named ``lora`` (as a dict without ``name``), or ``None``."""
    for entry in cfg.algorithms or []:
        if entry.get("name") in ("lora", "llmforge.algorithms.lora.LoRA"):
            out = dict(entry)
            out.pop("name")
            return out
    return None


def base_pointer(cfg: Any) -> dict[str, Any]:
    """What rebuilds the frozen base of a LoRA run: ``model.init_from`` when set, else the
    random init of ``run.seed`` (with the model config, saved in the run's config.yaml)."""
    init_from = cfg.model.get("init_from")
    if init_from:
        return {"init_from": str(init_from), "description": f"weights of {init_from}"}
    return {"init_from": None, "seed": int(cfg.run.seed),
            "description": f"random init of model '{cfg.model.name}' with run.seed={cfg.run.seed}"}


def load_lora_model(cfg: Any, ckpt: Any, device: str = "cpu") -> nn.Module:
    """Rebuild a LoRA run's model from a checkpoint that holds only adapters: the base from
    its pointer (``model.init_from`` or the seeded init), then the adapters. Eval mode, unmerged.

    Raises:
        ConfigError: the run config has no ``lora`` entry, or the base cannot be loaded.
    """
    from llmforge.algorithms.float8 import build_model_on_meta
    from llmforge.checkpoint.dcp import load_model_weights
    from llmforge.parallel.init import seeded_init

    import json
    from pathlib import Path

    entry = lora_entry(cfg)
    meta_file = Path(ckpt) / "meta.json"
    saved = json.loads(meta_file.read_text()).get("lora") if meta_file.exists() else None
    if saved:  # the settings the adapters were trained with win over config.yaml's
        entry = {**(entry or {}), **saved}
    if entry is None:
        raise ConfigError(f"{ckpt}: the checkpoint holds LoRA adapters only, but the run's "
                          "config.yaml has no 'lora' entry under algorithms:")
    model = LoRA(**entry).convert(build_model_on_meta(cfg), cfg.run.seed)
    model.to_empty(device=device)
    seeded_init(model, cfg.run.seed)
    if cfg.model.get("init_from"):
        from llmforge.checkpoint.init_from import load_initial_weights

        load_initial_weights(model, cfg.model.init_from)
    load_model_weights(ckpt, model, adapters_only=True)
    return model.eval()
