"""``LLMParallelStrategy``: Lightning's ``ModelParallelStrategy`` with llmforge's 3-D mesh.

Lightning's strategy builds a 2-D (data_parallel, tensor_parallel) mesh; llmforge needs
(dp_replicate, dp_shard, tp) for HSDP, so this subclass builds that mesh instead and leaves
everything else to Lightning: process-group setup (gloo on CPU, NCCL on GPUs), cluster
environments (torchelastic, SLURM), the launcher and precision. The model itself is
parallelized by the transforms of :mod:`llmforge.parallel.transforms` in
``LLMModule.configure_model``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy
from llmforge.parallel.lightning_private import setup_strategy_mesh
from llmforge.parallel.mesh import ParallelDims, build_mesh


class LLMParallelStrategy(ModelParallelStrategy):
    """Model-parallel strategy over a (dp_replicate, dp_shard, tp) device mesh.

    Args:
        dims: the resolved parallel degrees.
        **kwargs: passed to ``ModelParallelStrategy`` (``process_group_backend``, ``timeout``).
    """

    def __init__(self, dims: ParallelDims, **kwargs: Any) -> None:
        super().__init__(data_parallel_size=dims.dp, tensor_parallel_size=dims.tp, **kwargs)
        self.dims = dims

    def setup_environment(self) -> None:
        # accelerator + cluster env and the process group, then our 3-D mesh instead of the
        # parent's 2-D one (Lightning's private attributes: parallel/lightning_private.py)
        setup_strategy_mesh(self, lambda: build_mesh(self.dims, self.root_device.type))

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp = self.device_mesh["dp"]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}
