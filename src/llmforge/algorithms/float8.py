"""``float8``: FP8 matrix multiplies in the linear layers, through torchao.

YAML::

    algorithms:
      - name: float8
        recipe: tensorwise                          # tensorwise | rowwise | rowwise_with_gw_hp
        enable_fsdp_float8_all_gather: false        # FSDP2 all-gathers weights in FP8 (tensorwise)
        enable_tp_float8_all_gather: null           # TP all-gathers activations in FP8 (null: tensorwise)
        precompute_float8_dynamic_scale_for_fsdp: null   # null = same as the all-gather key
        emulate: false                              # FP8 numerics with high-precision matmuls
        filter_fqns: [output]                       # Linear layers kept in high precision
        modules: null                               # only these FQN substrings (null = all others)

``torchao.float8.convert_to_float8_training`` swaps ``nn.Linear`` for ``Float8Linear`` (a
subclass of ``nn.Linear``: names, shapes and state dict unchanged). The weights stay in high
precision; each matmul casts its inputs to FP8 with dynamic scales (per tensor, or per row for
the rowwise recipes) and accumulates in high precision. Default filter: keep the layers whose
FQN contains a ``filter_fqns`` entry (the output projection, whose FP8 cast hurts the loss the
most) and every Linear whose in or out features are not multiples of 16 (an FP8 GEMM
requirement) in high precision.

With ``enable_fsdp_float8_all_gather`` FSDP2 all-gathers the weights already cast to FP8 (half
the bytes of bf16), and ``precompute_float8_dynamic_scale_for_fsdp`` computes all weight scales
with one all-reduce after each optimizer step instead of one per layer.

Under tensor parallelism with the tensorwise recipe the converted layers take torchao's float8
TP styles (``Float8ColwiseParallel``, ``Float8RowwiseParallel``, ``PrepareFloat8ModuleInput``),
as torchtitan does: a block's inputs are cast before their sequence-parallel all-gather and its
output gradients before theirs, so those all-gathers move 1 byte per element instead of 2; the
reduce-scatters stay in high precision. The cast uses the whole tensor's scale (an amax
all-reduce over the tp group), so the FP8 values are those a cast after the gather gives: the
losses are the same. ``enable_tp_float8_all_gather: false`` keeps torch's styles; the rowwise
recipes always do (torchao's float8 TP styles scale per tensor).

Stage ``CONVERT`` (first: every later stage sees the final module types). The FP8 dtypes are
torchao's choice per device (e4m3fn/e5m2, or the fnuz variants on MI300). Sources: torchao
``torchao/float8/README.md``; torchtitan ``docs/float8.md``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any, Mapping, Optional, Sequence

from torch import nn

from llmforge.errors import ConfigError
from llmforge.models.tp_styles import TPStyles
from llmforge.plugin import Algorithm, CheckContext, ModelContext, Stage

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def import_float8() -> Any:
    """``torchao.float8``, imported without its CPU-only notices (skipped C++ extensions, a
    torch 2.13 deprecation of Enum pytree constants), which are not actionable here."""
    import logging

    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        import torchao.float8 as f8
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    return f8




def plain_weight_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook: replace a float8 all-gather weight wrapper (possibly inside a
    DTensor shard) by a view of its plain inner tensor."""
    import torch

    key = prefix + "weight"
    t = state_dict.get(key)
    local = getattr(t, "_local_tensor", None)
    inner = getattr(local if local is not None else t, "_tensor", None)
    if inner is None:
        return
    inner = inner.detach()  # the original Parameter: a detached view shares its storage
    with torch.no_grad():
        if local is None:
            state_dict[key] = inner
        else:
            from torch.distributed.tensor import DTensor

            state_dict[key] = DTensor.from_local(inner, t.device_mesh, t.placements,
                                                 run_check=False, shape=t.shape, stride=t.stride())


def check_entries(key: str, entries: Sequence[str], model: nn.Module) -> None:
    """Every entry of ``float8.<key>`` must be a substring of some module's FQN.

    Raises:
        ConfigError: an entry matches no module; names the entry and the closest module names
            (difflib over the FQNs and their last parts, else the Linear layers' names).
    """
    import difflib

    fqns = [name for name, _ in model.named_modules() if name]
    for entry in entries:
        if any(entry in fqn for fqn in fqns):
            continue
        leaves = sorted({f.rsplit(".", 1)[-1] for f in fqns})
        names = list(dict.fromkeys(leaves + fqns))
        close = difflib.get_close_matches(entry, names, n=3, cutoff=0.5) or sorted(
            {f.rsplit(".", 1)[-1] for f, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(f"algorithms: float8.{key} entry '{entry}' matches no module of the "
                          f"model; closest module names: {', '.join(close)}. Entries are "
                          "substrings of module names such as 'output' or 'layers.0.attention'")


class Float8TPStyles(TPStyles):
    """torchao's float8 TP styles for ``Float8Linear`` layers with dynamic scaling (what
    torchtitan's ``apply_tp`` gives them with the tensorwise recipe); torch's for every other
    layer, and for an input whose readers are not all such layers (a cast input would reach a
    high-precision matmul)."""

    @staticmethod
    def gathers(module: nn.Module) -> bool:
        """Whether ``module`` is a ``Float8Linear`` that casts its input and gradient with
        dynamic scales (torchao's condition for float8 all-gathers)."""
        f8 = import_float8()
        dynamic = f8.config.ScalingType.DYNAMIC
        return (isinstance(module, f8.float8_linear.Float8Linear) and module.scaling_type_input == dynamic
                and module.scaling_type_grad_output == dynamic)

    def colwise(self, module: nn.Module, **kwargs: Any) -> Any:
        if not self.gathers(module):
            return super().colwise(module, **kwargs)
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

        return Float8ColwiseParallel(**kwargs)

    def rowwise(self, module: nn.Module, **kwargs: Any) -> Any:
        if not self.gathers(module):
            return super().rowwise(module, **kwargs)
        from torchao.float8.float8_tensor_parallel import Float8RowwiseParallel

        return Float8RowwiseParallel(**kwargs)

    def prepare_input(self, readers: Sequence[nn.Module], **kwargs: Any) -> Any:
        if not readers or not all(self.gathers(m) for m in readers):
            return super().prepare_input(readers, **kwargs)
        from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

        return PrepareFloat8ModuleInput(**kwargs)


class Float8(Algorithm):
    """Convert ``nn.Linear`` layers to torchao ``Float8Linear`` for FP8 training.

    Args:
        recipe: ``tensorwise`` (one scale per tensor; fastest, FP8 all-gather), ``rowwise``
            (one scale per row: more accurate), ``rowwise_with_gw_hp`` (rowwise, weight gradient
            in high precision).
        enable_fsdp_float8_all_gather: FSDP2 all-gathers FP8 weights (``tensorwise`` only).
            ``fsdp_float8_all_gather`` is accepted as a short alias.
        enable_tp_float8_all_gather: under ``strategy.tp > 1``, the sequence-parallel
            all-gathers of the converted layers' inputs and output gradients in FP8 (torchao's
            float8 TP styles); ``None`` (default): on with ``tensorwise``, off otherwise.
        precompute_float8_dynamic_scale_for_fsdp: one all-reduce for all weight scales after
            each optimizer step; ``None`` follows ``enable_fsdp_float8_all_gather``.
        emulate: emulate FP8 matmuls in high precision (hardware without FP8 units; testing).
        filter_fqns: FQN substrings of Linear layers kept in high precision (default
            ``["output"]``). Each given entry must match some module's FQN (``check``): a
            misspelt one would silently convert the layer it meant to keep.
        modules: if given, only Linear layers whose FQN contains one of these are converted,
            and each must have in/out features divisible by 16.

    Raises:
        ConfigError: unknown ``recipe``; a flag that is not true or false (or null where
            it has a default of its own); FP8 all-gather (FSDP2's or TP's) with a rowwise recipe; precompute
            without FP8 all-gather; (``check``) a ``filter_fqns`` or ``modules`` entry that
            matches no module, naming the closest module names.
    """

    name = "float8"
    stage = Stage.CONVERT
    summary = "FP8 linear layers via torchao (tensorwise/rowwise), optional FP8 FSDP2 all-gather"

    def __init__(self, recipe: str = "tensorwise", enable_fsdp_float8_all_gather: bool = False,
                 precompute_float8_dynamic_scale_for_fsdp: Optional[bool] = None,
                 emulate: bool = False, filter_fqns: Optional[Sequence[str]] = None,
                 modules: Optional[Sequence[str]] = None,
                 fsdp_float8_all_gather: Optional[bool] = None,
                 enable_tp_float8_all_gather: Optional[bool] = None) -> None:
        if recipe not in RECIPES:
            raise ConfigError(f"algorithms: float8.recipe '{recipe}' is not one of {', '.join(RECIPES)}")
        # a quoted 'false' would read as true
        for key, value, null in (("enable_fsdp_float8_all_gather", enable_fsdp_float8_all_gather, False),
                                 ("emulate", emulate, False),
                                 ("fsdp_float8_all_gather", fsdp_float8_all_gather, True),
                                 ("precompute_float8_dynamic_scale_for_fsdp",
                                  precompute_float8_dynamic_scale_for_fsdp, True),
                                 ("enable_tp_float8_all_gather", enable_tp_float8_all_gather, True)):
            if not isinstance(value, bool) and not (null and value is None):
                raise ConfigError(f"algorithms: float8.{key} must be true or false{' (or null)' * null}, "
                                  f"got {value!r}")
        if fsdp_float8_all_gather is not None:
            if fsdp_float8_all_gather != enable_fsdp_float8_all_gather and enable_fsdp_float8_all_gather:
                raise ConfigError("algorithms: float8.fsdp_float8_all_gather and enable_fsdp_float8_all_gather "
                                  "(its long name) disagree; give one")
            enable_fsdp_float8_all_gather = fsdp_float8_all_gather
        self.recipe, self.all_gather = recipe, bool(enable_fsdp_float8_all_gather)
        self.precompute = (self.all_gather if precompute_float8_dynamic_scale_for_fsdp is None
                           else bool(precompute_float8_dynamic_scale_for_fsdp))
        self.emulate = bool(emulate)
        for key, value in (("filter_fqns", filter_fqns), ("modules", modules)):
            # a string would be read character by character (each matches nearly every layer)
            if value is not None and (isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence)
                                      or not all(isinstance(v, str) and v for v in value)):
                raise ConfigError(f"algorithms: float8.{key} must be a list of module-name substrings, "
                                  f"e.g. [output]; got {value!r}")
        self.explicit_filter = filter_fqns is not None  # the default is not checked (other families)
        self.filter_fqns = ["output"] if filter_fqns is None else [str(f) for f in filter_fqns]
        self.modules = None if modules is None else [str(m) for m in modules]
        if self.all_gather and recipe != "tensorwise":
            raise ConfigError(
                f"algorithms: float8.enable_fsdp_float8_all_gather=true needs float8.recipe="
                f"tensorwise (one scale per weight tensor); float8.recipe={recipe} scales per row. "
                "Use recipe: tensorwise or set enable_fsdp_float8_all_gather: false")
        if enable_tp_float8_all_gather and recipe != "tensorwise":
            raise ConfigError(
                f"algorithms: float8.enable_tp_float8_all_gather=true needs float8.recipe=tensorwise "
                f"(torchao's float8 TP styles scale per tensor); float8.recipe={recipe} scales per row. "
                "Use recipe: tensorwise or leave enable_tp_float8_all_gather out")
        self.tp_gather = recipe == "tensorwise" and enable_tp_float8_all_gather is not False
        self.tp_gathered = False  # set when the TP plan got the float8 styles
        if self.precompute and not self.all_gather:
            raise ConfigError(
                "algorithms: float8.precompute_float8_dynamic_scale_for_fsdp=true only acts on "
                "FP8 all-gathered weights; set float8.enable_fsdp_float8_all_gather=true too")
        self.converted: list[str] = []
        self.kept: list[str] = []

    # -------------------------------------------------------------------- filter
    def keep_reason(self, module: nn.Module, fqn: str) -> Optional[str]:
        """Why the Linear ``fqn`` stays in high precision, or ``None`` if it is converted.

        Raises:
            ConfigError: a layer selected by ``modules`` has a dimension not divisible by 16.
        """
        if any(f in fqn for f in self.filter_fqns):
            return "filter_fqns"
        if self.modules is not None and not any(m in fqn for m in self.modules):
            return "not in modules"
        n, k = module.out_features, module.in_features
        if n % 16 or k % 16:
            if self.modules is not None:
                raise ConfigError(
                    f"algorithms: float8.modules selects '{fqn}' ({k} -> {n} features), but FP8 "
                    "matmuls need in and out features divisible by 16; remove it from "
                    "float8.modules or add it to float8.filter_fqns")
            return "dims not multiples of 16"
        return None

    def module_filter(self, module: nn.Module, fqn: str) -> bool:
        """``module_filter_fn`` for torchao: True converts the layer."""
        if not isinstance(module, nn.Linear):
            return False
        reason = self.keep_reason(module, fqn)
        (self.kept if reason else self.converted).append(fqn)
        return reason is None

    def plan(self, model: nn.Module) -> tuple[list[str], list[str]]:
        """``(converted, kept)`` FQNs of ``model``'s Linear layers under this filter."""
        conv, kept = [], []
        for fqn, m in model.named_modules():
            if isinstance(m, nn.Linear):
                (kept if self.keep_reason(m, fqn) else conv).append(fqn)
        return conv, kept

    def config(self) -> Any:
        """The torchao ``Float8LinearConfig`` for these settings."""
        cfg = import_float8().Float8LinearConfig.from_recipe_name(self.recipe)
        return dataclasses.replace(cfg, enable_fsdp_float8_all_gather=self.all_gather,
                                   emulate=self.emulate)

    # -------------------------------------------------------------------- pipeline
    def check(self, run: CheckContext) -> None:
        """torchao installed; FP8 all-gather only under FSDP2 sharding; ``modules`` dims.

        Raises:
            ConfigError: see the class docstring; names ``float8.*`` and the strategy keys.
        """
        if importlib.util.find_spec("torchao") is None:
            raise ConfigError("algorithms: float8 needs torchao: pip install 'llmforge[fp8]' "
                              "(in a clone: pip install -e '.[fp8]'; torchao>=0.18, tested with "
                              "0.18.0 and torch 2.13)")
        if self.all_gather:
            # the FSDP2 shard group of the resolved run (none unless strategy fsdp2)
            shard = run.dims.dp_shard if run.strategy == "fsdp2" else 1
            if shard <= 1:
                raise ConfigError(
                    "algorithms: float8.enable_fsdp_float8_all_gather=true needs FSDP2 sharding "
                    f"(strategy.name=fsdp2 with strategy.dp_shard > 1), but strategy.name="
                    f"{run.cfg.strategy.name} on {run.world_size} "
                    f"process(es) shards over {shard}; set "
                    "float8.enable_fsdp_float8_all_gather=false or train with FSDP2 on several devices")
        if self.explicit_filter or self.modules is not None:  # the meta model only when needed
            self.check_model(run.model)

    def check_model(self, model: nn.Module) -> None:
        """The filters against ``model``: each given ``filter_fqns`` and ``modules`` entry names a
        module, and ``modules`` selects a Linear layer (``llmforge plan --layout`` runs this too).

        Raises:
            ConfigError: names the entry and the closest module names.
        """
        if self.explicit_filter:
            check_entries("filter_fqns", self.filter_fqns, model)
        if self.modules is not None:
            check_entries("modules", self.modules, model)
            if not self.plan(model)[0]:
                raise ConfigError(f"algorithms: float8.modules {self.modules} leaves no Linear layer to convert "
                                  f"(none matches, or float8.filter_fqns {self.filter_fqns} keeps those that do)")

    def apply(self, model: nn.Module, ctx: ModelContext) -> nn.Module:
        """Swap the selected Linear layers for ``Float8Linear``; returns the model.

        Under ``tp > 1`` with the tensorwise recipe it sets ``ctx.tp_styles`` to
        :class:`Float8TPStyles` (the TP stage runs after this one).
        With FP8 all-gather the weights become torchao's ``WeightWithDynamicFloat8CastTensor``;
        a state-dict hook hands out their plain high-precision tensor instead (same storage),
        so checkpoints hold plain tensors that load without torchao (and with
        ``weights_only``), and loading into them still writes the weights in place.
        """
        self.converted, self.kept = [], []
        model = import_float8().convert_to_float8_training(
            model, module_filter_fn=self.module_filter, config=self.config())
        dims = getattr(ctx, "dims", None)  # no context: one process
        self.tp_gathered = self.tp_gather and dims is not None and dims.tp > 1 and bool(self.converted)
        if self.tp_gathered:  # the TP stage runs after this one and takes these styles
            ctx.tp_styles = Float8TPStyles()
        if self.all_gather:
            for module in model.modules():
                if type(module).__name__ == "Float8Linear":
                    module.register_state_dict_post_hook(plain_weight_hook)
        return model

    # -------------------------------------------------------------------- training
    def fit_start(self, state: Any) -> None:
        if state.trainer.is_global_zero:
            ag = ((", FP8 all-gather" if self.all_gather else "")
                  + (", FP8 TP all-gather" if self.tp_gathered else ""))
            print(f"float8: {len(self.converted)} Linear layers in FP8 ({self.recipe}{ag}"
                  f"{', emulated' if self.emulate else ''}), {len(self.kept)} kept in high "
                  f"precision ({', '.join(self.kept[:4])}{' ...' if len(self.kept) > 4 else ''})",
                  flush=True)

    def after_optimizer_step(self, state: Any) -> None:
        """After the optimizer step: the next all-gather's weight scales, one all-reduce."""
        if self.precompute:
            import_float8().precompute_float8_dynamic_scale_for_fsdp(state.model)
