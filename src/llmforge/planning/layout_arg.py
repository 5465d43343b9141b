"""``llmforge plan CONFIG --gpus N --layout dp_shard=8,tp=8,pp=8[,dp_replicate=..,cp=..,ep=..,ac=..,mbs=..]``:
one given layout predicted by the calibrated step-time model (memory per rank, tokens/s per
GPU, MFU, the term that limits it), no simulation: an answer in a second to "how fast would my
own layout be?".
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Callable, Optional

import torch
from omegaconf import OmegaConf

from llmforge import registry
from llmforge.algorithms.loading import check_listed_once
from llmforge.config.validate import check_entries, check_parallel_keys, packed_sft
from llmforge.errors import ConfigError
from llmforge.models.memory_estimate import ac_mode
from llmforge.models.spec import get_spec
from llmforge.parallel.pipeline import rank_stages
from llmforge.planning.calibration import comparison_error, model_error
from llmforge.planning.context import check_cp, cp_of
from llmforge.planning.gpus import GPUKind
from llmforge.planning.layout import AC_MODES
from llmforge.planning.published import published_layout, unmeasured_degrees
from llmforge.planning.setting import Setting, Shape
from llmforge.planning.search import tp_degrees
from llmforge.planning.stages import pp_allowed
from llmforge.planning.step_model import fp8_share
from llmforge.planning.whatif import FIT_SHARE, assess, best_layout, versus
from llmforge.plugin import Algorithm, meta_model
from llmforge.registry import build_entries

KEYS = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "ac", "mbs")
"""Keys ``--layout`` takes; degrees left out are 1, ``ac`` and ``mbs`` the config's."""


def parse_layout(text: str) -> dict[str, Any]:
    """``key=value,...`` of :data:`KEYS` as a dict (degrees and ``mbs`` as ints).

    Raises:
        ConfigError: no key at all, an unknown or repeated key, a missing ``=``, a value that
            is not a positive integer, or ``ac`` not none / selective / full (each names the key).
    """
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if key not in KEYS:
            raise ConfigError(f"--layout: unknown key '{key}'; known: {', '.join(KEYS)}")
        if key in out:
            raise ConfigError(f"--layout: {key} is given twice ({key}={out[key]} and {part}); "
                              "give it once")
        if not eq:
            raise ConfigError(f"--layout: '{part}' has no value; write {key}=VALUE")
        if key == "ac":
            if value not in AC_MODES:
                raise ConfigError(f"--layout ac={value}: expected none, selective or full")
            out[key] = value
            continue
        if not (value.isascii() and value.isdigit()) or int(value) < 1:  # "²".isdigit() too
            raise ConfigError(f"--layout {key}={value}: expected a positive integer")
        out[key] = int(value)
    if not out:
        raise ConfigError(f"--layout {text!r} names no degree; e.g. --layout dp_shard=8,tp=8 (or "
                          "leave --layout out to plan)")
    return out


def _precision(cfg: Any, algos: list[Algorithm], model: Any) -> tuple[str, bool, bool, bool, Optional[float]]:
    """``(precision, FSDP's fp8 all-gather, TP's fp8 all-gather, compiled, fp8_share)`` of
    ``algos``, the config's algorithms as the run builds them (:func:`built_algorithms`: aliases
    resolved, an import path included), on ``model`` (meta): float8 counts only if it converts a
    layer of its blocks, and then only on the layers it converts (``fp8_share``: their weights'
    share of all Linear weights, the share of the linear FLOPs); its TP all-gathers are float8
    only if it keeps no block layer in high precision (an input a kept layer reads is gathered
    in bf16; the output layer is no block's)."""
    prec, gather, tp_gather, compiled, share = "bf16", False, False, False, None
    linear = {fqn: m.weight.numel() for fqn, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    ids = {id(b) for b in get_spec(cfg.model.name).model_blocks(model)}
    blocks = {name for name, m in model.named_modules() if id(m) in ids}
    for a in algos:
        name = getattr(a, "name", None)
        compiled = compiled or name == "compile"
        if name != "float8":
            continue
        a.check_model(model)  # a filter entry that names no module exits 2, as in training
        converted, kept = a.plan(model)
        if any(c.startswith(b + ".") for c in converted for b in blocks):  # the output alone: no speed-up
            prec = "fp8_tensorwise" if a.recipe == "tensorwise" else "fp8_rowwise"
            gather = a.all_gather
            tp_gather = a.tp_gather and not any(k.startswith(b + ".") for k in kept for b in blocks)
            share = sum(linear[c] for c in converted) / sum(linear.values())
    return prec, gather, tp_gather, compiled, share


def check_float8(algos: list[Algorithm], gpu: GPUKind) -> None:
    """Refuse a float8 recipe among ``algos`` (:func:`built_algorithms`) on a GPU kind without
    float8 units (``fp8_flops`` 0: torchao's float8 matmuls need them), instead of crediting it a
    speed-up it cannot have.

    Raises:
        ConfigError: names the GPU kind and the ``float8`` algorithm.
    """
    if any(getattr(a, "name", None) == "float8" for a in algos) and not gpu.fp8_flops:
        raise ConfigError(f"algorithms: float8 needs float8 tensor cores, which {gpu.name} lacks; "
                          "remove the float8 algorithm or plan another --gpu")


def base_setting(cfg: Any, world: int, gpu: GPUKind, algos: Optional[list[Algorithm]] = None) -> Setting:
    """``cfg``'s model shape and recipe (batch, sequence, precision, compile, pipeline
    schedule, activation checkpointing) on ``world`` GPUs of ``gpu``, all ranks ``dp_shard``;
    ``algos``: ``cfg``'s algorithms already built (default: :func:`built_algorithms`).

    Raises:
        ConfigError: a model with experts (the calibrated model covers dense decoders), a recipe
            :class:`Setting` refuses (a count below 1, an unknown schedule), what
            :func:`built_algorithms` refuses.
    """
    spec = get_spec(cfg.model.name)
    model = meta_model(cfg)
    if spec.expert_modules(model):
        raise ConfigError(f"--layout: model '{cfg.model.name}' has experts; the calibrated step-time "
                          "model covers dense decoders only (run llmforge plan without --layout)")
    m = spec.get("memory_shape")(model)
    a = model.args
    mode, _ = ac_mode(cfg.algorithms)
    prec, gather, tp_gather, compiled, share = _precision(cfg, built_algorithms(cfg) if algos is None else algos,
                                                          model)
    p = cfg.pipeline
    try:
        shape = Shape(cfg.model.get("preset") or cfg.model.name, m.n_layers, m.dim, m.ffn_dim, a.n_heads,
                      a.n_kv_heads, m.vocab_size, head_size=m.q_dim // a.n_heads,
                      tie_embeddings=bool(getattr(a, "tie_embeddings", False)))
        return Setting(shape, gpu.name, world, world, int(cfg.trainer.global_batch_size),
                       int(cfg.trainer.micro_batch_size), int(cfg.trainer.seq_len),
                       ac=mode if mode in AC_MODES else "selective", precision=prec,
                       fp8_all_gather=gather, fp8_tp_all_gather=tp_gather, fp8_share=share, compile=compiled,
                       schedule=str(p.schedule),
                       stages_per_rank=rank_stages(str(p.schedule), p.stages_per_rank), cp_mode=cp_of(cfg)[1],
                       gpus_per_node=gpu.gpus_per_node)
    except (TypeError, ValueError) as exc:  # a recipe key the config's own checks name better
        raise ConfigError(f"the config's recipe does not describe a run: {exc}") from exc


def built_algorithms(cfg: Any) -> list[Algorithm]:
    """``cfg.algorithms`` built as the run builds them (nothing is allocated): a typo in a name or
    a key (an activation checkpointing mode) would otherwise be planned as no algorithm or as
    another one.

    Raises:
        ConfigError: an entry that is no mapping with a string ``name``
            (:func:`~llmforge.config.validate.check_entries`), what the entries' classes refuse,
            an algorithm listed twice; each names the entry and the key.
    """
    check_entries("algorithms", cfg.algorithms)
    algos = build_entries(registry.algorithms, "algorithms", cfg.algorithms or [], base=Algorithm)
    check_listed_once(cfg, algos)
    return algos


def calibrated_setting(cfg: Any, world: int, gpu: GPUKind,
                       algos: Optional[list[Algorithm]] = None) -> Optional[Setting]:
    """:func:`base_setting` (``algos`` as there), or ``None`` where the calibrated model does
    not apply: experts, an algorithm that replaces the memory estimate (adapters on frozen
    weights: no weight gradients, no optimizer state; ``Algorithm.replaces_memory_estimate``), a
    model without ``args.n_heads``, algorithms the run's own checks refuse."""
    try:
        algos = built_algorithms(cfg) if algos is None else algos
        if any(getattr(a, "replaces_memory_estimate", False) for a in algos):
            return None
        return base_setting(cfg, world, gpu, algos)
    except (ConfigError, AttributeError):
        return None


def at_layout(base: Setting, dp_replicate: int, dp_shard: int, tp: int, pp: int, cp: int, ac: str,
              mbs: int) -> Setting:
    """``base`` with the given degrees, activation checkpointing and micro-batch size (the
    schedule's virtual stages only with ``pp > 1``)."""
    sched = {} if pp > 1 else {"schedule": "1f1b", "stages_per_rank": 1}
    return replace(base, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp, ac=ac,
                   micro_batch_size=mbs, **sched)


def config_setting(cfg: Any, world: int, gpu: GPUKind, layout: dict[str, Any]) -> Setting:
    """The :class:`Setting` of ``cfg`` on ``world`` GPUs of ``gpu`` with ``layout``.

    Raises:
        ConfigError: a model with experts (the calibrated model covers dense decoders), ``ep``
            other than 1, adapters on frozen weights (``Algorithm.replaces_memory_estimate``), a
            product of degrees other than ``world``, ``tp`` that the model family's check (its
            heads, tied embeddings) or the node refuse, ``pp`` with tied embeddings, ``cp`` with
            ``pp`` on packed SFT rows, ``cp`` that does not divide the GPUs or the sequence (in
            ``2 x cp`` chunks; :func:`llmforge.planning.context.check_cp`), ``mbs`` or ``dp`` that
            do not divide the global batch, more stages than blocks, what the pipeline's own checks
            refuse, an unknown pipeline schedule or attention mode, stages per rank below 1
            (:func:`~llmforge.config.validate.check_parallel_keys`), an algorithms entry its
            class refuses (an unknown name or key, an unknown activation checkpointing mode),
            float8 on a GPU kind without it (:func:`check_float8`); each names the key.
    """
    check_parallel_keys(cfg)  # --layout replaces the degrees: only the recipe's keys are checked
    algos = built_algorithms(cfg)
    adapters = [str(e.get("name")) for e, a in zip(cfg.algorithms or [], algos)
                if getattr(a, "replaces_memory_estimate", False)]
    check_float8(algos, gpu)
    if adapters:
        raise ConfigError(f"--layout: algorithms: {', '.join(adapters)} trains adapters on frozen weights; the "
                          "calibrated step-time model covers full training only (run llmforge plan "
                          "without --layout)")
    base = base_setting(cfg, world, gpu, algos)
    sh = base.shape
    if layout.get("ep", 1) != 1:
        raise ConfigError(f"--layout ep={layout['ep']}: model '{cfg.model.name}' has no experts to split")
    d = {k: layout.get(k, 1) for k in ("dp_replicate", "tp", "pp", "cp")}
    tp = d["tp"]
    node = gpu.gpus_per_node
    if tp > 1:  # the node's and the model family's own check, as training runs it
        ok, refused = tp_degrees(cfg, world, node)
        if tp not in ok:
            # tp outside the node's divisors is not among those checked: the family names why first
            why = (f"tensor parallel stays inside a node of {node} GPUs" if tp > node else
                   refused.get(tp) or tp_degrees(cfg, tp, tp)[1].get(tp)
                   or f"tensor parallel takes a divisor of the node's {node} GPUs that divides --gpus {world}")
            raise ConfigError(f"--layout tp={tp}: {why}; tp in {ok} work on {world} GPUs")
    if d["pp"] > 1 and sh.tie_embeddings:
        raise ConfigError(f"--layout pp={d['pp']}: pipeline stages need untied embeddings "
                          "(model.tie_embeddings=false) or pp=1")
    if d["cp"] > 1:
        check_cp(d["cp"], base.seq_len, world, sh.n_heads // tp, base.cp_mode)
        if d["pp"] > 1 and packed_sft(cfg.data):
            raise ConfigError(f"--layout cp={d['cp']},pp={d['pp']}: context parallelism with pipeline "
                              "stages takes rows without documents; set data.packed=false, pp=1 or cp=1")
    if d["pp"] > 1 and d["pp"] * base.stages_per_rank > sh.n_layers:
        raise ConfigError(f"--layout pp={d['pp']}: {d['pp'] * base.stages_per_rank} stages "
                          f"({base.stages_per_rank} per rank, pipeline.stages_per_rank / "
                          f"pipeline.schedule) for the model's {sh.n_layers} blocks")
    rest = d["dp_replicate"] * tp * d["pp"] * d["cp"]
    given = ",".join(f"{k}={layout[k]}" for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp") if k in layout)
    if "dp_shard" not in layout and world % rest:
        raise ConfigError(f"--layout {given}: dp_replicate*tp*pp*cp = {rest} does not divide --gpus {world}")
    dp_shard = layout.get("dp_shard", world // rest)
    if rest * dp_shard != world:
        raise ConfigError(f"--layout {given}: dp_replicate*dp_shard*tp*pp*cp = {rest * dp_shard}, "
                          f"not --gpus {world}")
    gbs, dp = base.global_batch_size, d["dp_replicate"] * dp_shard
    if gbs % dp:
        named = f"dp_replicate={d['dp_replicate']},dp_shard={dp_shard}" if d["dp_replicate"] > 1 else f"dp_shard={dp_shard}"
        raise ConfigError(f"--layout {named}: data-parallel size {dp} does not divide "
                          f"trainer.global_batch_size={gbs}")
    mbs = layout.get("mbs", base.micro_batch_size)
    # the recipe's pipeline keys apply to the layout's stages, as training with strategy.pp set runs
    as_run = OmegaConf.merge(cfg, {"strategy": {"pp": d["pp"]}}) if d["pp"] > 1 else cfg
    m = as_run.pipeline.microbatches if d["pp"] > 1 else None
    if m is not None and isinstance(m, int) and m >= 1 and (gbs // dp) % m == 0:
        if "mbs" in layout and mbs * m != gbs // dp:
            raise ConfigError(f"--layout mbs={mbs}: pipeline.microbatches={m} splits the per-rank batch "
                              f"{gbs // dp} into micro-batches of {gbs // dp // m}; drop mbs= or "
                              "pipeline.microbatches")
        mbs = gbs // dp // m
    if (gbs // dp) % mbs:
        named = f"--layout mbs={mbs}" if "mbs" in layout else (
            f"--layout {given}: mbs={mbs} (the config's trainer.micro_batch_size)")
        raise ConfigError(f"{named}: does not divide the per-rank batch {gbs // dp}; give a "
                          "divisor of it as mbs= in --layout")
    if d["pp"] > 1:  # the pipeline's own checks: the split, the micro-batches the schedule needs
        why = pp_allowed(as_run, d["pp"], sh.n_layers, gbs // dp, mbs, world)
        if why:
            raise ConfigError(f"--layout pp={d['pp']}: {why}")
    return at_layout(base, d["dp_replicate"], dp_shard, tp, d["pp"], d["cp"], layout.get("ac", base.ac), mbs)


def layout_report(s: Setting, gpu: GPUKind, config: str, compare: bool = True,
                  allowed: Optional[Callable[[Setting], bool]] = None) -> dict[str, Any]:
    """The prediction of ``s`` as a dict (what ``--json`` prints); with ``compare``, the best
    layout the analytic search finds among those ``allowed`` accepts (:func:`runnable`) and the
    published recipe for this model and GPU count."""
    v = assess(s)
    pr = v.prediction
    out: dict[str, Any] = {
        "config": config, "gpu": gpu.name, "world_size": s.world,
        "layout": {"dp_replicate": s.dp_replicate, "dp_shard": s.dp_shard, "tp": s.tp, "pp": s.pp, "cp": s.cp,
                   "ac": s.ac, "mbs": s.micro_batch_size},
        "memory_bytes_per_rank": v.memory, "fits": v.fits, "fit_share": FIT_SHARE,
        "tokens_per_second_per_gpu": pr.tokens_per_second_per_gpu, "mfu": pr.mfu,
        "step_seconds": pr.step_seconds, "terms_seconds": pr.terms, "limit": pr.limit,
        "model_error": model_error(), "comparison_error": comparison_error(), "compile": s.compile,
        "precision": s.precision, "fp8_all_gather": s.fp8_all_gather, "fp8_tp_all_gather": s.fp8_tp_all_gather,
        "fp8_share": None if s.precision == "bf16" else fp8_share(s),
        "unmeasured": unmeasured_degrees(s.shape, s.tp, s.pp, s.cp, s.dp_replicate) or None}
    if compare:
        best = best_layout(s, allowed=allowed, node=gpu.gpus_per_node)
        if best is not None:
            same = _text(best.setting) == _text(s)
            out["best"] = {"layout": _text(best.setting), "tokens_per_second_per_gpu":
                           best.prediction.tokens_per_second_per_gpu,
                           "versus": "this layout" if same else versus(best, v), "is_this_layout": same,
                           "unmeasured": unmeasured_degrees(s.shape, best.setting.tp, best.setting.pp,
                                                            best.setting.cp, best.setting.dp_replicate) or None}
        pub = published_layout(s.shape, s.world, s.seq_len)
        if pub is not None:
            out["published"] = {"layout": _text(pub.setting), "measured_tokens_per_second_per_gpu":
                                pub.tokens_per_second_per_gpu, "gpu": pub.setting.gpu, "source": pub.source,
                                "table": pub.table}
    return out


def runnable(cfg: Any, world: int, gpu: GPUKind) -> Callable[[Setting], bool]:
    """Whether ``cfg`` can run a layout the analytic search proposes: a ``tp`` the model family
    allows on ``world`` GPUs of ``gpu``, and stages only with the config's schedule and what the
    pipeline's own checks take (its split, the micro-batches), so that the best layout printed
    is one ``--layout`` and training accept."""
    tps, _ = tp_degrees(cfg, world, gpu.gpus_per_node)
    schedule, v = str(cfg.pipeline.schedule), rank_stages(str(cfg.pipeline.schedule), cfg.pipeline.stages_per_rank)

    def ok(lo: Setting) -> bool:
        if lo.tp not in tps:
            return False
        if lo.pp == 1:
            return True
        local = lo.global_batch_size // (lo.dp_replicate * lo.dp_shard)
        return ((lo.schedule, lo.stages_per_rank) == (schedule, v)
                and not pp_allowed(cfg, lo.pp, lo.shape.n_layers, local, lo.micro_batch_size, world))
    return ok


def _text(s: Setting) -> str:
    parts = [f"dp_shard={s.dp_shard}"] + [f"{k}={getattr(s, k)}" for k in ("dp_replicate", "tp", "pp", "cp")
                                           if getattr(s, k) > 1]
    return ",".join(parts + [f"ac={s.ac}", f"mbs={s.micro_batch_size}"])


def format_report(r: dict[str, Any]) -> str:
    """The text of :func:`layout_report`."""
    gib = 2**30
    mem = r["memory_bytes_per_rank"]
    terms = ", ".join(f"{k} {v:.3g} s" for k, v in r["terms_seconds"].items() if v)
    parts = ", ".join(f"{k.replace('_', ' ')} {v / gib:.1f}" for k, v in mem.items()
                      if k != "total" and (v or k != "unsharded_gradients"))
    lines = [f"layout {_text_of(r['layout'])} of {r['config']} on {r['world_size']} x {r['gpu']} "
             f"(analytic; held-out error {r['model_error']:.1%}, {r['comparison_error']:.1%} for a comparison of "
             f"two layouts, docs/scale.md)",
             f"  memory per rank {mem['total'] / gib:.1f} GiB ({parts}): "
             f"{'fits' if r['fits'] else 'does NOT fit'} in "
             f"{r['fit_share']:.0%} of the GPU",
             f"  precision {r['precision']}" + _precision_detail(r),
             f"  {r['tokens_per_second_per_gpu']:.0f} tokens/s per GPU, MFU {r['mfu']:.1%}, step "
             f"{r['step_seconds']:.3g} s: {terms}; limited by {r['limit']}"]
    if r["unmeasured"]:
        lines.append(f"  its degrees: {r['unmeasured']}")
    if "best" in r and r["best"]["is_this_layout"]:
        lines.append("  best layout found: this one")
    elif "best" in r:
        lines.append(f"  best layout found: {r['best']['layout']} at {r['best']['tokens_per_second_per_gpu']:.0f} "
                     f"tokens/s per GPU ({r['best']['versus']})")
        if r["best"]["unmeasured"]:
            lines.append(f"  its degrees: {r['best']['unmeasured']}")
    if r.get("compile"):
        # the analytic activations are compiled ones (OLMo-core's 7B and 13B runs fit only so);
        # the planner's simulation runs eager and may refuse a layout without AC that fits here
        lines.append("  memory counts torch.compile's recomputed elementwise activations; `llmforge plan` "
                     "without --layout simulates them eager and may refuse a layout without AC that fits here")
    if "published" in r:
        p = r["published"]
        lines.append(f"  published: {p['layout']} measured {p['measured_tokens_per_second_per_gpu']:.0f} "
                     f"tokens/s per GPU on {p['gpu']} ({p['source']}, {p['table']})")
    return "\n".join(lines)


def _precision_detail(r: dict[str, Any]) -> str:
    """float8's share and the gathers it makes float8 on this layout's FSDP and TP; fp32 said."""
    if r["fp8_share"] is None:  # the published runs are bf16 or float8: fp32 has no row of its own
        return (" (trainer.precision fp32 is predicted at bf16's speed)"
                if r.get("trainer_precision") == "fp32" else "")
    lo = r["layout"]
    gathers = [dim for dim, on, used in (("FSDP", r["fp8_all_gather"], lo["dp_shard"] * lo["cp"] > 1),
                                         ("TP", r["fp8_tp_all_gather"], lo["tp"] > 1)) if on and used]
    return (f" on {r['fp8_share']:.1%} of the linear FLOPs"
            + (f", float8 all-gathers on {' and '.join(gathers)}" if gathers else ""))


def _text_of(lo: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in lo.items() if v != 1 or k in ("dp_shard", "mbs"))


def run_layout(cfg: Any, config: str, world: int, gpu: GPUKind, text: str, as_json: bool = False) -> int:
    """Print the prediction of ``--layout text``; returns 0.

    Raises:
        ConfigError: a bad layout (:func:`parse_layout`, :func:`config_setting`).
    """
    s = config_setting(cfg, world, gpu, parse_layout(text))
    r = {**layout_report(s, gpu, config, allowed=runnable(cfg, world, gpu)),
         "trainer_precision": str(cfg.trainer.precision)}
    print(json.dumps(r, indent=1) if as_json else format_report(r))
    return 0
