"""The planner's search space: the world sizes it takes, the tensor-parallel degrees a model
and a node allow, and every layout of a GPU count (step 1 of :mod:`llmforge.planning.planner`),
with the candidates the search drops and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from llmforge.errors import ConfigError
from llmforge.models.spec import get_spec
from llmforge.planning.context import cp_degrees, cp_of
from llmforge.planning.experts import ExpertShape, ep_degrees
from llmforge.planning.layout import AC_MODES, Layout
from llmforge.planning.stages import pp_allowed
from llmforge.plugin import meta_model

MAX_GPUS = 131_072
"""The most GPUs the planner takes (2**17, above the largest clusters built so far, about
100,000 GPUs): the simulation's fake process group and meshes grow with the world size."""


def check_gpus(world: int, what: str = "--gpus") -> None:
    """Refuse a world size outside ``1..MAX_GPUS`` at once, before any config is read.

    Raises:
        ConfigError: names ``what`` and the value, and the range that works.
    """
    if not 1 <= world <= MAX_GPUS:
        raise ConfigError(f"{what} {world}: the planner takes 1 to {MAX_GPUS:,} GPUs (above the largest "
                          f"clusters built); pass a GPU count in that range")


@dataclass
class Candidate:
    """A layout and the planner's verdict. Times in seconds, memory in bytes."""

    layout: Layout
    status: str = "fits"  # chosen | fits | does not fit | does not divide | refused | not measured | slower
    reason: str = ""
    peak_bytes: Optional[float] = None
    step_seconds: Optional[float] = None
    tokens_per_second_per_gpu: Optional[float] = None
    mfu: Optional[float] = None
    simulated: bool = False
    terms: Optional[dict[str, float]] = None  # seconds per step by term (calibrated model)
    traffic: float = 0.0  # FSDP / CP / HSDP seconds before overlap: the tie-break

    def as_dict(self) -> dict[str, Any]:
        lo = self.layout
        return {"dp_replicate": lo.dp_replicate, "dp_shard": lo.dp_shard, "tp": lo.tp, "pp": lo.pp,
                "ep": lo.ep, "cp": lo.cp,
                "activation_checkpointing": lo.activation_checkpointing,
                "micro_batch_size": lo.micro_batch_size, "fits": self.status in ("chosen", "fits", "slower"),
                "peak_bytes_per_rank": self.peak_bytes, "step_seconds": self.step_seconds,
                "tokens_per_second_per_gpu": self.tokens_per_second_per_gpu, "mfu": self.mfu,
                "simulated": self.simulated, "status": self.status, "reason": self.reason,
                "terms_seconds": self.terms}



def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in ascending order, in O(sqrt(n)) steps (``--gpus 2**31``: 46,341)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def tp_degrees(cfg: Any, world: int, gpus_per_node: int) -> tuple[list[int], dict[int, str]]:
    """Tensor-parallel degrees that divide both the node and the world and that the model
    allows; the refused ones with the reason (from the family's ``check_tp``)."""
    spec = get_spec(cfg.model.name)
    model = meta_model(cfg)
    ok, refused = [], {}
    for tp in _divisors(math.gcd(world, gpus_per_node)):
        check = spec.get("check_tp") if tp > 1 else None
        try:
            if tp > 1 and spec.tp_plan is None:
                raise ConfigError(f"model '{cfg.model.name}' has no tensor-parallel plan")
            if check is not None:
                check(model, tp)
        except ConfigError as exc:
            refused[tp] = str(exc)
            continue
        ok.append(tp)
    return ok, refused


def enumerate_layouts(cfg: Any, world: int, gpus_per_node: int,
                      experts: Optional[ExpertShape] = None,
                      search_cp: bool = False) -> tuple[list[Layout], list[Candidate]]:
    """Every layout of ``world`` GPUs (with ``experts``: every ``ep`` too; pipeline degrees
    ``pp`` that the model's blocks, the schedule and the micro-batches allow, none with tied
    embeddings; with ``search_cp``, every ``cp`` of :func:`llmforge.planning.context.cp_degrees`
    without pipeline stages), and the dropped ones (status ``does not divide``).

    Raises:
        ConfigError: no tensor-parallel degree divides the model and the node (names the key
            and the nearest world sizes that work).
    """
    gbs = int(cfg.trainer.global_batch_size)
    tps, refused = tp_degrees(cfg, world, gpus_per_node)
    model = meta_model(cfg)
    n_blocks = len(get_spec(cfg.model.name).model_blocks(model))
    tied = bool(getattr(getattr(model, "args", None), "tie_embeddings", False))
    seq, mode = int(cfg.trainer.seq_len), cp_of(cfg)[1]
    heads = int(getattr(getattr(model, "args", None), "n_heads", 1))
    out, dropped = [], []
    for tp, pp in ((tp, pp) for tp in tps for pp in (_divisors(world // tp) if not tied else [1])):
        for cp in cp_degrees(seq, world // tp, heads // tp, mode) if search_cp and pp == 1 else [1]:
            dp = world // (tp * pp * cp)
            if gbs % dp:
                if pp == 1 and cp == 1:
                    dropped.append(Candidate(Layout(1, dp, tp, "none", 1), "does not divide",
                                             f"trainer.global_batch_size={gbs} is not a multiple of dp={dp}"
                                             f"{' without pipeline stages' if n_blocks > 1 and not tied else ''}"))
                continue
            mbs_ok = [mbs for mbs in _divisors(gbs // dp)
                      if pp == 1 or pp_allowed(cfg, pp, n_blocks, gbs // dp, mbs, world) is None]
            for rep in _divisors(dp):
                for ep in ep_degrees(experts, dp // rep):
                    for ac in AC_MODES:
                        for mbs in mbs_ok:
                            out.append(Layout(rep, dp // rep, tp, ac, mbs, pp=pp, ep=ep, cp=cp))
    for tp, why in refused.items():
        dropped.append(Candidate(Layout(1, world // tp if world % tp == 0 else 1, tp, "none", 1),
                                 "does not divide", why))
    if not out:
        near = [n for n in range(max(1, world - 64), world + 65) if n != world
                and any(gbs % (n // tp) == 0 for tp in _divisors(math.gcd(n, gpus_per_node)) if tp in tps or tp == 1)]
        nearest = sorted(near, key=lambda n: abs(n - world))[:2]
        why = "".join(f"; tp={tp} refused: {r}" for tp, r in refused.items())
        hint = (f"nearest GPU counts that do: {', '.join(map(str, sorted(nearest)))}" if nearest else
                f"no GPU count within 64 of {world} does: raise trainer.global_batch_size to a "
                f"multiple of the data-parallel size (e.g. {world})")
        raise ConfigError(f"--gpus {world}: no layout divides trainer.global_batch_size={gbs} "
                          f"(tp within a node of {gpus_per_node}: {tps or 'none allowed'}{why}); {hint}")
    return out, dropped
