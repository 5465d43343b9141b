"""Parallel degrees and the one device mesh every rank-aware piece uses.

The mesh has three named dims, outermost first: ``dp_replicate`` (DDP / the replicate dim of
HSDP), ``dp_shard`` (FSDP2 sharding) and ``tp`` (tensor parallel), with a flattened ``dp``
(= dp_replicate x dp_shard) for the data loader, loss and token-count reductions. A rank's
data-parallel coordinate is its index in ``dp``; ranks of one tp group read the same data.
With ``pp > 1`` a ``pp`` dim (pipeline stages) comes first, outermost as in torchtitan: the
ranks of one pipeline read the same data too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmforge.config.validate import data_parallel_size


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees: ``pp * dp_replicate * dp_shard * tp == world_size``."""

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    pp: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @classmethod
    def from_config(cls, cfg: Any, world_size: int) -> "ParallelDims":
        """Resolve ``strategy:`` for ``world_size`` (``dp_shard=-1`` takes the rest).

        Raises:
            ConfigError: the degrees do not multiply to the world size (see
                :func:`llmforge.config.validate.data_parallel_size`).
        """
        dp = data_parallel_size(cfg, world_size)
        s = cfg.strategy
        name = s.name
        rep, tp, pp = int(s.dp_replicate), int(s.tp), int(s.get("pp", 1))
        if name == "ddp" and world_size > 1 and s.dp_shard in (-1, 1) and rep == 1:
            rep = dp  # plain DDP: every data-parallel rank is a replica
        return cls(dp_replicate=rep, dp_shard=dp // rep, tp=tp, world_size=world_size, pp=pp)


def build_mesh(dims: ParallelDims, device_type: str) -> Any:
    """``init_device_mesh`` with dims (dp_replicate, dp_shard, tp), preceded by ``pp`` when
    ``dims.pp > 1``, and a flattened ``dp``.

    Needs an initialized process group (every rank calls it).
    """
    from torch.distributed.device_mesh import init_device_mesh

    pp = (dims.pp,) if dims.pp > 1 else ()
    mesh = init_device_mesh(device_type, (*pp, dims.dp_replicate, dims.dp_shard, dims.tp),
                            mesh_dim_names=(*("pp",) * len(pp), "dp_replicate", "dp_shard", "tp"))
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh


def dp_coordinates(mesh: Any) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` of this rank; ``(0, 1)`` without a mesh."""
    if mesh is None:
        return 0, 1
    dp = mesh["dp"]
    return dp.get_local_rank(), dp.size()


def pp_size(mesh: Any) -> int:
    """The pipeline degree of ``mesh`` (1 without a mesh or without a ``pp`` dim)."""
    if mesh is None or "pp" not in (mesh.mesh_dim_names or ()):
        return 1
    return mesh["pp"].size()
