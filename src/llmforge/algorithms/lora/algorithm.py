"""``lora``: low-rank adapters on chosen linear layers, the base model frozen.

YAML::

    algorithms:
      - name: lora
        rank: 16                 # r: inner dimension of the adapters
        alpha: 32                # scaling alpha / r of the adapter output
        dropout: 0.0             # dropout on the adapter input (training only)
        targets: [wq, wk, wv, wo]   # Linear layers or expert weights by name suffix (default: attention)
        base_dtype: bfloat16     # storage dtype of every frozen parameter (bfloat16 | float32)

The layers and their math: :mod:`llmforge.algorithms.lora.layers`. Every other parameter
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

Experts: a target also names the weights of a family's expert layers (``ModelSpec.experts``;
Qwen3-MoE's ``w1 w2 w3`` are its experts' gate, down and up projections, and its dense layers'
Linear layers of the same names): each expert gets its own adapter pair, stacked by expert on
dim 0 (:class:`~llmforge.algorithms.lora.layers.LoRAExpertsMixin`), so ``strategy.ep`` and
FSDP2 shard them with the experts. ``dropout`` must be 0 then (the expert adapters act on the
weights, where dropout has no meaning).

Everything else goes through the plugin hooks of :class:`llmforge.plugin.Algorithm`,
so no core file knows LoRA: ``adapters_only`` checkpoints (the adapters and their optimizer
state; the base is rebuilt from its pointer), the settings in ``meta.json``
(:meth:`LoRA.checkpoint_meta`) that a resume must match (:meth:`LoRA.check_resume`), the
adapter layers for ``generate``/``eval``/``convert`` (:meth:`LoRA.inference_model`), the merged
export (:meth:`LoRA.export_model`), PEFT's adapter format (:meth:`LoRA.export_adapters`,
:mod:`llmforge.algorithms.lora.peft`) and the dry run's memory estimate
(:mod:`llmforge.algorithms.lora.memory`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from llmforge.algorithms.lora.layers import (LoRAMixin, has_adapters, init_adapters, is_adapter_key,
                                             lora_class, lora_experts_class,
                                             merge_lora)
from llmforge.algorithms.lora.memory import lora_lines, parameter_counts
from llmforge.algorithms.lora.peft import save_peft
from llmforge.errors import ConfigError
from llmforge.models.spec import get_spec, spec_for_model
from llmforge.plugin import Algorithm, CheckContext, ModelContext, Stage

DEFAULT_TARGETS = ("wq", "wk", "wv", "wo")
BASE_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
               "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}


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


def expert_weights(model: nn.Module) -> list[tuple[str, str]]:
    """``(expert layer fqn, weight name)`` of every 3-D weight ``[E, out, in]`` of the model's
    expert layers (its spec's ``experts`` hook; none for a dense family)."""
    spec = spec_for_model(model)
    experts = {id(m) for m in spec.expert_modules(model)} if spec is not None else set()
    return [(fqn, pname) for fqn, m in model.named_modules() if id(m) in experts
            for pname, p in m.named_parameters(recurse=False) if p.ndim == 3]


def match_expert_targets(model: nn.Module, targets: Sequence[str]) -> dict[str, list[tuple[str, str]]]:
    """``{target: [(expert layer fqn, weight name), ...]}``: the :func:`expert_weights` whose
    full name is ``target`` or ends with ``"." + target`` (``w1`` matches
    ``layers.0.feed_forward.experts.w1``)."""
    found = expert_weights(model)
    return {t: [(f, p) for f, p in found if f"{f}.{p}" == t or f"{f}.{p}".endswith("." + t)]
            for t in targets}


class LoRA(Algorithm):
    """Low-rank adapters on the ``targets`` Linear layers; everything else frozen.

    Args:
        rank: adapter inner dimension ``r`` (>= 1).
        alpha: the adapter output is scaled by ``alpha / rank`` (> 0).
        dropout: dropout probability on the adapter input, in ``[0, 1)``.
        targets: Linear module-name suffixes (``wq wk wv wo w1 w2 w3 output`` for Llama), or
            expert weight names (``w1 w2 w3`` for Qwen3-MoE's experts).
        base_dtype: storage dtype of the frozen parameters: ``bfloat16`` (default; half the
            memory of float32) or ``float32`` (exact comparisons; needed for tests on the CPU).

    Raises:
        ConfigError: a bad value (naming ``lora.<key>``), a target matching no Linear layer
            and no expert weight, ``strategy.tp > 1``, ``output`` targeted with tied
            embeddings, or ``dropout > 0`` with expert weights targeted.
    """

    name = "lora"
    stage = Stage.CONVERT
    priority = 1  # after float8 in the same stage: float8 converts the base Linear layers first
    adapters_only = True  # checkpoints: the adapters; the frozen base comes from its pointer
    replaces_memory_estimate = True
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
        self.converted_experts: dict[str, list[str]] = {}

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def options(self) -> dict[str, Any]:
        """The keys of this entry (as in YAML), for ``meta.json`` and the PEFT config."""
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "targets": list(self.targets), "base_dtype": self.base_dtype_name}

    # -------------------------------------------------------------------- checks
    def check(self, run: CheckContext) -> None:
        """Targets match, no tensor parallelism, no LoRA on a tied output projection.

        Raises:
            ConfigError: see the class docstring.
        """
        cfg = run.cfg
        if run.dims.tp > 1:
            raise ConfigError(f"algorithms: lora does not support strategy.tp={run.dims.tp} "
                              "(tensor parallelism would shard the adapters' rank dimension); "
                              "use strategy.tp=1 with FSDP2 (strategy.name=fsdp2)")
        model = run.model
        experts = match_expert_targets(model, self.targets)
        for t, fqns in match_targets(model, self.targets).items():
            if not fqns and not experts[t]:
                names = sorted({f.rsplit(".", 1)[-1] for f, m in model.named_modules()
                                if isinstance(m, nn.Linear)})
                weights = sorted({p for _, p in expert_weights(model)})
                raise ConfigError(f"algorithms: lora.targets entry '{t}' matches no Linear layer "
                                  f"of model '{cfg.model.name}'; its Linear layers are named "
                                  f"{', '.join(names)}"
                                  + (f" and its expert weights {', '.join(weights)}" if weights else ""))
            if experts[t] and self.dropout > 0:
                raise ConfigError(f"algorithms: lora.dropout={self.dropout:g} must be 0 when "
                                  f"lora.targets entry '{t}' names expert weights (their "
                                  "adapters act on the weights, where dropout has no meaning)")
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
        self.converted_experts = {}
        for found in match_expert_targets(model, self.targets).values():
            for fqn, pname in found:
                self.converted_experts.setdefault(fqn, []).append(pname)
        for fqn, names in sorted(self.converted_experts.items()):
            m = model.get_submodule(fqn)
            m.__class__ = lora_experts_class(type(m))
            m.add_expert_adapters(sorted(set(names)), self.rank, self.alpha, fqn)
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

    def fit_start(self, state: Any) -> None:
        if state.trainer.is_global_zero:
            counts = parameter_counts(state.model)
            experts = (f" and {len(self.converted_experts)} expert layers"
                       if self.converted_experts else "")
            print(f"lora: {len(self.converted)} Linear layers{experts} with rank-{self.rank} adapters "
                  f"(alpha {self.alpha:g}, scale {self.scaling:g}); trainable "
                  f"{counts[0]:,} / frozen {counts[1]:,} parameters (base in "
                  f"{self.base_dtype_name})", flush=True)

    # ------------------------------------------------------------- plugin hooks
    @staticmethod
    def saved_options(meta: dict[str, Any]) -> Optional[dict[str, Any]]:
        """The settings a checkpoint's adapters were trained with (``meta.json``:
        ``plugins.lora``; ``lora`` in checkpoints of llmforge before the event contract)."""
        return (meta.get("plugins") or {}).get("lora") or meta.get("lora")

    def checkpoint_meta(self, cfg: Any) -> dict[str, Any]:
        return self.options()

    def check_resume(self, checkpoint: Path, meta: dict[str, Any], cfg: Any) -> None:
        """The adapters' settings must be those they were saved with.

        Raises:
            ConfigError: a setting differs (names it, with both values).
        """
        saved, now = self.saved_options(meta), self.options()
        if not saved:
            return
        changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        if changed:
            raise ConfigError(
                f"checkpoint.resume: {checkpoint} holds LoRA adapters saved with "
                + ", ".join(f"{k}={saved.get(k)!r}" for k in changed) + "; this run has "
                + ", ".join(f"{k}={now.get(k)!r}" for k in changed)
                + "; resume with the lora settings it was saved with, or start a new run")

    def inference_model(self, model: nn.Module, cfg: Any, meta: dict[str, Any]) -> nn.Module:
        """Add the adapter layers with the settings the checkpoint was saved with (they win
        over config.yaml's)."""
        saved = self.saved_options(meta)
        lora = LoRA(**{**self.options(), **saved}) if saved else self
        return lora.convert(model, cfg.run.seed)

    def export_model(self, model: nn.Module, checkpoint: Path) -> nn.Module:
        """Merged: ``W + (alpha / r) B A`` in float32 (a bf16 base would round small adapter
        updates away; ``convert --dtype`` casts afterwards)."""
        return merge_lora(model.float()) if has_adapters(model) else model

    def export_adapters(self, model: nn.Module, out: Path, cfg: Any, meta: dict[str, Any],
                        dtype: Any = None) -> Optional[Path]:
        """PEFT's adapter folder (:func:`llmforge.algorithms.lora.peft.save_peft`)."""
        if not has_adapters(model):
            return None
        adapter = get_spec(cfg.model.name).adapter()
        if adapter is None:
            raise ConfigError(f"model '{cfg.model.name}' has no Hugging Face adapter "
                              "(ModelSpec.hf_adapter), so its LoRA adapters have no PEFT names")
        init_from = cfg.model.get("init_from") or ""
        base = init_from[3:] if init_from.startswith("hf:") else None
        return save_peft(model, out, {**self.options(), **(self.saved_options(meta) or {})},
                         base=base, dtype=dtype, adapter=adapter)

    def dry_run_lines(self, cfg: Any, plan: Any, device_memory_gib: Optional[float]) -> list[str]:
        """Rank, trainable/frozen counts and the per-device memory of a LoRA run
        (:func:`llmforge.algorithms.lora.memory.lora_lines`)."""
        return lora_lines(self, cfg, plan, device_memory_gib)

    @classmethod
    def from_peft_config(cls, peft_config: Any) -> Optional[dict[str, Any]]:
        """PEFT's LoRA settings (``peft_type`` absent or ``LORA``; ``r``, ``lora_alpha``,
        ``lora_dropout``) as a ``lora`` entry; target modules stay llmforge's defaults."""
        if str(peft_config.get("peft_type") or "LORA").upper() != "LORA":
            return None
        names = {"r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout"}
        return {"name": cls.name, **{new: peft_config[old] for old, new in names.items() if old in peft_config}}
