"""The loop of an LLM Foundry YAML: duration, batch arithmetic, optimizer, schedule, precision,
``fsdp_config`` and ``algorithms``.

Composer's schedulers (``composer.optim.scheduler``) are evaluated at the batch count ``b``
before step ``b`` runs; their ``*_with_warmup`` forms warm up as ``b / t_warmup`` and then decay
over ``(b - t_warmup) / (t_max - t_warmup)``: llmforge's schedules with
``scheduler.warmup_from_zero: true`` are the same numbers (:mod:`llmforge.training.schedule`).
"""

from __future__ import annotations

from typing import Any

from llmforge.config.foundry.context import Clock, Conversion
from llmforge.errors import ConfigError

SCHEDULERS = {"cosine_with_warmup": "cosine", "linear_decay_with_warmup": "linear",
              "constant_with_warmup": "constant"}
"""Foundry scheduler names -> ``scheduler.name``."""
# (lr, betas, eps, weight_decay) defaults of each optimizer class, used where the YAML omits them
_OPT_DEFAULTS = {"decoupled_adamw": (1e-3, [0.9, 0.95], 1e-8, 1e-5),  # composer.optim.DecoupledAdamW
                 "adamw": (1e-3, [0.9, 0.999], 1e-8, 1e-2),  # torch.optim.AdamW
                 "decoupled_lionw": (1e-4, [0.9, 0.99], None, 0.0)}  # llmforge/composer DecoupledLionW


def _positive_int(value: Any, key: str, what: str = "") -> int:
    """``value`` when it is an integer >= 1 (not a bool).

    Raises:
        ConfigError: names ``key``."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ConfigError(f"{key}: must be a positive integer{what}; got {value!r}")


def batch_and_duration(c: Conversion, steps_per_epoch: Any) -> Clock:
    """``global_train_batch_size``, ``device_train_microbatch_size``, ``max_seq_len`` and
    ``max_duration``; returns the :class:`Clock` the later time strings use."""
    global_batch = _positive_int(c.take("global_train_batch_size"), "global_train_batch_size")
    c.map("global_train_batch_size", "trainer.global_batch_size", global_batch)
    micro = c.take("device_train_microbatch_size", global_batch)
    if micro == "auto":
        c.map("device_train_microbatch_size", "trainer.micro_batch_size", 1,
              "Composer's auto microbatching searches the largest micro-batch that fits by catching "
              "out-of-memory errors; llmforge does not search: 1 is safe, `llmforge plan CONFIG --gpus "
              "N` or `llmforge train CONFIG --dry-run` size it")
    else:
        c.map("device_train_microbatch_size", "trainer.micro_batch_size",
              _positive_int(micro, "device_train_microbatch_size", " or auto"))
    if c.has("device_train_grad_accum"):
        c.drop("device_train_grad_accum", "llmforge derives accumulation from the batch sizes",
               "trainer.micro_batch_size")
    given = [v for v in (c.take("train_loader.dataset.max_seq_len"), c.take("max_seq_len"),
                         c.peek("model.max_seq_len")) if v is not None]
    seq_len = _positive_int(given[0] if given else 2048, "max_seq_len", " (tokens)")
    c.used.add("max_seq_len")
    c.map("max_seq_len", "trainer.seq_len", seq_len)
    spe = int(steps_per_epoch) if steps_per_epoch else None
    clock = Clock(global_batch, seq_len, steps_per_epoch=spe)
    steps, how = clock.steps(c.take("max_duration", "1ep"), "max_duration")
    c.map("max_duration", "trainer.max_steps", steps, how)
    clock.max_steps = steps
    return clock


def convert_optimizer(c: Conversion) -> None:
    """``optimizer:``. Composer's decoupled weight decay multiplies the weights by
    ``1 - wd * lr_t / lr_0`` each step (``DecoupledAdamW.adamw``: ``decay_factor = lr /
    initial_lr``); torch's AdamW (llmforge's) by ``1 - lr_t * wd``: the same when
    ``wd_llmforge = wd_composer / lr_0``."""
    name = c.take("optimizer.name", "decoupled_adamw")
    if name not in _OPT_DEFAULTS:
        c.drop("optimizer.name", f"'{name}' is not an optimizer llmforge has", "optimizer.name: adamw")
        name = "adamw"
    lr0, betas0, eps0, wd0 = _OPT_DEFAULTS[name]
    lr = float(c.take("optimizer.lr", lr0))
    c.set("optimizer.name", "adamw")
    if name == "decoupled_lionw":
        c.change("optimizer.name", "optimizer.name: adamw", "llmforge has no Lion: AdamW replaces it "
                 "(sign updates become Adam's; Lion's lr is usually 3-10x below AdamW's: raise "
                 "optimizer.lr after a short sweep)")
        c.todo.append("optimizer: Lion became AdamW; re-tune optimizer.lr")
    else:
        c.mapped.append(("optimizer.name", "optimizer.name: adamw", ""))
    c.map("optimizer.lr", "optimizer.lr", lr)
    c.map("optimizer.betas", "optimizer.betas", [float(b) for b in c.take("optimizer.betas", betas0)])
    if name == "decoupled_lionw":
        c.set("optimizer.eps", 1e-8)
    else:
        c.map("optimizer.eps", "optimizer.eps", float(c.take("optimizer.eps", eps0)))
    wd = float(c.take("optimizer.weight_decay", wd0))
    scope = ("; Composer decays every parameter, llmforge only the 2-D weights (not norms, biases, "
             "embeddings' 1-D parameters)")
    if name.startswith("decoupled_") and wd:
        c.map("optimizer.weight_decay", "optimizer.weight_decay", wd / lr,
              f"Composer's decoupled decay {wd:g} is not multiplied by lr; torch's AdamW multiplies "
              f"by lr, so {wd:g} / lr {lr:g} = {wd / lr:g} gives the same decay at every step" + scope)
    else:
        c.map("optimizer.weight_decay", "optimizer.weight_decay", wd, scope.lstrip("; ") if wd else "")
    for key in c.peek("optimizer", {}) or {}:
        if not c.touched(f"optimizer.{key}"):
            c.drop(f"optimizer.{key}", "not a setting of llmforge's AdamW",
                   "optimizer.* (docs/optimizers.md)")


def convert_scheduler(c: Conversion, clock: Clock) -> None:
    """``scheduler:`` (see the module docstring for why the numbers agree)."""
    if not c.has("scheduler"):
        c.set("scheduler.name", "constant")
        c.set("scheduler.warmup_steps", 0)
        c.changed.append(("scheduler", "scheduler.name: constant, warmup_steps: 0",
                          "no scheduler in Composer is a constant lr"))
        return
    name = c.take("scheduler.name")
    if name not in SCHEDULERS:
        c.drop("scheduler.name", f"'{name}' has no llmforge schedule",
               "scheduler.name: cosine, linear, wsd or constant")
        name = "cosine_with_warmup"
    else:
        c.map("scheduler.name", "scheduler.name", SCHEDULERS[name])
    warmup, how = clock.steps(c.take("scheduler.t_warmup", "0ba"), "scheduler.t_warmup")
    c.map("scheduler.t_warmup", "scheduler.warmup_steps", warmup, how)
    c.set("scheduler.warmup_from_zero", True)
    if name != "constant_with_warmup":
        c.map("scheduler.alpha_f", "scheduler.min_lr_ratio", float(c.take("scheduler.alpha_f", 0.0)))
    else:
        alpha = float(c.take("scheduler.alpha", 1.0))
        if alpha != 1.0:
            lr = c.out["optimizer"]["lr"] * alpha
            c.map("scheduler.alpha", "optimizer.lr", lr, f"the constant factor {alpha:g} is folded into the lr")
    if c.has("scheduler.t_max"):
        t_max, _ = clock.steps(c.take("scheduler.t_max"), "scheduler.t_max")
        if t_max != clock.max_steps:
            c.drop("scheduler.t_max", f"the schedule ends at step {t_max}, not at max_duration; "
                   "llmforge's schedules end at trainer.max_steps", "trainer.max_steps")
    if float(c.take("scheduler.alpha_i", 1.0)) != 1.0:
        c.drop("scheduler.alpha_i", "llmforge's linear decay starts at the peak lr", "optimizer.lr")
    if c.take("scheduler.scale_warmup", False):
        c.drop("scheduler.scale_warmup", "only scale-schedule-ratio runs use it", "none")


_PRECISION = {"amp_bf16": "bf16-mixed", "fp32": "fp32", "amp_fp8": "bf16-mixed", "amp_fp16": "bf16-mixed"}


def convert_precision(c: Conversion) -> None:
    """``precision`` (``amp_fp8``: bf16 autocast plus torchao float8 linears)."""
    precision = c.take("precision", "fp32")
    value = _PRECISION.get(precision)
    if value is None:
        c.drop("precision", f"'{precision}' is not a Composer precision llmforge knows", "trainer.precision")
        return
    note = {"amp_fp8": "Composer's amp_fp8 runs TransformerEngine's FP8 layers; llmforge adds the "
                       "float8 algorithm (torchao, tensorwise scaling) over bf16 autocast",
            "amp_fp16": "llmforge has no fp16 autocast; bf16 has fp32's range and needs no loss scaling"}
    c.map("precision", "trainer.precision", value, note.get(precision, ""))
    if precision == "amp_fp8":
        c.out.setdefault("algorithms", []).append({"name": "float8"})


def convert_fsdp(c: Conversion, precision: str) -> None:
    """``fsdp_config`` -> ``strategy:`` (FSDP2) and activation checkpointing."""
    if not c.has("fsdp_config"):
        return
    cfg = c.peek("fsdp_config") or {}
    sharding = c.take("fsdp_config.sharding_strategy", "FULL_SHARD")
    sharding = sharding.upper() if isinstance(sharding, str) else sharding  # Composer: case-blind
    known = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "NO_SHARD")
    if sharding not in known:
        raise ConfigError(f"fsdp_config.sharding_strategy: {sharding!r} is not one of FSDP's "
                          f"{', '.join(known)}")
    if sharding == "NO_SHARD":
        c.map("fsdp_config.sharding_strategy", "strategy.name", "ddp")
    else:
        c.set("strategy.name", "fsdp2")
        zero3 = sharding in ("FULL_SHARD", "HYBRID_SHARD")
        c.map("fsdp_config.sharding_strategy", "strategy.reshard_after_forward", zero3,
              "" if "HYBRID" not in sharding else "hybrid sharding: set strategy.dp_replicate to the "
              "node count (HSDP); the converter does not know the world size")
    dtype = "bfloat16"
    mp = c.take("fsdp_config.mixed_precision", "DEFAULT")
    if precision != "fp32" and mp in ("PURE", "DEFAULT", "FULL"):
        param, reduce = {"PURE": (dtype, dtype), "DEFAULT": (dtype, "float32"),
                         "FULL": ("float32", "float32")}[mp]
        c.set("strategy.mixed_precision.param_dtype", param)
        c.map("fsdp_config.mixed_precision", "strategy.mixed_precision.reduce_dtype", reduce)
    elif precision == "fp32":
        c.drop("fsdp_config.mixed_precision", "the run is fp32 (precision), so parameters and "
               "reductions stay fp32", "strategy.mixed_precision with trainer.precision bf16-mixed")
    else:
        c.drop("fsdp_config.mixed_precision", "a per-dtype mapping", "strategy.mixed_precision.param_dtype/reduce_dtype")
    if c.take("fsdp_config.activation_checkpointing", False):
        c.out.setdefault("algorithms", []).append({"name": "activation_checkpointing", "mode": "full"})
        c.changed.append(("fsdp_config.activation_checkpointing", "algorithms: activation_checkpointing "
                          "(mode full)", "every block is checkpointed"))
    if c.has("fsdp_config.cpu_offload"):
        c.map("fsdp_config.cpu_offload", "strategy.cpu_offload", bool(c.take("fsdp_config.cpu_offload")))
    for key in ("data_parallel_shard_degree", "data_parallel_replicate_degree"):
        if c.has(f"fsdp_config.{key}"):
            value = c.take(f"fsdp_config.{key}")
            c.map(f"fsdp_config.{key}", "strategy.dp_shard" if "shard" in key else "strategy.dp_replicate", value)
    for key in cfg:
        if not c.touched(f"fsdp_config.{key}"):
            c.drop(f"fsdp_config.{key}", "an FSDP1 setting; FSDP2 (per-parameter sharding) has no "
                   "such knob or does it always", "strategy.* (docs/parallelism.md)")


def convert_algorithms(c: Conversion) -> None:
    """``algorithms:`` (a mapping of name -> kwargs). Composer clips no gradients unless the
    ``gradient_clipping`` algorithm is listed, so llmforge's default clip is turned off."""
    algos = c.peek("algorithms") or {}
    if not isinstance(algos, dict):
        c.drop("algorithms", "expected LLM Foundry's mapping of algorithm name -> kwargs", "algorithms:")
        algos = {}
    clip = algos.get("gradient_clipping") if isinstance(algos, dict) else None
    if clip is None:
        c.set("trainer.gradient_clip_val", None)
        c.changed.append(("algorithms", "trainer.gradient_clip_val: null", "no gradient_clipping: "
                          "Composer does not clip (llmforge's default would clip at 1.0)"))
    for name, kwargs in (algos.items() if isinstance(algos, dict) else []):
        key, kwargs = f"algorithms.{name}", kwargs or {}
        if name == "gradient_clipping":
            kind = kwargs.get("clipping_type", "norm")
            if kind == "norm":
                c.map(key, "trainer.gradient_clip_val", float(kwargs.get("clipping_threshold", 1.0)))
            else:
                c.set("trainer.gradient_clip_val", None)
                c.drop(key, f"clipping_type {kind}: llmforge clips the global L2 norm only",
                       "trainer.gradient_clip_val")
        elif name in ("low_precision_layernorm", "fused_layernorm", "low_precision_groupnorm"):
            c.drop(key, "llmforge's models use RMSNorm, computed in the parameters' dtype", "none needed")
        elif name == "alibi":
            c.drop(key, "llmforge's models use RoPE; ALiBi is not available", "model.rope_theta")
        elif name == "gated_linear_units":
            c.change(key, "SwiGLU MLP", "llmforge's Llama MLP is gated (SwiGLU) already")
        elif name == "ema":
            c.out.setdefault("algorithms", []).append({"name": "ema"})
            c.change(key, "algorithms: [{name: ema}]", "Composer's half_life becomes ema.decay "
                     "(default 0.999); set it as 0.5 ** (1 / half_life_in_steps)")
        elif name == "seq_length_warmup":
            c.out.setdefault("algorithms", []).append({"name": "seq_length_warmup"})
            c.change(key, "algorithms: [{name: seq_length_warmup}]", "duration/min_seq_len are "
                     "llmforge's (steps); check them against Composer's")
        else:
            c.drop(key, f"no llmforge algorithm '{name}'", "`llmforge algorithms` lists them; "
                   "docs/migrating_from_composer.md ports one")
