"""``ema``: an exponential moving average of the weights, for evaluation and export.

YAML::

    algorithms:
      - name: ema
        decay: 0.999           # weight of the old average per optimizer step
        use_for_eval: true     # evaluations (eval/loss) use the averaged weights
        use_for_export: false  # `llmforge convert to-hf` writes the averaged weights

After every optimizer step (a skipped one leaves it unchanged)::

    ema <- decay * ema + (1 - decay) * w         (so ema_k = decay^k w_0 + sum_i (1 - decay) decay^(k-i) w_i)

starting from the initial weights ``w_0`` (Polyak averaging as in Karras et al. 2024,
"Analyzing and Improving the Training Dynamics of Diffusion Models", sec. 3.1; Composer's
``EMA`` algorithm). The average is kept in float32 with the same placement and sharding as each
trainable weight (a DTensor shard under FSDP2 or TP: no gathering, memory ``4 x params /
shards`` bytes per device), saved in every checkpoint (``plugins.EMA``) and resharded on resume.
With ``use_for_eval`` the weights are swapped for the average around each evaluation and
swapped back after it (training continues from the raw weights).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from llmforge.checkpoint.safe_load import load_metadata, safe_load
from llmforge.errors import ConfigError
from llmforge.models.memory_estimate import estimate_memory
from llmforge.plugin import Algorithm, meta_model

_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical(name: str) -> str:
    """A parameter name without wrapper prefixes (activation checkpointing, compile), as in
    the checkpoint and the exported model."""
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


class EMA(Algorithm):
    """Keeps ``ema = decay * ema + (1 - decay) * w`` of every trainable weight.

    Args:
        decay: in ``[0, 1)``.
        use_for_eval: evaluate with the averaged weights.
        use_for_export: ``convert to-hf`` writes the averaged weights.

    Raises:
        ConfigError: ``decay`` outside ``[0, 1)``, or a ``use_for_*`` that is not a bool.
    """

    name = "ema"
    summary = "exponential moving average of the weights (sharded like them), for eval and export"

    def __init__(self, decay: float = 0.999, use_for_eval: bool = True, use_for_export: bool = False) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not (
                math.isfinite(decay) and 0.0 <= decay < 1.0):
            raise ConfigError(f"algorithms: ema.decay={decay!r} must be in [0, 1) (e.g. 0.999)")
        for key, value in (("use_for_eval", use_for_eval), ("use_for_export", use_for_export)):
            if not isinstance(value, bool):  # bool("false") is True
                raise ConfigError(f"algorithms: ema.{key}={value!r} must be true or false")
        self.decay = float(decay)
        self.use_for_eval, self.use_for_export = use_for_eval, use_for_export
        self.model: Optional[nn.Module] = None
        self.params: dict[str, nn.Parameter] = {}
        self.shadow: dict[str, torch.Tensor] = {}
        self._backup: Optional[dict[str, torch.Tensor]] = None
        self._loaded = False

    # ------------------------------------------------------------------ state
    @torch.no_grad()
    def attach(self, model: nn.Module) -> None:
        """Start the average at ``model``'s current trainable weights (once per fit)."""
        self.model = model
        self.params = {canonical(n): p for n, p in model.named_parameters() if p.requires_grad}
        self.shadow = {n: p.detach().to(torch.float32, copy=True) for n, p in self.params.items()}

    def before_load(self, state: Any) -> None:
        # before the checkpointer's resume (FIT_START), which loads into these tensors
        self.attach(state.model)

    def sharded_state_dict(self) -> dict[str, Any]:
        return dict(self.shadow)

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        self.shadow.update(state)  # loaded in place into the tensors of sharded_state_dict()
        self._loaded = True

    def fit_start(self, state: Any) -> None:
        if state.step > 0 and not self._loaded:  # resumed from a checkpoint without an EMA
            self.attach(state.model)  # start the average at the resumed weights

    # ----------------------------------------------------------------- events
    @torch.no_grad()
    def update(self) -> None:
        """One averaging step with the current weights."""
        for name, p in self.params.items():
            s = self.shadow[name]
            s.lerp_(p.detach().to(s.dtype), 1.0 - self.decay)

    def after_optimizer_step(self, state: Any) -> None:
        if not state.skip_step:
            self.update()

    def _reshard(self) -> None:
        """Drop FSDP2's unsharded copies (the root keeps its own after a forward), so the next
        forward all-gathers the weights just written into the shards."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    @torch.no_grad()
    def _swap_in(self) -> None:
        self._reshard()
        self._backup = {n: p.detach().clone() for n, p in self.params.items()}
        for n, p in self.params.items():
            p.detach().copy_(self.shadow[n].to(p.dtype))

    @torch.no_grad()
    def _swap_out(self) -> None:
        if self._backup is not None:
            self._reshard()
            for n, p in self.params.items():
                p.detach().copy_(self._backup[n])
            self._backup = None

    def before_evaluation(self, state: Any) -> None:
        if self.use_for_eval and self.shadow:
            self._swap_in()

    def after_evaluation(self, state: Any) -> None:
        if self.use_for_eval:
            self._swap_out()

    def dry_run_lines(self, cfg: Any, plan: Any, device_memory_gib: Optional[float]) -> list[str]:
        """The average's memory per device: 4 bytes per trainable weight, sharded like it."""
        n = sum(p.numel() for p in meta_model(cfg).parameters() if p.requires_grad)
        mem = estimate_memory(n, "fp32", cfg.strategy, plan.world_size)
        return [f"ema             + {mem.params_bytes / 2**30:.2f} GiB per device (fp32 average of "
                f"{n:,} weights, sharded {mem.shards}x; not in memory/device)"]

    # ----------------------------------------------------------------- export
    @torch.no_grad()
    def export_model(self, model: nn.Module, checkpoint: Path) -> nn.Module:
        """With ``use_for_export``: the averaged weights from ``checkpoint`` (``plugins.EMA``)."""
        if not self.use_for_export:
            return model
        params = {canonical(n): p for n, p in model.named_parameters()}
        names = _saved_names(checkpoint, self.state_key)
        template = {n: torch.empty(tuple(params[n].shape), dtype=torch.float32) for n in names if n in params}
        if not template:
            raise ConfigError(f"algorithms: ema.use_for_export: {checkpoint} holds no EMA weights "
                              "(was the run trained with the ema algorithm?)")
        state = {"plugins": {self.state_key: template}}
        safe_load(state, str(checkpoint))
        for n, t in template.items():
            params[n].copy_(t.to(params[n].dtype))
        return model


def _saved_names(checkpoint: Path, key: str) -> list[str]:
    """Parameter names of the EMA entries (``plugins.<key>.<name>``) in a DCP checkpoint."""
    prefix = f"plugins.{key}."
    keys = load_metadata(Path(checkpoint) / ".metadata").state_dict_metadata
    return [k[len(prefix):] for k in keys if k.startswith(prefix)]
