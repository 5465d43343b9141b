"""Switch a model to eval mode for a while and give every submodule back its own mode.

``model.train()`` after an evaluation would put *every* submodule into training mode, also the
ones a research model keeps in eval mode on purpose (a frozen encoder, dropout or batch-norm
held fixed). :func:`eval_mode` records each submodule's ``training`` flag and
:func:`restore_modes` puts exactly those flags back; Lightning's own evaluation loop does the
same (``_ModuleMode`` in ``lightning/pytorch/loops/utilities.py``, private, hence not imported).
"""

from __future__ import annotations

from torch import nn

Modes = list[tuple[nn.Module, bool]]


def eval_mode(model: nn.Module) -> Modes:
    """Put ``model`` in eval mode; returns every submodule's previous ``training`` flag (the
    model's own included) for :func:`restore_modes`."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    return modes


def restore_modes(modes: Modes) -> None:
    """Give each submodule recorded by :func:`eval_mode` the mode it had then."""
    for module, training in modes:
        module.training = training
