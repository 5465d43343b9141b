"""The parallel styles a tensor-parallel plan gives its linear layers, as one object a model
transform can replace.

A family's plan (``ModelSpec.tp_plan``, e.g. :func:`llmforge.models.llama3.parallelize.apply_decoder_tp`)
asks :class:`TPStyles` for the style of each column-wise and row-wise linear layer and for the
input preparation of the modules whose linear layers read one gathered input (attention's
``wq``/``wk``/``wv``, the SwiGLU's ``w1``/``w3``). The default is torch's
(``ColwiseParallel``, ``RowwiseParallel``, ``PrepareModuleInput``). A transform at an earlier
stage that swaps module types can set :attr:`llmforge.plugin.ModelContext.tp_styles` to a
subclass whose styles suit the new types: the ``float8`` algorithm's gathers float8 activations
(torchao's float8 TP styles, torchtitan's default with tensorwise scaling), so the plan needs no
knowledge of any algorithm.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

__all__ = ["TPStyles"]


class TPStyles:
    """torch's tensor-parallel styles; subclass and override to change them per module."""

    def colwise(self, module: nn.Module, **kwargs: Any) -> Any:
        """The style of the column-wise (output features sharded) linear ``module``;
        ``kwargs`` are ``ColwiseParallel``'s (``input_layouts``, ``output_layouts``,
        ``use_local_output``)."""
        from torch.distributed.tensor.parallel import ColwiseParallel

        return ColwiseParallel(**kwargs)

    def rowwise(self, module: nn.Module, **kwargs: Any) -> Any:
        """The style of the row-wise (input features sharded) linear ``module``; ``kwargs`` are
        ``RowwiseParallel``'s."""
        from torch.distributed.tensor.parallel import RowwiseParallel

        return RowwiseParallel(**kwargs)

    def prepare_input(self, readers: Sequence[nn.Module], **kwargs: Any) -> Any:
        """The input preparation of a module whose linear layers ``readers`` all read the
        redistributed input (its all-gather); ``kwargs`` are ``PrepareModuleInput``'s."""
        from torch.distributed.tensor.parallel import PrepareModuleInput

        return PrepareModuleInput(**kwargs)
