"""Parallel degrees and the one device mesh every rank-aware piece uses.

The mesh has three named dims, outermost first: ``dp_replicate`` (DDP / the replicate dim of
HSDP), ``dp_shard`` (FSDP2 sharding) and ``tp`` (tensor parallel), with a flattened ``dp``
(= dp_replicate x dp_shard) for the data loader, loss and token-count reductions. A rank's
data-parallel coordinate is its index in ``dp``; ranks of one tp group read the same data.
With ``pp > 1`` a ``pp`` dim (pipeline stages) comes first, outermost as in torchtitan: the
ranks of one pipeline read the same data too.

Expert parallelism (``ep > 1``) borrows its ranks from ``dp_shard``, as torchtitan's
``expert_parallel_degree`` does (torchtitan: ``dp_shard x cp x tp = efsdp x ep``, where ``ep``
may also take tp ranks when experts are not tensor-parallel; llmforge has no cp and computes the
experts whole on each tp rank, so here ``dp_shard = efsdp x ep``, ``ep`` divides ``dp_shard``
and the tp ranks hold the same experts): ``dp_shard`` is split into an outer ``efsdp``
(``dp_shard / ep``: the FSDP2 group of the expert weights) and an inner ``ep`` (the ranks that
share out the experts and exchange tokens), and ``dp_shard`` and ``dp`` become flattened dims
over them, so data placement and the non-expert FSDP2 group do not change with ``ep``.

Context parallelism (``cp > 1``) adds a ``cp`` dim between ``dp_shard`` and ``tp`` (torchtitan's
order): the cp ranks of one data-parallel rank read the same rows and each holds a slice of
every sequence. FSDP2 shards over the flattened ``dp_shard_cp`` (= dp_shard x cp), and the
loss and target counts of the slices are summed over the flattened ``dp_cp`` (= dp x cp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmforge.config.validate import data_parallel_size
from llmforge.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees: ``pp * dp_replicate * dp_shard * cp * tp == world_size``; ``ep`` divides
    ``dp_shard`` (expert parallelism borrows data-parallel shard ranks)."""

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    pp: int = 1
    ep: int = 1
    cp: int = 1

    @property
    def efsdp(self) -> int:
        """The FSDP2 degree of the expert weights: ``dp_shard / ep``."""
        return self.dp_shard // self.ep

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @classmethod
    def from_config(cls, cfg: Any, world_size: int) -> "ParallelDims":
        """Resolve ``strategy:`` for ``world_size`` (``dp_shard=-1`` takes the rest).

        Raises:
            ConfigError: the degrees do not multiply to the world size (see
                :func:`llmforge.config.batch_plan.data_parallel_size`), or ``strategy.ep`` is not a
                positive divisor of ``dp_shard`` (the message lists the valid values).
        """
        dp = data_parallel_size(cfg, world_size)
        s = cfg.strategy
        name = s.name
        rep, tp, pp = int(s.dp_replicate), int(s.tp), int(s.get("pp", 1))
        if name == "ddp" and world_size > 1 and s.dp_shard in (-1, 1) and rep == 1:
            rep = dp  # plain DDP: every data-parallel rank is a replica
        shard = dp // rep
        return cls(dp_replicate=rep, dp_shard=shard, tp=tp, world_size=world_size, pp=pp,
                   ep=_expert_degree(s, shard, tp), cp=int(s.get("cp", 1)))


def _expert_degree(s: Any, dp_shard: int, tp: int) -> int:
    """``strategy.ep`` checked: it divides ``dp_shard`` (the ranks it borrows; module docs)."""
    ep = getattr(s, "ep", 1)
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or dp_shard % ep:
        ok = [d for d in range(1, dp_shard + 1) if dp_shard % d == 0]
        raise ConfigError(f"strategy.ep={ep!r} must divide strategy.dp_shard ({dp_shard}): expert "
                          f"parallelism borrows those ranks (not tp's: strategy.tp={tp} computes "
                          f"the experts whole on each tp rank); use one of {ok}")
    return ep


def build_mesh(dims: ParallelDims, device_type: str) -> Any:
    """``init_device_mesh`` with dims (dp_replicate, dp_shard, tp), preceded by ``pp`` when
    ``dims.pp > 1``, and a flattened ``dp``; with ``ep > 1`` dims (dp_replicate, efsdp, ep, tp)
    and flattened ``dp_shard`` (efsdp x ep) and ``dp``; with ``cp > 1`` dims (dp_replicate,
    dp_shard, cp, tp) and flattened ``dp``, ``dp_shard_cp`` and ``dp_cp``.

    Needs an initialized process group (every rank calls it).
    """
    from torch.distributed.device_mesh import init_device_mesh

    pp = (dims.pp,) if dims.pp > 1 else ()
    pp_name = ("pp",) * len(pp)
    if dims.ep > 1:
        mesh = init_device_mesh(device_type, (*pp, dims.dp_replicate, dims.efsdp, dims.ep, dims.tp),
                                mesh_dim_names=(*pp_name, "dp_replicate", "efsdp", "ep", "tp"))
        mesh["efsdp", "ep"]._flatten("dp_shard")
        mesh["dp_replicate", "efsdp", "ep"]._flatten("dp")
        return mesh
    if dims.cp > 1:
        mesh = init_device_mesh(device_type, (*pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp),
                                mesh_dim_names=(*pp_name, "dp_replicate", "dp_shard", "cp", "tp"))
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        return mesh
    mesh = init_device_mesh(device_type, (*pp, dims.dp_replicate, dims.dp_shard, dims.tp),
                            mesh_dim_names=(*pp_name, "dp_replicate", "dp_shard", "tp"))
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh


def dp_coordinates(mesh: Any) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` of this rank; ``(0, 1)`` without a mesh."""
    if mesh is None:
        return 0, 1
    dp = mesh["dp"]
    return dp.get_local_rank(), dp.size()


def mesh_dims(mesh: Any) -> "ParallelDims":
    """The :class:`ParallelDims` of a built ``mesh`` (all ones for ``None``, one process)."""
    if mesh is None:
        return ParallelDims(1, 1, 1, 1)
    sizes = [mesh[d].size() for d in ("dp_replicate", "dp_shard", "tp")]
    pp = pp_size(mesh)
    names = mesh.mesh_dim_names or ()
    ep = mesh["ep"].size() if "ep" in names else 1
    cp = mesh["cp"].size() if "cp" in names else 1
    return ParallelDims(*sizes, world_size=sizes[0] * sizes[1] * sizes[2] * pp * cp, pp=pp, ep=ep,
                        cp=cp)


def cp_size(mesh: Any) -> int:
    """The context-parallel degree of ``mesh`` (1 without a mesh or without a ``cp`` dim)."""
    if mesh is None or "cp" not in (mesh.mesh_dim_names or ()):
        return 1
    return mesh["cp"].size()


def pp_size(mesh: Any) -> int:
    """The pipeline degree of ``mesh`` (1 without a mesh or without a ``pp`` dim)."""
    if mesh is None or "pp" not in (mesh.mesh_dim_names or ()):
        return 1
    return mesh["pp"].size()
