"""A planned layout written as settings: the nested mapping, the dotlist overrides that
``strategy.name: auto`` adds to a launched job, and the YAML ``llmforge plan`` prints.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from llmforge.planning.planner import Candidate
from llmforge.planning.layout import AC_ENTRIES


def layout_settings(cand: Candidate, algorithms: list[dict]) -> dict[str, Any]:
    """The settings that give the layout of ``cand``, as a nested mapping of config keys:
    ``strategy`` (``fsdp2`` and the degrees, ``pp`` included; ``ep`` and ``cp`` when above 1), ``trainer.micro_batch_size`` and the
    ``algorithms`` list with its activation checkpointing entry replaced (the other entries,
    ``compile`` included, as they were). The one source of :func:`layout_overrides` and
    :func:`winner_yaml`."""
    lo = cand.layout
    algos = [a for a in algorithms if a.get("name") != "activation_checkpointing"]
    if lo.activation_checkpointing != "none":
        algos.append(AC_ENTRIES[lo.activation_checkpointing])
    return {"strategy": {"name": "fsdp2", "dp_replicate": lo.dp_replicate, "dp_shard": lo.dp_shard,
                         "tp": lo.tp, "pp": lo.pp, **({"ep": lo.ep} if lo.ep > 1 else {}),
                         **({"cp": lo.cp} if lo.cp > 1 else {})},
            "trainer": {"micro_batch_size": lo.micro_batch_size},
            "algorithms": algos}


def _flow(v: Any) -> str:
    """One YAML flow value (omegaconf's dotlist parses it as YAML)."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_flow(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_flow(x) for x in v) + "]"
    if v is None:
        return "null"
    return str(v).lower() if isinstance(v, bool) else str(v)


def layout_overrides(cand: Candidate, algorithms: list[dict]) -> list[str]:
    """:func:`layout_settings` as dotlist overrides (``strategy.name=fsdp2``, ...,
    ``algorithms=[...]``): what ``strategy.name: auto`` adds to a launched job."""
    settings = layout_settings(cand, algorithms)
    algos = settings.pop("algorithms")
    return [f"{section}.{key}={_flow(v)}" for section, values in settings.items()
            for key, v in values.items()] + [f"algorithms={_flow(algos)}"]


def winner_yaml(cand: Candidate, algorithms: list[dict]) -> str:
    """:func:`layout_settings` as YAML, to paste into the run's config."""
    return OmegaConf.to_yaml(layout_settings(cand, algorithms)).rstrip("\n")
