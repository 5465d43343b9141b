"""``ModelSpec``: everything llmforge needs to know about one model family, in one object.

The anchor is torchtitan's ``ModelSpec`` (``torchtitan/protocols/model_spec.py``): a family is a
folder (``models/llama3/``, ``models/qwen3/``) whose spec bundles

* ``config_cls``: the family's ``model:`` YAML keys, a dataclass subclassing
  :class:`llmforge.config.schema.ModelConfig` (the loader validates them like every other key:
  unknown key with the closest one, wrong type);
* ``build``: ``build(model_cfg) -> nn.Module`` (the factory contract of :mod:`llmforge.models`);
* ``presets``: preset name -> shape (documentation and ``--dry-run``);
* ``check_config``: optional ``check_config(model_cfg)``, the light check of the ``model:``
  keys (preset name, shape) raising :class:`~llmforge.errors.ConfigError`; run when the run is
  resolved, before torch is imported, so a bad shape fails in a fraction of a second (the
  built-ins: their ``*_args_from_config``; a derived spec with other keys sets its own or
  ``None``);
* ``blocks``: the repeated blocks FSDP2, activation checkpointing and compile wrap (default:
  ``model.blocks()``);
* ``tp_plan``: optional ``tp_plan(model, tp_mesh) -> model`` applying tensor parallelism, and
  ``check_tp(model, tp)`` raising :class:`~llmforge.errors.ConfigError` for degrees it cannot do;
* ``hf_adapter``: optional Hugging Face state-dict adapter
  (:class:`llmforge.models.hf_adapter.HFAdapter`: weights and ``config.json`` both ways);
* ``flops_per_token``: ``flops_per_token(model, seq_len)`` (default: the model's method);
* ``active_params``: optional ``active_params(model) -> int``, the parameters one token's forward
  uses (a mixture of experts: all but the experts it is not routed to; default: all);
* ``memory_shape``: optional ``memory_shape(model) -> MemoryShape``, the widths the dry run's
  activation estimate needs;
* ``stage_ends``: ``(first, last)`` names of the top-level modules the first pipeline stage
  keeps before the blocks (the embedding) and the last keeps after them (final norm, output);
  the other stages set them to ``None`` and the model's forward skips them
  (:mod:`llmforge.parallel.pipeline`).
* ``check_tokens``: optional ``check_tokens(model_cfg, tokens)`` raising
  :class:`~llmforge.errors.ConfigError` when a forward of ``tokens`` tokens on one rank (a
  micro-batch) cannot work for the ``model:`` section (a mixture of experts: a capacity below
  one token per expert); checked before anything is built.
* ``experts``: optional ``experts(model) -> list[nn.Module]``, the expert layers: what expert
  parallelism (``strategy.ep``, :mod:`llmforge.parallel.expert`) splits. Each has an int
  ``num_experts`` ``E``, parameters stacked by expert on dim 0 (``[E, ...]``) and
  ``forward(x [M, D] rows sorted by expert, counts [E] int64, *rest) -> [M, D]``; with a
  parameter sharded on dim 0 it computes with its local experts (``counts`` then has
  ``E / ep`` entries). Its weights ``[E, out, in]`` (the forward computes ``x W_e^T``) are
  read by its forward through ``local_weight(name) -> [E_local, out, in]``, which an adapter
  plugin may override (low-rank adapters on experts).

Heavy members may be given as import paths (``"llmforge.models.qwen3.model:build_qwen3"``) and
are imported on first use, so loading and checking a config imports no torch. This module
imports nothing heavy either.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

from llmforge import registry
from llmforge.errors import ConfigError

__all__ = ["ModelSpec", "MemoryShape", "family_spec", "get_spec", "spec_for_model",
           "spec_for_hf_type", "cfg_get", "check_shape_int", "reject_factory_kwargs", "factory_kind"]

Ref = Union[str, Callable[..., Any], None]


def _resolve(ref: Any) -> Any:
    """An import path ``pkg.mod:attr`` -> the object; anything else unchanged."""
    if isinstance(ref, str):
        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(module), attr)
    return ref


def cfg_get(cfg: Any, key: str) -> Any:
    """``cfg[key]`` of a ``model:`` section (dataclass, OmegaConf ``DictConfig`` or mapping) as
    plain Python (OmegaConf containers -> dict/list); ``None`` when absent."""
    value = cfg.get(key) if isinstance(cfg, Mapping) or hasattr(cfg, "_get_node") else getattr(cfg, key, None)
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


# The largest shape a built-in family accepts: past these a meta model never finishes building
# (10**300 blocks) or torch's size arithmetic overflows (a width of 10**300). Blocks: 65 x the
# deepest published dense model (Llama 3.1 405B: 126); widths, heads, vocabulary: 2**24, 1,024
# x its width (16,384); sequence: 2**30 tokens.
SHAPE_LIMITS = {"n_layers": 8_192, "max_seq_len": 2**30}
WIDTH_LIMIT = 2**24


def check_shape_int(key: str, value: Any) -> None:
    """A ``model.<key>`` shape field is an integer from 1 to its limit (:data:`SHAPE_LIMITS`,
    else :data:`WIDTH_LIMIT`).

    Raises:
        ConfigError: naming ``model.<key>``, the value and the limit.
    """
    shown = (f"a {'negative ' * (value < 0)}{len(str(abs(value)))}-digit number"
             if isinstance(value, int) and abs(value) >= 10**30
             else repr(value))  # not 300 digits on the terminal
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"model.{key} must be a positive integer; got {shown}")
    limit = SHAPE_LIMITS.get(key, WIDTH_LIMIT)
    if value > limit:
        shown = shown if value >= 10**30 else f"{value:,}"
        raise ConfigError(f"model.{key} is {shown}: llmforge builds at most {limit:,}; give a smaller value")


def reject_factory_kwargs(family: str, cfg: Any, kwargs: Mapping[str, Any]) -> None:
    """A built-in family's factory takes its shape from the ``model:`` fields only.

    Raises:
        ConfigError: ``model.kwargs`` or keyword arguments were given (names them).
    """
    extra = {**dict(cfg_get(cfg, "kwargs") or {}), **kwargs}
    if extra:
        raise ConfigError(f"model.kwargs: the built-in '{family}' factory takes no extra arguments "
                          f"(got {', '.join(sorted(extra))}); set the model: shape fields instead.")


@dataclass(frozen=True)
class MemoryShape:
    """Widths of one repeated block, for the dry run's activation estimate (elements per token).

    ``dim`` residual width D; ``q_dim`` query width (H x head_dim); ``kv_dim`` key/value width
    (K x head_dim); ``ffn_dim`` SwiGLU hidden width F; ``extra`` further elements a block saves
    per token (e.g. QK-norm outputs: q_dim + kv_dim)."""

    dim: int
    n_layers: int
    q_dim: int
    kv_dim: int
    ffn_dim: int
    vocab_size: int
    extra: int = 0


@dataclass
class ModelSpec:
    """One model family (see the module docstring). ``spec(cfg)`` builds the model, so a spec
    registered in :data:`llmforge.registry.models` works wherever a bare factory did.

    Example (research code)::

        from llmforge.models import LLAMA3
        from llmforge.registry import models

        models.register("my_llama", LLAMA3.derive(name="my_llama", build=build_my_llama))
    """

    name: str
    build: Ref
    config_cls: Optional[type] = None
    presets: Mapping[str, Any] = field(default_factory=dict)
    check_config: Ref = None
    model_cls: Ref = None
    blocks: Ref = None
    tp_plan: Ref = None
    check_tp: Ref = None
    hf_adapter: Ref = None
    flops_per_token: Ref = None
    memory_shape: Ref = None
    active_params: Ref = None
    stage_ends: tuple = (("tok_embeddings",), ("norm", "output"))
    experts: Ref = None
    check_tokens: Ref = None
    description: str = ""

    def __call__(self, cfg: Any, **kwargs: Any) -> Any:
        """Build the model from the ``model:`` section; a spec's ``blocks`` becomes the model's
        ``blocks()`` when it has none, so FSDP2, activation checkpointing and compile (which
        call ``model.blocks()``) all wrap the same modules."""
        model = _resolve(self.build)(cfg, **kwargs)
        fn = self.get("blocks")
        if fn is not None and not callable(getattr(model, "blocks", None)):
            object.__setattr__(model, "blocks", lambda: list(fn(model)))
        return model

    def check(self, cfg: Any) -> None:
        """Run ``check_config`` on the ``model:`` section ``cfg`` (nothing without one).

        Raises:
            ConfigError: from the family's check (unknown preset, impossible shape)."""
        fn = self.get("check_config")
        if fn is not None:
            fn(cfg)

    def get(self, member: str) -> Any:
        """A member with import paths resolved (``None`` when the family has none)."""
        return _resolve(getattr(self, member))

    def derive(self, **changes: Any) -> "ModelSpec":
        """A copy with some members replaced (a research variant of a built-in family)."""
        return dataclasses.replace(self, **changes)

    # -- what the core packages call ------------------------------------------------------
    def model_blocks(self, model: Any) -> list:
        """The repeated blocks of a built model (units of FSDP2, AC and compile)."""
        if callable(getattr(model, "blocks", None)):
            return list(model.blocks())
        fn = self.get("blocks")
        if fn is None:
            raise ConfigError(f"model '{self.name}' has no blocks() and its spec no blocks: FSDP2, "
                              "activation checkpointing and compile need the repeated blocks")
        return list(fn(model))

    def expert_modules(self, model: Any) -> list:
        """The expert layers of a built model (what ``strategy.ep`` splits); ``[]`` for a
        dense family."""
        fn = self.get("experts")
        return list(fn(model)) if fn is not None else []

    def flops(self, model: Any, seq_len: int) -> float:
        """Training FLOPs per token at ``seq_len`` (forward + backward); nan if unknown."""
        fn = self.get("flops_per_token")
        if fn is not None:
            return float(fn(model, seq_len))
        method = getattr(model, "flops_per_token", None)
        return float(method(seq_len)) if method is not None else float("nan")

    def num_params(self, model: Any) -> tuple[int, int]:
        """``(total, active)`` parameters of a built model (tied weights once; ``active`` is
        the spec's ``active_params`` hook, else ``total``)."""
        total = int(model.num_params()) if hasattr(model, "num_params") else sum(
            p.numel() for p in model.parameters())
        fn = self.get("active_params")
        return total, (int(fn(model)) if fn is not None else total)

    def adapter(self) -> Any:
        """The Hugging Face state-dict adapter (an instance), or ``None``."""
        obj = self.get("hf_adapter")
        return obj() if isinstance(obj, type) else obj


def family_spec(name: str, package: str, *, model: str, build: str, hf_adapter: str,
                **members: Any) -> ModelSpec:
    """The spec of a built-in family laid out as one folder ``package`` (``models/llama3/``):
    ``model``, ``build`` are names in ``<package>.model``, ``hf_adapter`` in ``<package>.hf``,
    the TP plan is ``<package>.parallelize:apply_tp``/``check_tp``; ``members`` are the other
    :class:`ModelSpec` fields (``config_cls``, ``presets``, ``memory_shape``, ...). Members are
    import paths, so nothing heavy is imported here."""
    return ModelSpec(name=name, build=f"{package}.model:{build}", model_cls=f"{package}.model:{model}",
                     tp_plan=f"{package}.parallelize:apply_tp",
                     check_tp=f"{package}.parallelize:check_tp",
                     hf_adapter=f"{package}.hf:{hf_adapter}", **members)


def factory_kind(obj: Any) -> str:
    """"" when ``obj`` (named by import path in ``model.name``) can be a model factory: a
    :class:`ModelSpec`, a function defined in Python outside the standard library, or an
    ``nn.Module`` subclass; else what it is, for the error message. Checked before it is called:
    ``model.name: builtins.print`` or ``subprocess.Popen`` must not run with the model section."""
    if isinstance(obj, ModelSpec):
        return ""
    if inspect.isfunction(obj):
        top = (obj.__module__ or "").split(".")[0]
        if top in sys.stdlib_module_names:
            return f"a function of the standard library ({obj.__module__}), not a model factory"
        return ""
    torch = sys.modules.get("torch")  # a Module subclass was defined by importing torch
    if isinstance(obj, type) and torch is not None and issubclass(obj, torch.nn.Module):
        return ""
    what = "a class that is not an nn.Module subclass" if isinstance(obj, type) else f"a {type(obj).__name__}"
    return (f"{what}, not a model factory; name a ModelSpec, a function cfg -> nn.Module or an "
            "nn.Module subclass (docs/models.md)")


def _as_spec(name: str, obj: Any) -> ModelSpec:
    if isinstance(obj, ModelSpec):
        return obj
    # a bare factory (research code): its blocks come from model.blocks(), no TP plan, no HF
    return ModelSpec(name=name, build=obj, config_cls=getattr(obj, "config_cls", None))


def get_spec(name: str, *, key: str = "model.name") -> ModelSpec:
    """The spec registered as ``name`` (or imported from an import path); a bare factory is
    wrapped in a spec with defaults.

    Raises:
        ConfigError: unknown name or import path (the message lists the registered names).
    """
    return _as_spec(name, registry.models.get(name, key=key))


def _registered_specs() -> list[ModelSpec]:
    return registry.models.matching(lambda o: isinstance(o, ModelSpec))


def spec_for_model(model: Any) -> Optional[ModelSpec]:
    """The registered spec whose ``model_cls`` the built ``model`` is an instance of (the most
    derived match first), or ``None``."""
    hits = []
    for spec in _registered_specs():
        cls = spec.get("model_cls")
        if cls is not None and isinstance(model, cls):
            hits.append((len(cls.__mro__), spec))
    return max(hits, key=lambda h: h[0])[1] if hits else None


def spec_for_hf_type(model_type: str) -> Optional[ModelSpec]:
    """The built-in spec whose HF adapter reads ``config.json`` ``model_type`` (``llama``,
    ``qwen3``), or ``None``."""
    for spec in _registered_specs():
        if spec.hf_adapter is not None and spec.adapter().model_type == model_type:
            if spec.name == spec.adapter().family:
                return spec
    return None
